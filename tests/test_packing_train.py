"""Packed documents and sliding windows in the data, the GPT and the trainer (issue 12), on a CPU.

The rows packing makes (hand-built corpora with known answers, and the standard-library
corpus whole), the model on a packed row against each document alone, the model's window
against an explicit mask, decoding with a window, and the trainer: flags, resume checks,
and one short packed, windowed run that python -m sample then samples from.
"""

import contextlib
import io
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlayers
import models
from models.generate import generate
from tests import reference
from tests.test_generate import GREEDY, forward, greedy_by_recomputation
from tests.test_generate import config as generate_config
from tests.test_generate import model as wandering_model
from sample import cli as sample_cli
from train import checkpoint, cli, data, packing, reader, report

TINY = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "8", "--no-progress", "--log-every", "1"]
T = 4


def texts(*docs: bytes) -> list[np.ndarray]:
  return [np.frombuffer(d, np.uint8) for d in docs]


def as_bytes(row) -> bytes:
  return bytes(np.asarray(row, np.uint8))


# --- the rows


def test_segments_and_positions_at_document_boundaries():
  p = packing.from_texts(texts(b"abc", b"defgh", b"ij", b"klmnopqrstu"), T)  # stream: abc0defgh0ij0klmnopqrstu0
  x, y, seg, pos = p.rows(range(4))
  assert [as_bytes(r) for r in x] == [b"abc\0", b"defg", b"h\0ij", b"\0klm"]
  assert [as_bytes(r) for r in y] == [b"bc\0d", b"efgh", b"\0ij\0", b"klmn"]  # the separator's target: next doc's first
  np.testing.assert_array_equal(seg, [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 2, 2], [1, 2, 2, 2]])
  np.testing.assert_array_equal(pos, [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 0, 1], [0, 0, 1, 2]])
  assert all(a.dtype == np.int32 for a in (x, y, seg, pos))


def test_shard_documents_end_with_their_end_of_text_token():
  eot = packing.GPT2_EOT
  p = packing.from_shards([np.array([5, 6, eot, 7, eot, 8, 9, 10, 11], np.uint16)], T)
  x, y, seg, pos = p.rows(range(p.n_rows))
  np.testing.assert_array_equal(x, [[5, 6, eot, 7], [eot, 8, 9, 10]])
  np.testing.assert_array_equal(y, [[6, eot, 7, eot], [8, 9, 10, 11]])
  np.testing.assert_array_equal(seg, [[1, 1, 1, 2], [1, 2, 2, 2]])
  np.testing.assert_array_equal(pos, [[0, 1, 2, 0], [0, 0, 1, 2]])


def test_rows_reproduce_the_stream_with_every_document_short_ones_too():
  ds = data.load(None, 256, pack=True)
  files = [np.fromfile(f, np.uint8) for i, f in enumerate(data.stdlib_files()) if i % 10 != 9]
  assert min(len(f) for f in files) <= 256  # a file the unpacked mode drops (it needs > seq_len + 1 bytes)
  stream = np.concatenate([np.append(f, np.uint8(packing.BYTE_SEPARATOR)) for f in files])
  np.testing.assert_array_equal(ds.packed.streams[0], stream)
  x, y, seg, pos = ds.packed.rows(range(ds.packed.n_rows))
  n = ds.packed.n_rows * 256
  assert len(stream) - n <= 256  # less than a row left over
  np.testing.assert_array_equal(x.reshape(-1), stream[:n])  # the inputs, row after row, are the stream
  np.testing.assert_array_equal(y.reshape(-1), stream[1:n + 1])  # every token is one target
  starts = np.flatnonzero(pos.reshape(-1) == 0)  # a document start or a row start, nothing else
  assert set(starts) == set(range(0, n, 256)) | set(ds.packed.starts[0][ds.packed.starts[0] < n])
  assert (np.diff(seg, axis=1) >= 0).all() and (seg[:, 0] == 1).all()
  assert ds.packed.max_segments() == seg.max()  # the bound the kernels get: the most documents in any row


def test_max_segments_counts_the_documents_of_the_fullest_row():
  p = packing.from_texts(texts(b"abc", b"defgh", b"ij", b"klmnopqrstu"), T)
  seg = p.rows(range(p.n_rows))[2]
  assert p.max_segments() == seg.max() >= 2
  shards = packing.from_shards([np.array([5, 50256, 7, 50256, 8, 50256, 9, 10, 11, 12], np.uint16)] * 2, 4)
  assert shards.max_segments() == shards.rows(range(shards.n_rows))[2].max()


def test_packed_batches_depend_only_on_seed_and_step():
  ds = data.load(None, 32, pack=True)
  same = [ds.packed_batch(3, 7, 8), data.load(None, 32, pack=True).packed_batch(3, 7, 8)]
  for a, b in zip(*same):
    np.testing.assert_array_equal(a, b)
  assert not np.array_equal(ds.packed_batch(3, 8, 8)[0], same[0][0])
  assert not np.array_equal(ds.packed_batch(4, 7, 8)[0], same[0][0])
  np.testing.assert_array_equal(ds.batch("val", 3, 7, 8, 32)[0], data.load(None, 32).batch("val", 3, 7, 8, 32)[0])


def test_an_epoch_trains_every_row_once():
  p = packing.from_texts(texts(b"abc", b"defgh", b"ij", b"klmnopqrstu"), T)  # 6 rows
  seen = np.concatenate([p.batch(0, step, 3)[0] for step in (0, 1)])
  assert sorted(map(as_bytes, seen)) == sorted(map(as_bytes, p.rows(range(6))[0]))


# --- the model


def small(backend="xla", **overrides) -> models.GPTConfig:
  return models.GPTConfig(**{"vocab_size": 256, "seq_len": 24, "n_layer": 2, "n_head": 4, "n_kv_head": 2,
                             "d_model": 32, "dtype": "float32", "backend": backend} | overrides)


@pytest.mark.parametrize("window", [None, 3], ids=["full", "window-3"])
def test_a_packed_row_computes_what_each_document_computes_alone(window):
  cfg = small(window=window)
  m = models.GPT(cfg, rngs=nnx.Rngs(0))
  docs = [bytes(np.random.default_rng(i).integers(1, 256, n, np.uint8)) for i, n in enumerate((5, 9, 4, 30))]
  x, _, seg, pos = packing.from_texts(texts(*docs), cfg.seq_len).rows([0])  # 6 + 10 + 5 + the first 3 of 31
  packed = m(jnp.asarray(x), segment_ids=jnp.asarray(seg), positions=jnp.asarray(pos))[0]  # (T, V)
  for s in np.unique(seg):
    where = np.flatnonzero(seg[0] == s)
    alone = m(jnp.asarray(x[:, where]))[0]  # the document's tokens in a row of their own, positions 0...
    reference.assert_close(packed[where], alone, jnp.float32, what=f"segment {s} of {seg[0].tolist()}")


def with_explicit_masks(m: models.GPT, tokens, masks):
  """The model's steps written out, each block's attention given masks[i] ((T, S) bool) instead of its own."""
  x = m.wte(tokens) + m.wpe(jnp.arange(tokens.shape[1])[None])  # (B, T, D)
  for block, mask in zip(m.blocks, masks):
    a, h = block.attn, block.ln1(x)
    x = x + a.out(attnlayers.attention(a.query(h), a.key(h), a.value(h), backend="naive", mask=mask))
    x = x + block.proj(jax.nn.gelu(block.fc(block.ln2(x))))
  return jnp.einsum("btd,vd->btv", m.ln_f(x), m.wte.embedding[...])  # (B, T, V)


@pytest.mark.parametrize("pattern", ["local", "local,global", "global,local"])
def test_window_equals_an_explicit_mask_on_the_layers_it_names(pattern):
  m = models.GPT(small(window=5, window_pattern=pattern), rngs=nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 24)))
  t, s = np.arange(24)[:, None], np.arange(24)[None]
  window, causal = (t - 5 < s) & (s <= t), s <= t  # a window of 5: the query and the 4 before it
  masks = [window if kind == "local" else causal for kind in (pattern.split(",") * 2)[:2]]
  reference.assert_close(m(tokens), with_explicit_masks(m, tokens, masks), jnp.float32, what=pattern)
  assert not np.allclose(m(tokens), with_explicit_masks(m, tokens, [causal, causal]), atol=1e-4)


@pytest.mark.parametrize("window", [True, np.True_, 0, 2.0], ids=["True", "numpy-True", "0", "2.0"])
def test_window_must_be_a_positive_int(window):
  with pytest.raises(ValueError, match=f"window must be an int >= 1 .*; got {window!r}"):
    small(window=window)


def test_window_takes_a_numpy_int():
  """window=np.int64(5) was refused as 'not an int >= 1' (attnlayers.spec.is_integer takes numpy's ints)."""
  assert small(window=np.int64(5)).layer_window(0) == small(window=5).layer_window(0) == (4, 0)


def test_a_numpy_int_window_is_recorded_as_json_takes_it():
  """A checkpoint records architecture() as JSON (orbax's JsonSave): window=np.int64(8), taken since is_integer,
  trained its steps and then failed at the first save with 'Object of type int64 is not JSON serializable'."""
  arch = small(window=np.int64(8)).architecture()
  assert json.dumps(arch) == json.dumps(small(window=8).architecture()) and type(arch["window"]) is int


def test_a_window_that_covers_the_context_is_plain_causal_attention():
  cfg = small(window=24)
  assert [cfg.layer_window(i) for i in range(2)] == [None, None]
  assert small(window=23).layer_window(0) == (22, 0)
  tokens = jnp.arange(24)[None]
  windowed, plain = models.GPT(cfg, rngs=nnx.Rngs(0)), models.GPT(small(), rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(windowed(tokens), plain(tokens))


def test_cached_decoding_with_a_window_equals_recomputation():
  m = wandering_model(generate_config(window=6, window_pattern="local,global"))
  prompt = np.array([5, 9, 2, 40, 33, 17, 8])
  got = generate(m, [prompt], max_new_tokens=12, sampling=GREEDY).tokens[0]
  assert got.tolist() == greedy_by_recomputation(forward(m), prompt, 12)


def test_model_refuses_packing_arguments_it_cannot_use():
  m = models.GPT(small(), rngs=nnx.Rngs(0))
  tokens = jnp.zeros((1, 8), jnp.int32)
  with pytest.raises(ValueError, match=r"positions must lie in \[0, seq_len=24\); got values in \[0, 28\]"):
    m(tokens, positions=jnp.arange(0, 32, 4)[None])
  with pytest.raises(ValueError, match=r"segment_ids must be an int array of the tokens' shape \(B, T\) = \(1, 8\)"):
    m(tokens, segment_ids=jnp.ones((1, 7), jnp.int32))
  m.init_cache(1, 8)
  with pytest.raises(ValueError, match="segment_ids= and positions= apply without decode"):
    m(tokens, decode=True, segment_ids=jnp.ones((1, 8), jnp.int32))


# --- the trainer


# Bad --pack / --window flags exit 2 before any work: tests/test_train_faults.py BAD_FLAGS.


@pytest.mark.parametrize("pattern, windows", [("local", [(7, 0)]), ("local,global", [(7, 0), None])])
def test_the_backend_check_sees_segment_ids_and_every_layer_window(pattern, windows):
  plans = report.attention_plans(models.preset("tiny", window=8, window_pattern=pattern), 8, pack=True)
  assert [p.call.window for p in plans] == windows and all(p.call.segments and p.ok for p in plans)
  assert not report.attention_plans(models.preset("tiny"), 8, pack=False)[0].call.segments


@pytest.fixture(scope="module")
def packed_run(tmp_path_factory):
  """python -m train --pack --window 8, 3 steps, evaluated and sampled at the end, in this process: (ckpt folder,
  stdout, metrics)."""
  d = tmp_path_factory.mktemp("packed")
  args = [*TINY, "--pack", "--window", "8", "--steps", "3", "--eval-every", "3", "--sample-tokens", "8",
          "--ckpt-dir", str(d / "c"), "--metrics", str(d / "m.jsonl")]
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    cli.main(args)  # exits through SystemExit on any failure
  return d / "c", out.getvalue(), [json.loads(line) for line in open(d / "m.jsonl")]


def test_packed_windowed_run_trains_evaluates_and_samples(packed_run):
  _, out, rows = packed_run
  steps, summary = [r for r in rows if "step" in r], rows[-1]
  assert rows[0]["event"] == "start" and summary["event"] == "summary", rows
  assert [r["step"] for r in steps] == [1, 2, 3] and "val_loss" in steps[-1], rows
  assert np.isfinite([r["loss"] for r in steps]).all() and summary["tokens_per_s"] > 0
  assert "sample:\n" in out and ", window 8" in out.splitlines()[0], out  # the model line


def test_python_m_sample_rebuilds_the_window(packed_run, capsys):
  restored = sample_cli.restore(str(packed_run[0]), "auto")
  assert restored.model.cfg.window == 8 and restored.model.blocks[0].attn.sliding_window == (7, 0)
  with contextlib.redirect_stdout(io.StringIO()):
    sample_cli.main(["--ckpt-dir", str(packed_run[0]), "--prompt", "def ", "--tokens", "4"])


@pytest.mark.parametrize("flags, difference", [
    (["--no-pack", "--window", "8"],
     "pack: checkpoint True, now False (python -m train sets it with --pack / --no-pack)"),
    (["--pack"], "model.window: checkpoint 8, now None"),
    (["--pack", "--window", "4"], "model.window: checkpoint 8, now 4"),
    (["--pack", "--window", "8", "--window-pattern", "local,global"],
     "model.window_pattern: checkpoint 'local', now 'local,global'"),
], ids=["unpacked", "no-window", "other-window", "other-pattern"])
def test_resume_with_other_packing_or_window_is_refused(packed_run, flags, difference, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main([*TINY, "--steps", "4", "--allow-change", "steps", "--ckpt-dir", str(packed_run[0]), *flags])
  err = capsys.readouterr().err
  assert e.value.code == 2 and "cannot resume" in err and difference in err, err
  assert "--allow-change pack" not in err and "--allow-change window" not in err


def test_window_pattern_defaults_to_none_every_layer_local():
  """None (the default) puts the window on every layer and is recorded as "local", what checkpoints recorded when
  "local" was the default; now the model tells a pattern given without a window from the default, and refuses it
  (python -m train refused --window-pattern local without --window on its own)."""
  cfg = small(window=5)
  assert cfg.window_pattern is None and [cfg.layer_window(i) for i in range(2)] == [(4, 0), (4, 0)]
  assert cfg.architecture()["window_pattern"] == "local" and "window_pattern" not in small().architecture()
  with pytest.raises(ValueError, match="window_pattern 'local' says which layers use the window; give window"):
    small(window_pattern="local")


# What python -m train --preset tiny --seq-len 32 --window 8 recorded when window_pattern defaulted to "local"
OLD_DEFAULT_MODEL = {"vocab_size": 256, "seq_len": 32, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 128,
                     "mlp_ratio": 4, "param_dtype": "float32", "tie_embeddings": True, "bias": True, "window": 8,
                     "window_pattern": "local"}


def test_a_checkpoint_of_the_old_default_pattern_resumes_and_samples(packed_run, tmp_path, monkeypatch, capsys):
  """A checkpoint written before window_pattern defaulted to None records "local" for it: a run without
  --window-pattern resumes it, and python -m sample rebuilds its window on every layer."""
  now = {"model": models.preset("tiny", seq_len=32, window=8).architecture(), "seed": 0, "pack": True}
  assert checkpoint.check_meta(str(tmp_path), 3, now | {"model": OLD_DEFAULT_MODEL}, now) == {}
  read = reader.Reader.meta

  def old_record(self, step):  # python -m sample reads the old record, as it was written
    return read(self, step) | {"model": OLD_DEFAULT_MODEL}
  monkeypatch.setattr(reader.Reader, "meta", old_record)
  restored = sample_cli.restore(str(packed_run[0]), "auto")
  assert restored.model.cfg.window_pattern == "local"
  assert [b.attn.sliding_window for b in restored.model.blocks] == [(7, 0), (7, 0)]
  monkeypatch.undo()
  folder = tmp_path / "c"
  shutil.copytree(packed_run[0], folder)  # this trainer's checkpoint records the same model (asserted next)
  with reader.Reader(str(folder)) as read:
    assert read.meta(3)["model"] == OLD_DEFAULT_MODEL
  cli.main([*TINY, "--pack", "--window", "8", "--steps", "4", "--allow-change", "steps", "--eval-every", "0",
            "--sample-tokens", "0", "--ckpt-dir", str(folder)])
  assert f"resumed from {folder} at step 3" in capsys.readouterr().out
  with reader.Reader(str(folder)) as read:
    assert read.newest_intact() == 4


def test_a_checkpoint_from_before_packing_resumes_unpacked_only(tmp_path):
  old = {"model": {"n_layer": 2}, "seed": 0, "data": "python-stdlib", "run": {"lr": 1.0}}  # no "pack" key
  assert checkpoint.check_meta(str(tmp_path), 5, old, old | {"pack": False}) == {}
  with pytest.raises(checkpoint.ResumeMismatchError, match="pack: checkpoint False, now True"):
    checkpoint.check_meta(str(tmp_path), 5, old, old | {"pack": True})


def _shard(path, tokens) -> None:
  header = np.zeros(256, np.int32)
  header[:3] = data.SHARD_MAGIC, 1, len(tokens)
  path.write_bytes(header.tobytes() + np.asarray(tokens, np.uint16).tobytes())


@pytest.mark.parametrize("source", ["folder", "shards"])
def test_a_packed_runs_recorded_content_covers_the_short_documents_it_trains_on(tmp_path, source):
  """A packed run also trains on texts (files, shards) of seq_len + 1 tokens or fewer, which Dataset.content's token
  counts leave out (they count the texts unpacked windows use); its sha256 covers each file's size and first and
  last MiB, which is the whole of every such text: one changed, even to the same size, changes the content, so a
  resume on it is refused (checkpoint.check_meta compares it). Passed before anything changed: it pins that."""
  seq_len = 32
  if source == "folder":  # 10 files: the last held out; file 3 is short (10 bytes)
    for i in range(10):
      (tmp_path / f"{i}.txt").write_bytes(bytes([97 + i]) * (10 if i == 3 else 200))
    spec, short, edit = str(tmp_path), tmp_path / "3.txt", lambda b: b[:5] + b"Z" + b[6:]
  else:  # a short training shard (12 tokens), a long one, and the held-out one
    _shard(tmp_path / "a_train.bin", np.arange(12))
    _shard(tmp_path / "b_train.bin", np.arange(300) % 1000)
    _shard(tmp_path / "c_val.bin", np.arange(300) % 1000)
    spec, short = str(tmp_path / "*.bin"), tmp_path / "a_train.bin"
    edit = lambda b: b[:-2] + np.uint16(999).tobytes()
  before = data.load(spec, seq_len, pack=True)
  recorded = before.content()
  trained = b"".join(as_bytes(s) if source == "folder" else s.tobytes() for s in before.packed.streams)
  body = short.read_bytes()[0 if source == "folder" else 1024:]
  assert body in trained and not any(len(t) == len(body) // (1 if source == "folder" else 2) for t in before.train)
  short.write_bytes(edit(short.read_bytes()))
  after = data.load(spec, seq_len, pack=True)
  assert after.content()["train"] == recorded["train"]  # the counts see nothing
  assert after.content() != recorded  # the hash does
