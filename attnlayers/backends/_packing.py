"""Segment ids as the fused kernels' packed (THD) layout wants them: one run per document.

TransformerEngine's packed descriptor (SequenceDescriptor.from_segment_ids_and_pos) counts a
segment's tokens by id value and finds its start as a change of id, so it needs each
document to be one contiguous run and ids that increase along the row. attnlayers' rule
(spec.py) takes any ids; `runs` relabels a row's runs 1, 2, 3, ... and says which rows the
packed layout can hold exactly: those where each id forms one run (a document split by
padding or by another document is two runs there, so its halves would not see each other)
and that hold at most max_segments runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attnlayers.spec import run_starts


def runs(ids, max_segments: int):
  """ids (B, L) int -> (run id (B, L): 1, 2, ... per run, 0 padding; position in its run (B, L);
  ok (B,): each of the row's ids forms one run, and it holds <= max_segments runs)."""
  ids = jnp.asarray(ids, jnp.int32)  # (B, L)
  start = run_starts(ids)  # (B, L) first token of a run
  rid = jnp.where(ids != 0, jnp.cumsum(start, axis=1, dtype=jnp.int32), 0)
  t = jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :]  # (1, L)
  first = jax.lax.cummax(jnp.where(start, t, 0), axis=1)  # (B, L) where the current run started
  pos = jnp.where(ids != 0, t - first, 0)
  srt = jnp.sort(ids, axis=1)  # (B, L): each distinct id once as a change of value
  distinct = jnp.sum((srt != 0) & (srt != jnp.pad(srt[:, :-1], ((0, 0), (1, 0)))), axis=1)  # (B,)
  runs_per_row = jnp.max(rid, axis=1)  # (B,)
  ok = (distinct == runs_per_row) & (runs_per_row <= max_segments)
  return rid, pos, ok


def check_concrete(ok, what: str) -> None:
  """Raises for rows that are not `ok` when the ids were known (not traced); traced rows become NaN (poison)."""
  if isinstance(ok, jax.core.Tracer):
    return
  bad = np.flatnonzero(~np.asarray(ok))
  if bad.size:
    raise ValueError(f"segment_ids rows {bad[:5].tolist()} cannot run on {what}: its packed layout needs each "
                     "document to be one run of its id (any order and gaps; padding 0 between documents is "
                     "fine), and at most max_segments runs per row; "
                     "backend='xla' takes any ids")


def poison(out, ok):
  """out (B, T, N, H) with the rows that are not `ok` NaN."""
  return jnp.where(ok[:, None, None, None], out, jnp.full((), jnp.nan, out.dtype))
