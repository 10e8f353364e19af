"""Ring attention: attention over a sequence split across devices, keys and values passed around a ring.

Each device holds its queries, keys and values for its tokens (``[batch,
tokens, heads, head size]``, Keras's and KerasHub's layout). In ``P`` steps
over a mesh axis of ``P`` devices, each device scores its queries against
the key block it holds, folds the block into a running (online) softmax, and
passes the block on to the next device (``permute``, point to point): after
``P`` steps every query has met every key. Nothing of size ``S x S`` is ever
gathered; a device computes and keeps for its backward pass the scores of
its queries against the sequence, ``S^2 / P`` of one device's, and the ``P``
key and value blocks it saw. The gradients ride the ring back (the gradient
of a ``permute`` is the reverse ``permute``).

Masks are computed from global positions (``_sequence.sequence_positions`` of the
block's device of origin, known while the step is built), so causal attention
means on every device what it means on one, in either token order. Every
block is computed, those entirely above the diagonal too (their terms are
zero): skipping them on some devices and not others would make the devices'
backward passes differ in the order of their permutes, which are matched by
order (same shapes: one device's keys' gradient would meet another's values').
So a causal split costs a whole split's scores in either order; the zigzag
order balances the useful ones (for a later skip that keeps the order). ``key_mask``
(``[batch, tokens]``, True where a key may be attended: padding) travels
with its keys. Masked scores get ``-1e9`` added, as Keras's softmax does, so
the result equals one device's attention with the same mask.

The running maximum is only there for the exponentials' range: the result
does not depend on it, so it is taken under ``stop_gradient`` (Ring
Attention's ``max_score``), and the backward pass keeps no second copy of
the scores for it.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from replicator.core import _errors
from replicator.core import _primitives
from replicator.core import _sequence

MASKED = -1e9  # added to a masked score (Keras's softmax adds the same; -3e4 in float16, its range)


def _masked(dtype) -> float:
  return -3e4 if dtype == tf.float16 else MASKED


def _check(q, k, v, location: str) -> None:
  for name, t in (("q", q), ("k", k), ("v", v)):
    if t.shape.rank != 4:
      raise _errors.ArgumentError(f"repl.ring_attention at {location}: {name} has shape {t.shape}; expected "
                                  "[batch, tokens, heads, head size] (a device's tokens). Fix: reshape it "
                                  "(Keras's MultiHeadAttention and KerasHub's layers use this layout).")
  if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2] or q.shape[3] != k.shape[3] or q.shape[2] != k.shape[2]:
    raise _errors.ArgumentError(f"repl.ring_attention at {location}: q {q.shape}, k {k.shape}, v {v.shape} do not "
                                "agree: k and v need the same tokens and heads, q and k the same heads and head "
                                "size. Fix: repeat grouped key/value heads to the query heads first.")


def ring_attention(ctx, q, k, v, axes: tuple[str, ...], causal: bool, order: str, key_mask, scale,
                   location: str):
  """Attention of this device's queries over the whole split sequence (see the module)."""
  q, k, v = (tf.convert_to_tensor(t) for t in (q, k, v))
  _check(q, k, v, location)
  mesh = ctx.replicator.mesh
  count, index = mesh.axis_size(axes), mesh.axis_index(ctx.replica_id, axes)
  tokens = q.shape[1]
  if tokens is None or k.shape[1] != tokens:
    raise _errors.ArgumentError(
        f"repl.ring_attention at {location}: every device's queries and keys hold the same tokens of one sequence "
        f"(static sizes); found q {q.shape}, k {k.shape}. Fix: split the sequence evenly (replicator.shard_sequence).")
  length = tokens * count
  mine = _sequence.sequence_positions(length, index, count, order)
  scale = float(q.shape[3]) ** -0.5 if scale is None else float(scale)
  ring = [(i, (i + 1) % count) for i in range(count)]
  block = (k, v) if key_mask is None else (k, v, tf.cast(key_mask, tf.bool))
  shape = tf.shape(q)
  running_max = tf.fill([shape[0], shape[2], tokens], tf.constant(-np.inf, q.dtype))  # [batch, heads, queries]
  total = tf.zeros([shape[0], shape[2], tokens], q.dtype)
  out = tf.zeros_like(q)
  for step in range(count):
    origin = (index - step) % count  # the device whose keys this block holds
    keys = _sequence.sequence_positions(length, origin, count, order)
    allowed = mine[:, None] >= keys[None, :] if causal else None
    # every block, masked ones too (see the module: a skipped block changes the backward pass's order)
    kb, vb = block[0], block[1]
    scores = tf.einsum("bqhd,bkhd->bhqk", q, kb) * tf.cast(scale, q.dtype)
    if allowed is not None:  # (on every block, all-allowed ones too: the same ops on every device)
      scores += tf.constant(np.where(allowed, 0.0, _masked(q.dtype)), q.dtype)
    if key_mask is not None:
      scores += tf.where(block[2], tf.constant(0, q.dtype), tf.constant(_masked(q.dtype), q.dtype))[:, None, None, :]
    new_max = tf.stop_gradient(tf.maximum(running_max, tf.reduce_max(scores, axis=-1)))
    weights = tf.exp(scores - new_max[..., None])
    rescale = tf.exp(running_max - new_max)
    total = total * rescale + tf.reduce_sum(weights, axis=-1)
    out = out * tf.transpose(rescale, [0, 2, 1])[..., None] + tf.einsum("bhqk,bkhd->bqhd", weights, vb)
    running_max = new_max
    if step < count - 1:
      block = tuple(_primitives.permute(ctx, t, ring, axes, location) for t in block)
  return out / tf.transpose(total, [0, 2, 1])[..., None]
