"""Ring attention at global shapes: the global view's ``context_parallel="ring"``.

The queries, keys and values are taken as ``P`` tiles along their sequence
(``[batch, P, tokens / P, heads, size]``, tile ``p`` the tokens device ``p``
holds over a sequence split ``P`` ways). Step ``t`` of ``P`` pairs query tile
``p`` with key and value tile ``(p - t) mod P``: the keys and values are rolled
by one tile a step (``tf.roll`` along the tiles; the partitioner's rule for a
roll by whole tiles is a ``permute`` to the next device, ``rewrite/rules/_roll.py``),
and each step's scores are folded into an online softmax (a running maximum
and denominator per query, as ``_blockwise_attention``), then dropped. So
each device holds its queries, one tile of keys and values at a time, and
one block of scores ``[b, H, S / P, S / P]``; the keys and values go around
the ring, one neighbour's tile a step (``P - 1`` permutes each), never
gathered.

The backward pass is FlashAttention's, around the ring the other way: the
keys and values rolled back one tile a step, from the last step's tiles
(each device's own rolled back once) to the first's (its own: the rolls wait
for the output's gradient, so that no tile is made early and held), each step's scores recomputed from the query tile and the
held maxima and denominators, and the keys' and values' gradients travelling with
their tiles (rolled back one tile a step, each step's added where they
are), home after the last step: ``P - 1`` permutes each of the keys, values
and their gradients. Kept for the backward pass: ``q``, ``k``, ``v``, the
output, the queries' maxima and denominators, never scores.

Masks mean what they mean on one device: a causal mask from each tile's
global positions (query ``p * S_q / P + i`` sees key ``((p - t) mod P) * S_k / P
+ j`` if not later), a boolean mask broadcast to ``[batch, heads, queries,
keys]`` cut into the same tile pairs (a mask over keys alone is rolled with
them; one over queries and keys has each step's tile pair picked out: where
its keys are split, a collective of a tile pair's size a step, which
``explain`` names by :data:`PAIRS_CUT`). A mask given as a tuple of masks
(their AND: ``_keras_attention`` hands ``MultiHeadAttention``'s padding so)
is cut piece by piece: a mask over queries stays on the query tile (each
device's own rows, nothing sent), one over keys is rolled with them (``b S_k
/ P`` elements a step), and no mask over both is made.
Every device computes every step (a causal mask's hidden pairs too): the
same work on every device whatever the token order. Causal attention with no
other mask or one over the keys alone, queries and keys of one length that
``2P`` divides, is ``_zigzag_ring``'s instead: the tokens reordered so that
each device holds an early and a late chunk, and each step computes only the
half-tile blocks the mask lets through (``2P + 1`` of ``4P`` quarter-blocks a
pass, the same on every device).
"""

from __future__ import annotations

import functools

import numpy as np
import tensorflow as tf

from replicator.core import _blockwise_attention
from replicator.core import _primitives
from replicator.core import _zigzag_ring

PAIRS_CUT = ("context_parallel='ring': a mask over queries and keys (an attention_mask= tensor) cut into each step's "
             "[queries, keys] tile pairs; a causal mask, Keras's padding masks and KerasHub decoders' are not")


def divides(q, k, tiles: int) -> bool:
  """Whether the ring applies: ``tiles > 1`` dividing both the queries' and the keys' lengths."""
  return tiles > 1 and q.shape[1] % tiles == 0 and k.shape[1] % tiles == 0


def _tiled(t, tiles: int):
  """``[b, S, ...]`` as ``[b, tiles, S / tiles, ...]``."""
  shape = t.shape.as_list()
  return tf.reshape(t, [shape[0], tiles, shape[1] // tiles] + shape[2:])


def _untiled(t):
  shape = t.shape.as_list()
  return tf.reshape(t, [shape[0], shape[1] * shape[2]] + shape[3:])


def _mask_steps(mask, tiles: int, queries: int, keys: int):
  """A function of the step ``t`` giving the mask's ``[b, P | 1, H | 1, S_q / P | 1, S_k / P | 1]`` boolean tile pairs.

  ``mask`` broadcasts to ``[batch, heads, queries, keys]``, or is a tuple of such masks (their AND: each cut by
  its own shape, so that a mask over queries and one over keys are never made one over both).
  """
  if isinstance(mask, (tuple, list)):
    steps = [_mask_steps(m, tiles, queries, keys) for m in mask]
    return lambda t: functools.reduce(tf.logical_and, [step(t) for step in steps])
  mask = tf.convert_to_tensor(mask, tf.bool)
  while mask.shape.rank < 4:
    mask = mask[None]
  mb, mh, mq, mk = mask.shape.as_list()
  bq, bk = queries // tiles, keys // tiles
  if mk == 1:  # the same every step
    m = tf.reshape(mask, [mb, mh, tiles, bq, 1]) if mq == queries else tf.reshape(mask, [mb, mh, 1, 1, 1])
    fixed = tf.transpose(m, [0, 2, 1, 3, 4])
    return lambda t: fixed
  if mq == 1:  # a mask over keys: its tiles rolled with the keys'
    by_keys = tf.transpose(tf.reshape(mask, [mb, mh, tiles, 1, bk]), [0, 2, 1, 3, 4])

    def rolled(t):
      return by_keys if t == 0 else tf.roll(by_keys, t, axis=1)
    return rolled
  # Over queries and keys: step t's pair of query tile p and key tile (p - t) mod P, picked out (where the mask's
  # keys are split, a collective of a tile pair's size a step: explain's line says so).
  with _primitives.noted(PAIRS_CUT, "ring_mask_pairs"):
    pairs = tf.cast(tf.reshape(mask, [mb, mh, tiles, bq, tiles, bk]), tf.float32)

  def picked(t):
    pick = np.zeros([tiles, tiles], np.float32)
    pick[np.arange(tiles), (np.arange(tiles) - t) % tiles] = 1.0
    with _primitives.noted(PAIRS_CUT, "ring_mask_pairs"):
      chosen = tf.reduce_max(pairs * tf.constant(pick[None, None, :, None, :, None]), axis=4) > 0.5
      return tf.transpose(chosen, [0, 2, 1, 3, 4])
  return picked


def attention(q, k, v, *, mask=None, is_causal: bool = False, scale: float, tiles: int, groups: int = 1,
              balanced: bool = True):
  """``[batch, queries, heads, size]``: attention of ``q`` over ``k`` and ``v`` as a ring of ``tiles`` (see the module).

  Args:
    q: ``[batch, queries, heads, size]``; ``k``, ``v``: ``[batch, keys, heads / groups, size]``; ``tiles``
      divides both lengths (:func:`divides`).
    mask: boolean, broadcast to ``[batch, heads, queries, keys]`` (True: the key is seen), a tuple of such masks
      (their AND), or None.
    is_causal: key ``j`` seen by query ``i`` only if ``j <= i``.
    scale: the scores' scale.
    tiles: the ring's length: the devices the sequence is split over.
    groups: grouped-query attention: each key and value head serves ``groups`` query heads.
    balanced: a causal mask (with a mask over the keys alone, or none) in the balanced order, each device half
      the tile pairs (``_zigzag_ring``) where it applies; False: every tile pair.
  """
  if balanced and _zigzag_ring.applies(q, k, mask, is_causal, tiles):
    return _zigzag_ring.attention(q, k, v, mask=mask, scale=scale, tiles=tiles, groups=groups)
  queries, keys = q.shape[1], k.shape[1]
  bq, bk = queries // tiles, keys // tiles
  logits_dtype = tf.float32 if q.dtype in (tf.float16, tf.bfloat16) else q.dtype
  negative = tf.constant(_blockwise_attention.large_negative(logits_dtype), logits_dtype)
  masks = None if mask is None else _mask_steps(mask, tiles, queries, keys)

  def allowed_at(t):
    allowed = None if masks is None else masks(t)
    if is_causal:
      rows = np.arange(tiles)[:, None, None] * bq + np.arange(bq)[None, :, None]
      cols = ((np.arange(tiles) - t) % tiles)[:, None, None] * bk + np.arange(bk)[None, None, :]
      causal = tf.constant((rows >= cols)[None, :, None])  # [1, P, 1, bq, bk]
      allowed = causal if allowed is None else tf.logical_and(allowed, causal)
    return allowed

  def scores_of(qt, kt, t):  # [b, P, H, bq, bk], masked
    s = tf.cast(tf.einsum("bptnh,bpsnh->bpnts", qt, repeated(kt)), logits_dtype) * tf.cast(scale, logits_dtype)
    allowed = allowed_at(t)
    return (s, None) if allowed is None else (tf.where(allowed, s, negative), allowed)

  repeated = functools.partial(_blockwise_attention.repeated_tiles, groups=groups)
  grouped = functools.partial(_blockwise_attention.grouped_tiles, groups=groups)
  heads_last = _blockwise_attention.heads_last

  @tf.custom_gradient
  def ring(q, k, v):
    qt, kt, vt = _tiled(q, tiles), _tiled(k, tiles), _tiled(v, tiles)
    running_max = total = out = None
    for t in range(tiles):
      if t:
        kt, vt = tf.roll(kt, 1, axis=1), tf.roll(vt, 1, axis=1)  # each device's tile to the next
      s, _ = scores_of(qt, kt, t)
      block_max = tf.reduce_max(s, axis=-1)
      new_max = block_max if running_max is None else tf.maximum(running_max, block_max)
      weights = tf.exp(s - new_max[..., None])
      part = tf.cast(tf.einsum("bpnts,bpsnh->bptnh", tf.cast(weights, v.dtype), repeated(vt)), logits_dtype)
      if running_max is None:
        total, out = tf.reduce_sum(weights, axis=-1), part
      else:
        rescale = tf.exp(running_max - new_max)
        total = total * rescale + tf.reduce_sum(weights, axis=-1)
        out = out * heads_last(rescale) + part
      running_max = new_max
    out = out / heads_last(total)
    # (the maximum and the denominator kept apart: a row with every key masked has the masked score as its maximum,
    # a float the log of a denominator added to would not change)
    result = tf.cast(_untiled(out), v.dtype)

    def grad(dout):
      with tf.name_scope("gradients"):  # (the backward pass's ops, as the rewrite tells them: by their scope)
        return backward(dout)

    def backward(dout):
      dout = _tiled(tf.cast(dout, logits_dtype), tiles)
      delta = tf.transpose(tf.reduce_sum(dout * tf.cast(_tiled(result, tiles), logits_dtype), axis=-1), [0, 1, 3, 2])
      qt = _tiled(q, tiles)
      with tf.control_dependencies([dout]):  # (made when the backward pass reaches them, not held from the forward)
        home_k, home_v = tf.identity(_tiled(k, tiles)), tf.identity(_tiled(v, tiles))
      kt, vt = home_k, home_v
      dq = dk = dv = None
      for t in reversed(range(tiles)):  # step P - 1 first: its tiles one roll back from each device's own
        kt, vt = (home_k, home_v) if t == 0 else (tf.roll(kt, -1, axis=1), tf.roll(vt, -1, axis=1))
        if dk is not None:  # the gradients travel with their tiles
          dk, dv = tf.roll(dk, -1, axis=1), tf.roll(dv, -1, axis=1)
        s, allowed = scores_of(qt, kt, t)
        p = tf.exp(s - running_max[..., None]) / total[..., None]
        dvt = grouped(tf.einsum("bpnts,bptnh->bpsnh", p, dout))
        dp = tf.einsum("bptnh,bpsnh->bpnts", dout, tf.cast(repeated(vt), logits_dtype))
        ds = p * (dp - delta[..., None]) * tf.cast(scale, logits_dtype)
        if allowed is not None:  # (a masked score is a constant: no gradient, even in a row with nothing seen)
          ds = tf.where(allowed, ds, tf.zeros_like(ds))
        dqt = tf.einsum("bpnts,bpsnh->bptnh", ds, tf.cast(repeated(kt), logits_dtype))
        dkt = grouped(tf.einsum("bpnts,bptnh->bpsnh", ds, tf.cast(qt, logits_dtype)))
        dq = dqt if dq is None else dq + dqt
        dk, dv = (dkt, dvt) if dk is None else (dk + dkt, dv + dvt)
      return (tf.cast(_untiled(dq), q.dtype), tf.cast(_untiled(dk), k.dtype), tf.cast(_untiled(dv), v.dtype))

    return result, grad

  return ring(q, k, v)
