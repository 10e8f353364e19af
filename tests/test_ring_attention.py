"""repl.ring_attention: a split sequence's attention, against one device's, in float64 as the truth.

Tolerance: twice the one-device reorder floor. The floor is float32's own
noise on one device: the largest distance from the float64 truth among one
device's float32 runs of the same attention summed in other orders (as
written; the tokens reversed; the keys in ``P`` online-softmax blocks, in the
split's token order and reversed), each distance the root mean square over
the tensor. The split run's distance must be at most twice that. Measured
over 15 seeds of every case (the ring, the all-gather and Ulysses x both
orders x none, causal, padding, causal with padding, a causal window with
packed segments; 1,800 results): at most 1.43 times the floor. The largest
element's distance is not the measure: one sample of float32's rounding
against another, it came up to 3.7 times its floor over the same cases. A
dropped mask or tokens in the wrong order are 0.5 off or more.
"""

import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus

import mesh
import replicator

B, S, H, D, P = 2, 32, 2, 8, 4


def _attention(q, k, v, allowed, blocks=1):
  """One device: softmax(q k^T / sqrt(D) + mask) v, the mask ``allowed [b, q, k]`` added as Keras adds it; the
  keys in ``blocks`` online-softmax blocks (a running maximum and denominator), the same function summed in
  another order."""
  scores = tf.einsum("bqhd,bkhd->bhqk", q, k) * tf.cast(D ** -0.5, q.dtype)
  scores += tf.constant(np.where(allowed, 0.0, -1e9)[:, None], q.dtype)
  if blocks == 1:
    return tf.einsum("bhqk,bkhd->bqhd", tf.nn.softmax(scores), v)
  maximum = None
  for keys in np.array_split(np.arange(k.shape[1]), blocks):
    block = tf.gather(scores, keys, axis=3)
    block_max = tf.reduce_max(block, -1, keepdims=True)
    e = tf.exp(block - block_max)
    total, out = tf.reduce_sum(e, -1, keepdims=True), tf.einsum("bhqk,bkhd->bhqd", e, tf.gather(v, keys, axis=1))
    if maximum is None:
      maximum, denominator, numerator = block_max, total, out
    else:
      new = tf.maximum(maximum, block_max)
      old_scale, block_scale = tf.exp(maximum - new), tf.exp(block_max - new)
      denominator = denominator * old_scale + total * block_scale
      numerator = numerator * old_scale + out * block_scale
      maximum = new
  return tf.transpose(numerator / denominator, [0, 2, 1, 3])


def _allowed(length, causal, key_mask, window=None, segments=None):
  """The ``[B, length, length]`` boolean mask one device's attention applies."""
  apart = np.arange(length)[:, None] - np.arange(length)[None, :]
  allowed = (apart >= 0 if causal else np.ones((length, length), bool)) & (np.abs(apart) < (window or length))
  allowed = np.broadcast_to(allowed, (B, length, length))
  if key_mask is not None:
    allowed = allowed & np.asarray(key_mask)[:, None, :]
  if segments is not None:
    allowed = allowed & (segments[:, :, None] == segments[:, None, :])
  return allowed


def _one_device(values, causal, key_mask, dtype, window=None, segments=None, order=None, blocks=1):
  """One device's attention of ``values`` (q, k, v and the loss's weights) and its gradients (of sum(out * w));
  keys and values of fewer heads repeated to the queries'. ``order``: the tokens taken in this order (the
  result put back in theirs), the keys' sums in another order."""
  length = values[0].shape[1]
  order = np.arange(length) if order is None else order
  allowed = _allowed(length, causal, key_mask, window, segments)[:, order][:, :, order]
  q, k, v, w = (tf.constant(x.astype(dtype)[:, order]) for x in values)
  with tf.GradientTape() as tape:
    tape.watch([q, k, v])
    groups = q.shape[2] // k.shape[2]
    out = _attention(q, tf.repeat(k, groups, axis=2), tf.repeat(v, groups, axis=2), allowed, blocks)
    loss = tf.reduce_sum(out * w)
  back = np.argsort(order)
  return [t.numpy()[:, back] for t in [out, *tape.gradient(loss, [q, k, v])]]


def _rms(a, b):
  return float(np.sqrt(np.mean((np.asarray(a, np.float64) - b) ** 2)))


def _split_order(length, order, axis_size):
  """The tokens as the devices hold them, one device's after another (a length they do not divide padded first,
  the padding left out)."""
  padded = -(-length // (2 * axis_size)) * 2 * axis_size
  held = [replicator.shard_sequence(np.arange(padded)[None], i, axis_size, order=order).numpy()[0]
          for i in range(axis_size)]
  held = np.concatenate(held)
  return held[held < length]


def reorder_floor(values, truth, order, causal, key_mask, window=None, segments=None, axis_size=P):
  """Per result (output, then the q, k, v gradients): the largest root-mean-square distance from ``truth`` among
  one device's float32 runs summed in other orders (see the module)."""
  length = values[0].shape[1]
  split = _split_order(length, order, axis_size)
  runs = [_one_device(values, causal, key_mask, np.float32, window, segments, order=tokens, blocks=blocks)
          for tokens, blocks in [(None, 1), (np.arange(length)[::-1], 1), (split, axis_size),
                                 (split[::-1], axis_size)]]
  return [max(_rms(run[i], truth[i]) for run in runs) for i in range(len(truth))]


def _values(seed=0):
  rng = np.random.default_rng(seed)
  return [rng.normal(size=(B, S, H, D)).astype(np.float32) for _ in range(4)]  # q, k, v and the loss's weights


def assert_within_twice_the_floor(got, truth, floor):
  """Each result's root-mean-square distance from the float64 truth at most twice its reorder floor."""
  for which, (ours, expected, noise) in enumerate(zip(got, truth, floor)):
    assert _rms(ours, expected) <= 2 * noise, (which, _rms(ours, expected), noise)


def assert_split_attention_equals_one_device(attend, values, order, causal, key_mask, axis_size=P, window=None,
                                             segments=None):
  """``attend(repl, q, k, v, key_mask[, segment ids])`` on each device's tokens, then gathered: one device's
  attention and its three gradients (of sum(out * w)), within twice the reorder floor of a float64 truth."""
  truth = _one_device(values, causal, key_mask, np.float64, window, segments)
  floor = reorder_floor(values, truth, order, causal, key_mask, window, segments, axis_size=axis_size)
  repl = replicator.Replicator(mesh=mesh.Mesh({"seq": axis_size}, devices=cpus(axis_size)))

  def step():
    index = int(tf.get_static_value(repl.axis_index("seq")))
    q, k, v, w = (replicator.shard_sequence(x, index, axis_size, order=order) for x in values)
    mask = None if key_mask is None else replicator.shard_sequence(key_mask, index, axis_size, order=order)
    with tf.GradientTape() as tape:
      tape.watch([q, k, v])
      if segments is None:
        out = attend(repl, q, k, v, mask)
      else:
        out = attend(repl, q, k, v, mask, replicator.shard_sequence(segments, index, axis_size, order=order))
      loss = tf.reduce_sum(out * w)
    return [out, *tape.gradient(loss, [q, k, v])]

  got = [replicator.unshard_sequence([t.numpy() for t in per_device], order=order).numpy()
         for per_device in repl.run(step)]
  assert_within_twice_the_floor(got, truth, floor)


@pytest.mark.parametrize("exchange", ["ring", "all_gather"])
@pytest.mark.parametrize("order", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_each_device_gets_its_rows_of_one_devices_attention_and_gradients(order, causal, padded, exchange):
  key_mask = None
  if padded:  # the last 5 tokens of the second sequence are padding
    key_mask = np.ones((B, S), bool)
    key_mask[1, -5:] = False

  def attend(repl, q, k, v, mask):
    return repl.ring_attention(q, k, v, axis="seq", causal=causal, order=order, key_mask=mask, exchange=exchange)

  assert_split_attention_equals_one_device(attend, _values(), order, causal, key_mask)


@pytest.mark.parametrize("exchange", ["ring", "all_gather"])
@pytest.mark.parametrize("order", ["contiguous", "zigzag"])
def test_sliding_windows_and_packed_segments_mean_what_they_mean_on_one_device(order, exchange):
  # A causal window of 6 positions (it crosses the devices' blocks of 8, and the zigzag order's chunks of 4), and
  # three packed sequences of 11, 13 and 8 tokens in the first row, two in the second.
  segments = np.array([[0] * 11 + [1] * 13 + [2] * 8, [0] * 20 + [1] * 12])

  def attend(repl, q, k, v, mask, segment_ids):
    return repl.ring_attention(q, k, v, axis="seq", causal=True, order=order, window=6, segment_ids=segment_ids,
                               exchange=exchange)

  assert_split_attention_equals_one_device(attend, _values(2), order, True, None, window=6, segments=segments)


def _score_work(order, exchange, causal=True, window=None):
  """Each device's score products in a step of ring attention and its gradient, from the built graph's shapes:
  the elements of every ``[batch, heads, queries, keys]`` einsum placed on it (forward, and again backward)."""
  repl = replicator.Replicator(mesh=mesh.Mesh({"seq": P}, devices=cpus(P)))
  values = _values()

  def step():
    index = int(tf.get_static_value(repl.axis_index("seq")))
    q, k, v, w = (replicator.shard_sequence(x, index, P, order=order) for x in values)
    with tf.GradientTape() as tape:
      tape.watch([q, k, v])
      loss = tf.reduce_sum(repl.ring_attention(q, k, v, axis="seq", causal=causal, order=order, exchange=exchange,
                                               window=window) * w)
    return tape.gradient(loss, [q, k, v])

  compiled, _ = repl._views["local"].step(step, None, None)  # pylint: disable=protected-access
  graph = compiled._build(1, False).graph  # pylint: disable=protected-access
  work = {}
  for op in graph.get_operations():
    if op.type == "Einsum" and op.get_attr("equation").decode() in ("bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd"):
      shape = op.outputs[0].shape if op.get_attr("equation").decode().endswith("bhqk") else None
      if shape is not None:
        device = tf.DeviceSpec.from_string(op.device).device_index
        work[device] = work.get(device, 0) + shape.num_elements()
  return [work.get(d, 0) for d in range(P)]


def test_the_zigzag_order_balances_the_causal_scores_each_device_needs():
  # The scores a device's queries need under a causal mask (the unmasked ones), from the positions it holds:
  # contiguous, device i needs (2i + 1) / (2P) of its block row; zigzag, every device the same.
  def needed(order):
    rows = [replicator.sequence_positions(S, i, P, order) for i in range(P)]
    return [int(sum((r[:, None] >= np.arange(S)[None, :]).sum() for r in [row])) for row in rows]

  contiguous, zigzag = needed("contiguous"), needed("zigzag")
  block = S // P
  assert contiguous == [sum(q + 1 for q in range(i * block, (i + 1) * block)) for i in range(P)]  # 36 ... 228
  assert zigzag == [S * (S + 1) // 2 // P] * P


@pytest.mark.parametrize("exchange", ["ring", "all_gather"])
def test_causal_attention_skips_the_masked_pieces_and_the_zigzag_order_balances_the_work(exchange):
  # Counted from the built graph: the score-shaped products each device makes (the forward pass's scores; the
  # backward pass's recomputed scores and their gradient), in B x H x queries x keys elements. Pieces wholly above the diagonal are skipped: contiguous,
  # device i makes i + 1 of its P blocks a pass (P times between the last device and the first); zigzag (each
  # device's two chunks against each block's two), 2P + 1 quarter-blocks a pass on every device; without a mask,
  # all P blocks everywhere.
  block = B * H * (S // P) ** 2
  assert _score_work("contiguous", exchange) == [3 * (i + 1) * block for i in range(P)]
  assert _score_work("zigzag", exchange) == [3 * (2 * P + 1) * block // 4] * P
  assert _score_work("zigzag", exchange, causal=False) == [3 * P * block] * P
  # A sliding window of a block's length: the blocks it reaches, the diagonal and the one before it.
  assert _score_work("contiguous", exchange, window=S // P) == [3 * min(i + 1, 2) * block for i in range(P)]


def test_shapes_that_do_not_agree_are_named():
  repl = replicator.Replicator(mesh=mesh.Mesh({"seq": 2}, devices=cpus(2)))
  q = tf.zeros([1, 4, 2, 8])
  with pytest.raises(replicator.ArgumentError, match=r"expected \[batch, tokens, heads, head size\]"):
    repl.run(lambda: repl.ring_attention(tf.zeros([4, 8]), q, q, axis="seq"))
  with pytest.raises(replicator.ArgumentError, match=r"do not agree.*query heads a multiple of the key heads"):
    repl.run(lambda: repl.ring_attention(tf.zeros([1, 4, 3, 8]), tf.zeros([1, 4, 2, 8]), tf.zeros([1, 4, 2, 8]),
                                         axis="seq"))


@pytest.mark.parametrize("exchange", ["ring", "all_gather"])
def test_grouped_query_heads_travel_unrepeated_and_equal_one_devices_repeated_attention(exchange):
  # 4 query heads over 2 key and value heads (each serving 2): the blocks go around with their 2 heads (half the
  # bytes of repeated ones), repeated on each device for its products, their gradients summed over each group.
  # The reference: one device's attention of the keys and values repeated to the query heads.
  rng = np.random.default_rng(3)
  q, w = (rng.normal(size=(B, S, 2 * H, D)).astype(np.float32) for _ in range(2))
  k, v = (rng.normal(size=(B, S, H, D)).astype(np.float32) for _ in range(2))

  values = [q, k, v, w]
  truth = _one_device(values, True, None, np.float64)
  floor = reorder_floor(values, truth, "zigzag", True, None)
  repl = replicator.Replicator(mesh=mesh.Mesh({"seq": P}, devices=cpus(P)))

  def step():
    index = int(tf.get_static_value(repl.axis_index("seq")))
    mine = [replicator.shard_sequence(x, index, P, order="zigzag") for x in (q, k, v, w)]
    with tf.GradientTape() as tape:
      tape.watch(mine[:3])
      out = repl.ring_attention(*mine[:3], axis="seq", causal=True, order="zigzag", exchange=exchange)
      loss = tf.reduce_sum(out * mine[3])
    return [out, *tape.gradient(loss, mine[:3])]

  got = [replicator.unshard_sequence([t.numpy() for t in per_device], order="zigzag").numpy()
         for per_device in repl.run(step)]
  assert_within_twice_the_floor(got, truth, floor)
  sent = [c for c in repl.explain(step).collectives if c.kind in ("permute", "all_gather")]
  assert sent and all(c.shape[2] == H for c in sent if c.shape.rank == 4)  # (the key heads, not the query heads)


def test_the_backward_pass_keeps_a_devices_tokens_not_its_scores():
  # One device keeps the softmax's output, [B, H, S, S]; the ring keeps a device's q, k, v, output and the log
  # of its queries' softmax denominators (FlashAttention's backward recomputes the scores block by block).
  length = 256
  rng = np.random.default_rng(0)
  values = [rng.normal(size=(1, length, H, D)).astype(np.float32) for _ in range(3)]

  def one_step(batch):
    q, k, v = batch
    with tf.GradientTape() as tape:
      tape.watch([q, k, v])
      scores = tf.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
      loss = tf.reduce_sum(tf.einsum("bhqk,bkhd->bqhd", tf.nn.softmax(scores), v) ** 2)
    return tape.gradient(loss, [q, k, v])

  one = replicator.Replicator(devices=cpus(1)).memory(one_step, inputs=tuple(values)).device()
  assert one.saved_bytes >= H * length * length * 4
  repl = replicator.Replicator(mesh=mesh.Mesh({"seq": P}, devices=cpus(P)))

  def step(batch):
    index = int(tf.get_static_value(repl.axis_index("seq")))
    q, k, v = (replicator.shard_sequence(x, index, P, order="zigzag") for x in values)
    with tf.GradientTape() as tape:
      tape.watch([q, k, v])
      loss = tf.reduce_sum(repl.ring_attention(q, k, v, axis="seq", causal=True, order="zigzag") ** 2)
    return tape.gradient(loss, [q, k, v])

  tokens = length // P
  for device in repl.memory(step, inputs=(tf.zeros([1]),)).devices:
    assert device.saved_bytes == 4 * tokens * H * D * 4 + H * tokens * 4, device
    assert device.saved_bytes <= one.saved_bytes / P


def test_auto_is_the_ring_in_one_process_and_the_all_gather_across_processes():
  from replicator.core import _ring_attention  # pylint: disable=import-outside-toplevel
  one = mesh.Mesh({"seq": 2}, devices=cpus(2))
  assert _ring_attention.exchange_for(one, 0, ("seq",), "auto") == "ring"


  class Workers:  # a mesh of two worker processes' devices (a real one needs a cluster: test_multi_client's)
    devices = ("/job:worker/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:1/device:CPU:0")

    def groups(self, axes):
      return ((0, 1),)

  assert _ring_attention.exchange_for(Workers(), 1, ("seq",), "auto") == "all_gather"
  with pytest.raises(replicator.ArgumentError, match=r"exchange='p2p'\): expected one of"):
    _ring_attention.exchange_for(one, 0, ("seq",), "p2p")


@pytest.mark.parametrize("exchange", ["ring", "all_gather"])
@pytest.mark.parametrize("order", ["contiguous", "zigzag"])
def test_a_length_the_devices_do_not_divide_is_padded_and_masked(order, exchange):
  # 30 tokens over 4 devices: padded to 32 (zigzag: 8 chunks of 4), the 2 padding keys masked; the real tokens'
  # outputs and gradients are one device's on the 30 tokens (causal: the padding comes after every real query).
  def attend(repl, q, k, v, key_mask):
    return repl.ring_attention(q, k, v, axis="seq", causal=True, order=order, key_mask=key_mask, exchange=exchange)

  assert_padded_attention_equals_one_device(attend, order, H)


def assert_padded_attention_equals_one_device(attend, order, heads):
  """``attend(repl, q, k, v, key_mask)``, causal, on 30 tokens padded to a length ``P`` devices split: the real
  tokens' attention and gradients within twice the reorder floor of one device's on the 30 tokens (float64)."""
  length = 30
  rng = np.random.default_rng(3)
  values = [rng.normal(size=(B, length, heads, D)).astype(np.float32) for _ in range(4)]
  truth = _one_device(values, True, None, np.float64)
  floor = reorder_floor(values, truth, order, True, None)
  padded = [replicator.pad_sequence(x, P, order=order) for x in values]
  mask = padded[0][1].numpy()
  assert mask.shape == (B, 32) and mask.sum() == B * length
  repl = replicator.Replicator(mesh=mesh.Mesh({"seq": P}, devices=cpus(P)))

  def step():
    index = int(tf.get_static_value(repl.axis_index("seq")))
    q, k, v, w = (replicator.shard_sequence(x, index, P, order=order) for x, _ in padded)
    key_mask = replicator.shard_sequence(mask, index, P, order=order)
    with tf.GradientTape() as tape:
      tape.watch([q, k, v])
      out = attend(repl, q, k, v, key_mask)
      loss = tf.reduce_sum(out * w)  # (w is zero on the padding: its rows add nothing)
    return [out, *tape.gradient(loss, [q, k, v])]

  got = [replicator.unshard_sequence([t.numpy() for t in per_device], order=order).numpy()[:, :length]
         for per_device in repl.run(step)]
  assert_within_twice_the_floor(got, truth, floor)


def test_explain_says_which_exchange_ring_attention_chose():
  from replicator.core import _ring_attention  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(5)
  q, k, v = (tf.constant(rng.normal(size=(B, 8, H, D)).astype(np.float32)) for _ in range(3))
  repl = replicator.Replicator(mesh=mesh.Mesh({"seq": 2}, devices=cpus(2)))
  for exchange, kinds, said in [("auto", {"permute"}, "passed around the ring (a permute a step)"),
                                ("all_gather", {"all_gather"}, "all-gathered (exchange='all_gather')")]:
    report = repl.explain(lambda e=exchange: repl.ring_attention(q, k, v, axis="seq", exchange=e))
    rows = report.summary()
    assert {row["kind"] for row in rows} == kinds and all(said in row["location"] for row in rows), rows
  # Across worker processes "auto" is the all-gather, and says why.
  assert "as the axis spans worker processes" in _ring_attention.exchange_said("all_gather", "auto")
