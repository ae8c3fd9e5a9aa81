"""On an NVIDIA GPU: a training run that asks for more device memory than the GPU has ends in one line saying what
ran out, how much was asked and which flag to lower; no traceback (the CPU's cases: tests/test_resources.py)."""

import pytest

from tests.test_resources import one_error_line
from tests.test_train_faults import TINY, train_cli

pytestmark = pytest.mark.gpu
ONE_STEP = ["--steps", "1", "--no-ckpt", "--sample-tokens", "0", "--eval-every", "0", "--no-progress"]


@pytest.mark.parametrize("args, hint", [
    (["--attn", "cudnn", "--preset", "gpt2-small", "--batch-size", "4096"], "lower --batch-size"),
    (["--attn", "xla", "--preset", "gpt2-small", "--batch-size", "4096"], "lower --batch-size"),
    ([*TINY, "--attn", "naive", "--seq-len", "65536", "--batch-size", "64"], "--attn naive builds the (B, N, T, T)"),
], ids=["gpt2-small-batch-4096-cudnn", "gpt2-small-batch-4096-xla", "naive-T65536"])
def test_a_step_larger_than_the_gpu_is_one_line(args, hint):
  code, _, err = train_cli([*args, *ONE_STEP], cpu=False)  # the trainer on the GPU, as a user runs it
  line = one_error_line(err)
  assert code == 1 and line.startswith("error: out of memory on gpu") and "asked" in line and hint in line, err
