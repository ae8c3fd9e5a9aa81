"""attnlayers.nnx.MultiHeadAttention against flax.nnx.MultiHeadAttention and the float64 reference."""

import hashlib
import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax
from flax import nnx

import attnlayers
from attnlayers import fp8
from attnlayers.fp8 import OPERANDS as FP8_OPERANDS
from attnlayers.fp8 import FP8Meta, FP8Recipe, FP8Unavailable
from attnlayers.flax_attention import BackendAttention
from attnlayers.nnx import FLAX_CALL_SOURCE_SHA256, MultiHeadAttention
from tests import cases, reference

D = 32  # model width


def pair(**kwargs):
  """(ours, Flax's) built from the same arguments and rngs."""
  args = dict(num_heads=4, in_features=D, decode=False) | kwargs
  backend = args.pop("backend", "xla")
  return MultiHeadAttention(**args, backend=backend, rngs=nnx.Rngs(0)), nnx.MultiHeadAttention(**args, rngs=nnx.Rngs(0))


def x_and_mask(shape=(2, 8)):
  x = jax.random.normal(jax.random.key(1), (*shape, D))
  mask = jax.random.bernoulli(jax.random.key(2), 0.7, (*shape[:-1], 1, shape[-1], shape[-1])).at[..., 0].set(True)
  return x, mask.astype(jnp.float32)  # Flax-style float mask, nonzero = attend


def params_of(layer):
  return nnx.to_pure_dict(nnx.state(layer, nnx.Param))


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_equals_flax_from_identical_init(kv_heads, causal, masked):
  ours, flax = pair(num_kv_heads=kv_heads)
  jax.tree.map(np.testing.assert_array_equal, params_of(ours), params_of(flax))
  x, mask = x_and_mask()
  mask = mask if masked else None
  np.testing.assert_array_equal(ours(x, mask=mask, is_causal=causal), flax(x, mask=mask, is_causal=causal))


def test_equals_flax_with_options():
  """normalize_qk, separate in/out/qkv sizes, cross attention, bfloat16 compute, two batch dims."""
  kwargs = dict(num_kv_heads=2, qkv_features=48, out_features=24, in_kv_features=16, normalize_qk=True,
                dtype=jnp.bfloat16, use_bias=False)
  ours, flax = pair(**kwargs)
  xq = jax.random.normal(jax.random.key(3), (2, 3, 8, D))
  xkv = jax.random.normal(jax.random.key(4), (2, 3, 5, 16))
  np.testing.assert_array_equal(ours(xq, xkv), flax(xq, xkv))
  assert ours(xq, xkv).shape == (2, 3, 8, 24)


def test_construction_time_is_causal():
  _, flax = pair()
  causal = MultiHeadAttention(4, D, decode=False, backend="xla", is_causal=True, rngs=nnx.Rngs(0))
  x, _ = x_and_mask()
  np.testing.assert_array_equal(causal(x), flax(x, is_causal=True))
  np.testing.assert_array_equal(causal(x, is_causal=False), flax(x))  # the call's value wins


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["naive", "xla", "auto"])
def test_every_backend_matches_the_reference_from_a_loaded_checkpoint(backend, dtype):
  """A checkpoint of one backend loads into another, which then computes the float64 reference.

  The reference is built from the checkpoint's projections (the source layer's), so the test
  fails if the parameters did not load as well as if the backend's numbers are off.
  """
  source = MultiHeadAttention(4, D, num_kv_heads=2, decode=False, backend="naive", dtype=dtype, rngs=nnx.Rngs(0))
  layer = MultiHeadAttention(4, D, num_kv_heads=2, decode=False, backend=backend, dtype=dtype, rngs=nnx.Rngs(7))
  nnx.update(layer, nnx.state(source, nnx.Param))
  x, mask = x_and_mask()
  want = cases.layer_reference(source, x, mask=mask, is_causal=True)
  reference.assert_close(layer(x, mask=mask, is_causal=True), want, dtype, what=f"{backend} layer")


def test_every_backend_builds_flax_parameter_tree():
  shapes = lambda layer: jax.tree.map(jnp.shape, params_of(layer))
  flax = shapes(nnx.MultiHeadAttention(4, D, num_kv_heads=2, rngs=nnx.Rngs(0)))
  for b in attnlayers.BACKENDS:
    assert shapes(MultiHeadAttention(4, D, num_kv_heads=2, backend=b, rngs=nnx.Rngs(0))) == flax, b


@pytest.mark.parametrize("kv_heads", [4, 1], ids=["MHA", "MQA"])
def test_decode_with_cache_equals_causal_forward(kv_heads):
  layer = MultiHeadAttention(4, D, num_kv_heads=kv_heads, decode=False, is_causal=True, rngs=nnx.Rngs(0))
  x, _ = x_and_mask()
  full = layer(x)
  layer.init_cache(x.shape)
  steps = [layer(x[:, t:t + 1], decode=True) for t in range(x.shape[1])]
  reference.assert_close(jnp.concatenate(steps, axis=1), full, jnp.float32, what="decode vs full")
  np.testing.assert_array_equal(layer.cache_index[...], x.shape[1])  # one position per sequence


def test_sow_weights_matches_flax():
  ours, flax = pair(num_kv_heads=2, backend="auto")
  x, mask = x_and_mask()
  a, b = ours(x, mask=mask, sow_weights=True), flax(x, mask=mask, sow_weights=True)
  reference.assert_close(a, b, jnp.float32)
  wa = nnx.state(ours, nnx.Intermediate)["attention_weights"]
  wb = nnx.state(flax, nnx.Intermediate)["attention_weights"]
  reference.assert_close(wa[0], wb[0], jnp.float32, what="sown weights")
  assert wa[0].shape == (2, 4, 8, 8)


def test_sow_weights_warns_no_deprecation():
  """Flax 0.12.6+ deprecates Module.sow() outside nnx.capture(); our layer must not trigger that.

  Flax's own nnx.MultiHeadAttention does (flax/nnx/nn/attention.py, filtered in pyproject.toml);
  ours keeps nnx.state(layer, nnx.Intermediate) working without it.
  """
  ours, _ = pair(num_kv_heads=2, backend="naive")
  x, _ = x_and_mask()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ours(x, sow_weights=True)
    ours(x, sow_weights=True)  # a second call appends to the sown tuple, as Module.sow does
  deprecations = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if issubclass(w.category, DeprecationWarning)]
  assert not deprecations, "\n".join(deprecations)
  sown = nnx.state(ours, nnx.Intermediate)["attention_weights"]
  assert len(sown) == 2 and sown[1].shape == (2, 4, 8, 8)


def test_sow_weights_inside_nnx_capture_matches_flax():
  """nnx.capture(layer, nnx.Intermediate), Flax's supported way to read sown values, works on ours as on Flax's."""
  ours, flax = pair(num_kv_heads=2, backend="naive")
  x, mask = x_and_mask()
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)  # capture is the path without the deprecation
    (a, sown), (b, flax_sown) = (nnx.capture(m, nnx.Intermediate)(x, mask=mask, sow_weights=True) for m in (ours, flax))
  reference.assert_close(a, b, jnp.float32)
  weights = sown["attention_weights"]
  assert len(weights) == 1 and weights[0].shape == (2, 4, 8, 8)
  reference.assert_close(weights[0], flax_sown["attention_weights"][0], jnp.float32, what="captured weights")
  assert not nnx.state(ours, nnx.Intermediate)  # capture returns them; the layer keeps none


def test_complex_inputs_keep_the_complex_softmax_where_flax_s_default_drops_the_imaginary_part():
  """README, where the layers differ from Flax's: Flax's nnx class without sow_weights or dropout calls
  jax.nn.dot_product_attention, which casts the complex scores to float32 (jax warns); ours takes the softmax of
  the complex scores on every call, as Flax's class does where it builds the weights (sow_weights). xla's refusal
  said 'naive' runs complex attention "as Flax does", which Flax's default nnx path does not; it now says where."""
  kw = dict(num_heads=2, in_features=D, decode=False, dtype=jnp.complex64, param_dtype=jnp.complex64)
  ours, flax_layer = MultiHeadAttention(**kw, rngs=nnx.Rngs(0)), nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
  parts = jax.random.normal(jax.random.key(1), (2, 2, 6, D))
  x = (parts[0] + 1j * parts[1]).astype(jnp.complex64)  # (B, T, D)
  out = ours(x)
  np.testing.assert_allclose(out, flax_layer(x, sow_weights=True), **reference.tolerance(jnp.float32))
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)  # jax: complex-to-real casts will become errors
      flax_default = flax_layer(x)
  except (TypeError, ValueError):  # a later jax that refuses the cast outright
    flax_default = None
  assert flax_default is None or not np.allclose(out, flax_default, atol=1e-2), \
      "Flax's default nnx path now keeps the imaginary part: update the README's note on complex inputs"
  q = x.reshape(2, 6, 4, D // 4)  # (B, T, N, H)
  message = " ".join(attnlayers.explain("xla", q, q, q).unmet["xla"])
  assert "as Flax does" not in message and "nnx's with sow_weights or a dropout_rate" in message, message


def test_sow_weights_on_a_fused_backend_raises():
  ours, _ = pair(backend="xla")
  with pytest.raises(attnlayers.BackendUnavailableError, match="only 'naive' can"):
    ours(x_and_mask()[0], sow_weights=True)


def test_dropout_matches_flax():
  ours, flax = pair(dropout_rate=0.5, deterministic=False, backend="auto")
  x, _ = x_and_mask()
  a, b = ours(x, rngs=nnx.Rngs(dropout=5)), flax(x, rngs=nnx.Rngs(dropout=5))
  reference.assert_close(a, b, jnp.float32)
  assert not np.allclose(a, ours(x, deterministic=True))  # dropout changed something


def test_custom_attention_fn_is_used():
  calls = []

  def spy(query, key, value, **kwargs):
    calls.append(query.shape)
    return jnp.zeros_like(query)

  layer = MultiHeadAttention(4, D, decode=False, attention_fn=spy, rngs=nnx.Rngs(0))
  out = layer(x_and_mask()[0])
  assert calls == [(2, 8, 4, 8)]
  np.testing.assert_array_equal(out, jnp.broadcast_to(layer.out.bias[...], out.shape))
  with pytest.raises(ValueError, match="either attention_fn= or backend="):
    MultiHeadAttention(4, D, attention_fn=spy, backend="xla", rngs=nnx.Rngs(0))


def test_backend_attention_plugs_into_flax_class():
  _, flax = pair()
  plugged = nnx.MultiHeadAttention(4, D, decode=False, attention_fn=BackendAttention("naive"), rngs=nnx.Rngs(0))
  x, mask = x_and_mask()
  reference.assert_close(plugged(x, mask=mask), flax(x, mask=mask), jnp.float32)


def test_jit_and_grad_through_layer_match_flax():
  ours, flax = pair(num_kv_heads=2)
  x, _ = x_and_mask()
  loss = lambda m, x: jnp.sum(m(x, is_causal=True) ** 2)
  grads, flax_grads = (nnx.to_pure_dict(nnx.jit(nnx.grad(loss))(m, x)) for m in (ours, flax))
  check = lambda path, got, want: reference.assert_close(got, want, jnp.float32, "grad", jax.tree_util.keystr(path))
  jax.tree_util.tree_map_with_path(check, grads, flax_grads)  # also fails if the two trees differ


def test_te_fp8_keeps_flax_parameters_and_adds_fp8_state_beside_them():
  fp8_layer = MultiHeadAttention(4, D, backend="te-fp8", decode=False, rngs=nnx.Rngs(0))
  plain = MultiHeadAttention(4, D, backend="xla", decode=False, rngs=nnx.Rngs(0))
  jax.tree.map(np.testing.assert_array_equal, params_of(fp8_layer), params_of(plain))
  meta = nnx.to_pure_dict(nnx.state(fp8_layer, FP8Meta))
  assert set(meta) == {"fp8_qkv", "out", "fp8_core"}  # one FP8 GEMM for q, k and v together, one for the output,
  np.testing.assert_array_equal(meta["fp8_core"], np.zeros((3, 1024)))  # and the FP8 core's q/k/v amax history
  for state in (meta["fp8_qkv"], meta["out"]["dot_general"]):
    for operand in FP8_OPERANDS:
      np.testing.assert_array_equal(state["scale"][operand], np.ones(1))
      np.testing.assert_array_equal(state["amax_history"][operand], np.zeros(1024))
  current = MultiHeadAttention(4, D, backend="te-fp8", fp8_recipe=FP8Recipe(kind="current"), decode=False,
                               rngs=nnx.Rngs(0))
  assert not nnx.state(current, FP8Meta)  # current scaling keeps no state


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU message")
def test_te_fp8_layer_on_cpu_names_every_reason():
  layer = MultiHeadAttention(4, D, backend="te-fp8", decode=False, rngs=nnx.Rngs(0))
  with pytest.raises(FP8Unavailable, match=r"compute capability >= 8.9; the call's device is cpu(.|\n)*pip install 'attnlayers\[te\]'"):
    layer(jnp.ones((1, 8, D)))


def test_fp8_recipe_is_checked():
  with pytest.raises(ValueError, match="applies to backend='te-fp8' only"):
    MultiHeadAttention(4, D, backend="xla", fp8_recipe=FP8Recipe(), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="'delayed' or 'current'"):
    FP8Recipe(kind="mxfp8")
  # 0 built a te-fp8 layer with a (3, 0) core history, refused only when a GPU call read it; -3 and 2.5 raised jax's
  # shape errors from inside the layer's constructor
  for bad in (0, -3, 2.5, True):
    with pytest.raises(ValueError, match=f"amax_history_len must be an int >= 1.*got {bad!r}"):
      FP8Recipe(amax_history_len=bad)
  # numpy's integers are integers, as a shape takes them: they made a recipe before the check, and still do
  assert fp8.core_history(FP8Recipe(amax_history_len=np.int64(16)))[...].shape == (3, 16)


def test_flax_call_is_one_the_layer_was_checked_against():
  """The layer runs its own copy of Flax's __call__ steps; a Flax release that changes them shows here."""
  digest = hashlib.sha256(inspect.getsource(nnx.MultiHeadAttention.__call__).encode()).hexdigest()
  assert digest in FLAX_CALL_SOURCE_SHA256, (
      f"flax {flax.__version__}'s nnx.MultiHeadAttention.__call__ (sha256 {digest}) is none of those attnlayers.nnx "
      f"was checked against ({'; '.join(FLAX_CALL_SOURCE_SHA256.values())}): compare its steps with "
      "MultiHeadAttention.__call__ and _attend there, then add its digest to FLAX_CALL_SOURCE_SHA256")


def test_input_positions_go_to_a_custom_attention_fn_only():
  """Refused on the layer's own backends, plain calls and decode calls alike; None (Flax's default) passes."""
  ours, flax_layer = pair()
  x, _ = x_and_mask()
  positions = jnp.arange(8)[None]
  with pytest.raises(ValueError, match="input_positions= is passed on to a custom attention_fn"):
    ours(x, input_positions=positions)
  np.testing.assert_array_equal(ours(x, input_positions=None), flax_layer(x))
  ours.init_cache((2, 8, D))
  with pytest.raises(ValueError, match="input_positions= is passed on to a custom attention_fn"):
    ours(x[:, :1], decode=True, input_positions=positions[:, :1])
  ours(x[:, :1], decode=True, input_positions=None)


def test_a_misspelt_call_keyword_is_named_on_the_public_call():
  """Flax's class says 'MultiHeadAttention.__call__() got an unexpected keyword argument'; ours said
  '_attend()', a private step, for plain and decode calls alike. Now the public call, with the nearest keyword."""
  ours, flax_layer = pair()
  x, _ = x_and_mask()
  with pytest.raises(TypeError) as flax_err:
    flax_layer(x, is_casual=True)
  for call in (lambda: ours(x, is_casual=True), lambda: ours(x[:, :1], decode=True, is_casual=True)):
    with pytest.raises(TypeError) as err:
      call()
    assert str(err.value).startswith(str(flax_err.value)), (str(err.value), str(flax_err.value))
    assert "did you mean 'is_causal'?" in str(err.value)
  with pytest.raises(TypeError, match=r"__call__\(\) got an unexpected keyword argument 'extra'"):
    ours(x, extra={})  # _attend's own arguments are not the caller's
