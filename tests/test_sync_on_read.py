"""Sync-on-read variables and Keras metrics: per-replica in a step, aggregated outside."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus

import replicator

ON_READ = tf.VariableSynchronization.ON_READ


@pytest.mark.parametrize("aggregation, want", [
    (tf.VariableAggregation.SUM, 0 + 1 + 2 + 3 + 10.0),
    (tf.VariableAggregation.MEAN, (0 + 1 + 2 + 3) / 4 + 10.0),
    (tf.VariableAggregation.ONLY_FIRST_REPLICA, 0 + 10.0)])
def test_aggregated_read_outside_a_step(aggregation, want):
  repl = replicator.Replicator(cpus(4))
  with repl.context():
    v = tf.Variable(10.0, synchronization=ON_READ, aggregation=aggregation, trainable=False)
  assert float(v.numpy()) == 10.0  # the initial value is the aggregate

  def step_fn():
    v.assign_add(float(repl.replica_id))
    return v.read_value()  # inside a step: this replica's own value

  local = repl.run(step_fn)
  assert float(v.numpy()) == pytest.approx(want)
  assert float(tf.convert_to_tensor(v)) == pytest.approx(want)
  if aggregation == tf.VariableAggregation.SUM:
    assert [float(x) for x in local] == [10.0, 1.0, 2.0, 3.0]
  v.assign(5.0)  # outside a step: the aggregate becomes 5
  assert float(v.numpy()) == pytest.approx(5.0)


def test_on_read_checkpoint_stores_the_aggregate(tmp_path):
  repl = replicator.Replicator(cpus(4))
  with repl.context():
    v = tf.Variable(0.0, synchronization=ON_READ, aggregation=tf.VariableAggregation.SUM, trainable=False)
  def step_fn():
    v.assign_add(1.0 + repl.replica_id)

  repl.run(step_fn)
  path = tf.train.Checkpoint(v=v).write(str(tmp_path / "c"))
  plain = tf.Variable(0.0)
  tf.train.Checkpoint(v=plain).read(path).assert_consumed()
  assert float(plain.numpy()) == 10.0
  repl2 = replicator.Replicator(cpus(2))
  with repl2.context():
    w = tf.Variable(0.0, synchronization=ON_READ, aggregation=tf.VariableAggregation.SUM, trainable=False)
  tf.train.Checkpoint(v=w).read(path).assert_consumed()
  assert float(w.numpy()) == 10.0


@pytest.mark.parametrize("n", [2, 4])
def test_keras_metrics_report_the_global_value(n):
  rng = np.random.RandomState(0)
  logits = rng.randn(4 * n * 3, 5).astype(np.float32)
  labels = rng.randint(0, 5, size=4 * n * 3).astype(np.int32)
  values = rng.rand(4 * n * 3).astype(np.float32)

  ref_mean, ref_acc = keras.metrics.Mean(), keras.metrics.SparseCategoricalAccuracy()
  for chunk in np.split(np.arange(len(labels)), 3):
    ref_mean.update_state(values[chunk])
    ref_acc.update_state(labels[chunk], logits[chunk])

  repl = replicator.Replicator(cpus(n))
  with repl.context():
    mean, acc = keras.metrics.Mean(), keras.metrics.SparseCategoricalAccuracy()

  def step_fn(batch):
    v, y, z = batch
    mean.update_state(v)
    acc.update_state(y, z)
    return tf.constant(0)

  for chunk in np.split(np.arange(len(labels)), 3):  # 3 steps; each replica gets a slice
    parts = np.array_split(chunk, n)
    repl.run(step_fn, inputs=replicator.PerReplica([(values[p], labels[p], logits[p]) for p in parts]))
  np.testing.assert_allclose(float(mean.result()), float(ref_mean.result()), rtol=1e-6)
  np.testing.assert_allclose(float(acc.result()), float(ref_acc.result()), rtol=1e-6)
  mean.reset_state()
  acc.reset_state()
  assert float(mean.result()) == 0.0 and float(acc.result()) == 0.0
