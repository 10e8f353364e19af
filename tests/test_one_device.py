"""Tests for the one_device lowering's reductions: AddN, and XLA sums for large tensors."""

import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus

import replicator
from rewrite import _one_device

LARGE = _one_device.XLA_SUM_MIN_BYTES // 4 + 5  # float32 elements: just above the threshold


def _op_types(fn, *args):
  return {op.type for op in tf.function(fn).get_concrete_function(*args).graph.get_operations()}


def test_large_sums_are_one_xla_call_small_ones_add_n():
  big = [tf.TensorSpec([LARGE], tf.float32)] * 3
  small = [tf.TensorSpec([LARGE - 10], tf.float32)] * 3
  large_ops = _op_types(lambda *v: _one_device.reduce_values("sum", v), *big)
  small_ops = _op_types(lambda *v: _one_device.reduce_values("sum", v), *small)
  assert "AddN" in small_ops and not small_ops & {"PartitionedCall", "StatefulPartitionedCall"}
  assert "AddN" not in large_ops and large_ops & {"PartitionedCall", "StatefulPartitionedCall"}
  # Integers and unknown shapes keep AddN.
  assert "AddN" in _op_types(lambda *v: _one_device.reduce_values("sum", v), *[tf.TensorSpec([LARGE], tf.int32)] * 2)
  assert "AddN" in _op_types(lambda *v: _one_device.reduce_values("sum", v), *[tf.TensorSpec([None], tf.float32)] * 2)


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_large_all_reduce_matches_numpy(op):
  repl = replicator.Replicator(cpus(4), implementation="one_device")
  rng = np.random.RandomState(0)
  values = [rng.randn(LARGE).astype(np.float32) for _ in range(4)]
  out = repl.run(lambda x: repl.all_reduce(x, op), inputs=replicator.PerReplica(values))
  want = np.sum(values, axis=0) / (4 if op == "mean" else 1)
  for o in out:
    np.testing.assert_allclose(o.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("root", [None, 2])
def test_an_all_reduce_is_made_on_its_root_member(root):
  # The sharded update reduces each gradient for its owner (params "root"): made on the owner's device, the
  # others' copies are then unread and pruned. Without a root, the first device makes it.
  from rewrite._plan import Collective  # pylint: disable=import-outside-toplevel
  devices = cpus(4)
  params = (("op", "sum"),) if root is None else (("op", "sum"), ("root", root))
  collective = Collective(index=0, kind="all_reduce", params=params, axes=("x",), dtype=tf.float32,
                          shape=tf.TensorShape([3]), members=(), groups=((0, 1, 2, 3),), implementation="one_device")
  graph = tf.Graph()
  with graph.as_default():
    inputs = []
    for i, d in enumerate(devices):
      with tf.device(d):
        inputs.append(tf.constant([1.0, 2.0, 3.0]) * (i + 1))
    outputs = _one_device.OneDevice().lower_group(collective, inputs, devices, None)
    (total,) = [op for op in graph.get_operations() if op.type == "AddN"]
    assert total.device == tf.DeviceSpec.from_string(devices[root or 0]).to_string()
    assert outputs[root or 0] is total.outputs[0]
    assert [o.device for o in outputs] == [tf.DeviceSpec.from_string(d).to_string() for d in devices]
    with tf.compat.v1.Session(graph=graph) as session:
      for value in session.run(outputs):
        np.testing.assert_array_equal(value, [10.0, 20.0, 30.0])


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_members_sharing_a_device_are_added_in_turn_then_summed_across_devices(op):
  # A pipeline's microbatches (Mesh.with_repeats): each device's members' values added one at a time in their
  # order (a running sum: each microbatch's gradient freed once added), then the devices' sums on the root's.
  from rewrite._plan import Collective  # pylint: disable=import-outside-toplevel
  two = cpus(2)
  devices = [two[0], two[0], two[0], two[1], two[1], two[1]]
  collective = Collective(index=0, kind="all_reduce", params=(("op", op),), axes=("x",), dtype=tf.float32,
                          shape=tf.TensorShape([2]), members=(), groups=(tuple(range(6)),), implementation="one_device")
  graph = tf.Graph()
  with graph.as_default():
    inputs = []
    for i, d in enumerate(devices):
      with tf.device(d):
        inputs.append(tf.constant([1.0, 10.0]) * (i + 1))
    outputs = _one_device.OneDevice().lower_group(collective, inputs, devices, None)
    adds = [o for o in graph.get_operations() if o.type == "AddV2"]
    assert len(adds) == 4 and not [o for o in graph.get_operations() if o.type == "AddN" and len(o.inputs) > 2]
    assert {a.device for a in adds} == {tf.DeviceSpec.from_string(d).to_string() for d in two}
  with tf.compat.v1.Session(graph=graph) as session:
    got = session.run(outputs)
  want = np.array([21.0, 210.0]) / (6 if op == "mean" else 1)
  for value in got:
    np.testing.assert_allclose(value, want, rtol=1e-6)
