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


def repeated_tiles(t, groups: int):
  """Tiles of keys or values ``[b, P, tokens, heads / groups, size]`` repeated to the query heads."""
  return t if groups == 1 else tf.repeat(t, repeats=groups, axis=3)


def grouped_tiles(d, groups: int):
  """Gradients of repeated tiles (:func:`repeated_tiles`) summed over each group: ``[b, P, tokens, heads / groups,
  size]``."""
  if groups == 1:
    return d
  shape = d.shape.as_list()
  return tf.reduce_sum(tf.reshape(d, shape[:3] + [shape[3] // groups, groups] + shape[4:]), axis=4)


def heads_last(x):
  """A per-query value ``[b, P, heads, tokens]`` as ``[b, P, tokens, heads, 1]``, to scale outputs with."""
  return tf.transpose(x, [0, 1, 3, 2])[..., None]


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
    mask: boolean, broadcast likewise (True: the key is seen), a tuple of such masks (their AND), or None.
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
  masks = () if mask is None else tuple(tf.convert_to_tensor(m, tf.bool) for m in (
      mask if isinstance(mask, (tuple, list)) else (mask,)))
  bias = None if bias is None else tf.convert_to_tensor(bias)

  def scores_of(qg, kb, start, stop):  # [batch, heads, queries, keys of the block], masked (qg: by_group(q))
    s = tf.cast(per_query(qg, kb), logits_dtype) * tf.cast(scale, logits_dtype)
    if bias is not None:
      s += tf.cast(_block(bias, start, stop, -1), logits_dtype)
    allowed = None  # (a tuple's masks each cut to the block, then joined: no mask over queries and keys made whole)
    for m in masks:
      allowed = _block(m, start, stop, -1) if allowed is None else tf.logical_and(allowed, _block(m, start, stop, -1))
    if is_causal:
      causal = tf.constant(np.arange(queries)[:, None] >= np.arange(start, stop)[None, :])
      allowed = causal if allowed is None else tf.logical_and(allowed, causal)
    if allowed is not None:
      s = tf.where(allowed, s, tf.constant(negative, logits_dtype))
    return s, allowed

  # Grouped-query attention: each key and value head meets its group of query heads in one product (the query
  # heads [kv heads, groups] by a reshape), never repeated (a repeat is a dozen ops a block, and its copy).
  def by_group(x):  # [batch, queries, heads, size] -> [batch, queries, heads / groups, groups, size]
    if groups == 1:
      return x
    b, t, n, size = x.shape.as_list()
    return tf.reshape(x, [b, t, n // groups, groups, size])

  def per_query(xg, kb):  # xg (by_group) times a block kb [batch, keys, heads / groups, size], summed over the
    # size: [batch, heads, queries, keys]
    if groups == 1:
      return tf.einsum("btnh,bsnh->bnts", xg, kb)
    b, t, kv_heads, _, _ = xg.shape.as_list()
    return tf.reshape(tf.einsum("btkgh,bskh->bkgts", xg, kb), [b, kv_heads * groups, t, kb.shape[1]])

  def per_head(d, vb):  # d [batch, heads, queries, keys] times a block vb [batch, keys, heads / groups, size],
    # summed over the keys: [batch, queries, heads, size]
    if groups == 1:
      return tf.einsum("bnts,bsnh->btnh", d, vb)
    (b, n, t, s), size = d.shape.as_list(), vb.shape[-1]
    product = tf.einsum("bkgts,bskh->btkgh", tf.reshape(d, [b, n // groups, groups, t, s]), vb)
    return tf.reshape(product, [b, t, n, size])

  def per_key(d, xg):  # d [batch, heads, queries, keys] times xg (by_group), summed over the queries and each
    # group's query heads: [batch, keys, heads / groups, size], one product (its partial sums over a split of the
    # queries summed once, in the key heads)
    if groups == 1:
      return tf.einsum("bnts,btnh->bsnh", d, xg)
    b, n, t, s = d.shape.as_list()
    return tf.einsum("bkgts,btkgh->bskh", tf.reshape(d, [b, n // groups, groups, t, s]), xg)

  @tf.custom_gradient
  def blockwise(q, k, v):
    running_max, total, out = None, None, None
    qg = by_group(q)
    for start, stop in edges:
      s, _ = scores_of(qg, _block(k, start, stop, 1), start, stop)
      block_max = tf.reduce_max(s, axis=-1)
      new_max = block_max if running_max is None else tf.maximum(running_max, block_max)
      weights = tf.exp(s - tf.expand_dims(new_max, -1))
      part = per_head(tf.cast(weights, v.dtype), _block(v, start, stop, 1))
      if running_max is None:
        total, out = tf.reduce_sum(weights, axis=-1), tf.cast(part, logits_dtype)
      else:
        rescale = tf.exp(running_max - new_max)  # [batch, heads, queries]
        total = total * rescale + tf.reduce_sum(weights, axis=-1)
        out = out * tf.expand_dims(tf.transpose(rescale, [0, 2, 1]), -1) + tf.cast(part, logits_dtype)
      running_max = new_max
    out = out / tf.expand_dims(tf.transpose(total, [0, 2, 1]), -1)
    # (the maximum and the denominator kept apart: a row with every key masked has the masked score as its maximum,
    # a float the log of a denominator added to would not change)
    result = tf.cast(out, v.dtype)

    def grad(dout):
      with tf.name_scope("gradients"):  # (the backward pass's ops, as the rewrite tells them: by their scope)
        return backward(dout)

    def backward(dout):
      dout = tf.cast(dout, logits_dtype)
      delta = tf.transpose(tf.reduce_sum(dout * tf.cast(result, logits_dtype), axis=-1), [0, 2, 1])
      # q read once the gradient exists (q or q as it says: q, a data input on it), so that the scores are made
      # again as the backward pass reaches attention, not as soon as q and a block of keys exist (with the
      # forward pass or a layer early, then held until here)
      qg = by_group(tf.where(tf.math.is_nan(dout[..., :1]), q, q))
      qg_logits, dout_g = tf.cast(qg, logits_dtype), by_group(dout)
      maximum, denominator, delta = (tf.expand_dims(t, -1) for t in (running_max, total, delta))
      dq = None  # (no zeros to start from: a Fill of constants runs when the step starts, held until here)
      dks, dvs = [], []
      for start, stop in edges:
        kb, vb = _block(k, start, stop, 1), _block(v, start, stop, 1)
        s, allowed = scores_of(qg, kb, start, stop)
        p = tf.exp(s - maximum) / denominator  # the block's probabilities
        dvs.append(per_key(p, dout_g))
        dp = per_query(dout_g, tf.cast(vb, logits_dtype))
        ds = p * (dp - delta) * tf.cast(scale, logits_dtype)
        if allowed is not None:  # (a masked score is a constant: no gradient, even in a row with nothing seen)
          ds = tf.where(allowed, ds, tf.constant(0, logits_dtype))  # (a scalar: see dq)
        dq_block = per_head(ds, tf.cast(kb, logits_dtype))
        dq = dq_block if dq is None else dq + dq_block
        dks.append(per_key(ds, qg_logits))
      dk, dv = (tf.concat(d, axis=1) if len(d) > 1 else d[0] for d in (dks, dvs))
      return tf.cast(dq, q.dtype), tf.cast(dk, k.dtype), tf.cast(dv, v.dtype)

    return result, grad

  return blockwise(q, k, v)
