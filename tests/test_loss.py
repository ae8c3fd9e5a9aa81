"""models.loss.head_cross_entropy against the plain output layer + cross-entropy: values, gradients, chunking.

The oracle is the textbook formula in float64 numpy (value and hand-derived gradients), itself
checked against optax's softmax_cross_entropy_with_integer_labels; tolerances are
tests/reference.py's per dtype. Gradients are taken of N * loss (cotangent N through the custom
backward) so that they are O(1) and the absolute tolerances mean something.
"""

import dataclasses
import os
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import models
from attnlayers.fp8 import FP8Meta
from models import ops
from models.ops import softmax_grad
from models.loss import head_cross_entropy
from tests import reference
from train.step import batch_loss

B, T, D, V = 2, 7, 16, 41  # N = 14 tokens; sizes that no other dimension repeats, for the HLO check
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# 4 and 5: N = 14 is no multiple (4 chunks of 4 with 2 padding, 3 of 5 with 1); 14: one chunk, exact; 64 > N
CHUNKS = (1, 4, 5, 14, 64)
KERNELS = ("xla", "interpret")  # "interpret": the Pallas kernel (models.ops.softmax_onepass here), interpreted


def _inputs(dtype, b=B, t=T, d=D, v=V):
  kh, kw, kt = jax.random.split(jax.random.key(0), 3)
  h = jax.random.normal(kh, (b, t, d), jnp.float32).astype(dtype)  # (B, T, D)
  w = jax.random.normal(kw, (v, d), jnp.float32).astype(dtype)  # (V, D)
  return h, w, jax.random.randint(kt, (b, t), 0, v)  # targets (B, T)


def _oracle(h, w, targets):
  """float64 (loss, d loss/dh (B, T, D), d loss/dw (V, D)) of mean(-log softmax(h @ w.T)[target])."""
  h, w, targets = np.asarray(h, np.float64), np.asarray(w, np.float64), np.asarray(targets)
  N = targets.size
  logits = np.einsum("btd,vd->btv", h, w)  # (B, T, V)
  top = logits.max(-1, keepdims=True)
  lse = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]  # (B, T)
  loss = (lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]).mean()
  dlogits = (np.exp(logits - lse[..., None]) - np.eye(w.shape[0])[targets]) / N  # (B, T, V)
  return loss, np.einsum("btv,vd->btd", dlogits, w), np.einsum("btv,btd->vd", dlogits, h)


def test_oracle_is_optax():
  """The float64 oracle is the formula training used before: optax on float32 logits, its gradients by jax."""
  h, w, t = _inputs(jnp.float32)
  plain = lambda h, w: optax.softmax_cross_entropy_with_integer_labels(jnp.einsum("btd,vd->btv", h, w), t).mean()
  value, (dh, dw) = jax.value_and_grad(plain, (0, 1))(h, w)
  loss, dh64, dw64 = _oracle(h, w, t)
  reference.assert_close(value, loss, jnp.float32, "out", "loss")
  reference.assert_close(t.size * dh, t.size * dh64, jnp.float32, "grad", "N * dh")
  reference.assert_close(t.size * dw, t.size * dw64, jnp.float32, "grad", "N * dw")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_oracle(dtype, chunk, jit, kernel):
  """Loss (evaluated and differentiated) and both gradients, in the inputs' dtypes."""
  h, w, t = _inputs(DTYPES[dtype])
  N = t.size
  loss = lambda h, w: head_cross_entropy(h, w, t, chunk=chunk, kernel=kernel)
  scaled = lambda h, w: N * loss(h, w)  # cotangent N through the custom backward
  evaluate, grad = (jax.jit(loss), jax.jit(jax.value_and_grad(scaled, (0, 1)))) if jit else \
      (loss, jax.value_and_grad(scaled, (0, 1)))
  value = evaluate(h, w)
  value_n, (dh, dw) = grad(h, w)
  ref, dh64, dw64 = _oracle(h, w, t)
  assert value.dtype == value_n.dtype == jnp.float32 and value.shape == ()
  assert (dh.dtype, dh.shape, dw.dtype, dw.shape) == (h.dtype, h.shape, w.dtype, w.shape)
  reference.assert_close(value, ref, dtype, "out", "loss (evaluation)")
  reference.assert_close(value_n / N, ref, dtype, "out", "loss (differentiated)")
  reference.assert_close(value_n / N, value, jnp.float32, "out", "differentiated == evaluated")  # both float32 sums
  reference.assert_close(dh, N * dh64, dtype, "grad", "N * dh")
  reference.assert_close(dw, N * dw64, dtype, "grad", "N * dw")


def test_no_logits_of_every_token_in_the_program():
  """The compiled forward + backward holds (C, V) logit blocks, never (N, V) or (B, T, V)."""
  h, w, t = _inputs(jnp.float32)
  hlo = jax.jit(jax.grad(lambda h, w: head_cross_entropy(h, w, t, chunk=4), (0, 1))).lower(h, w).compile().as_text()
  assert re.search(rf"f32\[4,{V}\]", hlo)  # the chunk's logits: so the pattern can find what it looks for
  assert not re.search(rf"\[{B * T},{V}\]|\[{B},{T},{V}\]", hlo)


@pytest.mark.parametrize("kernel", KERNELS)
def test_large_logits_stay_finite(kernel):
  """Logits past 88, where exp overflows float32 without the max shift: still the oracle's numbers. (Much
  larger ones would carry float32 rounding of the logits themselves past the float32 tolerance.)"""
  h, w, t = _inputs(jnp.float32)
  h = h * 10.0
  assert np.einsum("btd,vd->btv", np.asarray(h), np.asarray(w)).max() > 89  # exp(89) is inf in float32
  value, (dh, dw) = jax.value_and_grad(
      lambda h, w: t.size * head_cross_entropy(h, w, t, chunk=4, kernel=kernel), (0, 1))(h, w)
  ref, dh64, dw64 = _oracle(h, w, t)
  reference.assert_close(value / t.size, ref, jnp.float32, "out", "loss")
  reference.assert_close(dh, t.size * dh64, jnp.float32, "grad", "N * dh")
  reference.assert_close(dw, t.size * dw64, jnp.float32, "grad", "N * dw")


def test_one_pass_max_and_sumexp_is_the_two_pass_formula():
  """The loss's variadic (max, sum(exp(x - max))) reduction against max-then-sum in float64: rows with a
  wide spread, ties, -inf entries, a single finite entry, and one element."""
  from models.loss import _max_and_sumexp
  rng = np.random.default_rng(0)
  x = rng.normal(size=(6, 301)).astype(np.float32) * np.array([1, 30, 300, 0, 1, 1], np.float32)[:, None]
  x[3] = 2.5  # all tied
  x[4, ::2] = -np.inf
  x[5, :] = -np.inf
  x[5, 17] = 4.0
  m, s = jax.jit(_max_and_sumexp)(jnp.asarray(x))
  x64 = x.astype(np.float64)
  m64 = x64.max(axis=1, keepdims=True)
  s64 = np.exp(x64 - m64).sum(axis=1, keepdims=True)
  np.testing.assert_array_equal(np.asarray(m), m64.astype(np.float32))
  reference.assert_close(s, s64, jnp.float32, "out", "sum of exp(x - max)")
  m1, s1 = _max_and_sumexp(jnp.asarray(x[:1, :1]))
  assert float(m1[0, 0]) == x[0, 0] and float(s1[0, 0]) == 1.0


@pytest.mark.parametrize("make, message", [
    (lambda h, w, t: (h, w.astype(jnp.bfloat16), t), "h and w must share the compute dtype; got h float32, w bfloat16"),
    (lambda h, w, t: (h, w[:, :3], t), "h must be (B, T, D) and w (V, D) with the same D; got h (2, 7, 16), w (41, 3)"),
    (lambda h, w, t: (h, w, t[:, :3]),
     "targets must be an int array of h's (B, T) = (2, 7); got int32 of shape (2, 3)"),
    (lambda h, w, t: (h, w, t.astype(jnp.float32)), "targets must be an int array"),
    (lambda h, w, t: (h, w, t.at[0, 0].set(V)), f"targets must lie in [0, V={V}); got values in [0, {V}]"),
], ids=["dtypes", "widths", "targets-shape", "targets-dtype", "targets-range"])
def test_errors_name_the_values(make, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    head_cross_entropy(*make(*_inputs(jnp.float32)))


@pytest.mark.parametrize("blocks", [1, 2.5], ids=["V=BLOCK", "V=2.5BLOCK"])
def test_softmax_grad_kernel_on_long_rows_and_padding(blocks):
  """models.ops.softmax_grad (interpreted) on rows of one whole read of the kernel and of a ragged 2.5, with
  logits spread by 30, ties, -inf entries, and a padding row: softmax - onehot and the loss of the float64
  formula."""
  V = int(blocks * softmax_grad.BLOCK)
  x = np.random.default_rng(1).normal(size=(5, V)).astype(np.float32) * 30
  x[1] = 2.0  # all tied
  x[2, 1::3] = -np.inf
  t, real = np.array([0, 5, V - 1, 7, 3]), np.array([1.0, 1.0, 1.0, 1.0, 0.0], np.float32)
  g, nll = softmax_grad.softmax_grad(jnp.asarray(x), jnp.asarray(t), jnp.asarray(real), jnp.float32, interpret=True)
  x64 = x.astype(np.float64)
  p = np.exp(x64 - x64.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  reference.assert_close(g, (p - np.eye(V)[t]) * real[:, None], jnp.float32, "grad", "softmax - onehot")
  with np.errstate(divide="ignore"):  # row 2's target (V - 1) is one of its -inf logits: p = 0, an infinite loss
    expected = -np.log(p[np.arange(5), t]) * real
  reference.assert_close(nll, expected, jnp.float32, "out", "-log p(target)")


def test_softmax_grad_kernel_bad_targets_and_padding():
  """Under jit (targets unchecked): a target outside [0, V) gives a NaN loss, as no logit is its; a padding
  row that is not finite still gives loss 0."""
  V = 37
  x = jnp.asarray(np.random.default_rng(2).normal(size=(4, V)), jnp.float32).at[3].set(jnp.nan)
  t, real = jnp.array([-1, V, 4, 0]), jnp.array([1.0, 1.0, 1.0, 0.0])
  _, nll = jax.jit(lambda x, t, r: softmax_grad.softmax_grad(x, t, r, jnp.float32, interpret=True))(x, t, real)
  assert np.isnan(nll[:2]).all() and np.isfinite(nll[2]) and nll[3] == 0.0


def test_interpret_runs_the_pallas_kernel():
  """kernel="interpret" really traces the Pallas kernel into the differentiated pass; "xla" does not."""
  h, w, t = _inputs(jnp.float32)
  jaxpr = lambda kernel: str(jax.make_jaxpr(jax.grad(lambda h, w: head_cross_entropy(h, w, t, chunk=4, kernel=kernel),
                                                     (0, 1)))(h, w))
  assert "pallas_call" in jaxpr("interpret") and "pallas_call" not in jaxpr("xla")


def test_kernel_choice_is_said_and_checked(monkeypatch):
  """auto says what it picked and why; pallas where it cannot compile is refused with what would run; with
  several devices auto keeps XLA's fusions (the kernel has no sharding rule)."""
  if jax.default_backend() == "gpu" and jax.device_count() == 1:
    assert ops.resolve("auto") == ("pallas", "one GPU: the Pallas kernels")
  elif jax.default_backend() != "gpu":
    picked, why = ops.resolve("auto")
    assert picked == "xla" and why.startswith("XLA fusions (the Pallas kernels need a GPU")
    with pytest.raises(ValueError, match=r"kernel='pallas': .*need a GPU.*Use kernel='xla'"):
      head_cross_entropy(*_inputs(jnp.float32), kernel="pallas")
  assert ops.resolve("xla") == ("xla", "as asked")
  with pytest.raises(ValueError, match=re.escape("kernel must be one of ('auto', 'xla', 'pallas', 'interpret'); "
                                                 "got 'triton'")):
    head_cross_entropy(*_inputs(jnp.float32), kernel="triton")
  monkeypatch.setattr(ops, "available", lambda *arrays: (True, ""))
  monkeypatch.setattr(jax, "device_count", lambda: 2)
  picked, why = ops.resolve("auto")
  assert picked == "xla" and "2 devices: the Pallas kernels have no sharding rule" in why


def test_without_pallas_triton_auto_runs_xla_and_says_why(monkeypatch):
  """A jax without Pallas's Triton backend (its import raises ImportError): auto runs XLA's fusions and says
  why, even where a GPU would take the kernels; pallas and interpret are refused with the reason."""
  monkeypatch.setitem(sys.modules, ops.TRITON, None)  # import of a None entry raises ImportError
  on_a_gpu = types.SimpleNamespace(of=lambda *arrays: types.SimpleNamespace(is_cuda=True))
  monkeypatch.setattr(ops, "device", on_a_gpu)  # as on one CUDA GPU, where auto would otherwise pick pallas
  monkeypatch.setattr(jax, "device_count", lambda: 1)
  assert "has no Pallas Triton backend (jax.experimental.pallas.triton does not import" in ops.triton_missing()
  picked, why = ops.resolve("auto")
  assert picked == "xla"
  assert why.startswith("XLA fusions (the Pallas kernels need Pallas's Triton backend, and this jax (")
  assert "has no Pallas Triton backend" in why
  with pytest.raises(ValueError, match=r"kernel='pallas': the Pallas kernels need Pallas's Triton backend, and this "
                                       r"jax .* has no Pallas Triton backend .*Use kernel='xla' \(XLA fusions, any "
                                       r"backend\) or 'auto'$"):
    ops.resolve("pallas")
  with pytest.raises(ValueError, match=r"kernel='interpret': .* has no Pallas Triton backend .*Use kernel='xla'"):
    head_cross_entropy(*_inputs(jnp.float32), kernel="interpret")
  assert ops.resolve("xla") == ("xla", "as asked")
  np.testing.assert_array_equal(head_cross_entropy(*_inputs(jnp.float32), kernel="auto"),
                                head_cross_entropy(*_inputs(jnp.float32), kernel="xla"))


def test_models_and_the_trainer_import_without_pallas_triton():
  """With jax.experimental.pallas.triton unimportable, models (the kernels' modules too) and the trainer import,
  and auto resolves to XLA's fusions with the reason (a new process, which imports them without it)."""
  code = ("import sys; sys.modules['jax.experimental.pallas.triton'] = None\n"
          "import models, models.loss, models.gpt, models.ops.bias_gelu, models.ops.layernorm, train.cli\n"
          "from models import ops\n"
          "from models.ops import tiling\n"
          "assert tiling.plgpu is None\n"
          "print(*ops.resolve('auto'), sep=' | ')\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert out.returncode == 0, out.stderr
  assert out.stdout.startswith("xla | XLA fusions (the Pallas kernels need Pallas's Triton backend, and this jax")


@pytest.mark.parametrize("chunk", [0, -1, 2.5, True, np.True_])
def test_chunk_must_be_a_positive_int(chunk):
  message = f"chunk must be an int >= 1 (tokens per block of logits); got {chunk!r}"
  with pytest.raises(ValueError, match=re.escape(message)):
    head_cross_entropy(*_inputs(jnp.float32), chunk=chunk)


def test_chunk_takes_a_numpy_int():
  """chunk=np.int64(4) was refused as 'not an int >= 1' (models.config.is_integer takes numpy's ints)."""
  inputs = _inputs(jnp.float32)
  np.testing.assert_array_equal(head_cross_entropy(*inputs, chunk=np.int64(4)), head_cross_entropy(*inputs, chunk=4))


def _tiny(tie: bool):
  cfg = dataclasses.replace(models.preset("tiny", seq_len=16), n_layer=1, tie_embeddings=tie)
  model = models.GPT(cfg, rngs=nnx.Rngs(0))
  x = jax.random.randint(jax.random.key(1), (3, 16), 0, cfg.vocab_size)  # (B, T)
  return model, {"inputs": x, "targets": jnp.roll(x, -1, axis=1)}


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_training_loss_is_the_logits_formula(tie):
  """train.step's loss (fused) and its parameter gradients equal the former logits + optax loss (float32 tiny)."""
  model, batch = _tiny(tie)
  graphdef, params, fp8 = nnx.split(model, nnx.Param, FP8Meta)
  N = batch["targets"].size

  def before(params):  # train.step.batch_loss before the fused loss
    logits = nnx.merge(graphdef, params, fp8)(batch["inputs"])  # (B, T, V) float32
    return N * optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  value, grads = jax.value_and_grad(lambda p: N * batch_loss(graphdef, p, fp8, batch, None))(params)
  value0, grads0 = jax.value_and_grad(before)(params)
  reference.assert_close(value / N, value0 / N, jnp.float32, "out", "loss")
  reference.assert_close(batch_loss(graphdef, params, fp8, batch, None), value0 / N, jnp.float32, "out", "eval loss")
  flat, flat0 = jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads0)
  assert len(flat) == len(flat0)
  for (path, g), g0 in zip(flat, flat0):
    reference.assert_close(g, g0, jnp.float32, "grad", f"N * d loss / d {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_logits_are_hidden_times_head_weight(tie):
  """GPT.__call__ split into hidden + head_weight keeps its logits: bit for bit the head it had (untied:
  the head's own Linear), and last_only picks the hidden state at each row's last token."""
  model, batch = _tiny(tie)
  x = batch["inputs"]
  h, w = model.hidden(x), model.head_weight()
  assert h.shape == (3, 16, model.cfg.d_model) and w.shape == (model.cfg.vocab_size, model.cfg.d_model)
  before = jnp.einsum("btd,vd->btv", h, model.wte.embedding[...].astype(h.dtype)) if tie else model.head(h)
  np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(before.astype(jnp.float32)))
  reference.assert_close(model.hidden(x, last_only=True), h[:, -1:], jnp.float32, "out", "last_only")


def test_logits_in_the_compute_dtype_match_the_oracle_and_the_einsum_formula():
  """logits_dtype=bfloat16: what the model's einsum(...).astype(float32) computes, within bf16 tolerance."""
  h, w, t = _inputs(jnp.bfloat16)
  N = t.size
  value_n, (dh, dw) = jax.jit(jax.value_and_grad(
      lambda h, w: N * head_cross_entropy(h, w, t, chunk=5, logits_dtype=jnp.bfloat16), (0, 1)))(h, w)
  ref, dh64, dw64 = _oracle(h, w, t)
  plain = optax.softmax_cross_entropy_with_integer_labels(
      jnp.einsum("btd,vd->btv", h, w).astype(jnp.float32), t).mean()
  reference.assert_close(value_n / N, ref, jnp.bfloat16, "out", "loss")
  reference.assert_close(value_n / N, plain, jnp.bfloat16, "out", "loss vs the bf16-logits formula")
  reference.assert_close(dh, N * dh64, jnp.bfloat16, "grad", "N * dh")
  reference.assert_close(dw, N * dw64, jnp.bfloat16, "grad", "N * dw")
  with pytest.raises(ValueError, match="logits_dtype must be float32 or the compute dtype bfloat16; got float16"):
    head_cross_entropy(h, w, t, logits_dtype=jnp.float16)


def _gradient_errors(h, w, t, chunk: int) -> dict[str, tuple[float, float]]:
  """Relative (Frobenius) errors of N * dh and N * dw against float64 for the one-read kernel ("interpret") and
  XLA's formula, and of the float64 gradients rounded to h's dtype ("rounding": the floor)."""
  N = t.size
  _, dh64, dw64 = _oracle(h, w, t)
  rel = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))
  errors = {}
  for kernel in ("interpret", "xla"):
    _, (dh, dw) = jax.jit(jax.value_and_grad(
        lambda h, w: N * head_cross_entropy(h, w, t, chunk=chunk, kernel=kernel), (0, 1)))(h, w)
    errors[kernel] = rel(dh, N * dh64), rel(dw, N * dw64)
  errors["rounding"] = tuple(rel(jnp.asarray(N * g, h.dtype), N * g) for g in (dh64, dw64))
  return errors


def test_onepass_gradients_are_at_least_as_accurate_as_rounding_softmax_minus_onehot():
  """bfloat16, near-uniform softmax (as at initialisation): models.ops.softmax_onepass's path (the target's p - 1
  applied in float32, never rounded) against XLA's formula, which rounds softmax - onehot to bfloat16 as
  models.ops.softmax_grad does. Relative (Frobenius) errors of N * dh and N * dw against float64; the one-pass
  path's must be smaller.
  Both include the rounding of dh and dw themselves to bfloat16, most of the error. (Rounding the onehot with
  the rest at the scale of the row sum, as the kernel's first version did, failed here: 2.27e-3 and 2.84e-3
  against XLA's 1.73e-3 and 1.77e-3.)"""
  h, w, t = _inputs(jnp.bfloat16, b=4, t=64, d=64, v=2048)
  w = (w.astype(jnp.float32) / 8).astype(jnp.bfloat16)  # logits ~ N(0, 1): a flat softmax
  errors = _gradient_errors(h, w, t, chunk=128)
  assert all(a < b for a, b in zip(errors["interpret"], errors["xla"])), errors


@pytest.mark.parametrize("first_block", [True, False], ids=["target-in-first-block", "target-after-it"])
@pytest.mark.parametrize("margin", [8.0, 16.0, 24.0])
def test_onepass_gradients_of_confident_predictions_are_at_least_as_accurate_as_xlas(margin, first_block):
  """bfloat16, p(target) from 0.42 to near 1 (1 - p about 0.58 at margin 8, 4.7e-4 at 16, 1.6e-7 at 24): the
  gradient at the target is -(1 - p), small, and must not come from two near-equal numbers (e_target * r - 1, with
  e_target rounded to bfloat16, gave relative errors of 3.93 in dh and 5.99 in dw at margin 16, the target after
  the first block, against 1.42e-3 and 1.44e-3 here). Token i's logits are column i of w (h is the
  identity), its target's logit `margin`, the rest ~ N(0, 1); the kernel's shift is its target's logit when the
  target lies in the first block of logits it reads, else smaller. Relative (Frobenius) errors of N * dh and
  N * dw against float64, in bfloat16: the one-read path's at most XLA's (which rounds softmax - onehot as one),
  give or take 1% (where both are the rounding of dw itself to bfloat16 they differ in the sixth digit), and
  within 5% of the float64 gradients' own rounding to bfloat16 (XLA's dh error was 4.6 and 11 times that at
  margin 16, 236 and 868 times at 24)."""
  from models.ops.softmax_onepass import BLOCK
  N, D, V = 16, 16, 2 * BLOCK + 452
  rng = np.random.default_rng(5)
  h = np.eye(N, D, dtype=np.float32)[None]  # (1, N, D): token i = e_i
  w = rng.normal(size=(V, D)).astype(np.float32)  # (V, D): token i's logits w[:, i]
  lo = 0 if first_block else BLOCK
  t = rng.choice(np.arange(lo, lo + 1000), size=N, replace=False)
  w[t, np.arange(N)] = margin
  errors = _gradient_errors(jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), jnp.asarray(t[None]), chunk=64)
  print(errors)
  assert all(a <= 1.01 * b for a, b in zip(errors["interpret"], errors["xla"])), errors  # 1%: equal in effect
  assert all(a <= 1.05 * b for a, b in zip(errors["interpret"], errors["rounding"])), errors


def test_a_negative_or_zero_cotangent_scales_both_gradients():
  """The backward multiplies the saved gradients by the cotangent, sign and all (a loss subtracted, or unused)."""
  h, w, t = _inputs(jnp.float32)
  _, dh64, dw64 = _oracle(h, w, t)
  for kernel in KERNELS:
    for ct in (-2.5, 0.0):
      _, pullback = jax.vjp(lambda h, w: head_cross_entropy(h, w, t, chunk=4, kernel=kernel), h, w)
      dh, dw = pullback(jnp.float32(ct))
      reference.assert_close(dh, ct * dh64, jnp.float32, "grad", f"{kernel}: dh at cotangent {ct}")
      reference.assert_close(dw, ct * dw64, jnp.float32, "grad", f"{kernel}: dw at cotangent {ct}")


def test_float16_runs_models_softmax_grad_interpreted():
  """float16 takes the two-read kernel (its exponent range cannot hold the one-read kernel's e); interpreted here,
  compiled in tests/test_gpu_loss.py. N * dh and N * dw within float16's tolerance of float64."""
  h, w, t = _inputs(jnp.float16)
  N = t.size
  value, (dh, dw) = jax.jit(jax.value_and_grad(
      lambda h, w: N * head_cross_entropy(h, w, t, chunk=4, kernel="interpret"), (0, 1)))(h, w)
  ref, dh64, dw64 = _oracle(h, w, t)
  assert dh.dtype == dw.dtype == jnp.float16
  reference.assert_close(value / N, ref, jnp.float16, "out", "loss")
  reference.assert_close(dh, N * dh64, jnp.float16, "grad", "N * dh")
  reference.assert_close(dw, N * dw64, jnp.float16, "grad", "N * dw")
