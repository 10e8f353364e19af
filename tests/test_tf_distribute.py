"""tf.distribute's replica context inside a step: Keras, Sonnet and user code that use it equal one device."""

import keras
import numpy as np
import pytest
import sonnet as snt
import tensorflow as tf
from conftest import cpus
from conftest import replica_values
from conftest import summary_events

import mesh
import replicator

X = (np.random.RandomState(0).randn(16, 6) * 3 + 1).astype(np.float32)
Y = np.random.RandomState(1).randn(16, 2).astype(np.float32)


def test_the_replica_contexts_methods_are_not_converted_by_autograph():
  # A step's tf.distribute.get_replica_context().all_reduce(...) took 1.8-4.3 s to build against 0.08 s for
  # repl.all_reduce: AutoGraph converted the context's methods and everything they call, in every build.
  from replicator.core import _tf_distribute  # pylint: disable=import-outside-toplevel
  for name in ("all_reduce", "all_gather", "merge_call"):
    assert hasattr(getattr(_tf_distribute.ReplicaContext, name), "autograph_info__"), name  # do_not_convert's mark


def test_the_context_reports_the_replicas_and_reduces_over_them():
  n = 4
  repl = replicator.Replicator(cpus(n))

  def step_fn(x):
    ctx = tf.distribute.get_replica_context()
    return (tf.constant(ctx.num_replicas_in_sync), ctx.replica_id_in_sync_group,
            ctx.all_reduce(tf.distribute.ReduceOp.SUM, x), ctx.all_reduce("MEAN", x),
            ctx.all_gather(x, axis=0), tf.constant(tf.distribute.has_strategy()),
            tf.constant(tf.distribute.get_strategy().num_replicas_in_sync))

  xs = [np.full([1, 2], r + 1.0, np.float32) for r in range(n)]
  num, ids, total, mean, gathered, has_strategy, strategy_replicas = repl.run(
      step_fn, inputs=replicator.PerReplica(xs))
  for r in range(n):
    assert int(num[r]) == n and int(ids[r]) == r
    np.testing.assert_allclose(total[r].numpy(), np.sum(xs, axis=0))
    np.testing.assert_allclose(mean[r].numpy(), np.mean(xs, axis=0))
    np.testing.assert_allclose(gathered[r].numpy(), np.concatenate(xs))
    # No strategy: Keras losses and tf.nn.compute_average_loss scale as on one device.
    assert not bool(has_strategy[r]) and int(strategy_replicas[r]) == 1
  assert tf.distribute.get_replica_context().num_replicas_in_sync == 1  # restored after the trace


def test_replicas_are_the_positions_along_the_batch_axes():
  m = mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4))
  repl = replicator.Replicator(mesh=m)

  def step_fn():
    ctx = tf.distribute.get_replica_context()
    value = tf.cast(repl.axis_index("batch") * 10 + repl.axis_index("model"), tf.float32)
    return tf.constant(ctx.num_replicas_in_sync), ctx.replica_id_in_sync_group, ctx.all_reduce("sum", value)

  num, ids, total = repl.run(step_fn)
  assert [int(v) for v in num] == [2] * 4
  assert [int(v) for v in ids] == [0, 0, 1, 1]
  assert [float(v) for v in total] == [10.0, 12.0, 10.0, 12.0]  # summed over "batch" only


def _bn_model(synchronized):
  keras.utils.set_random_seed(4)
  return keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, use_bias=False),  # no bias: BN cancels it
                           keras.layers.BatchNormalization(momentum=0.8, synchronized=synchronized),
                           keras.layers.Dense(2)])


def _train_keras(net, opt, x, y):
  with tf.GradientTape() as tape:
    loss = tf.reduce_mean(tf.square(net(x, training=True) - y))
  grads = tape.gradient(loss, net.trainable_variables)
  opt.apply_gradients(zip(grads, net.trainable_variables))
  return loss


@pytest.mark.parametrize("n", [2, 4, pytest.param(8, marks=pytest.mark.full_grid)])  # CI time: 8 by --full-grid
def test_synchronized_keras_batch_norm_equals_one_device(n):
  ref = _bn_model(synchronized=False)
  ref_opt = keras.optimizers.Adam(0.05)
  for _ in range(3):
    _train_keras(ref, ref_opt, X, Y)

  keras.backend.clear_session()
  repl = replicator.Replicator(cpus(n))
  with repl.context():
    net = _bn_model(synchronized=True)
    opt = repl.wrap_optimizer(keras.optimizers.Adam(0.05))
  inputs = replicator.PerReplica(list(zip(np.split(X, n), np.split(Y, n))))
  for _ in range(3):
    repl.run(lambda batch: _train_keras(net, opt, *batch), inputs=inputs)
  for v, want in zip(net.variables, ref.variables, strict=True):  # moving statistics included
    for value in replica_values(v):
      np.testing.assert_allclose(value, want.numpy(), atol=1e-5, err_msg=v.path)
  for v, want in zip(opt.variables, ref_opt.variables, strict=True):
    for value in replica_values(v):
      np.testing.assert_allclose(value, want.numpy(), atol=1e-5, err_msg=v.path)


def test_synchronized_keras_batch_norm_differs_from_per_replica_statistics():
  """The reference above is not trivially met: per-replica statistics give other outputs."""
  n = 4
  repl = replicator.Replicator(cpus(n))
  with repl.context():
    net = _bn_model(synchronized=False)
    sync = _bn_model(synchronized=True)
  inputs = replicator.PerReplica(list(np.split(X, n)))
  plain = repl.gather(repl.run(lambda x: net(x, training=True), inputs=inputs)).numpy()
  synced = repl.gather(repl.run(lambda x: sync(x, training=True), inputs=inputs)).numpy()
  assert np.max(np.abs(plain - synced)) > 0.1
  keras.backend.clear_session()
  ref = _bn_model(synchronized=False)
  np.testing.assert_allclose(synced, ref(X, training=True).numpy(), atol=1e-5)


def _snt_norm(cross_replica):
  if cross_replica:
    return snt.distribute.CrossReplicaBatchNorm(
        True, True, snt.ExponentialMovingAverage(0.9), snt.ExponentialMovingAverage(0.9))
  return snt.BatchNorm(True, True, decay_rate=0.9)


@pytest.mark.parametrize("n", [2, 4])
def test_sonnet_cross_replica_batch_norm_equals_one_device(n):
  ref = _snt_norm(cross_replica=False)
  ref_out = [ref(X, is_training=True).numpy() for _ in range(2)]

  repl = replicator.Replicator(cpus(n))
  with repl.context():
    norm = _snt_norm(cross_replica=True)
  inputs = replicator.PerReplica(list(np.split(X, n)))
  for want in ref_out:
    out = repl.gather(repl.run(lambda x: norm(x, is_training=True), inputs=inputs)).numpy()
    np.testing.assert_allclose(out, want, atol=1e-4)
  # offset, scale, then each moving average's counter, hidden state and value: same order in both.
  assert len(norm.variables) == len(ref.variables) == 8
  for v, want in zip(norm.variables, ref.variables, strict=True):
    for value in replica_values(v):
      np.testing.assert_allclose(value, want.numpy(), atol=1e-4, err_msg=v.name)


def test_merge_call_is_refused_at_build_time():
  repl = replicator.Replicator(cpus(2))

  def step_fn():
    return tf.distribute.get_replica_context().merge_call(lambda strategy: 1.0)

  with pytest.raises(replicator.UnsupportedError, match=r"merge_call\(\) was called while a Replicator step is "
                     r"built \(at .*test_tf_distribute.py.*\).*Fix: use the replica context's all_reduce"):
    repl.run(step_fn)


def test_a_plain_keras_optimizer_is_still_refused_not_summed():
  """Keras optimizers sum gradients over the replica context; unscaled, that would be N x one device."""
  repl = replicator.Replicator(cpus(2))
  with repl.context():
    net = _bn_model(synchronized=False)
    opt = keras.optimizers.SGD(0.1)
  inputs = replicator.PerReplica(list(zip(np.split(X, 2), np.split(Y, 2))))
  with pytest.raises(replicator.ReplicaInvarianceError, match="wrap_optimizer"):
    repl.run(lambda batch: _train_keras(net, opt, *batch), inputs=inputs)


def test_summaries_record_once_per_step_under_the_one_device_name(tmp_path):
  n = 4
  repl = replicator.Replicator(cpus(n))
  writer = tf.summary.create_file_writer(str(tmp_path))
  step = tf.Variable(0, dtype=tf.int64)

  def step_fn(x):
    loss = tf.reduce_mean(x)
    tf.summary.scalar("loss", loss, step=step)  # replica 0's value
    with tf.name_scope("train"):
      tf.summary.scalar("mean_loss", repl.all_reduce(loss, "mean"), step=step)  # the reduced value
    return loss

  xs = [np.full([2], r + 1.0, np.float32) for r in range(n)]
  with writer.as_default():
    for k in range(2):
      step.assign(k)
      repl.run(step_fn, inputs=replicator.PerReplica(xs))
  writer.flush()
  assert sorted((step, tag, float(v)) for step, tag, v in summary_events(tmp_path)) == [(0, "loss", 1.0), (0, "train/mean_loss", 2.5),
                                       (1, "loss", 1.0), (1, "train/mean_loss", 2.5)]
