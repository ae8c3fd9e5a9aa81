"""Splash block-size calibration on the TPU: causal fwd+bwd, bf16, against XLA's attention; one table."""
import functools, itertools, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk, splash_attention_mask as sm

def timed(f, *args, calls=5, reps=3):
  f(*args)[0].block_until_ready()
  out = []
  for _ in range(reps):
    t = time.perf_counter()
    for _ in range(calls):
      r = f(*args)
    jax.block_until_ready(r)
    out.append((time.perf_counter() - t) / calls * 1e3)
  return statistics.median(out), min(out), max(out)

def splash_fn(B, T, N, K, H, bs, causal=True, fused=False):
  blocks = None if bs is None else sk.BlockSizes(block_q=bs, block_kv=bs, block_kv_compute=bs, block_q_dkv=bs,
      block_kv_dkv=bs, block_kv_dkv_compute=bs, block_q_dq=None if fused else bs, block_kv_dq=None if fused else bs,
      use_fused_bwd_kernel=fused)
  G = N // K
  m = sm.CausalMask((T, T)) if causal else sm.FullMask((T, T))
  kern = sk.make_splash_mqa_single_device(sm.MultiHeadMask([m] * G), block_sizes=blocks)
  def attn(q, k, v):  # q (B, T, N, H), k/v (B, T, K, H)
    qg = (q * H ** -0.5).reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4)  # (B, K, G, T, H)
    kk, vv = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (B, K, T, H)
    o = jax.vmap(jax.vmap(kern))(qg, kk, vv)  # (B, K, G, T, H)
    return o.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)
  return attn

def xla_fn(causal=True):
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

def step(attn):
  def loss(q, k, v):
    return jnp.sum(attn(q, k, v).astype(jnp.float32))
  return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))

print(jax.devices()[0].device_kind, jax.__version__)
rows = []
for (B, T, N, K, H) in [(8, 1024, 16, 16, 128), (2, 4096, 16, 4, 128), (2, 4096, 16, 16, 128), (1, 8192, 16, 4, 128), (8, 1024, 12, 12, 64)]:
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (B, T, N, H), jnp.bfloat16)
  k = jax.random.normal(ks[1], (B, T, K, H), jnp.bfloat16)
  v = jax.random.normal(ks[2], (B, T, K, H), jnp.bfloat16)
  try:
    base = timed(step(xla_fn()), q, k, v)
  except Exception as e:
    base = (float("nan"),) * 3; print("xla failed", str(e)[:200])
  ref = step(xla_fn())(q, k, v)[1][0] if base[0] == base[0] else None
  for bs, fused in [(None, False), (512, False), (1024, False), (1024, True), (2048, False)]:
    if bs and bs > T: continue
    try:
      f = step(splash_fn(B, T, N, K, H, bs, fused=fused))
      t = timed(f, q, k, v)
      err = float(jnp.max(jnp.abs(f(q, k, v)[1][0].astype(jnp.float32) - ref.astype(jnp.float32)))) if ref is not None else float("nan")
    except Exception as e:
      t, err = (float("nan"),) * 3, str(e).splitlines()[0][:120]
    rows.append((f"B{B} T{T} N{N} K{K} H{H}", f"{bs}{'f' if fused else ''}", base[0], t[0], t[1], t[2], base[0] / t[0], err))
    print(rows[-1], flush=True)
print(f"{'shape':28} {'blocks':7} {'xla ms':>8} {'splash ms (min-max)':>24} {'x':>6} dq err")
for r in rows:
  print(f"{r[0]:28} {r[1]:7} {r[2]:8.2f} {r[3]:8.2f} ({r[4]:.2f}-{r[5]:.2f}) {r[6]:6.2f} {r[7]}")
