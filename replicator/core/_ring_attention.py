"""Ring attention: attention over a sequence split across devices, keys and values passed around a ring.

Each device holds its queries, keys and values for its tokens (``[batch,
tokens, heads, head size]``, Keras's and KerasHub's layout). In ``P`` steps
over a mesh axis of ``P`` devices, each device scores its queries against
the key block it holds, folds the block into a running (online) softmax, and
passes the block on to the next device (``permute``, point to point): after
``P`` steps every query has met every key. Nothing of size ``S x S`` is ever
gathered; a device computes and keeps for its backward pass the scores of
its queries against the sequence (``S^2 / P`` of one device's) one block at a
time, and keeps none of them for the backward pass (below).

Masks are computed from global positions (``_sequence.sequence_positions`` of the
block's device of origin, known while the step is built), so causal attention
and a sliding window mean on every device what they mean on one, in either
token order; segment ids (packed sequences) travel with their keys. Pieces
of a block that no query of this device may see by those static masks are
skipped, forward and backward (whole blocks above the diagonal in the
contiguous order; in the zigzag order, pairs of the device's two chunks and
the block's two): the block still goes on around the ring, so every device
calls the same permutes in the same order, and only the score products
differ between devices. The zigzag order gives every device the same work
(``2P + 1`` quarter-blocks a pass), the contiguous one ``i + 1`` blocks to
device ``i``. ``key_mask``
(``[batch, tokens]``, True where a key may be attended: padding) travels
with its keys. Masked scores get ``-1e9`` added, as Keras's softmax does, so
the result equals one device's attention with the same mask.

The backward pass is FlashAttention's, around the ring a second time (Ring
Attention's custom VJP): the forward pass keeps the device's queries, keys,
values, output and the log of each query's softmax denominator, nothing of
the scores; each step of the backward pass recomputes the scores of the
block it holds, adds to the queries' gradient, and passes the block on with
its keys' and values' gradients, which reach their device after the last
step. A device's saved bytes are then a few times its tokens' (not ``S^2 /
P``), for one more pass of score products.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from replicator.core import _errors
from replicator.core import _gradient_registry
from replicator.core import _primitives
from replicator.core import _sequence

# The backward pass's ops' name scope: under gradient_tape, where repl.memory looks for a backward pass.
BACKWARD_SCOPE = "gradient_tape/ring_attention"
MASKED = -1e9  # added to a masked score (Keras's softmax adds the same; -3e4 in float16, its range)


def masked(dtype) -> float:
  return -3e4 if dtype == tf.float16 else MASKED


def check(q, k, v, location: str, call: str = "repl.ring_attention", grouped: bool = False) -> None:
  """Raises a named error unless q, k, v are ``[batch, tokens, heads, head size]`` and agree (``grouped``: the
  query heads a multiple of the key and value heads, grouped-query attention)."""
  for name, t in (("q", q), ("k", k), ("v", v)):
    if t.shape.rank != 4:
      raise _errors.ArgumentError(f"{call} at {location}: {name} has shape {t.shape}; expected "
                                  "[batch, tokens, heads, head size] (a device's tokens). Fix: reshape it "
                                  "(Keras's MultiHeadAttention and KerasHub's layers use this layout).")
  heads_agree = (q.shape[2] is not None and k.shape[2] is not None and q.shape[2] % k.shape[2] == 0) if grouped \
      else q.shape[2] == k.shape[2]
  if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2] or q.shape[3] != k.shape[3] or not heads_agree:
    raise _errors.ArgumentError(
        f"{call} at {location}: q {q.shape}, k {k.shape}, v {v.shape} do not agree: k and v need the same tokens "
        "and heads, q and k the same head size and " + ("query heads a multiple of the key heads (grouped-query "
                                                         "attention). Fix: reshape the heads." if grouped else
                                                         "the same heads. Fix: repeat grouped key/value heads to "
                                                         "the query heads first."))


EXCHANGES = ("auto", "ring", "all_gather")


def _spans_processes(mesh, replica: int, axes) -> bool:
  """Whether the group of ``replica`` along ``axes`` has devices of more than one task (worker process)."""
  def task(device: str) -> str:
    return tf.DeviceSpec.from_string(device).replace(device_type=None, device_index=None).to_string()
  group = next(g for g in mesh.groups(axes) if replica in g)
  return len({task(mesh.devices[r]) for r in group}) > 1


def exchange_for(mesh, replica: int, axes, exchange: str) -> str:
  """The exchange ``"auto"`` means: the ring in one process; across processes one all-gather of the keys and values
  (the ring's bytes in one collective, not ``P - 1`` rounds of sends between the processes; with the ring's
  permutes sent point to point, a ``[1, 4096, 8, 64]`` causal attention's step took 0.83-0.84x the all-gather's
  with 2 workers and 0.96-0.98x with 4, two runs each on an idle 2-core machine, 1.18x with 4 under load: the
  default is kept until the ring is measured on a network)."""
  if exchange not in EXCHANGES:
    raise _errors.ArgumentError(f"repl.ring_attention(exchange={exchange!r}): expected one of {EXCHANGES}.")
  if exchange != "auto":
    return exchange
  return "all_gather" if _spans_processes(mesh, replica, axes) else "ring"


def exchange_said(chosen: str, asked: str) -> str:
  """What ``explain`` says of the exchange ``chosen`` (``asked``: the ``exchange=`` given), after the call's place."""
  if chosen == "ring":
    return "ring attention: keys and values passed around the ring (a permute a step)"
  if asked == "auto":
    return ("ring attention: keys and values all-gathered, as the axis spans worker processes (one collective "
            "there, not P - 1 rounds of sends between the processes; exchange='ring' for the ring)")
  return "ring attention: keys and values all-gathered (exchange='all_gather')"


def allowed_positions(queries: np.ndarray, keys: np.ndarray, causal: bool, window: int | None) -> np.ndarray | None:
  """Which (query, key) pairs of global positions may attend: causal (a key at or before its query) and within a
  sliding window (fewer than ``window`` positions apart); None: every pair."""
  if not causal and window is None:
    return None
  apart = queries[:, None] - keys[None, :]
  allowed = apart >= 0 if causal else np.ones(apart.shape, bool)
  if window is not None:
    allowed &= np.abs(apart) < window
  return allowed


def chunks(tokens: int, order: str) -> list[tuple[int, int]]:
  """Index ranges of a device's ``tokens`` holding runs of positions: the zigzag order's two chunks, else one."""
  return [(0, tokens // 2), (tokens // 2, tokens)] if order == "zigzag" else [(0, tokens)]


def segment_bias(query_segments, key_segments, dtype):
  """``[batch, 1, queries, keys]``: 0 where a query's and a key's segments (packed sequences) are one, else masked."""
  same = tf.equal(query_segments[:, :, None], key_segments[:, None, :])
  return tf.where(same, tf.constant(0, dtype), tf.constant(masked(dtype), dtype))[:, None]


def ring_attention(ctx, q, k, v, axes: tuple[str, ...], causal: bool, order: str, key_mask, scale,
                   location: str, exchange: str = "auto", window: int | None = None, segment_ids=None):
  """Attention of this device's queries over the whole split sequence (see the module)."""
  q, k, v = (tf.convert_to_tensor(t) for t in (q, k, v))
  check(q, k, v, location, grouped=True)
  groups = q.shape[2] // k.shape[2]  # (grouped-query attention: the blocks travel with their key heads only)
  mesh = ctx.replicator.mesh
  count, index = mesh.axis_size(axes), mesh.axis_index(ctx.replica_id, axes)
  chosen = exchange_for(mesh, ctx.replica_id, axes, exchange)
  said = f"{location} ({exchange_said(chosen, exchange)})"  # where its collectives are called, in explain
  exchange = chosen
  tokens = q.shape[1]
  if tokens is None or k.shape[1] != tokens:
    raise _errors.ArgumentError(
        f"repl.ring_attention at {location}: every device's queries and keys hold the same tokens of one sequence "
        f"(static sizes); found q {q.shape}, k {k.shape}. Fix: split the sequence evenly (replicator.shard_sequence).")
  length = tokens * count
  positions = [_sequence.sequence_positions(length, j, count, order) for j in range(count)]
  mine = positions[index]
  scale = float(q.shape[3]) ** -0.5 if scale is None else float(scale)
  ring = [(i, (i + 1) % count) for i in range(count)]
  if window is not None and not _errors.positive_int(window):
    raise _errors.ArgumentError(f"repl.ring_attention(window={window!r}) at {location}: expected a positive int, "
                                "the number of positions a query sees (itself included).")
  # What travels with the keys: their padding mask and their segments (packed sequences), as int32.
  extras = {}
  if key_mask is not None:
    extras["mask"] = tf.cast(key_mask, tf.int32)
  if segment_ids is not None:
    extras["segments"] = tf.cast(segment_ids, tf.int32)
  names = sorted(extras)

  def send(*tensors):
    return tuple(_primitives.permute(ctx, t, ring, axes, said) for t in tensors)

  def pieces(origin):
    """``[((q0, q1), (k0, k1))]``: the index ranges of this device's queries and of the block's keys (from device
    ``origin``) whose scores are made: every pair of chunks in which some query may see some key by the causal
    mask and window (known while the step is built); the others' terms are zero."""
    allowed = allowed_positions(mine, positions[origin], causal, window)
    out = []
    for q0, q1 in chunks(tokens, order):
      seen = [(k0, k1) for k0, k1 in chunks(tokens, order) if allowed is None or allowed[q0:q1, k0:k1].any()]
      merged = []
      for k0, k1 in seen:  # (adjacent ranges as one)
        merged = merged[:-1] + [(merged[-1][0], k1)] if merged and merged[-1][1] == k0 else merged + [(k0, k1)]
      out += [((q0, q1), kr) for kr in merged]
    return out

  def scores_of(qs, ks, kb, extra, origin):  # [batch, heads, queries, keys] of a piece of a block, masked
    (q0, q1), (k0, k1) = qs, ks
    allowed = allowed_positions(mine[q0:q1], positions[origin][k0:k1], causal, window)
    scores = tf.einsum("bqhd,bkhd->bhqk", q[:, q0:q1], repeated(kb[:, k0:k1])) * tf.cast(scale, q.dtype)
    if allowed is not None and not allowed.all():
      scores += tf.constant(np.where(allowed, 0.0, masked(q.dtype)), q.dtype)
    if "mask" in extra:
      keys_mask = tf.cast(extra["mask"][:, k0:k1], q.dtype)
      scores += ((1 - keys_mask) * tf.constant(masked(q.dtype), q.dtype))[:, None, None, :]
    if "segments" in extra:
      scores += segment_bias(extras["segments"][:, q0:q1], extra["segments"][:, k0:k1], q.dtype)
    return scores

  def blocks(k, v):
    """(keys, values, what travels with them, device of origin) of each block, in the order this device meets them."""
    if exchange == "all_gather":  # every device's keys and values at once, in device order
      gathered = [_primitives.all_gather(ctx, t, 1, axes, said) for t in [k, v] + [extras[n] for n in names]]
      for j in range(count):
        piece = [t[:, j * tokens:(j + 1) * tokens] for t in gathered]
        yield piece[0], piece[1], dict(zip(names, piece[2:])), j
      return
    kb, vb, extra = k, v, dict(extras)
    for step in range(count):
      yield kb, vb, extra, (index - step) % count
      if step < count - 1:
        kb, vb, *rest = send(kb, vb, *[extra[n] for n in names])
        extra = dict(zip(names, rest))

  def repeated(t):  # a block's keys or values for every query head
    return tf.repeat(t, groups, axis=2) if groups > 1 else t

  def folded(t):  # a gradient of repeated keys or values, summed over each key head's group
    if groups == 1:
      return t
    shape = t.shape.as_list()
    return tf.reduce_sum(tf.reshape(t, shape[:2] + [shape[2] // groups, groups] + shape[3:]), axis=3)

  def by_rows(parts, axis):  # one tensor of this device's queries from each run's
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=axis)

  def padded(part, ks):  # a piece's keys' gradient, in place among the block's keys
    return tf.pad(part, [[0, 0], [ks[0], tokens - ks[1]], [0, 0], [0, 0]]) if ks != (0, tokens) else part

  @tf.custom_gradient
  def attention(q, k, v):
    shape = tf.shape(q)
    # A running softmax for each run of this device's queries: [batch, heads, queries of the run] and the output.
    state = {qs: (tf.fill([shape[0], shape[2], qs[1] - qs[0]], tf.constant(-np.inf, q.dtype)),
                  tf.zeros([shape[0], shape[2], qs[1] - qs[0]], q.dtype), tf.zeros_like(q[:, qs[0]:qs[1]]))
             for qs in chunks(tokens, order)}
    for kb, vb, extra, origin in blocks(k, v):
      for qs, ks in pieces(origin):
        running_max, total, out = state[qs]
        scores = scores_of(qs, ks, kb, extra, origin)
        new_max = tf.maximum(running_max, tf.reduce_max(scores, axis=-1))
        weights = tf.exp(scores - new_max[..., None])
        rescale = tf.exp(running_max - new_max)
        total = total * rescale + tf.reduce_sum(weights, axis=-1)
        out = out * tf.transpose(rescale, [0, 2, 1])[..., None] + tf.einsum("bhqk,bkhd->bqhd", weights,
                                                                            repeated(vb[:, ks[0]:ks[1]]))
        state[qs] = (new_max, total, out)
    out = by_rows([o / tf.transpose(t, [0, 2, 1])[..., None] for _, t, o in state.values()], 1)
    logsumexp = by_rows([m + tf.math.log(t) for m, t, _ in state.values()], 2)  # [batch, heads, queries]

    def grad(dout):
      with tf.name_scope(BACKWARD_SCOPE):  # (TensorFlow's tape does not scope a custom gradient's ops)
        return backward(dout)

    def block_grads(dout, delta, kb, vb, extra, origin):
      """This device's queries' gradient and the block's keys' and values' from it: the pieces' sums."""
      dq = {qs: [] for qs in chunks(tokens, order)}
      dk, dv = [], []
      for qs, ks in pieces(origin):
        (q0, q1), (k0, k1) = qs, ks
        probabilities = tf.exp(scores_of(qs, ks, kb, extra, origin) - logsumexp[:, :, q0:q1, None])
        dp = tf.einsum("bqhd,bkhd->bhqk", dout[:, q0:q1], repeated(vb[:, k0:k1]))
        ds = probabilities * (dp - delta[:, :, q0:q1, None]) * tf.cast(scale, q.dtype)
        dq[qs].append(tf.einsum("bhqk,bkhd->bqhd", ds, repeated(kb[:, k0:k1])))
        dk.append(padded(folded(tf.einsum("bhqk,bqhd->bkhd", ds, q[:, q0:q1])), ks))
        dv.append(padded(folded(tf.einsum("bhqk,bqhd->bkhd", probabilities, dout[:, q0:q1])), ks))
      dq = by_rows([tf.add_n(parts) if parts else tf.zeros_like(q[:, qs[0]:qs[1]]) for qs, parts in dq.items()], 1)
      return dq, tf.add_n(dk) if dk else tf.zeros_like(kb), tf.add_n(dv) if dv else tf.zeros_like(vb)

    def backward(dout):
      # FlashAttention's backward: each block's scores recomputed from q and the block. Around the ring, each
      # block's dk and dv are carried with it and home after the last step; after an all-gather, they are
      # summed into their devices' pieces (a reduce-scatter).
      delta = tf.transpose(tf.reduce_sum(dout * out, axis=-1), [0, 2, 1])  # [batch, heads, queries]
      dq = tf.zeros_like(q)
      if exchange == "all_gather":
        dks, dvs = [], []
        for kb, vb, extra, origin in blocks(k, v):
          dq_block, dk, dv = block_grads(dout, delta, kb, vb, extra, origin)
          dq, dks, dvs = dq + dq_block, dks + [dk], dvs + [dv]
        return dq, *(_primitives.reduce_scatter(ctx, tf.concat(d, axis=1), "sum", 1, axes, said)
                     for d in (dks, dvs))
      kb, vb, extra = k, v, dict(extras)
      dk, dv = tf.zeros_like(k), tf.zeros_like(v)
      for step in range(count):
        dq_block, dk_block, dv_block = block_grads(dout, delta, kb, vb, extra, (index - step) % count)
        dq, dk, dv = dq + dq_block, dk + dk_block, dv + dv_block
        if step < count - 1:
          kb, vb, dk, dv, *rest = send(kb, vb, dk, dv, *[extra[n] for n in names])
          extra = dict(zip(names, rest))
      dk, dv = send(dk, dv)  # home: the last block came from the next device
      return dq, dk, dv

    return out, grad

  result = attention(q, k, v)
  name = _gradient_registry.gradient_name(result)
  if name:
    ctx.gradient_names.append(name)
  return result
