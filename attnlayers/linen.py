"""`attnlayers.linen`: flax.linen's attention layers with grouped kv heads and a kernel choice.

`MultiHeadDotProductAttention` (and its aliases `MultiHeadAttention`, `SelfAttention`)
subclass Flax's classes: every field and call argument keeps its meaning, submodules keep
Flax's names (query, key, value, out, query_ln, key_ln; cache: cached_key, cached_value,
cache_index), so Flax's initialisation and checkpoints carry over. Added fields:

  num_kv_heads: key/value heads (None = num_heads); must divide num_heads.
  backend:      any name in attnlayers.BACKENDS (default "auto"), except "te-fp8", whose
                FP8 projections keep NNX state: use attnlayers.nnx for it.
  is_causal:    default for the call's `is_causal` (ignored in decode mode, where the
                cache makes the new queries causal).
  sliding_window: default (left, right) window of every call (attnlayers.attention's `window`);
                the call's `sliding_window=` overrides it (None there: no window).

Added call arguments: `segment_ids=` (packed documents, see attnlayers.attention),
`max_segments=` (its bound on documents per row) and `sliding_window=`.

Decoding (decode=True) on the layer's own backends uses attnlayers' cache, as attnlayers.nnx
does (attnlayers.kv_cache): `init` with a (*batch, max_length, features) input shapes it, with
cache_index (*batch,), one position per row; each call then writes T >= 1 new tokens per row
(`lengths=` (*batch,): how many are real, right-padded) and attends to the row's cache up to
them in one attention call. One-token calls compute what Flax's cache computes. A cache made by
Flax's own layer's `init` decodes too, and keeps its scalar cache_index: every call advances
all rows by T, so the cache keeps its type as an nn.scan / lax.scan carry; lengths= is refused
on it (it needs a position per row: init the cache with this layer). With a custom
attention_fn the layer decodes as Flax's does, one token per call, and its init makes Flax's
cache (one index for the batch); on a cache of the layer's own it writes each row at the row's
position and masks each row to its own tokens (all rows at one position: Flax's numbers).

The attention itself is the same `BackendAttention` the nnx layer uses, so both give the
same numbers for the same parameters; its docstring says how `force_fp32_for_softmax` and
complex inputs (which run on 'naive', as in Flax) are handled.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable

import jax.numpy as jnp
from flax import linen as nn
from jax import lax

from attnlayers import backends, kv_cache, spec
from attnlayers.flax_attention import BackendAttention


# What this module copies from Flax, all of it in the class below: flax.linen.MultiHeadDotProductAttention's
# `__call__`, as of flax 0.12.x (its linen/attention.py is the same file in 0.12.8 and 0.12.12). Flax
# builds the key/value projections with num_heads heads and checks its decode cache against the query's
# shape, so grouped kv heads cannot reuse it. Lines that differ from Flax end in "# ours"; the rest is
# Flax's logic. tests/test_linen.py fails when the installed Flax's method no longer matches these two:
FLAX_CALL_SIGNATURE = ("(self, inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None, mask=None, "
                       "deterministic=None, dropout_rng=None, sow_weights=False)")
FLAX_CALL_SOURCE_SHA256 = "fdf33c91d425a6760b2e1136f75b88443304b7ecc031e2aa5b466d4c9b977dbe"


class MultiHeadDotProductAttention(nn.MultiHeadDotProductAttention):
  """Drop-in for flax.linen.MultiHeadDotProductAttention with num_kv_heads, backend, is_causal."""
  attention_fn: Callable | None = None  # None: attnlayers' core on `backend`
  num_kv_heads: int | None = None  # None: num_heads (MHA); a divisor of num_heads: GQA; 1: MQA
  backend: str = backends.AUTO
  is_causal: bool = False
  sliding_window: tuple[int, int] | None = None  # default window=(left, right) of every call; None: no window

  def __post_init__(self):
    backends.check_name(self.backend)  # an unknown name fails where the layer is made, as the nnx layer's does
    spec.check_is_causal(self.is_causal)  # so does an is_causal that is not a bool
    super().__post_init__()

  def _attention_fn(self) -> Callable:
    backends.check_name(self.backend)
    if self.backend == "te-fp8":
      raise ValueError("backend='te-fp8' runs its projections as FP8 GEMMs whose scaling state is NNX state; "
                       "use attnlayers.nnx.MultiHeadAttention, or attnlayers.attention(..., backend='te-fp8') "
                       "for the FP8 attention core alone")
    if self.attention_fn is not None:
      if self.backend != backends.AUTO:
        raise ValueError(f"pass either attention_fn= or backend= ({self.backend!r}), not both")
      return self.attention_fn
    if self.qk_attn_weights_einsum_cls or self.attn_weights_value_einsum_cls:
      raise ValueError("qk_attn_weights_einsum_cls / attn_weights_value_einsum_cls replace the einsums of "
                       "Flax's own attention: pass attention_fn=flax.linen.dot_product_attention with them")
    return BackendAttention(self.backend)

  # ---- the copy of Flax's __call__ (flax 0.12.x), in three parts: __call__, _kv_inputs, _update_cache ----
  @nn.compact
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None, mask=None,
               deterministic: bool | None = None, dropout_rng=None, sow_weights: bool = False,
               is_causal: bool | None = None, lengths=None, segment_ids=None,
               sliding_window=spec.LAYER_DEFAULT, max_segments=None):  # ours: is_causal ... max_segments
    attention_fn = self._attention_fn()  # ours
    window = spec.check_window(self.sliding_window if sliding_window is spec.LAYER_DEFAULT else sliding_window)  # ours
    extra = {name: x for name, x in (("segment_ids", segment_ids), ("window", window), ("max_segments", max_segments))
             if x is not None}  # ours
    if extra and not isinstance(attention_fn, BackendAttention):  # ours
      raise ValueError("segment_ids= and sliding windows need the layer's own backends; a custom attention_fn "
                       "takes Flax's arguments only")
    if segment_ids is not None and self.decode:  # ours
      raise ValueError("segment_ids= with a KV cache (decode=True) is not supported: the cache keeps no segment "
                       "ids; decode each document in its own row (lengths= gives each row its own length)")
    if lengths is not None and not self.decode:  # ours
      raise ValueError("lengths= counts the new tokens of a decode call; it needs decode=True")
    inputs_k, inputs_v = self._kv_inputs(inputs_q, inputs_k, inputs_v, inputs_kv)
    features = self.out_features or inputs_q.shape[-1]
    qkv_features = self.qkv_features or inputs_q.shape[-1]
    spec.check_num_heads(self.num_heads)  # ours: Flax's modulo below divides by it
    spec.check_num_kv_heads(self.num_kv_heads)  # ours
    num_kv_heads = self.num_kv_heads or self.num_heads  # ours
    if qkv_features % self.num_heads:
      raise ValueError(f"Memory dimension ({qkv_features}) must be divisible by number of heads ({self.num_heads}).")
    if self.num_heads % num_kv_heads:  # ours
      raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({num_kv_heads}).")
    if self.attention_fn is nn.dot_product_attention and num_kv_heads != self.num_heads:  # ours: its assert, said
      raise ValueError(f"flax.linen.dot_product_attention takes as many key/value heads as query heads; got "
                       f"num_kv_heads ({num_kv_heads}) < num_heads ({self.num_heads}). Leave attention_fn out (the "
                       "layer's backends take grouped heads) or pass flax.nnx.dot_product_attention, which does too")
    head_dim = qkv_features // self.num_heads
    dense = functools.partial(
        nn.DenseGeneral, axis=-1, dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=self.kernel_init, bias_init=self.bias_init, use_bias=self.use_bias,
        precision=self.precision, dot_general=self.qkv_dot_general, dot_general_cls=self.qkv_dot_general_cls)
    query = dense(features=(self.num_heads, head_dim), name="query")(inputs_q)  # (batch..., T, N, H)
    key = dense(features=(num_kv_heads, head_dim), name="key")(inputs_k)  # (batch..., S, K, H)  ours: K
    value = dense(features=(num_kv_heads, head_dim), name="value")(inputs_v)  # (batch..., S, K, H)  ours: K
    if self.normalize_qk:
      ln = functools.partial(nn.LayerNorm, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype)
      query, key = ln(name="query_ln")(query), ln(name="key_ln")(key)

    causal = self.is_causal if is_causal is None else is_causal  # ours
    attend = {}  # ours: the arguments of a decode call on attnlayers' cache
    if self.decode and isinstance(attention_fn, BackendAttention):  # ours: T >= 1 tokens, a position per row
      key, value, attend = self._append_to_cache(query, key, value, lengths)
      causal = False
    elif self.decode:
      if lengths is not None or (query.shape[-3] != 1 and self.has_variable("cache", "cached_key")):  # ours
        raise ValueError("with a custom attention_fn the cache decodes one token per call, as Flax's does; "
                         "chunked prefill and lengths= need the layer's own backends")
      key, value, mask = self._update_cache(key, value, mask)
      causal = False  # ours: the cache mask limits the new query to positions <= its own

    if self.dropout_rate > 0.0:
      deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
      if not deterministic and dropout_rng is None:
        dropout_rng = self.make_rng("dropout")
    else:
      deterministic = True
    kwargs = dict(mask=mask, dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
                  broadcast_dropout=self.broadcast_dropout, deterministic=deterministic, dtype=self.dtype,
                  precision=self.precision, force_fp32_for_softmax=self.force_fp32_for_softmax,
                  qk_attn_weights_einsum=self.qk_attn_weights_einsum_cls() if self.qk_attn_weights_einsum_cls else None,
                  attn_weights_value_einsum=(self.attn_weights_value_einsum_cls()
                                             if self.attn_weights_value_einsum_cls else None))
    accepted = inspect.signature(attention_fn).parameters
    kwargs = {k: v for k, v in kwargs.items() if k in accepted}  # custom attention_fns get what they take
    if causal:  # ours
      if "is_causal" not in accepted:
        raise ValueError("is_causal=True, but the custom attention_fn takes no is_causal argument")
      kwargs["is_causal"] = True
    if sow_weights:
      kwargs["module"] = self
    kwargs |= attend | extra  # ours
    x = attention_fn(query, key, value, **kwargs)  # (batch..., T, N, H)
    return nn.DenseGeneral(
        features=features, axis=(-2, -1), kernel_init=self.out_kernel_init or self.kernel_init,
        bias_init=self.out_bias_init or self.bias_init, use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, precision=self.precision, dot_general=self.out_dot_general,
        dot_general_cls=self.out_dot_general_cls, name="out")(x)  # (batch..., T, features)

  @staticmethod
  def _kv_inputs(inputs_q, inputs_k, inputs_v, inputs_kv):
    """Flax's defaults for k/v inputs, the deprecated inputs_kv, and its warning for a mask passed as inputs_v."""
    if inputs_kv is not None:
      if inputs_k is not None or inputs_v is not None:
        raise ValueError("If either `inputs_k` or `inputs_v` is not None, `inputs_kv` must be None; "
                         "prefer `inputs_k` and `inputs_v`.")
      warnings.warn("The inputs_kv arg will be deprecated soon. Use inputs_k and inputs_v instead.",
                    DeprecationWarning)
      return inputs_kv, inputs_kv
    if inputs_k is None:
      if inputs_v is not None:
        raise ValueError("`inputs_k` cannot be None if `inputs_v` is not None. To have both be the same "
                         "value, pass it to `inputs_k` and leave `inputs_v` as None.")
      inputs_k = inputs_q
    if inputs_v is None:
      return inputs_k, inputs_k
    if inputs_v.shape[-1] == inputs_v.shape[-2]:
      warnings.warn(
          f"You are passing an array of shape {inputs_v.shape} to the `inputs_v` arg, when you may have "
          "intended to pass it to the `mask` arg. As of Flax version 0.7.4, the function signature of "
          "MultiHeadDotProductAttention's `__call__` method has changed to `__call__(inputs_q, inputs_k=None, "
          "inputs_v=None, *, inputs_kv=None, mask=None, deterministic=None)`. Use the kwarg `mask` instead. "
          "See https://github.com/google/flax/discussions/3389 and read the docstring for more information.",
          DeprecationWarning)
    return inputs_k, inputs_v

  def _append_to_cache(self, query, key, value, lengths):  # ours
    """attnlayers' cache (see attnlayers.kv_cache): writes the call's T tokens at each row's position.

    The init pass creates the cache in the shape of its (*batch, max_length) input, as Flax's
    does, but with cache_index (*batch,), one position per row; it attends over that input. A
    cache from Flax's own init keeps its scalar cache_index (kv_cache.append).
    Returns the whole cache and the attention arguments that read it (bottom-right causal).
    """
    is_initialized = self.has_variable("cache", "cached_key")
    if not is_initialized:  # ours
      kv_cache.check_length(key.shape[-3], kv_cache.LINEN_SIZE)
    cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
    cache_index = self.variable("cache", "cache_index", lambda: jnp.zeros(key.shape[:-3], jnp.int32))
    if not is_initialized:
      if lengths is not None:
        raise ValueError("lengths= applies once the cache exists: the init pass only shapes it")
      return key, value, {}
    if query.shape[:-2] != key.shape[:-2]:
      raise ValueError(f"the queries ({tuple(query.shape)}) and keys ({tuple(key.shape)}) of a decode call must "
                       "share (*batch, T): T new tokens per row")
    cached_key.value, cached_value.value, cache_index.value, attend = kv_cache.append(
        cached_key.value, cached_value.value, cache_index.value, key, value, lengths, kv_cache.LINEN_SIZE)
    return cached_key.value, cached_value.value, attend

  def _update_cache(self, key, value, mask):
    """Writes this step's k/v into the cache; returns the whole cache and its position mask. On the layer's own
    cache (cache_index (*batch,)) each row's token goes to its row's position (kv_cache.append), and the mask,
    (*batch, 1, 1, max_length), lets each row see its own positions up to the new one."""
    is_initialized = self.has_variable("cache", "cached_key")
    if not is_initialized:  # ours
      kv_cache.check_length(key.shape[-3], kv_cache.LINEN_SIZE)
    cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
    cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, dtype=jnp.int32))
    if not is_initialized:  # init pass: the cache takes the shape of the (B, max_length) input
      return key, value, mask
    *batch_dims, max_length, num_kv_heads, depth = cached_key.value.shape
    expected = (*batch_dims, 1, num_kv_heads, depth)
    if key.shape != expected:  # ours: Flax compares the query's shape, which has num_heads heads
      raise ValueError(f"Autoregressive cache shape error, expected key shape {expected} instead got {key.shape}.")
    index = cache_index.value
    if index.ndim:  # ours: the layer's own cache (its init without attention_fn), (*batch,): a position per row
      cached_key.value, cached_value.value, cache_index.value, _ = kv_cache.append(
          cached_key.value, cached_value.value, index, key, value, None, kv_cache.LINEN_SIZE)  # ours
      seen = (jnp.arange(max_length) < cache_index.value[..., None])[..., None, None, :]  # ours: (*batch, 1, 1, L)
      return cached_key.value, cached_value.value, seen if mask is None else nn.combine_masks(mask, seen)  # ours
    kv_cache.check_flax_room(index, tuple(batch_dims), max_length, kv_cache.LINEN_SIZE)  # ours: before Flax's write
    zero = jnp.array(0, dtype=lax.dtype(index.dtype))
    at = (zero,) * len(batch_dims) + (index, zero, zero)
    cached_key.value = lax.dynamic_update_slice(cached_key.value, key, at)
    cached_value.value = lax.dynamic_update_slice(cached_value.value, value, at)
    cache_index.value = index + 1
    seen = jnp.broadcast_to(jnp.arange(max_length) <= index, (*batch_dims, 1, 1, max_length))
    mask = seen if mask is None else nn.combine_masks(mask, seen)
    return cached_key.value, cached_value.value, mask
  # ---- end of the copy of Flax's __call__ ----


class MultiHeadAttention(MultiHeadDotProductAttention):
  """Alias of MultiHeadDotProductAttention under Flax's other name (auto-named MultiHeadAttention_i)."""


class SelfAttention(MultiHeadDotProductAttention):
  """Self-attention form of MultiHeadDotProductAttention, with Flax's call signature."""

  @nn.compact
  def __call__(self, inputs_q, mask=None, deterministic: bool | None = None, dropout_rng=None,  # type: ignore[override]
               sow_weights: bool = False, is_causal: bool | None = None, lengths=None, segment_ids=None,
               sliding_window=spec.LAYER_DEFAULT, max_segments=None):
    return super().__call__(inputs_q, mask=mask, deterministic=deterministic, dropout_rng=dropout_rng,
                            sow_weights=sow_weights, is_causal=is_causal, lengths=lengths, segment_ids=segment_ids,
                            sliding_window=sliding_window, max_segments=max_segments)
