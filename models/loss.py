"""The output layer and cross-entropy as one chunked op: the training loss without (B, T, V) logits.

Letters: B batch, T sequence, N = B * T tokens, D model width, V vocabulary, C tokens per chunk.

Why: with GPT-2's vocabulary the logits are the step's largest activation. For gpt2-small at
B=32, T=1024, V=50304, float32 logits are 6.6 GB; the plain loss writes them, reads them for
the softmax, then writes and reads a gradient of the same size, all at HBM bandwidth.
`head_cross_entropy` computes the logits C tokens at a time and, when differentiated, the
gradients of h and w in the same pass (Liger-Kernel's fused linear cross-entropy): only (C, V)
blocks ever exist, and the backward is two saved arrays times the incoming scalar.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import spmd
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from models import ops
from models.config import is_integer
from models.ops import softmax_grad, softmax_onepass

# Most tokens per chunk. A chunk's logits take C * V elements (half the bytes of float32 in bfloat16, as
# training takes them), and the differentiated pass adds their compute-dtype gradient: a fraction of the
# whole (N, V) logits, while each chunk's three matmuls stay large GEMMs. Larger chunks raise the peak
# memory without making the step measurably faster on an H200.
DEFAULT_CHUNK = 4096

_CONTRACT_D = (((1,), (1,)), ((), ()))  # (C, D) x (V, D) -> (C, V)
_CONTRACT_V = (((1,), (0,)), ((), ()))  # (C, V) x (V, D) -> (C, D)
_CONTRACT_C = (((0,), (0,)), ((), ()))  # (C, V) x (C, D) -> (V, D)


def head_cross_entropy(h: Float[Array, "B T D"], w: Float[Array, "V D"], targets: Int[Array, "B T"], *,
                       chunk: int = DEFAULT_CHUNK, logits_dtype=jnp.float32, kernel: str = "auto") -> Float[Array, ""]:
  """Mean over all B * T tokens of -log softmax(h @ w.T)[target], float32, never all (B, T, V) logits.

  h: hidden states after the final LayerNorm; w: the output projection (the tied token embedding,
  or an untied head's kernel transposed); both in the compute dtype, the same one. targets: ints
  in [0, V) (checked when not traced). chunk: the most tokens per block of logits (default
  DEFAULT_CHUNK). N need not be a multiple of it: the N tokens are split into ceil(N / chunk)
  equal chunks, and the last tokens padded with weight 0 (fewer than one per chunk).

  logits_dtype: the logits GEMM's output, float32 (default: not rounded before the softmax) or
  the compute dtype (what `einsum(...).astype(float32)` computes; half the bytes through HBM).
  The softmax runs in float32 either way. Differentiable in h and w in reverse mode (a custom_vjp; no jvp): under jax.grad
  the loss pass also computes the gradients, kept as dh in h's dtype and dw in w's dtype; the
  backward scales them by the cotangent. Undifferentiated (evaluation), only the loss is computed.

  kernel: how the differentiated pass turns each chunk's logits into softmax - onehot and the loss
  (models.ops.resolve says what "auto", the default, picks): "xla" (XLA fusions, any backend),
  "pallas" (one GPU kernel for XLA's two fusions: models.ops.softmax_onepass, one read of the
  logits, where w is bfloat16 or float32; models.ops.softmax_grad, two reads, for float16) or "interpret"
  (that kernel through the Pallas interpreter, any backend, slow: for tests). The same float32 formula,
  rounded differently: models.ops.softmax_onepass's path never rounds the target's entry, p - 1.

  On a mesh (jax.set_mesh, Auto axes) with Flax's logical axis rules in context (nnx.logical_axis_rules)
  whose rule for "batch" splits B: every device runs the chunk loop over its own tokens (`chunk` then counts
  a device's tokens), with w gathered whole once, and the loss and dw are reduced once, after the loop, not
  once per chunk. Its tokens are its rows (B split over the "batch" axes) and, where the mesh's other axes
  (tensor) divide T, a part of their positions: the loss is not computed again on every device of those
  axes. dw is reduce-scattered into w's layout by the rules for "vocab" and "embed" (where the axes divide
  V and D) and all-reduced over the rest; dh comes back in h's layout (B split over the "batch" axes).
  Without a mesh or rules, or with a B they do not divide, the loop runs over the whole batch: on a mesh,
  XLA's partitioner then splits each chunk, and reduces dw once per chunk.
  """
  if h.ndim != 3 or w.ndim != 2 or h.shape[-1] != w.shape[-1]:
    raise ValueError(f"h must be (B, T, D) and w (V, D) with the same D; got h {tuple(h.shape)}, w {tuple(w.shape)}")
  if h.dtype != w.dtype:
    raise ValueError(f"h and w must share the compute dtype; got h {h.dtype}, w {w.dtype} (cast w, e.g. "
                     "model.head_weight())")
  if tuple(targets.shape) != h.shape[:2] or not jnp.issubdtype(targets.dtype, jnp.integer):
    raise ValueError(f"targets must be an int array of h's (B, T) = {tuple(h.shape[:2])}; got {targets.dtype} "
                     f"of shape {tuple(targets.shape)}")
  if not is_integer(chunk) or chunk < 1:
    raise ValueError(f"chunk must be an int >= 1 (tokens per block of logits); got {chunk!r}")
  if not isinstance(targets, jax.core.Tracer) and targets.size:  # known (also closed over by a jit): check
    known = np.asarray(targets)  # on the host: jnp ops here would be traced under a jit
    lo, hi = int(known.min()), int(known.max())
    if lo < 0 or hi >= w.shape[0]:
      raise ValueError(f"targets must lie in [0, V={w.shape[0]}); got values in [{lo}, {hi}]")
  logits_dtype = jnp.dtype(logits_dtype)
  if logits_dtype not in (jnp.dtype(jnp.float32), jnp.dtype(h.dtype)):
    raise ValueError(f"logits_dtype must be float32 or the compute dtype {h.dtype}; got {logits_dtype}")
  kernel, _ = ops.resolve(kernel, h, w)
  return _head_cross_entropy(h, w, targets, chunk, logits_dtype, kernel, _split(h.shape, w.shape))


@dataclasses.dataclass(frozen=True)
class _Split:
  """How head_cross_entropy splits its tokens over the mesh in context, and where dw goes out."""
  mesh: jax.sharding.AbstractMesh
  rows: tuple[str, ...]  # the mesh axes B is split over: the rules' "batch"
  positions: tuple[str, ...]  # the mesh's other axes, T split over them where they divide it, else ()
  dw: P  # dw's layout out of the loss: w's by the rules for "vocab" and "embed", over axes of rows + positions

  @property
  def axes(self) -> tuple[str, ...]:  # every mesh axis the tokens are split over
    return self.rows + self.positions

  def run(self, fn, h, w, targets, out_specs):
    """fn(h, w, targets) on every device of the mesh, over its own tokens (B split over rows, T over
    positions), with w whole; out_specs: shard_map's, for what fn returns. fn reduces its sums itself
    (check_vma=False: the chunk loop's carry starts the same on every device and varies after a chunk, which
    jax's type check of scan refuses). Where positions are split, h is held to its rows' split going in (and
    the caller holds dh to it coming out): XLA's partitioner would otherwise carry the split of T into the
    layers before (all-to-alls in the attention)."""
    tokens = P(self.rows, self.positions or None)  # (B, T)
    if self.positions:
      h = lax.with_sharding_constraint(h, P(self.rows, None, None))  # (B, T, D)
    return jax.shard_map(fn, mesh=self.mesh, in_specs=(P(*tokens, None), P(), tokens), out_specs=out_specs,
                         check_vma=False)(h, w, targets)

  def reduce(self, dw: Float[Array, "V D"]) -> Float[Array, "V D"]:
    """Every device's float32 dw summed: reduce-scattered over the axes self.dw splits, all-reduced over the rest."""
    for d, on in enumerate(self.dw):
      if on:
        dw = lax.psum_scatter(dw, on, scatter_dimension=d, tiled=True)
    rest = tuple(a for a in self.axes if not any(a in on for on in self.dw if on))
    return lax.psum(dw, rest) if rest else dw


def _split(h_shape, w_shape) -> _Split | None:
  """The split of the mesh and logical axis rules in context (head_cross_entropy's docstring); None where there
  is no mesh of Auto axes, no rule for "batch", no axis of it larger than 1, or a B it does not divide."""
  mesh = jax.sharding.get_abstract_mesh()
  rules = dict(spmd.get_logical_axis_rules())
  if mesh.empty or "batch" not in rules or any(t != jax.sharding.AxisType.Auto for t in mesh.axis_types):
    return None  # no mesh, no rules, or axes XLA's partitioner does not place (inside a shard_map, Explicit)

  def axes(name):  # the mesh axes larger than 1 that the rule for `name` names
    rule = rules.get(name)
    return tuple(a for a in ((rule,) if isinstance(rule, str) else rule or ()) if mesh.shape.get(a, 1) > 1)

  span = lambda names: math.prod(mesh.shape[a] for a in names)
  (B, T, _), (V, D) = h_shape, w_shape
  rows = axes("batch")
  if not rows or B % span(rows):
    return None
  others = tuple(a for a in mesh.axis_names if a not in rows and mesh.shape[a] > 1)
  positions = others if T % span(others) == 0 else ()  # (): each device of them computes its rows whole

  def dim(name, size):  # w's axis `name` split as train.mesh splits it, over the axes the tokens are split over
    on = tuple(a for a in axes(name) if a in rows + positions)
    return on if on and size % span(on) == 0 else None
  return _Split(mesh, rows, positions, P(dim("vocab", V), dim("embed", D)))


def _chunked(h, targets, chunk: int):
  """(B, T, D), (B, T) -> h (n, C, D), targets (n, C), real (n, C) bool; n = ceil(N / chunk), C = ceil(N / n).

  Chunk k holds the flattened tokens k, k + n, k + 2n, ...: where XLA's partitioner splits the batch rows
  over devices (no _Split), every chunk is split the same way (contiguous chunks would each sit on one
  device)."""
  B, T, D = h.shape
  N = B * T
  n = -(-N // chunk)
  C = -(-N // n)
  pad = n * C - N
  hf = jnp.pad(h.reshape(N, D), ((0, pad), (0, 0)))  # (n * C, D)
  tf = jnp.pad(targets.reshape(N), (0, pad))  # (n * C,)
  real = jnp.arange(n * C) < N  # (n * C,)
  return hf.reshape(C, n, D).swapaxes(0, 1), tf.reshape(C, n).T, real.reshape(C, n).T  # (n, C, D), (n, C), (n, C)


def _unchunked(x, B: int, T: int):
  """_chunked's inverse for h: (n, C, D) -> (B, T, D), the padding dropped."""
  n, C, D = x.shape
  return x.swapaxes(0, 1).reshape(n * C, D)[:B * T].reshape(B, T, D)  # (C, n, D) -> (n * C, D) -> (B, T, D)


def _max_and_sumexp(x: Float[Array, "C V"]) -> tuple[Float[Array, "C 1"], Float[Array, "C 1"]]:
  """Each row's max m and sum(exp(x - m)) in one read of x (a variadic reduction, online softmax's
  rescaling): the max first and then the sum would read the (C, V) block twice."""

  def combine(a, b):  # (m1, s1), (m2, s2): two partial (max, sum of exp(x - max)) -> the pair of their union
    (m1, s1), (m2, s2) = a, b
    scale = jnp.where(m1 == m2, 1.0, jnp.exp(-jnp.abs(m1 - m2)))  # exp(smaller max - larger); -inf pairs: 1, not NaN
    return jnp.maximum(m1, m2), jnp.where(m1 >= m2, s1 + s2 * scale, s1 * scale + s2)

  init = (jnp.array(-jnp.inf, x.dtype), jnp.array(0.0, x.dtype))
  m, s = lax.reduce((x, jnp.ones_like(x)), init, combine, (1,))  # each element alone: (x, exp(x - x) = 1)
  return m[:, None], s[:, None]


def _chunk_loss(h_c, w, t_c, real_c, logits_dtype):
  """Summed -log p(target) of one chunk's real tokens; its float32 logits (C, V), their row maxima (C, 1) and
  softmax denominators sum(exp(logits - max)) (C, 1). Everything is taken relative to the max: subtracting
  the logsumexp instead (~log V + max) would cost its rounding, relative to its size, in every probability."""
  logits = lax.dot_general(h_c, w, _CONTRACT_D, preferred_element_type=logits_dtype).astype(jnp.float32)  # (C, V)
  top, denom = _max_and_sumexp(logits)  # (C, 1), (C, 1) >= 1
  target = jnp.take_along_axis(logits, t_c[:, None], axis=-1) - top  # (C, 1) <= 0
  nll = (jnp.log(denom) - target)[:, 0]  # (C,)
  return jnp.sum(jnp.where(real_c, nll, 0.0)), logits, top, denom


def _loss_sum(h, w, targets, chunk, logits_dtype):
  """The summed loss of h's tokens (float32): the chunk loop, loss only."""
  hs, ts, real = _chunked(h, targets, chunk)

  def step(total, xs):
    total_c, _, _, _ = _chunk_loss(xs[0], w, xs[1], xs[2], logits_dtype)
    return total + total_c, None

  total, _ = lax.scan(step, jnp.zeros((), jnp.float32), (hs, ts, real))
  return total


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _head_cross_entropy(h, w, targets, chunk, logits_dtype, kernel, split):
  del kernel  # evaluation computes no gradient: XLA's fusions are one read of each chunk
  B, T, _ = h.shape
  local = functools.partial(_loss_sum, chunk=chunk, logits_dtype=logits_dtype)
  if split is None:
    return local(h, w, targets) / (B * T)
  return split.run(lambda h, w, t: lax.psum(local(h, w, t), split.axes), h, w, targets, P()) / (B * T)


def _chunk_grad(h_c, w, t_c, real_c, logits_dtype, kernel):
  """One chunk's summed loss over real tokens, and d loss / d logits * N = softmax - onehot (C, V): as g, in
  w's dtype, with scales None; or (models.ops.softmax_onepass) as g * r + onehot * a, g = exp(logits - c) (0 at the
  target) in w's dtype and scales = (r, a), each (C,) float32, the onehot's term left to the caller. Padding
  rows contribute 0."""
  if kernel == "xla":
    total_c, logits, top, denom = _chunk_loss(h_c, w, t_c, real_c, logits_dtype)
    g = jnp.exp(logits - top) * (1 / denom) - jax.nn.one_hot(t_c, w.shape[0], dtype=jnp.float32)  # (C, V)
    return total_c, jnp.where(real_c[:, None], g, 0.0).astype(w.dtype), None  # (C, V) padding passes no gradient
  logits = lax.dot_general(h_c, w, _CONTRACT_D, preferred_element_type=logits_dtype)  # (C, V)
  interpret = kernel == "interpret"
  if jnp.dtype(w.dtype) in softmax_onepass.DTYPES:  # one read of the logits; r and the target's term go to the GEMMs
    e, r, a, nll = softmax_onepass.softmax_scaled(logits, t_c, real_c, w.dtype, interpret=interpret)
    return jnp.sum(nll), e, (r, a)
  g, nll = softmax_grad.softmax_grad(logits, t_c, real_c, w.dtype, interpret=interpret)  # float16
  return jnp.sum(nll), g, None


def _sums_and_grads(h, w, targets, chunk, logits_dtype, kernel, N):
  """The summed loss of h's tokens, dh (B, T, D) in h's dtype, and the float32 sum dw (V, D) = (softmax - onehot)^T h
  over them: the chunk loop, differentiated. dh is d loss / dh for a loss that is a mean over N tokens."""
  B, T, D = h.shape
  hs, ts, real = _chunked(h, targets, chunk)

  def step(carry, xs):
    total, dw = carry
    h_c, t_c, real_c = xs  # (C, D), (C,), (C,)
    total_c, g, scales = _chunk_grad(h_c, w, t_c, real_c, logits_dtype, kernel)  # (), (C, V), ((C,), (C,)) | None
    dh_c = lax.dot_general(g, w, _CONTRACT_V, preferred_element_type=jnp.float32)  # (C, D)
    if scales is not None:  # softmax - onehot = g * r + onehot * a: r scales dh's rows after the GEMM and h's rows
      # before dw's; the target's term p - 1 = a is applied in float32, never rounded: a * w[target] on dh's rows,
      # a * h's rows scattered onto dw's target rows (a is 0 for padding)
      r, a = scales[0][:, None], scales[1][:, None]  # (C, 1), (C, 1)
      dh_c = dh_c * r + w[t_c].astype(jnp.float32) * a  # (C, D)
      dw = dw.at[t_c].add(h_c.astype(jnp.float32) * a)  # (V, D)
      h_c = (h_c.astype(jnp.float32) * r).astype(h_c.dtype)  # (C, D)
    dw = dw + lax.dot_general(g, h_c, _CONTRACT_C, preferred_element_type=jnp.float32)  # (V, D)
    return (total + total_c, dw), (dh_c / N).astype(h.dtype)

  zeros = (jnp.zeros((), jnp.float32), jnp.zeros((w.shape[0], D), jnp.float32))
  (total, dw), dhs = lax.scan(step, zeros, (hs, ts, real))  # dhs (n, C, D)
  return total, _unchunked(dhs, B, T), dw


def _head_cross_entropy_fwd(h, w, targets, chunk, logits_dtype, kernel, split):
  """The loss and, in the same chunk loop, its gradients: d loss / d logits = (softmax - onehot) / N.

  The 1/N is applied to the float32 matmul results, not to softmax - onehot before its cast to the
  compute dtype: in float16, (1/V) / N (6e-10 for gpt2-small) would underflow to 0. On a mesh (split),
  the sums are reduced over the devices before the 1/N and the cast."""
  B, T, _ = h.shape
  N = B * T
  sums = functools.partial(_sums_and_grads, chunk=chunk, logits_dtype=logits_dtype, kernel=kernel, N=N)
  if split is not None:
    def local(h, w, t):
      total, dh, dw = sums(h, w, t)
      return lax.psum(total, split.axes), split.reduce(dw), dh
    total, dw, dh = split.run(local, h, w, targets, (P(), split.dw, P(split.rows, split.positions or None, None)))
    if split.positions:
      dh = lax.with_sharding_constraint(dh, P(split.rows, None, None))  # (B, T, D) gathered over positions: h's layout
  else:
    total, dh, dw = sums(h, w, targets)
  return total / N, (dh, (dw / N).astype(w.dtype))


def _head_cross_entropy_bwd(chunk, logits_dtype, kernel, split, residuals, g):
  dh, dw = residuals  # (B, T, D), (V, D)
  return (g * dh).astype(dh.dtype), (g * dw).astype(dw.dtype), None  # targets: ints, no cotangent


_head_cross_entropy.defvjp(_head_cross_entropy_fwd, _head_cross_entropy_bwd)
