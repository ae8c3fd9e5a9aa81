"""The GPT-style decoder that puts attnlayers to work."""

from models.config import PRESETS, GPTConfig, preset
from models.gpt import GPT, count_params, flops_per_token
from models.ops import KERNELS

__all__ = ["GPT", "GPTConfig", "PRESETS", "preset", "count_params", "flops_per_token", "KERNELS"]
