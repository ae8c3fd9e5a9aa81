"""attnlayers.linen against flax.linen and against attnlayers.nnx (one set of numbers for both)."""

import hashlib
import inspect
import warnings

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import attnlayers
import attnlayers.linen as al
from attnlayers.nnx import MultiHeadAttention
from tests import reference

D = 32
x = jax.random.normal(jax.random.key(1), (2, 8, D))
mask = jax.random.bernoulli(jax.random.key(2), 0.7, (2, 1, 8, 8)).at[..., 0].set(True).astype(jnp.float32)


@pytest.mark.parametrize("cls, flax_cls", [(al.MultiHeadDotProductAttention, nn.MultiHeadDotProductAttention),
                                           (al.MultiHeadAttention, nn.MultiHeadAttention)])
def test_equals_flax_linen_from_identical_init(cls, flax_cls):
  ours, flax = cls(num_heads=4, backend="xla"), flax_cls(num_heads=4)
  vo, vf = ours.init(jax.random.key(0), x), flax.init(jax.random.key(0), x)
  jax.tree.map(np.testing.assert_array_equal, vo, vf)
  # Flax's linen attention is the einsum path; ours runs XLA's kernel: equal to float32 rounding.
  reference.assert_close(ours.apply(vo, x, mask=mask), flax.apply(vf, x, mask=mask), jnp.float32)


def test_self_attention_alias():
  ours, flax = al.SelfAttention(num_heads=4, backend="naive"), nn.SelfAttention(num_heads=4)
  vo = ours.init(jax.random.key(0), x)
  with pytest.warns(DeprecationWarning):
    ref = flax.apply(vo, x, mask)
  reference.assert_close(ours.apply(vo, x, mask), ref, jnp.float32)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("backend", ["naive", "xla"])
def test_nnx_and_linen_give_the_same_numbers(kv_heads, backend):
  layer = MultiHeadAttention(4, D, num_kv_heads=kv_heads, decode=False, backend=backend, rngs=nnx.Rngs(0))
  params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
  ours = al.MultiHeadDotProductAttention(num_heads=4, num_kv_heads=kv_heads, backend=backend)
  assert jax.tree.map(jnp.shape, ours.init(jax.random.key(0), x)["params"]) == jax.tree.map(jnp.shape, params)
  np.testing.assert_array_equal(ours.apply({"params": params}, x, mask=mask, is_causal=True),
                                layer(x, mask=mask, is_causal=True))


def test_construction_time_is_causal():
  causal = al.MultiHeadDotProductAttention(num_heads=4, num_kv_heads=2, is_causal=True)
  full = al.MultiHeadDotProductAttention(num_heads=4, num_kv_heads=2)
  v = causal.init(jax.random.key(0), x)
  np.testing.assert_array_equal(causal.apply(v, x), full.apply(v, x, is_causal=True))
  assert not np.allclose(causal.apply(v, x), full.apply(v, x))


@pytest.mark.parametrize("kv_heads", [4, 1], ids=["MHA", "MQA"])
def test_decode_with_cache_equals_causal_forward(kv_heads):
  full_layer = al.MultiHeadDotProductAttention(num_heads=4, num_kv_heads=kv_heads, is_causal=True)
  params = full_layer.init(jax.random.key(0), x)["params"]
  want = full_layer.apply({"params": params}, x)
  step_layer = al.MultiHeadDotProductAttention(num_heads=4, num_kv_heads=kv_heads, is_causal=True, decode=True)
  cache = step_layer.init(jax.random.key(0), x)["cache"]  # shaped by the (B, max_length) input
  outs = []
  for t in range(x.shape[1]):
    out, updated = step_layer.apply({"params": params, "cache": cache}, x[:, t:t + 1], mutable=["cache"])
    cache = updated["cache"]
    outs.append(out)
  reference.assert_close(jnp.concatenate(outs, axis=1), want, jnp.float32, what="decode vs full")


def test_sow_weights():
  layer = al.MultiHeadDotProductAttention(num_heads=4, num_kv_heads=2)
  v = layer.init(jax.random.key(0), x)
  _, state = layer.apply(v, x, mask=mask, sow_weights=True, mutable=["intermediates"])
  weights = state["intermediates"]["attention_weights"][0]
  assert weights.shape == (2, 4, 8, 8)
  np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, atol=1e-6)


def test_dropout_uses_the_dropout_rng():
  layer = al.MultiHeadDotProductAttention(num_heads=4, dropout_rate=0.5, deterministic=False)
  v = layer.init(jax.random.key(0), x)
  a = layer.apply(v, x, rngs={"dropout": jax.random.key(1)})
  b = layer.apply(v, x, rngs={"dropout": jax.random.key(1)})
  c = layer.apply(v, x, rngs={"dropout": jax.random.key(2)})
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)


def test_custom_attention_fn_and_backend_conflict():
  layer = al.MultiHeadDotProductAttention(num_heads=4, attention_fn=nn.dot_product_attention, backend="xla")
  with pytest.raises(ValueError, match="either attention_fn= or backend="):
    layer.init(jax.random.key(0), x)


def test_grouped_heads_with_flax_linen_attention_fn_are_refused_with_a_way_out():
  """Flax's linen dot_product_attention asserts on K < N; the layer says so and names what takes grouped heads."""
  layer = al.MultiHeadDotProductAttention(num_heads=4, num_kv_heads=2, attention_fn=nn.dot_product_attention)
  with pytest.raises(ValueError, match=r"num_kv_heads \(2\) < num_heads \(4\).*flax.nnx.dot_product_attention"):
    layer.init(jax.random.key(0), x)
  nnx_fn = al.MultiHeadDotProductAttention(num_heads=4, num_kv_heads=2, attention_fn=nnx.dot_product_attention)
  params = nnx_fn.init(jax.random.key(0), x)
  ours = al.MultiHeadDotProductAttention(num_heads=4, num_kv_heads=2, backend="xla")
  np.testing.assert_allclose(nnx_fn.apply(params, x), ours.apply(params, x), rtol=1e-5, atol=1e-6)


def test_te_fp8_points_to_the_nnx_layer():
  layer = al.MultiHeadDotProductAttention(num_heads=4, backend="te-fp8")
  x = jnp.ones((1, 8, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match="use attnlayers.nnx.MultiHeadAttention"):
    layer.init(jax.random.key(0), x, x)


def _plain_signature(fn) -> str:
  """The call signature without annotations: names, kinds and defaults, what callers depend on."""
  sig = inspect.signature(fn)
  params = [p.replace(annotation=p.empty) for p in sig.parameters.values()]
  return str(sig.replace(parameters=params, return_annotation=sig.empty))


def test_the_copy_of_flax_call_follows_the_installed_flax():
  flax_call = nn.MultiHeadDotProductAttention.__call__
  update = f"flax {flax.__version__} changed MultiHeadDotProductAttention.__call__: update the copy in attnlayers/linen.py"
  assert _plain_signature(flax_call) == al.FLAX_CALL_SIGNATURE, update
  assert hashlib.sha256(inspect.getsource(flax_call).encode()).hexdigest() == al.FLAX_CALL_SOURCE_SHA256, update
  # ours takes exactly Flax's arguments, plus is_causal, lengths (decode calls), segment_ids, sliding_window
  # and max_segments
  assert (_plain_signature(al.MultiHeadDotProductAttention.__call__) == al.FLAX_CALL_SIGNATURE[:-1]
          + ", is_causal=None, lengths=None, segment_ids=None, sliding_window=LAYER_DEFAULT, max_segments=None)")


def _sown(layer, variables, *args, **kwargs):
  """(output, the one sown attention_weights array)."""
  out, state = layer.apply(variables, *args, sow_weights=True, mutable=["intermediates"], **kwargs)
  return out, state["intermediates"]["attention_weights"][0]


@pytest.mark.parametrize("force_fp32", [True, False], ids=["fp32-softmax", "dtype-softmax"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["F32", "BF16"])
def test_force_fp32_for_softmax_as_flax(dtype, force_fp32):
  fields = dict(num_heads=4, dtype=dtype, force_fp32_for_softmax=force_fp32)
  flax_layer = nn.MultiHeadDotProductAttention(**fields)
  v = flax_layer.init(jax.random.key(0), x)
  want_out, want_w = _sown(flax_layer, v, x, mask=mask)
  # Flax's rule: float32 weights when forced, else the compute dtype
  assert want_w.dtype == (jnp.float32 if force_fp32 else dtype)
  out, w = _sown(al.MultiHeadDotProductAttention(**fields), v, x, mask=mask)  # auto: naive, the one that sows
  assert (out.dtype, w.dtype) == (want_out.dtype, want_w.dtype) == (dtype, want_w.dtype)
  # Flax rounds the scores to the compute dtype, ours keeps them float32: equal to that dtype's rounding
  reference.assert_close(w, want_w, dtype, what="sown weights")
  reference.assert_close(out, want_out, dtype, what="output")
  if force_fp32 and dtype == jnp.bfloat16:  # float32 weights really computed in float32, not bf16 ones cast up
    assert not np.array_equal(w, w.astype(jnp.bfloat16).astype(jnp.float32))
  fused = al.MultiHeadDotProductAttention(**fields, backend="xla").apply(v, x, mask=mask)
  reference.assert_close(fused, want_out, dtype, what="xla output")


xc = ((x + 1j * jax.random.normal(jax.random.key(3), x.shape)) / 2).astype(jnp.complex64)


@pytest.mark.parametrize("backend", ["naive", "auto"])
def test_complex_inputs_as_flax(backend):
  flax_layer = nn.MultiHeadDotProductAttention(num_heads=4)
  v = flax_layer.init(jax.random.key(0), x)  # real parameters, complex inputs: Flax promotes to complex64
  want_out, want_w = _sown(flax_layer, v, xc, mask=mask)
  assert np.abs(want_out.imag).max() > 0.1 and np.abs(want_w.imag).max() > 0.01  # really complex
  ours = al.MultiHeadDotProductAttention(num_heads=4, backend=backend)
  out, w = _sown(ours, v, xc, mask=mask)
  assert out.dtype == w.dtype == want_out.dtype == want_w.dtype == jnp.complex64
  tol = reference.tolerance(jnp.float32)  # complex64 has float32 parts
  np.testing.assert_allclose(w, want_w, **tol, err_msg="sown weights")
  np.testing.assert_allclose(out, want_out, **tol, err_msg="output")
  np.testing.assert_allclose(ours.apply(v, xc, mask=mask), want_out, **tol, err_msg="output, no weights sown")


def test_complex_runs_on_naive_only_because_xla_drops_the_imaginary_part():
  parts = jax.random.normal(jax.random.key(4), (2, 3, 2, 8, 4, 8))
  q, k, v = ((parts[0] + 1j * parts[1]) / 2).astype(jnp.complex64)  # each (B, T, N, H)
  want = nn.dot_product_attention(q, k, v)
  np.testing.assert_allclose(attnlayers.attention(q, k, v, backend="naive"), want, **reference.tolerance(jnp.float32))
  assert attnlayers.explain("auto", q, k, v).chosen == "naive"
  with pytest.raises(attnlayers.BackendUnavailableError, match="drops the imaginary part"):
    attnlayers.attention(q, k, v, backend="xla")
  try:  # why: jax's XLA attention casts the complex scores to float32 before the softmax
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)  # jax: complex-to-real casts will become errors
      got = jax.nn.dot_product_attention(q, k, v, implementation="xla")
  except (TypeError, ValueError):  # a later jax that refuses the cast outright
    got = None
  assert got is None or not np.allclose(got, want, atol=1e-2), "jax's XLA attention now runs complex: lift xla's refusal"


@pytest.mark.parametrize("backend", ["cudnn", "te", "te-fp8"])
def test_fused_backends_refuse_complex_with_the_reason(backend):
  q = xc.reshape(2, 8, 4, 8)
  plan = attnlayers.explain(backend, q, q, q)
  assert not plan.ok
  assert "takes no complex inputs (got complex64); use backend='naive'" in str(plan)


def test_complex_with_force_fp32_for_softmax_refuses_flax_s_lossy_cast():
  layer = al.MultiHeadDotProductAttention(num_heads=4, force_fp32_for_softmax=True)
  v = nn.MultiHeadDotProductAttention(num_heads=4).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="dropping their imaginary part"):
    layer.apply(v, xc)


def test_mask_passed_positionally_warns_as_flax():
  """Flax's __call__ is (inputs_q, inputs_k, inputs_v, *, mask): a positional mask lands in inputs_v."""
  layers = [nn.MultiHeadDotProductAttention(num_heads=4), al.MultiHeadDotProductAttention(num_heads=4)]
  v = layers[0].init(jax.random.key(0), x)
  messages = []
  for layer in layers:
    with pytest.warns(DeprecationWarning, match="the function signature of MultiHeadDotProductAttention's "
                                                "`__call__` method has changed") as record:
      with pytest.raises(flax.errors.ScopeParamShapeError):  # the mask's last dim is not the model width
        layer.apply(v, x, x, mask)
    messages.append([str(w.message) for w in record if w.category is DeprecationWarning])
  assert messages[0] == messages[1]


@pytest.mark.parametrize("cls", [al.MultiHeadDotProductAttention, al.SelfAttention])
def test_an_unknown_backend_is_refused_where_the_layer_is_made(cls):
  with pytest.raises(ValueError, match="unknown attention backend 'flash'; known backends: auto, naive, xla"):
    cls(num_heads=2, backend="flash")
