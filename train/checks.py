"""The checks of `python -m train`'s flags, run in order before anything is built or compiled (train.cli.start).

Each check reads the run as the checks before it made it (Start) and returns the message the run stops with
(exit code 2), or None; CHECKS orders them. They live apart from the parser and the run itself so that every
refusal of the flags reads in one place, and each can be called on a Start of its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax

import attnlayers
import models
from train import checkpoint, config, data, hosts, mesh, overlap, report, rundirs, stepdirs

SAMPLE_TOKENS = 200  # new tokens the end-of-run sample has by default, where they fit


@dataclasses.dataclass
class Start:
  """The run as the checks of its flags make it: each check reads what those before it made."""
  a: argparse.Namespace  # the flags
  walk: data.Walk | None = None  # --data's folder, walked where first needed: every check and load read this walk
  model: models.GPTConfig | None = None
  cfg: config.TrainConfig | None = None
  made: list[str] = dataclasses.field(default_factory=list)  # folders above the run's own folder made for it (train.rundirs.RUNS)
  mesh: dict[str, int] | None = None  # each mesh axis's size (train.mesh), once the devices are known

  @property
  def fresh(self) -> bool:
    """Whether the run keeps its checkpoints in a new folder of its own (no --ckpt-dir, no --no-ckpt)."""
    return self.a.ckpt_dir is None and not self.a.no_ckpt


def _sample_tokens(asked: int | None, seq_len: int) -> int:
  """--sample-tokens as given, or the default: SAMPLE_TOKENS, fewer where the context holds fewer after the prompt."""
  return report.sample_lengths(seq_len, SAMPLE_TOKENS)[1] if asked is None else asked


def _checkpoint_flags(a: argparse.Namespace) -> str | None:
  """Why flags about checkpoints would be ignored, or None: --no-ckpt keeps none, and without --ckpt-dir a run
  starts in a new folder, with nothing to resume."""
  given = [flag for flag, value in (("--ckpt-every", a.ckpt_every), ("--allow-change", a.allow_change or None))
           if value is not None]
  if a.no_ckpt and given:
    return (f"{' and '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to checkpoints, and --no-ckpt keeps "
            f"none: leave out {' and '.join(given)}, or --no-ckpt")
  if a.allow_change and a.ckpt_dir is None:
    return (f"--allow-change applies to a resume from --ckpt-dir; without it the run starts in a new folder of its "
            f"own ({rundirs.RUNS}/train-YYYYmmdd-HHMMSS) with nothing to resume: give --ckpt-dir the folder to resume, or "
            "leave out --allow-change")
  return None


LOCAL_SETTINGS = ("metrics", "progress", "profile_dir")  # what each process of a multi-host run may set alone


def _settings_unlike_process_0(cfg: config.TrainConfig) -> str | None:
  """Where a process of a multi-host run was given other settings than process 0, the message every process
  stops with (each in its own words); else None. The processes train one model in lockstep: another shape ends
  in a collective of the wrong size, another learning rate in models that drift apart without a word."""
  mine = json.loads(json.dumps({k: v for k, v in dataclasses.asdict(cfg).items() if k not in LOCAL_SETTINGS},
                               sort_keys=True, default=str))
  theirs = json.loads(hosts.from_process_0(json.dumps(mine, sort_keys=True)))
  flat = lambda d: {f"{k}.{j}" if isinstance(v, dict) else k: w for k, v in d.items()
                    for j, w in (v.items() if isinstance(v, dict) else [(None, v)])}
  mine, theirs = flat(mine), flat(theirs)
  differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
  unlike = [i for i, x in enumerate(hosts.every_process(len(differ))) if x]
  if not unlike:
    return None
  if differ:
    return (f"process {jax.process_index()} was given other settings than process 0 ("
            + "; ".join(f"{k}: {theirs.get(k)!r} there, {mine.get(k)!r} here" for k in differ)
            + "): every process of a run takes the same flags (only --metrics, --progress and --profile-dir may differ)")
  return (f"process(es) {', '.join(map(str, unlike))} were given other settings than process {jax.process_index()} "
          "(each says which): every process of a run takes the same flags")


# The flags that set GPTConfig fields a checkpoint does not record as its architecture (checkpoint.MODEL_FLAGS has
# those), as a GPTConfig message may name them
RUN_MODEL_FLAGS = {"fp8_core": "--fp8-core", "backend": "--attn"}


def _flags_named(e: Exception) -> str:
  """' (FIELD is FLAG, ...)' for the model fields a GPTConfig error names (its ArgumentError.arguments, read through
  checkpoint.MODEL_FLAGS and RUN_MODEL_FLAGS), else ''."""
  arguments = e.arguments if isinstance(e, attnlayers.ArgumentError) else ()
  named = [f"{field} is {flag}" for field, flag in (checkpoint.MODEL_FLAGS | RUN_MODEL_FLAGS).items()
           if field in arguments]
  return f" ({', '.join(named)})" if named else ""


def _config(a: argparse.Namespace, model: models.GPTConfig, walk: data.Walk) -> config.TrainConfig:
  """The run's TrainConfig of the flags, refused (ValueError) where TrainConfig refuses a setting and where an output
  lies in what --data reads, as `walk` found it (train.overlap): every problem in one message."""
  outside = overlap.outputs_read_as_data(a.data, walk, ckpt_dir=a.ckpt_dir, metrics=a.metrics,
                                         profile_dir=a.profile_dir)
  try:
    cfg = config.TrainConfig(
        model=model, steps=a.steps, batch_size=a.batch_size, lr=a.lr, warmup=a.warmup, seed=a.seed, data=a.data,
        data_raw_bytes=a.data_raw_bytes, ckpt_dir=a.ckpt_dir,
        ckpt_every=config.TrainConfig.ckpt_every if a.ckpt_every is None else a.ckpt_every,
        eval_every=a.eval_every, log_every=a.log_every,
        metrics=a.metrics, sample_tokens=_sample_tokens(a.sample_tokens, model.seq_len), peak_tflops=a.peak_tflops,
        progress=a.progress,
        profile_dir=a.profile_dir, allow_change=tuple(a.allow_change), pack=a.pack, mesh=a.mesh)
  except ValueError as e:
    raise ValueError("; ".join([str(e), *outside])) from None
  if outside:
    raise ValueError("; ".join(outside))
  return cfg


def _built(s: Start) -> str | None:
  """Makes the model's GPTConfig and the run's TrainConfig of the flags; what they refuse, with the flags of the
  model fields it names."""
  try:
    s.walk = data.Walk(s.a.data)
    s.model = models.preset(s.a.preset, backend=s.a.attn, n_layer=s.a.n_layer, n_head=s.a.n_head,
                            d_model=s.a.d_model, n_kv_head=s.a.kv_heads, seq_len=s.a.seq_len,
                            vocab_size=s.a.vocab_size, dtype=s.a.dtype, bias=s.a.bias, fp8_core=s.a.fp8_core,
                            window=s.a.window, window_pattern=s.a.window_pattern, kernels=s.a.kernels)
    s.cfg = _config(s.a, s.model, s.walk)
  except ValueError as e:
    return f"{e}{_flags_named(e)}"
  return None


def _float16_off_a_gpu(s: Start) -> str | None:
  if s.a.dtype == "float16" and jax.default_backend() == "cpu":
    return ("--dtype float16 needs a GPU: XLA's CPU backend has no float16 matmul with float32 accumulation; use "
            "--dtype bfloat16 or float32 here")
  return None


MULTIHOST_FLAGS = ("--coordinator-address", "--num-processes", "--process-id")


def _multihost_flags_apart(s: Start) -> str | None:
  given = (s.a.coordinator_address, s.a.num_processes, s.a.process_id)
  if any(x is not None for x in given) and any(x is None for x in given):
    return ("multi-host runs need all of --coordinator-address, --num-processes and --process-id "
            f"(got {', '.join(n for n, x in zip(MULTIHOST_FLAGS, given) if x is not None)})")
  return None


def _process_id_out_of_range(s: Start) -> str | None:
  if s.a.process_id is not None and s.a.process_id >= s.a.num_processes:
    return f"--process-id {s.a.process_id} must be below --num-processes {s.a.num_processes}"
  return None


def _joined_unlike_process_0(s: Start) -> str | None:
  """Joins a multi-host run (--coordinator-address); where a process was given other settings than process 0, the
  message every process stops with."""
  if not s.a.coordinator_address:
    return None
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes talk through gloo
  jax.distributed.initialize(s.a.coordinator_address, num_processes=s.a.num_processes, process_id=s.a.process_id)
  return _settings_unlike_process_0(s.cfg)


def _mesh_unfit(s: Start) -> str | None:
  """Why --mesh cannot split the run over the devices (every process's, once joined), with what would."""
  try:
    s.mesh = mesh.parse(s.a.mesh, jax.device_count())
  except mesh.MeshError as e:
    return str(e)
  return mesh.check(s.mesh, jax.device_count(), s.model, s.a.batch_size)


def _runs_read_as_data(s: Start) -> str | None:
  """A fresh run's runs folder (train.rundirs.RUNS) in what --data reads, refused before the run folder is made there (as _config refuses a
  --ckpt-dir there)."""
  return overlap.runs_folder_read_as_data(s.cfg.data, rundirs.RUNS, s.walk) if s.fresh else None


def _run_dir_made(s: Start) -> str | None:
  """Makes a fresh run's own folder (process 0 makes it, every process saves there); why it cannot be made."""
  if not s.fresh:
    return None
  try:
    run_dir, s.made = rundirs.agreed_run_dir()
  except rundirs.RunDirError as e:
    return str(e)
  s.cfg = dataclasses.replace(s.cfg, ckpt_dir=run_dir)
  return None


def _outputs_in_another_run(s: Start) -> str | None:
  """Where an output path would land where this run has no business: --ckpt-dir a folder holding files but no
  checkpointed run of this program, or any output in a step folder of a run (stepdirs.step_folder_at). A run writing
  there would mix its files with the user's, or make that run's newest step look damaged."""
  problems = []
  for flag, path in (("--ckpt-dir", s.a.ckpt_dir), ("--metrics", s.a.metrics), ("--profile-dir", s.a.profile_dir)):
    step = stepdirs.step_folder_at(path) if path else None
    if step is not None:
      run = os.path.dirname(step)
      resume = f"--ckpt-dir {run} resumes that run, or give" if flag == "--ckpt-dir" else "give"
      where = "is" if os.path.realpath(path) == step else "lies in"
      problems.append(f"{flag} {path} {where} the step folder {step} of the checkpointed run in {run}: writing there "
                      f"would damage that checkpoint; {resume} {flag} a path outside it")
  ckpt = s.a.ckpt_dir
  for flag, path in (("--ckpt-dir", ckpt), ("--profile-dir", s.a.profile_dir)):
    if s.a.metrics and path and os.path.realpath(s.a.metrics) == os.path.realpath(path):
      problems.append(f"--metrics {s.a.metrics} is also {flag}, a folder: give --metrics a file of its own, e.g. "
                      f"--metrics {os.path.join(path, 'metrics.jsonl')}")
  if s.a.metrics and not problems and stepdirs.runs_own_file(s.a.metrics, ckpt):
    problems.append(f"--metrics {s.a.metrics} names a file python -m train keeps in a run's checkpoint folder (its "
                    "lock file, which is emptied when the run ends, a journal, or a step): give --metrics another "
                    "name, e.g. metrics.jsonl")
  if not problems and ckpt and os.path.isdir(ckpt) and os.listdir(ckpt) and not stepdirs.holds_run(ckpt):
    names = sorted(os.listdir(ckpt))
    problems.append(f"--ckpt-dir {ckpt} holds files that are not a checkpointed run of python -m train "
                    f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}): give a new or empty folder, or the "
                    "folder a run saved its checkpoints to")
  return "; ".join(problems) or None


# Every refusal of the flags, in the order checked, each run once the checks above it passed: a function of the
# Start that returns the message the run stops with (exit code 2), or None. The last two make the multi-host run's
# connection and the run's folder, which the checks after them need, and nothing else is made before them.
CHECKS = (
    lambda s: _checkpoint_flags(s.a),
    _outputs_in_another_run,
    _built,
    _float16_off_a_gpu,
    _multihost_flags_apart,
    _process_id_out_of_range,
    _joined_unlike_process_0,
    _mesh_unfit,
    _runs_read_as_data,
    _run_dir_made,
)
