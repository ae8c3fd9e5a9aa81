"""GPT model configuration: one frozen dataclass and the named presets."""

from __future__ import annotations

import dataclasses
import numbers

import jax.numpy as jnp

from attnlayers import BACKENDS, ArgumentError
from attnlayers.spec import FP8_CORE_MODES
from models.ops import KERNELS

WINDOW_KINDS = ("local", "global")  # window_pattern's words: the layer uses the sliding window, or sees every token


def is_integer(x) -> bool:
  """Whether x is an int, numpy's included, and not a bool: True is an int to Python, never a count, size or id
  here. The models' checks of counts, sizes, seeds and ids all use this one."""
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  vocab_size: int = 50304  # token ids; GPT-2's 50257 padded to a multiple of 64 (never sampled: Sampling.real_vocab)
  seq_len: int = 1024  # longest context; size of the learned position table
  n_layer: int = 12  # transformer blocks
  n_head: int = 12  # query heads
  n_kv_head: int | None = None  # key/value heads (GQA: a divisor of n_head; 1 = MQA); None = n_head
  d_model: int = 768  # residual stream width; head dim = d_model // n_head
  mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * d_model
  dropout: float = 0.0  # residual/embedding dropout (nanoGPT's); 0 for pre-training speed
  backend: str = "auto"  # attention kernel, any name in attnlayers.BACKENDS
  fp8_core: str = "fp8"  # te-fp8 only: its attention core, "fp8" (or refuse), "fp8-or-bf16" or "bf16"
  causal: bool = True  # causal self-attention (a decoder); False gives a bidirectional encoder
  dtype: str = "bfloat16"  # compute dtype of activations and matmuls
  param_dtype: str = "float32"  # parameters and optimizer state
  tie_embeddings: bool = True  # output projection reuses the token embedding (GPT-2)
  bias: bool = True  # biases in the Linears and LayerNorms (GPT-2); False: none (nanoGPT's train.py default)
  window: int | None = None  # sliding window: each query sees itself and the window - 1 tokens before it; None = all
  window_pattern: str | None = None  # with window: "local"/"global" per layer, comma-separated, cycled; None: all local
  max_segments: int | None = None  # packed rows: the most documents one holds (te runs B * max_segments sequences); None: seq_len
  kernels: str = "auto"  # the model's own GPU kernels (LayerNorm, bias + GELU, loss): models.ops.KERNELS

  def __post_init__(self):
    self._check_types()
    kv = self.n_kv_head or self.n_head
    if self.d_model % self.n_head:
      raise ArgumentError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head}): n_head one of "
                          f"{_divisors(self.d_model)}, or another d_model", arguments=("n_head", "d_model"),
                          value=self.n_head, expected=f"one of {_divisors(self.d_model)}")
    if self.n_head % kv:
      raise ArgumentError(f"n_head ({self.n_head}) must be divisible by n_kv_head ({kv}): n_kv_head one of "
                          f"{_divisors(self.n_head)} (1 = MQA, {self.n_head} = MHA)", arguments=("n_kv_head", "n_head"),
                          value=kv, expected=f"one of {_divisors(self.n_head)}")
    if self.fp8_core != "fp8" and self.backend != "te-fp8":
      raise ArgumentError(f"fp8_core={self.fp8_core!r} applies to backend 'te-fp8' only; got backend {self.backend!r}",
                          arguments=("fp8_core", "backend"), value=self.fp8_core, expected="'fp8' or backend 'te-fp8'")
    if not isinstance(self.bias, bool):
      raise ArgumentError(f"bias must be True (biases in the Linears and LayerNorms) or False (none); got "
                          f"{self.bias!r}", arguments=("bias",), value=self.bias, expected="True or False")
    if self.kernels not in KERNELS:
      raise ArgumentError(f"kernels must be one of {KERNELS} (models.kernels); got {self.kernels!r}",
                          arguments=("kernels",), value=self.kernels, expected=f"one of {KERNELS}")
    self._check_window()
    if self.window is not None:  # a numpy int (is_integer takes them) kept as the Python int that JSON records
      object.__setattr__(self, "window", int(self.window))

  def _check_types(self) -> None:
    """Each field's kind and range, before any arithmetic on them: a size of 0 divided by (ZeroDivisionError), a
    str counted with (TypeError), or a bad name or rate accepted and failing only when the model is built or run."""
    def refuse(name: str, expected: str):
      value = getattr(self, name)
      raise ArgumentError(f"{name} must be {expected}; got {value!r}", arguments=(name,), value=value,
                          expected=expected)
    for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
      if not is_integer(getattr(self, name)) or getattr(self, name) < 1:
        refuse(name, "an int >= 1")
    for name, none in (("n_kv_head", "n_head"), ("max_segments", "seq_len")):
      value = getattr(self, name)
      if value is not None and (not is_integer(value) or value < 1):
        refuse(name, f"an int >= 1, or None for {none}")
    rate = self.dropout
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0 <= rate < 1:
      refuse("dropout", "a number in [0, 1)")
    for name in ("causal", "tie_embeddings"):
      if not isinstance(getattr(self, name), bool):
        refuse(name, "True or False")
    if self.backend not in BACKENDS:
      refuse("backend", f"one of {', '.join(BACKENDS)}")
    if self.fp8_core not in FP8_CORE_MODES:
      refuse("fp8_core", f"one of {', '.join(FP8_CORE_MODES)}")
    for name in ("dtype", "param_dtype"):
      try:
        floating = jnp.issubdtype(jnp.dtype(getattr(self, name)), jnp.floating)
      except TypeError:
        floating = False
      if not floating:
        refuse(name, "a floating dtype's name, e.g. 'bfloat16' or 'float32'")

  def _check_window(self) -> None:
    w, kinds = self.window, self.pattern.split(",")
    if w is not None and (not is_integer(w) or w < 1):
      raise ArgumentError(f"window must be an int >= 1 (tokens each query sees, itself included) or None for "
                          f"every earlier token; got {w!r}", arguments=("window",), value=w, expected="an int >= 1")
    if w is not None and not self.causal:
      raise ArgumentError(f"window ({w}) applies to causal models: a window of N tokens is the query and the N - 1 "
                          "before it; a bidirectional model (causal=False) takes window=None",
                          arguments=("window", "causal"), value=w, expected="None")
    if any(k not in WINDOW_KINDS for k in kinds) or "local" not in kinds:
      raise ArgumentError(f"window_pattern must list {' or '.join(map(repr, WINDOW_KINDS))} per layer, "
                          f"comma-separated, at least one 'local' (e.g. 'local,global'); got {self.window_pattern!r}",
                          arguments=("window_pattern",), value=self.window_pattern,
                          expected="'local' and 'global' per layer, at least one 'local'")
    if w is None and self.window_pattern is not None:
      raise ArgumentError(f"window_pattern {self.window_pattern!r} says which layers use the window; give window "
                          "(tokens per window) too", arguments=("window", "window_pattern"), value=w,
                          expected="an int >= 1")
    layers = layer_kinds(self.pattern, self.n_layer)
    if w is not None and "local" not in layers:  # the pattern's 'local' lies past the last layer
      first = kinds.index("local")
      raise ArgumentError(
          f"window_pattern {self.window_pattern!r} makes no layer of the {self.n_layer} (n_layer) local: it is read "
          f"from layer 0 on, so the layers are {','.join(layers)!r} and the window ({w}) would apply to none; put "
          f"'local' among its first {self.n_layer} entries (e.g. {','.join((['local'] + kinds[1:])[:self.n_layer])!r}), "
          f"give "
          f"n_layer {first + 1} or more, or leave out window for no sliding window",
          arguments=("window_pattern", "n_layer", "window"), value=self.window_pattern,
          expected=f"'local' among the first {self.n_layer} entries")
    if len(kinds) > self.n_layer:  # entries past the last layer would never be read
      raise ArgumentError(
          f"window_pattern {self.window_pattern!r} has {len(kinds)} entries for {self.n_layer} layers (n_layer): "
          f"entries past the last layer would apply to none; give at most {self.n_layer} (e.g. "
          f"{','.join(kinds[:self.n_layer])!r}, which is what these layers would use) or more layers",
          arguments=("window_pattern", "n_layer"), value=self.window_pattern,
          expected=f"at most {self.n_layer} entries")

  def layer_window(self, layer: int) -> tuple[int, int] | None:
    """Layer `layer`'s sliding_window for attnlayers: (window - 1, 0), or None where it attends every earlier
    token (no window, a 'global' layer, or a window that covers the whole context: window >= seq_len)."""
    kinds = self.pattern.split(",")
    if self.window is None or self.window >= self.seq_len or kinds[layer % len(kinds)] == "global":
      return None
    return (self.window - 1, 0)

  @property
  def pattern(self) -> str:
    """window_pattern as the layers read it: "local" (every layer) where it is None."""
    return "local" if self.window_pattern is None else self.window_pattern

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_head

  def architecture(self) -> dict:
    """The fields that shape the parameters, and the attention window: what a checkpoint must agree on to
    resume, and what python -m sample rebuilds the model from. The window fields appear only when a window
    is set, so a checkpoint written before they existed reads as what it is: no window (one without "bias"
    has biases: train.checkpoint.ABSENT_MODEL). The pattern is recorded as the layers read it (`pattern`): a
    window_pattern of None is "local", as checkpoints recorded the default before it was None."""
    fields = ("vocab_size", "seq_len", "n_layer", "n_head", "n_kv_head", "d_model", "mlp_ratio",
              "param_dtype", "tie_embeddings", "bias")
    window = {"window": self.window, "window_pattern": self.pattern} if self.window is not None else {}
    return {f: getattr(self, f) for f in fields} | {"n_kv_head": self.n_kv_head or self.n_head} | window


def _divisors(n: int, most: int = 12) -> str:
  """n's divisors, the first `most` of them, for a message."""
  found = [d for d in range(1, n + 1) if n % d == 0]
  return ", ".join(map(str, found[:most])) + (", ..." if len(found) > most else "")


def layer_kinds(window_pattern: str, n_layer: int) -> list[str]:
  """Each layer's kind, "local" or "global": the comma-separated pattern read from layer 0, cycled (as
  GPTConfig.layer_window reads it)."""
  kinds = window_pattern.split(",")
  return [kinds[i % len(kinds)] for i in range(n_layer)]


PRESETS: dict[str, GPTConfig] = {
    # byte-level, trains in seconds to minutes on 2 CPU cores
    "tiny": GPTConfig(vocab_size=256, seq_len=128, n_layer=2, n_head=4, n_kv_head=2, d_model=128,
                      dtype="float32"),
    # GPT-2 small (~124M) and medium (~350M), nanoGPT's shapes
    "gpt2-small": GPTConfig(),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, d_model=1024),
    # ~1.07B (0.97B in the blocks + the tied 50304 x 2048 embedding): where FP8 is meant to pay; head dim 128
    # (the FP8 attention core's), GQA with 4 key/value heads, a 2048-token context
    "gpt-1b": GPTConfig(seq_len=2048, n_layer=22, n_head=16, n_kv_head=4, d_model=2048),
    # ~7.27B (7.05B in the blocks): Mistral-7B's width, heads and GQA (d_model 4096, 32 heads of dim 128, 8 key/value
    # heads, a 4096-token context), 40 blocks where it has 32, as its SwiGLU MLP has three matrices and this GELU
    # MLP two; the scaling model's larger size (benchmarks.scaling, docs/scaling.md)
    "gpt-7b": GPTConfig(seq_len=4096, n_layer=40, n_head=32, n_kv_head=8, d_model=4096),
}


def preset(name: str, **overrides) -> GPTConfig:
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
  overrides = {k: v for k, v in overrides.items() if v is not None}
  return dataclasses.replace(PRESETS[name], **overrides)
