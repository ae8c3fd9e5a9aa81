"""What a run says of itself apart from its steps: the notices before any work, the attention
plans it checks first (made once per run: the summary reports the same plans), and the end-of-run
summary with its sample."""

from __future__ import annotations

import jax
from jax.experimental import multihost_utils
import numpy as np
from flax import nnx

import attnlayers
import models
from models import generate, ops, plans
from train import data, metrics, tokenizers
from train.config import TrainConfig
from train.session import Session

SAMPLE_TEMPERATURE = 0.8  # of the end-of-run sample


def attention_plans(cfg: models.GPTConfig, batch_size: int, pack: bool) -> list[attnlayers.Plan]:
  """How the training step's attention calls run, one plan per distinct layer window (models.plans)."""
  return plans.attention_plans(cfg, batch_size, cfg.seq_len, pack=pack)


def check_attention(cfg: TrainConfig) -> list[attnlayers.Plan]:
  """The plans of the training step's attention calls (attention_plans), checked before any work.

  Raises:
    attnlayers.BackendUnavailableError: with every reason, where the backend cannot run one of them.
  """
  checked = attention_plans(cfg.model, cfg.batch_size, cfg.pack)
  for plan in checked:
    if not plan.ok:
      raise attnlayers.BackendUnavailableError.from_plan(plan)
  return checked


def attention_ran(cfg: models.GPTConfig, batch_size: int, pack: bool = False) -> str:
  """The kernel the model's attention calls run on (what `auto` chose); layers that differ: "a/b" (models.plans.ran
  of attention_plans). For callers without a run's plans (a run's summary reads its own: Session.attention_plans)."""
  return plans.ran(attention_plans(cfg, batch_size, pack))


def attention_notes(cfg: models.GPTConfig, batch_size: int, pack: bool = False) -> list[str]:
  """How those calls run where the backend's name does not say it, once each (models.plans.notes of
  attention_plans). For callers without a run's plans, as attention_ran."""
  return plans.notes(attention_plans(cfg, batch_size, pack))


def summary(s: Session, state: dict, loss: float | None, dataset: data.Dataset) -> dict:
  cfg, mcfg = s.cfg, s.cfg.model
  steps_per_s = s.throughput.steady_steps_per_s()
  summary = {
      "event": "summary", "steps": cfg.steps, "final_loss": loss,
      "params": sum(x.size for x in jax.tree.leaves(state["params"])),  # every trained parameter
      "params_for_flops": s.model.n_params,  # N of the MFU count: the weights that multiply activations
      "final_val_loss": s.val_loss[max(s.val_loss)] if s.val_loss else None,
      **s.throughput.rates_fields(steps_per_s),
      "time_to_first_step_s": s.throughput.time_to_first_step_s, "peak_memory_bytes": metrics.peak_memory_bytes(),
      **metrics.peak_fields(s.throughput.peak, cfg.peak_tflops),
      "attention": mcfg.backend, "attention_ran": plans.ran(s.attention_plans),
      "attention_notes": plans.notes(s.attention_plans),
      "kernels": ops.resolve(mcfg.kernels)[0],  # the loss's, the LayerNorms' and bias + GELU's
      "device": str(jax.local_devices()[0].device_kind), "devices": jax.device_count(),
  }
  if cfg.sample_tokens and s.stop.received is None:  # a signal after the last step: no sample, stop now
    summary |= _sample(s, state, dataset)
  return summary


def sample_lengths(seq_len: int, sample_tokens: int) -> tuple[int, int]:
  """(prompt tokens, new tokens) of the end-of-run sample: the prompt takes a quarter to a half of the context,
  the new tokens at most the rest."""
  prompt_len = max(1, seq_len // 4, min(seq_len // 2, seq_len - sample_tokens))
  return prompt_len, min(sample_tokens, seq_len - prompt_len)


def notices(cfg: TrainConfig) -> None:
  """Says where the run will do less than a setting asks (printed before any work, by process 0)."""
  if jax.process_index() != 0:
    return
  if cfg.warmup >= cfg.steps:
    cut = f"is more than steps {cfg.steps}: the warm-up is shortened to {cfg.steps} step{'s' * (cfg.steps != 1)}, so" if \
        cfg.warmup > cfg.steps else f"is as long as the run ({cfg.steps} steps):"
    print(f"warmup {cfg.warmup} {cut} the learning rate rises for the whole run, to {cfg.steps}/{cfg.steps + 1} of "
          "the peak lr, and never decays (--warmup sets the warm-up)", flush=True)
  elif cfg.warmup == cfg.steps - 1 and cfg.steps > 1:
    print(f"warmup {cfg.warmup} ends at the last of {cfg.steps} steps: the learning rate reaches its peak there and "
          "never decays (--warmup sets the warm-up)", flush=True)
  prompt_len, new = sample_lengths(cfg.model.seq_len, cfg.sample_tokens)
  if new < cfg.sample_tokens:
    print(f"sample_tokens {cfg.sample_tokens}: the end-of-run sample has {new} new tokens, what fits in the "
          f"{cfg.model.seq_len}-token context after its {prompt_len}-token prompt", flush=True)


def vocab_notice(cfg: TrainConfig, dataset: data.Dataset) -> None:
  """Says where the model has more token ids than the data's tokenizer gives, beyond padding to a multiple of 64
  (GPT-2's 50257 to 50304): the extra ids never occur in the data. Not refused: later data may use them
  (--allow-change data, e.g. GPT-2 shards after bytes), and they cost parameters, not correctness."""
  have, need = cfg.model.vocab_size, dataset.vocab_size
  if jax.process_index() == 0 and have > -(-need // 64) * 64:
    print(f"vocab_size {have}: the data ({dataset.name}) holds {tokenizers.NAMES[dataset.tokenizer]}, ids below {need}; "
          f"ids {need}-{have - 1} never occur in it, and only add embedding and output rows (--vocab-size {need} "
          f"fits it); samples decode {tokenizers.NAMES[dataset.tokenizer]}", flush=True)


def _whole(tree):
  """Each array of `tree` whole on this process's first device: its copy where every device holds one, else
  gathered from its shards (from every process's devices)."""
  device = jax.local_devices()[0]

  def one(x):
    if x.is_fully_replicated:
      return x.addressable_data(0)
    return jax.device_put(x if x.is_fully_addressable else multihost_utils.process_allgather(x, tiled=True), device)
  return jax.tree.map(one, tree)


def _sample(s: Session, state: dict, dataset: data.Dataset) -> dict:
  """The end-of-run sample, by python -m sample's decoder (models.generate, backend auto): the start of
  the first validation text (from its first full line where it was cut mid-file) continued. Prompt and new
  tokens share the context: at most seq_len - seq_len // 4 new ones. Each process samples from its own whole
  copy of the parameters (gathered from their shards on the mesh)."""
  prompt_len, new = sample_lengths(s.cfg.model.seq_len, s.cfg.sample_tokens)
  if new < 1:
    return {}
  prompt = np.asarray(dataset.val[0][dataset.prompt_start:][:prompt_len])
  model = nnx.merge(s.model.graphdef, _whole(state["params"]), _whole(state["fp8"]))
  # the run's --seed may exceed 32 bits, which Sampling refuses; jax.random.key used its low 32 bits, as here
  gen = generate.generate(model, [prompt], max_new_tokens=new, backend=attnlayers.backends.AUTO,
                          sampling=generate.Sampling(temperature=SAMPLE_TEMPERATURE, seed=s.cfg.seed % generate.SEEDS,
                                                     real_vocab=dataset.vocab_size))
  return {"sample": tokenizers.decode(gen.tokens[0], dataset.tokenizer),
          "sample_prompt": tokenizers.decode(prompt, dataset.tokenizer),
          "sample_time_to_first_token_s": gen.time_to_first_token_s, "sample_tokens_per_s": gen.decode_tokens_per_s}
