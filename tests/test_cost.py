"""The global view's cost model (``rewrite._cost``): each device's work from a partition, priced on a machine."""

import collections
import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus
from conftest import keras_step

import mesh
import replicator
from rewrite import _cost
from rewrite import _partition

MESH = {"batch": 2, "model": 2}


def _work(fn, specs, given, outputs=True):
  graph = tf.function(fn, autograph=False).get_concrete_function(*specs).graph
  m = mesh.Mesh(MESH, devices=cpus(4))
  part = _partition.propagate(graph, m, {t.name: layout for t, layout in zip(graph.inputs, given)})
  return _cost.work(graph, part, MESH, graph.outputs if outputs else ())


def test_a_column_split_product_counts_the_pieces_flops_and_the_gathers_of_its_output():
  # x [8, 6] over "batch", w [6, 4] by columns over "model": each device multiplies [4, 6] by [6, 2].
  work = _work(lambda x, w: tf.matmul(x, w), [tf.TensorSpec([8, 6]), tf.TensorSpec([6, 4])],
               [(("batch",), ()), ((), ("model",))])
  assert work.devices == 4 and work.ops == 1
  assert work.flops == 2 * 4 * 2 * 6
  # returned whole: gathered over "batch" (a [4, 2] piece: 32 bytes), then over "model" ([8, 2]: 64 bytes)
  assert [(c.kind, c.group, c.bytes) for c in work.collectives] == [("all_gather", 2, 32), ("all_gather", 2, 64)]
  assert work.bytes_communicated == 32 + 64  # an all-gather of 2 sends its piece once


def test_a_row_split_product_all_reduces_its_partial_sums():
  # w [6, 4] by rows over "model": x's columns are sliced (free), the products are partial sums over "model".
  work = _work(lambda x, w: tf.matmul(x, w), [tf.TensorSpec([8, 6]), tf.TensorSpec([6, 4])],
               [(("batch",), ()), (("model",), ())], outputs=False)
  assert work.flops == 2 * 4 * 4 * 3
  assert [(c.kind, c.group, c.bytes) for c in work.collectives] == [("all_reduce", 2, 4 * 4 * 4)]
  assert work.bytes_communicated == pytest.approx(2 * (2 - 1) / 2 * 64)
  # an elementwise op after it: bytes read and written on the piece, no flops
  work = _work(lambda x, w: tf.tanh(tf.matmul(x, w)), [tf.TensorSpec([8, 6]), tf.TensorSpec([6, 4])],
               [(("batch",), ()), (("model",), ())], outputs=False)
  assert work.ops == 2 and work.bytes == 2 * 4 * 4 * 4


def test_the_peak_counts_each_tensor_from_its_op_to_its_last_reader():
  # y = exp(x), z = 2y, out = y + z, x [1000] float32: at the sum y and z are still held and out is made (12,000
  # bytes); the reshape is y's buffer (not counted), and keeps y until its reader. The input is not counted.
  def fn(x):
    y = tf.exp(x)
    z = y * 2.0
    return y + z, tf.reshape(y, [20, 50]) * 3.0

  spec = [tf.TensorSpec([1000])]
  whole = _work(fn, spec, [((),)], outputs=False)
  assert whole.peak_bytes == 4000 * 3
  # the last product: y (through its reshape) and the product; out was freed (nothing reads it) as were z
  assert _work(lambda x: fn(x)[1], spec, [((),)], outputs=False).peak_bytes == 4000 * 2
  split = _work(fn, spec, [(("batch", "model"),)], outputs=False)  # a piece of 250 a device
  assert split.peak_bytes == 1000 * 3


def test_contractions_count_their_contracted_size():
  specs = [tf.TensorSpec([8, 3, 6]), tf.TensorSpec([6, 2, 4])]
  given = [(("batch",), (), ()), ((), ("model",), ())]
  einsum = _work(lambda x, w: tf.einsum("btd,dhe->bthe", x, w), specs, given, outputs=False)
  assert einsum.flops == 2 * (4 * 3 * 1 * 4) * 6
  batched = _work(lambda x, y: tf.matmul(x, y, adjoint_b=True), [tf.TensorSpec([8, 3, 6]), tf.TensorSpec([8, 5, 6])],
                  [(("batch",), (), ()), (("batch",), (), ())], outputs=False)
  assert batched.flops == 2 * (4 * 3 * 5) * 6
  conv = _work(lambda x, k: tf.nn.conv2d(x, k, 1, "SAME"), [tf.TensorSpec([4, 6, 6, 3]), tf.TensorSpec([3, 3, 3, 8])],
               [(("batch",), (), (), ()), ((), (), (), ("model",))], outputs=False)
  assert conv.flops == 2 * (2 * 6 * 6 * 4) * (3 * 3 * 3)


def test_an_estimate_adds_compute_overhead_and_communication_with_devices_sharing_cores():
  work = _cost.Work(devices=4, ops=10, flops=1e6, bytes=2e6, collectives=(
      _cost.CollectiveWork("all_reduce", 4, 1000, "a"), _cost.CollectiveWork("all_gather", 2, 500, "b")))
  machine = _cost.Machine(flops_per_second=1e9, bytes_per_second=1e9, op_seconds=1e-6, parallel_devices=2,
                          collective_seconds=1e-5, collective_bytes_per_second=1e8)
  estimate = work.estimate(machine)
  assert estimate.compute_seconds == pytest.approx((1e-3 + 2e-3) * 2)  # 4 devices, 2 at a time
  assert estimate.overhead_seconds == pytest.approx(10 * 1e-6 * 2)
  assert estimate.communication_seconds == pytest.approx(2 * 1e-5 + (1500 + 500) / 1e8)
  assert estimate.seconds == pytest.approx(estimate.compute_seconds + estimate.overhead_seconds
                                           + estimate.communication_seconds)
  # each kind at its own measured cost where the machine has one (the all-gather's: 5e-5 s and 1e7 bytes/s)
  measured = dataclasses.replace(machine, collectives={"all_gather": (5e-5, 1e7)})
  assert work.estimate(measured).communication_seconds == pytest.approx(1e-5 + 1500 / 1e8 + 5e-5 + 500 / 1e7)


def _explained(layouts, update="replicated"):
  repl = replicator.Replicator(mesh=mesh.Mesh(MESH, devices=cpus(4)), view="global", update=update,
                               layouts=mesh.LayoutMap(layouts) if layouts else None)
  with repl.context():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.layers.Input((32,)), keras.layers.Dense(64, activation="relu", name="ff_in"),
                              keras.layers.Dense(64, activation="relu", name="ff_mid"),
                              keras.layers.Dense(8, name="ff_out")])
    opt = keras.optimizers.Adam(1e-2)
  step = keras_step(model, opt)

  rng = np.random.default_rng(0)
  data = tf.data.Dataset.from_tensors((rng.normal(size=(16, 32)).astype("float32"),
                                       rng.integers(0, 8, size=16).astype("int32")))
  return repl.explain(step, data)


@pytest.mark.parametrize("update", ["replicated", "sharded"])
def test_the_work_of_a_keras_step_has_the_collectives_of_its_plan(update):
  # The cost model reads the partition alone (a search scores layouts without expanding them): its collectives
  # must be the ones the expander and the plan make.
  report = _explained({r"ff_in/kernel$": (None, "model"), r"ff_in/bias$": ("model",),
                        r"ff_mid/kernel$": ("model", None)}, update=update)
  assert any(c.kind == "broadcast" for c in report.collectives) == (update == "sharded")
  planned = collections.Counter((c.kind, len(c.groups[0])) for c in report.collectives)
  modelled = collections.Counter((c.kind, c.group) for c in report.work.collectives)
  assert modelled == planned, (modelled, planned)
  assert sum(c.bytes for c in report.work.collectives) == sum(r.bytes_per_device for r in report.collective_rows)


def test_splitting_the_hidden_layers_costs_less_compute_a_device_than_replicating_them():
  machine = _cost.Machine(flops_per_second=1e10, bytes_per_second=1e10, op_seconds=1e-6, parallel_devices=4,
                          collective_seconds=1e-5, collective_bytes_per_second=1e9)
  replicated = _explained(None).work
  split = _explained({r"ff_(in|mid)/kernel$": (None, "model"), r"ff_in/bias$": ("model",)}).work
  assert split.flops < replicated.flops  # the hidden layers' products on half the units a device
  assert len(split.collectives) > len(replicated.collectives)
  assert split.estimate(machine).compute_seconds < replicated.estimate(machine).compute_seconds


def test_a_rematerialized_block_frees_its_saved_tensors_and_runs_its_forward_ops_twice():
  # Three blocks of u = relu(h @ w) [512, 256] and h' = h + u @ v [512, 64] under a tape: each keeps relu for
  # the backward pass (internal), and its input h (the block before it: kept).
  from rewrite import _recompute  # pylint: disable=import-outside-toplevel

  def fn(x, w0, v0, w1, v1, w2, v2):
    weights = [(w0, v0), (w1, v1), (w2, v2)]
    with tf.GradientTape() as tape:
      tape.watch(weights)
      h = x
      for i, (w, v) in enumerate(weights):
        with tf.name_scope(f"block{i}"):
          h = h + tf.matmul(tf.nn.relu(tf.matmul(h, w)), v)
      loss = tf.reduce_sum(h)
    return tape.gradient(loss, weights)

  specs = [tf.TensorSpec([512, 64])] + [tf.TensorSpec([64, 256]), tf.TensorSpec([256, 64])] * 3
  graph = tf.function(fn, autograph=False).get_concrete_function(*specs).graph
  m = mesh.Mesh({"batch": 1}, devices=cpus(1))
  part = _partition.propagate(graph, m, {t.name: ((),) * 2 for t in graph.inputs})
  blocks = _recompute.blocks(graph)
  assert [b.scope for b in blocks] == ["block0", "block1", "block2"]
  plain = _cost.work(graph, part, {"batch": 1}, graph.outputs)
  every = _cost.work(graph, part, {"batch": 1}, graph.outputs, recomputed=blocks)
  one = _cost.work(graph, part, {"batch": 1}, graph.outputs, recomputed=blocks[:1])
  relu = 512 * 256 * 4
  # Two of three relus are no longer held through the forward pass at its end (the last block's, recomputed at
  # once, is made as before); the first block's alone, one.
  assert plain.peak_bytes - every.peak_bytes >= 2 * relu
  assert plain.peak_bytes - one.peak_bytes >= relu
  # Again: each block's first product (2 x 512 x 64 x 256 flops), which the relu needs; not the second (its sum
  # with h is the next block's input, kept).
  assert every.flops - plain.flops == 3 * (2 * 512 * 64 * 256)
  assert every.ops > plain.ops
