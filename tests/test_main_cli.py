"""`python -m attnlayers`: every flag is checked before any work (one line, exit code 2, what was wrong and what
would work) and says in --help what it does and its default."""

import re

import pytest

from attnlayers import __main__ as cli


@pytest.mark.parametrize("args, message", [
    (["--heads", "8", "--kv-heads", "3"], "num_heads N (8) must be divisible by num_kv_heads K (3): use K = N (MHA)"),
    (["--kv-heads", "0"], "argument --kv-heads: must be >= 1, got 0"),
    (["--seq-len", "0"], "argument --seq-len: must be >= 1, got 0"),
    (["--batch", "-1"], "argument --batch: must be >= 1, got -1"),
    (["--heads", "0"], "argument --heads: must be >= 1, got 0"),
    (["--head-dim", "0"], "argument --head-dim: must be >= 1, got 0"),
    (["--batch", "two"], "argument --batch: expected an integer, got 'two'"),
    (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
], ids=["heads-not-divisible", "kv-heads-0", "seq-len-0", "batch-negative", "heads-0", "head-dim-0", "batch-word",
        "dtype"])
def test_a_bad_flag_is_one_line_and_exit_2_before_any_work(args, message, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(args)
  out, err = capsys.readouterr()
  assert e.value.code == 2, err
  assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err
  assert out == ""  # nothing ran: not even the header


def test_the_shape_error_names_the_flags_behind_the_letters(capsys):
  with pytest.raises(SystemExit):
    cli.main(["--heads", "8", "--kv-heads", "3"])
  err = capsys.readouterr().err
  assert "N --heads" in err and "K --kv-heads" in err, err


def test_every_flag_says_what_it_does_and_its_default(capsys, monkeypatch):
  monkeypatch.setenv("COLUMNS", "1000")  # no wrapped help text
  with pytest.raises(SystemExit) as e:
    cli.main(["--help"])
  assert e.value.code == 0
  flags, flag = {}, None
  for line in capsys.readouterr().out.split("options:")[1].splitlines():
    if m := re.match(r"  (?:-\w, )?(--[\w-]+)(?: \S+)?(?:\s{2,}(.*))?$", line):  # a flag, its help on the line or the next
      flag, flags[m.group(1)] = m.group(1), m.group(2) or ""
    elif flag and line.strip():
      flags[flag] += " " + line.strip()
  assert set(flags) == {"--help", "--batch", "--seq-len", "--heads", "--kv-heads", "--head-dim", "--dtype",
                        "--no-causal", "--show-kernels"}, flags
  assert all(text.strip() for text in flags.values()), flags
  defaults = {"--batch": 2, "--seq-len": 256, "--heads": 8, "--kv-heads": 2, "--head-dim": 64, "--dtype": "bfloat16"}
  for flag, value in defaults.items():
    assert f"(default: {value})" in flags[flag], (flag, flags[flag])


def test_a_good_shape_still_runs_every_backend(capsys):
  cli.main(["--batch", "1", "--seq-len", "8", "--heads", "4", "--kv-heads", "1", "--head-dim", "8", "--dtype",
            "float32"])
  out = capsys.readouterr().out
  assert re.search(r"^\s+xla\s+ok", out, flags=re.M) and re.search(r"^\s+naive\s+ok", out, flags=re.M), out
