"""`python -m benchmarks.step`: where one GPT training step's time goes.

Times, with the one timing helper, the forward pass with loss, forward + backward, and the
whole step with the AdamW update, for one model and attention backend; the differences
give backward and optimizer time. The loss is the training loss (train.step.batch_loss itself: the
output layer fused with the cross-entropy in chunks, models.loss), and the step differentiates
with respect to the FP8 scaling state too, as training does (te-fp8). Also the output layer + loss
alone, both ways: float32 (B, T, V) logits + optax, and fused (logits are the largest
activation of a GPT-2-sized vocabulary); the fused loss's softmax - onehot on the kernel that
--kernels picks ("kernels" in the printed config) and on XLA's fusions. The whole step is timed
on XLA's fusions too (kernels="xla": the LayerNorms, bias + GELU and the loss as XLA fusions), so the
same run says what the Pallas kernels buy. Everything compiles with the trainer's XLA options
(train.step.STEP_COMPILER_OPTIONS), and the whole step once more with XLA's defaults, so the
same run says what those options buy.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import attnlayers
from train import flags
import models
from benchmarks import common
from attnlayers.fp8 import FP8Meta
from models import ops, plans
from models.loss import head_cross_entropy
from train import optim, report
from train.step import STEP_COMPILER_OPTIONS, batch_loss


def main(argv=None) -> None:
  p = flags.Parser(prog="python -m benchmarks.step", description=flags.description(__doc__))
  p.add_argument("--attn", choices=attnlayers.BACKENDS, default="auto")
  p.add_argument("--preset", choices=list(models.PRESETS), default="gpt2-small")
  one = flags.int_at_least(1)
  p.add_argument("--seq-len", type=one, help="default: the preset's context (1024 for gpt2-small)")
  p.add_argument("--batch-size", type=one, default=32, help="rows of the timed batch (default 32)")
  p.add_argument("--kernels", choices=models.KERNELS, default="auto", help="the step's own GPU kernels")
  a = p.parse_args(argv)
  a.seq_len = models.PRESETS[a.preset].seq_len if a.seq_len is None else a.seq_len
  try:
    cfg = models.preset(a.preset, backend=a.attn, seq_len=a.seq_len, kernels=a.kernels)
    ops.resolve(a.kernels)  # kernels pallas off a CUDA GPU
  except ValueError as e:
    p.error(str(e))
  common.refuse_unless_runnable({f"--attn {a.attn}": plans.attention_plans(cfg, a.batch_size, a.seq_len)},
                                "This benchmark times the training step with that attention kernel: run it where "
                                "the kernel runs, or give another --attn")
  graphdef, params, fp8 = nnx.split(models.GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param, FP8Meta)  # fp8: te-fp8's state
  xla_model = nnx.eval_shape(lambda: models.GPT(dataclasses.replace(cfg, kernels="xla"), rngs=nnx.Rngs(0)))
  graphdef_xla = nnx.split(xla_model, nnx.Param, FP8Meta)[0]  # only its graph: the parameters are shapes
  tx = optim.adamw(3e-4, 1000, 10)
  opt_state = tx.init(params)
  x = jax.random.randint(jax.random.key(1), (a.batch_size, a.seq_len), 0, cfg.vocab_size)
  y = jnp.roll(x, -1, axis=1)

  def loss(params, fp8, x, y, graphdef=graphdef):
    return batch_loss(graphdef, params, fp8, {"inputs": x, "targets": y}, None)

  def step(params, fp8, opt_state, x, y, graphdef=graphdef):  # as train.step's: the FP8Meta "gradient" is its next value
    l, (g, fp8) = jax.value_and_grad(loss, argnums=(0, 1))(params, fp8, x, y, graphdef)
    updates, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, updates), fp8, opt_state, l

  h = jax.random.normal(jax.random.key(2), (a.batch_size, a.seq_len, cfg.d_model), jnp.dtype(cfg.dtype))
  wte = params["wte"]["embedding"][...]

  def head_loss(wte, h, y):
    logits = jnp.einsum("btd,vd->btv", h, wte.astype(h.dtype)).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def fused_head_loss(wte, h, y):  # the same inputs and work, without the (B, T, V) logits
    return head_cross_entropy(h, wte.astype(h.dtype), y)

  jit = functools.partial(jax.jit, compiler_options=STEP_COMPILER_OPTIONS)  # as the trainer compiles
  parts = {
      "forward+loss": common.time_fn(jit(loss), params, fp8, x, y),
      "forward+backward": common.time_fn(jit(jax.grad(loss, argnums=(0, 1))), params, fp8, x, y),
      "step (with AdamW)": common.time_fn(jit(step), params, fp8, opt_state, x, y),
      "step, XLA's default options": common.time_fn(jax.jit(step), params, fp8, opt_state, x, y),
      "step, XLA fusions (kernels=xla)": common.time_fn(jit(functools.partial(step, graphdef=graphdef_xla)),
                                                        params, fp8, opt_state, x, y),
      "output layer+loss fwd+bwd": common.time_fn(jit(jax.grad(head_loss, (0, 1))), wte, h, y),
      "output layer+fused loss fwd+bwd": common.time_fn(jit(jax.grad(fused_head_loss, (0, 1))), wte, h, y),
      "... fused, bf16 logits fwd+bwd": common.time_fn(jit(jax.grad(
          lambda w, h, y: head_cross_entropy(h, w.astype(h.dtype), y, logits_dtype=h.dtype), (0, 1))), wte, h, y),
      "... the same, XLA fusions": common.time_fn(jit(jax.grad(
          lambda w, h, y: head_cross_entropy(h, w.astype(h.dtype), y, logits_dtype=h.dtype, kernel="xla"),
          (0, 1))), wte, h, y),
  }
  print(json.dumps({"config": a.__dict__, "attention_ran": report.attention_ran(cfg, a.batch_size),
                    "attention_notes": report.attention_notes(cfg, a.batch_size), "kernels": ops.resolve(a.kernels),
                    "compiler_options": STEP_COMPILER_OPTIONS} | common.environment()))
  for name, t in parts.items():
    print(f"{name:>31}: {t.median_ms:8.2f} ms  (p10 {t.p10_ms:.2f}, p90 {t.p90_ms:.2f})")


if __name__ == "__main__":
  main()
