"""Training data, all offline, with batches that depend only on (seed, step).

Sources (`--data`):
  (default)     the Python standard library's own .py files read as bytes: present on
                every machine, no download; every 10th file (sorted) is held out.
  PATH          a text file or a folder of text files (one holding python -m train's run
                folders or llm.c token shards is refused), byte-level (vocab 256); a
                folder splits by file like the default, a single file keeps its last 10%.
                A file that is mostly not text (not_text: an executable, compressed or
                random bytes) is refused unless load's raw_bytes (--data-raw-bytes) is set;
                a device, pipe or socket is refused. A single file is memory-mapped,
                several are read once into one array.
  'DIR/*.bin'   llm.c / modded-nanogpt GPT-2 token shards (256 x int32 header, magic
                20240520, version 1, token count; then uint16 tokens), memory-mapped.
                Files with 'val' in the name are held out; without any, the last shard is.
                Given the model's vocab_size, load reads every shard once and refuses ids
                that reach it (a model cannot embed them).

Batch b of step s is drawn from numpy's generator seeded with (seed, split, s), so a run
resumed at step s sees exactly the batches the uninterrupted run would have.

Unpacked (default): each row is a window of seq_len + 1 tokens inside one text (a shard
counts as one text), so texts of seq_len + 1 tokens or fewer are not used. Packed
(`load(..., pack=True)`, train.packing): every training document, short ones too, end to end
in rows with segment ids and positions.

Validation is the same unpacked held-out windows in both modes (`batch("val", ...)`): plain
causal windows inside held-out texts, as an unpacked run trains on. So the val_loss
of a packed and an unpacked run compare on identical tokens, it needs no segment ids (which
not every kernel takes), and a packed model meets nothing
there it did not train on: a window that starts inside a text at position 0 is what a packed
row's continued document is. It needs a held-out text longer than seq_len + 1 tokens, and it
does not score short documents or a document's first tokens. On GPT-2 shards the windows
cross end-of-text tokens unmasked, as only the unpacked run trained; weigh that there.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import itertools
import os
import shlex
import stat
import sysconfig
from collections.abc import Iterator

import numpy as np
from tqdm.auto import tqdm

from train import lock, packing, stepdirs
from train import tokenizers

DEFAULT_NAME = "python-stdlib"  # the default data's name (not a path)
CONTENT_MIB = 1 << 20  # bytes of each end of a file that Dataset.content hashes
SHARD_MAGIC = 20240520
SHARD_HEADER_INTS = 256
TEXT_SAMPLE = 1 << 16  # bytes read at a file's start, middle and end to tell text from other bytes
NOT_TEXT = 0.3  # the share of those bytes that are control bytes or invalid UTF-8 above which a file is not text
READ_CHUNK = 1 << 24  # bytes (or tokens) read at a time, so that a load's progress shows and its memory stays flat
PROGRESS_DELAY = 1.0  # seconds a load runs before its progress bar shows: small data loads without one
_CONTROL = np.ones(256, bool)  # the bytes text does not hold: C0 controls but tab, newlines, form feed, escape; DEL
_CONTROL[[8, 9, 10, 11, 12, 13, 27]] = False
_CONTROL[32:127] = _CONTROL[128:] = False


@dataclasses.dataclass
class Dataset:
  name: str  # for logs
  tokenizer: str  # what the token ids are: tokenizers.BYTES (text) or tokenizers.GPT2 (GPT-2 BPE shards)
  train: list[np.ndarray]  # 1-d token arrays (uint8 bytes or uint16 GPT-2 ids), each > seq_len + 1 long
  val: list[np.ndarray]  # as train, held out; windows of these give val_loss in both modes
  packed: packing.Packed | None = None  # every training document end to end (load(pack=True)); else None
  prompt_start: int = 0  # where in val[0] a sample's prompt starts: past the first newline when val[0] is cut mid-file
  files: tuple[str, ...] = ()  # the files read, in order

  @property
  def vocab_size(self) -> int:
    """The smallest model vocabulary that covers every token id: the tokenizer's."""
    return tokenizers.IDS[self.tokenizer]

  def batch(self, split: str, seed: int, step: int, batch_size: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), each (batch_size, seq_len) int32; targets are inputs shifted by one."""
    docs = self.train if split == "train" else self.val
    lengths = np.array([len(d) - seq_len - 1 for d in docs])
    rng = np.random.default_rng([seed, 0 if split == "train" else 1, step])
    which = rng.choice(len(docs), size=batch_size, p=lengths / lengths.sum())
    starts = rng.integers(0, lengths[which] + 1)
    rows = np.stack([docs[d][s:s + seq_len + 1] for d, s in zip(which, starts)]).astype(np.int32)
    return rows[:, :-1], rows[:, 1:]

  def content(self) -> dict:
    """What a checkpoint records of the data beside its path, so that other data under the same path (a file
    replaced, another Python's standard library) is noticed: the token counts of the training and held-out
    texts, and a sha256 over each file's size and first and last MiB (cheap for shards of gigabytes). The counts
    are of the texts unpacked windows use; the texts only a packed run trains on (files or shards of seq_len + 1
    tokens or fewer) fit in their first and last MiB for any seq_len below a million, so the hash covers each of
    them whole and sees their changes too (tests/test_packing_train.py)."""
    h = hashlib.sha256()
    for path in self.files:
      size = os.path.getsize(path)
      with open(path, "rb") as f:
        head = f.read(CONTENT_MIB)
        f.seek(max(0, size - CONTENT_MIB))
        for part in (size.to_bytes(8, "little"), head, f.read(CONTENT_MIB)):  # as one update, without a copy
          h.update(part)
    return {"train": sum(len(t) for t in self.train), "val": sum(len(t) for t in self.val), "sha256": h.hexdigest()}

  def packed_batch(self, seed: int, step: int, batch_size: int) -> tuple[np.ndarray, ...]:
    """The training split's packed rows of `step`: (inputs, targets, segment_ids, positions), each int32
    (batch_size, seq_len), a function of (seed, step) only (train.packing)."""
    if self.packed is None:
      raise ValueError(f"{self.name} was loaded unpacked; load it with pack=True for packed batches")
    return self.packed.batch(seed, step, batch_size)


def _usable(arrays: list[np.ndarray], seq_len: int) -> list[np.ndarray]:
  return [a for a in arrays if len(a) > seq_len + 1]


def _bar(total: int, desc: str, progress: bool):
  """A tqdm bar of `total` bytes for one step of a load, shown once the step runs past PROGRESS_DELAY."""
  return tqdm(total=total, desc=desc, unit="B", unit_scale=True, delay=PROGRESS_DELAY, disable=not progress,
              leave=False)


def _read_bytes(files: list[str], progress: bool) -> tuple[np.ndarray, list[np.ndarray]]:
  """The bytes of `files` end to end, and each file's as a view of them: a single file memory-mapped (read as
  windows need it), several read into one array in chunks under a progress bar, so that host memory holds the data
  once."""
  if len(files) == 1:
    one = np.memmap(files[0], dtype=np.uint8, mode="r") if os.path.getsize(files[0]) else np.zeros(0, np.uint8)
    return one, [one]
  sizes = [os.path.getsize(f) for f in files]
  buf, ends, at = np.empty(sum(sizes), np.uint8), [], 0
  with _bar(len(buf), "reading --data", progress) as bar:
    for path, size in zip(files, sizes):
      end = at + size
      with open(path, "rb") as f:
        while at < end and (got := f.readinto(memoryview(buf[at:min(end, at + READ_CHUNK)]))):
          at += got
          bar.update(got)
      ends.append(at)  # a file that shrank since its size was read ends where its bytes did
  return buf[:at], [buf[a:b] for a, b in zip([0, *ends[:-1]], ends)]


def _first_line(text: np.ndarray, end: int) -> int:
  """Where the first full line of text[:end] starts (past its first newline), 0 where it has none; read in small
  chunks, as a line is short and text may be memory-mapped."""
  for at in range(0, end, TEXT_SAMPLE):
    hits = np.flatnonzero(text[at:min(end, at + TEXT_SAMPLE)] == ord("\n"))
    if len(hits):
      return at + int(hits[0]) + 1
  return 0


def _split_bytes(name: str, files: list[str], seq_len: int, pack: bool, progress: bool = False) -> Dataset:
  stream, texts = _read_bytes(sorted(files), progress)
  if len(texts) >= 10:
    train = [t for i, t in enumerate(texts) if i % 10 != 9]
    val = [t for i, t in enumerate(texts) if i % 10 == 9]
    docs = train  # packed: the training files
  else:  # too few files to hold some out: keep the last 10% of the bytes
    cut = int(len(stream) * 0.9)
    train, val = [stream[:cut]], [stream[cut:]]
    docs = np.split(stream[:cut], [c for c in np.cumsum([len(t) for t in texts]) if c < cut])  # the files, cut
  packed = packing.from_texts(docs, seq_len) if pack else None
  if not (packed.n_rows if pack else _usable(train, seq_len)) or not _usable(val, seq_len):
    raise ValueError(_too_little(name, texts, train, val, seq_len, packed))
  train, val = _usable(train, seq_len), _usable(val, seq_len)
  # the last 10% of the bytes starts where the cut fell, often mid-word: prompts start at its first full line
  start = _first_line(val[0], len(val[0]) - seq_len // 2) if len(texts) < 10 else 0
  return Dataset(name, tokenizers.BYTES, train, val, packed, prompt_start=start, files=tuple(sorted(files)))


def _too_little(name: str, texts: list, train: list, val: list, seq_len: int, packed: packing.Packed | None) -> str:
  """Why `texts`, split into `train` and `val` (_split_bytes), are too short for seq_len, with the numbers, and what
  would fit: validation (unpacked in both modes) and unpacked training need a text longer than a window of
  seq_len + 1 bytes; packed training (`packed`) needs a row, seq_len + 1 bytes of its one stream."""
  by_file, window = len(texts) >= 10, seq_len + 1
  longest = lambda ts: max((len(t) for t in ts), default=0)
  problems = []
  if longest(val) <= window:
    problems.append(f"validation holds out every 10th file (sorted), and none is longer than {window} bytes (the "
                    f"longest has {longest(val)})" if by_file else
                    f"validation holds out the last 10% of the bytes, {longest(val)} here, and needs more than {window}")
  stream = len(packed.streams[0]) if packed else 0  # the training documents, each closed by a separator
  if packed and not packed.n_rows:
    problems.append(f"packed training needs {window} bytes in all, separators included, and has {stream}")
  elif not packed and longest(train) <= window:
    problems.append(f"no training file is longer than {window} bytes (the longest has {longest(train)})" if by_file
                    else f"training keeps the first 90%, {longest(train)} bytes, and needs more than {window}")
  fit = min(longest(val) - 2, stream - 1 if packed else longest(train) - 2)  # the largest --seq-len that works
  if by_file:
    more = "longer files"
  else:  # the fewest bytes whose last 10% (as cut above) is longer than a window; the first 90% then is too
    need = next(n for n in itertools.count(10 * window - 10) if n - int(n * 0.9) > window)
    more = f"at least {need} bytes in all"
  total = sum(len(t) for t in texts)
  return (f"{name}: {total} bytes in {len(texts)} file(s) is too little for --seq-len {seq_len}: "
          f"{'; '.join(problems)}. Give {more}" + (f", or --seq-len {fit} or less" if fit >= 1 else ""))


def read_shard(path: str) -> np.ndarray:
  """The uint16 tokens of one llm.c shard, memory-mapped; a clear error for a bad header."""
  with open(path, "rb") as f:
    header = np.frombuffer(f.read(SHARD_HEADER_INTS * 4), dtype=np.int32)
  if len(header) < 3 or header[0] != SHARD_MAGIC:
    got = int(header[0]) if len(header) else None
    raise ValueError(f"{path}: not an llm.c token shard: header magic {got}, expected {SHARD_MAGIC} "
                     "(256 int32 header: magic, version, token count; then uint16 tokens)")
  if header[1] != 1:
    raise ValueError(f"{path}: unsupported shard version {int(header[1])}; expected 1")
  n = int(header[2])
  size = os.path.getsize(path)
  if size != SHARD_HEADER_INTS * 4 + 2 * n:
    raise ValueError(f"{path}: header says {n} tokens ({SHARD_HEADER_INTS * 4 + 2 * n} bytes) but the file has {size} bytes")
  return np.memmap(path, dtype=np.uint16, mode="r", offset=SHARD_HEADER_INTS * 4, shape=(n,))


def _largest_ids(paths: list[str], progress: bool) -> list[int]:
  """The largest token id in each llm.c shard of `paths` (headers checked), read in chunks under a progress bar."""
  largest, sizes = [], [os.path.getsize(p) - SHARD_HEADER_INTS * 4 for p in paths]
  with _bar(sum(sizes), "checking --data's token ids", progress) as bar:
    for path in paths:
      top = 0
      with open(path, "rb") as f:
        f.seek(SHARD_HEADER_INTS * 4)
        while len(chunk := np.fromfile(f, dtype=np.uint16, count=READ_CHUNK // 2)):
          top = max(top, int(chunk.max()))
          bar.update(2 * len(chunk))
      largest.append(top)
  return largest


def _ids_outside(pattern: str, paths: list[str], largest: list[int], vocab_size: int) -> str:
  """Why the shards of `pattern` whose `largest` ids do not fit vocab_size are refused, naming them."""
  bad = [(p, m) for p, m in zip(paths, largest) if m >= vocab_size]
  named = "; ".join(f"{p} holds token id {m}" for p, m in bad[:3]) + ("; ..." if len(bad) > 3 else "")
  return (f"--data {pattern!r}: {len(bad)} shard(s) hold token ids outside --vocab-size {vocab_size} (ids 0 to "
          f"{vocab_size - 1}): {named}. A model cannot embed them (training would end in a non-finite loss): give "
          f"shards of GPT-2 tokens (ids below {tokenizers.GPT2_VOCAB}), or --vocab-size {max(largest) + 1} or larger")


def _shards(pattern: str, seq_len: int, pack: bool, vocab_size: int | None = None, progress: bool = False) -> Dataset:
  paths = sorted(glob.glob(pattern))
  if not paths:
    raise FileNotFoundError(f"--data {pattern!r} matches no files")
  shards = {p: read_shard(p) for p in paths}  # every header checked before anything else
  if vocab_size is not None and max(largest := _largest_ids(paths, progress)) >= vocab_size:
    raise ValueError(_ids_outside(pattern, paths, largest, vocab_size))
  val_paths = [p for p in paths if "val" in os.path.basename(p)] or paths[-1:]
  train_paths = [p for p in paths if p not in val_paths]
  if not train_paths:
    raise ValueError(f"--data {pattern!r}: {len(paths)} shard(s), none left for training after holding out "
                     f"{', '.join(val_paths)} for validation; give at least two shards")
  train_shards, val_shards = [shards[p] for p in train_paths], [shards[p] for p in val_paths]
  packed = packing.from_shards(train_shards, seq_len) if pack else None
  train, val = _usable(train_shards, seq_len), _usable(val_shards, seq_len)
  if not (packed.n_rows if pack else train) or not val:
    raise ValueError(_shards_too_short(pattern, train_shards, val_shards, seq_len, pack))
  return Dataset(pattern, tokenizers.GPT2, train, val, packed, files=tuple(paths))


def _shards_too_short(pattern: str, train: list[np.ndarray], val: list[np.ndarray], seq_len: int, pack: bool) -> str:
  """Why the shards of `pattern` are too short for seq_len, with their lengths, and the largest --seq-len that fits:
  validation (unpacked in both modes) and unpacked training need a shard longer than a window of seq_len + 1 tokens;
  packed training a row, seq_len + 1 tokens of one shard (packing.from_shards)."""
  window, longest_train, longest_val = seq_len + 1, max(map(len, train)), max(map(len, val))
  rule = f"a window needs a shard of more than {window} tokens" + (
      f" (validation's; packed training needs {window} tokens in one training shard)" if pack else "")
  fit = min(longest_val - 2, longest_train - 1 if pack else longest_train - 2)  # the largest --seq-len that works
  return (f"--data {pattern!r}: shards too short for --seq-len {seq_len}: {rule}, and the longest training shard has "
          f"{longest_train} tokens, the longest validation shard {longest_val}. Give longer shards"
          + (f", or --seq-len {fit} or less" if fit >= 1 else ""))


def stdlib_files() -> list[str]:
  root = sysconfig.get_paths()["stdlib"]
  return sorted(glob.glob(os.path.join(root, "*.py")))


def check_source(spec: str | None) -> None:
  """Raises FileNotFoundError where `spec` names nothing, ValueError where it names a device, pipe or socket (a
  stream without an end, or one that a second read finds empty: not data); cheap, so callers check it before other
  work."""
  if spec is not None and os.path.exists(spec) and not (os.path.isfile(spec) or os.path.isdir(spec)):
    mode = os.stat(spec).st_mode
    kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else
            "a pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
    raise ValueError(f"--data {spec!r} is {kind}, not a file of data: give a text file, a folder of text, or "
                     "'DIR/*.bin' token shards (to train on a stream, write it to a file first)")
  if spec is None or os.path.exists(spec) or (spec.endswith(".bin") and glob.glob(spec)):
    return
  if spec.endswith(".bin"):
    raise FileNotFoundError(f"--data {spec!r} matches no files")
  if os.path.islink(spec):  # exists() follows the link: its target is missing, or links lead back to it
    raise FileNotFoundError(f"--data {spec!r} is a symbolic link to {os.readlink(spec)!r}, which does not exist (or "
                            "leads back round to it): give the file or folder itself")
  if glob.has_magic(spec) and glob.glob(spec):
    raise FileNotFoundError(f"--data {spec!r} is a pattern, and a pattern reads llm.c token shards ('DIR/*.bin') "
                            f"only: give a text file, or the folder {os.path.dirname(spec) or '.'!r} to read every "
                            "file in it as text")
  raise FileNotFoundError(f"--data {spec!r}: no such file or folder (give a text file, a folder, or 'DIR/*.bin')")


def tokenizer(source: str) -> str:
  """The tokens of the data a checkpoint records as `source` (source(), or --data as typed): GPT-2 BPE for token
  shards (a pattern ending in .bin, as load tells them apart), else UTF-8 bytes."""
  return tokenizers.GPT2 if source.endswith(".bin") else tokenizers.BYTES


def source(spec: str | None) -> str:
  """--data as a checkpoint records it: DEFAULT_NAME, or the path with links and '..' resolved (a pattern's
  folder), so the same data given relative or absolute is one source."""
  if spec is None:
    return DEFAULT_NAME
  return os.path.join(os.path.realpath(os.path.dirname(spec)), os.path.basename(spec)) if spec.endswith(".bin") \
      else os.path.realpath(spec)


class Walk:
  """One walk of folder `spec` (_walk) for load and train.overlap to share, made where the first of them needs it
  and kept: a trainer's start-up gives one to its checks of the run's outputs (train.overlap, which train.cli and
  train.loop.run make) and to load, so that --data is walked once between them."""

  def __init__(self, spec: str | None):
    self.spec = spec  # --data, as load and train.overlap.read_by take it

  @functools.cached_property
  def found(self) -> list[tuple[str, list[str]]]:
    return list(_walk(self.spec))


def walked(spec: str, walk: Walk | None = None) -> list[tuple[str, list[str]]]:
  """(path, names) of each folder load reads under folder `spec` (_walk): what `walk` found, walked where not yet;
  a walk of its own where None. A Walk of other data is refused: its folders and files are not those of `spec`."""
  if walk is None:
    return list(_walk(spec))
  if walk.spec != spec:
    raise ValueError(f"a Walk of --data {walk.spec!r} was given for --data {spec!r}; give data.Walk({spec!r}), or none")
  return walk.found


def _walk(folder: str) -> Iterator[tuple[str, list[str]]]:
  """(path, names) of each folder load reads under `folder`, with the names in it that it may read (no name
  starting with "."; files, links and others): as glob's "**/*" walks (links followed), but each real folder once,
  under the first path that reaches it. glob walks every path: through a link back up the tree it reads each file
  many times over (into both training and validation), and through two such links it never ends."""
  walked = set()
  for top, dirs, names in os.walk(folder, followlinks=True):
    walked.add(os.path.realpath(top))
    dirs[:] = sorted(d for d in dirs if not d.startswith(".") and os.path.realpath(os.path.join(top, d)) not in walked)
    walked.update(os.path.realpath(os.path.join(top, d)) for d in dirs)  # each folder under one path only
    yield top, [n for n in names if not n.startswith(".")]


def _folder_files(folders: list[tuple[str, list[str]]]) -> list[str]:
  """The files a walk of a folder found (_walk), sorted, each once: a file reached by two paths is read by the first."""
  found = [os.path.join(top, n) for top, names in folders for n in names if os.path.isfile(os.path.join(top, n))]
  seen = set()
  return [p for p in sorted(found) if not (os.path.realpath(p) in seen or seen.add(os.path.realpath(p)))]


def _run_folders(files: list[str]) -> list[str]:
  """The folders among `files`' that python -m train wrote: a run folder (its lock file) or a checkpoint step
  (its manifest; the run folder is its parent)."""
  runs = {os.path.dirname(f) for f in files if os.path.basename(f) == lock.LOCK_NAME}
  runs |= {os.path.dirname(os.path.dirname(f)) for f in files if os.path.basename(f) == stepdirs.MANIFEST}
  return sorted(runs)


def _text_files(spec: str, walk: Walk | None) -> list[str]:
  """The files of folder `spec` (_folder_files of `walk`, or of a walk made now), refused where they are not all text:
  none, python -m train's run folders, or llm.c token shards (read as bytes, they would train on their header and
  uint16 halves)."""
  folders = walked(spec, walk)
  files = _folder_files(folders)
  if not files:
    others = sum(len(names) for _, names in folders)  # devices, pipes, sockets, links to nothing
    if others:
      raise ValueError(f"--data {spec!r} holds no files of data, only {others} device(s), pipe(s) or other "
                       "entries that are not files; put text files in it")
    raise ValueError(f"--data {spec!r} is an empty folder; put text files in it")
  runs = _run_folders(files)
  top = os.path.abspath(spec)
  if around := [r for r in runs if os.path.commonpath([os.path.abspath(r), top]) == os.path.abspath(r)]:
    raise ValueError(f"--data {spec!r} is python -m train's run folder {around[0]} or a checkpoint step in it "
                     "(checkpoints and logs, not text); give a folder of text files")
  if runs:
    raise ValueError(f"--data {spec!r} holds {len(runs)} python -m train run folder(s) ({', '.join(runs[:3])}"
                     f"{', ...' if len(runs) > 3 else ''}: checkpoints and logs, not text); they would be read as "
                     "training text. Give a folder that holds text only: move the run folders out of it, or "
                     "give a subfolder of it that has none")
  if shards := [f for f in files if _is_shard(f)]:
    raise ValueError(_shards_in_folder(spec, shards, len(files)))
  return files


def _is_shard(path: str) -> bool:
  """Whether `path` is an llm.c token shard, by its name and its first 4 bytes (read_shard's magic)."""
  if not path.endswith(".bin"):
    return False
  with open(path, "rb") as f:
    head = f.read(4)
  return len(head) == 4 and int(np.frombuffer(head, np.int32)[0]) == SHARD_MAGIC


def _shards_in_folder(spec: str, shards: list[str], n_files: int) -> str:
  """Why folder `spec`, whose `n_files` files include `shards`, is refused, and the pattern that reads the shards."""
  folders = sorted({os.path.dirname(s) for s in shards})
  patterns = " or ".join(f"--data {shlex.quote(os.path.join(d, '*.bin'))}" for d in folders[:3])
  others = n_files - len(shards)
  mixed = f" beside {others} other file(s)" if others else ""
  return (f"--data {spec!r} holds {len(shards)} llm.c token shard(s){mixed}: a folder is read as text (UTF-8 bytes), "
          f"so the shards' GPT-2 tokens would be trained on as bytes. To train on them as GPT-2 tokens give the quoted "
          f"pattern {patterns} (a pattern reads one folder's shards, not its subfolders)"
          + ("; for the text, a folder without the shards" if others else ""))


def not_text(path: str) -> float:
  """The share of `path`'s bytes, sampled at its start, middle and end (TEXT_SAMPLE each), that text does not hold:
  control bytes (_CONTROL) and bytes of invalid UTF-8. Text scores near 0, executables and random or compressed
  bytes about half or more."""
  size, bad, seen = os.path.getsize(path), 0, 0
  with open(path, "rb") as f:
    for at in sorted({0, max(0, size // 2 - TEXT_SAMPLE // 2), max(0, size - TEXT_SAMPLE)}):
      f.seek(at)
      chunk = f.read(TEXT_SAMPLE)
      invalid = chunk.decode("utf-8", "replace").count("\ufffd") - chunk.count("\ufffd".encode())
      bad, seen = bad + int(_CONTROL[np.frombuffer(chunk, np.uint8)].sum()) + invalid, seen + len(chunk)
  return bad / seen if seen else 0.0


def _check_text(spec: str, files: list[str]) -> None:
  """Refuses --data `spec` where any of its `files` is mostly not text (not_text above NOT_TEXT), naming them."""
  scores = [(f, not_text(f)) for f in files]
  bad = [(f, share) for f, share in scores if share > NOT_TEXT]
  if not bad:
    return
  raw = "or --data-raw-bytes to train on the bytes as they are"
  if len(files) == 1:
    raise ValueError(f"--data {spec!r} is mostly not text: {bad[0][1]:.0%} of the bytes sampled at its start, middle "
                     "and end are control bytes or invalid UTF-8 (an executable, compressed or random data?), and "
                     f"python -m train reads a file as UTF-8 text. Give a text file, {raw}")
  named = ", ".join(f"{f} ({share:.0%})" for f, share in bad[:3]) + (", ..." if len(bad) > 3 else "")
  raise ValueError(f"--data {spec!r} holds {len(bad)} file(s) that are mostly not text (the share of control bytes "
                   f"or invalid UTF-8 in their sampled bytes): {named}. Give a folder of text only, {raw}")


def load(spec: str | None, seq_len: int, pack: bool = False, walk: Walk | None = None, vocab_size: int | None = None,
         raw_bytes: bool = False, progress: bool = False) -> Dataset:
  """The data of `spec` (module docstring) for windows of seq_len.

  Args:
    spec: --data; None for the default.
    seq_len: the model's window.
    pack: also every training document packed (train.packing).
    walk: a folder's files as that Walk of `spec` found them (the one its caller checked the run's outputs with);
      None: walked now.
    vocab_size: token shards whose ids reach it are refused (every shard read once); None: not checked.
    raw_bytes: read files that are mostly not text (not_text) as bytes; False: refuse them.
    progress: show tqdm bars for steps of the load that run past PROGRESS_DELAY.
  """
  check_source(spec)
  if spec is None:
    return _split_bytes(DEFAULT_NAME, stdlib_files(), seq_len, pack, progress)
  if spec.endswith(".bin"):
    return _shards(spec, seq_len, pack, vocab_size, progress)
  if os.path.isdir(spec):
    files = _text_files(spec, walk)
    if not raw_bytes:
      _check_text(spec, files)
    return _split_bytes(spec, files, seq_len, pack, progress)
  if os.path.isfile(spec):
    if os.path.getsize(spec) == 0:
      with open(spec, "rb") as f:
        streamed = bool(f.read(1))
      raise ValueError(f"--data {spec!r} reports a size of 0 but holds bytes (a file of /proc or /sys, made as it "
                       "is read): copy it to a file first" if streamed else f"--data {spec!r} is empty")
    if not raw_bytes:
      _check_text(spec, [spec])
    return _split_bytes(spec, [spec], seq_len, pack, progress)
  raise FileNotFoundError(f"--data {spec!r}: no such file or folder (give a text file, a folder, or 'DIR/*.bin')")
