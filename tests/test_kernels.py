"""benchmarks.kernels: the kernels of one decode step, read from the compiled program (here on the CPU)."""

import jax
import pytest

import models
from benchmarks import kernels
from models import generate


def test_an_instruction_is_the_kernel_it_launches():
  fusion = ('%loop_add_fusion = bf16[2,768]{1,0} fusion(%a, %b), kind=kLoop, calls=%fused_add, '
            'backend_config={"operation_queue_id":"0"}')
  gemm = ('%gemm_fusion_dot.3 = bf16[2,768]{1,0} fusion(%a, %w), kind=kCustom, calls=%c, '
          'backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}')
  call = '%fmha = (bf16[2,12,1,64]{3,1,2,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax"'
  assert kernels.kind(fusion) == "fusion:kLoop"
  assert kernels.kind(gemm) == "fusion:kCustom:__triton_nested_gemm_fusion"
  assert kernels.kind(call) == "custom-call:__cudnn$fmhaSoftmax"
  assert kernels.kind("%copy.1 = s32[2]{0} copy(%gte)") == "copy"
  for free in ("%p = s32[] parameter(0)", "%b = bf16[2,768]{1,0} bitcast(%a)", "ROOT %t = (s32[]) tuple(%i)",
               "%g = s32[] get-tuple-element(%t), index=0"):
    assert kernels.kind(free) is None


def test_each_block_adds_its_kernels_to_a_decode_step():
  """The decode loop's kernels, counted on this machine's compile: a second block adds as many as the first
  block has, and the loop has kernels beyond the blocks (the head, the sampling, the bookkeeping)."""
  device = jax.devices()[0]
  counts = {}
  for n_layer in (1, 2, 3):
    cfg = models.preset("tiny", n_layer=n_layer, backend="xla")
    lowered = generate.lower_decode(cfg, batch=2, cache_len=64, sampling=generate.Sampling(temperature=0),
                                    compiler_options={}, sharding=jax.sharding.SingleDeviceSharding(device))
    counts[n_layer] = sum(kernels.loop_kernels(lowered.compile().as_text()).values())
  per_block = counts[2] - counts[1]
  assert per_block > 0 and counts[3] - counts[2] == per_block and counts[1] > per_block, counts


def test_a_program_without_a_loop_is_refused():
  text = jax.jit(lambda x: x + 1).lower(1.0).compile().as_text()
  with pytest.raises(ValueError, match="no while loop"):
    kernels.loop_kernels(text)


def test_a_command_buffers_call_counts_as_the_kernels_it_holds():
  """Where XLA outlines kernels into a command buffer's computation, the loop is found through the call and the
  call counts as what it holds."""
  hlo = """HloModule m

%fused_add (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  ROOT %a = f32[2]{0} add(%p, %p)
}

%command_buffer.1 (q: f32[2]) -> f32[2] {
  %q = f32[2]{0} parameter(0)
  %f1 = f32[2]{0} fusion(%q), kind=kLoop, calls=%fused_add
  ROOT %f2 = f32[2]{0} fusion(%f1), kind=kLoop, calls=%fused_add
}

%body (t: (s32[], f32[2])) -> (s32[], f32[2]) {
  %t = (s32[], f32[2]{0}) parameter(0)
  %x = f32[2]{0} get-tuple-element(%t), index=1
  %c = f32[2]{0} call(%x), to_apply=%command_buffer.1
  %g = f32[2]{0} custom-call(%c), custom_call_target="__cudnn$fmhaSoftmax"
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %r = (s32[], f32[2]{0}) tuple(%i, %g)
}

%cond (u: (s32[], f32[2])) -> pred[] {
  %u = (s32[], f32[2]{0}) parameter(0)
  %j = s32[] get-tuple-element(%u), index=0
  ROOT %lt = pred[] compare(%j, %j), direction=LT
}

%command_buffer (v: (s32[], f32[2])) -> (s32[], f32[2]) {
  %v = (s32[], f32[2]{0}) parameter(0)
  ROOT %w = (s32[], f32[2]{0}) while(%v), condition=%cond, body=%body
}

ENTRY %main (e: (s32[], f32[2])) -> (s32[], f32[2]) {
  %e = (s32[], f32[2]{0}) parameter(0)
  ROOT %k = (s32[], f32[2]{0}) call(%e), to_apply=%command_buffer
}
"""
  assert kernels.loop_kernels(hlo) == {"fusion:kLoop": 2, "custom-call:__cudnn$fmhaSoftmax": 1, "compare": 1}
