"""Ulysses attention: a split sequence's attention by trading the sequence split for a heads split.

DeepSpeed-Ulysses: each device holds its tokens of every head (``[batch,
tokens, heads, head size]``). An all-to-all over the sequence's axis gives
each device every token of ``heads / P`` heads; it computes their attention
whole, on its own, and a second all-to-all gives the tokens back. Per layer a
device sends ``4 x its tokens' q, k, v, out x (P - 1) / P`` bytes, whatever
the sequence's length; it holds its heads' scores, ``1 / P`` of one device's.
The heads must divide over the axis (:data:`NOT_DIVISIBLE`: the ring does
not need it).

Masks are built from global positions as the ring's are: the tokens after the
exchange are every device's in device order, each at the positions
``_sequence.sequence_positions`` gives it.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from replicator.core import _errors
from replicator.core import _primitives
from replicator.core import _ring_attention
from replicator.core import _sequence

NOT_DIVISIBLE = (
    "repl.ulysses_attention at {location}: {heads} heads cannot be split over the {count} devices of {axes} "
    "(Ulysses gives each device heads / devices of them). Fix: use repl.ring_attention (any number of heads), or a "
    "number of heads the devices divide (grouped keys and values: repeat them to the query heads first)."
)


def ulysses_attention(ctx, q, k, v, axes: tuple[str, ...], causal: bool, order: str, key_mask, scale,
                      location: str, window: int | None = None, segment_ids=None):
  """Attention of this device's tokens over the whole split sequence, by two all-to-alls (see the module)."""
  q, k, v = (tf.convert_to_tensor(t) for t in (q, k, v))
  _ring_attention.check(q, k, v, location, "repl.ulysses_attention")
  count = ctx.replicator.mesh.axis_size(axes)
  heads, tokens = q.shape[2], q.shape[1]
  if heads % count:
    raise _errors.ArgumentError(NOT_DIVISIBLE.format(location=location, heads=heads, count=count, axes=axes))
  length = tokens * count
  exchange = lambda t: _primitives.all_to_all(ctx, t, 2, 1, axes, location)  # noqa: E731  (heads -> tokens)
  qa, ka, va = exchange(q), exchange(k), exchange(v)  # [batch, every token, heads / P, head size]
  positions = np.concatenate([_sequence.sequence_positions(length, j, count, order) for j in range(count)])
  scale = float(q.shape[3]) ** -0.5 if scale is None else float(scale)
  scores = tf.einsum("bqhd,bkhd->bhqk", qa, ka) * tf.cast(scale, q.dtype)
  masked = _ring_attention.masked(q.dtype)
  allowed = _ring_attention.allowed_positions(positions, positions, causal, window)
  if allowed is not None:
    scores += tf.constant(np.where(allowed, 0.0, masked), q.dtype)
  if key_mask is not None:
    every = _primitives.all_gather(ctx, tf.cast(key_mask, q.dtype), 1, axes, location)  # [batch, every token]
    scores += ((1 - every) * tf.constant(masked, q.dtype))[:, None, None, :]
  if segment_ids is not None:  # every token's segment, for the queries and the keys alike
    segments = _primitives.all_gather(ctx, tf.cast(segment_ids, tf.int32), 1, axes, location)
    scores += _ring_attention.segment_bias(segments, segments, q.dtype)
  out = tf.einsum("bhqk,bkhd->bqhd", tf.nn.softmax(scores), va)
  return _primitives.all_to_all(ctx, out, 1, 2, axes, location)  # back: this device's tokens, every head
