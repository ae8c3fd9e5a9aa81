"""te-fp8's FP8 attention core with delayed scaling: q/k/v scales from an amax history.

Current scaling (_fp8_core.attention) must find max|q|, max|k|, max|v| before it can quantise
them: a whole extra read of q, k and v ahead of the kernel. Here each scale comes from the amaxes
of earlier steps, as TransformerEngine's DelayedScaling scales its GEMMs, so a tensor is
quantised in the same pass that measures its amax (XLA fuses the two, and in a layer into
the q/k/v projection's bias add); the amax measured now goes into the history.

State: `history` (3, L) float32, rows q, k, v, column 0 the latest step. The layer keeps it
as an FP8Meta (attnlayers.fp8) and it advances the way TE's own FP8 state does: the gradient
jax.grad returns for the history *is* the next history (this call's amaxes rolled in), so a
training step that assigns its FP8Meta gradients (train/step.py) advances it, and a forward
alone leaves it as it was. As for TE's state, that needs one differentiated call per history
per step: jax adds the cotangents of several uses (a layer applied twice in one loss, or
under jax.vmap with one history), which would add next-histories; and a history no call
used (fp8_core="fp8-or-bf16" running the bf16 kernel) gets a zero gradient, so it stays empty.

Scales, the numerics rule of _fp8_core with the history's max in place of the current amax:
  q, k, v  scale = the largest power of two with max(history row) * scale <= 448; 1 while the
           row is all zero (nothing measured yet), as TE starts. A value beyond 448 / scale
           (an amax that grew past its history) saturates to +-448 rather than becoming NaN.
           Dequantising is exact (scales are powers of two).
  O        |O| <= max|v as quantised| <= 448 / scale_v, so scale_o = scale_v / 2 as before.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from attnlayers.backends._fp8_core import E4M3, E4M3_MAX, pow2_scale, quantized_backward, quantized_forward


def scales_from(history):
  """(3, L) amax history -> (3,) float32 scales: powers of two, max(row) * scale <= 448; 1 for an all-zero row."""
  amax = jnp.max(history, axis=1)  # (3,)
  return jnp.where(amax > 0, pow2_scale(amax), 1.0).astype(jnp.float32)


def quantize(x, scale):
  """x * scale in E4M3, saturated at +-448, and max|x| (float32, for the history); one pass over x."""
  y = jnp.clip(x.astype(jnp.float32) * scale, -E4M3_MAX, E4M3_MAX).astype(E4M3)  # float32: fp16 cannot hold every 2^n
  return y, jnp.max(jnp.abs(x)).astype(jnp.float32)


def roll(history, amax):
  """The next history: this call's (3,) amaxes in column 0, the oldest column dropped. A non-finite amax (an
  inf or NaN in q, k or v) enters as 0, "nothing measured", so the row's scale comes from its other steps
  instead of being 0 for L steps (train/loop.py stops a run at its first non-finite loss anyway)."""
  amax = jnp.where(jnp.isfinite(amax), amax, 0.0)  # (3,)
  return jnp.concatenate([amax[:, None], history[:, :-1]], axis=1)  # (3, L)


def _attention_fwd(q, k, v, history, scale, is_causal):
  scales = scales_from(history)  # (3,)
  (q8, aq), (k8, ak), (v8, av) = (quantize(x, s) for x, s in zip((q, k, v), scales))
  out, stats = quantized_forward(q8, k8, v8, tuple(scales), q.dtype, scale=scale, is_causal=is_causal)
  return out, (q8, k8, v8, scales, out, stats, roll(history, jnp.stack([aq, ak, av])))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def attention(q, k, v, history, scale: float, is_causal: bool):
  """FP8 attention, delayed scaling: q (B, T, N, H), k/v (B, S, K, H) in bf16/fp16, history (3, L) float32
  -> (B, T, N, H) in q's dtype. The history's gradient is its next value (module docstring)."""
  return _attention_fwd(q, k, v, history, scale, is_causal)[0]


def _attention_bwd(scale, is_causal, residuals, dout):
  q8, k8, v8, scales, out, stats, next_history = residuals
  dq, dk, dv = quantized_backward(q8, k8, v8, tuple(scales), out, stats, dout, scale=scale, is_causal=is_causal)
  return dq, dk, dv, next_history


attention.defvjp(_attention_fwd, _attention_bwd)
