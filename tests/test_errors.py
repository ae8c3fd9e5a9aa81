"""Bad input and unavailable backends: one clear error naming the values and what would work."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlayers
from attnlayers.device import has_module
from attnlayers.nnx import MultiHeadAttention
from tests import reference

q = jnp.zeros((2, 8, 6, 16))
kv = jnp.zeros((2, 8, 2, 16))
on_cpu = pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU-side availability errors")


def test_heads_not_divisible():
  k = jnp.zeros((2, 8, 4, 16))
  with pytest.raises(ValueError, match=re.escape("num_heads N (6) must be divisible by num_kv_heads K (4)")):
    attnlayers.attention(q, k, k)


def test_layer_heads_not_divisible():
  with pytest.raises(ValueError, match=re.escape("num_heads (6) must be divisible by num_kv_heads (4)")):
    MultiHeadAttention(6, 48, num_kv_heads=4, rngs=nnx.Rngs(0))


def test_rank_mismatch():
  with pytest.raises(ValueError, match=r"must be rank 4.*k has shape \(8, 2, 16\)"):
    attnlayers.attention(q, kv[0], kv[0])


def test_head_dim_mismatch():
  with pytest.raises(ValueError, match=r"head dims differ: q \(2, 8, 6, 16\) has H=16, k \(2, 8, 2, 32\) has H=32"):
    attnlayers.attention(q, jnp.zeros((2, 8, 2, 32)), jnp.zeros((2, 8, 2, 32)))


def test_k_v_shape_mismatch():
  with pytest.raises(ValueError, match=r"k and v must have the same shape"):
    attnlayers.attention(q, kv, jnp.zeros((2, 9, 2, 16)))


def test_dtype_mismatch():
  with pytest.raises(ValueError, match=r"share one dtype; got float32, bfloat16, float32"):
    attnlayers.attention(q, kv.astype(jnp.bfloat16), kv)


def test_mask_wrong_shape():
  mask = jnp.ones((2, 1, 8, 9), dtype=bool)
  with pytest.raises(ValueError, match=r"mask of shape \(2, 1, 8, 9\) does not broadcast to \(B, N, T, S\) = "
                                       r"\(2, 6, 8, 8\); mismatched dims S: 9 \(expected 1 or 8\)"):
    attnlayers.attention(q, kv, kv, mask=mask)


def test_mask_not_boolean():
  with pytest.raises(ValueError, match=r"mask must be boolean \(True = may attend\); got float32"):
    attnlayers.attention(q, kv, kv, mask=jnp.ones((8, 8)))


def test_unknown_backend_lists_known():
  with pytest.raises(ValueError, match=r"unknown attention backend 'flash'; known backends: auto, naive, xla, cudnn, te, te-fp8"):
    attnlayers.attention(q, kv, kv, backend="flash")
  with pytest.raises(ValueError, match="known backends"):
    MultiHeadAttention(6, 96, backend="flash", rngs=nnx.Rngs(0))


@on_cpu
def test_cudnn_on_cpu_float32_names_each_constraint():
  with pytest.raises(attnlayers.BackendUnavailableError) as err:
    attnlayers.attention(q, kv, kv, backend="cudnn")
  message = str(err.value)
  assert "needs an NVIDIA GPU with compute capability >= 8.0; the call's device is cpu" in message
  assert "needs float16 or bfloat16 q/k/v; got float32" in message
  assert "backends that can run this call here: naive, xla" in message
  assert err.value.backend == "cudnn" and len(err.value.reasons) == 2


@on_cpu
def test_cudnn_on_cpu_bfloat16_names_only_the_platform():
  with pytest.raises(attnlayers.BackendUnavailableError) as err:
    attnlayers.attention(q.astype(jnp.bfloat16), kv.astype(jnp.bfloat16), kv.astype(jnp.bfloat16), backend="cudnn")
  assert len(err.value.reasons) == 1 and "NVIDIA GPU" in err.value.reasons[0]


@pytest.mark.skipif(has_module("transformer_engine"), reason="TransformerEngine is installed here")
@pytest.mark.parametrize("backend", ["te", "te-fp8"])
def test_te_without_transformer_engine_says_how_to_install(backend):
  """On any machine without TransformerEngine, a GPU one included."""
  with pytest.raises(attnlayers.BackendUnavailableError) as err:
    attnlayers.attention(q.astype(jnp.bfloat16), kv.astype(jnp.bfloat16), kv.astype(jnp.bfloat16), backend=backend)
  message = str(err.value)
  assert "TransformerEngine is not installed: pip install 'attnlayers[te]'" in message
  if jax.default_backend() != "gpu":
    assert "NVIDIA GPU" in message


def test_te_fp8_lists_its_cores_head_dim_beside_the_device_it_lacks():
  """Every unmet requirement at once: where the device fails too (a CPU, or no TransformerEngine), a head dim the
  FP8 core cannot take is still named, with fp8_core='fp8-or-bf16' as what would work."""
  x = jnp.zeros((2, 128, 4, 32), jnp.bfloat16)  # (B, T, N, H): H 32, the FP8 core takes 128
  plan = attnlayers.explain("te-fp8", x, x, x, is_causal=True)
  if plan.ok:
    pytest.skip("te-fp8 can run here: the head dim check is tests/test_gpu_te.py's")
  reasons = plan.unmet["te-fp8"]
  assert any("head dim 128" in r and "H=32" in r for r in reasons), reasons
  assert any("fp8_core='fp8-or-bf16'" in r for r in reasons), reasons
  assert not any("head dim" in r for r in attnlayers.explain("te-fp8", x, x, x, fp8_core="fp8-or-bf16").unmet.get(
      "te-fp8", [])), "fp8-or-bf16 runs the bf16 core, which takes H 32"


def test_fused_backend_refuses_weights_and_dropout():
  with pytest.raises(attnlayers.BackendUnavailableError, match="only 'naive' can"):
    attnlayers.attention(q, kv, kv, backend="xla", return_weights=True)
  with pytest.raises(attnlayers.BackendUnavailableError, match="no dropout"):
    attnlayers.attention(q, kv, kv, backend="xla", dropout_rate=0.1, dropout_rng=jax.random.key(0))


def test_explain_with_the_backend_out_of_place_says_where_it_goes():
  with pytest.raises(TypeError, match=r"explain takes the backend first: explain\(backend, q, k, v, ...\)"):
    attnlayers.explain(q, kv, kv, "auto")


def test_auto_reports_its_choice():
  plan = attnlayers.explain("auto", q, kv, kv, is_causal=True)
  assert plan.chosen == "xla"  # float32 never goes to cudnn, on any machine
  assert f"auto chose '{plan.chosen}'" in str(plan)
  assert attnlayers.explain("auto", q, kv, kv, return_weights=True).chosen == "naive"


def test_auto_says_how_its_choice_runs_the_call(monkeypatch):
  """explain('auto') carries the chosen backend's notes, as explain(that backend) does: on an H200 (stood in for,
  nothing runs) a causal bf16 window goes to cudnn's band, and auto's report says so. It gave no notes at all, so
  the trainer's attention_notes and `python -m attnlayers`' auto row left out how auto's kernel ran."""
  from attnlayers import device as device_lib
  monkeypatch.setattr(device_lib, "of", lambda *arrays: device_lib.DeviceInfo("gpu", "NVIDIA H200", (9, 0), 91900))
  monkeypatch.setattr(device_lib, "has_module", lambda name: False)  # no TransformerEngine: te is not asked
  x = jnp.zeros((2, 64, 4, 64), jnp.bfloat16)
  direct = attnlayers.explain("cudnn", x, x, x, is_causal=True, window=(7, 0))
  assert direct.ok and any("local_window_size=(7, 0)" in n for n in direct.notes), str(direct)
  plan = attnlayers.explain("auto", x, x, x, is_causal=True, window=(7, 0))
  assert plan.chosen == "cudnn" and plan.notes == direct.notes, str(plan)
  assert "local_window_size=(7, 0)" in str(plan)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=lambda d: jnp.dtype(d).name)
def test_float8_inputs_run_on_naive_and_the_others_say_why(dtype, monkeypatch):
  """jax's XLA attention cannot take float8 q/k/v (it promotes them with float32 for its scores, and jax refuses
  that promotion): xla said it ran them and then raised jax's TypePromotionError. It refuses them now, naming
  'naive', which auto picks; the fp16/bf16 kernels name 'naive' too (not 'xla', which cannot). On an H200 (stood
  in for, nothing runs there) as on this machine."""
  from attnlayers import device as device_lib
  x8 = jax.random.normal(jax.random.key(0), (2, 8, 4, 16)).astype(dtype)  # (B, T, N, H)
  name = jnp.dtype(dtype).name
  with pytest.raises(attnlayers.BackendUnavailableError, match=f"cannot run {name} q/k/v; 'naive' runs them"):
    attnlayers.attention(x8, x8, x8, backend="xla")
  out = attnlayers.attention(x8, x8, x8)
  assert out.dtype == dtype
  if dtype == jnp.float8_e4m3fn:  # E4M3 is what the "fp8" rule is written for
    want, _ = reference.forward(*(np.asarray(x8.astype(jnp.float32), np.float64) for _ in range(3)))
    reference.assert_close(out, want, "fp8", what="naive on float8_e4m3fn")
  monkeypatch.setattr(device_lib, "of", lambda *arrays: device_lib.DeviceInfo("gpu", "NVIDIA H200", (9, 0), 91900))
  plan = attnlayers.explain("auto", x8, x8, x8)
  assert plan.chosen == "naive" and set(plan.unmet) == {"cudnn", "splash", "xla"}, str(plan)
  for backend in ("cudnn", "te", "te-fp8"):
    about_dtype = [r for r in attnlayers.explain(backend, x8, x8, x8).unmet[backend] if name in r]
    assert len(about_dtype) == 1 and "only 'naive' runs" in about_dtype[0], about_dtype
    assert "'xla'" not in about_dtype[0], about_dtype


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=lambda d: jnp.dtype(d).name)
def test_a_float8_bias_runs_on_naive_and_xla_says_why(dtype):
  """xla's float8 refusal read q/k/v's dtype only: a float8 bias beside bfloat16 q/k/v passed it, and attention()
  (auto included, which chose xla) then raised jax's TypePromotionError from adding it to the float32 scores."""
  x = jax.random.normal(jax.random.key(0), (2, 8, 4, 16)).astype(jnp.bfloat16)  # (B, T, N, H)
  bias = (jax.random.normal(jax.random.key(1), (2, 4, 8, 8)) * 2).astype(dtype)  # (B, N, T, S)
  with pytest.raises(attnlayers.BackendUnavailableError, match=f"for a {jnp.dtype(dtype).name} bias"):
    attnlayers.attention(x, x, x, bias=bias, backend="xla")
  plan = attnlayers.explain("auto", x, x, x, bias=bias)
  assert plan.chosen == "naive", str(plan)
  np.testing.assert_array_equal(attnlayers.attention(x, x, x, bias=bias),
                                attnlayers.attention(x, x, x, bias=bias.astype(jnp.float32), backend="naive"))


def test_float64_runs_in_float64_on_naive_and_xla_says_why():
  """With jax_enable_x64, float64 q/k/v ran on xla (auto's choice), whose softmax jax computes in float32: the
  float64 output was about 2e-7 off the float64 reference, and naive's scores were float32 too. xla refuses them
  now, naming 'naive', which auto picks and which computes in float64: outputs and gradients within 1e-12."""
  rng = np.random.default_rng(0)
  q64, k64, v64, dout = (rng.standard_normal(s) for s in [(2, 8, 4, 16), (2, 8, 2, 16), (2, 8, 2, 16), (2, 8, 4, 16)])
  with jax.enable_x64(True):
    q, k, v = (jnp.asarray(x, jnp.float64) for x in (q64, k64, v64))
    with pytest.raises(attnlayers.BackendUnavailableError, match="float64 q/k/v would come back as float64 of "
                                                                 "float32 precision; 'naive' runs them"):
      attnlayers.attention(q, k, v, backend="xla")
    assert attnlayers.explain("auto", q, k, v, is_causal=True).chosen == "naive"
    out, vjp = jax.vjp(lambda q, k, v: attnlayers.attention(q, k, v, is_causal=True), q, k, v)
    grads = vjp(jnp.asarray(dout))
    assert out.dtype == jnp.float64 and all(g.dtype == jnp.float64 for g in grads)
  want, _ = reference.forward(q64, k64, v64, is_causal=True)
  reference.assert_close(out, want, np.float64, what="naive float64 out")
  for got, want_g, name in zip(grads, reference.gradients(q64, k64, v64, dout, is_causal=True), "qkv"):
    reference.assert_close(got, want_g, np.float64, "grad", what=f"naive float64 d{name}")


@pytest.mark.parametrize("kv_shape", [(3, 2, 5, 32), (6, 5, 32), (2, 4, 5, 32)])
def test_layers_refuse_kv_batch_dims_other_than_the_querys(kv_shape):
  """Keys and values of batch dims (3, 2) or (6,) beside queries of (2, 3) were flattened to the same 6 rows and
  paired wrongly without a word (Flax raises); (2, 4) failed in jnp.reshape with a TypeError."""
  import flax.linen as nn
  import attnlayers.linen
  x = jnp.ones((2, 3, 8, 32))  # (*batch, T, features)
  kv_in = jnp.ones(kv_shape)
  want = re.escape(f"batch dims (2, 3), {kv_shape[:-2]}, {kv_shape[:-2]}")
  layer = MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="query, key and value batch dims must match.*" + want):
    layer(x, kv_in)
  module = attnlayers.linen.MultiHeadDotProductAttention(num_heads=4)
  params = nn.MultiHeadDotProductAttention(num_heads=4).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="query, key and value batch dims must match.*" + want):
    module.apply(params, x, kv_in)


@pytest.mark.parametrize("shape, says", [
    ((2, 8, 8), "does not broadcast to (batch, num_heads, q_length, kv_length) = (2, 4, 8, 8); mismatched dims "
                "num_heads: 2 (expected 1 or 4); it reads as a (*batch, q_length, kv_length) mask, and Flax's "
                "attention takes a heads axis before q_length too: pass mask[..., None, :, :]"),
    ((2, 1, 8, 9), "does not broadcast to (batch, num_heads, q_length, kv_length) = (2, 4, 8, 8); mismatched dims "
                   "kv_length: 9 (expected 1 or 8)"),
    ((1, 2, 1, 8, 8), "must have at most 4 dims broadcastable to (batch, num_heads, q_length, kv_length) = "
                      "(2, 4, 8, 8); got shape (1, 2, 1, 8, 8)")])
def test_a_layer_mask_of_the_wrong_shape_is_named_as_given(shape, says):
  """A (B, T, S) mask, without Flax's heads axis, was reported after padding, as (1, 2, 8, 8) with N mismatched."""
  layer = MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=re.escape(f"mask {'' if len(shape) > 4 else f'of shape {shape} '}{says}")):
    layer(jnp.ones((2, 8, 32)), mask=jnp.ones(shape, bool))


def test_a_mask_over_two_batch_dims_names_each():
  layer = MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=re.escape("mask of shape (2, 1, 1, 8) does not broadcast to (batch[0], "
                                                 "batch[1], num_heads, q_length, kv_length) = (2, 3, 4, 8, 8); "
                                                 "mismatched dims batch[1]: 2 (expected 1 or 3)")):
    layer(jnp.ones((2, 3, 8, 32)), mask=jnp.ones((2, 1, 1, 8), bool))


def test_dropout_needs_rng():
  with pytest.raises(ValueError, match="needs a dropout_rng"):
    attnlayers.attention(q, kv, kv, backend="naive", dropout_rate=0.1)


@on_cpu
def test_float16_on_cpu_runs_on_naive_and_xla_says_why():
  """jax's XLA attention asks XLA for the F16_F16_F32 dot algorithm for float16, which XLA's CPU backend does not
  run: xla passed explain() on CPU float16, and under jit attention() (auto included, which chose xla) raised jax's
  'The precision 'F16_F16_F32' is not supported by dot_general on CPU'; `python -m attnlayers --dtype float16
  --show-kernels` crashed on it."""
  x = jax.random.normal(jax.random.key(0), (2, 8, 4, 16)).astype(jnp.float16)
  with pytest.raises(attnlayers.BackendUnavailableError, match="F16_F16_F32") as err:
    attnlayers.attention(x, x, x, backend="xla")
  assert "backends that can run this call here: naive" in str(err.value)
  plan = attnlayers.explain("auto", x, x, x, is_causal=True)
  assert plan.chosen == "naive", str(plan)
  out = jax.jit(lambda q, k, v: attnlayers.attention(q, k, v, is_causal=True))(x, x, x)
  grads = jax.jit(jax.grad(lambda q: jnp.sum(attnlayers.attention(q, x, x, is_causal=True).astype(jnp.float32))))(x)
  np.testing.assert_array_equal(out, attnlayers.attention(x, x, x, is_causal=True, backend="naive"))
  assert out.dtype == jnp.float16 and bool(jnp.isfinite(grads).all())
  layer = MultiHeadAttention(4, 64, dtype=jnp.float16, is_causal=True, decode=False, rngs=nnx.Rngs(0))
  assert nnx.jit(lambda m, y: m(y))(layer, jnp.ones((2, 8, 64), jnp.float16)).dtype == jnp.float16


def test_traced_window_needs_a_value_known_at_trace_time():
  """A window passed through jit's arguments is traced: the error says it must be known when the call is traced,
  as scale's does, rather than that it is not two ints."""
  x = jnp.zeros((1, 4, 2, 8))
  with pytest.raises(TypeError, match=r"window must be two Python ints known when the call is traced.*got a traced "
                                      r"value.*Pass it as a constant"):
    jax.jit(lambda w: attnlayers.attention(x, x, x, window=(w, 0)))(2)
  layer = MultiHeadAttention(2, 8, decode=False, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="window must be two Python ints known when the call is traced"):
    nnx.jit(lambda layer, w: layer(jnp.zeros((1, 4, 8)), sliding_window=(0, w)))(layer, 1)


@pytest.mark.parametrize("num_heads", [0, -2, 2.0, True])
def test_layer_num_heads_must_be_positive(num_heads):
  """num_heads=0 divided by zero inside Flax's constructor; both layers refuse it by name."""
  from attnlayers.linen import MultiHeadDotProductAttention
  message = re.escape(f"num_heads must be a positive int (the query heads: 1 or more, dividing the qkv features); "
                      f"got {num_heads!r}")
  with pytest.raises(ValueError, match=message):
    MultiHeadAttention(num_heads, 8, decode=False, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=message):
    MultiHeadAttention(in_features=8, num_heads=num_heads, decode=False, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=message):
    MultiHeadDotProductAttention(num_heads=num_heads).init(jax.random.key(0), jnp.zeros((1, 4, 8)))
