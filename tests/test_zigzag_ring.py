"""Causal ring attention at global shapes in the balanced order (``replicator/core/_zigzag_ring.py``).

Checked against Keras's attention in float64 (the function: causal, with
and without a mask over the keys, queries that see no key, grouped heads,
rings of 2 to 4 tiles), and in the global view against one device in
float32, with each device's score work counted from the partitioned
graph's shapes and the collectives from ``explain``.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus
from test_ring_attention import B
from test_ring_attention import D
from test_ring_attention import S
from test_ring_attention import _one_device
from test_ring_attention import _values
from test_ring_attention import assert_within_twice_the_floor
from test_ring_attention import reorder_floor

import mesh
import replicator
from replicator.core import _blockwise_ring
from replicator.core import _zigzag_ring


def test_the_zigzag_order_gives_tile_p_chunks_p_and_2P_minus_1_minus_p():
  assert _zigzag_ring.zigzag(2, 8).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
  assert _zigzag_ring.zigzag(4, 8).tolist() == [0, 7, 1, 6, 2, 5, 3, 4]


@pytest.mark.parametrize("mask_kind", [None, "keys", "keys_by_head", "padding_first"])
@pytest.mark.parametrize("tiles,groups", [(2, 1), (3, 2), (4, 1)])
def test_balanced_ring_attention_is_keras_attention_and_its_gradients(mask_kind, tiles, groups):
  # float64: 1.8e-15 apart at most (measured); a step's block folded into the other half (the condition t < p for
  # t <= p) is 1.9 off, the keys' mask a tile off 1.3 or more (measured). "padding_first": the first 5 keys padding, so queries 0 to 4 see
  # no key (Keras: every score masked, the mean of all the values; their gradient to every value).
  rng = np.random.default_rng(0)
  q = tf.constant(rng.normal(size=(2, 24, 4, 4)))
  k, v = (tf.constant(rng.normal(size=(2, 24, 4 // groups, 4))) for _ in range(2))
  mask = {None: None,
          "keys": tf.constant(rng.random((2, 1, 1, 24)) > 0.3),
          "keys_by_head": tf.constant(rng.random((2, 4, 1, 24)) > 0.3),
          "padding_first": tf.constant(np.arange(24)[None, None, None, :] >= 5)}[mask_kind]
  assert _zigzag_ring.applies(q, k, mask, True, tiles)
  weights = tf.constant(rng.normal(size=(2, 24, 4, 4)))
  with tf.GradientTape(persistent=True) as tape:
    tape.watch([q, k, v])
    theirs = keras.ops.dot_product_attention(q, tf.repeat(k, groups, axis=2), tf.repeat(v, groups, axis=2),
                                             mask=mask, scale=0.5, is_causal=True)
    ours = _zigzag_ring.attention(q, k, v, mask=mask, scale=0.5, tiles=tiles, groups=groups)
    their_loss, our_loss = tf.reduce_sum(theirs * weights), tf.reduce_sum(ours * weights)
  np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=1e-13)
  for a, b in zip(tape.gradient(our_loss, [q, k, v]), tape.gradient(their_loss, [q, k, v])):
    np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-13)


def test_only_causal_attention_with_no_mask_or_one_over_the_keys_is_balanced():
  q = tf.zeros((2, 24, 2, 4))
  assert _zigzag_ring.applies(q, q, None, True, 4)
  assert not _zigzag_ring.applies(q, q, None, False, 4)  # (not causal: no pair hidden)
  assert not _zigzag_ring.applies(q, q, tf.ones((2, 1, 24, 24), tf.bool), True, 4)  # over queries and keys
  assert not _zigzag_ring.applies(q, q, tf.ones((2, 1, 24, 1), tf.bool), True, 4)  # over queries
  assert not _zigzag_ring.applies(q, q, None, True, 5)  # 10 chunks do not divide 24
  assert not _zigzag_ring.applies(q, tf.zeros((2, 12, 2, 4)), None, True, 2)  # keys of another length
  assert _zigzag_ring.applies(q, q, tf.ones((24,), tf.bool), True, 3)  # (a mask of the keys alone, broadcast)
  with tf.GradientTape() as tape:  # the unbalanced ring still there when asked for
    tape.watch(q)
    out = _blockwise_ring.attention(q, q, q, is_causal=True, scale=0.5, tiles=4, balanced=False)
  assert out.shape == q.shape and tape.gradient(out, q) is not None


def _global(shape, key_mask, balanced=True):
  """A causal attention and its gradients (of sum(out * w)) as a global-view step over ``shape``'s "seq" (and
  "batch"): the Replicator, the step, its dataset."""
  batch = ("batch",) if "batch" in shape else ()
  tiles = shape["seq"]
  repl = replicator.Replicator(mesh=mesh.Mesh(shape, devices=cpus(4)), view="global", batch_axes=batch, strict=True,
                               input_layouts=lambda i, spec: (batch or None, "seq") + (None,) * (spec.shape.rank - 2))
  values = _values()
  data = tf.data.Dataset.from_tensors(tuple(values) + (() if key_mask is None else (key_mask,)))

  def step(batch):
    q, k, v, w = batch[:4]
    mask = None if key_mask is None else batch[4][:, None, None, :]
    with tf.GradientTape() as tape:
      tape.watch([q, k, v])
      out = _blockwise_ring.attention(q, k, v, mask=mask, is_causal=True, scale=D ** -0.5, tiles=tiles,
                                      balanced=balanced)
      loss = tf.reduce_sum(out * w)
    return [out, *tape.gradient(loss, [q, k, v])]

  return repl, step, data


def _score_work(repl, step, data):
  """Each device's score elements, forward and backward, from the partitioned graph's shapes: the elements of every
  ``[b, P, heads, queries, keys]`` einsum placed on it (the scores, and again the scores and their gradient's
  ``dout v^T`` in the backward pass)."""
  built = repl._views["global"].step_for(step, next(iter(data)))  # pylint: disable=protected-access
  graph = tf.Graph()
  with graph.as_default():
    tf.graph_util.import_graph_def(built.graph_def, name="")
  work = {}
  for op in graph.get_operations():
    if op.type == "Einsum" and op.get_attr("equation").decode().endswith("->bpnts"):
      device = tf.DeviceSpec.from_string(op.device).device_index
      work[device] = work.get(device, 0) + op.outputs[0].shape.num_elements()
  return [work.get(d, 0) for d in range(4)]


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("shape", [{"seq": 4}, {"batch": 2, "seq": 2}])
def test_causal_attention_at_global_shapes_is_one_devices_with_half_the_work_on_every_device(shape, padded):
  # Tolerance: twice the one-device reorder floor (test_ring_attention's: the largest root-mean-square distance from
  # float64 among one device's float32 runs summed in other orders, the zigzag split's among them). Measured here,
  # every result of the four cases: 0.61 to 0.95 times the floor (the most: the queries' gradient over
  # {"batch": 2, "seq": 2}, padded).
  key_mask = None
  if padded:  # the last 5 tokens of the second sequence are padding
    key_mask = np.ones((B, S), bool)
    key_mask[1, -5:] = False
  tiles = shape["seq"]
  values = _values()
  truth = _one_device(values, True, key_mask, np.float64)
  floor = reorder_floor(values, truth, "zigzag", True, key_mask, axis_size=tiles)
  repl, step, data = _global(shape, key_mask)
  got = [np.asarray(t) for t in repl.run(step, data)]
  assert_within_twice_the_floor(got, truth, floor)

  # Balance: every device the same score work, (2P + 1) / 4P of the ring's every tile pair (P = 4: 9 of 16
  # quarter-blocks a pass; P = 2: 5 of 8).
  balanced = _score_work(repl, step, data)
  every_pair = _score_work(*_global(shape, key_mask, balanced=False))
  assert len(set(balanced)) == 1 and len(set(every_pair)) == 1, (balanced, every_pair)
  assert balanced[0] * 4 * tiles == every_pair[0] * (2 * tiles + 1), (balanced, every_pair)

  # Communication: the reorders' permutes (q, k, v, the output, and their gradients: a chunk of half a tile a
  # device each round) and the ring's (rolls of the keys, values, the keys' mask and the gradients); no all-gather
  # or all-reduce but the results' gathers to return them.
  rows = repl.explain(step, data).collective_rows
  assert not [c for c in rows if c.kind != "permute" and "to return it" not in (c.why or "")], rows
  permutes = [c for c in rows if c.kind == "permute"]
  assert all(c.axes == ("seq",) for c in permutes), permutes
  reorders = [c for c in permutes if c.why.startswith("GatherV2 of constant rows")]
  rolls = [c for c in permutes if c.why.startswith("Roll by")]
  rows_here, chunk = B // shape.get("batch", 1), S // (2 * tiles)
  rounds = {2: 1, 4: 2}[tiles]  # (P = 2: a swap; P = 4: a ring and a swap)
  tokens = [c for c in reorders if c.shape == (rows_here, chunk, values[0].shape[2], D)]
  padding = [c for c in reorders if c.shape == (rows_here, 1, 1, chunk) and c.dtype == "bool"]  # the keys' mask
  assert len(tokens) == 8 * rounds and len(padding) == (rounds if padded else 0), reorders
  assert len(tokens) + len(padding) == len(reorders), reorders
  masks = 2 * (tiles - 1) if padded else 0  # the keys' mask rolled with the keys, forward and backward
  assert len(rolls) == 6 * (tiles - 1) + masks and len(reorders) + len(rolls) == len(permutes), permutes
