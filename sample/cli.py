"""`python -m sample`: continue a prompt with a model that `python -m train` saved.

Reads the newest intact checkpoint of a training folder without writing anything there
(train.reader: no lock, no renames, no clean-up, as a trainer may be using the folder at the
same time), restores only the parameters, and generates with the KV-cache decoder (models.generate), printing
the text, the time to the first token and the decode rate. Every bad input exits with code 2
and one line saying what would work.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

import jax
from flax import nnx

import attnlayers
from attnlayers import device
import models
from attnlayers.fp8 import FP8Meta
from models.generate import SEEDS, Sampling, bucket, generate, rows_for
from train import checkpoint, data, flags, reader, tokenizers
from train.rundirs import LATEST, RUNS

DEFAULT_TOKENS = 200  # new tokens when --tokens is not given (fewer where the context has less room)
PROMPT_CHARS = 1 << 24  # the most of --prompt-file read: far past any context, whatever a token's length


class SampleError(ValueError):
  """Bad input to python -m sample; the message says what would work."""


@dataclasses.dataclass(frozen=True)
class Restored:
  model: models.GPT  # the trained parameters in a model built for the asked backend
  directory: str  # the checkpoint folder
  step: int  # the step restored
  data: str  # what it was trained on
  tokenizer: str  # its tokens: tokenizers.BYTES or tokenizers.GPT2 (tokenizer)


def restore(directory: str, backend: str, step: int | None = None, named: str | None = None) -> Restored:
  """The model of `directory`'s newest intact step (or `step`), built with attention `backend`; errors call the
  folder `named` (default: "--ckpt-dir <directory>", train.reader.Reader)."""
  with reader.Reader(directory, named) as read:
    step = read.newest_intact() if step is None else step
    meta = read.meta(step)
    arch, note = checkpoint.architecture(meta)
    if note:
      print(note, file=sys.stderr)
    tokens = tokenizer(meta, arch["vocab_size"])  # before the parameters are read
    cfg = models.GPTConfig(**arch, dtype=meta["run"]["dtype"], backend=backend,
                           # decode steps (one query) never qualify for te-fp8's FP8 core; its projections stay FP8
                           fp8_core="fp8-or-bf16" if backend == "te-fp8" else "fp8")
    abstract = nnx.eval_shape(lambda: models.GPT(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, fp8 = nnx.split(abstract, nnx.Param, ...)
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    params = read.params(step, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), params))
    if jax.tree.leaves(fp8):  # te-fp8: the run's FP8 scaling where it saved one (a te-fp8 run), else fresh
      fp8 = jax.jit(lambda: nnx.state(models.GPT(cfg, rngs=nnx.Rngs(0)), FP8Meta))()
      if read.has_fp8(step):
        fp8 = read.fp8(step, fp8)
  return Restored(nnx.merge(graphdef, params, fp8), directory, step, meta.get("data", "?"), tokens)


def tokenizer(meta: dict, vocab_size: int) -> str:
  """The tokenizer of what a checkpoint's model was trained on: bytes for text, GPT-2 BPE for token shards (the
  trainer's end-of-run sample used the same). Only where its meta does not record the data, the one its
  vocabulary implies (tokenizers.for_vocab)."""
  if not isinstance(meta.get("data"), str):
    try:
      return tokenizers.for_vocab(vocab_size)
    except ValueError as e:
      raise SampleError(f"the checkpoint does not record the data its model was trained on, so its vocabulary "
                        f"decides, and there is {e}") from None
  chosen = data.tokenizer(meta["data"])
  if tokenizers.IDS[chosen] > vocab_size:  # the trainer refuses such a model: a checkpoint it did not write
    raise SampleError(f"the model was trained on {tokenizers.NAMES[chosen]} (ids up to {tokenizers.IDS[chosen] - 1}), "
                      f"more than its vocabulary of {vocab_size}: its checkpoint contradicts itself")
  return chosen


def latest_run() -> str:
  """The folder that runs/latest names: the newest run python -m train finished without --ckpt-dir."""
  try:
    with open(LATEST, "rb") as f:
      raw = f.read()
  except FileNotFoundError:
    raise SampleError(f"no --ckpt-dir given and no {LATEST} here (written when python -m train finishes "
                      "without --ckpt-dir): train first, or give --ckpt-dir") from None
  except OSError as e:
    raise SampleError(f"no --ckpt-dir given, and {LATEST} cannot be read ({e.strerror or e}): "
                      "give --ckpt-dir") from None
  try:
    name = raw.decode("utf-8").strip()
  except UnicodeDecodeError:
    name = None
  if not name or name != os.path.basename(name) or name in (".", ".."):
    raise SampleError(f"no --ckpt-dir given, and {LATEST} does not hold the name of a run folder in {RUNS} (as "
                      f"python -m train writes it): it holds {raw[:40]!r}. Give --ckpt-dir, or delete {LATEST} "
                      "and train again")
  path = os.path.join(RUNS, name)
  if not os.path.isdir(path):
    raise SampleError(f"no --ckpt-dir given, and the run {LATEST} names, {path}, "
                      f"{'is not a folder' if os.path.exists(path) else 'does not exist (deleted?)'}: give --ckpt-dir "
                      "with a folder python -m train saved to, or train again")
  return path


_temperature = flags.float_above(0, inclusive=True, note=" (0 = greedy)")


def _seed(text: str) -> int:
  value = flags.int_at_least(0)(text)
  if value >= SEEDS:  # jax.random.key keeps the low 32 bits: a larger seed would repeat a smaller one's samples
    raise argparse.ArgumentTypeError(f"must be below 2**32 ({SEEDS}), got {value}: jax's random key keeps 32 bits, "
                                     "so a larger seed would repeat a smaller one's samples")
  return value


def parser() -> argparse.ArgumentParser:
  p = flags.Parser(prog="python -m sample", description=__doc__.splitlines()[0], formatter_class=flags.Help)
  one = flags.int_at_least(1)
  p.add_argument("--ckpt-dir", type=flags.path(f"leave out --ckpt-dir to sample the run {LATEST} names"),
                 help=f"a folder python -m train saved to; default: the one {LATEST} names")
  text = p.add_mutually_exclusive_group()
  text.add_argument("--prompt", help="text to continue; default: a newline")
  text.add_argument("--prompt-file", type=flags.path("--prompt gives the text itself"),
                    help="continue this file's text")
  p.add_argument("--tokens", type=one, help=f"new tokens per sample; default: {DEFAULT_TOKENS}, or as many "
                                            "as the context has room for after the prompt")
  p.add_argument("--temperature", type=_temperature, default=0.8, help="0: greedy (the most likely token)")
  p.add_argument("--top-k", type=one, help="draw from the k most likely tokens only; default: all")
  p.add_argument("--seed", type=_seed, help=f"random stream of the samples, 0 .. {SEEDS - 1}; default: 0")
  p.add_argument("--attn", choices=attnlayers.BACKENDS, default="auto", help="attention backend")
  p.add_argument("--batch", type=one, default=1, help="samples of the prompt, drawn together (one batch)")
  return p


def _prompt(a) -> str:
  if a.prompt_file is None:
    return "\n" if a.prompt is None else a.prompt
  try:
    # bytes that are not UTF-8 read as --prompt's do (surrogateescape): a byte model takes them as they are, and
    # GPT-2 BPE refuses them saying so (tokenizers.encode)
    with open(a.prompt_file, encoding="utf-8", errors="surrogateescape") as f:
      text = f.read(PROMPT_CHARS + 1)  # bounded: /dev/zero or a stream that never ends would be read for ever
  except OSError as e:
    raise SampleError(f"--prompt-file {a.prompt_file}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
  if len(text) > PROMPT_CHARS:
    raise SampleError(f"--prompt-file {a.prompt_file} holds more than {PROMPT_CHARS:,} characters, more than any "
                      "model's context takes as a prompt (the prompt and the new tokens share it): give a shorter file")
  return text


def _new_tokens(asked: int | None, prompt_len: int, seq_len: int) -> int:
  room = seq_len - prompt_len
  if prompt_len == 0:
    raise SampleError("the prompt is empty: give some text with --prompt or --prompt-file")
  if room < 1:
    raise SampleError(f"the prompt is {prompt_len} tokens, and the model's context holds {seq_len} in all (prompt "
                      f"and new tokens): shorten it to at most {seq_len - 1} tokens")
  if asked is not None and asked > room:
    raise SampleError(f"--tokens {asked} does not fit: the context holds {seq_len} tokens and the prompt takes "
                      f"{prompt_len}, so at most {room} new ones fit (--tokens {room}, or a shorter prompt)")
  return min(DEFAULT_TOKENS, room) if asked is None else asked


def _memory_of(dev) -> int | None:
  """Bytes the device `dev` may allocate: a GPU's allocator limit, the host's available memory for a CPU; None where
  neither is known."""
  stats = dev.memory_stats() if dev.platform != "cpu" else None
  return stats.get("bytes_limit") if stats else device.host_memory() if dev.platform == "cpu" else None


def _check_memory(cfg: models.GPTConfig, batch: int, prompt_len: int, new: int) -> None:
  """SampleError where the KV cache alone of `batch` rows would not fit the device: on a CPU, XLA takes host memory as
  it is touched, and a run past it is killed by the OS with no message rather than refused by XLA."""
  rows, length = rows_for(batch), bucket(prompt_len + new, cfg.seq_len)
  need = 2 * cfg.n_layer * rows * length * (cfg.n_kv_head or cfg.n_head) * cfg.head_dim * jax.numpy.dtype(
      cfg.dtype).itemsize  # keys and values of every layer: (rows, length, K, H) each
  available = _memory_of(jax.local_devices()[0])
  if available is not None and need > available:
    raise SampleError(f"--batch {batch}: the KV cache alone needs about {device.size(need)} ({cfg.n_layer} layers' "
                      f"keys and values, {rows} rows of {length} positions), more than the "
                      f"{device.size(available)} {device.current().describe()} has: lower --batch, or --tokens")


def run(a) -> None:
  text = _prompt(a)
  directory = a.ckpt_dir if a.ckpt_dir is not None else latest_run()
  r = restore(directory, a.attn, named=None if a.ckpt_dir is not None else f"{directory} (the run {LATEST} names)")
  cfg = r.model.cfg
  prompt = tokenizers.encode(text, r.tokenizer)
  new = _new_tokens(a.tokens, len(prompt), cfg.seq_len)
  # drawn only from these: ids past the tokenizer's are the vocabulary's padding, never trained on; a checkpoint
  # without a data record may have fewer than its tokenizer's (tokenizer(): bytes for any vocab_size <= 256)
  ids = min(tokenizers.IDS[r.tokenizer], cfg.vocab_size)
  if prompt.max() >= cfg.vocab_size:  # only there: every id a tokenizer gives is below its IDS
    raise SampleError(f"the prompt's {tokenizers.NAMES[r.tokenizer]} include id {prompt.max()}, past the model's "
                      f"vocabulary of {cfg.vocab_size} (ids 0..{cfg.vocab_size - 1}): give a prompt of those ids only")
  _check_memory(cfg, a.batch, len(prompt), new)
  if a.top_k is not None and a.top_k > ids:
    raise SampleError(f"--top-k {a.top_k} is more than the {ids} {tokenizers.NAMES[r.tokenizer]} the model samples "
                      f"from; use 1..{ids}, or leave it out to keep every token")
  print(f"{r.directory}: step {r.step}, trained on {r.data} ({tokenizers.NAMES[r.tokenizer]}); {cfg.n_layer} layers, "
        f"d_model {cfg.d_model}, context {cfg.seq_len}; attention {a.attn}", flush=True)
  gen = generate(r.model, [prompt] * a.batch, max_new_tokens=new,
                 sampling=Sampling(temperature=a.temperature, top_k=a.top_k, seed=a.seed, real_vocab=ids))
  texts = [[int(t) for t in prompt] + [int(t) for t in tokens] for tokens in gen.tokens]
  if a.batch > 1 and all(t == texts[0] for t in texts):  # greedy, or a draw that agreed: printed once, said so
    why = "--temperature 0 decodes greedily" if a.temperature == 0 else "the draws agreed"
    print(f"--- all {a.batch} samples are this one ({why})")
    texts = texts[:1]
  for i, tokens in enumerate(texts):
    if len(texts) > 1:
      print(f"--- sample {i + 1} of {a.batch}")
    print(tokenizers.decode(tokens, r.tokenizer))
  rate = f"{gen.decode_tokens_per_s:,.0f} tokens/s" if math.isfinite(gen.decode_tokens_per_s) else "no decode step"
  print(f"---\ntime to first token: {gen.time_to_first_token_s * 1e3:.1f} ms; decode: {rate} "
        f"({a.batch} x {new} new tokens; compile {gen.compile_s:.1f} s and a first run, not counted); "
        f"attention {a.attn} ran on: {gen.attention}; a decode step's blocks: {gen.decode_step}")


def _greedy_ignores(a) -> list[str]:
  """The flags that --temperature 0 would ignore: greedy decoding takes the most likely token, which is always among
  the top k and draws nothing from the random stream."""
  if a.temperature != 0:
    return []
  return [flag for flag, value in (("--top-k", a.top_k), ("--seed", a.seed)) if value is not None]


def main(argv=None) -> None:
  p = parser()
  a = p.parse_args(argv)
  ignored = _greedy_ignores(a)
  if ignored:  # refused rather than ignored, as python -m train refuses --ckpt-every with --no-ckpt
    why = ", ".join({"--top-k": "always among the top k", "--seed": "nothing random"}[flag] for flag in ignored)
    p.error(f"{' and '.join(ignored)} {'applies' if len(ignored) == 1 else 'apply'} to sampling, and --temperature 0 "
            f"decodes greedily (the most likely token: {why}): leave out {' and '.join(ignored)}, or give a "
            "--temperature above 0")
  if a.seed is None:
    a.seed = 0
  try:
    run(a)
  except (SampleError, ValueError, reader.CheckpointError,
          attnlayers.BackendUnavailableError) as e:  # FP8Unavailable is one too
    hint = ""
    if isinstance(e, attnlayers.BackendUnavailableError):
      hint = ("\nhere: --attn picks the backend (auto: one that runs this model); the compute dtype is the one the "
              "model was trained in (python -m train --dtype)")
    print(f"error: {e}{hint}", file=sys.stderr)
    sys.exit(2)
  except jax.errors.JaxRuntimeError as e:  # XLA could not compile or run decoding: one line, not JAX's traceback
    if (oom := device.out_of_memory(e)) is not None:
      print(f"error: {oom}; lower --batch (the samples drawn together) or --tokens", file=sys.stderr)
    else:
      print(f"error: {device.xla_failure(e)} (--attn xla decodes on XLA's own ops, to tell the attention kernel "
            "from the rest)", file=sys.stderr)
    sys.exit(1)
