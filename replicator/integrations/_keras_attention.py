"""Keras's ``dot_product_attention``, blockwise in a global-view step that splits more than the batch.

Keras 3's ``MultiHeadAttention`` (without dropout, not returning its scores)
and any layer calling ``keras.ops.dot_product_attention`` compute attention
on TensorFlow with plain ops: the whole ``[batch, heads, queries, keys]``
score matrix, kept for the backward pass. Over a sequence split across
devices the global view gives each device its queries' rows of it (``1 / P``
of one device's), materialized and kept. While the step of a Replicator
that splits its inputs beyond the batch (``input_layouts=``) or lays out a
layer's output (a ``"<layer>/output"`` key) is traced, Keras's TensorFlow
backend computes it instead as ``_blockwise_attention`` does: an online
softmax over as many blocks of keys as the devices along the mesh's other
axes, FlashAttention's backward pass, nothing of the scores kept. The
results are one device's (the same function, summed in another order).
Other calls (flash attention asked for, a soft cap, a bias, not 4-D) are
Keras's own. KerasHub's attention layers compute attention with plain ops
on TensorFlow (they call ``dot_product_attention`` only where KerasHub finds
a fused kernel, on JAX and PyTorch); for the trace ``_keras_hub_attention``
makes Llama's and Gemma's call this one instead, with their keys and values
as they were before the layer repeated them for grouped-query attention (the
heads of a block of keys meet their group of query heads in one product,
never repeated).

With ``Replicator(context_parallel="ring")`` it is ``_blockwise_ring``'s
ring instead: the keys and values passed from device to device a tile a
step (where the sequence's axes are in one process and divide its length:
:func:`ring_tiles`), their gradients passed back.

``MultiHeadAttention``'s mask from its inputs' Keras masks (an
``Embedding(mask_zero=True)``'s or a ``Masking`` layer's padding: the
queries' and the keys'), with ``use_causal_mask=True`` or not, reaches that
attention as its pieces (:func:`padding_as_pieces`): the queries' padding
``[batch, 1, queries, 1]`` and the keys' ``[batch, 1, 1, keys]`` (a tuple of
masks, their AND) and ``is_causal``, never made one ``[batch, queries,
keys]`` mask. A device's queries' padding is its own rows, the keys' is a
vector going with the keys (the ring rolls it with them, ``b S / P``
elements a step; the all-gather and Ulysses gather it), the causal mask is
made from each block's global positions: no collective of a mask over
queries and keys (the ring's would be one of a tile pair's size a step).
A query all of whose keys are masked (a padding query) attends to every
key uniformly, as on one device. An ``attention_mask=`` tensor, a sliding
window, and the calls Keras's attention does not make (dropout, the scores
returned, flash attention) or a subclass whose ``call`` or
``_compute_attention`` is its own keep Keras's own mask.

With ``Replicator(context_parallel="ulysses")`` the queries, keys and values
are laid out by heads over those axes first (``with_layout``: an all-to-all
from a split of the tokens to a split of the heads, DeepSpeed-Ulysses), each
device attends over whole sequences of its heads, and the output is laid out
by tokens again (their gradients likewise, the other way). The heads must
divide over the axes: an ``ArgumentError`` says so, and the fix.

Private Keras API, in this module only (Keras 3.15.1; tests/test_keras_attention.py
fails if it changes): ``keras.src.backend.tensorflow.nn.dot_product_attention``,
which ``keras.ops.dot_product_attention`` calls, is replaced for the trace and
put back after it; so are ``MultiHeadAttention``'s ``_compute_attention_mask``
and ``_compute_attention`` (:data:`MHA_PARAMETERS`: left as they are if their
parameters differ), which read :data:`MHA_ATTRIBUTES`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import sys

import tensorflow as tf

from replicator.core import _blockwise_attention
from replicator.core import _blockwise_ring
from replicator.core import _context
from replicator.core import _errors
from replicator.core import _layout_constraint
from replicator.core import _primitives
from replicator.core import _ring_attention
from replicator.integrations import _keras_hub_attention

_MODULE = "keras.src.backend.tensorflow.nn"
MHA = ("keras.src.layers.attention.multi_head_attention", "MultiHeadAttention")
MHA_PARAMETERS = {  # MultiHeadAttention's methods replaced for the trace, and their parameters (Keras 3.15.1)
    "_compute_attention_mask": ("self", "query", "value", "query_mask", "value_mask", "key_mask", "attention_mask",
                                "use_causal_mask"),
    "_compute_attention": ("self", "query", "key", "value", "attention_mask", "training", "return_attention_scores",
                           "use_causal_mask"),
}
MHA_ATTRIBUTES = ("_sliding_window", "_dropout", "_flash_attention", "_inverse_sqrt_key_dim")  # read by the above
RING_ACROSS = ("context_parallel='ring': keys and values all-gathered, as the sequence's axes span worker "
               "processes (one collective there, not P - 1 rounds of sends between the processes)")
RING_UNEVEN = ("context_parallel='ring': keys and values all-gathered, as {tiles} tiles do not divide {queries} "
               "queries and {keys} keys")
ULYSSES_HEADS = (
    "Replicator(context_parallel='ulysses') moves attention from a split of the tokens to a split of the heads over "
    "{axes} ({devices} devices), but the attention at {location} has {heads} heads (after grouped keys are "
    "repeated), which {devices} does not divide. Fix: a number of heads divisible by {devices}, or "
    "context_parallel='all_gather' (the keys and values gathered: any number of heads).")


def blocks_for(replicator) -> int:
  """How many blocks of keys attention takes in ``replicator``'s global-view steps (1: Keras's own attention)."""
  layouts = replicator.layouts
  if replicator.input_layouts is None and not (layouts is not None and layouts.output_keys()):
    return 1
  shape = replicator.mesh.shape
  return math.prod(size for axis, size in shape.items() if axis not in replicator.batch_axes)


def ring_tiles(replicator) -> int:
  """The ring's length with ``context_parallel="ring"``: the devices a sequence is split over (1: no ring).

  The axes of the inputs' second dimension where ``input_layouts`` is one spec, else every non-batch axis; 1 where
  those axes span worker processes (the keys and values are all-gathered once there, the ring's bytes in one
  collective).
  """
  axes = _sequence_axes(replicator)
  spec = replicator.input_layouts
  if isinstance(spec, (tuple, list)) and len(spec) > 1:
    second = spec[1] if isinstance(spec[1], (tuple, list)) else (spec[1],) if spec[1] else ()
    axes = tuple(a for a in second if replicator.mesh.shape.get(a, 1) > 1)
  if not axes or _ring_attention.exchange_for(replicator.mesh, 0, axes, "auto") != "ring":
    return 1
  return math.prod(replicator.mesh.shape[a] for a in axes)


def _sequence_axes(replicator) -> tuple[str, ...]:
  """The mesh axes a sequence is split over: the non-batch axes that split anything."""
  return tuple(a for a, size in replicator.mesh.shape.items() if a not in replicator.batch_axes and size > 1)


def _ulysses(replicator, query, key, value, attend):
  """``attend(q, k, v)`` on whole sequences of each device's heads (see the module)."""
  axes, location = _sequence_axes(replicator), _primitives.user_location()
  devices = math.prod(replicator.mesh.shape[a] for a in axes)
  if query.shape[2] % devices:
    raise _errors.ArgumentError(ULYSSES_HEADS.format(axes=axes, devices=devices, location=location,
                                                     heads=query.shape[2]))
  batch = tuple(a for a in replicator.batch_axes if replicator.mesh.shape[a] > 1) or None
  by_heads, by_tokens = (batch, None, axes, None), (batch, axes, None, None)

  def moved(t, source, target):  # t by source, then by target: forward and backward, an all-to-all each way
    t = _layout_constraint.with_layout(replicator, t, source, location=location)
    return _layout_constraint.with_layout(replicator, t, target, location=location)

  # Stated on both sides, so that the gradients move back too: the output's comes back by tokens and moves to the
  # heads before attention's backward pass (which runs on each device's heads alone), and the queries', keys' and
  # values' move to the tokens before their projections' backward passes.
  query, key, value = (moved(t, by_tokens, by_heads) for t in (query, key, value))
  return moved(attend(query, key, value), by_heads, by_tokens)


def _blockwise(original, blocks: int, replicator):
  def dot_product_attention(query, key, value, bias=None, mask=None, scale=None, is_causal=False,
                            flash_attention=None, attn_logits_soft_cap=None):
    shapes = [tf.convert_to_tensor(t).shape for t in (query, key, value)]
    if (flash_attention or attn_logits_soft_cap is not None or bias is not None
            or any(s.rank != 4 or not s.is_fully_defined() for s in shapes)):
      if isinstance(mask, tuple):  # (MultiHeadAttention's pieces, joined: Keras's attention takes one mask)
        mask = functools.reduce(tf.logical_and, mask)
      return original(query, key, value, bias=bias, mask=mask, scale=scale, is_causal=is_causal,
                      flash_attention=flash_attention, attn_logits_soft_cap=attn_logits_soft_cap)
    query, key, value = (tf.convert_to_tensor(t) for t in (query, key, value))
    dtype = tf.experimental.numpy.result_type(query.dtype, key.dtype, value.dtype)
    query, key, value = (tf.cast(t, dtype) for t in (query, key, value))
    heads, kv_heads = query.shape[2], key.shape[2]
    groups = heads // kv_heads if heads > kv_heads else 1  # grouped-query attention: a key head a group
    scale = 1.0 / math.sqrt(key.shape[-1]) if scale is None else scale

    def attend(q, k, v, groups=groups):
      return _blockwise_attention.attention(q, k, v, mask=mask, is_causal=is_causal, scale=scale, blocks=blocks,
                                            groups=groups)

    if replicator.context_parallel == "ring":
      tiles = ring_tiles(replicator)
      if _blockwise_ring.divides(query, key, tiles):
        return _blockwise_ring.attention(query, key, value, mask=mask, is_causal=is_causal, scale=scale, tiles=tiles,
                                         groups=groups)
      why = (RING_ACROSS if tiles == 1 and _sequence_axes(replicator) else
             RING_UNEVEN.format(tiles=tiles, queries=query.shape[1], keys=key.shape[1]))
      with _primitives.noted(why, "ring_as_all_gather"):  # (explain's "called at" says why)
        return attend(query, key, value)
    if replicator.context_parallel == "ulysses":  # (the key heads repeated first: the query heads divide)
      key, value = (tf.repeat(t, repeats=groups, axis=2) if groups > 1 else t for t in (key, value))
      return _ulysses(replicator, query, key, value, functools.partial(attend, groups=1))
    return attend(query, key, value)  # (the keys gathered before they are repeated, block by block)

  dot_product_attention.__doc__ = original.__doc__
  return dot_product_attention


class _Pieces:
  """``MultiHeadAttention``'s mask as its pieces: the queries' padding ``[batch, 1, queries, 1]``, the keys'
  ``[batch, 1, 1, keys]`` (the value's and the key's Keras masks, joined), each boolean or None, and ``causal``;
  ``dense()`` is Keras's own ``[batch, queries, keys]`` mask (``_compute_attention_mask``'s), for the calls
  :func:`padding_as_pieces` leaves to Keras."""

  def __init__(self, queries, keys, causal: bool, dense):
    self.masks = tuple(m for m in (queries, keys) if m is not None)
    self.causal = causal
    self.dense = dense


def _padding(mask, shape):
  """A Keras mask ``[batch, length]`` as a boolean ``shape``, or None."""
  return None if mask is None else tf.reshape(tf.cast(mask, tf.bool), shape)


def _mha_methods():
  """``MultiHeadAttention`` and its two methods as :data:`MHA_PARAMETERS` expects them, or None."""
  cls = getattr(sys.modules.get(MHA[0]), MHA[1], None)
  if cls is None:
    return None
  methods = tuple(cls.__dict__.get(name) for name in MHA_PARAMETERS)
  if any(m is None or tuple(inspect.signature(m).parameters) != MHA_PARAMETERS[name]
         for m, name in zip(methods, MHA_PARAMETERS)):
    return None
  return cls, methods


@contextlib.contextmanager
def padding_as_pieces(attention):
  """While entered, ``MultiHeadAttention``'s Keras masks (padding, causal) reach ``attention`` as pieces (see the module).

  Args:
    attention: Keras's ``dot_product_attention`` as this module makes it for the trace.
  """
  found = _mha_methods()
  if found is None:
    yield
    return
  cls, (compute_mask, compute_attention) = found
  mha_call = cls.__dict__["call"]

  def _compute_attention_mask(self, query, value, query_mask=None, value_mask=None, key_mask=None,
                              attention_mask=None, use_causal_mask=False):
    def dense():
      return compute_mask(self, query, value, query_mask=query_mask, value_mask=value_mask, key_mask=key_mask,
                          attention_mask=attention_mask, use_causal_mask=use_causal_mask)

    masks = [m for m in (query_mask, value_mask, key_mask) if m is not None]
    if (attention_mask is not None or self._sliding_window is not None or not masks
            or type(self).call is not mha_call or type(self)._compute_attention is not replaced
            or not all(tf.is_tensor(t) for t in [query, value] + masks)
            or not all(t.shape.rank == 3 and t.shape.is_fully_defined() for t in (query, value))
            or any(m.shape.rank != 2 for m in masks)):
      return dense()  # (an attention_mask= tensor, a sliding window, a subclass's call: Keras's own mask)
    (b, queries, _), keys = query.shape, value.shape[1]
    key_padding = [_padding(m, [b, 1, 1, keys]) for m in (value_mask, key_mask) if m is not None]
    return _Pieces(_padding(query_mask, [b, 1, queries, 1]),
                   functools.reduce(tf.logical_and, key_padding) if key_padding else None,
                   bool(use_causal_mask), dense)

  def _compute_attention(self, query, key, value, attention_mask=None, training=None,
                         return_attention_scores=False, use_causal_mask=False):
    causal = {"use_causal_mask": True} if use_causal_mask else {}  # (as Keras's call passes it: only if True)
    if not isinstance(attention_mask, _Pieces):
      return compute_attention(self, query, key, value, attention_mask, training, return_attention_scores, **causal)
    if self._dropout > 0.0 or return_attention_scores or self._flash_attention or len(query.shape) != 4:
      return compute_attention(self, query, key, value, attention_mask.dense(), training, return_attention_scores)
    return attention(query, key, value, mask=attention_mask.masks, scale=self._inverse_sqrt_key_dim,
                     is_causal=attention_mask.causal), None

  try:
    cls._compute_attention_mask = functools.wraps(compute_mask)(_compute_attention_mask)
    replaced = cls._compute_attention = functools.wraps(compute_attention)(_compute_attention)
    yield
  finally:
    cls._compute_attention_mask, cls._compute_attention = compute_mask, compute_attention


@contextlib.contextmanager
def blockwise_attention(replicator):
  """While ``replicator``'s step is traced, Keras's attention on TensorFlow runs blockwise (see the module)."""
  nn = sys.modules.get(_MODULE)
  blocks = blocks_for(replicator)
  if nn is None or blocks <= 1 or not hasattr(nn, "dot_product_attention"):
    yield
    return
  original = nn.dot_product_attention
  nn.dot_product_attention = _blockwise(original, blocks, replicator)
  try:
    with (_keras_hub_attention.routed(nn.dot_product_attention),  # KerasHub's layers: this attention too
          padding_as_pieces(nn.dot_product_attention)):
      yield
  finally:
    nn.dot_product_attention = original


_context.add_trace_hook(blockwise_attention)
