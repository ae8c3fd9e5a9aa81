"""On an NVIDIA GPU: decode-shaped attention (issue 11) on cudnn, te and te-fp8, in bfloat16.

The core against the float64 reference (tests/test_decode_core.check: outputs, gradients,
exact zeros), the nnx layer's KV cache against the reference and against its rows decoded
alone, and proof in the compiled HLO of which kernel runs a prefill chunk and a one-token
decode step. te-fp8 decodes with fp8_core="fp8-or-bf16" (cuDNN's FP8 attention takes no
lengths, so its core is TransformerEngine's bf16 kernel there; its projections stay FP8).
Shapes the GPU kernels take: B 4, head dim 64, chunks of 16 or 128, a cache of 256.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlayers
from attnlayers.fp8 import FP8Recipe
from attnlayers.nnx import MultiHeadAttention
from tests import cases, reference
from tests.test_decode_core import check
from tests.test_gpu import CUDNN_FMHA
from tests.test_gpu_te import custom_calls, targets

pytestmark = pytest.mark.gpu
needs_te = cases.needs_te
# backend name -> extra attention() options; te-fp8 runs decode-shaped calls on its bf16 core only when told
BACKENDS = {"cudnn": {}, "te": {}, "te-fp8": dict(fp8_core="fp8-or-bf16")}
PARAMS = [pytest.param(b, marks=() if b == "cudnn" else needs_te, id=b) for b in BACKENDS]
B, H, L = 4, 64, 256  # batch, head dim, cache length

# name -> (B, T, S, is_causal, causal_alignment, query_seq_lengths, key_value_seq_lengths), as test_decode_core
SCENARIOS = {
    "decode-step": (B, 1, L, True, "bottom-right", [1, 1, 1, 1], [1, 37, 200, 256]),
    "prefill-chunk-128": (B, 128, L, True, "bottom-right", [128, 100, 1, 128], [128, 150, 201, 256]),
    "prefill-chunk-16": (B, 16, L, True, "bottom-right", [16, 3, 16, 9], [16, 40, 256, 9]),
    "top-left-lengths": (B, 128, L, True, "top-left", [128, 60, 1, 100], [256, 60, 10, 128]),
    "no-causal-lengths": (B, 128, L, False, "top-left", [128, 60, 1, 100], [256, 60, 10, 128]),
    # row 0 no queries, row 1 no keys, row 2 more queries than keys (its first 4 see none)
    "empty-rows": (B, 16, L, True, "bottom-right", [0, 4, 6, 16], [5, 0, 2, 256]),
}


@pytest.mark.parametrize("heads", list(cases.HEADS))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("backend", PARAMS)
def test_decode_shaped_core_matches_reference(backend, scenario, heads):
  one_query = backend == "cudnn" and SCENARIOS[scenario][1] == 1  # jax's cuDNN: T=1 forward only
  check(backend, heads, SCENARIOS[scenario], dtype=jnp.bfloat16, head_dim=H, forward_only=one_query,
        **BACKENDS[backend])


@pytest.mark.parametrize("scenario", ["decode-step", "prefill-chunk-16", "empty-rows"])
@pytest.mark.parametrize("backend", PARAMS)
def test_decode_shaped_core_with_a_mask_matches_reference(backend, scenario):
  """Runs exactly, or refuses with the kernel's own reason: cuDNN takes a mask as a bias only at even T;
  TE answers through is_fused_attn_kernel_available for a post-scale bias with its padding masks."""
  Bs, T, S, causal, alignment, q_len, kv_len = SCENARIOS[scenario]
  q = jax.ShapeDtypeStruct((Bs, T, 4, H), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((Bs, S, 2, H), jnp.bfloat16)
  plan = attnlayers.explain(backend, q, kv, kv, is_causal=causal, causal_alignment=alignment,
                            mask=jnp.ones((Bs, 1, T, S), bool), query_seq_lengths=jnp.array(q_len, jnp.int32),
                            key_value_seq_lengths=jnp.array(kv_len, jnp.int32), **BACKENDS[backend])
  if not plan.ok:
    print(plan)
    expected = "even T and S" if backend == "cudnn" else "is_fused_attn_kernel_available is False"
    assert any(expected in r for r in plan.unmet[backend]), str(plan)
    assert backend != "cudnn" or T % 2, str(plan)  # cuDNN refuses odd T only
    return
  check(backend, "GQA", SCENARIOS[scenario], masked=True, dtype=jnp.bfloat16, head_dim=H, **BACKENDS[backend])


def _decode_call(scenario, backend, **extra):
  """(attend(q, k, v), q, k, v, options): the scenario's GQA call on `backend`; options as attention() takes them."""
  Bs, T, S, causal, alignment, q_len, kv_len = SCENARIOS[scenario]
  q, k, v, _, _ = cases.inputs(dict(heads="GQA", causal=causal, masked=False, dtype=jnp.bfloat16), B=Bs, T=T, S=S, H=H)
  options = dict(is_causal=causal, causal_alignment=alignment, query_seq_lengths=jnp.array(q_len, jnp.int32),
                 key_value_seq_lengths=jnp.array(kv_len, jnp.int32), **extra)
  attend = lambda q, k, v: attnlayers.attention(q, k, v, backend=backend, **options)
  return attend, q, k, v, options


@pytest.mark.parametrize("scenario", ["prefill-chunk-128", "prefill-chunk-16", "decode-step"])
@pytest.mark.parametrize("backend", ["cudnn", "auto"])
def test_cudnn_runs_prefill_chunks_and_decode_steps(backend, scenario):
  """auto picks cudnn for these bf16 calls, and the compiled program holds cuDNN's fused attention."""
  attend, q, k, v, options = _decode_call(scenario, backend)
  assert attnlayers.explain(backend, q, k, v, **options).chosen == "cudnn"
  found = set(CUDNN_FMHA.findall(jax.jit(attend).lower(q, k, v).compile().as_text()))
  assert found and all("Backward" not in t for t in found), found


@needs_te
@pytest.mark.parametrize("scenario, mask_type", [("prefill-chunk-128", "PADDING_CAUSAL_BOTTOM_RIGHT_MASK"),
                                                 ("prefill-chunk-16", "PADDING_CAUSAL_BOTTOM_RIGHT_MASK"),
                                                 ("decode-step", "PADDING_MASK")])
@pytest.mark.parametrize("backend", ["te", "te-fp8"])
def test_te_runs_prefill_chunks_and_decode_steps(backend, scenario, mask_type):
  """TE's fused kernel with its padding (and bottom-right causal) mask; te-fp8's core is that bf16 kernel here."""
  attend, q, k, v, options = _decode_call(scenario, backend, **BACKENDS[backend])
  found = targets(custom_calls(attend, q, k, v))
  assert any(t.startswith("te_fused_attn_forward") for t in found), found
  assert "__cudnn$fmhaSoftmaxF8" not in found, found
  plan = attnlayers.explain(backend, q, k, v, **options)
  assert plan.chosen == backend, str(plan)
  if backend == "te":
    assert any(mask_type in n for n in plan.notes), plan.notes
  else:
    assert any("TransformerEngine bf16 fused attention" in n for n in plan.notes), plan.notes


@needs_te
def test_te_fp8_refuses_decode_shaped_calls_by_default():
  _, q, k, v, options = _decode_call("decode-step", "te-fp8")
  plan = attnlayers.explain("te-fp8", q, k, v, **options)
  assert not plan.ok and "fp8_core='fp8-or-bf16'" in str(plan), str(plan)
  with pytest.raises(attnlayers.BackendUnavailableError, match="lengths"):
    attnlayers.attention(q, k, v, backend="te-fp8", **options)


# --- the nnx layer's KV cache, bfloat16 ---

N, K = 4, 2
D = N * H  # model width 256


def layer(backend):
  recipe = dict(fp8_recipe=FP8Recipe(core="fp8-or-bf16")) if backend == "te-fp8" else {}
  return MultiHeadAttention(N, D, num_kv_heads=K, decode=False, backend=backend, is_causal=True, dtype=jnp.bfloat16,
                            rngs=nnx.Rngs(0), **recipe)


def tokens(*shape, seed=1):
  return jax.random.normal(jax.random.key(seed), (*shape, D)).astype(jnp.bfloat16)


decode = nnx.jit(lambda m, x, lengths: m(x, decode=True, lengths=lengths))


@pytest.mark.parametrize("backend", PARAMS)
def test_layer_prefill_then_steps_match_reference(backend):
  """Chunks of 128 and 16 tokens, then 8 one-token steps, into a cache of 256.

  cudnn and te against the float64 reference of the layer's own projections. te-fp8's
  projections are FP8 GEMMs, which that reference does not model, so it is held to its own
  full causal forward: both project each token with the same (initial, delayed-scaling)
  scales and run TE's bf16 core, so they differ by bf16 rounding only.
  """
  m = layer(backend)
  x = tokens(B, 152)
  want = m(x, decode=False, is_causal=True) if backend == "te-fp8" else cases.layer_reference(m, x, is_causal=True)
  m.init_cache((B, L, D))
  full = lambda n: jnp.full(B, n, jnp.int32)
  parts = [decode(m, x[:, :128], full(128)), decode(m, x[:, 128:144], full(16))]
  parts += [decode(m, x[:, t:t + 1], full(1)) for t in range(144, 152)]
  got = jnp.concatenate(parts, axis=1)
  assert got.dtype == jnp.bfloat16
  reference.assert_close(got, want, jnp.bfloat16, what=f"{backend} layer decode")
  np.testing.assert_array_equal(m.cache_index[...], np.full(B, 152))
  assert m.cached_key[...].dtype == jnp.bfloat16 and m.cached_key[...].shape == (B, L, K, H)


@pytest.mark.parametrize("backend", PARAMS)
def test_layer_ragged_batch_equals_each_row_decoded_alone(backend):
  """A prompt chunk of 128 with 128/50/1/77 real tokens, then 4 steps; each row alone (batch 1, same chunk)."""
  lengths = [128, 50, 1, 77]
  prompt, steps = tokens(B, 128), [tokens(B, 1, seed=2 + i) for i in range(4)]
  batch = layer(backend)
  batch.init_cache((B, L, D))
  outs = [decode(batch, prompt, jnp.array(lengths, jnp.int32))]
  outs += [decode(batch, x, jnp.ones(B, jnp.int32)) for x in steps]
  for out in outs:
    assert np.isfinite(np.asarray(out.astype(jnp.float32))).all()
  for b, n in enumerate(lengths):
    alone = layer(backend)
    alone.init_cache((1, L, D))
    want = [decode(alone, prompt[b:b + 1], jnp.array([n], jnp.int32))[:, :n]]
    want += [decode(alone, x[b:b + 1], jnp.ones(1, jnp.int32)) for x in steps]
    got = [outs[0][b:b + 1, :n]] + [out[b:b + 1] for out in outs[1:]]
    for i, (g, w) in enumerate(zip(got, want)):
      reference.assert_close(g, w, jnp.bfloat16, what=f"{backend} row {b} call {i}")
    assert int(batch.cache_index[b]) == int(alone.cache_index[0]) == n + len(steps)


@pytest.mark.parametrize("chunk", [128, 1], ids=["prefill-chunk", "decode-step"])
def test_cudnn_layer_decode_runs_the_fused_kernel(chunk):
  m = layer("cudnn")
  m.init_cache((B, L, D))
  graphdef, state = nnx.split(m)
  step = lambda s, x, n: nnx.merge(graphdef, s)(x, decode=True, lengths=n)
  text = jax.jit(step).lower(state, tokens(B, chunk), jnp.full(B, chunk, jnp.int32)).compile().as_text()
  assert CUDNN_FMHA.findall(text)


def test_the_decode_loop_runs_the_steps_it_is_asked_for():
  """Under its default options (models.compiler.DECODE) the decode loop runs exactly the steps asked, call after
  call on the state each returns, and moves each row's position by them (why DECODE is not the command buffers:
  models/compiler.py)."""
  import models
  from models import generate
  cfg = models.preset("gpt2-small", n_kv_head=12, seq_len=1024, backend="cudnn")
  m = models.GPT(cfg, rngs=nnx.Rngs(0))
  P, steps = 512, 64
  decoder = generate.Decoder(m, batch=1, cache_len=1024, prompt_len=P, sampling=generate.Sampling(temperature=0),
                             stop_token=None)
  prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, P), dtype=np.int32)  # (B, P)
  state, first = decoder.prefill(decoder.init_state(), prompts, np.full((1,), P, np.int32))
  for call in range(1, 4):
    state, tokens, n_new = decoder.decode(state, first, steps)
    assert np.asarray(n_new).tolist() == [steps] and tokens.shape == (1, steps), (call, np.asarray(n_new))
    assert np.asarray(state["pos"]).tolist()[:1] == [P + call * steps], (call, np.asarray(state["pos"]))
    first = tokens[:, -1]
