"""On a GPU machine: eligibility comes from where the arrays are, not from jax's first device."""

import jax
import jax.numpy as jnp
import pytest

import attnlayers

pytestmark = pytest.mark.gpu


def _qkv(device):
  x = jax.random.normal(jax.random.key(0), (2, 128, 4, 64)).astype(jnp.bfloat16)  # (B, T, N, H)
  return (jax.device_put(x, device),) * 3


def test_cudnn_refuses_arrays_that_live_on_the_cpu():
  q, k, v = _qkv(jax.devices("cpu")[0])
  plan = attnlayers.explain("cudnn", q, k, v, is_causal=True)
  assert not plan.ok and "the call's device is cpu" in str(plan), str(plan)
  assert attnlayers.explain("auto", q, k, v, is_causal=True).chosen == "xla"


def test_cudnn_takes_the_same_arrays_on_the_gpu_and_under_jit():
  q, k, v = _qkv(jax.devices("gpu")[0])
  assert attnlayers.explain("cudnn", q, k, v, is_causal=True).ok
  chosen = []
  jax.jit(lambda q, k, v: chosen.append(attnlayers.explain("auto", q, k, v, is_causal=True).chosen) or q)(q, k, v)
  assert chosen == ["cudnn"]


def test_traced_calls_follow_jax_default_device():
  q, k, v = _qkv(jax.devices("gpu")[0])
  chosen = []
  with jax.default_device(jax.devices("cpu")[0]):
    jax.jit(lambda q, k, v: chosen.append(attnlayers.explain("auto", q, k, v).chosen) or q)(
        *(jax.device_put(x, jax.devices("cpu")[0]) for x in (q, k, v)))
  assert chosen == ["xla"]
