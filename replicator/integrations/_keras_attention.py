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

With ``Replicator(context_parallel="ulysses")`` the queries, keys and values
are laid out by heads over those axes first (``with_layout``: an all-to-all
from a split of the tokens to a split of the heads, DeepSpeed-Ulysses), each
device attends over whole sequences of its heads, and the output is laid out
by tokens again (their gradients likewise, the other way). The heads must
divide over the axes: an ``ArgumentError`` says so, and the fix.

Private Keras API, in this module only (Keras 3.15.1; tests/test_keras_attention.py
fails if it changes): ``keras.src.backend.tensorflow.nn.dot_product_attention``,
which ``keras.ops.dot_product_attention`` calls, is replaced for the trace and
put back after it.
"""

from __future__ import annotations

import contextlib
import functools
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
RING_ACROSS = ("context_parallel='ring': keys and values all-gathered, as the sequence's axes span worker "
               "processes (TensorFlow's collectives have no point-to-point send there: a ring step would be an "
               "all-gather)")
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
  those axes span worker processes (a point-to-point permute is an all-gather there: the keys and values are
  all-gathered once instead, the ring's bytes).
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
    with _keras_hub_attention.routed(nn.dot_product_attention):  # KerasHub's layers: this attention too
      yield
  finally:
    nn.dot_product_attention = original


_context.add_trace_hook(blockwise_attention)
