"""Text in and out of a model's token ids: UTF-8 bytes for a byte vocabulary, GPT-2 BPE above.

`python -m sample` and the sample at the end of `python -m train` both encode and decode
here and continue the prompt with models.generate (the KV-cache decoder), so they run the
same code.
"""

from __future__ import annotations

import numpy as np

GPT2_VOCAB = 50257  # tiktoken's "gpt2" encoding; models pad their vocabulary above it (50304)


def encode(text: str, vocab_size: int) -> np.ndarray:
  """Token ids (1-d int32) of `text`: UTF-8 bytes for a byte vocabulary (<= 256), else GPT-2's BPE."""
  if vocab_size <= 256:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
  if vocab_size < GPT2_VOCAB:
    raise ValueError(f"no tokenizer for a vocabulary of {vocab_size}: prompts are UTF-8 bytes for vocab_size "
                     f"<= 256 and GPT-2 BPE (tiktoken) for vocab_size >= {GPT2_VOCAB}")
  try:
    import tiktoken
  except ImportError:
    raise ValueError(f"this model's vocabulary ({vocab_size} ids) is GPT-2's BPE: encoding a prompt needs "
                     "tiktoken (pip install tiktoken)") from None
  return np.asarray(tiktoken.get_encoding("gpt2").encode(text), np.int32)


def decode(tokens: np.ndarray, vocab_size: int) -> str:
  if vocab_size <= 256:
    return bytes(np.asarray(tokens, np.uint8)).decode("utf-8", errors="replace")
  try:  # GPT-2 token shards: decode with tiktoken when it is installed
    import tiktoken
    return tiktoken.get_encoding("gpt2").decode([int(t) for t in tokens if t < GPT2_VOCAB])
  except ImportError:
    return "token ids: " + " ".join(str(int(t)) for t in tokens)

