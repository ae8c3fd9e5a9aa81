"""Text generation with a KV cache: the prompt in one compiled call, the decode loop in another.

Re-running the whole window for every new token costs a forward pass over T tokens and a
Python dispatch per token. Here the prompt goes through the model once (`prefill`, every row
right-padded to one length and told its real one), filling each block's KV cache, and the
new tokens come from one `lax.while_loop` program (`decode`) that feeds one token per row per
step and stops when every row has emitted the stop token. Prompt lengths are padded to a
multiple of BUCKET so that prompts of similar length share one compile; the compiled
programs are kept per (model graph, batch, cache length, prompt length, sampling rule).

Letters: B rows, P padded prompt length, L cache length, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

import attnlayers
from models import compiler, fused_decode, plans
from models.config import is_integer
from models.gpt import GPT

BUCKET = 64  # prompt and cache lengths are rounded up to a multiple of this (capped at seq_len)
SEEDS = 2**32  # Sampling.seed lies below: without jax_enable_x64 jax.random.key(seed) keeps the low 32 bits
NO_STOP = -1  # the stop token's runtime value when there is none: no sampled id equals it


@dataclasses.dataclass(frozen=True)
class Sampling:
  temperature: float = 1.0  # 0 = greedy (argmax); otherwise logits / temperature
  top_k: int | None = None  # keep the k most likely tokens (ties to the lower id); None = all
  seed: int = 0  # the random stream of the whole generation: an int in [0, SEEDS)
  real_vocab: int | None = None  # draw only ids below this: the tokenizer's (vocab_size may be padded past); None: all

  def __post_init__(self):
    s = self.seed
    if not is_integer(s) or not 0 <= s < SEEDS:
      raise ValueError(f"seed must be an integer in [0, 2**32) ({SEEDS}); got {s!r}: jax.random.key keeps its low "
                       "32 bits here (seed 2**32 + s would draw what seed s draws, and from 2**63 it fails)")
    t = self.temperature
    if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
      raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy); got {t!r}")
    k = self.top_k
    if k is not None and (not is_integer(k) or k < 1):
      raise ValueError(f"top_k must be an integer >= 1, or None to keep every token; got {self.top_k!r}")
    n = self.real_vocab
    if n is not None and (not is_integer(n) or n < 1):
      raise ValueError(f"real_vocab must be an integer >= 1 (the ids the tokenizer gives; a model's vocab_size may "
                       f"be padded past them), or None to draw from every id; got {n!r}")

  def check(self, vocab_size: int) -> None:
    if self.real_vocab is not None and self.real_vocab > vocab_size:
      raise ValueError(f"real_vocab ({self.real_vocab}) must be <= the model's vocab_size ({vocab_size}): the ids "
                       "the tokenizer gives are among the model's; None draws from every id")
    if self.top_k is not None and self.top_k > self.ids(vocab_size):
      what = (f"real_vocab ({self.real_vocab}), the ids drawn from" if self.real_vocab is not None else
              f"the model's vocab_size ({vocab_size})")
      raise ValueError(f"top_k ({self.top_k}) must be <= {what}; None keeps every token")

  def ids(self, vocab_size: int) -> int:
    """How many ids a model of `vocab_size` draws from: 0 .. ids - 1."""
    return vocab_size if self.real_vocab is None else self.real_vocab


def sample(logits: Float[Array, "B V"], key, sampling: Sampling) -> Int[Array, "B"]:
  """One token per row of the first real_vocab ids: argmax at temperature 0, else a draw from softmax(logits / T)
  over the top k.

  The ids past real_vocab (a vocabulary padded for the GEMMs: GPT-2's 50257 to 50304) are left out, as logits of
  -inf would be: no data trained them as targets, and their logits are whatever the weights give.

  A draw is the Gumbel-max one, argmax(logits / T + g) with g ~ Gumbel(0, 1) per logit, taken as argmax(logits +
  T * g) (the same argmax for T > 0): no division, so a tiny temperature leaves the logits' order rather than
  sending them to +-inf. With top_k it draws among jax.lax.top_k's k (ties at the k-th largest go to the lower
  index, exactly k kept), so a step sorts, draws and picks in a few kernels, none of them of the vocabulary's
  size but the top-k."""
  logits = logits[:, :sampling.real_vocab]  # (B, real_vocab); None: (B, V)
  if sampling.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  ids = None
  if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
    logits, ids = jax.lax.top_k(logits, sampling.top_k)  # (B, k) each
  noise = jax.random.gumbel(key, logits.shape, jnp.float32)  # (B, V | k)
  choice = jnp.argmax(logits.astype(jnp.float32) + sampling.temperature * noise, axis=-1)  # (B,)
  if ids is not None:
    choice = jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0]
  return choice.astype(jnp.int32)


def bucket(n: int, limit: int) -> int:
  """n rounded up to a multiple of BUCKET, at most `limit` (and at least n)."""
  return max(n, min(limit, -(-n // BUCKET) * BUCKET))


def check_new_tokens(max_new_tokens: int) -> None:
  """ValueError unless max_new_tokens is an integer >= 1."""
  if not is_integer(max_new_tokens) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an integer >= 1 (the new tokens per prompt); got {max_new_tokens!r}")


def check_options(vocab_size: int, sampling: Sampling, stop_token: int | None) -> None:
  """ValueError unless `sampling` is a Sampling that fits the vocabulary and stop_token a token id or None."""
  if not isinstance(sampling, Sampling):
    raise ValueError(f"sampling must be a models.generate.Sampling, e.g. Sampling(temperature=0.8, top_k=40); "
                     f"got {sampling!r}")
  sampling.check(vocab_size)
  ids = sampling.ids(vocab_size)  # a stop token past them is never drawn
  if stop_token is not None and (not is_integer(stop_token) or not 0 <= stop_token < ids):
    raise ValueError(f"stop_token must be a token id, an integer in [0, {ids}), or None to stop only at "
                     f"max_new_tokens; got {stop_token!r}" + (f" (ids from {ids} on are past real_vocab: never drawn)"
                                                              if ids < vocab_size else ""))


def check_fits(seq_len: int, prompt_len: int, max_new_tokens: int) -> None:
  """ValueError unless a prompt of `prompt_len` tokens plus `max_new_tokens` fit the context."""
  if prompt_len < 1:
    raise ValueError("the prompt is empty: give at least one token")
  if prompt_len > seq_len:
    raise ValueError(f"the prompt has {prompt_len} tokens, more than the model's context (seq_len {seq_len}); "
                     f"shorten it to at most {seq_len - 1} tokens to leave room for one new token")
  check_new_tokens(max_new_tokens)
  if prompt_len + max_new_tokens > seq_len:
    raise ValueError(f"a prompt of {prompt_len} tokens plus {max_new_tokens} new ones is "
                     f"{prompt_len + max_new_tokens}, past the model's context (seq_len {seq_len}): "
                     f"at most {seq_len - prompt_len} new tokens fit"
                     if seq_len > prompt_len else
                     f"the prompt fills the model's context (seq_len {seq_len}): no new token fits; shorten it")


# ---- the two compiled programs: (params, rest, cache, key, ...) -> (cache, key, ...) ----

def _prefill(params, rest, cache, key, prompts, lengths, *, graphdef, sampling):
  model = nnx.merge(graphdef, params, cache, rest)
  last = model(prompts, decode=True, lengths=lengths, last_only=True)[:, 0]  # (B, V) at each last real token
  key, sub = _split(key, sampling)
  return nnx.state(model, nnx.Cache), key, sample(last, sub, sampling)


def _decode(params, rest, cache, key, first, steps, stop, *, graphdef, sampling, width):
  B = first.shape[0]
  kv, start, join = _one_position(cache)  # start (B,): each row's position when the loop starts

  def more(carry):
    # a step is left and some row has not stopped. The step computes `live` with its tokens; the step count is
    # compared here so that the condition runs a kernel: XLA's command buffers order the loop's next-step flag
    # after the condition's kernels, and a condition with none sets it from the flag the step before left (one
    # step too many; tests/test_generate.py)
    return (carry[0] < steps) & carry[5]

  def step(carry):
    i, kv, key, token, done, _, out, n_new = carry
    # every row advances one position a step (Decoder.decode checks the cache has room for them all), so step i
    # is at start + i: the loop carries no position, and the blocks' own advance of it goes unused
    model = nnx.merge(graphdef, params, join(kv, start + i), rest)
    logits = model(token[:, None], decode=True)[:, 0]  # (B, V)
    token = jnp.where(done, stop, sample(logits, jax.random.fold_in(key, i), sampling))  # (B,) a finished row
    # repeats its stop; step i draws with the call's key folded with i, so the loop carries one key, unchanged
    out = jax.lax.dynamic_update_slice(out, token[:, None], (0, i))  # out[:, i] = token
    kv, _, _ = _one_position(nnx.state(model, nnx.Cache))
    n_new, done = n_new + ~done, done | (token == stop)
    return i + 1, kv, key, token, done, ~jnp.all(done), out, n_new  # live: some row has not stopped

  out = jnp.full((B, width), stop, jnp.int32)  # (B, width) the new tokens; columns past the loop's end hold stop
  done = first == stop
  carry = (jnp.int32(0), kv, key, first, done, ~jnp.all(done), out, jnp.zeros((B,), jnp.int32))
  ran, kv, key, _, _, _, out, n_new = jax.lax.while_loop(more, step, carry)
  key = _split(key, sampling)[0]  # the next call's key: a stream of its own
  return join(kv, start + ran), key, out, n_new, ran  # ran: the steps taken; every row's cache advanced by that many


def _one_position(cache):
  """(the cache's keys and values, its position (B,), join: (keys and values, position) -> the cache).

  Every block's cache_index holds the same positions (each call advances them all by the same lengths), so the
  decode loop reads one and derives each step's from it: the blocks read one buffer, and no block's position is
  copied to keep its old value while another's is written."""
  leaves, tree = jax.tree_util.tree_flatten_with_path(cache)
  at = [i for i, (path, _) in enumerate(leaves) if "['cache_index']" in jax.tree_util.keystr(path)]
  if not at:
    paths = [jax.tree_util.keystr(path) for path, _ in leaves]
    raise ValueError(f"the decoding graph's cache has no cache_index among {paths}")
  kv = [x for i, (_, x) in enumerate(leaves) if i not in at]

  def join(kv, pos):
    rest = iter(kv)
    return jax.tree_util.tree_unflatten(tree, [pos if i in at else next(rest) for i in range(len(leaves))])

  return kv, leaves[at[0]][1], join


def _split(key, sampling: Sampling):
  """(the key to carry, the key to draw this token with); greedy decoding draws nothing and leaves the key."""
  return (key, key) if sampling.temperature == 0 else tuple(jax.random.split(key))


_COMPILED: dict = {}  # (program, static arguments, argument shapes) -> executable

# XLA's GPU compiler rewrites a vector-matrix product (every projection of a batch-1 decode step)
# into multiply + reduce fusions ("dot strength reduction", no option turns it off in jax 0.11's XLA).
# On a GPU that makes a batch-1 decode step slower than a batch-2 one, so there a batch of one decodes as two
# rows (the second a copy of the first, dropped) and runs the GEMMs.
MIN_GPU_ROWS = 2


def rows_for(batch: int) -> int:
  """The rows the compiled programs hold for `batch` sequences on the default device (see MIN_GPU_ROWS)."""
  return max(batch, MIN_GPU_ROWS) if attnlayers.device.current().platform == "gpu" else batch


def _pad_rows(x, rows: int):
  """x (B, ...) with rows - B copies of its first row appended."""
  x = jnp.asarray(x)
  return x if x.shape[0] == rows else jnp.concatenate([x, jnp.repeat(x[:1], rows - x.shape[0], axis=0)])


def _compiled(fn, statics: dict, args: tuple, options: dict):
  """fn compiled for `args`' shapes with XLA `options`, its cache argument donated; and the seconds compiling
  took (0: reused)."""
  leaves, tree = jax.tree.flatten(args)
  key = (fn.__name__, tuple(sorted(statics.items())), tree, tuple((x.shape, str(x.dtype)) for x in leaves),
         tuple(sorted(options.items())))
  if key in _COMPILED:
    return _COMPILED[key], 0.0
  t0 = time.perf_counter()
  _COMPILED[key] = _lowered(fn, statics, args, options).compile()
  return _COMPILED[key], time.perf_counter() - t0


def _lowered(fn, statics: dict, args: tuple, options: dict) -> jax.stages.Lowered:
  def program(*a):
    return fn(*a, **statics)
  program.__name__ = fn.__name__  # the compiled module's name: jit__decode, jit__prefill (in profiler traces)
  return jax.jit(program, donate_argnums=2, compiler_options=options).lower(*args)


def _graph(cfg, rows: int, cache_len: int):
  """The decoding graph of a GPT under `cfg` with a cache of (rows, cache_len), as shapes: (graphdef, parameters,
  cache, the rest of its state)."""
  return nnx.split(nnx.eval_shape(lambda: _model(cfg, rows, cache_len)), nnx.Param, nnx.Cache, ...)


def _model(cfg, rows: int, cache_len: int) -> GPT:
  """A GPT under `cfg` with an empty cache of (rows, cache_len): the decoding graph."""
  m = GPT(cfg, rngs=nnx.Rngs(0))
  m.init_cache(rows, cache_len)
  return m


def lower_decode(cfg, *, batch: int, cache_len: int, sampling: Sampling, compiler_options: dict,
                 sharding: jax.sharding.Sharding) -> jax.stages.Lowered:
  """The decode loop program of a Decoder for a GPT under `cfg` lowered for `sharding`'s device, from shapes alone
  (no parameters are made): what XLA compiles for a device, e.g. a compile-only one of
  jax.experimental.topologies, where none is at hand. Call it under jax.default_device of that device, so that
  `auto` plans and the rows (rows_for) are that device's."""
  rows = rows_for(batch)
  graphdef, params, cache, rest = _graph(cfg, rows, cache_len)
  params = jax.eval_shape(lambda p: _cast(p, jnp.dtype(cfg.dtype)), params)  # as the Decoder casts them
  statics, args = _decode_call(graphdef, (params, rest, cache, _key_shape()), rows, cache_len, sampling)
  place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  return _lowered(_decode, statics, jax.tree.map(place, args), compiler_options)


def _decode_call(graphdef, state: tuple, rows: int, cache_len: int, sampling: Sampling) -> tuple[dict, tuple]:
  """The decode program's static arguments and arguments: `state` (parameters, rest, cache, key), then the first
  tokens (rows,), the step count and the stop token as int32 shapes."""
  i32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  statics = {"graphdef": graphdef, "sampling": dataclasses.replace(sampling, seed=0), "width": cache_len}
  return statics, (*state, i32((rows,)), i32(()), i32(()))


def _key_shape():
  return jax.eval_shape(lambda: jax.random.key(0))


def _cast(tree, dtype):
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


class Decoder:
  """Prefill and the decode loop for one (model, batch, cache_len, prompt_len, sampling), compiled once.

  The parameters are cast once to the model's compute dtype (a decode step reads bfloat16
  weights from a bfloat16 model). backend=None (or the model's own) keeps the model's graph
  and all its state; another name rebuilds the graph with that attention backend around the
  same nnx.Param state, so a te-fp8 model samples under "xla"; any other state (te-fp8's
  FP8Meta scaling) is then the new backend's own, fresh. Both programs compile with
  `compiler_options`: by default models.compiler.DECODE (XLA's own options;
  models.compiler.COMMAND_BUFFERS records the decode loop as CUDA graphs on a GPU).
  """

  def __init__(self, model: GPT, *, batch: int, cache_len: int, prompt_len: int, sampling: Sampling,
               stop_token: int | None = None, backend: str | None = None, compiler_options: dict | None = None):
    cfg = model.cfg
    if backend not in (None, cfg.backend):
      cfg = dataclasses.replace(cfg, backend=backend, fp8_core=cfg.fp8_core if backend == "te-fp8" else "fp8")
    check_options(cfg.vocab_size, sampling, stop_token)
    if batch < 1:
      raise ValueError(f"batch must be >= 1; got {batch}")
    if not 1 <= prompt_len <= cache_len <= cfg.seq_len:
      raise ValueError(f"need 1 <= prompt_len ({prompt_len}) <= cache_len ({cache_len}) <= seq_len ({cfg.seq_len})")
    self.cfg, self.batch, self.cache_len, self.prompt_len = cfg, batch, cache_len, prompt_len
    self.rows = rows_for(batch)  # rows the programs and the cache hold (>= batch; the extra ones dropped)
    self.sampling, self.stop = sampling, NO_STOP if stop_token is None else stop_token
    self.compiler_options = dict(compiler.DECODE if compiler_options is None else compiler_options)

    self.graphdef, params, self._cache_shapes, rest = _graph(cfg, self.rows, cache_len)
    source = nnx.state(model, nnx.Param)
    if jax.tree.structure(source) != jax.tree.structure(params):
      raise ValueError("the model's parameters do not fit the decoding graph (a GPT built from model.cfg)")
    self.params = _cast(source, jnp.dtype(cfg.dtype))  # cast once
    if cfg == model.cfg:  # the model's own non-parameter state (e.g. te-fp8's trained FP8 scaling)
      rest = nnx.split(model, nnx.Param, nnx.Cache, ...)[3]
    elif jax.tree.leaves(rest):  # the new backend's own fresh state (only the parameters carry over)
      rest = jax.jit(lambda: nnx.split(_model(cfg, self.rows, cache_len), nnx.Param, nnx.Cache, ...)[3])()
    self.rest = rest
    self._compile()

  def _compile(self) -> None:
    """Compiles (or finds compiled) both programs for this decoder's shapes; compile_s: the seconds it took."""
    B, i32 = self.rows, jnp.int32
    spec = lambda shape, dtype=i32: jax.ShapeDtypeStruct(shape, dtype)
    state = (self.params, self.rest, self._cache_shapes, _key_shape())
    statics = {"graphdef": self.graphdef, "sampling": dataclasses.replace(self.sampling, seed=0)}
    options = self.compiler_options
    self._prefill, t1 = _compiled(_prefill, statics, (*state, spec((B, self.prompt_len)), spec((B,))), options)
    self._decode, t2 = _compiled(_decode, *_decode_call(self.graphdef, state, B, self.cache_len, self.sampling),
                                 options)
    self.compile_s = t1 + t2

  def attention_plans(self) -> dict[str, list[attnlayers.Plan]]:
    """How the prefill and decode programs' attention calls run (models.plans: what `auto` chose)."""
    return {name: plans.attention_plans(self.cfg, self.rows, T, cache_len=self.cache_len)
            for name, T in (("prefill", self.prompt_len), ("decode", 1))}

  def attention_ran(self) -> str:
    """The kernels of attention_plans: "prefill cudnn, decode xla"; layers whose windows differ: "cudnn/xla"."""
    return ", ".join(f"{name} {plans.ran(p)}" for name, p in self.attention_plans().items())

  def decode_step_ran(self) -> str:
    """What each block runs in a decode step: models.fused_decode.planned ("fused (pallas)", or why not)."""
    return fused_decode.planned(self.cfg)

  def init_state(self) -> dict:
    """The parameters, an empty cache for (batch, cache_len) and the sampling's random key."""
    cache = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self._cache_shapes)
    return {"params": self.params, "rest": self.rest, "cache": cache, "key": jax.random.key(self.sampling.seed),
            "pos": np.zeros((self.batch,), np.int64)}  # pos: each row's next position (a decode makes it a device
    # array, read when a later call checks its room)

  def _args(self, state: dict) -> tuple:
    """The programs' state arguments; raises for a cache an earlier call consumed (both programs donate it)."""
    if any(x.is_deleted() for x in jax.tree.leaves(state["cache"]) if isinstance(x, jax.Array)):
      raise ValueError("this state's cache went to an earlier prefill or decode call, which reuses its buffers for "
                       "the cache it returns: pass the state that call returned, or a fresh init_state()")
    return state["params"], state["rest"], state["cache"], state["key"]

  def prefill(self, state: dict, prompts: Int[Array, "B P"], lengths: Int[Array, "B"]) -> tuple[dict, Int[Array, "B"]]:
    """The prompt chunk through the model (rows right-padded to prompt_len), and each row's first new token."""
    prompts, lengths = np.asarray(prompts), np.asarray(lengths)
    if prompts.shape != (self.batch, self.prompt_len) or lengths.shape != (self.batch,):
      raise ValueError(f"prompts must be ({self.batch}, {self.prompt_len}) and lengths ({self.batch},); "
                       f"got {prompts.shape} and {lengths.shape}")
    if lengths.min() < 1 or lengths.max() > self.prompt_len:
      raise ValueError(f"lengths must lie in [1, prompt_len={self.prompt_len}]; got {lengths.tolist()}")
    if state["pos"].max() + self.prompt_len > self.cache_len:
      raise ValueError(f"a chunk of {self.prompt_len} tokens after position {state['pos'].max()} passes the "
                       f"cache's {self.cache_len} positions")
    cache, key, first = self._prefill(*self._args(state), _pad_rows(prompts.astype(np.int32), self.rows),
                                      _pad_rows(lengths.astype(np.int32), self.rows))
    return state | {"cache": cache, "key": key, "pos": state["pos"] + lengths}, first[:self.batch]

  def decode(self, state: dict, first_tokens: Int[Array, "B"], steps: int) -> tuple[dict, Int[Array, "B S"],
                                                                                     Int[Array, "B"]]:
    """Up to `steps` one-token steps in one compiled loop, fed `first_tokens`; stops once every row has
    emitted the stop token. Returns (state, tokens (B, steps), n_new (B,): each row's new tokens up to
    and including its stop); tokens after a row's stop are the stop token."""
    room = self.cache_len - int(state["pos"].max())
    if not 0 <= steps <= room:
      raise ValueError(f"steps must be in [0, {room}]: the cache has {self.cache_len} positions and its fullest row "
                       f"is at {int(state['pos'].max())}; got {steps}")
    first = _pad_rows(jnp.asarray(first_tokens, jnp.int32), self.rows)
    cache, key, out, n_new, ran = self._decode(*self._args(state), first, jnp.int32(steps), jnp.int32(self.stop))
    # the loop ends early once every row has stopped: each row's cache then holds `ran` more, not `steps`
    # (a device scalar, not waited for here: the next call that checks a position reads it)
    return (state | {"cache": cache, "key": key, "pos": state["pos"] + ran}, out[:self.batch, :steps],
            n_new[:self.batch])


@dataclasses.dataclass
class Generation:
  tokens: list[np.ndarray]  # new tokens per row, up to and including the stop token
  time_to_first_token_s: float  # prefill + first sample, compiled and run once before (neither timed)
  decode_tokens_per_s: float  # new tokens from the decode loop per second of it (nan: no decode step)
  compile_s: float  # compiling prefill and decode (0 when this shape was compiled before)
  attention: str  # the kernels the attention calls ran on: Decoder.attention_ran
  decode_step: str  # what each block ran a decode step on: Decoder.decode_step_ran


def generate(model: GPT, prompts, *, max_new_tokens: int, sampling: Sampling = Sampling(),
             stop_token: int | None = None, backend: str | None = None) -> Generation:
  """Continues each prompt (1-d token ids; rows may differ in length) by up to max_new_tokens tokens.

  Every argument is checked before anything compiles: a ValueError names the first that is not what it takes."""
  if not isinstance(model, GPT):
    raise ValueError(f"model must be a models.GPT; got {type(model).__name__}")
  cfg = model.cfg
  check_new_tokens(max_new_tokens)
  check_options(cfg.vocab_size, sampling, stop_token)
  rows = _prompt_rows(prompts, cfg, max_new_tokens)
  lengths = np.array([len(p) for p in rows], np.int32)
  longest = int(lengths.max())
  prompt_len = bucket(longest, cfg.seq_len)
  decoder = Decoder(model, batch=len(rows), cache_len=bucket(longest + max_new_tokens, cfg.seq_len),
                    prompt_len=prompt_len, sampling=sampling, stop_token=stop_token, backend=backend)
  padded = np.zeros((len(rows), prompt_len), np.int32)  # (B, P) right-padded
  for b, p in enumerate(rows):
    padded[b, :len(p)] = p
  warm, first = decoder.prefill(decoder.init_state(), padded, lengths)  # untimed: a program's first run loads
  jax.block_until_ready(decoder.decode(warm, first, min(1, max_new_tokens - 1)))  # its kernels, set-up not rate
  state = decoder.init_state()
  ttft, (state, first) = _timed(lambda: decoder.prefill(state, padded, lengths))
  first = np.asarray(first)
  decode_s, (state, tokens, n_new) = _timed(lambda: decoder.decode(state, first, max_new_tokens - 1))
  tokens, n_new = np.asarray(tokens), np.asarray(n_new)
  out = [np.concatenate([first[b:b + 1], tokens[b, :n_new[b]]]) for b in range(len(rows))]
  rate = float(n_new.sum()) / decode_s if max_new_tokens > 1 else float("nan")
  return Generation(out, ttft, rate, decoder.compile_s, decoder.attention_ran(), decoder.decode_step_ran())


def _prompt_rows(prompts, cfg, max_new_tokens: int) -> list[np.ndarray]:
  """Each prompt as an array, checked: 1-d integer token ids of the vocabulary that fit the context with
  max_new_tokens new ones."""
  if isinstance(prompts, (str, bytes)):
    raise ValueError(f"prompts must be a list of token id arrays; got a {type(prompts).__name__}: encode the text "
                     "to token ids first and pass [ids]")
  try:
    rows = [np.asarray(p) for p in prompts]
  except TypeError:
    raise ValueError(f"prompts must be a list of token id arrays (1-d, one per row); got {prompts!r}") from None
  if not rows:
    raise ValueError("no prompts: give at least one")
  for i, p in enumerate(rows):
    if p.ndim != 1:
      hint = ("one number: prompts is a list of prompts, so one prompt goes as [ids]" if p.ndim == 0 else
              "a 2-d array of equal-length prompts goes as prompts itself, each row one prompt")
      raise ValueError(f"prompt {i} must be 1-d token ids; got shape {p.shape} ({hint})")
    check_fits(cfg.seq_len, len(p), max_new_tokens)
    if not np.issubdtype(p.dtype, np.integer):
      raise ValueError(f"prompt {i} must hold integer token ids in [0, {cfg.vocab_size}); got {p.dtype} values")
    if p.min() < 0 or p.max() >= cfg.vocab_size:
      raise ValueError(f"prompt {i} must hold integer token ids in [0, {cfg.vocab_size}); "
                       f"got {p.dtype} values in [{p.min()}, {p.max()}]")
  return rows


def _timed(call):
  """(seconds the call took, its result with every array ready)."""
  t0 = time.perf_counter()
  result = jax.block_until_ready(call())
  return time.perf_counter() - t0, result
