"""Bad `attention()` / layer / `models.GPTConfig` inputs raise one named error; the backend contract's option rules."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlayers
from attnlayers import spec
from attnlayers.backends import _fp8_core
from attnlayers.nnx import MultiHeadAttention

q = jax.random.normal(jax.random.key(0), (2, 8, 4, 16))  # (B, T, N, H)
kv = jax.random.normal(jax.random.key(1), (2, 8, 2, 16))  # (B, S, K, H)


@pytest.mark.parametrize("scale, error, message", [
    (float("nan"), ValueError, "scale must be a finite number > 0"),
    (float("inf"), ValueError, "scale must be a finite number > 0"),
    (-1.0, ValueError, "scale must be a finite number > 0"),
    ("0.5", TypeError, "scale must be a real number"),
    (True, TypeError, r"scale must be a real number \(a bool is not one"),
    (np.bool_(True), TypeError, r"scale must be a real number \(a bool is not one"),
    (np.array(True), TypeError, r"scale must be a real number \(a bool is not one"),
])
def test_bad_scale(scale, error, message):
  with pytest.raises(error, match=message):
    attnlayers.attention(q, kv, kv, scale=scale)


def test_traced_scale_says_it_is_static():
  with pytest.raises(TypeError, match="scale must be a Python number known when the call is traced"):
    jax.jit(lambda s: attnlayers.attention(q, kv, kv, scale=s))(0.5)


@pytest.mark.parametrize("value", ["no", 1, None])
def test_is_causal_must_be_bool(value):
  with pytest.raises(TypeError, match="is_causal must be True or False"):
    attnlayers.attention(q, kv, kv, is_causal=value)


@pytest.mark.parametrize("value", ["yes", 1])
def test_a_layer_refuses_a_non_bool_is_causal_where_it_is_made(value):
  """As the call does, and as the layers refuse a bad window or backend: at construction, not at the first call."""
  with pytest.raises(TypeError, match="is_causal must be True or False"):
    MultiHeadAttention(num_heads=4, in_features=32, is_causal=value, decode=False, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="is_causal must be True or False"):
    attnlayers.linen.MultiHeadDotProductAttention(num_heads=4, is_causal=value)


def test_numpy_bool_is_causal_is_accepted():
  np.testing.assert_array_equal(attnlayers.attention(q, kv, kv, is_causal=np.bool_(True)),
                                attnlayers.attention(q, kv, kv, is_causal=True))


def test_explain_reports_the_dtype_jax_runs_numpy_float64_as():
  """With x64 off (jax's default) float64 numpy inputs run as float32; explain() says float32, as the output is."""
  x = np.zeros((2, 8, 4, 16), np.float64)
  plan = attnlayers.explain("auto", x, x, x)
  assert not jax.config.jax_enable_x64 and attnlayers.attention(x, x, x).dtype == jnp.float32
  assert plan.call.dtype == np.float32 and "float32" in str(plan) and "float64" not in str(plan)


@pytest.mark.parametrize("shape_q, shape_kv, named", [
    ((2, 8, 4, 0), (2, 8, 2, 0), "H=0"), ((2, 8, 4, 16), (2, 0, 2, 16), "S=0"), ((2, 8, 4, 16), (2, 8, 0, 16), "K=0"),
    ((2, 0, 4, 16), (2, 8, 2, 16), r"T=0 \(attention over no queries"),
])
def test_zero_sized_dims(shape_q, shape_kv, named):
  with pytest.raises(ValueError, match=f"must have no zero-sized dim; got .*{named}"):
    attnlayers.attention(jnp.zeros(shape_q), jnp.zeros(shape_kv), jnp.zeros(shape_kv))


def test_python_list_is_named():
  with pytest.raises(TypeError, match=r"q must be an array .*got list. Wrap it with jnp.asarray"):
    attnlayers.attention(np.zeros((2, 8, 4, 16)).tolist(), kv, kv)


@pytest.mark.parametrize("kv_heads", [0, -2])
def test_layer_kv_heads_must_be_positive(kv_heads):
  with pytest.raises(ValueError, match="num_kv_heads"):
    MultiHeadAttention(4, 64, num_kv_heads=kv_heads, decode=False, rngs=nnx.Rngs(0))


def test_additive_float_mask_is_refused_with_a_pointer_to_what_works_there():
  """A layer's refusal of an additive mask names what works on a layer: the boolean mask it stands for (which then
  runs), or the functional core's bias=. It said the mask "goes in bias= instead", which no layer takes (TypeError);
  attnlayers.attention(), which takes bias=, keeps pointing there."""
  import attnlayers.linen
  layer = MultiHeadAttention(4, 64, decode=False, backend="xla", rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(2), (2, 8, 64))
  additive = jnp.where(jnp.tril(jnp.ones((8, 8), bool)), 0.0, -jnp.inf)  # PyTorch-style
  linen_layer = attnlayers.linen.MultiHeadDotProductAttention(num_heads=4, backend="xla")
  params = linen_layer.init(jax.random.key(0), x)
  for call in (lambda mask: layer(x, mask=mask), lambda mask: linen_layer.apply(params, x, mask=mask)):
    with pytest.raises(ValueError) as err:
      call(additive)
    message = str(err.value)
    assert "goes in bias=" not in message and "mask=(additive_mask == 0)" in message, message
    assert "attnlayers.attention(q, k, v, bias=" in message, message
    np.testing.assert_array_equal(call(additive == 0), call(jnp.tril(jnp.ones((8, 8), bool))))  # the hint runs
  np.testing.assert_array_equal(layer(x, mask=additive == 0), layer(x, is_causal=True))
  flax_style = jnp.tril(jnp.ones((8, 8), jnp.float32))  # 0/1 float masks keep working
  np.testing.assert_array_equal(layer(x, mask=flax_style), layer(x, is_causal=True))
  with pytest.raises(ValueError, match=r"an additive mask \(0 / -inf\) goes in bias="):  # where bias= works
    attnlayers.attention(q, kv, kv, mask=additive)


def test_fp8_core_mode_is_checked():
  with pytest.raises(ValueError, match="fp8_core must be one of 'fp8', 'fp8-or-bf16', 'bf16'"):
    attnlayers.attention(q, kv, kv, backend="te-fp8", fp8_core="maybe")


def test_precision_is_honoured_or_refused_never_dropped():
  highest = jax.lax.Precision.HIGHEST
  plan = attnlayers.explain("xla", q, kv, kv, precision=highest)  # float32: xla cannot apply it
  assert not plan.ok and "cannot apply precision=" in str(plan)
  assert attnlayers.explain("auto", q, kv, kv, precision=highest).chosen == "naive"
  assert attnlayers.explain("xla", q, kv, kv, precision=jax.lax.Precision.DEFAULT).ok
  half = q.astype(jnp.bfloat16), kv.astype(jnp.bfloat16), kv.astype(jnp.bfloat16)
  assert attnlayers.explain("xla", *half, precision=highest).ok  # bf16 products are exact at any precision
  layer = MultiHeadAttention(4, 64, decode=False, backend="xla", precision=highest, rngs=nnx.Rngs(0))
  with pytest.raises(attnlayers.BackendUnavailableError, match="cannot apply precision"):
    layer(jnp.ones((1, 8, 64)))  # the layer's precision reaches the core


def test_a_dot_algorithm_preset_is_a_precision_naive_applies_and_fused_backends_refuse():
  """precision= takes what jax's PrecisionLike takes, a DotAlgorithmPreset too (Flax's layer runs with one): naive
  applies it, xla refuses float32 naming it, auto picks naive, and its DEFAULT asks for nothing. Planning read a
  preset as a jax.lax.Precision and raised "DotAlgorithmPreset.F32_F32_F32 is not a valid Precision", naive too."""
  preset = jax.lax.DotAlgorithmPreset.F32_F32_F32
  np.testing.assert_allclose(attnlayers.attention(q, kv, kv, backend="naive", precision=preset),
                             attnlayers.attention(q, kv, kv, backend="naive"), rtol=1e-6, atol=1e-6)
  # applied: XLA's CPU gives the same numbers with or without it, the lowered matmuls name its algorithm
  naive = jax.jit(lambda q, kv: attnlayers.attention(q, kv, kv, backend="naive", precision=preset))
  assert _algorithms(naive.lower(q, kv).as_text()) == (2, 2)  # (B, N, T, S) scores and their values
  plan = attnlayers.explain("xla", q, kv, kv, precision=preset)
  assert not plan.ok and "cannot apply precision=F32_F32_F32" in str(plan), str(plan)
  assert attnlayers.explain("auto", q, kv, kv, precision=preset).chosen == "naive"
  assert attnlayers.explain("xla", q, kv, kv, precision=jax.lax.DotAlgorithmPreset.DEFAULT).ok
  x = jax.random.normal(jax.random.key(2), (1, 8, 64))
  flax = nnx.MultiHeadAttention(4, 64, decode=False, precision=preset, rngs=nnx.Rngs(0))
  layer = MultiHeadAttention(4, 64, decode=False, precision=preset, rngs=nnx.Rngs(0))
  np.testing.assert_allclose(layer(x), flax(x), rtol=1e-5, atol=1e-6)  # auto: naive, the layer's preset applied
  lowered = nnx.jit(lambda m, x: m(x)).lower(layer, x).as_text()
  assert _algorithms(lowered) == (6, 6), lowered  # q, k, v, out projections and attention's two matmuls


@pytest.mark.parametrize("algorithm", [jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32,
                                       jax.lax.DotAlgorithmPreset.F16_F16_F32, jax.lax.DotAlgorithmPreset.BF16_BF16_BF16,
                                       jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
                                       jax.lax.DotAlgorithm(jnp.float16, jnp.float16, jnp.float32)],
                         ids=["ANY_F8_ANY_F8_F32", "F16_F16_F32", "BF16_BF16_BF16", "BF16_BF16_F32", "DotAlgorithm"])
def test_fused_backends_refuse_a_dot_algorithm_on_half_inputs_too(algorithm):
  """bf16 products accumulate exactly in float32 at any Precision level, so fused backends take one on half inputs;
  a dot algorithm also sets input types and accumulation (f8 inputs, f16 on bf16, a bf16 sum), which their kernels
  never apply. xla's plan said ok and its fused op ran without the algorithm."""
  half = q.astype(jnp.bfloat16), kv.astype(jnp.bfloat16), kv.astype(jnp.bfloat16)
  for backend in ("xla", "cudnn", "te"):
    plan = attnlayers.explain(backend, *half, precision=algorithm)
    assert not plan.ok and f"{backend} cannot apply precision={algorithm}: a dot algorithm" in str(plan), str(plan)
    assert "only 'naive' applies it" in str(plan)
  plan = attnlayers.explain("auto", *half, precision=algorithm)
  assert plan.chosen == "naive" and f"xla: xla cannot apply precision={algorithm}" in str(plan), str(plan)
  assert attnlayers.explain("xla", *half, precision=jax.lax.DotAlgorithmPreset.DEFAULT).ok


def _algorithms(hlo: str) -> tuple[int, int]:
  """(matmuls that name a dot algorithm, matmuls) in lowered StableHLO text."""
  return hlo.count("algorithm = <"), hlo.count("stablehlo.dot_general")


def test_every_backend_has_a_named_minimum_compute_capability():
  from attnlayers import backends
  assert {n: b.min_cc for n, b in backends.REGISTRY.items()} == {
      "naive": None, "xla": None, "cudnn": (8, 0), "te": (8, 0), "te-fp8": (8, 9), "splash": None}


def test_fp8_guard_checks_the_functions_the_primitives_run(monkeypatch):
  _fp8_core.api_problem.cache_clear()
  assert _fp8_core.api_problem() is None  # this jax has them as we bind them
  fa = _fp8_core._fa
  impl = fa._dot_product_attention_fp8_fwd_p_wrapper.impl
  params = list(inspect.signature(impl).parameters.values())
  swapped = params[:]
  swapped[3], swapped[4] = swapped[4], swapped[3]  # descale_q <-> descale_k: same shapes, wrong meaning
  fake = lambda *a, **k: None
  fake.__signature__ = inspect.Signature(swapped)
  fake.__name__ = impl.__name__
  monkeypatch.setattr(fa._dot_product_attention_fp8_fwd_p_wrapper, "impl", fake)
  monkeypatch.setattr(fa, "_dot_product_attention_fp8_fwd_impl", fake)
  _fp8_core.api_problem.cache_clear()
  try:
    problem = _fp8_core.api_problem()
  finally:
    monkeypatch.undo()
    _fp8_core.api_problem.cache_clear()
  assert problem and "binds positionally" in problem and "descale_k" in problem, problem


def test_traced_float_mask_with_other_values_poisons_the_output():
  layer = MultiHeadAttention(4, 64, decode=False, backend="xla", rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(2), (2, 8, 64))
  run = nnx.jit(lambda layer, x, mask: layer(x, mask=mask))
  additive = jnp.where(jnp.tril(jnp.ones((8, 8), bool)), 0.0, -jnp.inf)
  assert bool(jnp.all(jnp.isnan(run(layer, x, additive))))  # cannot raise under jit: never silently inverted
  binary = jnp.tril(jnp.ones((8, 8), jnp.float32))
  np.testing.assert_allclose(run(layer, x, binary), layer(x, is_causal=True), rtol=1e-6, atol=1e-6)


def test_float_mask_a_jit_closes_over_is_checked_as_a_concrete_one():
  """A 0/1 float mask that a jitted function closes over (not an argument: not a tracer) runs under jit, for the
  nnx and the linen layer, as Flax's layers run it; an additive one raises there as it does outside jit."""
  import attnlayers.linen
  from flax import linen as nn
  layer = MultiHeadAttention(4, 64, decode=False, backend="xla", rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(2), (2, 8, 64))
  binary = nn.make_causal_mask(jnp.ones((2, 8)))  # Flax's helper: float32 0/1
  np.testing.assert_allclose(nnx.jit(lambda layer, x: layer(x, mask=binary))(layer, x), layer(x, is_causal=True),
                             rtol=1e-6, atol=1e-6)
  additive = jnp.where(jnp.tril(jnp.ones((8, 8), bool)), 0.0, -jnp.inf)[None, None]  # (1, 1, T, S): used as given
  with pytest.raises(ValueError, match="bias="):
    nnx.jit(lambda layer, x: layer(x, mask=additive))(layer, x)
  linen_layer = attnlayers.linen.MultiHeadDotProductAttention(num_heads=4, backend="xla")
  params = linen_layer.init(jax.random.key(0), x)
  np.testing.assert_allclose(jax.jit(lambda p, x: linen_layer.apply(p, x, mask=binary))(params, x),
                             linen_layer.apply(params, x, mask=binary), rtol=1e-6, atol=1e-6)


def test_fp8_unavailable_is_a_backend_unavailable_error():
  from attnlayers.fp8 import FP8Unavailable
  err = FP8Unavailable(["no GPU here"])
  assert isinstance(err, attnlayers.BackendUnavailableError)
  assert err.backend == "te-fp8" and err.reasons == ("no GPU here",) and "no GPU here" in str(err)


def test_te_fp8_refuses_weights_and_dropout_with_either_core(monkeypatch):
  """On a device where the FP8 core qualifies, te-fp8 must still refuse what no fused kernel does."""
  from attnlayers import device as device_lib
  from attnlayers.backends import te_fp8
  h200 = device_lib.DeviceInfo("gpu", "NVIDIA H200", (9, 0), 91900)
  monkeypatch.setattr(device_lib, "of", lambda *arrays: h200)
  monkeypatch.setattr(device_lib, "has_module", lambda name: True)
  x = jnp.zeros((2, 128, 4, 128), jnp.bfloat16)  # an FP8-core shape

  def unmet(**kwargs):  # te-fp8's own answer (plan() would also ask te, which imports TransformerEngine)
    dropout = dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)) if kwargs.pop("dropout", False) else {}
    return te_fp8.unmet(spec.describe(x, x, x, is_causal=True, **dropout, **kwargs))
  assert unmet() == []  # the call itself runs on the FP8 core
  for kwargs, reason in ((dict(return_weights=True), "never materialises"), (dict(dropout=True), "no dropout")):
    for mode in ("fp8", "fp8-or-bf16"):
      assert any(reason in r for r in unmet(fp8_core=mode, **kwargs)), (kwargs, mode)
  assert any("cannot apply precision" in r for r in unmet(precision=jax.lax.Precision.HIGHEST))


@pytest.mark.parametrize("precision, dtype, which", [
    (jax.lax.Precision.HIGHEST, jnp.bfloat16, "the FP8 core quantises"),  # the bf16 core would apply it
    (jax.lax.Precision.HIGHEST, jnp.float32, "to float32 attention matmuls"),
    (jax.lax.DotAlgorithmPreset.BF16_BF16_F32, jnp.bfloat16, "a dot algorithm"),
    (jax.lax.DotAlgorithmPreset.BF16_BF16_F32, jnp.float32, "a dot algorithm"),
], ids=["HIGHEST-bf16", "HIGHEST-f32", "preset-bf16", "preset-f32"])
def test_te_fp8_names_a_precision_refusal_once(precision, dtype, which):
  """te-fp8 refused a precision that no core of it applies (a dot algorithm; a level on float32), and its FP8 core
  refused it again, adding 'pass fp8_core='fp8-or-bf16'', whose bf16 core would not apply it either."""
  x = jnp.zeros((2, 128, 4, 128), dtype)
  reasons = attnlayers.explain("te-fp8", x, x, x, precision=precision).unmet["te-fp8"]
  named = [r for r in reasons if f"precision={precision}" in r]
  assert len(named) == 1 and which in named[0], reasons
  assert len(set(reasons)) == len(reasons), reasons


@pytest.mark.parametrize("args, kwargs", [((4, 64), dict(num_kv_heads=True)), ((4, 64), dict(num_kv_heads=np.True_)),
                                          ((4, 64, None, None, 0), {}), ((4, 64, None, None, True), {})],
                         ids=["True", "numpy-True", "positional-0", "positional-True"])
def test_nnx_kv_heads_must_be_a_positive_int_however_given(args, kwargs):
  """num_kv_heads=True ran as one kv head (MQA): bool is an int to Python, not a head count. Given as Flax's fifth
  positional argument it was not checked at all (0 raised ZeroDivisionError inside Flax)."""
  with pytest.raises(ValueError, match="num_kv_heads must be a positive int"):
    MultiHeadAttention(*args, decode=False, rngs=nnx.Rngs(0), **kwargs)


@pytest.mark.parametrize("kv_heads", [0, -2, True, np.True_, 2.0])
def test_linen_kv_heads_must_be_positive(kv_heads):
  import attnlayers.linen as al
  layer = al.MultiHeadDotProductAttention(num_heads=4, num_kv_heads=kv_heads)
  with pytest.raises(ValueError, match="num_kv_heads must be a positive int"):
    layer.init(jax.random.key(0), jnp.ones((1, 8, 64)))


@pytest.mark.parametrize("x, ok", [(4, True), (np.int64(4), True), (np.uint8(4), True), (-1, True), (True, False),
                                   (np.True_, False), (4.0, False), (np.float32(4), False), ("4", False), (None, False)],
                         ids=["int", "int64", "uint8", "negative", "True", "numpy-True", "float", "float32", "str", "None"])
def test_is_integer_takes_numpy_ints_and_refuses_bools(x, ok):
  """The one "an integer, not a bool" check of attnlayers, models and train (num_kv_heads, window, max_segments,
  FP8Recipe.amax_history_len, GPTConfig.window, the loss's chunk, generate's seed, top_k and token counts)."""
  assert spec.is_integer(x) is ok


@pytest.mark.parametrize("kv_heads", [np.int64(2), np.int32(2)], ids=["int64", "int32"])
def test_nnx_kv_heads_takes_a_numpy_int(kv_heads):
  """num_kv_heads=np.int64(2) was refused as 'not a positive int', though window= and max_segments= took numpy's
  ints; it now builds the layer an int 2 builds."""
  x = jax.random.normal(jax.random.key(2), (2, 8, 64))
  given, plain = (MultiHeadAttention(4, 64, num_kv_heads=k, decode=False, backend="xla", rngs=nnx.Rngs(0))
                  for k in (kv_heads, 2))
  assert given.key.kernel.shape == plain.key.kernel.shape == (64, 2, 16)
  np.testing.assert_array_equal(given(x), plain(x))


def test_linen_kv_heads_takes_a_numpy_int():
  import attnlayers.linen as al
  x = jax.random.normal(jax.random.key(2), (2, 8, 64))
  given, plain = (al.MultiHeadDotProductAttention(num_heads=4, num_kv_heads=k, backend="xla") for k in (np.int64(2), 2))
  params = given.init(jax.random.key(0), x)
  assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, plain.init(jax.random.key(0), x))
  np.testing.assert_array_equal(given.apply(params, x), plain.apply(params, x))


def test_a_traced_call_is_described_and_planned_once_and_recorded(monkeypatch):
  """attention() builds one Call and one Plan per call, which recorded_plans() collects from a jit's trace; the
  backend runs the plan's own Call and decision."""
  from attnlayers import core
  described, planned, ran = [], [], []
  real_describe, real_plan, real_run = spec.describe, core.plan, attnlayers.backends.REGISTRY["xla"].run
  monkeypatch.setattr(spec, "describe", lambda *a, **kw: described.append(1) or real_describe(*a, **kw))
  monkeypatch.setattr(core, "plan", lambda *a: planned.append(real_plan(*a)) or planned[-1])
  monkeypatch.setitem(attnlayers.backends.REGISTRY, "xla", attnlayers.backends.REGISTRY["xla"].__class__(
      **{**vars(attnlayers.backends.REGISTRY["xla"]), "run": lambda *a: ran.append(a[3:]) or real_run(*a)}))
  with core.recorded_plans() as plans:
    jax.jit(lambda q, kv: attnlayers.attention(q, kv, kv, backend="xla", is_causal=True)).lower(q, kv)
  assert len(described) == len(planned) == len(plans) == len(ran) == 1
  assert plans[0] is planned[0] and ran[0] == (plans[0].call, plans[0].decision)
  assert plans[0].call.is_causal and plans[0].chosen == "xla"


def test_a_scale_past_float32_is_refused():
  """scale=1e308 is finite, but inf in the float32 scores: every output was NaN, with only numpy's overflow warning."""
  with pytest.raises(ValueError, match=r"scale must be at most float32's largest number \(3.403e\+38\)"):
    attnlayers.attention(q, kv, kv, scale=1e308)
  attnlayers.attention(q, kv, kv, scale=1e30)  # large, and a float32


def test_attention_names_a_shape_given_for_values():
  """A jax.ShapeDtypeStruct, which explain() takes, failed deep in a backend: 'float() argument must be a string or a
  real number, not ShapeDtypeStruct'."""
  shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
  with pytest.raises(TypeError, match="q is a jax.ShapeDtypeStruct, a shape without values: attention"):
    attnlayers.attention(shape, kv, kv)
  assert attnlayers.explain("auto", shape, kv, kv).ok  # explain() takes it
  assert jax.eval_shape(lambda x: attnlayers.attention(x, kv, kv), shape).shape == q.shape


@pytest.mark.parametrize("rng", [0, "key", np.zeros(2, np.float32)], ids=["int", "str", "float-array"])
def test_dropout_rng_must_be_a_key(rng):
  """An int reached jax's PRNG code: 'JAX encountered invalid PRNG key data ... Got 0', naming no argument."""
  with pytest.raises(TypeError, match="dropout_rng must be a jax PRNG key, e.g. jax.random.key"):
    attnlayers.attention(q, kv, kv, dropout_rate=0.1, dropout_rng=rng)


@pytest.mark.parametrize("rng", [jax.random.key(0), jax.random.PRNGKey(0)], ids=["typed", "raw"])
def test_dropout_takes_typed_and_raw_keys(rng):
  assert attnlayers.attention(q, kv, kv, dropout_rate=0.1, dropout_rng=rng).shape == q.shape


@pytest.mark.parametrize("kwargs", [dict(in_features=0), dict(in_features="32"), dict(in_features=32.0),
                                    dict(in_features=32, qkv_features=0), dict(in_features=32, out_features=-1),
                                    dict(in_features=32, in_kv_features=0)],
                         ids=["zero", "str", "float", "qkv-0", "out-negative", "in-kv-0"])
def test_nnx_feature_sizes_must_be_positive_ints(kwargs):
  """in_features=0 ended in Flax's initializer's ZeroDivisionError; '32' in a TypeError from Flax's formatting of its
  own message ('not all arguments converted during string formatting')."""
  name = [k for k, v in kwargs.items() if not (v == 32 and type(v) is int)][0]
  with pytest.raises(ValueError, match=f"{name} must be a positive int"):
    MultiHeadAttention(num_heads=4, decode=False, rngs=nnx.Rngs(0), **kwargs)


def test_nnx_keys_and_values_of_other_features_are_named():
  """inputs_k of another width failed in dot_general ('contracting dimensions to have the same shape')."""
  layer = MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(0))
  x = jnp.ones((2, 8, 32))
  with pytest.raises(ValueError, match="Incompatible inputs_k dimension, got 16 but module expects in_kv_features 32"):
    layer(x, jnp.ones((2, 8, 16)))
  with pytest.raises(ValueError, match="Incompatible inputs_v dimension, got 16"):
    layer(x, x, jnp.ones((2, 8, 16)))
  cross = MultiHeadAttention(4, 32, in_kv_features=16, decode=False, rngs=nnx.Rngs(0))
  assert cross(x, jnp.ones((2, 8, 16))).shape == (2, 8, 32)


@pytest.mark.parametrize("field, value, expected", [
    ("n_layer", 0, "an int >= 1"), ("n_head", 0, "an int >= 1"), ("vocab_size", 0, "an int >= 1"),
    ("seq_len", 0, "an int >= 1"), ("d_model", -768, "an int >= 1"), ("mlp_ratio", 0, "an int >= 1"),
    ("n_layer", "4", "an int >= 1"), ("n_kv_head", 0, "an int >= 1, or None for n_head"),
    ("max_segments", 0, "an int >= 1, or None for seq_len"), ("dropout", 1.5, r"a number in \[0, 1\)"),
    ("dropout", True, r"a number in \[0, 1\)"), ("causal", "yes", "True or False"),
    ("tie_embeddings", 1, "True or False"), ("backend", "flash", "one of auto, naive, xla, cudnn, te, te-fp8, splash"),
    ("fp8_core", "maybe", "one of fp8, fp8-or-bf16, bf16"), ("dtype", "float99", "a floating dtype's name, e.g. 'bfloat16' or 'float32'"),
    ("param_dtype", "int32", "a floating dtype's name, e.g. 'bfloat16' or 'float32'"),
])
def test_gpt_config_refuses_a_field_of_the_wrong_kind_naming_it(field, value, expected):
  """These were accepted (and failed, if at all, when the model was built or run), or ended in a ZeroDivisionError
  (n_head 0), a TypeError (n_layer '4'), or a window_pattern message (n_layer 0); n_kv_head 0 built an MHA model."""
  import models
  with pytest.raises(attnlayers.ArgumentError, match=f"{field} must be {expected}; got {value!r}") as e:
    models.GPTConfig(**{field: value})
  assert e.value.arguments == (field,)


def test_gpt_config_takes_numpy_ints_and_dtype_objects():
  import models
  cfg = models.GPTConfig(n_layer=np.int64(2), dtype=jnp.float32, param_dtype="bfloat16", dropout=0.1)
  assert cfg.n_layer == 2
