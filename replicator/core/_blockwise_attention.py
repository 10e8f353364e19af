"""Attention computed block by block of keys, at global shapes: the global view's attention over a split sequence.

``softmax(q k^T * scale + bias, masked) v`` (Keras's ``dot_product_attention``
semantics: a boolean ``mask`` broadcast to ``[batch, heads, queries, keys]``,
``is_causal`` for key ``j`` seen by query ``i`` only if ``j <= i``, masked
scores set to ``-0.7`` of the dtype's largest value) as an online softmax over
``blocks`` blocks of keys: a running maximum and denominator per query, each
block's scores made, folded in and dropped. The backward pass is
FlashAttention's: each block's scores recomputed from ``q`` and the block,
with each query's maximum score and denominator kept from the forward pass.
What is kept for the backward pass is ``q``, ``k``, ``v``, the output and
those two, never the scores.

These are plain TensorFlow ops at the step's global shapes, so the global
view partitions them as any: over a sequence split by queries, each device
takes its queries' rows of every block (the keys and values gathered once
and sliced block by block, locally), so it holds at most ``s x S / blocks``
scores a head at a time, and keeps none of them for the backward pass.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf


def large_negative(dtype) -> float:
  """The score a masked key gets (Keras's: ``-0.7`` of the dtype's largest value; float16's for float16)."""
  return -0.7 * (65500.0 if dtype == tf.float16 else 3.38953e38)


def _edges(length: int, blocks: int) -> list[tuple[int, int]]:
  """``blocks`` consecutive ranges covering ``range(length)`` (the last ones shorter where it does not divide)."""
  size = -(-length // max(1, min(blocks, length)))
  return [(start, min(start + size, length)) for start in range(0, length, size)]


def _block(t, start: int, stop: int, axis: int):
  """``t``'s positions ``[start, stop)`` along ``axis`` (a dimension of size 1 broadcasts: kept whole)."""
  if t is None or t.shape[axis] == 1:
    return t
  begin, size = [0] * t.shape.rank, [-1] * t.shape.rank
  begin[axis], size[axis] = start, stop - start
  return tf.slice(t, begin, size)


def attention(q, k, v, *, bias=None, mask=None, is_causal: bool = False, scale: float, blocks: int,
              groups: int = 1):
  """``[batch, queries, heads, size]``: attention of ``q`` over ``k`` and ``v`` (see the module), blockwise.

  Args:
    q: ``[batch, queries, heads, size]``; ``k``, ``v``: ``[batch, keys, heads / groups, size]``.
    bias: added to the scores, broadcast to ``[batch, heads, queries, keys]``, or None.
    mask: boolean, broadcast likewise (True: the key is seen), or None.
    is_causal: key ``j`` seen by query ``i`` only if ``j <= i``.
    scale: the scores' scale.
    blocks: how many blocks of keys.
    groups: grouped-query attention: each key and value head serves ``groups`` query heads (repeated block by
      block, so that a split sequence's keys are gathered before they are repeated).
  """
  queries, keys = q.shape[1], k.shape[1]
  edges = _edges(keys, blocks)
  logits_dtype = tf.float32 if q.dtype in (tf.float16, tf.bfloat16) else q.dtype
  negative = large_negative(logits_dtype)
  mask = None if mask is None else tf.convert_to_tensor(mask, tf.bool)
  bias = None if bias is None else tf.convert_to_tensor(bias)

  def scores_of(q, kb, start, stop):  # [batch, heads, queries, keys of the block], masked
    s = tf.cast(tf.einsum("btnh,bsnh->bnts", q, kb), logits_dtype) * tf.cast(scale, logits_dtype)
    if bias is not None:
      s += tf.cast(_block(bias, start, stop, -1), logits_dtype)
    allowed = _block(mask, start, stop, -1)
    if is_causal:
      causal = tf.constant(np.arange(queries)[:, None] >= np.arange(start, stop)[None, :])
      allowed = causal if allowed is None else tf.logical_and(allowed, causal)
    if allowed is not None:
      s = tf.where(allowed, s, tf.constant(negative, logits_dtype))
    return s, allowed

  def repeated(t):  # a block's key or value heads, one a query head
    return t if groups == 1 else tf.repeat(t, repeats=groups, axis=2)

  def per_key(d, x):  # d [batch, heads, queries, keys] times x [batch, queries, heads, size], summed over the
    # queries and each group's query heads: [batch, keys, heads / groups, size], one product (its partial sums
    # over a split of the queries summed once, in the key heads)
    if groups == 1:
      return tf.einsum("bnts,btnh->bsnh", d, x)
    (b, n, t, s), size = d.shape.as_list(), x.shape[-1]
    return tf.einsum("bkgts,btkgh->bskh", tf.reshape(d, [b, n // groups, groups, t, s]),
                     tf.reshape(x, [b, t, n // groups, groups, size]))

  @tf.custom_gradient
  def blockwise(q, k, v):
    running_max, total, out = None, None, None
    for start, stop in edges:
      s, _ = scores_of(q, repeated(k[:, start:stop]), start, stop)
      block_max = tf.reduce_max(s, axis=-1)
      new_max = block_max if running_max is None else tf.maximum(running_max, block_max)
      weights = tf.exp(s - new_max[..., None])
      part = tf.einsum("bnts,bsnh->btnh", tf.cast(weights, v.dtype), repeated(v[:, start:stop]))
      if running_max is None:
        total, out = tf.reduce_sum(weights, axis=-1), tf.cast(part, logits_dtype)
      else:
        rescale = tf.exp(running_max - new_max)  # [batch, heads, queries]
        total = total * rescale + tf.reduce_sum(weights, axis=-1)
        out = out * tf.transpose(rescale, [0, 2, 1])[..., None] + tf.cast(part, logits_dtype)
      running_max = new_max
    out = out / tf.transpose(total, [0, 2, 1])[..., None]
    # (the maximum and the denominator kept apart: a row with every key masked has the masked score as its maximum,
    # a float the log of a denominator added to would not change)
    result = tf.cast(out, v.dtype)

    def grad(dout):
      with tf.name_scope("gradients"):  # (the backward pass's ops, as the rewrite tells them: by their scope)
        return backward(dout)

    def backward(dout):
      dout = tf.cast(dout, logits_dtype)
      # The keys and values read through an IdentityN on the gradient (their values, a data input on it): over a
      # split sequence the partition gathers them again once the backward pass reaches attention, not as soon as
      # their pieces exist (with the forward pass, then held until here).
      keys, values = tf.raw_ops.IdentityN(input=[k, v, dout])[:2]
      delta = tf.transpose(tf.reduce_sum(dout * tf.cast(result, logits_dtype), axis=-1), [0, 2, 1])
      dq = tf.zeros_like(q, logits_dtype)
      dks, dvs = [], []
      for start, stop in edges:
        kb, vb = repeated(keys[:, start:stop]), repeated(values[:, start:stop])
        s, allowed = scores_of(q, kb, start, stop)
        p = tf.exp(s - running_max[..., None]) / total[..., None]  # the block's probabilities
        dvs.append(per_key(p, dout))
        dp = tf.einsum("btnh,bsnh->bnts", dout, tf.cast(vb, logits_dtype))
        ds = p * (dp - delta[..., None]) * tf.cast(scale, logits_dtype)
        if allowed is not None:  # (a masked score is a constant: no gradient, even in a row with nothing seen)
          ds = tf.where(allowed, ds, tf.zeros_like(ds))
        dq += tf.einsum("bnts,bsnh->btnh", ds, tf.cast(kb, logits_dtype))
        dks.append(per_key(ds, tf.cast(q, logits_dtype)))
      dk, dv = (tf.concat(d, axis=1) if len(d) > 1 else d[0] for d in (dks, dvs))
      return tf.cast(dq, q.dtype), tf.cast(dk, k.dtype), tf.cast(dv, v.dtype)

    return result, grad

  return blockwise(q, k, v)
