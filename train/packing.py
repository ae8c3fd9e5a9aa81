"""Packed batches: documents end to end in rows, each token told its document and its position.

Unpacked batches are windows cut out of single texts, so a text shorter than a window is
never trained on and a window never shows where a text begins. Packing trains on every token
of every document: documents are laid end to end, each closed by its separator token, into
one stream per source (all text files; each GPT-2 shard), and the stream is cut into rows.

Row r of a stream holds its tokens rT .. rT + T (T = seq_len): inputs rT .. rT + T - 1 and
targets one later. Rows overlap by one token (the last target of one row is the first input
of the next), so the inputs of rows 0, 1, 2, ... are the stream itself and every token is
the target of exactly one row: no token is lost and none is padding. The stream's last
(len - 1) % T tokens, less than a row, are not used.

Every target is trained, the one after a separator too: the separator (last token of its
document) predicts the next document's first token, from its own document only, which
teaches how documents begin, as nanoGPT's training on end-of-text -> next document does.
With no padding and no target left out, the loss is the plain mean, as in unpacked batches.

Each input token gets (both int32 (B, T)):
  segment_ids  1, 2, 3, ... for the documents of its row, in order; a document cut at a row
               boundary continues in the next row as that row's segment 1.
  positions    its offset from the start of its segment: 0 where a document starts, and 0 at
               the row's first token (a continued document, like an unpacked window, starts
               its row at position 0; positions stay below T, inside the position table).

Step s of a run takes the rows s*B .. s*B + B - 1 of a shuffled order of all rows, a new
order each epoch drawn from (seed, epoch): batches depend only on (seed, step), so a resumed
run sees what the uninterrupted run saw, and each epoch trains every row once.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

BYTE_SEPARATOR = 0  # closes each text of a byte corpus: NUL, which text files do not hold (from_texts: if one does)
GPT2_EOT = 50256  # GPT-2's <|endoftext|>, already between the documents of a token shard


@dataclasses.dataclass(frozen=True, eq=False)
class Packed:
  streams: tuple[np.ndarray, ...]  # 1-d token arrays, documents end to end, each closed by its separator
  starts: tuple[np.ndarray, ...]  # per stream: increasing offsets where its documents start, the first 0
  seq_len: int  # T: inputs per row

  @functools.cached_property
  def row_ends(self) -> np.ndarray:
    """Cumulative rows over the streams: stream i holds rows row_ends[i-1] .. row_ends[i] - 1."""
    return np.cumsum([max(0, (len(s) - 1) // self.seq_len) for s in self.streams])

  @property
  def n_rows(self) -> int:
    return int(self.row_ends[-1]) if len(self.row_ends) else 0

  def max_segments(self) -> int:
    """The most documents any row holds (a document cut by a row's start counts in that row too)."""
    most = 0
    for i, starts in enumerate(self.starts):
      n = int(self.row_ends[i] - (self.row_ends[i - 1] if i else 0))
      first = np.arange(n, dtype=np.int64) * self.seq_len  # (rows,) each row's first input offset
      inside = np.searchsorted(starts, first + self.seq_len) - np.searchsorted(starts, first, side="right")
      most = max(most, int(inside.max(initial=0)) + 1)
    return most

  def rows(self, ids) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(inputs, targets, segment_ids, positions) of rows `ids` (global row numbers), each int32 (len(ids), T)."""
    T = self.seq_len
    out = np.zeros((4, len(ids), T), np.int32)
    for b, r in enumerate(np.asarray(ids)):
      i = int(np.searchsorted(self.row_ends, r, side="right"))  # the stream holding row r
      first = (int(r) - (int(self.row_ends[i - 1]) if i else 0)) * T  # its first input's offset
      tokens = self.streams[i][first:first + T + 1]
      p = first + np.arange(T)  # (T,) stream offsets of the inputs
      doc = np.searchsorted(self.starts[i], p, side="right") - 1  # (T,) document of each input
      out[:, b] = tokens[:-1], tokens[1:], doc - doc[0] + 1, p - np.maximum(self.starts[i][doc], first)
    return tuple(out)

  def batch(self, seed: int, step: int, batch_size: int) -> tuple[np.ndarray, ...]:
    """Step `step`'s rows (B = batch_size): (inputs, targets, segment_ids, positions), each int32 (B, T)."""
    g = step * batch_size + np.arange(batch_size)  # (B,) places in the sequence of epochs
    epochs, place = np.divmod(g, self.n_rows)
    ids = [_order(seed, int(e), self.n_rows)[k] for e, k in zip(epochs, place)]
    return self.rows(ids)


@functools.lru_cache(maxsize=4)
def _order(seed: int, epoch: int, n_rows: int) -> np.ndarray:
  """The rows of epoch `epoch` in the order they are trained."""
  return np.random.default_rng([seed, 2, epoch]).permutation(n_rows)  # 2: not a split of data.Dataset.batch


def from_texts(texts: list[np.ndarray], seq_len: int) -> Packed:
  """Texts (1-d uint8 arrays) as documents of one stream, each followed by BYTE_SEPARATOR; empty ones skipped.

  Document starts come from the texts' lengths, never from looking for separators, so a text
  that holds a NUL byte stays one document."""
  texts = [t for t in texts if len(t)]
  stream = np.concatenate([np.append(t, np.uint8(BYTE_SEPARATOR)) for t in texts] or [np.zeros(0, np.uint8)])
  starts = np.concatenate([[0], np.cumsum([len(t) + 1 for t in texts])[:-1]]).astype(np.int64)
  return Packed((stream,), (starts,), seq_len)


def from_shards(shards: list[np.ndarray], seq_len: int) -> Packed:
  """GPT-2 token shards as streams; a document ends with (and includes) each GPT2_EOT."""
  starts = []
  for s in shards:
    after = np.flatnonzero(s == GPT2_EOT) + 1
    starts.append(np.concatenate([[0], after[after < len(s)]]).astype(np.int64))
  return Packed(tuple(shards), tuple(starts), seq_len)
