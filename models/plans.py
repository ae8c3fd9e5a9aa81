"""How the GPT's attention calls run: attnlayers.explain on shape stand-ins of the model's calls, one plan
per distinct layer window, before any work (what `auto` chose, and why a backend cannot run).

Letters: B rows, T queries per row, S keys per row (T, or a KV cache's length), N query heads, K key/value
heads, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import attnlayers
from attnlayers import kv_cache
from models.config import GPTConfig


def attention_plans(cfg: GPTConfig, batch: int, T: int, *, cache_len: int | None = None,
                    pack: bool = False) -> list[attnlayers.Plan]:
  """The plans of the model's attention calls with `batch` rows of T tokens: a training or evaluation step
  (causal over its T keys; `pack`: with segment ids), or, given `cache_len`, T new tokens per row against a
  KV cache of that length (the arguments attnlayers.kv_cache.append gives the call)."""
  dt, i32 = jnp.dtype(cfg.dtype), jnp.int32
  S = T if cache_len is None else cache_len
  q = jax.ShapeDtypeStruct((batch, T, cfg.n_head, cfg.head_dim), dt)  # (B, T, N, H)
  kv = jax.ShapeDtypeStruct((batch, S, cfg.n_kv_head or cfg.n_head, cfg.head_dim), dt)  # (B, S, K, H)
  if cache_len is not None:
    lengths = jax.ShapeDtypeStruct((batch,), i32)  # (B,)
    call = kv_cache.cached_attention(lengths, lengths)
  else:
    call = {"is_causal": cfg.causal}
    if pack:
      call["segment_ids"] = jax.ShapeDtypeStruct((batch, T), i32)  # (B, T)
      call |= {"max_segments": cfg.max_segments} if cfg.max_segments else {}
  windows = dict.fromkeys(cfg.layer_window(i) for i in range(cfg.n_layer))
  return [attnlayers.explain(cfg.backend, q, kv, kv, fp8_core=cfg.fp8_core, window=w, **call) for w in windows]


def ran(plans: list[attnlayers.Plan]) -> str:
  """The kernels the plans run on, once each: "cudnn"; layers whose windows differ: "cudnn/xla"."""
  return "/".join(dict.fromkeys(str(p.chosen) for p in plans))


def notes(plans: list[attnlayers.Plan]) -> list[str]:
  """How the plans run where the backend's name does not say it, once each (attnlayers.explain's notes): e.g.
  te-fp8 with fp8_core='fp8-or-bf16' on a head dim the FP8 core does not take runs TE's bf16 core."""
  return list(dict.fromkeys(n for p in plans for n in p.notes))
