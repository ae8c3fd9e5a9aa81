"""Splash attention: JAX's Pallas kernels for TPU (`jax.experimental.pallas.ops.tpu.splash_attention`).

Flash attention in blocks, forward and backward, skipping the blocks its mask leaves empty. That mask is
structure, made into block tables on the host (numpy) once per shape and mask (`_kernel`, cached): what one
offset for every row expresses, causality (top-left, or bottom-right at S - T) and a window (left, right).
Segment ids and lengths reach the kernel as its segment ids, compared per element: a padding query (id 0,
or past its row's length) gets -1, a padding key -2, equal to nothing real. `_masks.finish` zeroes the
queries left with no key (the kernel gives them an average of values, or NaN for a query block with no key
block), and so their gradients. The kernel does not scale q: run() scales it in float32, rounding once.
The K key/value heads go in as they are, each serving N // K query heads (no repeated K/V), one batch row
per kernel call (vmapped over B).

What the kernel needs (`unmet`): a TPU; bfloat16 q/k/v; T and S multiples of LANES, which every block size
is; its mask from structure, so no mask= or bias= array, and bottom-right causality only without per-row
lengths (their offset differs per row); no dropout, weights or precision. Any head dim: it pads its lanes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from attnlayers.backends import _masks, _reasons
from attnlayers.spec import Call

NAME = "splash"
SUMMARY = "Pallas splash attention (jax.experimental.pallas.ops.tpu); TPU, bfloat16, T and S multiples of 128"
MIN_CC = None  # no NVIDIA GPU: unmet() asks for a TPU

LANES = 128  # every block size is a multiple of this, so T and S must be

# The block table, chosen by measurement on a TPU v5e (benchmarks/splash_blocks.py; its results are in
# benchmarks/results/tpu-v5e/): each block is the largest of its candidates that divides the length it tiles (T for
# query blocks, S for key blocks). 2048 does not fit the kernels' VMEM there.
Q_BLOCKS = (1024, 512, 256, 128)  # queries per block, forward and backward
KV_BLOCKS = (1024, 512, 256, 128)  # keys per block, forward and backward
KV_COMPUTE_BLOCKS = (1024, 512, 256, 128)  # keys per inner step of a key block (dividing it)
FUSED_BACKWARD = True  # dq inside the dk/dv kernel rather than a kernel of its own

# Private: tests set this (with pytest's monkeypatch) to run the kernels in Pallas's interpreter on any device,
# a CPU included, where unmet() would refuse them. Slow; nothing in attnlayers sets it.
_INTERPRET = False


@dataclasses.dataclass(frozen=True)
class Blocks:
  """The kernel's tile sizes (splash_attention_kernel.BlockSizes), the same in the forward and backward kernels."""
  q: int  # block_q, block_q_dkv, block_q_dq
  kv: int  # block_kv, block_kv_dkv, block_kv_dq
  kv_compute: int  # block_kv_compute, block_kv_dkv_compute: divides kv
  fused_backward: bool  # use_fused_bwd_kernel


def _largest(candidates: tuple[int, ...], n: int) -> int:
  return next((c for c in candidates if n % c == 0), candidates[-1])


def blocks(T: int, S: int) -> Blocks:
  """The block table's sizes for T queries and S keys (multiples of LANES)."""
  kv = _largest(KV_BLOCKS, S)
  return Blocks(_largest(Q_BLOCKS, T), kv, _largest(KV_COMPUTE_BLOCKS, kv), FUSED_BACKWARD)


@dataclasses.dataclass(frozen=True)
class Decision:
  """How run() hands a call to the kernel; everything but segment_ids keys the cached kernel."""
  mask: str  # the kernel's static mask: "full", "causal" (s <= p) or "local" (the window)
  offset: int  # p - t, a query's position against the keys: S - T bottom-right, else 0
  window: tuple[int | None, int | None] | None  # "local": (left, right), None for a side that reaches every key
  segment_ids: bool  # the kernel compares ids: the call's segment ids, its lengths, or both
  blocks: Blocks
  interpret: bool  # Pallas's interpreter (_INTERPRET)


def decide(call: Call) -> Decision:
  """The static mask of the call's causality and window at its one offset, and the block table's sizes. A side
  of the window that reaches every key is None; with causality the right side is cut at p."""
  reach = call.T + call.S  # |p - s| < reach for every query and key
  side = lambda n: None if n is None or n >= reach else n
  left, right = (None, None) if call.window is None else call.window
  left, right = side(left), 0 if call.is_causal else side(right)
  kinds = {(None, None): "full", (None, 0): "causal"}  # the windows that are another mask
  mask = kinds.get((left, right), "local")
  return Decision(mask, call.S - call.T if call.bottom_right else 0, (left, right) if mask == "local" else None,
                  call.segments or call.has_lengths, blocks(call.T, call.S), _INTERPRET)


@functools.cache
def _kernel_modules():
  """(splash_attention_kernel, splash_attention_mask), or None where this jax has no splash kernels."""
  try:
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel, splash_attention_mask
  except ImportError:
    return None
  return splash_attention_kernel, splash_attention_mask


def unmet(call: Call) -> list[str]:
  reasons = []
  if call.device.platform != "tpu" and not _INTERPRET:
    reasons.append(f"splash runs JAX's Pallas kernels for TPU; the call's device is {call.device.describe()} "
                   "(use backend='xla' or 'naive' there, 'cudnn' or 'te' on an NVIDIA GPU)")
  elif _kernel_modules() is None:
    reasons.append(f"jax {jax.__version__} has no splash attention (jax.experimental.pallas.ops.tpu."
                   "splash_attention); use backend='xla'")
  if call.dtype != np.dtype(jnp.bfloat16):
    reasons.append(_reasons.Reason(
        f"splash runs bfloat16 q/k/v (its kernels' matmul type); got {call.dtype.name} (cast the inputs, e.g. the "
        "layer's dtype=jnp.bfloat16, or use backend='xla')", "dtype", "bfloat16"))
  if call.T % LANES or call.S % LANES:
    reasons.append(f"splash tiles queries and keys in blocks of a multiple of {LANES} that divide T and S; got "
                   f"T={call.T}, S={call.S} (pad the rows to a multiple of {LANES}, marking the padding with "
                   "query_seq_lengths/key_value_seq_lengths or segment id 0, or use backend='xla', which runs any "
                   "length, a one-token decode step included)")
  if call.mask_shape is not None or call.bias_shape is not None:
    reasons.append("splash builds its mask on the host from the call's structure (causality, window, segment ids, "
                   "lengths) and takes no mask= or bias= array; use backend='xla' for them")
  if call.bottom_right and call.has_lengths:
    reasons.append("splash places its causal mask at one offset for every row; bottom-right causality with per-row "
                   "lengths (a KV cache's prefill and decode steps) needs one per row: use backend='xla' (auto "
                   "picks it)")
  return reasons + _reasons.fused_only(call, NAME, exact_half_products=False)


def notes(call: Call, decision: Decision) -> list[str]:
  b = decision.blocks
  backward = "dq in the dk/dv kernel" if b.fused_backward else "dq and dk/dv kernels of their own"
  mask = {"full": "no mask", "causal": "causal", "local": f"window (left, right) = {decision.window}"}[decision.mask]
  ids = "; segment ids " + " and ".join(what for what, on in (("of the call", call.segments),
                                                             ("from the lengths", call.has_lengths)) if on)
  return [f"splash blocks: q {b.q}, kv {b.kv}, kv_compute {b.kv_compute} (forward and backward; {backward}); "
          f"mask: {mask} at offset {decision.offset}" + (ids if decision.segment_ids else "")
          + ("; Pallas interpreter" if decision.interpret else "")]


@functools.lru_cache(maxsize=64)
def _kernel(T: int, S: int, N: int, mask: str, offset: int, window, sizes: Blocks, interpret: bool):
  """The kernel for one shape and mask, its block tables built once (host numpy) and kept: made as concrete
  arrays even where the first call is traced (a traced one kept here would leak out of that trace)."""
  sk, sm = _kernel_modules()
  if mask == "causal":
    head = sm.CausalMask((T, S), offset=offset)
  elif mask == "local":
    head = sm.LocalMask((T, S), window_size=window, offset=offset)
  else:
    head = sm.FullMask((T, S))
  dq = {} if sizes.fused_backward else dict(block_q_dq=sizes.q, block_kv_dq=sizes.kv)
  block_sizes = sk.BlockSizes(block_q=sizes.q, block_kv=sizes.kv, block_kv_compute=sizes.kv_compute,
                              block_q_dkv=sizes.q, block_kv_dkv=sizes.kv, block_kv_dkv_compute=sizes.kv_compute,
                              use_fused_bwd_kernel=sizes.fused_backward, **dq)
  with jax.ensure_compile_time_eval():
    return sk.make_splash_mha(sm.MultiHeadMask([head] * N), block_sizes=block_sizes, head_shards=1,
                              q_seq_shards=1, interpret=interpret)


def _segment_ids(call: Call):
  """(q (B, T), kv (B, S)) int32 ids for the kernel, which attends equal ids: the call's (1 without), -1 for a
  padding query and -2 for a padding key (id 0, or past the row's length), which equal nothing real."""
  B, T, S = call.B, call.T, call.S
  q_ids, kv_ids = _masks.segment_ids(call) if call.segments else (jnp.ones((B, T), jnp.int32),
                                                                    jnp.ones((B, S), jnp.int32))
  q_len, kv_len = _masks.lengths(call)
  real_q = (q_ids != 0) & (jnp.arange(T)[None, :] < q_len[:, None])  # (B, T)
  real_kv = (kv_ids != 0) & (jnp.arange(S)[None, :] < kv_len[:, None])  # (B, S)
  return jnp.where(real_q, q_ids, -1), jnp.where(real_kv, kv_ids, -2)


def run(q, k, v, call: Call, decision: Decision):
  d = decision
  kernel = _kernel(call.T, call.S, call.N, d.mask, d.offset, d.window, d.blocks, d.interpret)
  q = (q.astype(jnp.float32) * call.scale).astype(q.dtype)  # the kernel does not scale
  q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # (B, N, T, H), (B, K, S, H)
  if d.segment_ids:
    segment_ids = _kernel_modules()[0].SegmentIds
    one_row = lambda q, k, v, q_ids, kv_ids: kernel(q, k, v, segment_ids(q_ids, kv_ids))
    out = jax.vmap(one_row)(q, k, v, *_segment_ids(call))
  else:
    out = jax.vmap(kernel)(q, k, v)  # (B, N, T, H)
  return _masks.finish(out.transpose(0, 2, 1, 3), call)  # (B, T, N, H)
