"""Text from a trained model: temperature sampling over a sliding window, one compile."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def generate(graphdef, states: tuple, prompt: np.ndarray, *, steps: int, window: int, seed: int = 0,
             temperature: float = 0.8) -> np.ndarray:
  """Appends `steps` sampled tokens to the 1-d `prompt`; returns only the new tokens.

  `states` are the model's nnx states (parameters, and FP8 scaling state where it has one).
  """

  @jax.jit
  def next_token(states, buf, pos, key):
    # (V,): the prediction after buf[:pos]. A causal model ignores the zero padding buf[pos:];
    # a bidirectional one (causal=False) attends to it, so its samples are conditioned on it too.
    logits = nnx.merge(graphdef, *states)(buf[None])[0, pos - 1]
    return jax.random.categorical(key, logits / temperature)

  tokens = list(prompt[-window:])
  keys = jax.random.split(jax.random.key(seed), steps)
  out = []
  for key in keys:
    ctx = tokens[-window:]
    buf = jnp.zeros((window,), jnp.int32).at[:len(ctx)].set(jnp.asarray(ctx, jnp.int32))
    tok = int(next_token(states, buf, len(ctx), key))
    tokens.append(tok)
    out.append(tok)
  return np.asarray(out)


def decode(tokens: np.ndarray, vocab_size: int) -> str:
  if vocab_size <= 256:
    return bytes(np.asarray(tokens, np.uint8)).decode("utf-8", errors="replace")
  try:  # GPT-2 token shards: decode with tiktoken when it is installed
    import tiktoken
    return tiktoken.get_encoding("gpt2").decode([int(t) for t in tokens])
  except ImportError:
    return "token ids: " + " ".join(str(int(t)) for t in tokens)
