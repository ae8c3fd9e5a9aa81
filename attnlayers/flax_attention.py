"""`BackendAttention`: a Flax `attention_fn` that runs attnlayers' core on a chosen backend.

Flax's attention layers (nnx and linen) call `attention_fn(query, key, value, mask=...,
dropout_rng=..., module=..., ...)` with `[batch..., length, heads, head_dim]` arrays and
Flax-style masks (any dtype, nonzero = attend). This adapter is the one place that maps
that convention onto `attnlayers.attention`: it flattens extra batch dims, turns the mask
to bool, and asks for the weights only when Flax wants to sow them or drop them out. Both
attnlayers.nnx and attnlayers.linen use it; it also works as `attention_fn=` of Flax's own
classes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnlayers import backends, spec
from attnlayers.core import attention


def _flatten_batch(x, batch: tuple[int, ...]):
  """(*batch, A, B, C) -> (prod(batch), A, B, C); a no-op for one batch dim."""
  return x.reshape((math.prod(batch), *x.shape[-3:]))


def _flatten_ids(ids, batch: tuple[int, ...]):
  """Segment ids (*batch, L), or a pair of them, with the batch dims flattened to one: (B, L)."""
  if ids is None:
    return None
  if isinstance(ids, (tuple, list)):
    return tuple(_flatten_ids(x, batch) for x in ids)
  if not hasattr(ids, "ndim"):  # not an array (a nested list): attnlayers.attention says what it takes
    return ids
  return ids.reshape((math.prod(batch), ids.shape[-1])) if ids.ndim == len(batch) + 1 else ids


def _mask_4d(x, batch: tuple[int, ...]):
  """A mask/bias broadcastable to (*batch, N, T, S) -> one broadcastable to (B, N, T, S)."""
  x = x.reshape((1,) * (len(batch) + 3 - x.ndim) + x.shape)  # (*batch or 1s, N|1, T|1, S|1)
  if len(batch) == 1:
    return x
  return _flatten_batch(jnp.broadcast_to(x, batch + x.shape[-3:]), batch)


def _check_mask_shape(name: str, x, full: tuple[int, ...]) -> None:
  """A Flax mask or bias must broadcast to full = (*batch, N, T, S); the error names the caller's shape (the core's
  would name it after _mask_4d has padded it) and the heads axis that a (*batch, T, S) mask lacks."""
  n = len(full) - 3  # batch dims
  dims = (("batch",) if n == 1 else tuple(f"batch[{i}]" for i in range(n))) + ("num_heads", "q_length", "kv_length")
  with_heads = x.shape[:-2] + (1,) + x.shape[-2:]  # the shape with a heads axis, where x lacks one
  hint = (f"; it reads as a (*batch, q_length, kv_length) {name}, and Flax's attention takes a heads axis before "
          f"q_length too: pass {name}[..., None, :, :]") \
      if len(with_heads) == len(full) and all(a in (1, b) for a, b in zip(with_heads, full)) else ""
  spec.check_broadcast(name, x.shape, full, dims, hint)


def _sow(module, weights) -> None:
  """Sows the weights where Flax's own attention does, without Module.sow()'s deprecation warning.

  Inside nnx.capture() (Flax's supported capture API) and for linen, the module's own sow. Elsewhere
  it stores what nnx's Module.sow() stores outside capture in flax 0.12.8-0.12.10 (a tuple in an
  nnx.Intermediate attribute that grows by one per call), so `nnx.state(layer, nnx.Intermediate)`
  reads as it does for flax.nnx.MultiHeadAttention(sow_weights=True).
  """
  if not isinstance(module, nnx.Module):  # linen
    module.sow("intermediates", "attention_weights", weights)
  elif hasattr(module, "__captures__"):  # inside nnx.capture()
    module.sow(nnx.Intermediate, "attention_weights", weights)
  else:
    sown = getattr(module, "attention_weights", None)
    if sown is None:
      module.attention_weights = nnx.Intermediate((weights,))
    else:
      sown.set_value((*sown.get_value(), weights))


def _flax_mask(mask):
  """Flax's mask (nonzero = may attend) as bool, and for a traced float mask a flag that it held only 0 and 1.

  A float mask must hold only 0 (masked) and 1 (attend): an additive mask (0 / -inf, as PyTorch
  takes) read as nonzero-attends would be inverted. The error names what works from a layer, which
  takes no bias=: the boolean mask (additive_mask == 0), or attnlayers.attention's bias=. A concrete one is checked now; a traced one
  cannot raise, so where it holds other values the call's output is NaN (the flag returned).
  """
  if not jnp.issubdtype(mask.dtype, jnp.inexact):
    return mask.astype(jnp.bool_), None
  if isinstance(mask, jax.core.Tracer):
    return mask != 0, jnp.all((mask == 0) | (mask == 1))
  values = np.asarray(mask)  # concrete, also where a jit closes over it: checked in numpy (jnp would be traced there)
  if not np.all((values == 0) | (values == 1)):
    other = sorted({float(x) for x in np.unique(values) if x not in (0, 1)})[:3]
    raise ValueError(f"a {mask.dtype} mask must hold only 0 (masked) and 1 (may attend), Flax's convention; it holds "
                     f"{', '.join(map(str, other))}. For an additive mask (0 where allowed, -inf where not, as PyTorch "
                     "takes) pass the boolean mask it stands for, mask=(additive_mask == 0) (True = may attend); the "
                     "layers take no bias=, so an additive bias of other values needs the functional core, "
                     "attnlayers.attention(q, k, v, bias=...).")
  return mask != 0, None


@dataclasses.dataclass(frozen=True)
class BackendAttention:
  """attention_fn for Flax layers; `backend` is any name in attnlayers.BACKENDS.

  Flax's `precision` reaches the attention core too (as in Flax's own attention), so a
  backend that cannot apply it refuses the call and `auto` picks one that can.

  Softmax: every backend computes it in float32 (complex64 for complex inputs), or in float64
  for float64 inputs (complex128 for complex128; 'naive' only), whatever
  `force_fp32_for_softmax` says. Where Flax's own attention, given False, runs it in the
  compute dtype (bfloat16, float16), ours is at least as precise; the fused kernels (cudnn,
  te, te-fp8, xla) run that float32 softmax for both values of the flag.

  What the flag still decides, as in Flax, is the dtype of the weights after the softmax on
  the path that materialises them (sow_weights, or dropout; only 'naive' runs it):
    True:  the weights stay float32: sown as float32 and multiplied into v in float32. For
           fp16/bf16 inputs that path runs on float32 copies of q/k/v, which is exact (the
           upcast loses nothing, and naive accumulates scores in float32 for every dtype),
           so only the weights and their product with v change dtype.
    False: the weights are rounded to the compute dtype, then sown and multiplied into v.
  Off that path a kernel rounds its float32 probabilities to the compute dtype before
  multiplying them into v even when the flag is True (Flax keeps float32 there), so its
  output may differ from Flax's by that one rounding.

  Complex inputs run on 'naive' only (`auto` picks it): jax.nn.softmax of the complex scores,
  as Flax's attention computes it where it builds the weights (linen's always; nnx's with
  sow_weights or a dropout_rate). Flax's nnx attention without them calls
  jax.nn.dot_product_attention, and linen's with force_fp32_for_softmax=True casts the scores
  to float32: both drop their imaginary part (jax warns that this cast will become an error).
  Here the first keeps the complex softmax (README: where the layers differ from Flax's), and
  the second raises a ValueError.
  """
  backend: str = backends.AUTO
  fp8_core: str = "fp8"  # te-fp8 only: how its attention core runs (attnlayers.spec.FP8_CORE_MODES)

  def __post_init__(self):
    backends.check_name(self.backend)

  def __call__(self, query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
               dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False, dtype=None,
               precision=None, module=None, is_causal: bool = False, force_fp32_for_softmax: bool = False,
               query_seq_lengths=None, key_value_seq_lengths=None, segment_ids=None, **options):
    """Flax's attention_fn arguments, plus attnlayers.attention's that the layers pass.

    Args:
      query_seq_lengths, key_value_seq_lengths: int, shaped like the batch dims.
      segment_ids: int (*batch, T), or a pair with (*batch, S).
      **options: attnlayers.attention's other keyword arguments (causal_alignment, window, ...), passed on
        as they are.
    """
    dtype = jnp.dtype(dtype or jnp.result_type(query, key, value))
    dropping = dropout_rate > 0.0 and not deterministic
    if force_fp32_for_softmax and dtype.kind == "c":
      raise ValueError(f"force_fp32_for_softmax=True with {dtype.name} inputs: Flax casts the complex scores to "
                       "float32 there, dropping their imaginary part; pass force_fp32_for_softmax=False, and the "
                       f"softmax runs on the complex scores in {'complex128' if dtype == jnp.complex128 else 'complex64'}")
    if force_fp32_for_softmax and (module is not None or dropping) and dtype.itemsize < 4:
      dtype = jnp.dtype(jnp.float32)  # Flax's float32 weights, computed exactly: see the class docstring
    batch = query.shape[:-3]  # (batch...)
    if not key.shape[:-3] == value.shape[:-3] == batch:  # else flattening would pair rows wrongly, or fail deep in jax
      raise ValueError(f"query, key and value batch dims must match, as in Flax: query {query.shape}, key {key.shape}, "
                       f"value {value.shape} ((*batch, length, heads, head_dim)) have batch dims {batch}, "
                       f"{key.shape[:-3]}, {value.shape[:-3]}; give inputs_k and inputs_v the batch dims of inputs_q")
    query, key, value = (x.astype(dtype) for x in (query, key, value))
    q, k, v = (_flatten_batch(x, batch) for x in (query, key, value))  # (B, T, N, H), (B, S, K, H)
    full = (*batch, query.shape[-2], query.shape[-3], key.shape[-3])  # (*batch, N, T, S)
    for name, x in (("mask", mask), ("bias", bias)):
      if x is not None and hasattr(x, "shape"):
        _check_mask_shape(name, x, full)
    binary = None  # for a traced float mask: whether it held only 0 and 1
    if mask is not None:
      mask, binary = _flax_mask(_mask_4d(mask, batch))
    if bias is not None:
      bias = _mask_4d(bias, batch)
    result = attention(
        q, k, v, backend=self.backend, is_causal=is_causal, mask=mask, bias=bias,
        dropout_rate=dropout_rate if dropping else 0.0, dropout_rng=dropout_rng if dropping else None,
        broadcast_dropout=broadcast_dropout, precision=precision, return_weights=module is not None,
        fp8_core=self.fp8_core,
        query_seq_lengths=None if query_seq_lengths is None else query_seq_lengths.reshape(-1),  # (B,)
        key_value_seq_lengths=None if key_value_seq_lengths is None else key_value_seq_lengths.reshape(-1),
        segment_ids=_flatten_ids(segment_ids, batch), **options)
    out, weights = result if module is not None else (result, None)
    if binary is not None:
      out = jnp.where(binary, out, jnp.nan)  # a traced float mask with values other than 0/1: see _flax_mask
    if module is not None:
      _sow(module, weights.reshape(batch + weights.shape[1:]))  # (batch..., N, T, S)
    return out.reshape(query.shape[:-1] + value.shape[-1:])  # (batch..., T, N, H)
