"""Causal ring attention at global shapes in the balanced (zigzag) order: each device half the work, all equal.

``_blockwise_ring``'s ring computes every tile pair; under a causal mask half
of them are hidden, and in the sequence's order device ``p``'s queries need
``2p + 1`` of its ``2P`` half-tile pairs. Here the tokens are cut into ``2P``
chunks of ``c = S / 2P`` and put in the zigzag order first: tile ``p`` holds
chunks ``p`` (its ``lo`` half) and ``2P - 1 - p`` (its ``hi`` half). The
reorder is a ``tf.gather`` along the sequence with constant indices, which
the partitioner lowers to point-to-point moves of the chunks that change
device (``rewrite/rules/_gather.py``: two rounds of ``permute``, a chunk a
device each); the output is put back in the sequence's order the same way,
and the gradients of both are the inverse gathers.

Then the ring, as ``_blockwise_ring``'s (keys and values rolled a tile a
step, an online softmax, FlashAttention's backward pass around the ring the
other way), but each step computes only what the causal mask lets through,
as one program for every device (the same ops at the same shapes):

- step 0, the diagonal: ``(q_lo, k_lo)`` (causal within the chunk) and
  ``(q_hi, [k_lo, k_hi])`` (``k_lo`` earlier, ``k_hi`` causal): 3 of the 4
  quarter-blocks (``(q_lo, k_hi)`` is all hidden);
- step ``t >= 1``, key tile ``j = (p - t) mod P``: for ``j < p`` (``t <= p``)
  the queries need ``q_all x k_lo``, for ``j > p`` ``q_hi x k_all``, both
  whole (nothing hidden). Both hold the block ``X = (q_hi, k_lo)``; the other
  is ``Y = (select(c, q_lo, q_hi), select(c, k_lo, k_hi))`` with ``c = (t <=
  p)``, a constant ``[1, P, 1, ...]`` tensor along the tiles (the partitioner
  gives each device its element). ``X`` folds into the ``hi`` half's online
  softmax, ``Y`` into the half ``c`` picks (``tf.where``).

So every device computes ``3 + 2 (P - 1) = 2P + 1`` quarter-blocks of
scores a pass, of the ``4P`` the ring computes (P = 4: 9 of 16), the
backward pass likewise. A mask over the keys alone (their padding,
``[batch | 1, heads | 1, 1, keys]``) is reordered and rolled with the keys. A
query that sees no key at all (every key it may see is padding) gets, as in
Keras, the mean of every value (its scores all masked: a uniform softmax over
all the keys); its gradient goes to every value (a share added to each value
tile's gradient as it passes each device). Anything else (no causal mask, a
mask over queries, queries and keys of different lengths, a length ``2P``
does not divide) is ``_blockwise_ring``'s.
"""

from __future__ import annotations

import functools

import numpy as np
import tensorflow as tf

from replicator.core import _blockwise_attention


def key_mask(mask, keys: int):
  """``mask`` as ``[b | 1, heads | 1, 1, keys]`` boolean if it is a mask over the keys alone (or None: no mask);
  ``False`` if it is any other mask."""
  if mask is None:
    return None
  if isinstance(mask, (tuple, list)):  # (masks to AND: MultiHeadAttention's pieces)
    parts = [key_mask(m, keys) for m in mask]
    if any(part is False for part in parts):
      return False
    parts = [part for part in parts if part is not None]
    return functools.reduce(tf.logical_and, parts) if parts else None
  mask = tf.convert_to_tensor(mask)
  if mask.shape.rank is None or mask.shape.rank > 4 or not mask.shape.is_fully_defined():
    return False
  while mask.shape.rank < 4:
    mask = mask[None]
  if mask.shape[2] != 1 or mask.shape[3] != keys:
    return False
  return tf.cast(mask, tf.bool)


def applies(q, k, mask, is_causal: bool, tiles: int) -> bool:
  """Whether the balanced ring applies: causal, queries and keys of one length ``2 * tiles`` divides, no mask or
  one over the keys alone."""
  length = q.shape[1]
  return (is_causal and tiles > 1 and length is not None and length == k.shape[1] and length % (2 * tiles) == 0
          and key_mask(mask, k.shape[1]) is not False)


def zigzag(tiles: int, length: int) -> np.ndarray:
  """The tokens' positions in the zigzag order: tile ``p`` holds chunks ``p`` and ``2 tiles - 1 - p``."""
  chunk = length // (2 * tiles)
  chunks = [c for p in range(tiles) for c in (p, 2 * tiles - 1 - p)]
  return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in chunks])


def _reordered(x, order: np.ndarray, axis: int = 1):
  """``x``'s rows along ``axis`` at ``order`` (a permutation); its gradient the inverse's rows (a reorder too, not a
  segment sum)."""
  inverse = np.argsort(order)

  @tf.custom_gradient
  def reorder(x):
    def grad(dy):
      return tf.gather(dy, tf.constant(inverse, tf.int32), axis=axis)
    return tf.gather(x, tf.constant(order, tf.int32), axis=axis), grad

  return reorder(x)


def attention(q, k, v, *, mask=None, scale: float, tiles: int, groups: int = 1):
  """``[batch, tokens, heads, size]``: causal attention of ``q`` over ``k`` and ``v``, balanced (see the module).

  Args:
    q: ``[batch, tokens, heads, size]``; ``k``, ``v``: ``[batch, tokens, heads / groups, size]``;
      :func:`applies`.
    mask: None, or a boolean mask over the keys alone (True: the key is seen), broadcast to ``[batch, heads, 1,
      tokens]``.
    scale: the scores' scale.
    tiles: the ring's length ``P``: the devices the sequence is split over.
    groups: grouped-query attention: each key and value head serves ``groups`` query heads.
  """
  length = q.shape[1]
  order = zigzag(tiles, length)
  keys_seen = key_mask(mask, length)
  if keys_seen is not None:
    keys_seen = tf.gather(keys_seen, tf.constant(order, tf.int32), axis=3)
  out = _ring(*(_reordered(t, order) for t in (q, k, v)), keys_seen, scale, tiles, groups)
  return _reordered(out, np.argsort(order))


def _ring(q, k, v, keys_seen, scale: float, tiles: int, groups: int):
  """The ring on ``q``, ``k``, ``v`` (and the keys' mask) in the zigzag order; the output in that order."""
  length = q.shape[1]
  half = length // (2 * tiles)
  logits_dtype = tf.float32 if q.dtype in (tf.float16, tf.bfloat16) else q.dtype
  negative = tf.constant(_blockwise_attention.large_negative(logits_dtype), logits_dtype)
  scale_ = tf.cast(scale, logits_dtype)
  causal = np.arange(half)[:, None] >= np.arange(half)[None, :]
  diagonal_lo = tf.constant(causal[None, None, None])  # [1, 1, 1, c, c]: (q_lo, k_lo) at step 0
  diagonal_hi = tf.constant(np.concatenate([np.ones_like(causal), causal], 1)[None, None, None])  # (q_hi, k_all)

  def tiled(t):  # [b, S, ...] -> [b, P, S / P, ...]
    shape = t.shape.as_list()
    return tf.reshape(t, [shape[0], tiles, shape[1] // tiles] + shape[2:])

  def untiled(t):
    shape = t.shape.as_list()
    return tf.reshape(t, [shape[0], shape[1] * shape[2]] + shape[3:])

  def halves(t, last=False):  # a tile's lo and hi chunks (its tokens along dimension 2, or the last)
    return (t[..., :half], t[..., half:]) if last else (t[:, :, :half], t[:, :, half:])

  def picked(t):  # c = (t <= p) along the tiles, as a [1, P, 1, ...] condition of rank ``rank``
    def condition(rank):
      return tf.constant((np.arange(tiles) >= t).reshape([1, tiles] + [1] * (rank - 2)))
    return condition

  if keys_seen is not None:  # [b | 1, heads | 1, 1, S] -> [b | 1, P, heads | 1, 1, S / P]
    mb, mh = keys_seen.shape[0], keys_seen.shape[1]
    by_tiles = tf.transpose(tf.reshape(keys_seen, [mb, mh, 1, tiles, 2 * half]), [0, 3, 1, 2, 4])
  else:
    by_tiles = None

  def seen_at(t):  # the keys' mask of the tile each device holds at step t: (lo, hi, whole), or Nones
    if by_tiles is None:
      return None, None, None
    m = by_tiles if t == 0 else tf.roll(by_tiles, t, axis=1)
    return m[..., :half], m[..., half:], m

  repeated = functools.partial(_blockwise_attention.repeated_tiles, groups=groups)
  grouped = functools.partial(_blockwise_attention.grouped_tiles, groups=groups)
  heads_last = _blockwise_attention.heads_last

  def both(a, b):
    return b if a is None else a if b is None else tf.logical_and(a, b)

  def scores_of(qb, kb, allowed):  # [b, P, H, tq, tk], masked where not allowed
    s = tf.cast(tf.einsum("bptnh,bpsnh->bpnts", qb, repeated(kb)), logits_dtype) * scale_
    return s if allowed is None else tf.where(allowed, s, negative)

  def fold(state, s, vb):  # the block's scores ``s`` and values ``vb`` into an online softmax's (max, total, out)
    block_max = tf.reduce_max(s, axis=-1)
    new_max = block_max if state is None else tf.maximum(state[0], block_max)
    weights = tf.exp(s - new_max[..., None])
    part = tf.cast(tf.einsum("bpnts,bpsnh->bptnh", tf.cast(weights, vb.dtype), repeated(vb)), logits_dtype)
    if state is None:
      return new_max, tf.reduce_sum(weights, axis=-1), part
    running_max, total, out = state
    rescale = tf.exp(running_max - new_max)
    return new_max, total * rescale + tf.reduce_sum(weights, axis=-1), out * heads_last(rescale) + part

  def select(condition, a, b):
    return tf.where(condition(a.shape.rank), a, b)

  @tf.custom_gradient
  def ring(q, k, v):
    qt, kt, vt = tiled(q), tiled(k), tiled(v)
    q_lo, q_hi = halves(qt)
    values = None  # the sum of every value (for a query that sees no key), with a mask
    lo = hi = None
    for t in range(tiles):
      if t:
        kt, vt = tf.roll(kt, 1, axis=1), tf.roll(vt, 1, axis=1)  # each device's tile to the next
      (k_lo, k_hi), (v_lo, v_hi) = halves(kt), halves(vt)
      seen_lo, seen_hi, seen = seen_at(t)
      if by_tiles is not None:
        summed = tf.cast(tf.reduce_sum(vt, axis=2), logits_dtype)
        values = summed if values is None else values + summed
      if t == 0:
        lo = fold(None, scores_of(q_lo, k_lo, both(seen_lo, diagonal_lo)), v_lo)
        hi = fold(None, scores_of(q_hi, kt, both(seen, diagonal_hi)), vt)
        continue
      c = picked(t)
      hi = fold(hi, scores_of(q_hi, k_lo, seen_lo), v_lo)  # X
      chosen = tuple(select(c, a, b) for a, b in zip(lo, hi))
      y = fold(chosen, scores_of(select(c, q_lo, q_hi), select(c, k_lo, k_hi),
                                 None if seen is None else select(c, seen_lo, seen_hi)), select(c, v_lo, v_hi))
      lo, hi = tuple(select(c, n, a) for n, a in zip(y, lo)), tuple(select(c, a, n) for n, a in zip(y, hi))
    stats = []
    outs = []
    for running_max, total, out in (lo, hi):
      out = out / heads_last(total)
      empty = None
      if by_tiles is not None:  # a query that sees no key: every score masked, Keras's uniform softmax over all keys
        empty = tf.equal(running_max, negative)
        mean = repeated(values[:, :, None] / tf.cast(length, logits_dtype))  # [b, P, 1, H, D]
        out = tf.where(heads_last(empty), mean, out)
      stats.append((running_max, total, empty))
      outs.append(out)
    result = tf.cast(untiled(tf.concat(outs, axis=2)), v.dtype)

    def grad(dout):
      with tf.name_scope("gradients"):  # (the backward pass's ops, as the rewrite tells them: by their scope)
        return backward(dout)

    def backward(dout):
      dout = tiled(tf.cast(dout, logits_dtype))
      delta = tf.transpose(tf.reduce_sum(dout * tf.cast(tiled(result), logits_dtype), axis=-1), [0, 1, 3, 2])
      qt = tiled(q)
      q_lo, q_hi = halves(qt)
      (do_lo, do_hi), (delta_lo, delta_hi) = halves(dout), halves(delta, last=True)
      halves_of = []  # per half: (queries, dout, delta, max, 1 / total (0 where nothing is seen))
      for qb, dob, db, (running_max, total, empty) in zip((q_lo, q_hi), (do_lo, do_hi), (delta_lo, delta_hi), stats):
        inverse = 1.0 / total if empty is None else tf.where(empty, tf.zeros_like(total), 1.0 / total)
        halves_of.append((qb, dob, db, running_max, inverse))
      share = None  # what each value's gradient gets from the queries that see no key: their douts / S
      if by_tiles is not None:
        nothing = [tf.where(heads_last(e), dob, tf.zeros_like(dob)) for (_, dob, *_), (_, _, e)
                   in zip(halves_of, stats)]
        share = grouped(tf.reduce_sum(tf.concat(nothing, axis=2), axis=2, keepdims=True)) / tf.cast(length,
                                                                                                   logits_dtype)

      def block(half_of, kb, vb, allowed):  # one block's (dq, dk, dv)
        qb, dob, db, running_max, inverse = half_of
        s = scores_of(qb, kb, allowed)
        p = tf.exp(s - running_max[..., None]) * inverse[..., None]
        dvb = grouped(tf.einsum("bpnts,bptnh->bpsnh", p, dob))
        dp = tf.einsum("bptnh,bpsnh->bpnts", dob, tf.cast(repeated(vb), logits_dtype))
        ds = p * (dp - db[..., None]) * scale_
        if allowed is not None:  # (a masked score is a constant: no gradient)
          ds = tf.where(allowed, ds, tf.zeros_like(ds))
        dqb = tf.einsum("bpnts,bpsnh->bptnh", ds, tf.cast(repeated(kb), logits_dtype))
        dkb = grouped(tf.einsum("bpnts,bptnh->bpsnh", ds, tf.cast(qb, logits_dtype)))
        return dqb, dkb, dvb

      def chosen_half(c):
        return tuple(select(c, a, b) for a, b in zip(*halves_of))

      def kept(c, x, picked_lo):  # x where c picks this half (lo: c; hi: not c), zeros elsewhere
        zeros = tf.zeros_like(x)
        return select(c, x, zeros) if picked_lo else select(c, zeros, x)

      with tf.control_dependencies([dout]):  # (made when the backward pass reaches them, not held from the forward)
        home_k, home_v = tf.identity(tiled(k)), tf.identity(tiled(v))
      kt, vt = home_k, home_v
      dq_lo = dq_hi = dk = dv = None
      for t in reversed(range(tiles)):  # step P - 1 first: its tiles one roll back from each device's own
        kt, vt = (home_k, home_v) if t == 0 else (tf.roll(kt, -1, axis=1), tf.roll(vt, -1, axis=1))
        if dk is not None:  # the gradients travel with their tiles
          dk, dv = tf.roll(dk, -1, axis=1), tf.roll(dv, -1, axis=1)
        (k_lo, k_hi), (v_lo, v_hi) = halves(kt), halves(vt)
        seen_lo, seen_hi, seen = seen_at(t)
        if t == 0:
          dq_l, dk_l, dv_l = block(halves_of[0], k_lo, v_lo, both(seen_lo, diagonal_lo))
          dq_h, dk_step, dv_step = block(halves_of[1], kt, vt, both(seen, diagonal_hi))
          dk_step += tf.concat([dk_l, tf.zeros_like(dk_l)], axis=2)
          dv_step += tf.concat([dv_l, tf.zeros_like(dv_l)], axis=2)
        else:
          c = picked(t)
          dq_h, dk_x, dv_x = block(halves_of[1], k_lo, v_lo, seen_lo)  # X
          dq_y, dk_y, dv_y = block(chosen_half(c), select(c, k_lo, k_hi), select(c, v_lo, v_hi),
                                   None if seen is None else select(c, seen_lo, seen_hi))  # Y
          dq_l, dq_h = kept(c, dq_y, True), dq_h + kept(c, dq_y, False)
          dk_step = tf.concat([dk_x + kept(c, dk_y, True), kept(c, dk_y, False)], axis=2)
          dv_step = tf.concat([dv_x + kept(c, dv_y, True), kept(c, dv_y, False)], axis=2)
        if share is not None:
          dv_step += share
        dq_lo = dq_l if dq_lo is None else dq_lo + dq_l
        dq_hi = dq_h if dq_hi is None else dq_hi + dq_h
        dk, dv = (dk_step, dv_step) if dk is None else (dk + dk_step, dv + dv_step)
      dq = tf.concat([dq_lo, dq_hi], axis=2)
      return (tf.cast(untiled(dq), q.dtype), tf.cast(untiled(dk), k.dtype), tf.cast(untiled(dv), v.dtype))

    return result, grad

  return ring(q, k, v)
