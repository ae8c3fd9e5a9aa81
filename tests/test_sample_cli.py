"""`python -m sample` and the trainer's default run folder, on CPU, in-process.

One tiny model is trained once (python -m train without --ckpt-dir, in a temporary working
folder); the tests sample from it, check that sampling leaves the folder as it was, and that
every bad input exits with code 2 and says what would work.
"""

import contextlib
import io
import os
import shlex
import shutil
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import models
import models.generate
from tests.test_train import write_shard
from sample import cli as sample_cli
from train import checkpoint, cli, hosts, lock, loop, reader, rundirs, stepdirs, tokenizers

TRAIN = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "8", "--steps", "4", "--ckpt-every", "2",
         "--no-progress", "--eval-every", "0", "--log-every", "1", "--sample-tokens", "8"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(working folder, the run folder python -m train made there, what it printed)."""
  work = tmp_path_factory.mktemp("work")
  out, before = io.StringIO(), os.getcwd()
  os.chdir(work)
  try:
    with contextlib.redirect_stdout(out):
      cli.main(TRAIN)
  finally:
    os.chdir(before)
  runs = [d for d in os.listdir(work / rundirs.RUNS) if d.startswith("train-")]
  assert len(runs) == 1, runs
  return work, work / rundirs.RUNS / runs[0], out.getvalue()


def sample_main(args, capsys, cwd=None) -> tuple[int, str, str]:
  before = os.getcwd()
  os.chdir(cwd or before)
  try:
    sample_cli.main(args)
    code = 0
  except SystemExit as e:
    code = e.code
  finally:
    os.chdir(before)
  captured = capsys.readouterr()
  return code, captured.out, captured.err


def snapshot(folder) -> dict:
  """Every path under `folder` with its size, modification time and mode: what sampling must not change."""
  stat = lambda path: (lambda st: (st.st_size, st.st_mtime_ns, st.st_mode))(os.lstat(path))
  return {os.path.relpath(os.path.join(root, n), folder): stat(os.path.join(root, n))
          for root, dirs, files in os.walk(folder) for n in dirs + files}


def test_train_keeps_the_model_and_prints_the_command_that_samples_it(trained, capsys):
  work, run, printed = trained
  assert (work / rundirs.LATEST).read_text().strip() == run.name
  assert stepdirs.listing(str(run)).ours == (2, 4)
  assert "sample:\n" in printed
  command = printed.strip().splitlines()[-2].strip()  # the last line is the run's summary
  assert command.startswith(f"python -m sample --ckpt-dir {rundirs.RUNS}/{run.name} --prompt "), printed
  code, out, err = sample_main(shlex.split(command)[3:] + ["--tokens", "5"], capsys, cwd=work)  # as printed
  assert code == 0, err
  assert "step 4, trained on python-stdlib" in out


def test_sample_prints_text_time_to_first_token_and_rate(trained, capsys):
  work, run, _ = trained
  before = snapshot(run)
  code, out, err = sample_main(["--ckpt-dir", str(run), "--prompt", "def ", "--tokens", "10", "--seed", "3"], capsys)
  assert code == 0, err
  header, text = out.split("\n", 1)  # the line naming the checkpoint (before any work), then the sample
  assert header.endswith("attention auto"), header
  assert text.startswith("def ")
  assert "time to first token: " in out and " ms; decode: " in out and " tokens/s " in out
  assert out.rstrip().endswith("attention auto ran on: prefill xla, decode xla; a decode step's blocks: general: the "
                               "model's kernels are xla, XLA fusions (the Pallas kernels need a GPU (Pallas's Triton "
                               "backend, CUDA); the device is cpu)"), out  # what auto chose on a CPU
  assert snapshot(run) == before  # nothing written, renamed or locked in the trainer's folder


def test_no_ckpt_dir_samples_the_latest_run(trained, capsys):
  work, run, _ = trained
  code, out, err = sample_main(["--tokens", "4", "--temperature", "0"], capsys, cwd=work)
  assert code == 0 and out.startswith(f"{rundirs.RUNS}/{run.name}: step 4"), err


def test_batch_draws_several_samples(trained, capsys):
  code, out, err = sample_main(["--ckpt-dir", str(trained[1]), "--batch", "3", "--tokens", "6", "--top-k", "5"], capsys)
  assert code == 0, err
  assert "--- sample 3 of 3" in out and "(3 x 6 new tokens" in out


def test_a_greedy_batch_prints_its_one_text_once_and_says_why(trained, capsys):
  """--temperature 0 with --batch 3: the three rows decode the same prompt greedily, so they are one text; it is
  printed once under a line saying that all three are it, and the timing line still counts the three rows."""
  code, out, err = sample_main(["--ckpt-dir", str(trained[1]), "--batch", "3", "--tokens", "6", "--temperature", "0",
                                "--prompt", "def "], capsys)
  assert code == 0, err
  assert "--- all 3 samples are this one (--temperature 0 decodes greedily)\ndef " in out, out
  assert "--- sample" not in out and out.count("\ndef ") == 1 and "(3 x 6 new tokens" in out, out


def test_samples_while_a_trainer_holds_the_folder(trained, capsys):
  held = lock.DirLock(str(trained[1]))
  held.acquire()
  try:
    code, _, err = sample_main(["--ckpt-dir", str(trained[1]), "--tokens", "3"], capsys)
  finally:
    held.release()
  assert code == 0, err


def test_a_damaged_newest_step_falls_back_to_the_older_one_untouched(trained, tmp_path, capsys):
  copy = tmp_path / "run"
  shutil.copytree(trained[1], copy)
  meta = copy / "4" / "meta" / "metadata"
  meta.write_text(meta.read_text() + " ")
  before = snapshot(copy)
  code, out, err = sample_main(["--ckpt-dir", str(copy), "--tokens", "3"], capsys)
  assert code == 0 and f"{copy}: step 2" in out, err
  assert "skipped a damaged checkpoint: step 4:" in err
  assert snapshot(copy) == before  # reported, not set aside: that is the trainer's call


def test_newer_step_folders_without_a_manifest_are_named_when_an_older_step_is_sampled(trained, tmp_path, capsys):
  copy = tmp_path / "run"
  shutil.copytree(trained[1], copy)
  os.remove(copy / "4" / "attnlayers.json")  # a step folder the trainer did not seal (or someone else's)
  os.mkdir(copy / "9")
  code, out, err = sample_main(["--ckpt-dir", str(copy), "--tokens", "3"], capsys)
  assert code == 0 and f"{copy}: step 2" in out, err
  assert f"skipped {copy / '4'}: it has no attnlayers.json, so it is not a checkpoint python -m train " \
         "sealed" in err, err
  assert f"skipped {copy / '9'}: it is empty" in err, err


def _copy_damaged(trained, d):
  shutil.copytree(trained[1], d / "run")
  for step in ("2", "4"):
    meta = d / "run" / step / "meta" / "metadata"
    meta.write_text(meta.read_text() + " ")
  return str(d / "run")


def _empty(d):
  (d / "empty").mkdir()
  return str(d / "empty")


def _unsealed(folder):
  """A folder whose one step folder, 100, holds a file and no manifest (a save cut short, or not python -m train's)."""
  (folder / "100").mkdir(parents=True)
  (folder / "100" / "f").write_text("x")
  return str(folder)


def _latest(d, raw: bytes, *_):
  """No flags, with runs/latest holding `raw` in the working folder d."""
  (d / "runs").mkdir(exist_ok=True)
  (d / "runs" / "latest").write_bytes(raw)
  return []


def _file(d):
  (d / "f").write_text("x")
  return str(d / "f")


BAD = {
    "missing-dir": (lambda t, d: ["--ckpt-dir", str(d / "nope")], "does not exist"),
    "dir-is-a-file": (lambda t, d: ["--ckpt-dir", _file(d)], "is not a folder"),
    "empty-dir": (lambda t, d: ["--ckpt-dir", _empty(d)], "holds no checkpoint"),
    "no-intact-step": (lambda t, d: ["--ckpt-dir", _copy_damaged(t, d)], "is intact: step 4: "),
    "prompt-too-long": (lambda t, d: ["--ckpt-dir", str(t[1]), "--prompt", "x" * 40],
                        "the prompt is 40 tokens, and the model's context holds 32 in all"),
    "tokens-past-context": (lambda t, d: ["--ckpt-dir", str(t[1]), "--prompt", "abcd", "--tokens", "30"],
                            "--tokens 30 does not fit: the context holds 32 tokens and the prompt takes 4, "
                            "so at most 28 new ones fit"),
    "empty-prompt": (lambda t, d: ["--ckpt-dir", str(t[1]), "--prompt", ""], "the prompt is empty"),
    "missing-prompt-file": (lambda t, d: ["--ckpt-dir", str(t[1]), "--prompt-file", str(d / "no.txt")],
                            "cannot read it"),
    "unknown-backend": (lambda t, d: ["--ckpt-dir", str(t[1]), "--attn", "flash"],
                        "argument --attn: invalid choice: 'flash'"),
    "backend-cannot-run": (lambda t, d: ["--ckpt-dir", str(t[1]), "--attn", "cudnn", "--tokens", "2"],
                           "backend 'cudnn' cannot run"),  # the tiny model is float32: cuDNN refuses it anywhere
    "backend-hint": (lambda t, d: ["--ckpt-dir", str(t[1]), "--attn", "cudnn", "--tokens", "2"],
                     "here: --attn picks the backend (auto: one that runs this model); the compute dtype is the one "
                     "the model was trained in (python -m train --dtype)"),
    "top-k-past-vocab": (lambda t, d: ["--ckpt-dir", str(t[1]), "--top-k", "300"],
                         "--top-k 300 is more than the 256 UTF-8 bytes the model samples from; use 1..256"),
    "top-k-0": (lambda t, d: ["--top-k", "0"], "argument --top-k: must be >= 1, got 0"),
    "negative-temperature": (lambda t, d: ["--temperature", "-1"], "argument --temperature: must be a finite number"),
    "nan-temperature": (lambda t, d: ["--temperature", "nan"], "argument --temperature: must be a finite number"),
    "seed-past-32-bits": (lambda t, d: ["--seed", str(2**32)], "argument --seed: must be below 2**32 (4294967296), "
                          "got 4294967296: jax's random key keeps 32 bits"),  # it sampled what --seed 0 samples
    "batch-0": (lambda t, d: ["--batch", "0"], "argument --batch: must be >= 1, got 0"),
    # greedy decoding takes neither: both were accepted and silently ignored
    "greedy-top-k": (lambda t, d: ["--temperature", "0", "--top-k", "5"],
                     "--top-k applies to sampling, and --temperature 0 decodes greedily (the most likely token: "
                     "always among the top k): leave out --top-k,"),
    "greedy-seed": (lambda t, d: ["--temperature", "0", "--seed", "3"],
                    "--seed applies to sampling, and --temperature 0 decodes greedily (the most likely token: "
                    "nothing random): leave out --seed,"),
    "greedy-top-k-seed": (lambda t, d: ["--temperature", "0", "--top-k", "5", "--seed", "0"],
                          "--top-k and --seed apply to sampling, and --temperature 0 decodes greedily (the most "
                          "likely token: always among the top k, nothing random): leave out --top-k and --seed, "
                          "or give a --temperature above 0"),
    "no-latest-run": (lambda t, d: [], "no --ckpt-dir given and no runs/latest here"),
    # a step folder without its manifest: the message read "holds no checkpoint (no step folder with attnlayers.json)"
    "step-without-manifest": (lambda t, d: ["--ckpt-dir", _unsealed(d / "c")],
                              "holds no checkpoint python -m train saved (its step folder 100 has no attnlayers.json, "
                              "the manifest python -m train seals each saved step with): give --ckpt-dir the folder"),
    # runs/latest naming a deleted run blamed a --ckpt-dir the user never gave
    "latest-run-deleted": (lambda t, d: _latest(d, b"gone\n"), "no --ckpt-dir given, and the run runs/latest names, "
                           "runs/gone, does not exist (deleted?): give --ckpt-dir"),
    "latest-run-unsealed": (lambda t, d: _latest(d, b"r\n", _unsealed(d / "runs" / "r")),
                            "runs/r (the run runs/latest names) holds no checkpoint python -m train saved"),
    # bad bytes in runs/latest gave a bare "'utf-8' codec can't decode byte 0xff"
    "latest-bad-bytes": (lambda t, d: _latest(d, b"\xff\xfe\x80"), "no --ckpt-dir given, and runs/latest does not "
                         "hold the name of a run folder in runs (as python -m train writes it): it holds "
                         "b'\\xff\\xfe\\x80'. Give --ckpt-dir"),
    "latest-a-path": (lambda t, d: _latest(d, b"../etc\n"), "runs/latest does not hold the name of a run folder"),
    # an empty path read as a folder that does not exist: "--ckpt-dir  does not exist"
    "ckpt-dir-empty": (lambda t, d: ["--ckpt-dir", ""], "argument --ckpt-dir: an empty path (an unset variable?); "
                       "leave out --ckpt-dir to sample the run runs/latest names"),
    "ckpt-dir-spaces": (lambda t, d: ["--ckpt-dir", "  "], "argument --ckpt-dir: a path of spaces only ('  ')"),
    "prompt-file-empty": (lambda t, d: ["--prompt-file", ""], "argument --prompt-file: an empty path"),
    # read to its end, which /dev/zero never reaches: the sampler hung in silence
    "prompt-file-endless": (lambda t, d: ["--ckpt-dir", str(t[1]), "--prompt-file", "/dev/zero"],
                            "--prompt-file /dev/zero holds more than 16,777,216 characters, more than any model's "
                            "context takes as a prompt"),
    # a step folder, or a folder of run folders, said only that it held no checkpoint
    "step-folder": (lambda t, d: ["--ckpt-dir", _newest_step(t[1])], "is the step folder {s} of the run in {r}, not a "
                    "run's folder: give --ckpt-dir {r}"),
    "inside-a-step-folder": (lambda t, d: ["--ckpt-dir", os.path.join(_newest_step(t[1]), "state")],
                             "lies in the step folder {s} of the run in {r}"),
    "folder-of-runs": (lambda t, d: ["--ckpt-dir", str(t[1].parent)], "holds no checkpoint of its own but the run "
                       "folders {n}: give --ckpt-dir one of them, e.g. --ckpt-dir {r}"),
}


def _newest_step(run) -> str:
  return str(run / max((n for n in os.listdir(run) if n.isdigit()), key=int))
if jax.default_backend() == "cpu":  # a GPU with TransformerEngine may run it
  BAD["te-fp8-cannot-run"] = (lambda t, d: ["--ckpt-dir", str(t[1]), "--attn", "te-fp8", "--tokens", "2"],
                              "te-fp8 projections cannot run here")


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_exits_2_saying_what_would_work(trained, tmp_path, case, capsys):
  args, message = BAD[case]
  run = trained[1]
  message = message.format(s=os.path.realpath(_newest_step(run)), r=os.path.realpath(run), n=run.name)
  code, _, err = sample_main(args(trained, tmp_path), capsys, cwd=tmp_path)
  assert code == 2 and message in err, err
  assert "Traceback" not in err


def test_prompts_of_gpt2_tokens_need_tiktoken():
  try:
    import tiktoken  # noqa: F401
  except ImportError:
    with pytest.raises(ValueError, match=r"needs tiktoken \(pip install tiktoken\)"):
      tokenizers.encode("hi", tokenizers.GPT2)
  else:
    assert len(tokenizers.encode("hi", tokenizers.GPT2)) >= 1


def test_the_sample_command_after_gpt2_shards_says_it_needs_tiktoken_where_it_is_missing(tmp_path, monkeypatch,
                                                                                        capsys):
  """python -m sample takes GPT-2 tokens through tiktoken: without it, the command the trainer offers (at the end of
  a run, and where a rerun has nothing to train) says what it needs, and quotes no prompt (the end-of-run sample's,
  decoded without tiktoken, is token ids, not text). It printed a command that then failed."""
  monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken raises ImportError, installed or not
  write_shard(tmp_path / "a_train.bin", np.arange(300) % 1000)
  write_shard(tmp_path / "b_val.bin", np.arange(300) % 1000)
  run = tmp_path / "run"
  flags = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "8", "--no-progress", "--eval-every", "0",
           "--sample-tokens", "4", "--vocab-size", "50304", "--data", str(tmp_path / "*.bin"), "--ckpt-dir", str(run)]
  cli.main([*flags, "--steps", "2"])
  printed = capsys.readouterr().out
  assert "sample:\ntoken ids: " in printed, printed
  assert printed.strip().splitlines()[-3:-1] == [  # before the run's summary
      f"model saved in {run} (step 2); sample from it (needs tiktoken: pip install tiktoken) with:",
      f"  python -m sample --ckpt-dir {run}"], printed
  with pytest.raises(SystemExit) as e:
    cli.main([*flags, "--steps", "1"])
  err = capsys.readouterr().err
  assert e.value.code == 2 and f"or sample from it (needs tiktoken: pip install tiktoken): python -m sample --ckpt-dir " \
                               f"{run}" in err, err


def test_the_tokenizer_is_the_datas_and_the_vocabulary_decides_only_where_the_checkpoint_does_not_say():
  assert sample_cli.tokenizer({"data": "/d/book.txt"}, 50304) == tokenizers.BYTES  # text data: bytes, whatever the vocab
  assert sample_cli.tokenizer({"data": "python-stdlib"}, 512) == tokenizers.BYTES
  assert sample_cli.tokenizer({"data": "/d/fineweb_*.bin"}, 50304) == tokenizers.GPT2
  assert sample_cli.tokenizer({}, 256) == tokenizers.BYTES and sample_cli.tokenizer({}, 50304) == tokenizers.GPT2
  with pytest.raises(ValueError, match="does not record the data .* there is no tokenizer for a vocabulary of 1000: prompts"):
    sample_cli.tokenizer({}, 1000)
  with pytest.raises(ValueError, match=r"trained on GPT-2 BPE tokens \(ids up to 50256\), more than its "
                                       "vocabulary of 256"):
    sample_cli.tokenizer({"data": "/d/x_*.bin"}, 256)


def test_a_prompt_that_is_not_utf8_reaches_a_byte_model_as_its_bytes():
  """Bytes on the command line that are not UTF-8 arrive as lone surrogates (surrogateescape); they ended in
  "error: 'utf-8' codec can't encode characters in position 0-1: surrogates not allowed"."""
  text = b"a\xff\xfeb".decode("utf-8", errors="surrogateescape")  # what sys.argv holds for those bytes
  np.testing.assert_array_equal(tokenizers.encode(text, tokenizers.BYTES), [0x61, 0xFF, 0xFE, 0x62])
  with pytest.raises(ValueError, match="the prompt is not valid UTF-8 text .* give the prompt as UTF-8"):
    tokenizers.encode(text, tokenizers.GPT2)


def test_a_prompt_file_that_is_not_utf8_reaches_a_byte_model_as_its_bytes(trained, tmp_path, capsys):
  """--prompt-file reads as --prompt does: bytes that are not UTF-8 reach a byte model as they are (it ended in
  "cannot read it ('utf-8' codec can't decode byte 0xff ...)", where --prompt with the same bytes sampled)."""
  path = tmp_path / "p.bin"
  path.write_bytes(b"a\xff\xfeb")
  code, out, err = sample_main(["--ckpt-dir", str(trained[1]), "--prompt-file", str(path), "--tokens", "3"], capsys)
  assert code == 0, err
  assert "a\ufffd\ufffdb" in out


def test_ids_a_tokenizer_lacks_read_as_the_replacement_character():
  assert tokenizers.decode([104, 105, 300, 33], tokenizers.BYTES) == "hi\ufffd!"


@pytest.mark.parametrize("vocab", [512, 50304])
def test_a_byte_model_with_a_larger_vocabulary_samples_as_bytes_as_the_trainer_did(tmp_path, vocab, capsys,
                                                                                    monkeypatch):
  """--vocab-size above the data's 256 byte ids: the trainer says the extra ids never occur, its end-of-run sample
  decodes bytes, and the command it prints samples with bytes too (it said: no tokenizer for a vocabulary of 512,
  or took 50304 for GPT-2 BPE). Both draw from the 256 byte ids only (real_vocab), never from the extra ones, which
  no data trained as targets (they could, and then printed as U+FFFD)."""
  drawn = []  # the real_vocab of each generate() call: the trainer's, then python -m sample's
  def record(real):
    return lambda *a, sampling, **kw: drawn.append(sampling.real_vocab) or real(*a, sampling=sampling, **kw)
  monkeypatch.setattr(models.generate, "generate", record(models.generate.generate))
  monkeypatch.setattr(sample_cli, "generate", record(sample_cli.generate))
  cli.main(["--preset", "tiny", "--seq-len", "32", "--batch-size", "8", "--steps", "2", "--no-progress",
            "--eval-every", "0", "--sample-tokens", "8", "--vocab-size", str(vocab), "--ckpt-dir", str(tmp_path / "run")])
  printed = capsys.readouterr().out
  assert f"vocab_size {vocab}: the data (python-stdlib) holds UTF-8 bytes, ids below 256" in printed
  command = printed.strip().splitlines()[-2].strip()  # the last line is the run's summary
  code, out, err = sample_main(shlex.split(command)[3:] + ["--tokens", "5"], capsys)
  assert code == 0, err
  assert "trained on python-stdlib (UTF-8 bytes)" in out
  assert drawn == [256, 256]


def _hand_made(directory, vocab: int) -> str:
  """A checkpoint written without python -m train: a tiny model of `vocab` ids and a meta that records no data."""
  cfg = models.config.preset("tiny", vocab_size=vocab, seq_len=32)
  ckpts = checkpoint.Checkpoints(str(directory))
  ckpts.save(1, {"params": nnx.state(models.GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)},
             {"model": cfg.architecture(), "run": {"dtype": "float32"}})
  ckpts.close()
  return str(directory)


def test_a_model_without_a_data_record_and_fewer_ids_than_bytes_samples_from_its_own(tmp_path, capsys, monkeypatch):
  """vocab_size 64 and no data in the meta: its vocabulary picks bytes (tokenizers.for_vocab), whose 256 ids it lacks.
  It was refused ("real_vocab (256) must be <= the model's vocab_size (64)"); it now draws from its 64 ids only,
  and a prompt byte past them is refused naming both."""
  drawn = []  # (real_vocab, the tokens generated) of each call
  def record(*a, sampling, **kw):
    gen = models.generate.generate(*a, sampling=sampling, **kw)
    drawn.append((sampling.real_vocab, np.asarray(gen.tokens)))
    return gen
  monkeypatch.setattr(sample_cli, "generate", record)
  run = _hand_made(tmp_path / "run", 64)
  code, out, err = sample_main(["--ckpt-dir", run, "--tokens", "20", "--batch", "4", "--temperature", "2"], capsys)
  assert code == 0, err
  assert "trained on ? (UTF-8 bytes)" in out
  (real, tokens), = drawn
  assert real == 64 and tokens.max() < 64, (real, tokens)
  code, _, err = sample_main(["--ckpt-dir", run, "--prompt", "a"], capsys)  # "a" is byte 97
  assert code == 2 and ("the prompt's UTF-8 bytes include id 97, past the model's vocabulary of 64 (ids 0..63): "
                        "give a prompt of those ids only") in err, err


# --- python -m train's run folders (loop.run replaced: only the folder handling is under test)


def _fake_run(seen: list, fail: bool = False):
  def run(cfg, walk=None):  # loop.run's signature: the CLI hands on the data.Walk its checks were made with
    seen.append(cfg.ckpt_dir)
    ckpts = checkpoint.Checkpoints(cfg.ckpt_dir) if cfg.ckpt_dir else None  # a run first creates and locks its folder
    if fail and ckpts:
      ckpts.discard_if_unused()  # as loop.run does when it is refused: the lock file it made goes
    if ckpts:
      ckpts.close()
    if fail:
      raise ValueError("the data is too short")
    return {"event": "summary", "final_loss": 1.0}  # a run that trained
  return run


def test_each_run_gets_a_new_folder_and_no_ckpt_keeps_none(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  seen = []
  monkeypatch.setattr(loop, "run", _fake_run(seen))
  cli.main(["--steps", "1"])
  cli.main(["--steps", "1"])  # within the same second, too
  cli.main(["--steps", "1", "--no-ckpt"])
  cli.main(["--steps", "1", "--ckpt-dir", "mine"])
  assert seen[0] != seen[1] and all(s.startswith(f"{rundirs.RUNS}/train-") for s in seen[:2])
  assert seen[2:] == [None, "mine"]
  assert (tmp_path / rundirs.LATEST).read_text().strip() == os.path.basename(seen[1])  # explicit folders leave it be
  assert "python -m sample --ckpt-dir mine" in capsys.readouterr().out


def test_runs_started_in_the_same_second_each_make_a_folder_of_their_own(tmp_path, monkeypatch):
  """The folder is made where its name is chosen (os.mkdir), so runs racing for one name each get their own; a
  name chosen free and made later let two runs share one folder, and the one refused its lock removed it."""
  import threading
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(rundirs.time, "strftime", lambda fmt: "20260101-000000")
  start, made = threading.Barrier(8), []
  def race():
    start.wait()
    made.append(rundirs.fresh_run_dir())
  threads = [threading.Thread(target=race) for _ in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(set(made)) == 8 and all(os.path.isdir(p) for p in made)
  assert sorted(os.listdir(tmp_path / rundirs.RUNS))[:2] == ["train-20260101-000000", "train-20260101-000000-2"]


def test_a_run_that_fails_before_saving_leaves_no_folder(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  seen = []
  monkeypatch.setattr(loop, "run", _fake_run(seen, fail=True))
  with pytest.raises(SystemExit) as e:
    cli.main(["--steps", "1"])
  assert e.value.code == 2 and "the data is too short" in capsys.readouterr().err
  assert not (tmp_path / rundirs.RUNS).exists()  # nor the runs/ folder it made


def test_a_ckpt_dir_the_run_made_is_removed_when_it_fails_before_saving(tmp_path, capsys):
  """--ckpt-dir naming a new folder: a run refused after locking it (the vocabulary too small for the data)
  leaves no folder holding only its lock; a folder that existed before stays."""
  args = ["--preset", "tiny", "--seq-len", "32", "--vocab-size", "100", "--no-progress", "--ckpt-dir"]
  for existed in (False, True):
    path = tmp_path / f"c{existed}"
    if existed:
      path.mkdir()
    with pytest.raises(SystemExit) as e:
      cli.main([*args, str(path)])
    assert e.value.code == 2 and "vocab" in capsys.readouterr().err
    assert path.exists() == existed


def test_ckpt_dir_and_no_ckpt_exclude_each_other(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["--ckpt-dir", "x", "--no-ckpt"])
  assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def _as_processes(monkeypatch):
  """Runs the code after it as one of two processes (set the returned dict's "index"; process 0 first): process 1's
  n-th broadcast_one_to_all returns process 0's n-th, and fails the test where process 0 sent no n-th: the real one
  would wait for it for ever."""
  from jax.experimental import multihost_utils
  me, sent, calls = {"index": 0}, [], {0: 0, 1: 0}
  def broadcast(x):
    n = calls[me["index"]]
    calls[me["index"]] += 1
    if me["index"] == 0:
      sent.append(x.copy())
    if n >= len(sent):
      pytest.fail(f"process {me['index']} waits for process 0's broadcast {n + 1}, which never comes")
    return sent[n]
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: me["index"])
  monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", broadcast)
  return me


def test_process_0s_error_reaches_every_process_whole_however_long(monkeypatch):
  """on_process_0 sends process 0's error message whole (any length, any characters) and its result; the other
  processes raise that message or return that result."""
  message = "déjà vu \u2603 " * 1000  # 15000 characters, 19000 bytes of UTF-8, more again as JSON escapes them
  def fails():
    raise checkpoint.CheckpointError(message)
  me = _as_processes(monkeypatch)
  for me["index"] in (0, 1):
    with pytest.raises(checkpoint.CheckpointError) as e:
      hosts.on_process_0(fails, errors=(checkpoint.CheckpointError,))
    assert str(e.value) == message
  for me["index"] in (0, 1):
    assert hosts.on_process_0(lambda: "" if me["index"] else "runs/x") == "runs/x"  # process 1's work never runs
    assert hosts.on_process_0(lambda: None) is None


def test_every_process_saves_in_the_run_folder_process_0_made(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  seen = []
  monkeypatch.setattr(loop, "run", _fake_run(seen))
  me = _as_processes(monkeypatch)
  for me["index"] in (0, 1):
    cli.main(["--steps", "1"])
  assert seen[0] == seen[1] and seen[0].startswith(f"{rundirs.RUNS}/train-")
  assert sorted(os.listdir(tmp_path / rundirs.RUNS)) == sorted(["latest", os.path.basename(seen[0])])  # one folder


def test_a_run_folder_process_0_cannot_make_stops_every_process_with_its_reason(tmp_path, monkeypatch, capsys):
  """Process 0 sends its failure as it would the path: the others stop with the same error instead of waiting."""
  monkeypatch.chdir(tmp_path)
  (tmp_path / rundirs.RUNS).write_text("a file where the run folders go")
  monkeypatch.setattr(loop, "run", lambda cfg, walk=None: pytest.fail("trained without a run folder"))
  me = _as_processes(monkeypatch)
  errors = []
  for me["index"] in (0, 1):
    with pytest.raises(SystemExit) as e:
      cli.main(["--steps", "1"])
    assert e.value.code == 2
    errors.append(capsys.readouterr().err)
  assert errors[0] == errors[1] == (f"error: cannot make a run folder in {rundirs.RUNS}/ (File exists); give --ckpt-dir "
                                    "elsewhere, or --no-ckpt\n"), errors


@pytest.mark.parametrize("problem", ["file", "locked"])
def test_a_checkpoint_folder_process_0_cannot_use_stops_every_process_with_its_reason(tmp_path, monkeypatch, problem):
  """Process 0 opens --ckpt-dir; where it cannot (a file in the way, another run's lock) it sends its error before
  raising it, and the other processes raise the same instead of waiting in the next broadcast."""
  target = tmp_path / "c"
  if problem == "file":
    target.write_text("not a folder")
  else:
    holder = checkpoint.Checkpoints(str(target))  # this test's own run holds the lock
  me = _as_processes(monkeypatch)
  raised = []
  for me["index"] in (0, 1):
    with pytest.raises((checkpoint.CheckpointError, lock.LockedError)) as e:
      checkpoint.Checkpoints(str(target))
    raised.append((type(e.value), str(e.value)))
  assert raised[0] == raised[1], raised
  if problem == "locked":
    holder.close()  # its checkpointer and its lock


def _with_meta(monkeypatch, change):
  """Makes python -m sample read the checkpoint's meta as `change(meta)` returns it."""
  read = reader.Reader.meta
  monkeypatch.setattr(reader.Reader, "meta", lambda self, step: change(dict(read(self, step))))


def test_a_window_that_applied_to_no_layer_is_sampled_as_trained_without_one(trained, monkeypatch, capsys):
  """An earlier trainer accepted --window 16 --window-pattern global,global,local for 2 layers (GPTConfig now
  refuses it): no layer used the window, so sample rebuilds the model without one and says so."""
  _with_meta(monkeypatch, lambda m: m | {"model": m["model"] | {"window": 16, "window_pattern": "global,global,local"}})
  code, out, err = sample_main(["--ckpt-dir", str(trained[1]), "--tokens", "3"], capsys)
  assert code == 0, err
  assert "the checkpoint's window (16) applied to none of its 2 layers (window_pattern 'global,global,local')" in err


def test_a_window_pattern_longer_than_the_model_is_sampled_as_the_layers_used_it(trained, monkeypatch, capsys):
  """An earlier trainer accepted --window-pattern local,global,global for 2 layers (GPTConfig now refuses it): the
  layers used its first 2 entries, so sample rebuilds the model with those and says so."""
  _with_meta(monkeypatch, lambda m: m | {"model": m["model"] | {"window": 16, "window_pattern": "local,global,global"}})
  code, out, err = sample_main(["--ckpt-dir", str(trained[1]), "--tokens", "3"], capsys)
  assert code == 0, err
  assert ("the checkpoint's window_pattern 'local,global,global' has 3 entries for its 2 layers; the layers used the "
          "first 2, so it is read as 'local,global'") in err


def test_a_damaged_checkpoint_process_0_cannot_set_aside_stops_every_process(tmp_path, monkeypatch):
  """newest_intact: process 0 looks and sets aside, the others wait for its answer; where it fails (the rename
  refused), it sends the failure, and every process raises it instead of waiting for a step that never comes."""
  ckpts = checkpoint.Checkpoints(str(tmp_path / "c"))
  os.makedirs(tmp_path / "c" / "5")  # an emptied step folder: set aside before the search goes on
  ckpts.close()
  def refuse(directory, step):
    raise OSError(30, "Read-only file system")
  monkeypatch.setattr(stepdirs, "set_aside", refuse)
  me = _as_processes(monkeypatch)
  raised = []
  for me["index"] in (0, 1):
    with pytest.raises((OSError, checkpoint.CheckpointError)) as e:
      ckpts.newest_intact()
    raised.append(str(e.value))
  assert raised[0] == raised[1] == "[Errno 30] Read-only file system", raised


def test_a_batch_whose_kv_cache_exceeds_the_device_is_refused_before_it_is_made(trained, monkeypatch, capsys):
  """--batch 1000000 of the tiny model on a CPU: XLA took host memory as it touched it and the OS killed the sampler
  (SIGKILL, no message) after a minute; the cache's size is known before anything is allocated."""
  if jax.default_backend() != "cpu":
    pytest.skip("the device's own memory is read on a GPU")
  monkeypatch.setattr(sample_cli.device, "host_memory", lambda field="MemAvailable": 2**20)
  monkeypatch.setattr(sample_cli, "generate", lambda *a, **k: pytest.fail("generated"))
  code, _, err = sample_main(["--ckpt-dir", str(trained[1]), "--batch", "64", "--tokens", "2"], capsys)
  assert code == 2 and "error: --batch 64: the KV cache alone needs about 2 MiB (2 layers' keys and values, 64 rows " \
                        "of 32 positions), more than the 1 MiB cpu has: lower --batch, or --tokens" in err, err
