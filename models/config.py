"""GPT model configuration: one frozen dataclass and the named presets."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  vocab_size: int = 50304  # token ids; GPT-2's 50257 padded to a multiple of 64
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

  def __post_init__(self):
    kv = self.n_kv_head or self.n_head
    if self.d_model % self.n_head:
      raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
    if self.n_head % kv:
      raise ValueError(f"n_head ({self.n_head}) must be divisible by n_kv_head ({kv})")
    if self.fp8_core != "fp8" and self.backend != "te-fp8":
      raise ValueError(f"fp8_core={self.fp8_core!r} applies to backend 'te-fp8' only; got backend {self.backend!r}")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_head

  def architecture(self) -> dict:
    """The fields that shape the parameters: what a checkpoint must agree on to resume."""
    fields = ("vocab_size", "seq_len", "n_layer", "n_head", "n_kv_head", "d_model", "mlp_ratio",
              "param_dtype", "tie_embeddings")
    return {f: getattr(self, f) for f in fields} | {"n_kv_head": self.n_kv_head or self.n_head}


PRESETS: dict[str, GPTConfig] = {
    # byte-level, trains in seconds to minutes on 2 CPU cores
    "tiny": GPTConfig(vocab_size=256, seq_len=128, n_layer=2, n_head=4, n_kv_head=2, d_model=128,
                      dtype="float32"),
    # GPT-2 small (~124M) and medium (~350M), nanoGPT's shapes
    "gpt2-small": GPTConfig(),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, d_model=1024),
}


def preset(name: str, **overrides) -> GPTConfig:
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
  overrides = {k: v for k, v in overrides.items() if v is not None}
  return dataclasses.replace(PRESETS[name], **overrides)
