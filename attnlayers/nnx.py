"""`attnlayers.nnx.MultiHeadAttention`: flax.nnx.MultiHeadAttention with a kernel choice.

A subclass of Flax's class, so every constructor and call argument of the installed Flax
keeps its meaning and the parameter tree (names, shapes, initialisers) is Flax's own; a
checkpoint moves between Flax's class and this one, and between backends, unchanged.
Added, keyword-only:

  backend:   any name in attnlayers.BACKENDS (default "auto"; see attnlayers.explain).
  is_causal: default for the call's `is_causal` (the call's value wins when given).
  fp8_recipe: with backend="te-fp8", how the FP8 projections are scaled and how the attention
             core runs (attnlayers.fp8.FP8Recipe; default TE DelayedScaling, HYBRID, history
             1024, max, and core="fp8": cuDNN FP8 attention or a clear refusal).

With backend="te-fp8" the q/k/v/out projections run as TransformerEngine FP8 GEMMs; their
scaling state is FP8Meta variables beside the parameters (see attnlayers.fp8), which a
training step must carry: `nnx.split(layer, nnx.Param, FP8Meta)`.

In decode mode the cache's own position mask makes the one new query causal, so
`is_causal` is not applied to it.
"""

from __future__ import annotations

from flax import nnx

from attnlayers import backends, fp8, spec
from attnlayers.flax_attention import BackendAttention


class MultiHeadAttention(nnx.MultiHeadAttention):
  """Drop-in for flax.nnx.MultiHeadAttention; `backend` picks the attention kernel.

  Example::

    layer = MultiHeadAttention(num_heads=8, in_features=512, num_kv_heads=2,
                               backend="cudnn", is_causal=True, decode=False,
                               dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    y = layer(x)  # x: (B, T, 512) -> (B, T, 512)

  A custom `attention_fn` replaces the backend choice altogether, so passing one
  together with a `backend` other than "auto" is an error.
  """

  def __init__(self, *args, backend: str = backends.AUTO, is_causal: bool = False, attention_fn=None,
               fp8_recipe: fp8.FP8Recipe | None = None, **kwargs):
    backends.check_name(backend)
    spec.check_num_kv_heads(kwargs.get("num_kv_heads"))
    if attention_fn is not None and backend != backends.AUTO:
      raise ValueError(f"pass either attention_fn= or backend= ({backend!r}), not both: a custom "
                       "attention_fn replaces the backend's kernel")
    if fp8_recipe is not None and backend != "te-fp8":
      raise ValueError(f"fp8_recipe= applies to backend='te-fp8' only; got backend={backend!r}")
    fp8_core = (fp8_recipe or fp8.FP8Recipe()).core
    super().__init__(*args, attention_fn=attention_fn or BackendAttention(backend, fp8_core=fp8_core), **kwargs)
    self.backend = backend if attention_fn is None else "custom attention_fn"
    self.is_causal = is_causal
    if backend == "te-fp8":
      fp8.use_fp8_projections(self, fp8_recipe or fp8.FP8Recipe())

  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, is_causal: bool | None = None,
               decode: bool | None = None, **kwargs):
    causal = self.is_causal if is_causal is None else is_causal
    if (self.decode if decode is None else decode):
      causal = False  # the cache mask already limits the new query to positions <= its own
    return super().__call__(inputs_q, inputs_k, inputs_v, is_causal=causal, decode=decode, **kwargs)
