"""`python -m benchmarks.wrapper`: what attnlayers.attention costs over calling the kernel directly.

The raw kernels are called as a user would without attnlayers: jax.nn.dot_product_attention
(implementation="cudnn") and TransformerEngine's fused_attn. For each (backend, T, causal,
pass) the two programs are (1) compared op by op in the compiled HLO (a wrapper that adds a
transpose, cast or copy shows up there, and a kernel called with other settings, a mask type
or scale, is another op) and (2) timed in alternating rounds, so clock and
thermal drift hit both alike; the ratio is median(ours) / median(raw) over the rounds.
Writes wrapper.json and wrapper.md to --out.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

import attnlayers
from train import flags
from benchmarks import common, report


def cudnn_raw(q, k, v, causal: bool):
  return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


def te_raw(q, k, v, causal: bool):
  """TE's fused_attn with the scale 1/sqrt(H) as written out by TE's own DotProductAttention, jax's
  dot_product_attention and attnlayers' default: H ** -0.5 is another double at H = 128 (an ulp above), and
  hlo_ops compares the custom call's settings, its scaling_factor among them."""
  from transformer_engine.jax import attention as te  # TE's own op, as its users call it
  (B, T, _, H), S = q.shape, k.shape[1]
  lengths = te.SequenceDescriptor.from_seqlens((jnp.full((B,), T, jnp.int32), jnp.full((B,), S, jnp.int32)))
  mask = te.AttnMaskType.CAUSAL_MASK if causal else te.AttnMaskType.NO_MASK
  return te.fused_attn((q, k, v), None, lengths, None, attn_bias_type=te.AttnBiasType.NO_BIAS, attn_mask_type=mask,
                       qkv_layout=te.QKVLayout.BSHD_BSHD_BSHD, softmax_type=te.AttnSoftmaxType.VANILLA_SOFTMAX,
                       scaling_factor=1.0 / math.sqrt(H), dropout_probability=0.0, is_training=True)


RAW = {"cudnn": cudnn_raw, "te": te_raw}  # backend -> the kernel called directly
_OP = re.compile(r"=\s+(?:\([^=]*?\)|\S+)\s+([a-z][\w-]*)\(")
_IGNORED = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}


_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_SCHEDULING = ("operation_queue_id", "wait_on_operation_queues", "algorithm")  # where and how, not what, it runs
COMPARED = "opcode counts (fused bodies included); each custom call by its target and settings"  # rows' hlo_compared


def hlo_ops(fn, *args) -> collections.Counter:
  """Instruction counts of fn's compiled program (fused bodies included): by opcode, each custom call by its
  target and its settings (custom_call_key), so a kernel called with another mask or scale is another op."""
  return count_ops(jax.jit(fn).lower(*args).compile().as_text())


def count_ops(hlo: str) -> collections.Counter:
  """hlo_ops of an HLO module's text."""
  ops = collections.Counter()
  for line in hlo.splitlines():
    for op in _OP.findall(line):
      if op not in _IGNORED:
        ops[custom_call_key(line) if op == "custom-call" else op] += 1
  return ops


def custom_call_key(line: str) -> str:
  """'custom-call TARGET SETTINGS' for an HLO custom-call instruction: its backend_config (for cuDNN's attention,
  mask type, scale, dropout, layouts...) without the fields that say where and with which algorithm it runs (a
  stream, the autotuned engine), as sorted JSON; a config that is not JSON (an FFI call's attributes) as written."""
  target = _TARGET.search(line)
  at = line.find("backend_config=")
  config = ""
  if at >= 0:
    text = line[at + len("backend_config="):]
    try:
      config = json.dumps(_without_scheduling(json.JSONDecoder().raw_decode(text)[0]), sort_keys=True)
    except ValueError:
      config = _balanced(text)
  return f"custom-call {target.group(1) if target else '?'} {config}".rstrip()


def _without_scheduling(value):
  if isinstance(value, dict):
    return {k: _without_scheduling(v) for k, v in value.items() if k not in _SCHEDULING}
  return value


def _balanced(text: str) -> str:
  """The leading {...} (or "...") of `text` with its nesting closed, else `text` up to the next ', ' attribute."""
  if text[:1] == '"':
    end = text.find('"', 1)
    return text[:end + 1] if end > 0 else text
  depth = 0
  for i, c in enumerate(text):
    depth += {"{": 1, "}": -1}.get(c, 0)
    if depth == 0:
      return text[:i + 1] if text[:1] == "{" else text.split(", ")[0]
  return text


def programs(backend: str, causal: bool, pass_: str, shape):
  B, T, N, H = shape
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (B, T, N, H), jnp.bfloat16) for key in keys)  # (B, T, N, H)
  ours = lambda q, k, v: attnlayers.attention(q, k, v, backend=backend, is_causal=causal)
  raw = lambda q, k, v: RAW[backend](q, k, v, causal)
  if pass_ == "fwd":
    return ours, raw, (q, k, v)
  fb_ours, args = common.forward_backward(ours, (q, k, v))
  fb_raw, _ = common.forward_backward(raw, (q, k, v))
  return fb_ours, fb_raw, args


def measure(backend, T, causal, pass_, N, H, B, rounds, calls) -> dict:
  row = {"backend": backend, "B": B, "T": T, "N": N, "H": H, "causal": causal, "pass": pass_}
  ours, raw, args = programs(backend, causal, pass_, (B, T, N, H))
  ops_ours, ops_raw = hlo_ops(ours, *args), hlo_ops(raw, *args)
  ours, raw = jax.jit(ours), jax.jit(raw)
  t_ours, t_raw = [], []
  for _ in range(rounds):
    t_ours.append(common.time_fn(ours, *args, calls=calls).median_ms)
    t_raw.append(common.time_fn(raw, *args, calls=calls).median_ms)
  diff = sorted(f"{op}: {ops_ours[op]} vs {ops_raw[op]}" for op in ops_ours | ops_raw if ops_ours[op] != ops_raw[op])
  return row | {"ours_ms": float(np.median(t_ours)), "raw_ms": float(np.median(t_raw)),
                "ratio": float(np.median(t_ours) / np.median(t_raw)), "same_hlo_ops": not diff,
                "hlo_compared": COMPARED, "hlo_op_differences": "; ".join(diff)}


def main(argv=None) -> None:
  p = flags.Parser(prog="python -m benchmarks.wrapper", description=flags.description(__doc__), formatter_class=flags.Help)
  one = flags.int_at_least(1)
  p.add_argument("--backends", nargs="+", choices=list(RAW), default=list(RAW), help="the kernels compared")
  p.add_argument("--seqs", type=one, nargs="+", default=[1024, 4096, 16384], help="T = S values")
  p.add_argument("--shape", type=one, nargs=3, default=[2, 16, 128], metavar=("B", "N", "H"),
                 help="batch, heads, head dim of q, k and v")
  p.add_argument("--rounds", type=one, default=5, help="alternating timing rounds of --calls calls each")
  p.add_argument("--calls", type=one, default=20, help="timed calls per program and round")
  p.add_argument("--out", default="runs/benchmarks", help="output folder (published results: benchmarks/results/h200, written only when named here)")
  a = p.parse_args(argv)
  common.check_out(p, a.out)  # before any timing: rows that cannot be written are never timed
  B, N, H = a.shape
  q = jax.ShapeDtypeStruct((B, min(a.seqs), N, H), jnp.bfloat16)  # (B, T, N, H)
  common.refuse_unless_runnable(  # every kernel this compares must run here: say why not, before any work
      {f"--backends {b}": attnlayers.explain(b, q, q, q, is_causal=True) for b in a.backends},
      "This benchmark times each kernel itself, against attnlayers.attention: run it where the kernel runs")
  rows = [measure(b, T, c, ps, N, H, B, a.rounds, a.calls) for b in a.backends for T in a.seqs
          for c in (False, True) for ps in ("fwd", "fwd+bwd")]
  env = common.environment()
  os.makedirs(a.out, exist_ok=True)
  report.write_json(os.path.join(a.out, "wrapper.json"), env, rows)
  cols = ["backend", "T", "causal", "pass", "ours_ms", "raw_ms", "ratio", "same_hlo_ops", "hlo_op_differences"]
  md = f"# attnlayers.attention vs the kernel called directly\n\n{env}\n\n" + report.markdown_table(rows, cols) + "\n"
  with open(os.path.join(a.out, "wrapper.md"), "w") as f:
    f.write(md)
  print(md)


if __name__ == "__main__":
  main()
