"""The fused decode step (models.fused_decode over models.ops.norm_gemm) on CPU, its kernels interpreted: each
kernel against the float64 formula, the step against the block's general path, greedy decoding against
recomputation, and where the general path runs instead."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import fused_decode
from models.generate import Decoder, generate
from models.ops import gelu, norm_gemm
from tests import reference
from tests.test_generate import GREEDY, PROMPTS, config, forward, greedy_by_recomputation, model

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
M, D, F, EPS = 5, 96, 200, 1e-5  # D and F not multiples of the kernels' blocks: their masked edges run


def _inputs(dtype, *shapes):
  keys = jax.random.split(jax.random.key(3), len(shapes))
  return [(jax.random.normal(k, s) * (0.05 if len(s) == 2 and s[0] == D else 1.0)).astype(dtype)
          for k, s in zip(keys, shapes)]


def _norm64(x, y, scale, shift, dtype):
  """(s, h) in float64 from s rounded to dtype, as the kernels round the stream."""
  s = np.asarray((x.astype(jnp.float32) + (0 if y is None else y.astype(jnp.float32))).astype(dtype), np.float64)
  mean, var = s.mean(-1, keepdims=True), s.var(-1, keepdims=True)
  h = (s - mean) / np.sqrt(var + EPS) * np.asarray(scale, np.float64) + np.asarray(shift, np.float64)
  return s, h


@pytest.mark.parametrize("add", [True, False], ids=["x+y", "x"])
@pytest.mark.parametrize("act", [True, False], ids=["gelu", "linear"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_norm_gemm_matches_float64(dtype, act, add):
  dt = DTYPES[dtype]
  x, y, w, b = _inputs(dt, (M, D), (M, D), (D, F), (F,))
  scale, shift = 1 + 0.1 * _inputs(dt, (D,))[0], 0.1 * _inputs(dt, (D,))[0]
  s, out = norm_gemm.norm_gemm(x, y if add else None, scale, shift, w, b, eps=EPS, gelu=act, interpret=True)
  s64, h = _norm64(x, y if add else None, scale, shift, dt)
  want = h @ np.asarray(w, np.float64) + np.asarray(b, np.float64)
  if act:
    want = np.asarray(gelu.value(jnp.asarray(want, jnp.float32)), np.float64)
  np.testing.assert_array_equal(np.asarray(s, np.float64), s64)  # the stream: x + y rounded once
  reference.assert_close(out, want, dtype, "out", "norm_gemm")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_norm_qkv_writes_each_rows_key_and_value_at_its_position(dtype):
  """Rows at the cache's first and last position and between; a row at L (past the end) and one at -1 write
  nothing. Every other cache entry keeps its bits."""
  dt, (N, K, H, L) = DTYPES[dtype], (4, 2, 16, 7)
  x, y, wq, wk, wv, bq, bk, bv, kc, vc = _inputs(dt, (M, D), (M, D), (D, N * H), (D, K * H), (D, K * H), (N * H,),
                                                 (K * H,), (K * H,), (M, L, K, H), (M, L, K, H))
  scale, shift = 1 + 0.1 * _inputs(dt, (D,))[0], 0.1 * _inputs(dt, (D,))[0]
  index = jnp.array([0, 3, L - 1, L, -1], jnp.int32)
  s, q, k, v = jax.jit(lambda *a: norm_gemm.norm_qkv(*a[:4], a[4:7], a[7:10], *a[10:], eps=EPS, interpret=True))(
      x, y, scale, shift, wq, wk, wv, bq, bk, bv, kc, vc, index)
  s64, h = _norm64(x, y, scale, shift, dt)
  proj = lambda w, b: h @ np.asarray(w, np.float64) + np.asarray(b, np.float64)
  np.testing.assert_array_equal(np.asarray(s, np.float64), s64)
  reference.assert_close(q, proj(wq, bq), dtype, "out", "queries")
  for name, got, old, w, b in (("keys", k, kc, wk, bk), ("values", v, vc, wv, bv)):
    new = proj(w, b).reshape(M, K, H)
    for m, p in enumerate(index.tolist()):
      written = 0 <= p < L
      if written:
        reference.assert_close(got[m, p], new[m], dtype, "out", f"{name} row {m} at {p}")
      kept = [t for t in range(L) if t != p]
      np.testing.assert_array_equal(np.asarray(got[m, kept]), np.asarray(old[m, kept]), f"{name} row {m}")


def test_the_kernels_refuse_shapes_they_do_not_take():
  x, w, b = jnp.zeros((2, 32)), jnp.zeros((32, 8)), jnp.zeros((8,))
  ln = (jnp.ones(32), jnp.zeros(32))
  with pytest.raises(ValueError, match=r"norm_gemm wants w \(D, F\) = \(32, F\)"):
    norm_gemm.norm_gemm(x, None, *ln, jnp.zeros((16, 8)), b, eps=EPS, interpret=True)
  with pytest.raises(ValueError, match=r"x and y \(M, D\) = \(2, 32\) of one dtype"):
    norm_gemm.norm_gemm(x, jnp.zeros((2, 32), jnp.bfloat16), *ln, w, b, eps=EPS, interpret=True)
  cache = jnp.zeros((2, 4, 1, 8))  # head dim 8: programs write whole blocks of 16
  with pytest.raises(ValueError, match="head_dim 8 is not a multiple of 16"):
    norm_gemm.norm_qkv(x, None, *ln, (w, w, w), (b, b, b), cache, cache, jnp.zeros((2,), jnp.int32), eps=EPS)
  with pytest.raises(ValueError, match=r"caches \(B, L, K, H\) with B = M = 2"):
    norm_gemm.norm_qkv(x, None, *ln, (w, w, w), (b, b, b), cache[:1], cache[:1], jnp.zeros((2,), jnp.int32), eps=EPS)


def _fused_config(n_kv_head, kernels="interpret", backend="xla", **kw):
  return config(backend, n_kv_head, **{"d_model": 64, "kernels": kernels} | kw)  # head dim 16, as norm_qkv takes


@pytest.mark.parametrize("n_kv_head", [4, 1], ids=["MHA", "MQA"])  # GQA: test_the_fused_step_computes_the_general_step
def test_greedy_on_the_fused_step_equals_recomputation(n_kv_head, monkeypatch):
  steps = []
  monkeypatch.setattr(fused_decode, "step", lambda *a, step=fused_decode.step: steps.append(1) or step(*a))
  m = model(_fused_config(n_kv_head))
  logits = forward(m)
  want = [greedy_by_recomputation(logits, prompt, 12) for prompt in PROMPTS]
  assert len({t for row in want for t in row}) >= 2, f"degenerate test: greedy repeats one token: {want}"
  assert [t.tolist() for t in generate(m, PROMPTS, max_new_tokens=12, sampling=GREEDY).tokens] == want
  assert len(steps) == m.cfg.n_layer  # each block traced once, in the decode loop, on the fused step


def _decode_step(m, prompts, lengths, L, cache_dtype=None):
  """The logits (B, V), caches and positions of one decode step of one token per row after a prefill."""
  m = nnx.clone(m)
  m.init_cache(len(prompts), L, dtype=cache_dtype)
  graphdef, state = nnx.split(m)
  prefill = jax.jit(lambda st, t, n: nnx.state((mm := nnx.merge(graphdef, st), mm(t, decode=True, lengths=n))[0]))
  state = prefill(state, prompts, lengths)
  step = jax.jit(lambda st, t: (lambda mm: (mm(t, decode=True)[:, 0], nnx.state(mm, nnx.Cache)))(nnx.merge(graphdef, st)))
  return step(state, prompts[:, :1])


def compare_steps(monkeypatch, kernel: str, *, rows: int = 3, cache_dtype=None, **overrides):
  """One decode step after a prefill on the fused step (kernels=`kernel`) and on the general path (kernels="xla"),
  the same parameters: the fused step ran in each block; logits (within the dtype's tolerance of their largest),
  caches and positions agree. Every third row starts at the cache's end: on both its logits are NaN and its
  position stays."""
  steps = []
  monkeypatch.setattr(fused_decode, "step", lambda *a, step=fused_decode.step: steps.append(a[3]) or step(*a))
  L = 8
  prompts = jnp.tile(jnp.array([[3, 1, 4, 1, 5, 9, 2, 6]], jnp.int32), (rows, 1))
  lengths = jnp.array([2, 7, 8] * (rows // 3) + [5] * (rows % 3), jnp.int32)
  cfg = {"seq_len": L} | overrides
  m = model(_fused_config(2, kernels=kernel, **cfg))
  general = model(_fused_config(2, kernels="xla", **cfg))
  nnx.update(general, nnx.state(m, nnx.Param))
  got, got_cache = _decode_step(m, prompts, lengths, L, cache_dtype)
  assert steps == [kernel] * m.cfg.n_layer  # the decode step's blocks (the prefill's take the general path)
  want, want_cache = _decode_step(general, prompts, lengths, L, cache_dtype)
  assert len(steps) == m.cfg.n_layer
  dtype = jnp.dtype(m.cfg.dtype)
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  past = np.asarray(lengths) == L
  assert np.isnan(got[past]).all() and np.isnan(want[past]).all()
  # two orders of summation and rounding, each within the dtype's relative tolerance of the largest value
  close = lambda a, b, what: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=0,
                                                        atol=reference.tolerance(dtype)["rtol"] * np.abs(b).max(),
                                                        err_msg=what)
  close(got[~past], want[~past], "logits")
  flat = lambda st: {jax.tree_util.keystr(p): a for p, a in jax.tree_util.tree_leaves_with_path(st)}
  got_cache, want_cache = flat(got_cache), flat(want_cache)
  assert set(got_cache) == set(want_cache)
  for name, a in want_cache.items():
    if name.endswith("['cache_index']"):
      np.testing.assert_array_equal(got_cache[name], a, name)
      np.testing.assert_array_equal(a, np.where(past, L, np.asarray(lengths) + 1), name)
    else:
      assert got_cache[name].dtype == a.dtype, name
      close(got_cache[name], np.asarray(a, np.float32), name)
      values = np.asarray(got_cache[name], np.float32)  # projected in the compute dtype: each value one of its
      np.testing.assert_array_equal(values, np.asarray(values.astype(dtype), np.float32), name)


@pytest.mark.parametrize("case", ["float32", "no bias, window 3, 20 rows", "bfloat16, float32 cache",
                                  "bfloat16, naive backend"])
def test_the_fused_step_computes_the_general_step(case, monkeypatch):
  """20 rows: two blocks of rows, the second partly masked. The float32 cache of a bfloat16 model holds keys and
  values rounded to bfloat16 on both paths (they are projected in the compute dtype). The naive backend's case
  names the attention backend as the GPU tests name cudnn and te."""
  kw = {"no bias, window 3, 20 rows": dict(bias=False, window=3, rows=20),
        "bfloat16, float32 cache": dict(dtype="bfloat16", cache_dtype=jnp.float32),
        "bfloat16, naive backend": dict(dtype="bfloat16", backend="naive")}.get(case, {})
  compare_steps(monkeypatch, "interpret", **kw)


def test_decoding_past_the_cache_is_the_general_paths_clear_error():
  m = model(_fused_config(2, seq_len=8))
  m.init_cache(2, 4)
  for block in m.blocks:
    block.attn.cache_index[...] = jnp.array([1, 4], jnp.int32)
  with pytest.raises(ValueError, match=r"decoding past the KV cache: row 1 at position 4 adds 1 token"):
    m.blocks[0](jnp.zeros((2, 1, 64)), decode=True)


@pytest.mark.parametrize("case", ["two tokens", "lengths", "head dim 8", "xla kernels", "dropout"])
def test_the_general_path_runs_where_the_fused_step_does_not_apply(case):
  cfg = _fused_config(2, **({"d_model": 32} if case == "head dim 8" else {"kernels": "xla"} if case == "xla kernels"
                            else {}))
  m = models_with_cache(cfg)
  x = jnp.zeros((3, 2 if case == "two tokens" else 1, cfg.d_model))
  lengths = jnp.ones((3,), jnp.int32) if case == "lengths" else None
  rngs = nnx.Rngs(dropout=0) if case == "dropout" else None
  assert fused_decode.fusable(m.blocks[0], x, lengths=lengths, rngs=rngs) == ""


def models_with_cache(cfg):
  m = model(cfg)
  m.init_cache(3, 16)
  return m


def test_a_float32_model_decodes_on_the_fused_step_by_default_only_where_the_kernels_compile():
  """kernels="auto" resolves to XLA's fusions on this CPU: the general path; "interpret" asks for the kernels."""
  m = models_with_cache(dataclasses.replace(_fused_config(2), kernels="auto"))
  assert fused_decode.fusable(m.blocks[0], jnp.zeros((3, 1, 64)), lengths=None, rngs=None) == ""


@pytest.mark.parametrize("overrides, want", [
    ({}, "fused (interpret)"),
    ({"kernels": "xla"}, "general: the model's kernels are xla"),
    ({"d_model": 32}, "general: head_dim 8 is not a multiple of 16"),
])
def test_the_step_a_config_decodes_on_is_said(overrides, want):
  assert fused_decode.planned(_fused_config(2, **overrides)).startswith(want)


def test_the_decoder_says_which_step_its_blocks_run():
  m = model(_fused_config(2))
  assert Decoder(m, batch=2, cache_len=32, prompt_len=8, sampling=GREEDY).decode_step_ran() == "fused (interpret)"
