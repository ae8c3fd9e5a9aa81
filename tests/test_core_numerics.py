"""Every backend that runs on a CPU, against the float64 reference: outputs and gradients."""

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


@pytest.mark.parametrize("case", cases.matrix((jnp.float32,)), ids=cases.case_id)
def test_auto_matches_reference_on_cpu(case):
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


def test_bias_and_scale_agree_across_backends():
  q, k, v, _, _ = cases.inputs(dict(heads="MQA", causal=False, masked=False, dtype=jnp.float32))
  bias = jnp.linspace(-1, 1, 16 * 16).reshape(1, 1, 16, 16)
  a = attnlayers.attention(q, k, v, backend="naive", bias=bias, scale=0.3)
  b = attnlayers.attention(q, k, v, backend="xla", bias=bias, scale=0.3)
  reference.assert_close(a, b, jnp.float32)
  assert not np.allclose(a, attnlayers.attention(q, k, v, backend="xla", scale=0.3))  # the bias mattered
