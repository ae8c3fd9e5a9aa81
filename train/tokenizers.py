"""Text in and out of a model's token ids: UTF-8 bytes for text data, GPT-2 BPE for token shards.

`python -m sample` and the sample at the end of `python -m train` both encode and decode
here and continue the prompt with models.generate (the KV-cache decoder), so they run the
same code. Which tokenizer a model takes is what it was trained on (train.data.Dataset's
`tokenizer`, or train.data.tokenizer of the data a checkpoint records), not its vocabulary
size: a byte-level model may have more ids than the 256 bytes (--vocab-size 512).
"""

from __future__ import annotations

import itertools

import numpy as np

BYTES, GPT2 = "bytes", "gpt2"  # the tokenizers: UTF-8 bytes (text data), GPT-2 BPE (llm.c token shards)
GPT2_VOCAB = 50257  # tiktoken's "gpt2" encoding; models pad their vocabulary above it (50304)
IDS = {BYTES: 256, GPT2: GPT2_VOCAB}  # ids each tokenizer gives: a model needs at least this many
NAMES = {BYTES: "UTF-8 bytes", GPT2: "GPT-2 BPE tokens"}  # as messages say them


def for_vocab(vocab_size: int) -> str:
  """The tokenizer a vocabulary implies, for a checkpoint that does not record its data: bytes for
  vocab_size <= 256, GPT-2 BPE for vocab_size >= 50257, else ValueError."""
  if vocab_size <= IDS[BYTES]:
    return BYTES
  if vocab_size >= GPT2_VOCAB:
    return GPT2
  raise ValueError(f"no tokenizer for a vocabulary of {vocab_size}: prompts are UTF-8 bytes for vocab_size "
                   f"<= 256 and GPT-2 BPE (tiktoken) for vocab_size >= {GPT2_VOCAB}")


def missing(tokenizer: str) -> str | None:
  """What python -m sample needs to take `tokenizer`'s text that this Python lacks, as messages say it, or None:
  GPT-2 BPE needs tiktoken, bytes nothing. The trainer prints it beside the sample command it offers."""
  if tokenizer != GPT2:
    return None
  try:
    import tiktoken  # noqa: F401
  except ImportError:
    return "needs tiktoken: pip install tiktoken"
  return None


def _tiktoken():
  try:
    import tiktoken
  except ImportError:
    raise ValueError("this model was trained on GPT-2 BPE tokens: encoding a prompt needs tiktoken "
                     "(pip install tiktoken)") from None
  return tiktoken.get_encoding("gpt2")


def encode(text: str, tokenizer: str) -> np.ndarray:
  """Token ids (1-d int32) of `text` by `tokenizer` (BYTES or GPT2).

  Text from the command line that was not UTF-8 holds its bytes as lone surrogates (Python's surrogateescape):
  BYTES takes those bytes back as they were given; GPT-2 BPE, which encodes text, refuses them."""
  if tokenizer == BYTES:
    return np.frombuffer(text.encode("utf-8", errors="surrogateescape"), np.uint8).astype(np.int32)
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise ValueError(f"the prompt is not valid UTF-8 text (position {e.start}: {text[e.start:e.end]!r}), and this "
                     "model's GPT-2 BPE tokenizer encodes text: give the prompt as UTF-8") from None
  return np.asarray(_tiktoken().encode(text), np.int32)


def decode(tokens, tokenizer: str) -> str:
  """The text of `tokens` by `tokenizer`. An id the tokenizer lacks (a model may have more: GPT-2's padding to
  50304, or --vocab-size 512 on bytes) reads as U+FFFD, as bytes that are not UTF-8 do. GPT-2 tokens without
  tiktoken installed: their ids, as numbers."""
  ids = [int(t) for t in tokens]
  if tokenizer == BYTES:
    run = lambda ids: bytes(ids).decode("utf-8", errors="replace")
  else:
    try:
      run = _tiktoken().decode
    except ValueError:
      return "token ids: " + " ".join(map(str, ids))
  known = lambda i: i < IDS[tokenizer]
  return "".join(run(list(g)) if k else "\ufffd" * len(list(g)) for k, g in itertools.groupby(ids, known))
