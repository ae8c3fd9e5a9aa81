"""models.loss.head_cross_entropy on a mesh of 8 CPU devices: the values of one device, and the output
projection's gradient reduced once per step, not once per chunk.

XLA's CPU device count is fixed when jax starts, so the 8-device work runs in a process of its own
(--xla_force_host_platform_device_count=8).
"""

import contextlib
import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx

from models.loss import head_cross_entropy
from tests import reference
from train import mesh as mesh_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (mesh, B, T): B split over data x fsdp; T split over tensor where it divides T (12), else each tensor rank
# computes its rows' loss whole (7); data=2,tensor=4 does not divide V = 42, so dw is all-reduced, not scattered
CASES = (("data=8", 8, 12), ("fsdp=8", 8, 12), ("fsdp=4,tensor=2", 8, 12), ("fsdp=4,tensor=2", 8, 7),
         ("data=2,tensor=4", 8, 12))
D, V, CHUNK = 16, 42, 5  # every device's 12 tokens (data=8: 1 row of 12) make 3 chunks; the batch's, 20

# For each case and kernel: the loss evaluated, and differentiated with its gradients (of N * loss), under the
# mesh and train.mesh.RULES and on one device without them; and the collectives of the differentiated program.
_ON_MESHES = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from flax import nnx
    from benchmarks import collectives
    from models.loss import head_cross_entropy
    from train import mesh as mesh_lib
    assert jax.device_count() == 8, jax.devices()
    cases, D, V, chunk = json.loads(sys.argv[1])
    out = []
    for text, B, T in cases:
      kh, kw, kt = jax.random.split(jax.random.key(0), 3)
      h, w = jax.random.normal(kh, (B, T, D)), jax.random.normal(kw, (V, D))
      t = jax.random.randint(kt, (B, T), 0, V)
      for kernel in ("xla", "interpret"):
        loss = lambda h, w: head_cross_entropy(h, w, t, chunk=chunk, kernel=kernel)
        mesh = mesh_lib.make(mesh_lib.parse(text, 8))
        runs = {}
        for where in ("one", "mesh"):  # a jit of its own each: Flax's rules are no part of jit's cache key
          grad = jax.jit(jax.value_and_grad(lambda h, w: B * T * loss(h, w), (0, 1)))
          with (jax.set_mesh(mesh) if where == "mesh" else jax.default_device(jax.devices()[0])), \\
               nnx.logical_axis_rules(mesh_lib.RULES if where == "mesh" else ()):
            x = jax.device_put(h, mesh_lib.batch_sharding(mesh)) if where == "mesh" else h
            value, (dh, dw) = grad(x, w)
            runs[where] = {"value": float(jax.jit(loss)(x, w)), "loss": float(value) / (B * T),
                           "dh": np.asarray(dh).tolist(), "dw": np.asarray(dw).tolist()}
            if where == "mesh":
              found = collectives.parse(grad.lower(x, w).compile().as_text())
              runs[where]["collectives"] = [[c.kind, [a for a, _ in c.arrays], c.runs] for c in found]
        out.append({"case": [text, B, T], "kernel": kernel, **runs})
    print(json.dumps(out))
""")


def test_without_a_split_batch_the_loss_runs_its_loop_over_the_whole_batch():
  """No mesh, no rules, or a mesh whose batch axes are of size 1 (one device): the program has no shard_map,
  the single-device path that tests/test_gpu_loss.py times."""
  kh, kw, kt = jax.random.split(jax.random.key(0), 3)
  h, w, t = jax.random.normal(kh, (2, 12, D)), jax.random.normal(kw, (V, D)), jax.random.randint(kt, (2, 12), 0, V)
  mesh = mesh_lib.make(mesh_lib.parse(None, 1), jax.devices()[:1])
  grad = jax.grad(lambda h, w: head_cross_entropy(h, w, t, chunk=CHUNK), (0, 1))
  for on_mesh, rules in ((False, False), (True, False), (False, True), (True, True)):
    with jax.set_mesh(mesh) if on_mesh else contextlib.nullcontext(), \
         nnx.logical_axis_rules(mesh_lib.RULES if rules else ()):
      program = str(jax.make_jaxpr(grad)(h, w))
    assert "shard_map" not in program and "scan" in program, (on_mesh, rules)


@pytest.fixture(scope="module")
def on_meshes():
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
  done = subprocess.run([sys.executable, "-c", _ON_MESHES, json.dumps([CASES, D, V, CHUNK])], cwd=ROOT, env=env,
                        text=True, capture_output=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a python process of its own, on 8 CPU devices
def test_on_a_mesh_the_loss_and_its_gradients_are_one_devices(on_meshes):
  """Loss (evaluated and differentiated), N * dh and N * dw on each mesh against the same call on one device:
  the same sums in another order."""
  assert len(on_meshes) == 2 * len(CASES)
  for run in on_meshes:
    what = f"{run['case']} {run['kernel']}"
    one, mesh = run["one"], run["mesh"]
    for key in ("value", "loss"):
      reference.assert_close(mesh[key], one[key], np.float32, "loss across meshes", f"{what}: {key}")
    for key in ("dh", "dw"):
      reference.assert_close(mesh[key], one[key], np.float32, "grad", f"{what}: N * {key}")


@pytest.mark.slow  # a python process of its own, on 8 CPU devices
def test_on_a_mesh_dw_is_reduced_once_not_once_per_chunk(on_meshes):
  """Every collective of the differentiated loss runs once (none inside the chunk loop), and one of them reduces
  the whole (V, D) float32 gradient (a reduce-scatter over tensor then reduces its (V / 2, D) half over fsdp)."""
  for run in on_meshes:
    found = run["mesh"]["collectives"]
    assert all(runs == 1 for _, _, runs in found), (run["case"], found)
    whole = [kind for kind, arrays, _ in found if f"f32[{V},{D}]" in arrays]
    assert whole in (["all-reduce"], ["reduce-scatter"]), (run["case"], found)


# The trainer's step (benchmarks.scaling_check.compiled_step: train.step.jitted's, as build's) for the tiny preset on data=8 with
# 8 rows of 128 per device: the batch's 8192 tokens are 2 chunks of DEFAULT_CHUNK, each device's 1024 one.
_STEP = textwrap.dedent("""
    import json
    import models
    from benchmarks import collectives, scaling_check, scaling_model
    scaling_check.use_cpu_devices(8)
    cfg, sizes, rows = models.preset("tiny"), {"data": 8, "fsdp": 1, "tensor": 1}, 8
    found = collectives.parse(scaling_check.compiled_step(cfg, sizes, rows).as_text())
    model = scaling_model.per_kind(scaling_model.transfers(cfg, sizes, rows, regather=False))
    print(json.dumps([[[c.kind, c.payload, c.runs] for c in found], model, cfg.vocab_size, cfg.d_model]))
""")


@pytest.mark.slow  # a python process of its own, on 8 CPU devices
def test_the_data_parallel_step_reduces_the_output_projections_gradient_once():
  """No collective of the step runs inside a loop, and its all-reduces move the model's gradients and one more
  (V, D) float32 array: the tied embedding's gradient has two parts, the lookup's and the loss's, and each is
  reduced once (the loss's with its scalar)."""
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  done = subprocess.run([sys.executable, "-c", _STEP], cwd=ROOT, env=env, text=True, capture_output=True,
                        timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  found, model, vocab, width = json.loads(done.stdout.strip().splitlines()[-1])
  assert all(runs == 1 for _, _, runs in found), found
  reduced = sum(payload for kind, payload, _ in found if kind == "all-reduce")
  assert model["all-reduce"] + 4 * vocab * width <= reduced <= model["all-reduce"] + 4 * vocab * width + 64, found
