"""`python -m train`: train the GPT decoder with a chosen attention backend and measure it.

Every flag is checked before anything is built or compiled, by the rules of train.checks.CHECKS:
a bad value exits with code 2 and one line saying which flag and why. SIGINT and SIGTERM save the step in progress and
exit with 128 + the signal's number; one before the first step stops the run before its step
compiles (loading the data is cut short; one while it loads or before, before the model is built)
and removes the folders and files it made and left empty.

Without --ckpt-dir a run keeps its model in a folder of its own, runs/train-YYYYmmdd-HHMMSS
(never an existing one, so a second run never resumes the first by accident; resuming takes
--ckpt-dir), names it in runs/latest once it finishes, and prints the command that samples
from it. --no-ckpt keeps nothing.
"""

from __future__ import annotations

import argparse
import glob
import os
import shlex
import signal
import sys

import jax

import attnlayers
from attnlayers import device, spec
from train.flags import Help, Parser, address, int_at_least, path, positive_float
import models
from attnlayers.fp8 import FP8Unavailable
from train import (checkpoint, checks, config, data, diskspace, lock, loop, mesh, metrics, rundirs, signals,
                   tokenizers)
from train.checks import Start  # train.cli.Start: the run as the checks of its flags make it


def _setting(text: str) -> str:
  return text.replace("-", "_")


def parser() -> argparse.ArgumentParser:
  p = Parser(prog="python -m train", description=__doc__.splitlines()[0], formatter_class=Help)
  one, zero = int_at_least(1), int_at_least(0)
  p.add_argument("--attn", choices=attnlayers.BACKENDS, default="auto", help="attention backend")
  p.add_argument("--preset", choices=list(models.PRESETS), default="tiny", help="model shape to start from")
  p.add_argument("--n-layer", type=one, help="transformer blocks; default: the preset's")
  p.add_argument("--n-head", type=one, help="query heads; default: the preset's")
  p.add_argument("--d-model", type=one, help="model width (head dim = d_model / n_head); default: the preset's")
  p.add_argument("--kv-heads", type=one, help="key/value heads (GQA/MQA); default: the preset's")
  p.add_argument("--fp8-core", choices=spec.FP8_CORE_MODES, default="fp8",
                 help="--attn te-fp8 only: its attention core in FP8 (refused where cuDNN's FP8 attention cannot "
                      "take the model, e.g. head dim != 128), FP8 where it can else bf16, or bf16")
  p.add_argument("--kernels", choices=models.KERNELS, default="auto",
                 help="the model's own GPU kernels (LayerNorm, bias + GELU, the loss's softmax gradient): Pallas ones "
                      "(pallas; refused off a CUDA GPU and where jax has no Pallas Triton backend; with several "
                      "devices each runs all of their work), XLA's fusions (xla), or auto: pallas on one CUDA GPU "
                      "where jax has that backend, else xla; interpret: the Pallas kernels through Pallas's "
                      "interpreter, any device, slow (for tests)")
  p.add_argument("--seq-len", type=one, help="context length; default: the preset's")
  p.add_argument("--vocab-size", type=one, help="token ids the model covers; default: the preset's")
  p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="compute dtype; default: the preset's")
  p.add_argument("--bias", action=argparse.BooleanOptionalAction,
                 help="biases in the Linears and LayerNorms (GPT-2's); --no-bias: none, as nanoGPT's train.py "
                      "(bias=False); default: the preset's (every preset has them)")
  p.add_argument("--window", type=one, metavar="N",
                 help="sliding window of N tokens: each query attends itself and the N - 1 tokens before it "
                      "(N >= the context length is plain causal attention); default: none, every earlier token")
  p.add_argument("--window-pattern", metavar="PATTERN",
                 help="with --window: 'local' (windowed) or 'global' (every earlier token) per layer, comma-separated "
                      "and repeated over the layers (at most one entry per layer), e.g. 'local,global'; default: local on "
                      "every layer")
  p.add_argument("--pack", action=argparse.BooleanOptionalAction, default=False,
                 help="train on whole documents packed end to end into rows (short ones too), each token attending "
                      "only its own document (train.packing); validation is the same unpacked held-out windows "
                      "either way; default: --no-pack, windows cut out of single texts")
  p.add_argument("--batch-size", type=one, default=16, help="global batch, split over every device")
  p.add_argument("--steps", type=one, default=1000, help="optimizer steps in all, counting those before a resume")
  p.add_argument("--lr", type=positive_float, default=3e-3, help="peak learning rate (warm-up, then cosine decay)")
  p.add_argument("--warmup", type=zero, default=30, help="linear warm-up steps")
  p.add_argument("--seed", type=zero, default=0, help="parameters, data order and dropout")
  p.add_argument("--data", type=path("leave out --data to train on the default text"),
                 help="text file, folder of text (every file under it; no run folders of python -m train), or "
                      "'DIR/*.bin' token shards (quoted: the shell would expand it); default: the installed Python's "
                      "standard library sources, read at run time (no download)")
  p.add_argument("--data-raw-bytes", action="store_true", help="train on --data files that are mostly not text "
                 "(executables, compressed or random bytes) as bytes; default: refuse them")
  keep = p.add_mutually_exclusive_group()
  keep.add_argument("--ckpt-dir", type=path("--no-ckpt trains without checkpoints, and leaving out --ckpt-dir "
                                             f"keeps them in a new folder in {rundirs.RUNS}/"),
                    help="save checkpoints here and resume from the newest intact one: a new or empty folder, or "
                         "one a run saved to (a folder of other files, or a step folder, is refused); default: a new "
                         f"folder {rundirs.RUNS}/train-YYYYmmdd-HHMMSS for this run")
  keep.add_argument("--no-ckpt", action="store_true", help="keep no checkpoints (the model is lost at the end)")
  p.add_argument("--ckpt-every", type=one, help="steps between checkpoints (the last step is always saved); default: "
                 f"{config.TrainConfig.ckpt_every}")
  changeable = [k for k in config.TRAJECTORY if k not in ("weight_decay", "clip")] + [config.DATA]  # those two have no flag
  p.add_argument("--allow-change", type=_setting, choices=changeable, action="append", default=[],
                 metavar="SETTING", help="let a resume change this setting from the checkpoint's (one of "
                 f"{', '.join(changeable)}; repeatable; data: --data's path or its content, e.g. another "
                 "Python's standard library); the change is recorded in --metrics; default: a resume must keep "
                 "them all")
  p.add_argument("--eval-every", type=zero, default=100, help="steps between validation losses; 0: none")
  p.add_argument("--log-every", type=one, default=10, help="steps between metrics records")
  p.add_argument("--metrics", type=path("leave out --metrics to write no metrics file"),
                 help="append JSON lines (per logged step, resumes, ...) to this file; default: none")
  p.add_argument("--sample-tokens", type=zero, help="tokens to sample at the end, after a prompt from the validation "
                 f"text; at most three quarters of --seq-len fit (the prompt takes the rest); 0: none; default: "
                 f"{checks.SAMPLE_TOKENS}, or as many as fit")
  p.add_argument("--peak-tflops", type=positive_float, help="device bf16 peak for MFU; default: the built-in table")
  p.add_argument("--no-progress", dest="progress", action="store_false",
                 help="hide the progress bar (shown by default)")
  first, last = config.PROFILE_WINDOW
  p.add_argument("--profile-dir", type=path("leave out --profile-dir to write no trace"),
                 help=f"write a profiler trace of the run's steps {first}-{last} here (perfetto_trace.json.gz + "
                      "xplane); default: none")
  p.add_argument("--mesh", metavar="AXIS=SIZE,...",
                 help="how the devices split the work: data=D (batch rows), fsdp=F (batch rows, and the parameters and "
                      "optimizer state), tensor=T (attention heads, MLP width, vocabulary), any of them, comma-"
                      "separated; the sizes multiply to the device count (train.mesh); default: every device on data")
  p.add_argument("--coordinator-address", type=address("leave out --coordinator-address for a run on one host"),
                 help="multi-host: host:port of process 0 (with --num-processes, --process-id)")
  p.add_argument("--num-processes", type=one, help="multi-host: how many processes")
  p.add_argument("--process-id", type=zero, help="multi-host: this process's index")
  return p


def _sample_command(ckpt_dir: str, prompt: str | None, tokenizer: str) -> str:
  """How to sample from `ckpt_dir`: the python -m sample command, prompted with the first line of `prompt` (up to 40
  characters). Where python -m sample cannot take the model's tokens here (GPT-2 BPE without tiktoken), what it
  needs first, and no prompt: the end-of-run sample's, decoded without tiktoken, is token ids, not text."""
  needs = tokenizers.missing(tokenizer)
  line = "" if needs else next((l.strip() for l in (prompt or "").splitlines() if l.strip()), "")[:40]
  command = f"python -m sample --ckpt-dir {shlex.quote(ckpt_dir)}" + (f" --prompt {shlex.quote(line)}" if line else "")
  return f"sample from it ({needs}) with:\n  {command}" if needs else f"sample from it with:\n  {command}"


# The flags that do what a library error's structured fields ask, as _flag_hint adds them: for the arguments in
# BackendUnavailableError.fixes, and for ArgumentError.argument
FIX_FLAGS = {"dtype": "--dtype bfloat16 (or float16 on a GPU) the compute dtype",
             "fp8_core": "--fp8-core fp8-or-bf16 te-fp8's core where it cannot run in FP8"}
ARGUMENT_FLAGS = {"kernel": "--kernels"}  # followed by what the error expects, unquoted


def _flag_hint(e: Exception, a: argparse.Namespace) -> str:
  """The flags that do what a library error asks in Python terms (backend=..., dtype=..., kernel=...), read from
  its structured fields. The dtype flag is named wherever the run's dtype is not a half one."""
  if isinstance(e, attnlayers.BackendUnavailableError):
    half = (a.dtype or models.preset(a.preset).dtype) in ("bfloat16", "float16")  # given, or the preset's
    asked = {"dtype": not half, "fp8_core": "fp8_core" in e.fixes}
    return "\nhere: --attn NAME picks the backend" + "".join(f", {FIX_FLAGS[k]}" for k, on in asked.items() if on)
  if isinstance(e, attnlayers.ArgumentError) and e.argument in ARGUMENT_FLAGS:
    values = (e.expected or "").replace("'", "")  # "'xla' or 'auto'" as flag values: "xla or auto"
    return f"\nhere: {ARGUMENT_FLAGS[e.argument]} {values}"
  return ""


def parse(argv=None) -> argparse.Namespace:
  """The flags of `argv`, as parser().parse_args reads them; where --data's .bin is followed by more .bin files, the
  shell expanded an unquoted pattern ('--data d/*.bin' into '--data d/a.bin d/b.bin ...'), and the error says so
  rather than 'unrecognized arguments'."""
  p = parser()
  argv = sys.argv[1:] if argv is None else list(argv)
  a, extra = p.parse_known_args(argv)
  if extra and _expanded(a.data, extra, argv):
    folders = {os.path.dirname(f) for f in [a.data, *extra]}
    pattern = (f": --data {shlex.quote(os.path.join(folders.pop(), '*.bin'))}" if len(folders) == 1 else
               " (the files are in several folders: quote the pattern you typed)")
    p.error(f"--data {a.data} is followed by {len(extra)} more .bin file(s) ({' '.join(extra[:3])}"
            f"{' ...' if len(extra) > 3 else ''}): the shell expanded an unquoted pattern into the files it matches, "
            f"and --data takes one. Quote the pattern so that it reaches python -m train whole{pattern}")
  return p.parse_args(argv) if extra else a  # parse_args refuses what is left over, in argparse's own words


def _expanded(given: str | None, extra: list[str], argv: list[str]) -> bool:
  """Whether `extra`, the arguments argparse left over, are what a shell makes of an unquoted --data 'DIR/*.bin':
  .bin paths (no pattern left in them, none an option) right after --data's own .bin (`given`) in `argv`."""
  paths = [given or "", *extra]
  if not all(x.endswith(".bin") and not x.startswith("-") and not glob.has_magic(x) for x in paths):
    return False  # e.g. two quoted patterns, a stray option: argparse's message
  at = [i for i, x in enumerate(argv) if x == given or (x.startswith("-") and x.endswith("=" + given))]  # --data=
  return any(argv[i + 1:i + 1 + len(extra)] == extra for i in at)  # after it, as the shell puts them


def _refuse(message: str) -> None:
  """Ends a refused run: 'error: ' and the message on stderr, exit code 2."""
  _fail(message, 2)


def _fail(message: str, code: int = 1) -> None:
  """Ends a run that failed (or, code 2, was refused): 'error: ' and the message on stderr."""
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.exit(code)


def memory_hint(backend: str) -> str:
  """What lowers a training step's memory, after device.out_of_memory's line."""
  naive = (" (--attn naive builds the (B, N, T, T) attention scores; --attn auto, cudnn or te do not)"
           if backend == "naive" else "")
  return f"; lower --batch-size, --seq-len or --vocab-size{naive}"


def failure_hint(backend: str) -> str:
  """What tells a failing kernel from the rest of the step, after device.xla_failure's line."""
  if backend == "xla":
    return ""
  return f" (the step's attention ran on --attn {backend}: --attn xla runs it on XLA's own ops, to tell the kernel " \
         "from the rest of the step)"


def start(argv=None) -> Start:
  """The run of the flags of `argv`, every check of checks.CHECKS passed; the first that refuses ends the process."""
  s = Start(parse(argv))
  for check in checks.CHECKS:
    if (refused := check(s)) is not None:
      _refuse(refused)
  return s


def model_line(preset: str, model: models.GPTConfig) -> str:
  """The model in one line, as a person reads it at the start of a run (the metrics file's start record has every
  field): the preset and the fields that set its size, speed and numerics."""
  kv = f" ({model.n_kv_head} kv)" if model.n_kv_head not in (None, model.n_head) else ""
  window = (f", window {model.window}" + (f" ({model.window_pattern})" if model.window_pattern else "")
            if model.window else "")
  return (f"model: {preset}, {model.n_layer} layers, {model.n_head} heads{kv}, d_model {model.d_model}, seq_len "
          f"{model.seq_len}, vocab {model.vocab_size}, attn {model.backend}"
          f"{f' (fp8 core {model.fp8_core})' if model.backend == 'te-fp8' else ''}, {model.dtype}"
          f"{'' if model.bias else ', no bias'}{window}")


def summary_line(summary: dict, metrics_path: str | None) -> str:
  """The run's end in one line: its losses, rates and size, and where the whole summary record is (--metrics)."""
  steps = summary.get("steps")
  parts = [f"{steps} step{'' if steps == 1 else 's'}"] if steps is not None else []
  for key, name in (("final_loss", "loss"), ("final_val_loss", "val loss")):
    if summary.get(key) is not None:
      parts.append(f"{name} {float(summary[key]):.4f}")
  if summary.get("steps_per_s"):
    parts.append(f"{summary['steps_per_s']:.3g} steps/s, {summary['tokens_per_s']:,.0f} tokens/s")
  if summary.get("mfu") is not None:
    peak = f" of {summary['mfu_peak_tflops']:.0f} TFLOP/s ({summary['mfu_peak']})" if summary.get("mfu_peak") else ""
    parts.append(f"MFU {summary['mfu']:.1%}{peak}")
  if summary.get("params") is not None:
    parts.append(f"{summary['params']:,} parameters")
  where = f"the full summary is in {metrics_path}" if metrics_path else "--metrics FILE keeps the full summary"
  return f"done: {', '.join(parts)} ({where})"


def main(argv=None) -> None:
  s = start(argv)
  a, model, cfg = s.a, s.model, s.cfg
  print(f"{model_line(a.preset, model)}\n{jax.device_count()} x {jax.devices()[0].device_kind}, mesh "
        f"{mesh.describe(s.mesh)}, jax {jax.__version__}", flush=True)
  try:
    summary = loop.run(cfg, s.walk)
  except signals.Stopped as e:
    if s.fresh:  # stopped before its first save: the folder train.rundirs made holds nothing
      e.removed += rundirs.discard_if_unused(cfg.ckpt_dir, s.made)
    print(e.report(), file=sys.stderr, flush=True)
    sys.exit(e.exit_code)
  except diskspace.DiskFull as e:  # what is saved stays; the run's folder is kept for the resume
    _fail(str(e))
  except metrics.MetricsWriteError as e:  # what is saved stays; a fresh run's folder goes where it holds nothing
    if s.fresh:
      rundirs.discard_if_unused(cfg.ckpt_dir, s.made)
    _fail(str(e))
  except (loop.TrainingDiverged, checkpoint.ResumeMismatchError, checkpoint.CheckpointError, lock.LockedError,
          attnlayers.BackendUnavailableError, FP8Unavailable, FileNotFoundError, ValueError) as e:
    if s.fresh:  # made by train.rundirs: a --ckpt-dir this run made goes in loop.run (Checkpoints.discard_if_unused)
      rundirs.discard_if_unused(cfg.ckpt_dir, s.made)
    _refuse(f"{e}{_flag_hint(e, a)}")
  except jax.errors.JaxRuntimeError as e:  # XLA could not compile or run the step: one line, not JAX's traceback
    if s.fresh:
      rundirs.discard_if_unused(cfg.ckpt_dir, s.made)
    oom = device.out_of_memory(e)
    _fail(oom + memory_hint(model.backend) if oom else device.xla_failure(e) + failure_hint(model.backend))
  try:
    _report_end(s, summary)
  except KeyboardInterrupt:  # Ctrl-C while the end is printed: the run is over and saved, nothing to stop
    saved = f"; the model is saved in {cfg.ckpt_dir}" if cfg.ckpt_dir else ""
    print(f"\nstopped by SIGINT after the run ended{saved}", file=sys.stderr, flush=True)
    sys.exit(128 + signal.SIGINT)


def _report_end(s: Start, summary: dict) -> None:
  """Prints the end of a finished run (process 0): the sample, where the model is saved and how to sample from it,
  and the summary_line last; names a fresh run's folder in RUNS/latest (train.rundirs) first, so that an interrupt while printing
  loses nothing."""
  cfg = s.cfg
  sampled, prompt = summary.pop("sample", None), summary.pop("sample_prompt", None)
  if jax.process_index() != 0:
    return
  if cfg.ckpt_dir and s.fresh:
    rundirs.write_latest(cfg.ckpt_dir)
  if sampled is not None:
    print(f"prompt (the start of the first validation text):\n{prompt}\nsample:\n{sampled}")
  if cfg.ckpt_dir:
    saved = "model saved in" if summary["final_loss"] is not None else "no step to train: the model was saved in"
    tokens = data.tokenizer(data.source(cfg.data))
    print(f"{saved} {cfg.ckpt_dir} (step {cfg.steps}); " + _sample_command(cfg.ckpt_dir, prompt, tokens))
  print(summary_line(summary, cfg.metrics), flush=True)


if __name__ == "__main__":
  main()
