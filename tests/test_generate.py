"""KV-cache generation (models.generate) on CPU: the cached decoder gives the tokens that
re-running the whole sequence for every new token gives, on every CPU backend and head
layout; ragged batches, stop tokens, sampling, backend switches and errors.

Models are tiny (2 layers, d_model 32, float32) with parameters drawn at a large scale and
positions at a larger one, so that greedy decoding wanders over many tokens instead of
repeating one.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlayers
import models
from models import plans
from models.generate import Decoder, Sampling, generate, sample

GREEDY = Sampling(temperature=0)
PROMPTS = [np.array([5, 9, 2]), np.arange(17) % 7 + 20, (np.arange(50) * 7) % 64]  # ragged: 3, 17, 50 tokens
NEW = 20


def config(backend="xla", n_kv_head=2, **overrides) -> models.GPTConfig:
  return models.GPTConfig(**{"vocab_size": 64, "seq_len": 96, "n_layer": 2, "n_head": 4, "n_kv_head": n_kv_head,
                             "d_model": 32, "dtype": "float32", "backend": backend} | overrides)


def model(cfg: models.GPTConfig) -> models.GPT:
  """A GPT with normal(0, 0.5) parameters and normal(0, 10) positions (drawn by numpy: nothing to compile)."""
  graphdef, params = nnx.split(nnx.eval_shape(lambda: models.GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  rng = np.random.default_rng(1)
  draw = lambda path, x: jnp.asarray(rng.normal(0, 10.0 if "wpe" in jax.tree_util.keystr(path) else 0.5, x.shape),
                                     x.dtype)
  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, params))


def forward(m: models.GPT):
  """The model's logits (V,) of every position of one sequence, from a pass over all of it (no cache)."""
  graphdef, state = nnx.split(m)
  run = jax.jit(lambda state, buf: nnx.merge(graphdef, state)(buf[None])[0])  # (seq_len, V)

  def logits(seq) -> np.ndarray:  # (len(seq), V)
    buf = np.zeros(m.cfg.seq_len, np.int32)  # a causal model does not see the padding after the sequence
    buf[:len(seq)] = seq
    return np.asarray(run(state, buf))[:len(seq)]
  return logits


def greedy_by_recomputation(logits, prompt, n: int) -> list[int]:
  """Each new token from a pass over the whole sequence so far."""
  seq = list(prompt)
  for _ in range(n):
    seq.append(int(np.argmax(logits(seq)[-1])))
  return seq[len(prompt):]


def cached_logits(m: models.GPT, prompts, continuations: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Logits through the KV cache: the ragged prompts as one right-padded chunk (B, P, V), then
  the continuations (B, C) as a second chunk at each row's own position (B, C, V)."""
  lengths = np.array([len(p) for p in prompts], np.int32)
  padded = np.zeros((len(prompts), lengths.max()), np.int32)
  for b, p in enumerate(prompts):
    padded[b, :len(p)] = p
  m = nnx.clone(m)
  m.init_cache(len(prompts), m.cfg.seq_len)
  graphdef, state = nnx.split(m)

  @jax.jit
  def chunk(state, tokens, lengths):
    model = nnx.merge(graphdef, state)
    return model(tokens, decode=True, lengths=lengths), nnx.state(model)

  first, state = chunk(state, padded, lengths)
  second, _ = chunk(state, continuations, np.full(len(prompts), continuations.shape[1], np.int32))
  return np.asarray(first), np.asarray(second)


def assert_logits_close(got, want):
  """float32 logits of two orders of summation: within 1e-5 of the largest."""
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_cached_greedy_without_biases_equals_recomputation():
  """GPTConfig.bias False (python -m train --no-bias): the cache path has no biases to add either."""
  m = model(config("xla", 2, bias=False))
  assert not [p for p, _ in jax.tree_util.tree_leaves_with_path(nnx.state(m, nnx.Param)) if "bias" in str(p)]
  logits = forward(m)
  want = [greedy_by_recomputation(logits, prompt, NEW) for prompt in PROMPTS]
  assert len({t for row in want for t in row}) >= 4, f"degenerate test: greedy repeats a few tokens: {want}"
  assert [t.tolist() for t in generate(m, PROMPTS, max_new_tokens=NEW, sampling=GREEDY).tokens] == want


@pytest.mark.parametrize("backend", ["naive", "xla"])
@pytest.mark.parametrize("n_kv_head", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_cached_greedy_equals_recomputation(backend, n_kv_head):
  m = model(config(backend, n_kv_head))
  logits = forward(m)
  want = [greedy_by_recomputation(logits, prompt, NEW) for prompt in PROMPTS]
  assert len({t for row in want for t in row}) >= 4, f"degenerate test: greedy repeats a few tokens: {want}"
  gen = generate(m, PROMPTS, max_new_tokens=NEW, sampling=GREEDY)
  assert [t.tolist() for t in gen.tokens] == want
  # the logits along that path: the cache's (prompt chunk, then the new tokens as a chunk) against full passes
  first, second = cached_logits(m, PROMPTS, np.array(want))
  for b, (prompt, new) in enumerate(zip(PROMPTS, want)):
    full = logits(list(prompt) + new)  # (len + NEW, V)
    assert_logits_close(first[b, :len(prompt)], full[:len(prompt)])
    assert_logits_close(second[b], full[len(prompt):])


def test_ragged_batch_equals_each_row_alone():
  m = model(config())
  together = generate(m, PROMPTS, max_new_tokens=NEW, sampling=GREEDY).tokens
  for prompt, tokens in zip(PROMPTS, together):
    alone = generate(m, [prompt], max_new_tokens=NEW, sampling=GREEDY).tokens[0]
    np.testing.assert_array_equal(tokens, alone)


def test_one_row_padded_to_two_rows_decodes_the_same(monkeypatch):
  """On a GPU a batch of one runs as two rows (models.generate.MIN_GPU_ROWS); forced here on the CPU,
  the tokens must be the one-row decoder's, sampled or greedy."""
  m = model(config())
  sampled = Sampling(temperature=1.0, top_k=8, seed=3)
  want = [generate(m, PROMPTS[1:2], max_new_tokens=NEW, sampling=s).tokens[0] for s in (GREEDY, sampled)]
  monkeypatch.setattr(models.generate, "rows_for", lambda batch: max(batch, 2))
  for s, w in zip((GREEDY, sampled), want):
    gen = generate(m, PROMPTS[1:2], max_new_tokens=NEW, sampling=s)
    assert len(gen.tokens) == 1
    np.testing.assert_array_equal(gen.tokens[0], w)


def test_stop_token_ends_each_row_at_its_first_stop():
  m = model(config())
  free = [t.tolist() for t in generate(m, PROMPTS, max_new_tokens=NEW, sampling=GREEDY).tokens]
  stop = next(t for k, t in enumerate(free[0]) if k >= 2 and t not in free[0][:k])  # first seen at position k >= 2
  gen = generate(m, PROMPTS, max_new_tokens=NEW, sampling=GREEDY, stop_token=stop)
  for row, tokens in zip(free, gen.tokens):
    want = row[:row.index(stop) + 1] if stop in row else row
    assert tokens.tolist() == want
  assert gen.tokens[0][-1] == stop and len(gen.tokens[0]) < NEW


def test_decode_is_one_compiled_loop_and_pads_finished_rows_with_stop():
  m = model(config())
  d = Decoder(m, batch=2, cache_len=64, prompt_len=64, sampling=GREEDY, stop_token=0)
  assert "while" in d._decode.as_text()  # one program for every step, not a dispatch per token
  prompts = np.zeros((2, 64), np.int32)
  prompts[:, :3] = PROMPTS[0]
  state, first = d.prefill(d.init_state(), prompts, np.array([3, 3]))
  state, tokens, n_new = d.decode(state, np.array([0, int(first[1])]), 10)  # row 0 has already stopped
  assert tokens.shape == (2, 10) and tokens[0].tolist() == [0] * 10 and int(n_new[0]) == 0
  stopped = tokens[1].tolist().index(0) + 1 if 0 in tokens[1].tolist() else 10
  assert int(n_new[1]) == stopped and tokens[1, stopped:].tolist() == [0] * (10 - stopped)


def test_the_decode_loops_condition_computes_its_flag():
  """XLA's command buffers (the loop as a CUDA graph) order the loop's next-step flag after the condition's
  kernels; a condition that only reads a flag the step carried has none, its flag was set before the step wrote
  it, and the loop ran one step more than asked on an H200. The compiled condition computes something."""
  d = Decoder(model(config()), batch=2, cache_len=64, prompt_len=64, sampling=GREEDY)
  text = d._decode.as_text()
  loop = next(line for line in text.splitlines() if " while(" in line)
  name = re.search(r"condition=%?([\w.\-]+)", loop).group(1)
  body = re.search(r"^%?" + re.escape(name) + r" .*?^}", text, re.S | re.M).group(0).splitlines()[1:-1]
  assert [line for line in body if not re.search(r" (parameter|get-tuple-element)\(", line)], body


def test_the_decode_loop_carries_no_position_per_block():
  """Every block's cache_index holds the same positions, so the loop's carry does not grow with the blocks (a copy
  of each block's old position per step was the price of carrying them all), and each block's cache_index comes
  back equal to the decoder's positions. Greedy decoding draws no random bits: its key comes back as it went in."""
  carried = {}
  for n_layer in (1, 3):
    d = Decoder(model(config(n_layer=n_layer)), batch=3, cache_len=64, prompt_len=64, sampling=GREEDY)
    loop = next(line for line in d._decode.as_text().splitlines() if " while(" in line)
    carried[n_layer] = len(re.findall(r"\bs32\[3\]", loop.split(" while(")[0]))
    prompts = np.zeros((3, 64), np.int32)
    prompts[:, :3] = PROMPTS[0]
    state, first = d.prefill(d.init_state(), prompts, np.array([3, 2, 1]))
    key = jax.random.key_data(state["key"]).tolist()
    state, _, _ = d.decode(state, first, 7)
    blocks = state["cache"]["blocks"]
    assert [np.asarray(blocks[i]["attn"]["cache_index"][...]).tolist() for i in range(n_layer)] == \
        [[10, 9, 8]] * n_layer == [np.asarray(state["pos"]).tolist()] * n_layer
    assert jax.random.key_data(state["key"]).tolist() == key
  assert carried[1] == carried[3], carried


def test_same_shapes_reuse_the_compiled_programs():
  m = model(config(n_layer=1))
  first = generate(m, [PROMPTS[0]], max_new_tokens=5, sampling=GREEDY)
  again = generate(m, [PROMPTS[1]], max_new_tokens=6, sampling=GREEDY)  # same buckets: prompt 64, cache 64
  assert first.compile_s > 0 and again.compile_s == 0
  for g in (first, again):
    assert 0 < g.time_to_first_token_s < 10 and g.decode_tokens_per_s > 0


def test_a_tiny_temperature_samples_the_most_likely_token():
  """logits / 1e-38 overflow to +-inf, where a draw took the first positive logit; the row's largest goes to 0
  first, so a tiny temperature is greedy."""
  logits = jnp.array([[0.5, 1.0, 2.0, -1.0], [3.0, -2.0, 2.5, 0.0]])
  for seed in range(5):
    tokens = sample(logits, jax.random.key(seed), Sampling(temperature=1e-38))
    assert tokens.tolist() == [2, 0]
  m = model(config(n_layer=1))
  tiny = generate(m, PROMPTS[:2], max_new_tokens=NEW, sampling=Sampling(temperature=1e-38, seed=1))
  greedy = generate(m, PROMPTS[:2], max_new_tokens=NEW, sampling=GREEDY)
  assert [t.tolist() for t in tiny.tokens] == [t.tolist() for t in greedy.tokens]


def test_a_decode_that_ends_early_advances_each_row_by_the_steps_it_ran():
  """Every row stopped after a few steps: the decoder's positions advance by those, so the next decode call may
  use the rest of the cache and continues where the cache is."""
  m = model(config())
  d = Decoder(m, batch=1, cache_len=64, prompt_len=64, sampling=GREEDY, stop_token=0)
  prompts = np.zeros((1, 64), np.int32)
  prompts[:, :3] = PROMPTS[0]
  state, first = d.prefill(d.init_state(), prompts, np.array([3]))
  state, tokens, n_new = d.decode(state, np.array([0]), 50)  # the row has stopped: the loop ends at once
  assert int(n_new[0]) == 0 and state["pos"].tolist() == [3]
  state, tokens, n_new = d.decode(state, first, 61)  # the whole rest of the cache, refused before
  assert state["pos"].tolist() == [3 + int(n_new[0])]  # one row: the loop ran until its stop, or 61 steps


def test_a_state_an_earlier_call_consumed_is_a_clear_error():
  """prefill and decode reuse the cache's buffers for the cache they return: the state given to them is spent."""
  d = Decoder(model(config()), batch=1, cache_len=64, prompt_len=8, sampling=GREEDY)
  spent = d.init_state()
  state, first = d.prefill(spent, np.ones((1, 8), np.int32), np.array([8]))
  for call in (lambda: d.prefill(spent, np.ones((1, 8), np.int32), np.array([8])),
               lambda: d.decode(d.decode(state, first, 2)[0] | {"cache": state["cache"]}, first, 2)):
    with pytest.raises(ValueError, match="went to an earlier prefill or decode call"):
      call()


def test_generate_runs_each_program_once_untimed_before_the_timed_run(monkeypatch):
  """A program's first run loads its kernels: generate() runs prefill and a decode step once on a state of their
  own, then times a fresh one, whose tokens (same seed) are what a run without the warm-up gives."""
  calls = []
  for name in ("prefill", "decode"):
    real = getattr(Decoder, name)
    monkeypatch.setattr(Decoder, name, lambda self, state, *a, _real=real, _name=name:
                        calls.append((_name, id(state["cache"]))) or _real(self, state, *a))
  m = model(config(n_layer=1))
  sampling = Sampling(temperature=1.0, seed=7)
  gen = generate(m, PROMPTS[:2], max_new_tokens=6, sampling=sampling)
  assert [c[0] for c in calls] == ["prefill", "decode", "prefill", "decode"]
  assert calls[0][1] != calls[2][1]  # the timed prefill starts from a new cache, not the warm-up's
  monkeypatch.undo()
  d = Decoder(m, batch=2, cache_len=64, prompt_len=64, sampling=sampling)
  prompts, lengths = np.zeros((2, 64), np.int32), np.array([len(p) for p in PROMPTS[:2]])
  for b, p in enumerate(PROMPTS[:2]):
    prompts[b, :len(p)] = p
  state, first = d.prefill(d.init_state(), prompts, lengths)
  state, tokens, n_new = d.decode(state, first, 5)
  assert [t.tolist() for t in gen.tokens] == [[int(first[b])] + tokens[b].tolist() for b in range(2)]


def test_sampling_follows_seed_temperature_and_top_k():
  m = model(config(n_layer=1))
  draw = lambda **kw: [t.tolist() for t in generate(m, PROMPTS[:2], max_new_tokens=NEW, sampling=Sampling(**kw)).tokens]
  assert draw(temperature=1.0, seed=3) == draw(temperature=1.0, seed=3)
  assert draw(temperature=1.0, seed=3) != draw(temperature=1.0, seed=4)
  greedy = [t.tolist() for t in generate(m, PROMPTS[:2], max_new_tokens=NEW, sampling=GREEDY).tokens]
  assert draw(temperature=1.0, top_k=1, seed=5) == greedy  # the one most likely token


def test_top_k_keeps_exactly_k_tokens_when_the_kth_logit_is_tied():
  """Ties at the k-th largest logit are broken by index, as jax.lax.top_k (and torch.topk) pick: the k lowest-index
  of the largest stay, never more; every token can be drawn where k covers the vocabulary or is None."""
  logits = jnp.array([[1.0, 3.0, 2.0, 2.0, 2.0, 0.0],   # k=2: 3.0 and the first 2.0 (index 2)
                      [5.0, 5.0, 5.0, 5.0, 5.0, 5.0]])  # all tied: indices 0 and 1
  rows = jnp.tile(logits, (2048, 1))  # (4096, 6): rows 0, 2, 4, ... are the first, the others the second
  drawn = np.asarray(sample(rows, jax.random.key(0), Sampling(temperature=100.0, top_k=2))).reshape(2048, 2)
  assert set(drawn[:, 0].tolist()) == {1, 2} and set(drawn[:, 1].tolist()) == {0, 1}
  for k in (6, None):  # the whole vocabulary, or no top_k: nothing is left out
    everything = np.asarray(sample(rows, jax.random.key(1), Sampling(temperature=100.0, top_k=k))).reshape(2048, 2)
    assert set(everything[:, 1].tolist()) == set(range(6))


def test_a_draw_follows_softmax_of_the_logits_over_the_temperature():
  """The frequencies of 40,000 draws are softmax(logits / T) over the top k, within 5 standard errors."""
  logits = jnp.array([0.0, 1.0, 2.0, -1.0])
  n = 40_000
  for temperature, top_k in ((1.0, None), (0.5, None), (2.0, 2)):
    drawn = np.asarray(sample(jnp.tile(logits, (n, 1)), jax.random.key(3), Sampling(temperature, top_k)))
    kept = np.asarray(logits) / temperature
    if top_k is not None:
      kept = np.where(np.asarray(logits) >= np.sort(np.asarray(logits))[-top_k], kept, -np.inf)
    p = np.exp(kept - kept.max()) / np.exp(kept - kept.max()).sum()
    freq = np.bincount(drawn, minlength=4) / n
    np.testing.assert_allclose(freq, p, atol=5 * np.sqrt(p * (1 - p) / n).max() + 1e-12)


def test_sampling_with_top_k_draws_only_from_the_k_kept_tokens():
  """4,096 rows of four tied logits at top_k 2: a draw comes from tokens 0 and 1 only (the other two are at -inf,
  of probability 0), and from both."""
  tokens = sample(jnp.zeros((4096, 4)), jax.random.key(0), Sampling(top_k=2))
  assert set(np.asarray(tokens).tolist()) == {0, 1}


def padding_on_top(m: models.GPT, real: int) -> models.GPT:
  """m (tied embeddings, biases) made to rank its padding ids (>= real) first at every position: the final
  LayerNorm gives its bias alone (scale 0), all ones, and the padding rows of the tied embedding are ones too, so
  each padding logit is d_model (32) where a real one, of a row drawn at 0.5, is about N(0, 2.8)."""
  m = nnx.clone(m)
  m.ln_f.scale[...] = jnp.zeros_like(m.ln_f.scale[...])
  m.ln_f.bias[...] = jnp.ones_like(m.ln_f.bias[...])
  m.wte.embedding[...] = m.wte.embedding[...].at[real:].set(1.0)
  return m


@pytest.mark.parametrize("sampling", [GREEDY, Sampling(top_k=5, seed=1), Sampling(temperature=1.0, seed=2),
                                      Sampling(temperature=3.0, seed=3)], ids=["greedy", "top-k", "t1", "t3"])
def test_padding_ids_are_never_sampled_however_likely(sampling):
  """A vocabulary padded past the tokenizer's ids (GPT-2's 50257 to 50304): no data trains the padding ids as
  targets, so their logits may be anything, here the largest. With real_vocab the draw leaves them out (as logits of
  -inf); without it they are what greedy, top-k and temperature sampling pick."""
  real, m = 50, padding_on_top(model(config(n_layer=1)), 50)
  unmasked = generate(m, PROMPTS[:2], max_new_tokens=NEW, sampling=sampling).tokens
  assert min(int(t.min()) for t in unmasked) >= real  # the padding logits do rank first
  masked = generate(m, PROMPTS[:2], max_new_tokens=NEW, sampling=dataclasses.replace(sampling, real_vocab=real)).tokens
  assert max(int(t.max()) for t in masked) < real
  if sampling.temperature == 0:  # greedy among the real ids: the argmax of their logits, recomputed
    logits = forward(m)
    for prompt, tokens in zip(PROMPTS[:2], masked):
      assert tokens.tolist() == greedy_by_recomputation(lambda seq: logits(seq)[:, :real], prompt, NEW)


def test_sample_draws_only_ids_below_real_vocab():
  logits = jnp.array([[0.0, 1.0, 9.0, 8.0]] * 4096)  # (4096, 4): ids 2 and 3, past real_vocab 2, the most likely
  assert set(np.asarray(sample(logits, jax.random.key(0), Sampling(real_vocab=2))).tolist()) == {0, 1}
  assert np.asarray(sample(logits, jax.random.key(0), Sampling(temperature=0, real_vocab=2))).tolist() == [1] * 4096
  assert np.asarray(sample(logits, jax.random.key(0), Sampling(top_k=1, real_vocab=3))).tolist() == [2] * 4096


def test_parameters_cast_once_to_the_compute_dtype():
  m = model(config(dtype="bfloat16"))
  d = Decoder(m, batch=1, cache_len=64, prompt_len=64, sampling=GREEDY)
  assert {x.dtype for x in jax.tree.leaves(d.params)} == {jnp.dtype(jnp.bfloat16)}
  assert {x.dtype for x in jax.tree.leaves(nnx.state(m, nnx.Param))} == {jnp.dtype(jnp.float32)}  # model untouched
  assert len(generate(m, [PROMPTS[0]], max_new_tokens=4, sampling=GREEDY).tokens[0]) == 4


def test_te_fp8_model_samples_under_xla_from_its_parameters_alone():
  """A te-fp8 model (buildable on CPU, not runnable) carries FP8Meta state beside its parameters;
  backend="xla" rebuilds the graph around the parameters only."""
  fp8_model = models.GPT(config("te-fp8", dtype="bfloat16"), rngs=nnx.Rngs(0))
  assert jax.tree.leaves(nnx.state(fp8_model, nnx.Not(nnx.Param)))  # FP8Meta variables are there
  xla_model = models.GPT(config("xla", dtype="bfloat16"), rngs=nnx.Rngs(1))
  nnx.update(xla_model, nnx.state(fp8_model, nnx.Param))
  got = generate(fp8_model, PROMPTS, max_new_tokens=6, sampling=GREEDY, backend="xla").tokens
  want = generate(xla_model, PROMPTS, max_new_tokens=6, sampling=GREEDY).tokens
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("prompts, new, message", [
    ([], 5, "no prompts"),
    ([np.array([], np.int32)], 5, "the prompt is empty"),
    ([np.arange(100) % 64], 5, "the prompt has 100 tokens, more than the model's context (seq_len 96)"),
    ([np.arange(90) % 64], 10, "past the model's context (seq_len 96): at most 6 new tokens fit"),
    ([np.arange(96) % 64], 1, "the prompt fills the model's context (seq_len 96): no new token fits"),
    ([np.array([3, 64])], 5, "token ids in [0, 64)"),
    ([np.array([3])], 0, "max_new_tokens must be an integer >= 1 (the new tokens per prompt); got 0"),
    ([np.array([3.0, 4.0])], 5, "prompt 0 must hold integer token ids in [0, 64); got float64 values"),
    ([np.array(["a", "b"])], 5, "prompt 0 must hold integer token ids in [0, 64); got <U1 values"),
    ([np.array([True, False])], 5, "prompt 0 must hold integer token ids in [0, 64); got bool values"),
    (np.array([3, 4, 5]), 5, "prompt 0 must be 1-d token ids; got shape () (one number: prompts is a list of "
                             "prompts, so one prompt goes as [ids])"),  # was three prompts of one token each
    ([np.array([[3, 4, 5]])], 5, "prompt 0 must be 1-d token ids; got shape (1, 3) (a 2-d array of equal-length"),
    ("abc", 5, "prompts must be a list of token id arrays; got a str: encode the text to token ids first"),
    (5, 5, "prompts must be a list of token id arrays (1-d, one per row); got 5"),
], ids=["none", "empty", "too-long", "no-room", "full", "bad-id", "zero-new", "float-ids", "str-ids", "bool-ids",
        "one-1d-array", "2d-prompt", "text", "number"])
def test_bad_prompts_are_clear_errors(prompts, new, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    generate(model(config(n_layer=1)), prompts, max_new_tokens=new)


@pytest.mark.parametrize("kw, message", [
    ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
    ({"temperature": float("inf")}, "temperature must be a finite number >= 0"),
    ({"top_k": 0}, "top_k must be an integer >= 1"),
    ({"seed": 2**32}, r"seed must be an integer in \[0, 2\*\*32\)"),  # jax.random.key(2**32) is key(0): same draws
    ({"seed": 2**63}, r"seed must be an integer in \[0, 2\*\*32\)"),  # jax.random.key raised OverflowError
    ({"seed": -1}, r"seed must be an integer in \[0, 2\*\*32\)"),
    ({"seed": 1.5}, r"seed must be an integer in \[0, 2\*\*32\)"),  # a TypeError from inside the compiled prefill
    ({"real_vocab": 0}, r"real_vocab must be an integer >= 1 \(the ids the tokenizer gives"),
    ({"real_vocab": 50.0}, r"real_vocab must be an integer >= 1"),
    ({"real_vocab": True}, r"real_vocab must be an integer >= 1"),
])
def test_bad_sampling_is_a_clear_error(kw, message):
  with pytest.raises(ValueError, match=message):
    Sampling(**kw)


@pytest.mark.parametrize("kw, message", [
    ({"max_new_tokens": 2.0}, "max_new_tokens must be an integer >= 1 (the new tokens per prompt); got 2.0"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer >= 1 (the new tokens per prompt); got True"),
    ({"max_new_tokens": -2}, "max_new_tokens must be an integer >= 1 (the new tokens per prompt); got -2"),
    ({"max_new_tokens": "3"}, "max_new_tokens must be an integer >= 1 (the new tokens per prompt); got '3'"),
    ({"max_new_tokens": None}, "max_new_tokens must be an integer >= 1 (the new tokens per prompt); got None"),
    ({"stop_token": 2.0}, "stop_token must be a token id, an integer in [0, 64), or None to stop only at "
                          "max_new_tokens; got 2.0"),
    ({"stop_token": True}, "stop_token must be a token id, an integer in [0, 64), or None"),
    ({"stop_token": 64}, "stop_token must be a token id, an integer in [0, 64), or None"),
    ({"stop_token": 50, "sampling": Sampling(real_vocab=50)}, "stop_token must be a token id, an integer in [0, 50), "
     "or None to stop only at max_new_tokens; got 50 (ids from 50 on are past real_vocab: never drawn)"),
    ({"sampling": Sampling(real_vocab=65)}, "real_vocab (65) must be <= the model's vocab_size (64)"),
    ({"sampling": Sampling(top_k=51, real_vocab=50)}, "top_k (51) must be <= real_vocab (50), the ids drawn from"),
    ({"sampling": None}, "sampling must be a models.generate.Sampling, e.g. Sampling(temperature=0.8, top_k=40); "
                         "got None"),
    ({"sampling": {"temperature": 0}}, "sampling must be a models.generate.Sampling"),
    ({"model": object()}, "model must be a models.GPT; got object"),
], ids=["new-float", "new-bool", "new-negative", "new-str", "new-none", "stop-float", "stop-bool", "stop-65th",
        "stop-past-real-vocab", "real-vocab-past-vocab", "top-k-past-real-vocab", "sampling-none", "sampling-dict",
        "model"])
def test_bad_arguments_of_generate_are_clear_errors(kw, message):
  """Each names the argument, the value given and what it takes; 2.0 new tokens raised a TypeError about shapes
  from inside jax, True was one new token, and a float stop token was taken."""
  args = {"model": model(config(n_layer=1)), "max_new_tokens": 3} | kw
  with pytest.raises(ValueError, match=re.escape(message)):
    generate(args.pop("model"), [PROMPTS[0]], **args)


def test_top_k_beyond_the_vocabulary_is_a_clear_error():
  with pytest.raises(ValueError, match=r"top_k \(65\) must be <= the model's vocab_size \(64\)"):
    generate(model(config(n_layer=1)), [PROMPTS[0]], max_new_tokens=3, sampling=Sampling(top_k=65))


def test_token_ids_outside_the_vocabulary_are_a_clear_error():
  """The lookup read id -1 as the last token's row (finite, wrong logits) and ids >= vocab_size as NaN."""
  m = model(config(n_layer=1))
  for bad in (-1, 64):
    with pytest.raises(ValueError, match=r"tokens must be ids in \[0, vocab_size=64\); got values in"):
      m(jnp.array([[1, bad]], jnp.int32))


def test_decode_padding_past_lengths_is_not_checked_but_real_tokens_are():
  """With decode and lengths, the right padding past each row's length is never read: any value passes there;
  a bad id among the real tokens is refused, saying so."""
  m = model(config(n_layer=1))
  m.init_cache(2, 16)
  out = m(jnp.array([[1, 2, 3], [4, -1, -1]], jnp.int32), decode=True, lengths=jnp.array([3, 1]), last_only=True)
  assert out.shape == (2, 1, 64) and bool(jnp.all(jnp.isfinite(out)))
  with pytest.raises(ValueError, match=r"got values in \[-1, 4\] among each row's first lengths tokens"):
    m(jnp.array([[-1, 2], [4, 7]], jnp.int32), decode=True, lengths=jnp.array([1, 1]))


def test_known_tokens_and_positions_are_checked_inside_a_jit_too():
  """Arrays a jitted function closes over are known, and checked; np.min(positions) called the jax array's own
  min there, a tracer, and int() of it raised ConcretizationTypeError."""
  m = model(config(n_layer=1))
  tokens, positions = jnp.ones((1, 4), jnp.int32), jnp.arange(4)[None]
  np.testing.assert_allclose(jax.jit(lambda: m(tokens, positions=positions))(), m(tokens, positions=positions),
                             rtol=1e-5, atol=1e-5)  # fused under jit: float32 rounding apart
  with pytest.raises(ValueError, match="positions must lie in"):
    far = positions + 100  # known (computed outside the jit)
    jax.jit(lambda: m(tokens, positions=far))()


def test_decode_calls_of_the_model_check_their_input():
  m = model(config(n_layer=1))
  with pytest.raises(ValueError, match="call model.init_cache"):
    m(jnp.zeros((1, 2), jnp.int32), decode=True)
  with pytest.raises(ValueError, match="lengths= applies with decode=True only"):
    m(jnp.zeros((1, 2), jnp.int32), lengths=jnp.array([1]))
  m.init_cache(1, 96)
  m(jnp.zeros((1, 90), jnp.int32), decode=True)
  with pytest.raises(ValueError, match=r"row 0 would reach position 99: past the model's context \(seq_len 96"):
    m(jnp.zeros((1, 10), jnp.int32), decode=True)
  with pytest.raises(ValueError, match=r"max_length \(97\) must be in \[1, seq_len=96\]"):
    m.init_cache(1, 97)


def test_a_cache_with_one_index_for_the_batch_is_refused_saying_so():
  """A KV cache as Flax's own attention layer makes it (a scalar cache_index, here copied in from
  nnx.MultiHeadAttention.init_cache) is refused, saying the index is a scalar and how to make a cache with one
  position per row; the message was "the cache holds no rows (init_cache(batch=...))". A cache of another batch
  still names both counts."""
  m = model(config(n_layer=1))
  m.init_cache(2, 16)
  flax_layer = nnx.MultiHeadAttention(m.cfg.n_head, m.cfg.d_model, decode=True, rngs=nnx.Rngs(0))
  flax_layer.init_cache((2, 16, m.cfg.d_model))
  nnx.update(m.blocks[0].attn, nnx.state(flax_layer, nnx.Cache))
  assert m.blocks[0].attn.cache_index[...].shape == ()
  with pytest.raises(ValueError, match=re.escape(
      "the KV cache's cache_index is a scalar, one position for every row (as Flax's own attention layer keeps it); "
      "the model needs one position per row, shape (B,) = (2,): make the cache with "
      "model.init_cache(batch, max_length)")):
    m(jnp.zeros((2, 1), jnp.int32), decode=True)
  m.init_cache(3, 16)
  with pytest.raises(ValueError, match=re.escape("the cache holds 3 rows (init_cache(batch=...)), tokens have 2")):
    m(jnp.zeros((2, 1), jnp.int32), decode=True)


@pytest.fixture
def calls(monkeypatch) -> list:
  """The description (attnlayers.spec.Call) of every attention call planned from now on: the model's real calls
  as they are traced, and the stand-ins models.plans builds."""
  seen, real = [], attnlayers.core.plan
  monkeypatch.setattr(attnlayers.core, "plan", lambda backend, call: seen.append(call) or real(backend, call))
  return seen


@pytest.mark.parametrize("overrides", [{}, {"window": 8, "window_pattern": "local,global"},
                                       {"n_kv_head": 1, "seq_len": 80}], ids=["plain", "windows", "MQA"])
def test_the_decoders_reported_kernels_are_planned_from_its_real_calls(calls, overrides):
  decoder = Decoder(model(config(**overrides)), batch=3, cache_len=64, prompt_len=16, sampling=GREEDY)
  traced = set(calls)  # compiling the prefill and decode programs traced every layer's call
  calls.clear()
  plans = decoder.attention_plans()
  assert set(p.call for ps in plans.values() for p in ps) == traced
  assert decoder.attention_ran() == "prefill xla, decode xla"  # on a CPU


@pytest.mark.parametrize("pack", [False, True], ids=["unpacked", "packed"])
def test_the_trainers_plans_are_its_steps_real_calls(calls, pack):
  cfg = config(window=8, window_pattern="local,global", seq_len=48)
  B, T = 2, cfg.seq_len
  tokens = jnp.zeros((B, T), jnp.int32)
  packed = {"segment_ids": jnp.ones((B, T), jnp.int32), "positions": jnp.broadcast_to(jnp.arange(T), (B, T))}
  m = model(cfg)
  calls.clear()
  m(tokens, **(packed if pack else {}))  # eager: the packed inputs are checked on their values
  traced = set(calls)
  calls.clear()
  assert set(p.call for p in plans.attention_plans(cfg, B, T, pack=pack)) == traced
