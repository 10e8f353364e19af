"""KerasHub's attention layers computed by Keras's ``dot_product_attention``, their keys and values not repeated.

KerasHub's decoders compute attention on TensorFlow with plain ops (einsum,
mask, softmax, einsum): they call ``keras.ops.dot_product_attention`` only
where KerasHub finds a fused kernel (JAX, PyTorch). Over a sequence split
across devices, the global view then gives each device its queries' score
rows ``[batch, heads, queries / P, keys]``, materialized and kept for the
backward pass. While ``_keras_attention`` runs Keras's attention blockwise
(a global-view step that splits more than the batch), :func:`routed` makes
the layers below compute theirs with that attention instead: no score rows
kept, one device's results (the same function, summed in another order).

The keys and values go to it before their heads are repeated for
grouped-query attention, so that a split sequence's keys are gathered at
``[batch, keys, key heads, size]`` (each block's key heads then meet their
group of query heads in one product, never repeated):

* ``LlamaAttention`` (Llama, Llama 3): its ``call`` repeats the keys and
  values (``ops.repeat(key, repeats=self.num_key_value_groups, axis=2)``)
  before it calls ``_compute_attention(query, key, value, attention_mask)``;
  this takes the repeat's own input back off the traced graph (nothing of
  the repeat is then computed, nor its gradient), and the layer's scale
  (``_inv_norm_factor``) and mask (``[batch, queries, keys]``).
* ``CachedGemmaAttention`` (Gemma): ``_compute_attention(q, k, v,
  attention_mask, training, cache_update_index)`` takes the keys and values
  unrepeated; its scale (``query_head_dim_normalize``) and sliding window
  (``_mask_sliding_window``) are kept. With a logit soft cap or dropout it is
  KerasHub's own (the blockwise attention has neither).

A decoder's mask (``[batch, queries, keys]``: its padding mask's minimum
with the causal one, as both decoders make it, queries and keys the same
tokens) is passed as causal plus the keys' padding (each key's own row of
it, :func:`_causal_keys`): the ring then rolls the keys' padding with them
instead of cutting a mask over queries and keys into tile pairs (a
collective of score-tile size each step). Gemma's sliding window keeps the
whole mask.

Anything else (a shape not static, heads that do not match) is the layer's
own. Private KerasHub API, in this module only (KerasHub 0.32.0;
tests/test_keras_hub_attention.py fails if it changes): the classes above,
their ``_compute_attention`` (replaced on the class for the trace and put
back after it) and the attributes named; a layer whose method's parameters
or ``call``'s repeat differ from these is left as it is.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys

import numpy as np
import tensorflow as tf

LLAMA = ("keras_hub.src.models.llama.llama_attention", "LlamaAttention")
GEMMA = ("keras_hub.src.models.gemma.gemma_attention", "CachedGemmaAttention")
LLAMA_PARAMETERS = ("self", "query", "key", "value", "attention_mask")
GEMMA_PARAMETERS = ("self", "q", "k", "v", "attention_mask", "training", "cache_update_index")
LLAMA_REPEAT = "ops.repeat(key, repeats=self.num_key_value_groups, axis=2)"  # in LlamaAttention.call


def _static(*tensors) -> bool:
  return all(t.shape.rank == 4 and t.shape.is_fully_defined() for t in tensors)


def _mask(attention_mask):
  """KerasHub's ``[batch, queries, keys]`` mask (0/1) as Keras attention's: boolean, a heads dimension of 1."""
  return None if attention_mask is None else tf.cast(tf.convert_to_tensor(attention_mask)[:, None], tf.bool)


def _causal_keys(attention_mask):
  """A decoder's ``[batch, queries, keys]`` mask (its padding mask's minimum with the causal one, as KerasHub's
  decoders make it) as its keys' padding, ``[batch, 1, 1, keys]`` boolean: each key's own row says whether it is
  padding (a key not padding sees itself). With ``is_causal``, the same mask, never cut into tile pairs (a mask
  over queries and keys would be: each pair a collective of score-row size in the ring)."""
  m = tf.cast(tf.convert_to_tensor(attention_mask), tf.float32)
  length = m.shape[1]
  diagonal = tf.cast(tf.equal(tf.range(length)[:, None], tf.range(length)[None, :]), tf.float32)
  return (tf.reduce_max(m * diagonal, axis=1) > 0.5)[:, None, None, :]


def _llama(original, attention):
  def _compute_attention(self, query, key, value, attention_mask=None):
    query, key, value = (tf.convert_to_tensor(t) for t in (query, key, value))
    groups = self.num_key_value_groups
    if not _static(query, key, value) or key.shape[2] != query.shape[2] or query.shape[2] % groups:
      return original(self, query, key, value, attention_mask)
    if groups > 1:
      key, value = unrepeated(key, groups), unrepeated(value, groups)
    if attention_mask is not None and query.shape[1] == key.shape[1]:  # (a decoder's: causal, the keys' padding)
      return attention(query, key, value, mask=_causal_keys(attention_mask), scale=self._inv_norm_factor,
                       is_causal=True)
    return attention(query, key, value, mask=_mask(attention_mask), scale=self._inv_norm_factor)

  return _compute_attention


def unrepeated(t, groups: int):
  """``t`` as it was before ``ops.repeat(t, repeats=groups, axis=2)`` (each head ``groups`` times in a row).

  In a trace, the repeat's own input, read off the graph: TensorFlow's repeat is a reshape of a tile of
  ``expand_dims(x, 3)``, and shapes ``x [b, s, h, d]``, tile ``[b, s, h, groups, d]``, reshape ``[b, s, h * groups,
  d]`` make it one (nothing of the repeat, its copy or its gradient then computed). Otherwise the first of each
  group of heads: a reshape and an index of a dimension no layout splits (a strided slice of the heads would
  want them whole).
  """
  batch, length, heads, size = t.shape
  try:
    tile = t.op.inputs[0].op
    expand = tile.inputs[0].op
    found = expand.inputs[0]
    if ((t.op.type, tile.type, expand.type) == ("Reshape", "Tile", "ExpandDims")
            and found.shape == (batch, length, heads // groups, size)
            and tile.outputs[0].shape == (batch, length, heads // groups, groups, size)):
      return found
  except (AttributeError, IndexError):  # (an eager tensor has no op)
    pass
  return tf.reshape(t, [batch, length, heads // groups, groups, size])[:, :, :, 0]


def _gemma(original, attention):
  def _compute_attention(self, q, k, v, attention_mask, training=False, cache_update_index=0):
    q, k, v = (tf.convert_to_tensor(t) for t in (q, k, v))
    if (self.logit_soft_cap is not None or self.dropout or not _static(q, k, v)
            or q.shape[2] != k.shape[2] * self.num_key_value_groups):
      return original(self, q, k, v, attention_mask, training=training, cache_update_index=cache_update_index)
    # (KerasHub's scale, on the scores here: on one device it multiplies the queries by it)
    size = self.head_dim if self.query_head_dim_normalize else self.hidden_dim // self.num_query_heads
    if self.use_sliding_window_attention and attention_mask is not None:
      attention_mask = self._mask_sliding_window(attention_mask, cache_update_index=cache_update_index)
    elif attention_mask is not None and q.shape[1] == k.shape[1]:  # (a decoder's: causal, the keys' padding)
      return attention(q, k, v, mask=_causal_keys(attention_mask), scale=1 / np.sqrt(size), is_causal=True)
    return attention(q, k, v, mask=_mask(attention_mask), scale=1 / np.sqrt(size))

  return _compute_attention


def _parameters(method) -> tuple[str, ...]:
  return tuple(inspect.signature(method).parameters)


@functools.lru_cache(maxsize=None)
def _repeats_before(cls) -> bool:
  """Whether ``cls.call`` repeats the keys as :data:`LLAMA_REPEAT` before computing attention."""
  try:
    return LLAMA_REPEAT in inspect.getsource(cls.call)
  except (OSError, TypeError):
    return False


def _layers():
  """(class, the replacement's maker) of each layer above that this KerasHub has as expected."""
  found = []
  for (module, name), parameters, make in ((LLAMA, LLAMA_PARAMETERS, _llama), (GEMMA, GEMMA_PARAMETERS, _gemma)):
    cls = getattr(sys.modules.get(module), name, None)
    method = None if cls is None else cls.__dict__.get("_compute_attention")
    if method is None or _parameters(method) != parameters or (make is _llama and not _repeats_before(cls)):
      continue
    found.append((cls, make))
  return found


@contextlib.contextmanager
def routed(attention):
  """While entered, KerasHub's attention layers (those imported) compute with ``attention`` (see the module).

  Args:
    attention: Keras's ``dot_product_attention`` as ``_keras_attention`` makes it for the trace: ``(query, key,
      value, mask=, scale=)``, keys and values of fewer heads than the queries for grouped-query attention.
  """
  replaced = []
  try:
    for cls, make in _layers():
      original = cls.__dict__["_compute_attention"]
      cls._compute_attention = functools.wraps(original)(make(original, attention))
      replaced.append((cls, original))
    yield
  finally:
    for cls, original in reversed(replaced):
      cls._compute_attention = original
