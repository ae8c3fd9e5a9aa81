"""One attention call described as the backends see it, and the checks every call passes.

Letters, as in `jax.nn.dot_product_attention`: B batch, T query length, S key/value
length, N query heads, K key/value heads (N % K == 0: K == N is MHA, 1 < K < N is GQA,
K == 1 is MQA), H head dim. q is (B, T, N, H); k and v are (B, S, K, H); a mask or bias
broadcasts to (B, N, T, S). Masks are boolean with True = may attend, for every backend.

Which keys a query may attend (backends/_masks.py builds it; every backend runs it exactly or
refuses): query (b, t) attends key s iff all of
  lengths   t < Tb and s < Sb (query_seq_lengths / key_value_seq_lengths; default T, S);
  causal    s <= p, where p = t (top-left) or t + Sb - Tb (bottom-right) is the query's position;
  segments  q_segment_ids[b, t] == kv_segment_ids[b, s] != 0 (0 = padding: attends nothing);
  window    p - left <= s <= p + right (window=(left, right); p as above, t without causality);
  mask      the caller's mask.
A query left with no key by lengths, causality, segments or window outputs exactly 0, with
zero gradients, on every backend.

`describe()` turns attention()'s arguments into one validated `Call` (shapes, dtype, device and
options, arrays included); plan() and every backend read that one object.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from attnlayers import device as device_lib

# How te-fp8 runs its attention core (the projections are FP8 GEMMs in any case):
#   "fp8"          cuDNN's FP8 flash attention; a call it cannot take is refused with the reasons.
#   "fp8-or-bf16"  FP8 where the call qualifies, else TransformerEngine's bf16 kernel; explain() says which.
#   "bf16"         always TransformerEngine's bf16 kernel.
FP8_CORE_MODES = ("fp8", "fp8-or-bf16", "bf16")

# Where a causal query block sits against the keys (per row, after the lengths below):
#   "top-left"      query t attends keys s <= t (jax.nn.dot_product_attention, cuDNN's CAUSAL).
#   "bottom-right"  query t attends keys s <= t + Sb - Tb: the queries are the last Tb of the
#                   row's Sb keys, as when new tokens attend to a KV cache (TE's BOTTOM_RIGHT).
CAUSAL_ALIGNMENTS = ("top-left", "bottom-right")


def is_integer(x) -> bool:
  """x is an int, numpy's included (jax's shapes and numpy's arithmetic give them), and not a bool: True is an
  int to Python, never a count, size or id here (numpy's bool_ is no numbers.Integral, so it is refused too).
  Every "an integer, not a bool" check of attnlayers, models and train is this one."""
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


class ArgumentError(ValueError):
  """A ValueError that names the arguments at fault, for callers that map them onto their own settings.

  Attributes:
    arguments: the names of the arguments the message names, as the raising function spells them; the first
      is the one to change.
    value: the first one's value.
    expected: what would work, in words.
  """

  def __init__(self, message: str, *, arguments: tuple[str, ...], value=None, expected: str | None = None):
    super().__init__(message)
    self.arguments = tuple(arguments)
    self.value = value
    self.expected = expected

  @property
  def argument(self) -> str:
    return self.arguments[0]


class _LayerDefault:
  """The default of a layer call's sliding_window=: not given, so the layer's own sliding_window applies."""

  def __repr__(self) -> str:
    return "LAYER_DEFAULT"


LAYER_DEFAULT = _LayerDefault()


@dataclasses.dataclass(frozen=True)
class Dropout:
  """Dropout on the attention weights, as Flax applies it."""
  rate: float  # probability of dropping a weight, 0 < rate < 1
  rng: object = dataclasses.field(compare=False, repr=False)  # a jax PRNG key
  broadcast: bool = True  # one (T, S) pattern shared across batch and heads


def _array():
  """An array option: neither compared, hashed nor printed (the facts of it that unmet() reads are)."""
  return dataclasses.field(default=None, compare=False, repr=False)


def _fact():
  """A fact of the array options, set by Call.__post_init__ (compared and hashed in their place)."""
  return dataclasses.field(init=False, default=None)


@dataclasses.dataclass(frozen=True)
class Call:
  """One attention call, validated: the shapes, dtype and device of q, k, v, and every option.

  `describe()` builds it once from attention()'s arguments; plan() and every backend's unmet(),
  decide() and run() read it, and none derives it again. The options carry attention()'s names
  and meaning (its docstring). Constructing a Call validates it and raises naming the values.
  Arrays among the options are neither compared nor hashed; the facts of them that unmet()
  reads (mask_shape, q_lengths, segments, ...) are, so two calls that plan alike compare equal.
  """
  B: int  # batch
  T: int  # query length
  S: int  # key/value length
  N: int  # query heads
  K: int  # key/value heads, N % K == 0
  H: int  # head dim
  dtype: np.dtype  # q/k/v's, as jax runs it
  device: device_lib.DeviceInfo
  scale: float  # multiplies q k^T; finite, > 0
  is_causal: bool = False  # query t attends keys s <= p (p: its position, see causal_alignment)
  mask: object = _array()  # bool, broadcastable to (B, N, T, S); True = may attend
  bias: object = _array()  # float, broadcastable to (B, N, T, S); added to the scaled scores
  dropout: Dropout | None = None  # on the attention weights (naive only)
  precision: object = None  # the score and value matmuls' jax PrecisionLike, or None
  return_weights: bool = False  # also return the (B, N, T, S) weights (naive only)
  fp8_core: str = "fp8"  # te-fp8's core mode, one of FP8_CORE_MODES
  fp8_amax_history: object = _array()  # float32 (3, L): amaxes of q, k, v for te-fp8's delayed scaling
  query_seq_lengths: object = _array()  # int (B,): row b has Tb real queries
  key_value_seq_lengths: object = _array()  # int (B,): row b has Sb real keys
  causal_alignment: str = "top-left"  # one of CAUSAL_ALIGNMENTS (with is_causal)
  q_segment_ids: object = _array()  # int (B, T): query t's document; 0 = padding
  kv_segment_ids: object = _array()  # int (B, S): key s's document; 0 = padding
  window: tuple[int, int] | None = None  # (left, right): the query at p attends keys in [p - left, p + right]
  max_segments: int | None = None  # most documents (runs of one non-zero id) in a row; None: T
  mask_shape: tuple[int, ...] | None = _fact()  # the mask's, 4-d after left-padding with 1s
  bias_shape: tuple[int, ...] | None = _fact()  # the bias's, likewise
  bias_dtype: np.dtype | None = _fact()  # the bias's (it may differ from q/k/v's)
  q_lengths: bool = _fact()  # query_seq_lengths given (query padding per row)
  kv_lengths: bool = _fact()  # key_value_seq_lengths given (key padding per row)
  segments: bool = _fact()  # segment ids given (packed documents)
  shared_segments: bool = _fact()  # one segment_ids array for queries and keys (not a pair)
  fp8_delayed: bool = _fact()  # te-fp8's FP8 core scales from an amax history

  def __post_init__(self):
    check_is_causal(self.is_causal)
    self._set(is_causal=bool(self.is_causal), scale=_check_scale(self.scale), return_weights=bool(self.return_weights))
    if self.fp8_core not in FP8_CORE_MODES:
      raise ArgumentError(f"fp8_core must be one of {', '.join(map(repr, FP8_CORE_MODES))}; got {self.fp8_core!r}",
                          arguments=("fp8_core",), value=self.fp8_core, expected=f"one of {FP8_CORE_MODES}")
    if self.fp8_amax_history is not None:
      check_amax_history(self.fp8_amax_history, self.fp8_core)
    if self.causal_alignment not in CAUSAL_ALIGNMENTS:
      raise ArgumentError(f"causal_alignment must be one of {', '.join(map(repr, CAUSAL_ALIGNMENTS))}; "
                          f"got {self.causal_alignment!r}", arguments=("causal_alignment",),
                          value=self.causal_alignment, expected=f"one of {CAUSAL_ALIGNMENTS}")
    if self.causal_alignment != "top-left" and not self.is_causal:
      raise ArgumentError(f"causal_alignment={self.causal_alignment!r} places a causal mask; it needs "
                          "is_causal=True (without it every query attends every real key, and the lengths alone say "
                          "which)", arguments=("is_causal", "causal_alignment"), value=self.is_causal, expected="True")
    if self.dropout is not None and not (0.0 < self.dropout.rate < 1.0):
      raise ValueError(f"dropout rate must be in (0, 1); got {self.dropout.rate}")
    if self.dropout is not None and self.dropout.rng is None:
      raise ValueError(f"dropout_rate={self.dropout.rate} needs a dropout_rng (a jax PRNG key)")
    if self.dropout is not None and not _is_key(self.dropout.rng):
      raise TypeError(f"dropout_rng must be a jax PRNG key, e.g. jax.random.key(0); got {self.dropout.rng!r}")
    if self.max_segments is not None:
      if self.q_segment_ids is None:
        raise ArgumentError("max_segments= bounds the documents of segment_ids=; pass segment_ids too (or drop it)",
                            arguments=("max_segments", "segment_ids"), value=self.max_segments, expected="None")
      if not is_integer(self.max_segments) or self.max_segments < 1:
        raise ArgumentError(f"max_segments must be an int >= 1, the most documents any row holds; "
                            f"got {self.max_segments!r}", arguments=("max_segments",), value=self.max_segments,
                            expected="an int >= 1")
      self._set(max_segments=int(self.max_segments))
    self._set(window=check_window(self.window))
    self._check_arrays()

  def _set(self, **values) -> None:
    for name, value in values.items():
      object.__setattr__(self, name, value)

  def _check_arrays(self) -> None:
    """Validates the array options against the shapes and records the facts of them."""
    B, T, S = self.B, self.T, self.S
    target, dims = (B, self.N, T, S), ("B", "N", "T", "S")
    if self.mask is not None:
      _array_like("mask", self.mask)
      if self.mask.dtype != jnp.bool_:
        raise ValueError(f"mask must be boolean (True = may attend); got {self.mask.dtype}. Pass mask.astype(bool) "
                         "if nonzero means attend, or mask == 0 if your convention is True = masked out; an additive "
                         "mask (0 / -inf) goes in bias=.")
      self._set(mask_shape=check_broadcast("mask", self.mask.shape, target, dims))
    if self.bias is not None:
      _array_like("bias", self.bias)
      if not jnp.issubdtype(self.bias.dtype, jnp.floating):
        raise ValueError(f"bias must be floating point; got {self.bias.dtype}")
      self._set(bias_shape=check_broadcast("bias", self.bias.shape, target, dims),
                bias_dtype=np.dtype(jax.dtypes.canonicalize_dtype(self.bias.dtype)))
    if self.query_seq_lengths is not None:
      _check_lengths("query_seq_lengths", self.query_seq_lengths, B, T, "T")
    if self.key_value_seq_lengths is not None:
      _check_lengths("key_value_seq_lengths", self.key_value_seq_lengths, B, S, "S")
    shared = self.q_segment_ids is not None and self.q_segment_ids is self.kv_segment_ids
    if self.q_segment_ids is not None:
      if shared and T != S:
        raise ValueError(f"one segment_ids array serves queries and keys only when T == S; got T={T}, S={S}. "
                         "Pass a pair (q_segment_ids (B, T), kv_segment_ids (B, S)).")
      q_name = "segment_ids" if shared else "q_segment_ids"  # named as the caller gave them
      _check_segment_ids(q_name, self.q_segment_ids, (B, T), "(B, T)")
      _check_segment_ids("kv_segment_ids", self.kv_segment_ids, (B, S), "(B, S)")
      if self.max_segments is not None:
        sides = ((q_name, self.q_segment_ids),) + (() if shared else (("kv_segment_ids", self.kv_segment_ids),))
        for name, ids in sides:
          _check_max_segments(name, ids, self.max_segments)
    self._set(q_lengths=self.query_seq_lengths is not None, kv_lengths=self.key_value_seq_lengths is not None,
              segments=self.q_segment_ids is not None, shared_segments=shared,
              fp8_delayed=self.fp8_amax_history is not None)

  @property
  def has_lengths(self) -> bool:
    return self.q_lengths or self.kv_lengths

  @property
  def bottom_right(self) -> bool:
    """Causal with the queries at the end of the keys, where that differs from top-left (T != S or lengths).

    The one statement of the rule: _masks places the queries by it, and the backends pick their mask types by it."""
    return self.is_causal and self.causal_alignment == "bottom-right" and (self.T != self.S or self.has_lengths)

  def shape_str(self) -> str:
    return f"B{self.B} T{self.T} S{self.S} N{self.N} K{self.K} H{self.H} {self.dtype.name}"


def check_broadcast(name: str, shape: tuple[int, ...], target: tuple[int, ...], dims: tuple[str, ...],
                    hint: str = "") -> tuple[int, ...]:
  """`shape` padded with leading 1s to `target`'s rank, or a ValueError that names each of `dims` (target's dims,
  by name) that is neither 1 nor target's, with `hint` after it."""
  shape, where = tuple(shape), f"({', '.join(dims)}) = {target}"
  if len(shape) > len(target):
    raise ValueError(f"{name} must have at most {len(target)} dims broadcastable to {where}; got shape {shape}{hint}")
  padded = (1,) * (len(target) - len(shape)) + shape
  bad = [f"{dim}: {got} (expected 1 or {want})" for dim, got, want in zip(dims, padded, target) if got not in (1, want)]
  if bad:
    raise ValueError(f"{name} of shape {shape} does not broadcast to {where}; mismatched dims {', '.join(bad)}{hint}")
  return padded


def _check_positive(name: str, value, what: str, optional: bool = True) -> None:
  """ValueError unless `value` is a positive int, numpy's too (or None, where `optional`); `what` follows "a positive
  int" in the message."""
  if (value is not None or not optional) and (not is_integer(value) or value <= 0):
    raise ValueError(f"{name} must be a positive int{what}; got {value!r}")


def check_num_heads(num_heads) -> None:
  """A layer's num_heads: a positive int (it divides the features and the key/value heads divide it)."""
  _check_positive("num_heads", num_heads, " (the query heads: 1 or more, dividing the qkv features)", optional=False)


def check_features(**features) -> None:
  """A layer's feature sizes (in_features, and qkv_features, out_features, in_kv_features where given): positive
  ints. Flax's class divides by in_features in its initializer (ZeroDivisionError at 0) and formats a str into its
  own error message (a TypeError that names neither)."""
  for name, value in features.items():
    _check_positive(name, value, " (features of each input position)")


def check_num_kv_heads(num_kv_heads) -> None:
  """A layer's num_kv_heads: None (= num_heads) or a positive int (its divisibility is checked with num_heads)."""
  _check_positive("num_kv_heads", num_kv_heads, " that divides num_heads (or None for num_heads)")


def _is_key(x) -> bool:
  """A jax PRNG key: a typed key (jax.random.key), or a raw uint32 one (jax.random.PRNGKey), traced or not."""
  dtype = getattr(x, "dtype", None)
  return dtype is not None and (jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) or
                                dtype == np.uint32 and getattr(x, "ndim", 0) >= 1)


def _array_like(name: str, x):
  if not (hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "ndim")):
    raise TypeError(f"{name} must be an array (jax.Array, numpy.ndarray or jax.ShapeDtypeStruct); "
                    f"got {type(x).__name__}. Wrap it with jnp.asarray().")


def check_array_args(q, k, v) -> None:
  """q, k, v are arrays (before anything reads their shapes)."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    _array_like(name, x)


def check_values(q, k, v) -> None:
  """attention()'s q, k, v hold values: explain() also takes jax.ShapeDtypeStruct, which numpy fails to read deep in
  a backend ('float() argument must be ... not ShapeDtypeStruct')."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if isinstance(x, jax.ShapeDtypeStruct):
      raise TypeError(f"{name} is a jax.ShapeDtypeStruct, a shape without values: attention() computes, so it takes "
                      "arrays; explain() takes shapes (what would run, without running), and jax.eval_shape traces "
                      "attention() on them")


def check_is_causal(is_causal) -> None:
  """Refuses an is_causal that is not a bool (1, "yes", None): where it is given, the call or a layer's field."""
  if not isinstance(is_causal, (bool, np.bool_)):
    raise TypeError(f"is_causal must be True or False; got {is_causal!r} ({type(is_causal).__name__})")


FLOAT32_MAX = float(np.finfo(np.float32).max)


def _check_scale(scale) -> float:
  """A call's scale as a float: a real number (not a bool), finite, > 0, known when the call is traced."""
  if isinstance(scale, jax.core.Tracer):
    raise TypeError("scale must be a Python number known when the call is traced (it is a static option of the "
                    "fused kernels); got a traced value. Pass it as a constant, or scale q by it and pass scale=1.0.")
  if not isinstance(scale, (numbers.Real, np.ndarray, jax.Array)) or np.ndim(scale) != 0 or \
      isinstance(scale, (bool, np.bool_)) or np.asarray(scale).dtype == bool:
    raise TypeError(f"scale must be a real number (a bool is not one: True would scale by 1); got {scale!r}")
  scale = float(scale)
  if not (math.isfinite(scale) and scale > 0):
    raise ValueError(f"scale must be a finite number > 0 (default 1/sqrt(H)); got {scale}")
  if scale > FLOAT32_MAX:  # cast to the float32 scores it is inf, and every output NaN
    raise ValueError(f"scale must be at most float32's largest number ({FLOAT32_MAX:.4g}): the softmax takes the scaled "
                     f"scores in float32, where a larger one is inf; got {scale:g}")
  return scale


def check_amax_history(history, fp8_core: str) -> None:
  """fp8_amax_history: a float32 (3, L) array, L >= 1 (rows q, k, v), for a core that may run in FP8."""
  shape, dtype = getattr(history, "shape", None), getattr(history, "dtype", None)
  if shape is None or len(shape) != 2 or shape[0] != 3 or shape[1] < 1 or dtype != np.float32:
    raise ValueError(f"fp8_amax_history must be a float32 array (3, L): rows q, k, v, L >= 1 steps (what "
                     f"attnlayers.nnx.MultiHeadAttention keeps as fp8_core); got {type(history).__name__} "
                     f"shape={shape} dtype={dtype}")
  if fp8_core == "bf16":
    raise ValueError("fp8_amax_history= scales te-fp8's FP8 core, but fp8_core='bf16' runs the bf16 core; drop one")


WINDOW_MAX = 2**30  # a window side's largest value: positions (< 2**30) plus it stay within int32


def check_window(window) -> tuple[int, int] | None:
  """A sliding window: None (every key) or (left, right), two Python ints >= 0, known when the call is traced."""
  if window is None:
    return None
  if isinstance(window, (tuple, list)) and any(isinstance(w, jax.core.Tracer) for w in window):
    raise TypeError(f"window must be two Python ints known when the call is traced (it is a static option of "
                    f"the fused kernels); got a traced value in {window!r}. Pass it as a constant "
                    "(static_argnums, or a layer's sliding_window=), or mask keys with mask= or bias= instead")
  ok = isinstance(window, (tuple, list)) and len(window) == 2 and all(
      is_integer(w) and w >= 0 for w in window)
  if not ok:
    raise ArgumentError(f"window must be (left, right), two ints >= 0: a query at position p attends keys in "
                        f"[p - left, p + right] (causal: right = 0; None: no window); got {window!r}",
                        arguments=("window",), value=window, expected="(left, right), two ints >= 0")
  if max(window) > WINDOW_MAX:  # positions are int32: p + right must not wrap
    raise ArgumentError(f"window sides must be at most 2**30 ({WINDOW_MAX}): a side as long as the sequence "
                        f"already reaches every key that way (None: no window); got {window!r}",
                        arguments=("window",), value=window, expected=f"sides <= {WINDOW_MAX}")
  return int(window[0]), int(window[1])


def _split_segment_ids(segment_ids):
  """segment_ids as given (one (B, T) array, or a pair (q (B, T), kv (B, S))) -> (q_ids, kv_ids)."""
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2 or any(x is None for x in segment_ids):
      raise ValueError("segment_ids must be one int array (B, T) shared by queries and keys, or a pair "
                       f"(q_segment_ids (B, T), kv_segment_ids (B, S)); got a sequence of {len(segment_ids)}")
    return tuple(segment_ids)
  return segment_ids, segment_ids


def _check_lengths(name: str, x, B: int, limit: int, letter: str) -> None:
  """An int (B,) array of per-row lengths in [0, limit]; the range is checked where the values are known."""
  _array_like(name, x)
  if not jnp.issubdtype(x.dtype, jnp.integer) or x.shape != (B,):
    raise ValueError(f"{name} must be an integer array of shape (B,) = ({B},), one length per row; "
                     f"got {x.dtype} of shape {x.shape}")
  if isinstance(x, jax.core.Tracer) or isinstance(x, jax.ShapeDtypeStruct):
    return  # traced: attention() turns the rows out of range into NaN (backends/_masks.py)
  values = np.asarray(x)
  bad = [int(b) for b in np.flatnonzero((values < 0) | (values > limit))]
  if bad:
    raise ValueError(f"{name} must lie in [0, {letter}={limit}]; row(s) {bad[:5]} hold "
                     f"{[int(values[b]) for b in bad[:5]]}")


def describe(q, k, v, *, scale=None, dropout_rate: float = 0.0, dropout_rng=None, broadcast_dropout: bool = True,
             segment_ids=None, **options) -> Call:
  """The one description of a call, from attention()'s arguments (q, k, v may be jax.ShapeDtypeStruct).

  Checks q, k, v, resolves the arguments that the description holds in another form (scale's default,
  dropout, segment_ids as a (q, kv) pair) and passes the rest to `Call`, which validates them. Raises
  naming the values.
  """
  for name, x in (("q", q), ("k", k), ("v", v)):
    _array_like(name, x)
    if x.ndim != 4:
      raise ValueError(
          f"q, k, v must be rank 4: q (B, T, N, H), k and v (B, S, K, H); {name} has shape {x.shape}. "
          "Flatten extra batch dims into B, or use attnlayers.nnx / attnlayers.linen layers, which do.")
  B, T, N, H = q.shape
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape (B, S, K, H); got k {k.shape} and v {v.shape}")
  kB, S, K, kH = k.shape
  if kB != B:
    raise ValueError(f"q and k/v batch sizes differ: q {q.shape} has B={B}, k {k.shape} has B={kB}")
  if kH != H:
    raise ValueError(f"q and k/v head dims differ: q {q.shape} has H={H}, k {k.shape} has H={kH}")
  empty = [f"{letter}={n}" for letter, n in zip("BTNHSK", (B, T, N, H, S, K)) if n == 0]
  if empty:
    raise ValueError(f"q {q.shape} and k/v {k.shape} must have no zero-sized dim; got {', '.join(empty)} "
                     "(attention over no queries, keys, heads or features is undefined)")
  if N % K:
    raise ValueError(f"num_heads N ({N}) must be divisible by num_kv_heads K ({K}): use K = N (MHA), "
                     f"a divisor of N (GQA) or K = 1 (MQA); q {q.shape}, k {k.shape}")
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}. Cast them to one dtype first.")
  if not jnp.issubdtype(q.dtype, jnp.inexact):  # complex as Flax takes it; which backends run it is their unmet()
    raise ValueError(f"q, k, v must be floating point or complex; got {q.dtype}")
  q_ids, kv_ids = _split_segment_ids(segment_ids)
  return Call(B=B, T=T, S=S, N=N, K=K, H=H, dtype=np.dtype(jax.dtypes.canonicalize_dtype(q.dtype)),
              device=device_lib.of(q, k, v), scale=1.0 / math.sqrt(H) if scale is None else scale,
              dropout=Dropout(dropout_rate, dropout_rng, broadcast_dropout) if dropout_rate else None,
              q_segment_ids=q_ids, kv_segment_ids=kv_ids, **options)


def _check_segment_ids(name: str, x, shape: tuple[int, int], letters: str) -> None:
  """An int array of `shape`; concrete values must be >= 0 (0 = padding)."""
  _array_like(name, x)
  if not jnp.issubdtype(x.dtype, jnp.integer) or tuple(x.shape) != shape:
    raise ValueError(f"{name} must be an integer array of shape {letters} = {shape}, one document id per position "
                     f"(0 = padding); got {x.dtype} of shape {tuple(x.shape)}")
  if isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct)):
    return
  values = np.asarray(x)
  if values.min() < 0:
    raise ValueError(f"{name} must be >= 0 (documents 1, 2, ...; 0 = padding); got {int(values.min())}")
  if values.max() > np.iinfo(np.int32).max:  # the kernels compare ids as int32, where this one would wrap
    raise ValueError(f"{name} must fit int32 (at most {np.iinfo(np.int32).max}); got {int(values.max())}: number "
                     "each row's documents 1, 2, ...")


def run_starts(ids):
  """Bool (B, L): where a document starts in ids (B, L), a run of one non-zero id (padding 0 ends a run)."""
  ids = jnp.asarray(ids, jnp.int32)
  prev = jnp.pad(ids[:, :-1], ((0, 0), (1, 0)))  # (B, L) the id before each position (0 before the first)
  return (ids != 0) & (ids != prev)


def count_runs(ids) -> np.ndarray:
  """(B,) the documents of each row of concrete ids (B, L), also while a jit traces around them."""
  with jax.ensure_compile_time_eval():
    return np.asarray(run_starts(ids).sum(axis=1))


def _check_max_segments(name: str, x, limit: int) -> None:
  """Concrete ids hold at most `limit` documents per row (traced: the fused kernels make such rows NaN)."""
  if isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct)):
    return
  runs = count_runs(x)
  b = int(np.argmax(runs))
  if runs[b] > limit:
    raise ValueError(f"{name}: row {b} holds {int(runs[b])} documents (runs of one non-zero id), more than "
                     f"max_segments={limit}; raise max_segments (or leave it None: T)")
