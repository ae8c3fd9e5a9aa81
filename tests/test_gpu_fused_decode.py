"""On an NVIDIA GPU: the fused decode step's compiled kernels (models.ops.norm_gemm) against the float64 formula at
gpt2-small's widths, greedy decoding on them against recomputation (float32), the step against the block's general
path on cudnn and te (bfloat16), and proof in the compiled decode loop that each block runs it."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from benchmarks import kernels as count
from models import fused_decode, generate
from models.ops import gelu, norm_gemm
from tests import cases, reference
from tests.test_fused_decode import _fused_config, _norm64, compare_steps
from tests.test_generate import GREEDY, PROMPTS, forward, greedy_by_recomputation, model

pytestmark = pytest.mark.gpu
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
D, F, N, K, H, L, EPS = 768, 3072, 12, 4, 64, 256, 1e-5  # gpt2-small with 4 kv heads, a cache of 256


def _draw(dtype, *shapes):
  keys = jax.random.split(jax.random.key(5), len(shapes))
  return [(jax.random.normal(k, s) * (D ** -0.5 if len(s) == 2 and s[0] == D else 1.0)).astype(dtype)
          for k, s in zip(keys, shapes)]


@pytest.mark.parametrize("rows", [2, 64])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_compiled_norm_gemm_matches_float64(dtype, rows):
  dt = DTYPES[dtype]
  x, y, w, b, scale, shift = _draw(dt, (rows, D), (rows, D), (D, F), (F,), (D,), (D,))
  s, out = jax.jit(lambda *a: norm_gemm.norm_gemm(*a, eps=EPS, gelu=True))(x, y, 1 + 0.1 * scale, 0.1 * shift, w, b)
  s64, h = _norm64(x, y, 1 + 0.1 * scale, 0.1 * shift, dt)
  want = gelu.value(jnp.asarray(h @ np.asarray(w, np.float64) + np.asarray(b, np.float64), jnp.float32))
  np.testing.assert_array_equal(np.asarray(s, np.float64), s64)
  reference.assert_close(out, want, dtype, "out", "norm_gemm")


@pytest.mark.parametrize("rows", [2, 64])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_compiled_norm_qkv_writes_each_rows_key_and_value(dtype, rows):
  dt = DTYPES[dtype]
  x, y, wq, wk, wv, bq, bk, bv, kc, vc, scale, shift = _draw(
      dt, (rows, D), (rows, D), (D, N * H), (D, K * H), (D, K * H), (N * H,), (K * H,), (K * H,), (rows, L, K, H),
      (rows, L, K, H), (D,), (D,))
  index = (jnp.arange(rows, dtype=jnp.int32) * 37) % (L + 2) - 1  # -1 and L among them: no write
  run = jax.jit(lambda *a: norm_gemm.norm_qkv(*a[:4], a[4:7], a[7:10], *a[10:], eps=EPS), donate_argnums=(10, 11))
  s, q, k, v = run(x, y, 1 + 0.1 * scale, 0.1 * shift, wq, wk, wv, bq, bk, bv, jnp.copy(kc), jnp.copy(vc), index)
  _, h = _norm64(x, y, 1 + 0.1 * scale, 0.1 * shift, dt)
  proj = lambda w, b: h @ np.asarray(w, np.float64) + np.asarray(b, np.float64)
  reference.assert_close(q, proj(wq, bq), dtype, "out", "queries")
  for name, got, old, w, b in (("keys", k, kc, wk, bk), ("values", v, vc, wv, bv)):
    got, old, new = np.asarray(got, np.float32), np.asarray(old, np.float32), proj(w, b).reshape(rows, K, H)
    written = np.zeros((rows, L), bool)
    for m, p in enumerate(np.asarray(index).tolist()):
      if 0 <= p < L:
        written[m, p] = True
        reference.assert_close(got[m, p], new[m], dtype, "out", f"{name} row {m} at {p}")
    np.testing.assert_array_equal(got[~written], old[~written], f"{name}: entries no row wrote")


@pytest.mark.parametrize("n_kv_head", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_greedy_on_the_compiled_fused_step_equals_recomputation(n_kv_head, monkeypatch):
  """float32 with every GEMM at full float32 precision (the kernels' own float32 dot is), so that the two paths
  differ by the order of their sums alone, as on CPU."""
  steps = []
  monkeypatch.setattr(fused_decode, "step", lambda *a, step=fused_decode.step: steps.append(a[3]) or step(*a))
  with jax.default_matmul_precision("highest"):
    m = model(_fused_config(n_kv_head, kernels="pallas"))
    logits = forward(m)
    want = [greedy_by_recomputation(logits, prompt, 12) for prompt in PROMPTS]
    got = [t.tolist() for t in generate.generate(m, PROMPTS, max_new_tokens=12, sampling=GREEDY).tokens]
  assert got == want
  assert steps == ["pallas"] * m.cfg.n_layer


@pytest.mark.parametrize("backend", [pytest.param("cudnn"), pytest.param("te", marks=cases.needs_te)])
def test_the_compiled_fused_step_computes_the_general_step(backend, monkeypatch):
  """bfloat16, the same parameters on both paths (Pallas kernels against XLA's fusions): tests/test_fused_decode's
  compare_steps, 20 rows (two blocks of rows)."""
  compare_steps(monkeypatch, "pallas", rows=20, backend=backend, dtype="bfloat16")


def loop_body(hlo: str) -> list[str]:
  """The instructions of one step of the program's decode loop that launch kernels (benchmarks.kernels' walk)."""
  comps = count._computations(hlo)
  lines = []

  def walk(name):
    for line in comps[name]:
      if count.kind(line) == "call":
        walk(count._called(line))
      elif count.kind(line):
        lines.append(line)
  walk(re.search(r"body=%?([\w.\-]+)", count._find_while(comps, "ENTRY")).group(1))
  return lines


def fused_and_scatters(device) -> tuple[int, int, int]:
  """(norm_qkv kernels, scatters, layers) in the loop body of gpt2-small's decode program (4 kv heads, 8 rows, a
  cache of 1024) compiled for `device`: norm_qkv is the Triton call whose outputs include both caches."""
  cfg = models.preset("gpt2-small", n_kv_head=4, backend="cudnn", seq_len=1024)
  with jax.default_device(device):
    hlo = generate.lower_decode(cfg, batch=8, cache_len=1024, sampling=GREEDY, compiler_options={},
                                sharding=jax.sharding.SingleDeviceSharding(device)).compile().as_text()
  lines = loop_body(hlo)
  cache = r"bf16\[8,1024,4,64\]"
  fused = [l for l in lines if "__gpu$xla.gpu.triton" in l and re.search(f"= \\(.*{cache}.*{cache}.*\\) custom-call", l)]
  return len(fused), len([l for l in lines if "scatter" in l.split("=")[0]]), cfg.n_layer


def test_each_block_of_the_compiled_decode_loop_runs_the_fused_step():
  """One norm_qkv kernel per block, and no other kernel writes the caches (no scatter)."""
  fused, scatters, layers = fused_and_scatters(jax.devices()[0])
  assert fused == layers, f"{fused} norm_qkv kernels in the decode loop's body, want one per block ({layers})"
  assert scatters == 0, f"{scatters} scatters write the caches besides norm_qkv"
