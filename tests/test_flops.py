"""Every benchmark program's FLOP formula against the dots XLA compiled (CPU), and the peak guard.

The benchmarks time programs whose rates use benchmarks.flops' formulas. XLA deletes work
whose result nobody uses, so a program that drops its forward output would run fewer FLOPs
than the formula counts and print an inflated rate; here each program is compiled with the
XLA-built backends (naive, xla: plain dots) and its dot FLOPs are counted from the HLO.
XLA's unfused attention computes the full T x S square even when causal, so for causal
programs the formula (the lower triangle) must be exactly half of the attention's dots.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from benchmarks import common, flops, fp8, layer

B, T, N, K, H = 2, 16, 4, 2, 8


def compiled(program) -> float:
  fn, args = program
  return flops.compiled_dot_flops(fn, *args)


def case(backend, level, pass_, causal, k=K):
  return layer.Case("test", backend, "float32", B, T, N, k, H, causal, pass_, level)


@pytest.mark.parametrize("backend", ["naive", "xla"])
@pytest.mark.parametrize("level", ["core", "layer"])
@pytest.mark.parametrize("pass_", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_layer_benchmark_formula_is_what_xla_compiled(backend, level, pass_, causal):
  c = case(backend, level, pass_, causal)
  ran = compiled(layer._program(c))
  full_square = flops.attention_full_square(B, T, T, N, H, pass_=pass_)
  proj = flops.projections(B, T, N * H, N, K, H, pass_=pass_) if level == "layer" else 0.0
  assert ran == full_square + proj, (ran, full_square, proj)
  assert c.flops() == (0.5 * full_square if causal else full_square) + proj
  assert c.flops() <= ran  # never counts more than ran


def test_forward_backward_keeps_the_forward():
  """Returning only the gradients lets XLA drop P.V's forward (and the projections' forwards)."""
  c = case("xla", "layer", "fwd", False)
  f, args = layer._program(c)
  fb, fb_args = common.forward_backward(f, args)
  grads_only = lambda *a: fb(*a)[1]
  kept, dropped = flops.compiled_dot_flops(fb, *fb_args), flops.compiled_dot_flops(grads_only, *fb_args)
  assert kept == dataclasses.replace(c, pass_="fwd+bwd").flops()
  assert dropped < kept  # what the benchmarks measured before their programs kept the output


def test_fp8_benchmark_bf16_programs_are_what_xla_compiled():
  xs, w = fp8.projection_inputs(1, 8, 32)
  fb, args = common.forward_backward(fp8.bf16_projections, (xs, w))
  assert flops.compiled_dot_flops(fb, *args) == flops.projections(1, 8, 32, 4, 4, 8, pass_="fwd+bwd")
  for causal in (False, True):
    f, args = fp8.layer_program(1, 16, 32, 4, causal, "xla")
    fb, fb_args = common.forward_backward(f, args)
    attention_ran = flops.attention_full_square(1, 16, 16, 4, 8, pass_="fwd+bwd")
    proj = flops.projections(1, 16, 32, 4, 4, 8, pass_="fwd+bwd")
    assert flops.compiled_dot_flops(fb, *fb_args) == attention_ran + proj
    assert fp8.layer_flops(1, 16, 32, 4, causal, "fwd+bwd") == (0.5 if causal else 1.0) * attention_ran + proj


def test_gqa_and_mqa_count_the_same_attention_flops():
  for k in (N, 2, 1):
    c = case("naive", "core", "fwd+bwd", False, k=k)
    assert compiled(layer._program(c)) == c.flops() == 3 * 4 * B * N * T * T * H


def test_a_rate_above_the_peak_stops_the_benchmark():
  assert flops.check_rate("ok", 1e12, 1.0, 2e12, "bf16") == 1e12
  with pytest.raises(flops.ImpossibleRate, match="above the device's bf16 dense peak of 1 TFLOP/s"):
    flops.check_rate("inflated", 3e12, 1.0, 1e12, "bf16")
  assert flops.check_rate("no peak known", 3e12, 1.0, None, "bf16") == 3e12  # CPUs: nothing to check against


def test_counter_refuses_programs_it_cannot_count():
  conv = lambda x, w: jax.lax.conv(x, w, (1, 1), "SAME")
  x, w = jnp.ones((1, 2, 8, 8)), jnp.ones((3, 2, 3, 3))
  with pytest.raises(ValueError, match="not counted here"):
    flops.compiled_dot_flops(conv, x, w)


def test_packed_documents_count_each_documents_causal_triangle():
  # 2 documents of 4 tokens in a row of 8, B1 N1 H1: 2 x (4 * 4*4 / 2) = 64 forward, x3 with the backward
  assert flops.attention_segments(1, 8, 1, 1, documents=2, causal=True, pass_="fwd") == 64
  assert flops.attention_segments(1, 8, 1, 1, documents=2, causal=True, pass_="fwd+bwd") == 192
  assert flops.attention_segments(1, 8, 1, 1, documents=2, causal=False, pass_="fwd") == 2 * 4 * 4 * 4
  assert flops.attention_segments(2, 16, 4, 8, documents=1, causal=True, pass_="fwd") == \
      flops.attention(2, 16, 16, 4, 8, causal=True, pass_="fwd")  # one document: the plain causal call
  with pytest.raises(ValueError, match=r"documents \(3\) must be >= 1 and divide T \(8\)"):
    flops.attention_segments(1, 8, 1, 1, documents=3, causal=True, pass_="fwd")


def test_sliding_window_counts_the_in_window_causal_pairs():
  # T=4, left=1: queries 0..3 attend 1, 2, 2, 2 keys
  assert flops.window_pairs(4, 1) == 7
  assert flops.window_pairs(4, 0) == 4  # each query its own key
  assert flops.window_pairs(4, 3) == flops.window_pairs(4, 100) == 10  # the whole causal triangle, diagonal included
  for T, left in [(1, 0), (5, 2), (64, 16), (100, 99), (37, 200)]:
    assert flops.window_pairs(T, left) == sum(min(t + 1, left + 1) for t in range(T))
  assert flops.attention_window(1, 4, 2, 8, left=1, pass_="fwd+bwd") == 3 * 4 * 2 * 8 * 7
  # a window over the whole row counts the diagonal exactly: T / 2 pairs above the convention's T^2 / 2
  gap = flops.attention_window(B, T, N, H, left=T - 1, pass_="fwd") - flops.attention(B, T, T, N, H, causal=True,
                                                                                      pass_="fwd")
  assert gap == 4 * B * N * H * T / 2


@pytest.mark.parametrize("level, pass_", [("core", "fwd+bwd"), ("layer", "fwd+bwd")])
@pytest.mark.parametrize("extra", [dict(segments=4), dict(window=3)], ids=["segments4", "window3"])
def test_packing_programs_run_the_full_square_and_count_only_the_unmasked_pairs(level, pass_, extra):
  c = dataclasses.replace(case("xla", level, pass_, True), **extra)
  fn, args = layer._program(c)
  assert any(x.dtype == jnp.int32 for x in jax.tree.leaves(args)) == ("segments" in extra)  # ids: an argument
  ran = flops.compiled_dot_flops(fn, *args)
  proj = flops.projections(B, T, N * H, N, K, H, pass_=pass_) if level == "layer" else 0.0
  assert ran == flops.attention_full_square(B, T, T, N, H, pass_=pass_) + proj  # unfused: the square, masked
  assert c.flops() - proj == (flops.attention_segments(B, T, N, H, documents=4, causal=True, pass_=pass_)
                              if "segments" in extra else flops.attention_window(B, T, N, H, left=3, pass_=pass_))
  assert c.flops() < ran
