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
