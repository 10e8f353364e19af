"""Ring attention at global shapes (``replicator/core/_blockwise_ring.py``): ``context_parallel="ring"``.

Checked against Keras's attention in float64 (the function, every mask kind,
grouped heads, rings of 2 to 4 tiles), one device (a decoder trained over a
split sequence; masks built from the global batch: test_keras_attention's
scheme "ring"), and ``explain``: the
keys and values go around the ring by permutes a tile at a time (never
gathered), their gradients back, no scores kept for the backward pass.
"""

import types

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus
from conftest import keras_step
from test_keras_attention import HEADS
from test_keras_attention import B
from test_keras_attention import S
from test_keras_attention import V
from test_keras_attention import _data
from test_keras_attention import _decoder
from test_keras_attention import trains_as_one_device

import mesh
import replicator
from replicator.core import _blockwise_ring
from replicator.integrations import _keras_attention


@pytest.mark.parametrize("mask_kind", [None, "keys", "queries", "both", "pieces"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tiles,groups", [(2, 1), (3, 2), (4, 1)])
def test_ring_attention_is_keras_attention_and_its_gradients(mask_kind, causal, tiles, groups):
  # float64: 1e-15 apart (measured); a tile paired with the wrong keys, a mask tile from the wrong offset or a
  # gradient left one step off the ring is 1e-2 off or more. "pieces": a tuple of a mask over queries and one over
  # keys (MultiHeadAttention's padding as _keras_attention hands it), Keras given their AND; a third of the queries
  # then see no key.
  rng = np.random.default_rng(0)
  q = tf.constant(rng.normal(size=(2, 12, 4, 4)))
  k, v = (tf.constant(rng.normal(size=(2, 12, 4 // groups, 4))) for _ in range(2))
  shape = {None: None, "keys": (2, 1, 1, 12), "queries": (2, 1, 12, 1), "both": (2, 1, 12, 12),
           "pieces": ((2, 1, 12, 1), (2, 1, 1, 12))}[mask_kind]
  if mask_kind == "pieces":
    mask = tuple(tf.constant(rng.random(s) > 0.3) for s in shape)
  else:
    mask = None if shape is None else tf.constant(rng.random(shape) > 0.3)
  joined = tf.logical_and(*mask) if mask_kind == "pieces" else mask
  weights = tf.constant(rng.normal(size=(2, 12, 4, 4)))
  with tf.GradientTape(persistent=True) as tape:
    tape.watch([q, k, v])
    theirs = keras.ops.dot_product_attention(q, tf.repeat(k, groups, axis=2), tf.repeat(v, groups, axis=2),
                                             mask=joined, scale=0.5, is_causal=causal)
    ours = _blockwise_ring.attention(q, k, v, mask=mask, is_causal=causal, scale=0.5, tiles=tiles, groups=groups)
    their_loss, our_loss = tf.reduce_sum(theirs * weights), tf.reduce_sum(ours * weights)
  np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=1e-13)
  for a, b in zip(tape.gradient(our_loss, [q, k, v]), tape.gradient(their_loss, [q, k, v])):
    np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-13)


@pytest.mark.parametrize("scheme", ["ring", "blockwise"])
def test_a_query_seeing_no_key_has_keras_gradients(scheme):
  # Keras: its scores all masked, its probabilities uniform, no gradient through its scores. A maximum plus the log
  # of the denominator (2.4e38 + 2.5) loses the log: its values' gradient was 12 times Keras's (found by this test).
  from replicator.core import _blockwise_attention  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  q, k, v, weights = (tf.constant(rng.normal(size=(1, 12, 2, 4))) for _ in range(4))
  mask = tf.constant(np.arange(12)[None, None, :, None] % 3 > 0)  # queries 0, 3, 6, 9 see nothing
  with tf.GradientTape(persistent=True) as tape:
    tape.watch([q, k, v])
    theirs = keras.ops.dot_product_attention(q, k, v, mask=mask, scale=0.5)
    ours = (_blockwise_ring.attention(q, k, v, mask=mask, scale=0.5, tiles=3) if scheme == "ring" else
            _blockwise_attention.attention(q, k, v, mask=mask, scale=0.5, blocks=3))
    their_loss, our_loss = tf.reduce_sum(theirs * weights), tf.reduce_sum(ours * weights)
  for a, b in zip(tape.gradient(our_loss, [q, k, v]), tape.gradient(their_loss, [q, k, v])):
    np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-13)


@pytest.mark.parametrize("shape", [{"batch": 2, "seq": 2}, {"seq": 4}])  # {"seq": 4}: the traffic's P - 1 at P = 4
def test_a_decoder_over_a_ring_trains_as_on_one_device_passing_tiles_not_gathering(shape):
  # 3 Adam steps at 1e-2: 3e-7 from one device at most with every tile pair (measured; the all-gather's: 3.0e-7);
  # in the balanced order (the decoder's attention is causal) 4.6e-7 over {"batch": 2, "seq": 2} and 2.7e-7 over
  # {"seq": 4} (measured), so 1e-6; a wrong tile pairing or mask offset is 1e-3 off or more.
  batch_axes = ("batch",) if "batch" in shape else ()
  repl = replicator.Replicator(mesh=mesh.Mesh(shape, devices=cpus(4)), view="global", batch_axes=batch_axes,
                               input_layouts=("batch" if batch_axes else None, "seq"), context_parallel="ring",
                               strict=True)
  tiles = shape["seq"]
  assert _keras_attention.ring_tiles(repl) == tiles
  step = trains_as_one_device(repl)

  report = repl.explain(step, _data())
  rows, s = B // shape.get("batch", 1), S // tiles  # a device's rows and tokens
  tile = (rows, 1, s, HEADS, 8)  # a device's tile of keys or values (or of their gradients)
  permutes = [c for c in report.collective_rows if c.kind == "permute"]
  assert all(c.axes == ("seq",) for c in permutes), permutes
  # Forward: keys and values each rolled P - 1 times; backward: again, and their gradients P - 1 times each.
  ring = [c for c in permutes if c.why.startswith("Roll by")]
  assert len(ring) == 6 * (tiles - 1) and all(c.shape == tile for c in ring), ring
  assert all(c.bytes_per_device == rows * s * HEADS * 8 * 4 for c in ring)
  # The attention is causal (MultiHeadAttention's use_causal_mask): in the balanced order (_zigzag_ring), the
  # queries, keys, values and output reordered, and their gradients: each a chunk of half a tile a device, in one
  # round at P = 2 (a swap) and two at P = 4 (a ring and a swap).
  reorders = [c for c in permutes if c.why.startswith("GatherV2 of constant rows")]
  assert len(reorders) == 8 * {2: 1, 4: 2}[tiles] and len(reorders) + len(ring) == len(permutes), permutes
  assert all(c.shape == (rows, s // 2, HEADS, 8) for c in reorders), reorders
  assert not [c for c in report.collective_rows if c.kind == "all_gather" and c.shape and len(c.shape) >= 4]
  scores = {(rows, 1, HEADS, s, s), (rows, HEADS, s, S)}  # a tile pair's scores, a device's score rows
  saved = [t for t in report.memory.saved if t.device.endswith("CPU:0")]
  assert not any(tuple(t.shape or ()) in scores for t in saved), [t for t in saved if t.bytes > 8192]


def test_the_ring_is_the_all_gather_across_processes_and_where_the_length_does_not_divide():
  class Workers:  # two worker processes' devices, 2 each (a real cluster: test_multi_client's)
    devices = tuple(f"/job:worker/replica:0/task:{t}/device:CPU:{d}" for t in range(2) for d in range(2))
    shape = {"batch": 2, "seq": 2}

    def __init__(self, seq_groups):
      self.seq_groups = seq_groups

    def groups(self, axes):
      return self.seq_groups

  def ring_tiles(seq_groups):
    return _keras_attention.ring_tiles(types.SimpleNamespace(mesh=Workers(seq_groups), input_layouts=("batch", "seq"),
                                                             batch_axes=("batch",)))

  assert ring_tiles(((0, 2), (1, 3))) == 1  # "seq" joins the two workers' devices: the keys all-gathered
  assert ring_tiles(((0, 1), (2, 3))) == 2  # "seq" within each worker: the ring
  q = tf.zeros((2, 10, 2, 4))
  assert not _blockwise_ring.divides(q, q, 4) and _blockwise_ring.divides(q, q, 5)


def test_the_local_view_is_told_to_call_the_ring_itself():
  with pytest.raises(replicator.ArgumentError, match=r"context_parallel='ring'.*repl\.ring_attention"):
    replicator.Replicator(cpus(2), context_parallel="ring")


def test_explain_says_the_ring_took_the_all_gather_across_processes(monkeypatch):
  # (One process here: the ring's length made 1, as ring_tiles makes it where "seq" spans worker processes.)
  monkeypatch.setattr(_keras_attention, "ring_tiles", lambda repl: 1)
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "seq": 2}, devices=cpus(4)), view="global",
                               input_layouts=("batch", "seq"), context_parallel="ring", strict=True)
  with repl.context():
    model, opt = _decoder(), keras.optimizers.Adam(1e-2)
  rows = repl.explain(keras_step(model, opt), _data()).collective_rows
  gathers = [c for c in rows if c.kind == "all_gather" and c.shape and len(c.shape) == 4]
  assert len(gathers) == 4 and not [c for c in rows if c.kind == "permute"]  # keys and values, each pass
  forward = [c for c in gathers if not c.op_name.startswith("gradients/")]  # (the backward's: tape.gradient's line)
  assert len(forward) == 2 and all(c.location.endswith(f"({_keras_attention.RING_ACROSS})") for c in forward), [
      (c.op_name, c.location) for c in gathers]


def test_explain_says_where_a_mask_over_queries_and_keys_is_cut_into_tile_pairs():
  # An attention_mask= tensor [batch, queries, keys] (here the keys' padding tiled over the queries, split by its
  # keys): each step's tile pairs picked out by an all-reduce of a tile pair's size, which explain's line names.
  # (MultiHeadAttention's own padding masks are handed over as their pieces: test_keras_attention.)
  from test_keras_attention import _mask_layers  # pylint: disable=import-outside-toplevel
  from test_keras_attention import _masked_step  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(4)
  ids = rng.integers(0, V, (B, S)).astype(np.int32)
  data = tf.data.Dataset.from_tensors((ids, ids, ids)).repeat()
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "seq": 2}, devices=cpus(4)), view="global",
                               input_layouts=("batch", "seq"), context_parallel="ring", strict=True)
  with repl.context():
    layers = _mask_layers()
  rows = repl.explain(_masked_step(layers, "padding"), data).collective_rows
  cut = [c for c in rows if c.kind == "all_reduce" and "max" in c.why]
  assert len(cut) == 4 and all(c.shape == (B // 2, 1, 2, S // 2, S // 2) for c in cut), cut  # 2 steps, each pass
  assert all(c.location.endswith(f"({_blockwise_ring.PAIRS_CUT})") for c in cut), [c.location for c in cut]
