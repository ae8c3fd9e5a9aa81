"""Every backend that runs on a CPU, against the float64 reference: outputs and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnlayers
from tests import cases, reference

MATRIX = cases.matrix((jnp.float32, jnp.bfloat16))


@pytest.mark.parametrize("backend", ["naive", "xla"])
@pytest.mark.parametrize("case", MATRIX, ids=cases.case_id)
def test_backend_matches_reference(backend, case):
  cases.check(backend, case)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_auto_runs_the_backend_it_explains(dtype):
  """auto lowers to exactly the program of the backend explain() names, and matches the reference.

  Its choice: cudnn for bf16 on an NVIDIA GPU, else xla (float32 never goes to cudnn). The
  programs are compared, not the outputs: on a CPU naive and xla give the same bits.
  """
  case = dict(heads="GQA", causal=True, masked=True, dtype=dtype)
  q, k, v, _, mask = cases.inputs(case)
  chosen = attnlayers.explain("auto", q, k, v, is_causal=True, mask=mask).chosen
  assert chosen == ("cudnn" if jax.default_backend() == "gpu" and dtype == jnp.bfloat16 else "xla")
  attend = lambda q, k, v, mask, backend: attnlayers.attention(q, k, v, backend=backend, is_causal=True, mask=mask)
  run = jax.jit(attend, static_argnames="backend")
  program = {b: run.lower(q, k, v, mask, backend=b).as_text() for b in ("auto", chosen, "naive")}
  assert program["auto"] == program[chosen]
  assert program["auto"] != program["naive"]  # so the comparison above can tell backends apart
  cases.check("auto", case)


@pytest.mark.parametrize("backend", ["naive", "xla"])
def test_cross_attention_lengths_differ(backend):
  """T != S, with causal top-left aligned: query i sees keys j <= i."""
  case = dict(heads="GQA", causal=True, masked=True, dtype=jnp.float32)
  cases.check(backend, case, T=8, S=24)


def test_weights_are_the_reference_probabilities():
  q, k, v, _, mask = cases.inputs(dict(heads="GQA", causal=True, masked=True, dtype=jnp.float32))
  out, weights = attnlayers.attention(q, k, v, backend="naive", is_causal=True, mask=mask, return_weights=True)
  _, p = reference.forward(np.asarray(q), np.asarray(k), np.asarray(v), mask=np.asarray(mask), is_causal=True)
  assert weights.shape == (2, 4, 16, 16)
  reference.assert_close(weights, p, jnp.float32, "out", "weights")
  np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, atol=1e-6)


def test_hand_computed_value():
  """One query, two keys: scores (0, 1)*scale with scale=1 -> weights (1, e)/(1+e)."""
  q = jnp.array([[[[1.0]]]])  # (1, 1, 1, 1)
  k = jnp.array([[[[0.0]], [[1.0]]]])  # (1, 2, 1, 1)
  v = jnp.array([[[[10.0]], [[20.0]]]])
  e = np.e
  want = (10 * 1 + 20 * e) / (1 + e)
  for backend in ("naive", "xla"):
    out = attnlayers.attention(q, k, v, backend=backend, scale=1.0)
    np.testing.assert_allclose(float(out[0, 0, 0, 0]), want, rtol=1e-6)


BIAS_CASES = [dict(heads="GQA", causal=True, masked=True, dtype=jnp.float32),
              dict(heads="MQA", causal=False, masked=False, dtype=jnp.float32),
              dict(heads="MHA", causal=True, masked=False, dtype=jnp.bfloat16)]


@pytest.mark.parametrize("backend", ["naive", "xla"])
@pytest.mark.parametrize("case", BIAS_CASES, ids=cases.case_id)
def test_bias_and_scale_match_reference(backend, case):
  """A per-head bias (1, N, T, S) and scale 0.5 (twice the default 1/sqrt(16)): outputs and gradients."""
  cases.check(backend, case, scale=0.5, bias=cases.head_bias(case))
