"""Tests for wrap_optimizer's gradient reduction: fusion into buckets."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus

import replicator


def _train(bucket_bytes, n=4):
  repl = replicator.Replicator(cpus(n))
  with repl.context():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,))] + [keras.layers.Dense(w, activation="tanh") for w in (16, 16, 3)])
    optimizer = repl.wrap_optimizer(keras.optimizers.Adam(0.05), bucket_bytes=bucket_bytes)
  x = np.random.RandomState(0).randn(4 * n, 6).astype(np.float32)

  def step(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(model(x) ** 2)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

  inputs = replicator.PerReplica(np.split(x, n))
  for _ in range(3):
    repl.run(step, inputs=inputs)
  plan = repl.explain(step, inputs=inputs)
  return [v.numpy() for v in model.trainable_variables], plan


@pytest.mark.parametrize("bucket_bytes", [1, 600, 1 << 20])
def test_fused_gradients_equal_unfused(bucket_bytes):
  expected, plain = _train(None)
  got, fused = _train(bucket_bytes)
  for a, b in zip(got, expected):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  sizes = [c.shape.num_elements() for c in fused.collectives]
  assert len(plain.collectives) == 6
  if bucket_bytes == 1 << 20:  # everything in one bucket: 6*16+16 + 16*16+16 + 16*3+3 floats
    assert sizes == [96 + 16 + 256 + 16 + 48 + 3]
  elif bucket_bytes == 600:  # 150 floats per bucket at most; larger tensors alone
    assert sizes == [112, 256, 16 + 48 + 3] and max(c.nbytes for c in fused.collectives) == 1024
  else:
    assert len(sizes) == 6


def test_bucket_bytes_is_checked():
  repl = replicator.Replicator(cpus(2))
  with pytest.raises(ValueError, match=r"wrap_optimizer\(bucket_bytes=-1\): needs None or a byte count >= 0"):
    repl.wrap_optimizer(keras.optimizers.SGD(), bucket_bytes=-1)
