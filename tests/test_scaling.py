"""The scaling model (benchmarks.scaling_model, benchmarks.scaling) and the HLO reader it is checked with
(benchmarks.collectives): exact bytes on programs and configs counted by hand. No weights are made: parameters
are shapes (nnx.eval_shape)."""

import json
import os
import subprocess
import sys

import pytest

import models
from benchmarks import collectives, scaling, scaling_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# HLO text in the forms the reader must take: operands typed inline or by name, async pairs, a tuple all-reduce,
# a loop that runs its body's all-reduce 3 times.
HLO = """
%body (t: (s32[], f32[10])) -> (s32[], f32[10]) {
  %t = (s32[], f32[10]{0}) parameter(0)
  %x = f32[10]{0} get-tuple-element(%t), index=1
  %looped = f32[10]{0} all-reduce(%x), replica_groups=[1,8]<=[8], to_apply=%add
  ROOT %next = (s32[], f32[10]{0}) tuple(%i, %looped)
}

ENTRY %main (p: f32[1,64], big: f32[16,64], a: f32[10], b: bf16[4,4]) -> f32[10] {
  %p = f32[1,64]{1,0} parameter(0)
  %big = f32[16,64]{1,0} parameter(1)
  %a = f32[10]{0} parameter(2)
  %b = bf16[4,4]{1,0} parameter(3)
  %ags = (f32[1,64]{1,0}, f32[8,64]{1,0}) all-gather-start(f32[1,64]{1,0} %p), replica_groups=[1,8]<=[8], dimensions={0}
  %agd = f32[8,64]{1,0} all-gather-done((f32[1,64]{1,0}, f32[8,64]{1,0}) %ags)
  %rs = f32[2,64]{1,0} reduce-scatter(%big), replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
  %ar = (f32[10]{0}, bf16[4,4]{1,0}) all-reduce(%a, %b), replica_groups=[1,8]<=[8], to_apply=%add
  %ars = f32[10]{0} all-reduce-start(%a), replica_groups=[1,8]<=[8], to_apply=%add
  %ard = f32[10]{0} all-reduce-done(%ars)
  %cps = (f32[10]{0}, f32[10]{0}, u32[], u32[]) collective-permute-start(%a), source_target_pairs={{0,1}}
  %cpd = f32[10]{0} collective-permute-done(%cps)
  %loop = (s32[], f32[10]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[10]{0} get-tuple-element(%loop), index=1
}
"""


def on_8_devices(code: str):
  """The JSON that `code` prints last, run in a fresh process (which sets up 8 CPU devices itself)."""
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr
  return json.loads(out.stdout.splitlines()[-1])


def test_the_reader_sizes_every_form_of_collective():
  found = collectives.parse(HLO)
  assert [(c.kind, c.operand_bytes, c.result_bytes, c.runs) for c in found] == [
      ("all-reduce", 40, 40, 3),  # in the loop's body
      ("all-gather", 256, 2048, 1),  # one (1, 64) float32 shard in, all 8 out
      ("reduce-scatter", 4096, 512, 1),  # (16, 64) in, a (2, 64) shard out
      ("all-reduce", 40 + 32, 40 + 32, 1),  # two arrays combined: float32 (10,) and bfloat16 (4, 4)
      ("all-reduce", 40, 40, 1),
      ("collective-permute", 40, 40, 1)]  # its u32 context scalars are not data
  totals = collectives.summarize(found)
  assert totals["all-gather"] == {"count": 1, "operand_bytes": 256, "result_bytes": 2048, "payload": 2048}
  assert totals["all-reduce"] == {"count": 5, "operand_bytes": 232, "result_bytes": 232, "payload": 3 * 40 + 72 + 40}
  assert totals["reduce-scatter"]["payload"] == 4096
  assert found[3].arrays == (("f32[10]", 40), ("bf16[4,4]", 32))


def test_a_loop_of_unknown_length_around_a_collective_is_refused():
  unknown = HLO.replace(', backend_config={"known_trip_count":{"n":"3"}}', "")
  with pytest.raises(ValueError, match="known trip count"):
    collectives.parse(unknown)


@pytest.mark.slow  # a python process of its own, on 8 CPU devices
def test_the_reader_on_a_sharded_program_compiled_for_8_devices():
  """An (8, 64) float32 array split over 8 CPU devices and gathered whole: one all-gather of 2048 bytes from
  256; its column sums made whole: one all-reduce of the (64,) partial sums, 256 bytes."""
  code = """if True:
    import json
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from benchmarks import collectives
    from benchmarks.scaling_check import use_cpu_devices
    use_cpu_devices(8)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    whole = NamedSharding(mesh, P())
    programs = (jax.jit(lambda a: a * 2, out_shardings=whole), jax.jit(lambda a: a.sum(0), out_shardings=whole))
    print(json.dumps([collectives.summarize(collectives.parse(f.lower(x).compile().as_text())) for f in programs]))
  """
  gather, reduce = on_8_devices(code)
  assert gather["all-gather"] == {"count": 1, "operand_bytes": 256, "result_bytes": 2048, "payload": 2048}
  assert reduce["all-reduce"] == {"count": 1, "operand_bytes": 256, "result_bytes": 256, "payload": 256}
  for kind in collectives.KINDS:
    assert gather[kind]["count"] == (kind == "all-gather") and reduce[kind]["count"] == (kind == "all-reduce")


ONE_DEVICE = {"data": 1, "fsdp": 1, "tensor": 1}
# tiny, counted by hand: V 256, T 128, D 128, 2 blocks, 4 heads and 2 key/value heads of 32, MLP 512, biases
TINY_BLOCK = (2 * 128  # ln1 scale and bias
              + 128 * 4 * 32 + 4 * 32  # query kernel and bias
              + 2 * (128 * 2 * 32 + 2 * 32)  # key and value
              + 4 * 32 * 128 + 128  # out
              + 2 * 128  # ln2
              + 128 * 512 + 512 + 512 * 128 + 128)  # fc, proj
TINY = 2 * TINY_BLOCK + 256 * 128 + 128 * 128 + 2 * 128  # blocks, token and position tables, ln_f


def test_memory_of_tiny_on_one_device_is_counted_by_hand():
  m = scaling_model.memory(models.preset("tiny"), ONE_DEVICE, rows=1)
  assert TINY == 412928
  assert (m["params"], m["grads"], m["optimizer"], m["gathered"]) == (4 * TINY, 4 * TINY, 8 * TINY, 0)
  s, d, c = 128, 128, 4  # tiny computes in float32
  # LayerNorms' inputs and outputs, Q and the attention's output, K and V (2 heads of 32), log-sum-exp, GELU's
  block = 4 * c * s * d + 2 * c * s * d + 2 * c * s * 32 * 2 + 4 * s * 4 + 2 * c * s * 4 * d
  assert scaling_model.block_activations(models.preset("tiny"), s, 1, 1) == block == 985088
  assert m["activations"] == 2 * block + 2 * c * s * d + c * 256 * d
  assert m["total"] == sum(v for k, v in m.items() if k != "total")


def test_tensor_parallelism_splits_what_korthikanti_splits():
  """Under t-way tensor parallelism the LayerNorms' inputs and outputs stay whole; the rest is split t ways."""
  cfg = models.preset("gpt-7b")  # 8 key/value heads: tensor=8 splits them
  s, d, c = 4096, 4096, 2
  whole = 4 * c * s * d
  split = lambda t: scaling_model.block_activations(cfg, s, 1, t) - whole
  assert split(8) == split(1) // 8


def test_fsdp_holds_a_1_over_n_share_of_every_split_parameter():
  cfg = models.preset("gpt-1b")
  whole = scaling_model.parameters(cfg, ONE_DEVICE)
  total = sum(x.size * x.copies for x in whole)
  assert 1.07e9 < total < 1.08e9
  for n in scaling.DEVICES:
    ps = scaling_model.parameters(cfg, {"data": 1, "fsdp": n, "tensor": 1})
    split = sum(x.size * x.copies for x in ps if x.fsdp)
    held = sum(x.local_size * x.copies for x in ps)
    assert held == split // n + sum(x.size * x.copies for x in ps if not x.fsdp)
    assert scaling_model.memory(cfg, {"data": 1, "fsdp": n, "tensor": 1})["params"] == 4 * held
  fsdp8 = sum(x.local_size * x.copies for x in scaling_model.parameters(cfg, {"data": 1, "fsdp": 8, "tensor": 1}))
  assert fsdp8 <= 1.05 * total / 8  # LayerNorms and q/k/v biases, held whole, are a small part


def test_collective_bytes_of_dp_and_fsdp():
  """DP all-reduces every gradient: 2 (n - 1) / n of the model's bytes on the wire. FSDP gathers each split
  parameter twice (forward, backward) and reduce-scatters its gradient, (n - 1) / n each."""
  cfg, n = models.preset("tiny"), 8
  dp = scaling_model.transfers(cfg, {"data": n, "fsdp": 1, "tensor": 1})
  assert [(x.kind, x.payload) for x in dp] == [("all-reduce", 4 * TINY)]
  assert scaling_model.wire_bytes(dp[0]) == 2 * (n - 1) / n * 4 * TINY
  fsdp = scaling_model.per_kind(scaling_model.transfers(cfg, {"data": 1, "fsdp": n, "tensor": 1}))
  split = sum(x.size * x.copies for x in scaling_model.parameters(cfg, {"data": 1, "fsdp": n, "tensor": 1}) if x.fsdp)
  assert fsdp == {"all-gather": 2 * 4 * split, "reduce-scatter": 4 * split, "all-reduce": 4 * (TINY - split)}


def test_the_7b_preset_is_7b_class_and_never_made():
  cfg = models.preset("gpt-7b")
  assert (cfg.head_dim, cfg.n_head, cfg.n_kv_head, cfg.seq_len) == (128, 32, 8, 4096)
  total = sum(x.size * x.copies for x in scaling_model.parameters(cfg, ONE_DEVICE))
  assert 7.2e9 < total < 7.3e9


@pytest.mark.parametrize("name", scaling.PRESETS)
def test_every_layout_fits_its_mesh(name):
  for row in scaling.table_rows(name):
    assert row["total_gib"] > 0 and row["comm_gb"] > 0, row


@pytest.mark.slow  # a python process of its own, on 8 CPU devices
def test_the_checked_step_is_the_trainers_and_fsdp_moves_what_the_model_says():
  """On 8 CPU devices: the abstract step benchmarks.scaling_check compiles has train.step.build's collectives on
  tiny; and on fsdp=8 it gathers the split parameters and reduces the gradients that the model counts, to
  within the few small vectors and scalars it leaves out, and takes the parameters and optimizer state the
  model says a device holds."""
  code = """if True:
    import json
    import models
    from benchmarks import scaling_check
    scaling_check.use_cpu_devices(8)
    scaling_check.same_as_trainer(models.preset("tiny"), {"data": 1, "fsdp": 4, "tensor": 2})
    rows, _, memory = scaling_check.compare("tiny", None, {"data": 1, "fsdp": 8, "tensor": 1})
    print(json.dumps([rows, memory]))
  """
  found, memory = on_8_devices(code)
  rows = {r["kind"]: r for r in found}
  gather = rows["all-gather"]
  assert gather["model_bytes"] <= gather["hlo_bytes"] <= 1.02 * gather["model_bytes"]  # and (d,) vectors, token ids
  both = rows["all-reduce+reduce-scatter"]
  assert both["model_bytes"] <= both["hlo_bytes"] <= both["model_bytes"] + 64  # the loss's and norms' scalars
  tokens = 2 * 4 * 128  # one row of inputs and one of targets, int32, on each device
  # and AdamW's two int32 counts (the step number is unused without dropout, and jit drops unused arguments)
  assert memory["hlo_argument_bytes"] - memory["model_state_bytes"] - tokens == 8
