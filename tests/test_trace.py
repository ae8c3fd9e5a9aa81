"""benchmarks.trace: GPU time by kernel family and by part of the step, from a profiler trace's events."""

import gzip
import json

import pytest

from benchmarks import trace


def _events():
  meta = [{"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}}]
  k = lambda name, ts, dur, op, pid=7, hlo=None: {"ph": "X", "pid": pid, "name": name, "ts": ts, "dur": dur,
                                                  "args": {"name": op} | ({"hlo_op": hlo} if hlo else {})}
  return meta + [
      k("nvjet_sm90_tst_128x128_bias_NNT", 0, 10, "jit(train_step)/jvp()/dot_general", hlo="cublas-lt-matmul.91"),
      k("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 10, 5, "jit(train_step)/jvp()/dot_product_attention",
        hlo="dot_product_attention_fwd.60"),
      k("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", 15, 12, "jit(train_step)/transpose(jvp())/dpa",
        hlo="dot_product_attention_bwd.120"),
      k("nvjet_sm90_tst_192x192_splitK_NTN", 27, 20, "jit(train_step)/transpose(jvp())/dot_general",
        hlo="custom-call.401"),
      k("loop_add_fusion", 50, 3, "jit(train_step)", hlo="loop_add_fusion.7"),  # the optimizer: no jvp, no transpose
      k("Memset 3", 53, 1, "jit(train_step)/transpose(jvp())/dpa", hlo="dot_product_attention_bwd.120"),
      k("_kernel__2", 54, 6, "jit(train_step)/jvp()/while/body/pallas_call", hlo="pallas_call.139"),
      {"ph": "X", "pid": 7, "name": "input_reduce_fusion", "ts": 60, "dur": 2, "args": {}},  # from a CUDA graph: no op name
      k("host_thing", 0, 1000, "jit(train_step)/jvp()", pid=1),  # not on the GPU: left out
  ]


def test_summarize_splits_time_by_family_and_part():
  s = trace.summarize(_events())
  assert s["span_ms"] == pytest.approx(0.062) and s["busy_ms"] == pytest.approx(0.059)  # idle from 47 to 50 us
  assert s["families_ms"] == pytest.approx({"matmul (cuBLAS/GEMM)": 0.030, "attention (cuDNN/flash)": 0.017,
                                            "other (XLA fusions, Pallas)": 0.011, "copies/memset": 0.001})
  assert s["kernels"] == {"matmul (cuBLAS/GEMM)": 2, "attention (cuDNN/flash)": 2, "other (XLA fusions, Pallas)": 3,
                           "copies/memset": 1}
  parts = s["parts_ms"]
  assert parts["forward"] == pytest.approx({"matmul (cuBLAS/GEMM)": 0.010, "attention (cuDNN/flash)": 0.005,
                                            "other (XLA fusions, Pallas)": 0.006})
  assert parts["backward"] == pytest.approx({"matmul (cuBLAS/GEMM)": 0.020, "attention (cuDNN/flash)": 0.012,
                                             "copies/memset": 0.001})
  assert parts["rest"] == pytest.approx({"other (XLA fusions, Pallas)": 0.003})
  assert parts["unnamed"] == pytest.approx({"other (XLA fusions, Pallas)": 0.002})
  assert s["top_ops_ms"] == pytest.approx({  # by kind of XLA instruction and part, longest first
      ("custom-call", "backward"): 0.020, ("dot_product_attention_bwd", "backward"): 0.013,
      ("cublas-lt-matmul", "forward"): 0.010, ("pallas_call", "forward"): 0.006,
      ("dot_product_attention_fwd", "forward"): 0.005, ("loop_add_fusion", "rest"): 0.003,
      (trace.UNNAMED_OP, "unnamed"): 0.002})
  assert s["op_kernels"][("dot_product_attention_bwd", "backward")] == 2  # the bprop and its memset


@pytest.mark.parametrize("hlo_op, want", [("input_reduce_fusion.19", "input_reduce_fusion"),
                                          ("dynamic_slice_fusion#0", "dynamic_slice_fusion"),
                                          ("custom-call.4", "custom-call"), ("copy", "copy"), ("", trace.UNNAMED_OP)])
def test_op_kind_drops_the_instruction_number(hlo_op, want):
  assert trace.op_kind({"args": {"hlo_op": hlo_op}}) == want


@pytest.mark.parametrize("op, want", [("jit(f)/transpose(jvp(jit(_take)))/scatter-add", "backward"),
                                      ("jit(f)/jvp()/while/body/add", "forward"), ("jit(f)", "rest"), ("", "unnamed")])
def test_part_of_an_op_name(op, want):
  assert trace.part(op) == want


def test_main_prints_per_step_figures(tmp_path, capsys):
  path = tmp_path / "perfetto_trace.json.gz"
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": _events()}, f)
  trace.main([str(tmp_path), "--steps", "2"])
  out = capsys.readouterr().out
  assert "GPU span 0.03 ms/step" in out and "by part of the step" in out and "unnamed" in out
  assert "backward      0.02" in out  # 0.033 ms over 2 steps
  assert "kernels/step" in out
  assert "0.01      0.5  custom-call (backward)" in out  # 0.020 ms and 1 kernel over 2 steps


def test_events_as_jax_profiler_writes_them():
  """Two kernel events as an H200 trace of the training step holds them: with the op name (a step compiled
  without CUDA graphs; argument values copied from such a trace) and without (from a CUDA graph)."""
  named = {"ph": "X", "pid": 7, "ts": 0.0, "dur": 200.32, "name": "nvjet_sm90_tst_128x160_64x5_2x1_v_bz_TNT",
           "args": {"context_id": "$$1", "correlation_id": "538", "hlo_module": "jit_train_step",
                    "hlo_op": "custom-call.293", "name": "jit(train_step)/transpose(jvp())/dot_general",
                    "scope_range_id": "281474976711115", "tf_op": "XlaModule:", "unique_hlo_op_id": "828928689420"}}
  from_graph = {"ph": "X", "pid": 7, "tid": 1202383506, "ts": 300.0, "dur": 14.167,
                "name": "nvjet_sm90_tst_128x128_64x6_2x1_v_bz_bias_NNT",
                "args": {"context_id": "$$1", "correlation_id": "3", "device_id": "0", "scope_range_id": "281474976710666"}}
  s = trace.summarize(_events()[:2] + [named, from_graph])
  assert s["parts_ms"]["backward"] == pytest.approx({"matmul (cuBLAS/GEMM)": 0.20032})
  assert s["parts_ms"]["unnamed"] == pytest.approx({"matmul (cuBLAS/GEMM)": 0.014167})


def test_a_trace_without_gpu_kernels_is_refused():
  with pytest.raises(SystemExit, match="no GPU kernels"):
    trace.summarize(_events()[:2])


def test_gpu_span_is_the_kernels_extent_and_union_and_none_without_gpu_kernels():
  span, busy = trace.gpu_span(_events())
  assert (span, busy) == (62, 59)  # microseconds; the host event is left out
  assert trace.gpu_span([e for e in _events() if e.get("pid") != 7]) is None  # a CPU run's trace
