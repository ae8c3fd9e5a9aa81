"""Training over a mesh (train.mesh) on 8 CPU devices: the same losses as one device, every parameter where its
logical names put it, FSDP's per-device memory, checkpoints that move between meshes, and --mesh's refusals.

XLA's CPU device count is fixed when jax starts, so the 8-device work runs in processes of its own
(--xla_force_host_platform_device_count=8), each running all the meshes of its test.
"""

import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

import models
from tests import reference
from train import mesh as mesh_lib
from train import stepdirs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = ("data=8", "fsdp=8", "fsdp=4,tensor=2", "data=2,tensor=4")  # the tiny preset: 4 heads, 2 kv heads
SMALL = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "8", "--no-progress", "--sample-tokens", "0",
         "--eval-every", "0", "--log-every", "1", "--attn", "xla"]
# Each logical name's mesh axis, written out here apart from train.mesh.RULES: what the test holds it to
EXPECTED = {"embed": "fsdp", "vocab": "tensor", "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor",
            "position": None, "head_dim": None, "norm": None}


def _text(tmp_path) -> str:
  """A text file of a few hundred KB to train on: the project's own sources."""
  path = tmp_path / "text.txt"
  path.write_text("".join(open(f).read() for f in sorted(glob.glob(os.path.join(ROOT, "train", "*.py")))))
  return str(path)


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
  return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, text=True, capture_output=True,
                        timeout=900)


def _last_json(done: subprocess.CompletedProcess):
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


# Trains the tiny preset 20 steps on one device and on each mesh (the trainer's own build, batches and step), and
# records each mesh's losses, where each parameter lies, and the bytes each device holds.
_TRAIN_ON_MESHES = textwrap.dedent("""
    import json, sys, tempfile
    import jax, numpy as np
    from flax import nnx
    import models
    from train import checkpoint, data, step, mesh as mesh_lib
    from train.config import TrainConfig
    from train.session import Batches
    path, meshes = sys.argv[1], sys.argv[2].split(";")
    assert jax.device_count() == 8, jax.devices()
    dataset = data.load(path, 32, pack=False, walk=data.Walk(path), vocab_size=256, raw_bytes=False, progress=False)
    runs = [("xla", "one", 1)] + [("xla", m, 8) for m in meshes] + [("naive", "one", 1), ("naive", meshes[2], 8)]
    out = {}
    for backend, name, n in runs:
      cfg = TrainConfig(model=models.preset("tiny", seq_len=32, backend=backend), steps=20, batch_size=8, data=path,
                        progress=False)
      mesh = mesh_lib.make(mesh_lib.parse(None if name == "one" else name, n), jax.devices()[:n])
      model, state = step.build(cfg, mesh)
      init = [np.asarray(x) for x in jax.tree.leaves(state["params"])]
      ones = ones if name != "one" else init  # the one-device run of this backend comes first
      params = {jax.tree_util.keystr(p): {"names": v.get_metadata().get("out_sharding"), "shape": list(v.shape),
                                          "spec": [list(a) if isinstance(a, tuple) else a
                                                   for a in v.get_value().sharding.spec]}
                for p, v in jax.tree_util.tree_leaves_with_path(state["params"],
                                                                is_leaf=lambda x: isinstance(x, nnx.Variable))}
      arrays = jax.tree.leaves({"params": state["params"], "opt_state": state["opt_state"]})
      held = {}
      for a in arrays:
        for shard in a.addressable_shards:
          held[str(shard.device)] = held.get(str(shard.device), 0) + shard.data.nbytes
      adam = [x for x in jax.tree.leaves(state["opt_state"], is_leaf=lambda x: hasattr(x, "mu")) if hasattr(x, "mu")]
      moments = [x.sharding.spec == p.sharding.spec for m in (adam[0].mu, adam[0].nu)
                 for x, p in zip(jax.tree.leaves(m), jax.tree.leaves(state["params"]))]
      batches = Batches(dataset, cfg, mesh_lib.batch_sharding(mesh))
      losses = []
      for s in range(1, 21):
        state, loss = model.train_step(state, batches("train", s), s)
        losses.append(float(loss))
      out[f"{backend} {name}"] = {"losses": losses, "params": params, "mesh": dict(mesh.shape),
                                  "total_bytes": sum(a.nbytes for a in arrays), "most_bytes": max(held.values()),
                                  "moments_as_params": all(moments) and len(moments) == 2 * len(params),
                                  "init_as_one": all(np.array_equal(a, b) for a, b in zip(init, ones, strict=True))}
      if name == "fsdp=8":
        saved = state
    # the fsdp=8 state saved, and restored into fsdp=4 x tensor=2's state: each array in the new mesh's sharding
    cfg = TrainConfig(model=models.preset("tiny", seq_len=32, backend="xla"), steps=20, batch_size=8, data=path,
                      progress=False)
    with tempfile.TemporaryDirectory() as d:
      ckpts = checkpoint.Checkpoints(d + "/run")
      ckpts.save(20, saved, {"step": 20})
      _, like = step.build(cfg, mesh_lib.make(mesh_lib.parse(meshes[2], 8)))
      restored = ckpts.restore(20, like)
      ckpts.close()
    pairs = list(zip(jax.tree.leaves(restored), jax.tree.leaves(like), jax.tree.leaves(saved)))
    out["restored"] = {"as_target": all(r.sharding == l.sharding for r, l, _ in pairs),
                       "split": sum(not l.sharding.is_fully_replicated for _, l, _ in pairs),
                       "equal": all(np.array_equal(np.asarray(r), np.asarray(s)) for r, _, s in pairs)}
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def meshes(tmp_path_factory):
  return _last_json(_python(_TRAIN_ON_MESHES, _text(tmp_path_factory.mktemp("text")), ";".join(MESHES)))


@pytest.mark.slow
@pytest.mark.parametrize("backend,mesh", [("xla", m) for m in MESHES] + [("naive", MESHES[2])])
def test_losses_on_a_mesh_match_one_device(meshes, backend, mesh):
  assert meshes[f"{backend} {mesh}"]["init_as_one"], mesh  # made in place on the mesh: the one-device numbers
  one, got = meshes[f"{backend} one"]["losses"], meshes[f"{backend} {mesh}"]["losses"]
  np.testing.assert_allclose(got, one, **reference.tolerance("float32", "loss across meshes"), err_msg=mesh)
  assert one[-1] < one[0] - 1  # the run learns: the curves compared are not flat


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_every_parameter_lies_where_its_logical_names_ask(meshes, mesh):
  run = meshes[f"xla {mesh}"]
  sizes, kv_split = run["mesh"], 2 % run["mesh"]["tensor"] == 0  # the tiny preset's 2 kv heads
  for path, p in run["params"].items():
    assert p["names"] is not None and len(p["names"]) == len(p["shape"]), path
    want = [None if name == "kv_heads" and not kv_split else EXPECTED[name] for name in p["names"]]
    want = [a if a is None or size % sizes[a] == 0 else None for a, size in zip(want, p["shape"])]
    got = (p["spec"] + [None] * len(want))[:len(want)]
    assert got == want, f"{mesh}: {path} {p['names']} {p['shape']}: {got}, want {want}"
  assert run["moments_as_params"], mesh  # AdamW's moments lie as their parameters


@pytest.mark.slow
def test_fsdp_holds_an_eighth_of_parameters_and_optimizer_state_per_device(meshes):
  run = meshes["xla fsdp=8"]
  print(f"fsdp=8: {run['most_bytes']} of {run['total_bytes']} bytes on the fullest device")
  assert run["most_bytes"] <= 1.05 / 8 * run["total_bytes"], run
  assert meshes["xla data=8"]["most_bytes"] == meshes["xla data=8"]["total_bytes"]  # data parallel: all of it


@pytest.mark.slow
def test_a_checkpoint_restores_into_the_new_meshs_shardings(meshes):
  """fsdp=8's state, saved and restored for fsdp=4 x tensor=2: each array is read into that mesh's sharding (each
  device its own part), the values unchanged."""
  restored = meshes["restored"]
  assert restored["as_target"] and restored["equal"] and restored["split"] > 0, restored


def _train(*args, devices: int) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  return subprocess.run([sys.executable, "-m", "train", *SMALL, *args], cwd=ROOT, env=env, text=True,
                        capture_output=True, timeout=600)


def _losses(path) -> dict[int, float]:
  rows = [json.loads(line) for line in open(path)]
  return {r["step"]: r["loss"] for r in rows if "loss" in r and "step" in r}


def _resumable_from(src, dst, step: int) -> str:
  """A copy of the run folder `src` at `dst` without its steps after `step`: a run stopped after saving `step`."""
  shutil.copytree(src, dst)
  for later in stepdirs.listing(str(dst)).ours:
    if later > step:
      shutil.rmtree(stepdirs.step_path(str(dst), later))
  return str(dst)


@pytest.mark.slow
def test_a_checkpoint_resumes_on_other_meshes_on_the_same_curve(tmp_path):
  """fsdp=8 saves step 10; one device resumes it and saves step 15; fsdp=4 x tensor=2 resumes that: every step
  after a resume has the loss of the run that never stopped."""
  text = _text(tmp_path)
  common = ["--steps", "20", "--data", text]
  done = _train(*common, "--mesh", "fsdp=8", "--ckpt-dir", str(tmp_path / "a"), "--ckpt-every", "10",
                "--metrics", str(tmp_path / "a.jsonl"), devices=8)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "mesh data=1,fsdp=8,tensor=1" in done.stdout
  start = [json.loads(l) for l in open(tmp_path / "a.jsonl") if '"start"' in l][0]
  assert start["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
  whole = _losses(tmp_path / "a.jsonl")
  b = _resumable_from(tmp_path / "a", tmp_path / "b", 10)
  done = _train(*common, "--ckpt-dir", b, "--ckpt-every", "5", "--metrics", str(tmp_path / "b.jsonl"), devices=1)
  assert done.returncode == 0 and "at step 10" in done.stdout, done.stderr[-3000:]
  c = _resumable_from(tmp_path / "b", tmp_path / "c", 15)
  done = _train(*common, "--mesh", "fsdp=4,tensor=2", "--ckpt-dir", c, "--metrics", str(tmp_path / "c.jsonl"),
                "--sample-tokens", "4", devices=8)  # the end-of-run sample gathers the sharded parameters
  assert done.returncode == 0 and "at step 15" in done.stdout and "sample:" in done.stdout, done.stderr[-3000:]
  resumed = {s: l for s, l in _losses(tmp_path / "b.jsonl").items() if s <= 15} | _losses(tmp_path / "c.jsonl")
  assert sorted(resumed) == list(range(11, 21)), sorted(resumed)
  np.testing.assert_allclose([resumed[s] for s in range(11, 21)], [whole[s] for s in range(11, 21)],
                             **reference.tolerance("float32", "loss across meshes"))


# python -m train's checks of --mesh on 8 devices, each in this one process: its exit code, its error line, and
# whether anything compiled before it (jax's compile-time events)
_REFUSALS = textwrap.dedent("""
    import contextlib, io, json, sys
    import jax
    from train import cli
    compiled = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *_, **__: compiled.append(event) if "compil" in event else None)
    out = []
    for case in json.loads(sys.argv[1]):
      err = io.StringIO()
      with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
          cli.main(case)
          code = 0
        except SystemExit as e:
          code = e.code
      out.append({"code": code, "error": err.getvalue(), "compiled": list(compiled)})
    print(json.dumps(out))
""")

REFUSED = {  # --mesh and --batch-size -> what the error line says
    ("data=4", "8"): "spans 4 devices, and there are 8: the product of the sizes must be 8",
    ("data=2,pipe=4", "8"): "'pipe=4' is not AXIS=SIZE with AXIS one of data, fsdp, tensor",
    ("data=0,fsdp=8", "8"): "data=0 must be an int >= 1",
    ("tensor=8", "8"): "splits the 4 query heads (n_head) 8 ways, which does not divide them: give tensor one of 1, "
                       "2, 4",
    ("data=2,fsdp=2,tensor=2", "6"): "--batch-size 6 must be divisible by data x fsdp = 4",
}


@pytest.mark.slow
def test_a_bad_mesh_exits_2_before_anything_compiles(tmp_path):
  text = _text(tmp_path)
  cases = [[*SMALL, "--steps", "2", "--no-ckpt", "--data", text, "--mesh", mesh, "--batch-size", batch]
           for mesh, batch in REFUSED]
  results = _last_json(_python(_REFUSALS, json.dumps(cases)))
  for (mesh, _), want, got in zip(REFUSED, REFUSED.values(), results):
    assert got["code"] == 2 and want in got["error"], (mesh, got)
    assert got["error"].count("\n") == 1 and got["compiled"] == [], (mesh, got)


def test_key_value_heads_held_whole_are_said_and_left_unsplit():
  tiny = models.preset("tiny")  # 4 heads, 2 key/value heads
  assert mesh_lib.notices({"data": 2, "fsdp": 1, "tensor": 4}, tiny) == [
      "--mesh tensor=4: the 2 key/value heads (n_kv_head) are not split 4 ways; every device of the tensor axis "
      "holds all of them, and the attention repeats them per query head (the query heads are split)"]
  assert mesh_lib.notices({"data": 4, "fsdp": 1, "tensor": 2}, tiny) == []
  on = lambda tensor: dict(mesh_lib.rules(types.SimpleNamespace(shape={"tensor": tensor}), tiny))  # rules read .shape
  assert (on(4)["kv_heads"], on(4)["heads"]) == (None, "tensor") and on(2)["kv_heads"] == "tensor"


# Compiles (never runs) the trainer's parameter initialisation for gpt-1b on fsdp=8 and prints its per-device bytes.
_INIT_ON_FSDP = textwrap.dedent("""
    import json
    import jax
    import models
    from train import step, mesh as mesh_lib
    from train.config import TrainConfig
    cfg = TrainConfig(model=models.preset("gpt-1b", backend="xla"), batch_size=8)
    mesh = mesh_lib.make(mesh_lib.parse("fsdp=8", 8))
    init, _, _ = step.initializer(cfg, mesh, step.optimizer(cfg))
    m = init.lower().compile().memory_analysis()
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(init)))
    print(json.dumps({"whole": whole, "output": m.output_size_in_bytes, "temp": m.temp_size_in_bytes}))
""")


@pytest.mark.slow
def test_fsdp_makes_each_devices_parameters_in_place():
  """gpt-1b's initialisation on fsdp=8 holds an eighth of the parameters per device, and at no point all of them."""
  got = _last_json(_python(_INIT_ON_FSDP))
  print(f"gpt-1b init on fsdp=8, per device: {got}")
  assert got["output"] <= 1.05 / 8 * got["whole"], got
  assert got["output"] + got["temp"] <= got["whole"] / 2, got
