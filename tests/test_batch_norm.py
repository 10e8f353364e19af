"""CrossReplicaBatchNorm on N replicas == keras BatchNormalization on one device, full batch."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus

import replicator

BATCH = 16
X = (np.random.RandomState(0).randn(3 * BATCH, 6) * 3 + 1).astype(np.float32)
Y = np.random.RandomState(1).randn(3 * BATCH, 2).astype(np.float32)


def model(norm_layer):
  keras.utils.set_random_seed(4)
  return keras.Sequential([keras.Input((6,)), keras.layers.Dense(5), norm_layer(momentum=0.8), keras.layers.Dense(2)])


def loss_fn(net, x, y):
  return tf.reduce_mean(tf.square(net(x, training=True) - y))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_training_equals_batch_norm_on_one_device(n):
  ref = model(keras.layers.BatchNormalization)
  ref_opt = keras.optimizers.SGD(0.1)
  ref_outputs, ref_grads = [], []
  for k in range(3):
    x, y = X[k * BATCH:(k + 1) * BATCH], Y[k * BATCH:(k + 1) * BATCH]
    with tf.GradientTape() as tape:
      loss = loss_fn(ref, x, y)
    grads = tape.gradient(loss, ref.trainable_variables)
    ref_grads.append([g.numpy() for g in grads])
    ref_outputs.append(ref(x, training=False).numpy())
    ref_opt.apply_gradients(zip(grads, ref.trainable_variables))

  keras.backend.clear_session()
  repl = replicator.Replicator(cpus(n))
  with repl.context():
    net = model(replicator.CrossReplicaBatchNorm)
    opt = repl.wrap_optimizer(keras.optimizers.SGD(0.1))

  def step_fn(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = loss_fn(net, x, y)
    grads = opt.reduce_gradients(tape.gradient(loss, net.trainable_variables))
    outputs = net(x, training=False)  # before the update: uses the moving statistics
    opt.optimizer.apply_gradients(zip(grads, net.trainable_variables))
    return grads, outputs

  for k in range(3):
    x, y = X[k * BATCH:(k + 1) * BATCH], Y[k * BATCH:(k + 1) * BATCH]
    grads, outputs = repl.run(step_fn, inputs=replicator.PerReplica(list(zip(np.split(x, n), np.split(y, n)))))
    for g, want in zip(grads, ref_grads[k], strict=True):
      for r in range(n):  # gradients: equal on every replica, equal to one device
        np.testing.assert_allclose(g[r].numpy(), want, atol=2e-5)
    np.testing.assert_allclose(repl.gather(outputs).numpy(), ref_outputs[k], atol=2e-5)

  ref_bn, bn = ref.layers[1], net.layers[1]
  for name in ("gamma", "beta", "moving_mean", "moving_variance"):
    want = getattr(ref_bn, name).numpy()
    for component in getattr(bn, name).value.components:
      np.testing.assert_allclose(component.numpy(), want, atol=2e-5, err_msg=name)


def test_forward_statistics_span_replicas():
  repl = replicator.Replicator(cpus(2))
  with repl.context():
    bn = replicator.CrossReplicaBatchNorm(center=False, scale=False, epsilon=0.0)
    bn.build((None, 1))
  # Replica 0 holds [0, 0], replica 1 holds [2, 2]: global mean 1, variance 1.
  out = repl.run(lambda x: bn(x, training=True), inputs=replicator.PerReplica([np.zeros([2, 1], np.float32),
                                                                               np.full([2, 1], 2.0, np.float32)]))
  np.testing.assert_allclose(out[0].numpy(), [[-1.0], [-1.0]], atol=1e-6)
  np.testing.assert_allclose(out[1].numpy(), [[1.0], [1.0]], atol=1e-6)


def test_plain_batch_norm_outside_a_replicator():
  bn = replicator.CrossReplicaBatchNorm(center=False, scale=False, epsilon=0.0)
  out = bn(tf.constant([[0.0], [2.0]]), training=True)
  np.testing.assert_allclose(out.numpy(), [[-1.0], [1.0]], atol=1e-6)
