"""`attention()`: the functional core every layer and model in attnlayers calls."""

from __future__ import annotations

import contextlib

from jaxtyping import Array, Bool, Float, Int

from attnlayers import backends, spec
from attnlayers.plan import BackendUnavailableError, Plan, plan


_RECORDING: list[list[Plan]] = []  # the lists of the open recorded_plans() blocks


@contextlib.contextmanager
def recorded_plans():
  """Collects the Plan of every attention() call made inside the block, also while jax traces one.

  The plans of a program from its one trace, e.g. `with recorded_plans() as plans: jax.jit(step).lower(*args)`
  (each attention() call plans once). A function whose trace jax has cached makes no call: lower a new jit, or
  trace with jax.eval_shape.
  """
  plans: list[Plan] = []
  _RECORDING.append(plans)
  try:
    yield plans
  finally:
    _RECORDING.remove(plans)


def _plan(backend, q, k, v, **arguments) -> Plan:
  """The checks every call passes, its one description, then the plan: what explain() reports and attention()
  runs. `arguments` are attention()'s keyword arguments, by name."""
  spec.check_array_args(q, k, v)
  if arguments.get("fp8_amax_history") is not None and backend != "te-fp8":
    raise ValueError(f"fp8_amax_history= scales te-fp8's FP8 attention core; backend={backend!r} takes none")
  return plan(backend, spec.describe(q, k, v, **arguments))


def explain(backend: str, q, k, v, *, is_causal: bool = False, mask=None, bias=None, scale: float | None = None,
            dropout_rate: float = 0.0, dropout_rng=None, broadcast_dropout: bool = True, precision=None,
            return_weights: bool = False, fp8_core: str = "fp8", query_seq_lengths=None, key_value_seq_lengths=None,
            causal_alignment: str = "top-left", segment_ids=None, window=None, max_segments=None,
            fp8_amax_history=None) -> Plan:
  """Which backend would run this call (for `auto`: which it picks) and every unmet requirement.

  Takes exactly the arguments of `attention()` (q, k, v may be jax.ShapeDtypeStruct) and
  validates them the same way; runs nothing. `str(plan)` is a readable report; `plan.chosen`,
  `plan.unmet`, `plan.runnable`, `plan.notes`, `plan.call` (the call's one description, spec.Call)
  and `plan.decision` (how the chosen backend runs it) are the facts.
  """
  if not isinstance(backend, str):
    raise TypeError(f"explain takes the backend first: explain(backend, q, k, v, ...), e.g. explain('auto', q, k, v) "
                    f"(attention() takes it as backend=...); got {type(backend).__name__} as the backend")
  return _plan(**locals())  # the arguments as given, by name


def attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    *,
    backend: str = "auto",
    is_causal: bool = False,
    mask: Bool[Array, "#B #N #T #S"] | None = None,
    bias: Float[Array, "#B #N #T #S"] | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
    broadcast_dropout: bool = True,
    precision=None,
    return_weights: bool = False,
    fp8_core: str = "fp8",
    query_seq_lengths: Int[Array, "B"] | None = None,
    key_value_seq_lengths: Int[Array, "B"] | None = None,
    causal_alignment: str = "top-left",
    segment_ids: Int[Array, "B T"] | tuple[Int[Array, "B T"], Int[Array, "B S"]] | None = None,
    window: tuple[int, int] | None = None,
    max_segments: int | None = None,
    fp8_amax_history: Float[Array, "3 L"] | None = None,
):
  """Scaled dot-product attention on the chosen kernel.

  Args:
    q: queries (B, T, N, H); k, v: keys and values (B, S, K, H) with N % K == 0
      (K == N multi-head, 1 < K < N grouped-query, K == 1 multi-query attention).
    backend: one of `attnlayers.BACKENDS` ("auto" picks the first of cudnn, splash, xla,
      naive that can run the call; any other name runs that kernel or raises
      BackendUnavailableError listing every unmet requirement; never a silent fallback).
    is_causal: query i attends keys j <= i (top-left aligned when T != S). A bool.
    mask: boolean, broadcastable to (B, N, T, S); True = may attend. Combined with is_causal.
    bias: additive float bias on the scaled scores, broadcastable to (B, N, T, S).
    scale: multiplies q k^T; a finite number > 0, static under jit; default 1/sqrt(H).
    dropout_rate, dropout_rng, broadcast_dropout: dropout on the attention weights,
      drawn as Flax draws it (naive only).
    precision: of the score and value matmuls, as jax's PrecisionLike: a jax.lax.Precision
      (or a pair), a DotAlgorithmPreset or a DotAlgorithm. naive applies it; xla, cudnn and
      te take a Precision level for float16/bfloat16 inputs, whose products they accumulate
      exactly in float32 at any level, but no dot algorithm (it sets input types and
      accumulation their kernels do not take); a backend that cannot apply it refuses the call.
    return_weights: also return the (B, N, T, S) float weights (naive only).
    fp8_core: te-fp8 only: "fp8" (the default: cuDNN FP8 attention, or refuse the call with
      the reasons), "fp8-or-bf16" (FP8 where the call qualifies, else TransformerEngine's
      bf16 kernel; explain() says which) or "bf16".
    fp8_amax_history: te-fp8's FP8 core only: float32 (3, L), the amaxes of q, k, v over the
      last L steps (column 0 the latest). Given, the core scales q, k, v from it (delayed
      scaling, attnlayers.backends._fp8_delayed) and its gradient is the next history, this
      call's amaxes rolled in; None: scales from this call's amaxes (current scaling).
      attnlayers.nnx.MultiHeadAttention keeps one per te-fp8 layer.
    query_seq_lengths, key_value_seq_lengths: int (B,): row b has Tb real queries and Sb real
      keys (right padding; default T and S). Query (b, t) attends key s only if t < Tb and s < Sb.
    causal_alignment: with is_causal, "top-left" (query t attends keys s <= t) or
      "bottom-right" (s <= t + Sb - Tb: the queries are the row's last Tb keys, as when new
      tokens attend to a KV cache). A decode step is T = 1, bottom-right, Sb = cache position + 1.
    segment_ids: packed documents. One int array (B, T) when queries and keys share a layout
      (T == S), or a pair (q_segment_ids (B, T), kv_segment_ids (B, S)). A query attends only
      keys of its own document; id 0 is padding: such a query attends nothing (outputs 0) and
      such a key is attended by nothing. Ids need not be contiguous or ordered.
    window: (left, right), two ints >= 0, static: the query at position p attends keys in
      [p - left, p + right] (p = t, or t + Sb - Tb bottom-right). With is_causal the right side
      is cut at p; window=(L, 0) alone is a causal window. None: no window.
    max_segments: with segment_ids, the most documents (runs of one non-zero id) any row holds;
      static. te runs a packed call as B * max_segments sequences, so a tight bound is faster;
      None: T (always enough). Concrete ids with more raise; traced ones make their row NaN on te.
    Queries that are padding, or that lengths, causality, segments and the window leave with no
    key, output exactly 0 (zero gradients) on every backend. Traced lengths outside [0, T] /
    [0, S] make their row NaN.

  Returns:
    (B, T, N, H) in q's dtype, or (out, weights) when return_weights.
  """
  spec.check_values(q, k, v)
  chosen = _plan(**locals())  # the arguments as given, by name
  for plans in _RECORDING:
    plans.append(chosen)
  if not chosen.ok:
    raise BackendUnavailableError.from_plan(chosen)
  return backends.REGISTRY[chosen.chosen].run(q, k, v, chosen.call, chosen.decision)
