"""`attnlayers.nnx.MultiHeadAttention`: flax.nnx.MultiHeadAttention with a kernel choice.

A subclass of Flax's class, so every constructor and call argument of the installed Flax
keeps its meaning and the parameter tree (names, shapes, initialisers) is Flax's own; a
checkpoint moves between Flax's class and this one, and between backends, unchanged.
Added, keyword-only:

  backend:   any name in attnlayers.BACKENDS (default "auto"; see attnlayers.explain).
  is_causal: default for the call's `is_causal` (the call's value wins when given).
  sliding_window: default (left, right) window of every call (attnlayers.attention's `window`;
             None = no window); a call's sliding_window= overrides it (None there: no window).
  fp8_recipe: with backend="te-fp8", how the FP8 projections are scaled and how the attention
             core runs (attnlayers.fp8.FP8Recipe; default TE DelayedScaling, HYBRID, history
             1024, max, and core="fp8": cuDNN FP8 attention or a clear refusal).

With backend="te-fp8" the projections run as TransformerEngine FP8 GEMMs: q, k and v as one
GEMM (the input is quantised once; the three kernels are concatenated at run time, so the
parameter tree stays Flax's), and the output projection. Their scaling state is FP8Meta
variables beside the parameters (`fp8_qkv`, `out`; see attnlayers.fp8), and with delayed
scaling (the default recipe) so is the FP8 attention core's: `fp8_core`, the (3, L) amax
history of q, k and v its scales come from (attnlayers.backends._fp8_delayed). A training
step must carry them: `nnx.split(layer, nnx.Param, FP8Meta)`, and assign their gradients.
te-fp8 layers are self-attention layers (one input for q, k and v); cross-attention takes
backend="te".

Calls run Flax's __call__ steps in this class (`_attend`), so that they can take the arguments
below and compute q, k and v with attnlayers.projection (the same parameters, as 2-D GEMMs whose
biases XLA can fuse into the GEMM; see there for the rounding); a custom `attention_fn` runs
Flax's own __call__.

Added call arguments: `segment_ids=` (packed documents: (*batch, T) ids, 0 = padding, or a
pair (q ids, kv ids) for cross-attention; see attnlayers.attention), `max_segments=` (the most
documents a row holds; te runs B * max_segments sequences) and `sliding_window=`.

Several devices: under Flax logical axis rules (nnx.logical_axis_rules) and a mesh (jax.set_mesh), q
(B, T, N, H) is constrained to the names ("batch", "length", "heads", "head_dim") and k, v to
("batch", "length", "kv_heads", "head_dim"), so that heads split over a mesh axis stay split through
the attention (where "heads" is split and "kv_heads" is not, k and v are repeated to one head per
query head); without rules the layer adds no constraint.

Decoding (attnlayers.kv_cache says why it differs from Flax's cache):

  layer.init_cache((*batch, max_length, in_features))   # dtype: the layer's dtype (None: float32, as Flax)
  y = layer(x, decode=True)                  # x (*batch, T, in_features): T >= 1 new tokens per row
  y = layer(x, decode=True, lengths=lens)    # lens (*batch,): real tokens among the T (right padding)

The cache holds num_kv_heads heads, `cache_index` one position per sequence. A call writes
its tokens at each row's position and attends, in one attention call, to that row's cache
up to and including them (bottom-right causal); T == 1 without lengths computes exactly what
Flax's decode step computes. Decoding past `max_length` (or lengths outside [0, T]) is an error;
under jit such a row is NaN for the call and keeps its position (kv_cache says why).
A cache from Flax's own init_cache (or its state, nnx.update'd in) keeps its scalar
cache_index: every call advances all rows by T, so the state keeps its shapes under
nnx.scan / lax.scan, and lengths= is refused (it needs a position per row: use our init_cache).
"""

from __future__ import annotations

import difflib
import functools
import inspect

import jax
import jax.numpy as jnp
from flax import linen, nnx
from flax.core import spmd

from attnlayers import backends, fp8, kv_cache, projection, spec
from attnlayers.flax_attention import BackendAttention


# The Flax releases whose nnx.MultiHeadAttention.__call__ the steps below (__call__'s checks and _attend) were
# read against, by the sha256 of the method's source; tests/test_nnx.py fails on any other, so that a Flax
# release that changes those steps is read before this copy runs it.
FLAX_CALL_SOURCE_SHA256 = {
    "6dce382523b0e9d017c213ba8cd062af240f8cda45df7c42caa965d60e77bedc": "0.12.8",
    "54ec641fdb572e03862fc45bb80721d6e63277b889e0a9d7b28bc8e18b5fbedf":
        "0.12.9 and 0.12.10 (input_positions=, passed on to the attention_fn)",
    "94a34ef2b731a8e937ee92dfc13438d4a4072804f94f58b7cf34dfdea3e3bd81":
        "0.12.11 and 0.12.12 (is_causal ignored when decoding, where the cache masks)",
}


FLAX_INIT = inspect.signature(nnx.MultiHeadAttention.__init__)


class MultiHeadAttention(nnx.MultiHeadAttention):
  """Drop-in for flax.nnx.MultiHeadAttention; `backend` picks the attention kernel.

  Example::

    layer = MultiHeadAttention(num_heads=8, in_features=512, num_kv_heads=2,
                               backend="cudnn", is_causal=True, decode=False,
                               dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    y = layer(x)  # x: (B, T, 512) -> (B, T, 512)

  A custom `attention_fn` replaces the backend choice altogether, so passing one
  together with a `backend` other than "auto" is an error.
  """

  def __init__(self, *args, backend: str = backends.AUTO, is_causal: bool = False, attention_fn=None,
               fp8_recipe: fp8.FP8Recipe | None = None, sliding_window: tuple[int, int] | None = None, **kwargs):
    backends.check_name(backend)
    spec.check_is_causal(is_causal)
    # num_heads and num_kv_heads as Flax's signature binds them: keywords, or the first and fifth positional arguments
    bound = FLAX_INIT.bind_partial(self, *args, **kwargs).arguments
    if "num_heads" in bound:  # missing: Flax's own TypeError says so
      spec.check_num_heads(bound["num_heads"])
    spec.check_num_kv_heads(bound.get("num_kv_heads"))
    spec.check_features(**{name: bound.get(name) for name in ("in_features", "qkv_features", "out_features",
                                                              "in_kv_features")})
    if attention_fn is not None and backend != backends.AUTO:
      raise ValueError(f"pass either attention_fn= or backend= ({backend!r}), not both: a custom "
                       "attention_fn replaces the backend's kernel")
    if fp8_recipe is not None and backend != "te-fp8":
      raise ValueError(f"fp8_recipe= applies to backend='te-fp8' only; got backend={backend!r}")
    fp8_core = (fp8_recipe or fp8.FP8Recipe()).core
    super().__init__(*args, attention_fn=attention_fn or BackendAttention(backend, fp8_core=fp8_core), **kwargs)
    self.backend = backend if attention_fn is None else "custom attention_fn"
    self.is_causal = is_causal
    self.sliding_window = spec.check_window(sliding_window)
    self.fp8_qkv = None  # te-fp8: the fused q/k/v FP8 GEMM's scaling state (attnlayers.fp8)
    self.fp8_core = None  # te-fp8, delayed scaling: the FP8 core's q/k/v amax history (3, L), an FP8Meta
    if backend == "te-fp8":
      recipe = fp8_recipe or fp8.FP8Recipe()
      fp8.use_fp8_projections(self, recipe)
      if recipe.kind == "delayed" and recipe.core != "bf16":
        self.fp8_core = nnx.data(fp8.core_history(recipe))  # data: state, though None was assigned first

  def init_cache(self, input_shape, dtype=None):
    """Flax's init_cache with the compute dtype as default and one position per sequence.

    input_shape: (*batch, max_length, in_features). cached_key / cached_value: (*batch, max_length,
    num_kv_heads, head_dim) in `dtype` (default: the layer's dtype; with dtype=None, float32, Flax's default:
    the keys then take the inputs' dtype promoted with param_dtype, float32 for float32 inputs whatever the
    params, so param_dtype alone would round them; a dtype that is not floating or complex is refused);
    cache_index: int32 (*batch,); with a custom attention_fn, which decodes through Flax's own __call__,
    Flax's scalar index. A max_length below 1 is refused: every decode call would pass the cache's end.
    """
    source = "init_cache's dtype=" if dtype is not None else "the layer's dtype=, init_cache's default"
    dtype = (self.dtype or jnp.float32) if dtype is None else dtype
    kv_cache.check_dtype(dtype, source)
    kv_cache.check_length(input_shape[-2])
    super().init_cache(input_shape, dtype)
    if isinstance(self.attention_fn, BackendAttention):  # a custom attention_fn decodes on Flax's cache, as is
      self.cache_index = nnx.Cache(jnp.zeros(tuple(input_shape[:-2]), jnp.int32))

  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, is_causal: bool | None = None,
               decode: bool | None = None, lengths=None, segment_ids=None, sliding_window=spec.LAYER_DEFAULT,
               max_segments=None, **kwargs):
    causal = self.is_causal if is_causal is None else is_causal
    window = self.sliding_window if sliding_window is spec.LAYER_DEFAULT else spec.check_window(sliding_window)
    history = None if self.fp8_core is None else self.fp8_core[...]  # te-fp8, delayed: (3, L)
    extra = {name: x for name, x in (("segment_ids", segment_ids), ("window", window), ("max_segments", max_segments),
                                     ("fp8_amax_history", history)) if x is not None}
    if self.fp8_qkv is not None and not all(x is None or x is inputs_q for x in (inputs_k, inputs_v)):
      raise ValueError("backend='te-fp8' projects q, k and v of one input as one FP8 GEMM (self-attention); for "
                       "cross-attention (inputs_k / inputs_v other than inputs_q) use backend='te'")
    custom = not isinstance(self.attention_fn, BackendAttention)  # a custom attention_fn takes Flax's arguments only
    if not custom and kwargs.pop("input_positions", None) is not None:  # Flax 0.12.9+ hand it to the attention_fn
      raise ValueError("input_positions= is passed on to a custom attention_fn (e.g. Flax's "
                       "dot_product_attention_with_rope); the layer's own backends apply no rotary embedding. "
                       "Rotate q and k in an attention_fn of your own, or leave input_positions out")
    if not custom:
      _check_call_keywords(kwargs)
    if custom and extra:
      raise ValueError("segment_ids= and sliding windows need the layer's own backends; a custom attention_fn "
                       "takes Flax's arguments only")
    if (self.decode if decode is None else decode):
      if custom:
        if lengths is not None or inputs_q.shape[-2] != 1:
          raise ValueError("with a custom attention_fn the cache decodes one token per call, as Flax's does; "
                           "chunked prefill and lengths= need the layer's own backends")
        if self.cache_index is not None and self.cache_index.shape != ():  # Flax's dynamic_update_slice: a scalar
          raise ValueError(f"this cache has one position per row (cache_index shape {self.cache_index.shape}), as "
                           "the layer's backend path makes it; a custom attention_fn decodes through Flax's "
                           "__call__, which keeps one index for the batch and cannot use it. Make the cache with "
                           "this layer's init_cache (with a custom attention_fn it makes Flax's layout), or decode "
                           "without attention_fn")
        if self.cache_index is not None and self.cached_key is not None:  # Flax's write clamps past the end
          *batch, max_length = self.cached_key.shape[:-2]
          kv_cache.check_flax_room(self.cache_index[...], tuple(batch), max_length)
        return super().__call__(inputs_q, inputs_k, inputs_v, is_causal=False, decode=True, **kwargs)
      if segment_ids is not None:
        raise ValueError("segment_ids= with a KV cache (decode=True) is not supported: the cache keeps no segment "
                         "ids; decode each document in its own row (lengths= gives each row its own length)")
      return self._attend(inputs_q, inputs_k, inputs_v, cache=True, lengths=lengths, extra=extra, **kwargs)
    if lengths is not None:
      raise ValueError("lengths= counts the new tokens of a decode call; pass decode=True (or a mask otherwise)")
    if custom:
      return super().__call__(inputs_q, inputs_k, inputs_v, is_causal=causal, decode=decode, **kwargs)
    if decode is None and self.decode is None:  # Flax's own check, and its words
      raise ValueError("No `decode` argument was provided to MultiHeadAttention as either a __call__ argument, "
                       "class attribute, or nnx.flag.")
    # Flax's __call__ steps, here: its projections cannot take segment_ids / windows / FP8, and
    # attnlayers.projection writes q/k/v so that XLA can fuse their biases into the GEMMs
    return self._attend(inputs_q, inputs_k, inputs_v, cache=False, is_causal=causal, extra=extra, **kwargs)

  def _attend(self, inputs_q, inputs_k, inputs_v, *, cache: bool, extra: dict, lengths=None, is_causal=False,
              mask=None, deterministic=None, rngs=None, sow_weights: bool = False, out_sharding=None,
              qkv_sharding=None):
    """Flax's __call__ steps (projections, dropout, attention, output) with attnlayers' extra arguments.

    cache: write the new tokens into the KV cache and attend to the row's cache up to them (module
    docstring); else plain self-/cross-attention with `is_causal`. extra: segment_ids / window / max_segments.
    """
    if inputs_k is None and inputs_v is not None:
      raise ValueError("`inputs_k` cannot be None if `inputs_v` is not None. To have both `inputs_k` and `inputs_v` "
                       "be the same value, pass in the value to `inputs_k` and leave `inputs_v` as None.")
    inputs_k = inputs_q if inputs_k is None else inputs_k
    inputs_v = inputs_k if inputs_v is None else inputs_v
    if inputs_q.shape[-1] != self.in_features:
      raise ValueError(f"Incompatible input dimension, got {inputs_q.shape[-1]} but module expects {self.in_features}.")
    for name, x in (("inputs_k", inputs_k), ("inputs_v", inputs_v)):
      if self.fp8_qkv is None and x.shape[-1] != self.in_kv_features:  # else a dot_general shape error names neither
        raise ValueError(f"Incompatible {name} dimension, got {x.shape[-1]} but module expects in_kv_features "
                         f"{self.in_kv_features}.")
    if cache and (self.cached_key is None or self.cached_value is None or self.cache_index is None):
      raise ValueError("Autoregressive cache not initialized, call ``init_cache`` first.")
    if self.fp8_qkv is not None:
      if qkv_sharding is not None:
        raise ValueError("backend='te-fp8' takes no qkv_sharding (its fused FP8 GEMM); shard the inputs instead")
      query, key, value = self._fused_qkv(inputs_q)
    else:
      query = projection.heads(self.query, inputs_q, qkv_sharding)  # (*batch, T, N, H)
      key = projection.heads(self.key, inputs_k, qkv_sharding)  # (*batch, S, K, H)
      value = projection.heads(self.value, inputs_v, qkv_sharding)
    if self.normalize_qk:
      query, key = self.query_ln(query), self.key_ln(key)
    query, key, value = _on_mesh(query, key, value, cache=cache)
    attend = {"is_causal": is_causal}
    if cache:
      if query.shape[:-2] != key.shape[:-2]:
        raise ValueError(f"the queries ({tuple(query.shape)}) and keys ({tuple(key.shape)}) of a decode call must "
                         "share (*batch, T): T new tokens per row")
      key, value, index, attend = kv_cache.append(
          self.cached_key[...], self.cached_value[...], self.cache_index[...], key, value, lengths)
    dropout_rng = None
    if self.dropout_rate > 0.0:
      deterministic = self.deterministic if deterministic is None else deterministic
      if deterministic is None:
        raise ValueError("No `deterministic` argument was provided to MultiHeadAttention as either a __call__ "
                         "argument, class attribute, or nnx.flag.")
      if not deterministic:
        stream = self.rngs if rngs is None else (rngs.dropout if isinstance(rngs, nnx.Rngs) else rngs)
        if stream is None:
          raise ValueError("'rngs' must be provided to __call__ method if MultiHeadAttention instance is defined "
                           "with keep_rngs=False.")
        dropout_rng = stream()
    x = self.attention_fn(
        query, key, value, mask=mask, dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
        broadcast_dropout=self.broadcast_dropout, deterministic=dropout_rng is None, dtype=self.dtype,
        precision=self.precision, module=self if sow_weights else None, **attend, **extra)
    out = self.out(x, out_sharding=out_sharding)
    if cache:  # written last, so a call that raises anywhere above leaves the cache as it was
      # the index keeps its shape: (*batch,), or the scalar of a cache Flax's own init_cache made
      self.cached_key[...], self.cached_value[...], self.cache_index[...] = key, value, index
    return out

  def _fused_qkv(self, x):
    """q (*batch, T, N, H), k and v (*batch, T, K, H) from one FP8 GEMM of x (*batch, T, D) with the three
    kernels side by side, (D, (N + 2K) H), and the biases the same way; what the three projections compute."""
    projs = (self.query, self.key, self.value)
    heads = [p.kernel.shape[1:] for p in projs]  # (N, H), (K, H), (K, H)
    promote = functools.partial(self.query.promote_dtype, dtype=self.query.dtype)  # as the query's call promotes
    promoted = [promote((x, p.kernel[...], None if p.bias is None else p.bias[...])) for p in projs]
    # each (x, kernel (D, n, H), bias (n, H) | None) in the compute dtype, cast before they are joined
    x = promoted[0][0]
    kernel = jnp.concatenate([k.reshape(k.shape[0], -1) for _, k, _ in promoted], axis=1)  # (D, (N + 2K) H)
    bias = jnp.concatenate([b.reshape(-1) for _, _, b in promoted]) if self.use_bias else None  # ((N + 2K) H,)
    y = projection.dense(x, kernel, bias, dot_general=self.fp8_qkv, precision=self.query.precision)  # (*batch, T, (N + 2K) H)
    sizes = [n * h for n, h in heads]
    parts = jnp.split(y, [sizes[0], sizes[0] + sizes[1]], axis=-1)
    return tuple(part.reshape(*part.shape[:-1], *hs) for part, hs in zip(parts, heads))  # (*batch, T, heads, H)


def _on_mesh(query, key, value, *, cache: bool):
  """q, k and v constrained where a mesh's logical axis rules put their heads (_placed). Where the rules split
  query heads but hold key/value heads whole (a mesh axis that does not divide them, GQA/MQA), k and v are
  repeated to one head per query head (head n reads kv head n // (N / K), as grouped attention does), so that
  each device attends with its own query heads; grouping them instead would gather the scores across the
  axis. Not in decode calls, whose cache keeps K heads."""
  rules = dict(spmd.get_logical_axis_rules())
  grouped = query.ndim == 4 and key.shape[-2] < query.shape[-2]
  if grouped and not cache and rules.get("heads") and not rules.get("kv_heads") and \
      not jax.sharding.get_abstract_mesh().empty:
    group = query.shape[-2] // key.shape[-2]
    key, value = jnp.repeat(key, group, axis=-2), jnp.repeat(value, group, axis=-2)  # (B, S, N, H)
    return _placed(query, "heads"), _placed(key, "heads"), _placed(value, "heads")
  return _placed(query, "heads"), _placed(key, "kv_heads"), _placed(value, "kv_heads")


def _placed(x, heads: str):
  """x (B, T, heads, H) where Flax's logical axis rules put the names ("batch", "length", `heads`, "head_dim") on
  a mesh (nnx.logical_axis_rules inside a mesh context), so that the partitioner keeps each device's heads on it
  through the attention; as it is with no rules or no mesh, where the rules leave out one of the names, and with
  other batch dims."""
  if x.ndim != 4:
    return x
  return linen.with_logical_constraint(x, ("batch", "length", heads, "head_dim"),
                                       fallback=linen.spmd.RulesFallback.NO_CONSTRAINT)


def _keywords(method, internal: set[str]) -> list[str]:
  return [name for name, p in inspect.signature(method).parameters.items()
          if p.kind is not p.VAR_KEYWORD and name not in internal]


# What a call takes by keyword: __call__'s own, and Flax's, which __call__ hands on to _attend
CALL_KEYWORDS = tuple(_keywords(MultiHeadAttention.__call__, {"self", "inputs_q"}) + _keywords(
    MultiHeadAttention._attend, {"self", "inputs_q", "inputs_k", "inputs_v", "cache", "extra", "lengths", "is_causal"}))


def _check_call_keywords(kwargs: dict) -> None:
  """A keyword no call takes raises as Python raises it for Flax's class, naming __call__ (not the private _attend
  that would meet it first), and the nearest keyword a call takes."""
  for name in kwargs:
    if name not in CALL_KEYWORDS:
      near = difflib.get_close_matches(name, CALL_KEYWORDS, n=1)
      raise TypeError(f"MultiHeadAttention.__call__() got an unexpected keyword argument {name!r}"
                      + (f"; did you mean {near[0]!r}?" if near else f"; it takes {', '.join(CALL_KEYWORDS)}"))
