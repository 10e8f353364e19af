"""Random ops in step_fn: different on each replica, reproducible for a fixed seed."""

import keras
import numpy as np
import tensorflow as tf
from conftest import cpus

import replicator


def dropout_masks(seed, n=4, steps=2):
  keras.utils.set_random_seed(seed)
  repl = replicator.Replicator(cpus(n))
  with repl.context():
    layer = keras.layers.Dropout(0.5)
    dense = keras.layers.Dense(3)
    dense.build((None, 64))

  def step_fn():
    return layer(tf.ones([1, 64]), training=True)

  masks = [np.stack([m.numpy() for m in repl.run(step_fn)]) for _ in range(steps)]
  kernels = [c.numpy() for c in dense.kernel.value.components]
  return np.stack(masks), kernels


def test_dropout_differs_per_replica_and_repeats_with_the_seed():
  masks, kernels = dropout_masks(seed=7)
  n = masks.shape[1]
  for step in range(masks.shape[0]):
    for a in range(n):
      for b in range(a + 1, n):
        assert not np.array_equal(masks[step, a], masks[step, b]), f"replicas {a} and {b} share a mask"
  assert not np.array_equal(masks[0], masks[1])  # a new draw each step
  again, _ = dropout_masks(seed=7)
  np.testing.assert_array_equal(masks, again)  # same seed, same masks
  other, _ = dropout_masks(seed=8)
  assert not np.array_equal(masks, other)
  for k in kernels[1:]:  # initializers stay identical on every replica
    np.testing.assert_array_equal(k, kernels[0])


def test_seed_state_checkpoint_keeps_replica_streams(tmp_path):
  keras.utils.set_random_seed(3)
  repl = replicator.Replicator(cpus(2))
  with repl.context():
    layer = keras.layers.Dropout(0.5)
  state = layer.seed_generator.state.value
  base = state.components[0].numpy()
  np.testing.assert_array_equal(state.components[1].numpy() - base, [1_000_003, 0])
  path = tf.train.Checkpoint(state=state).write(str(tmp_path / "c"))
  state.assign([0, 0])
  tf.train.Checkpoint(state=state).read(path).assert_consumed()
  np.testing.assert_array_equal(state.components[0].numpy(), base)
  np.testing.assert_array_equal(state.components[1].numpy() - base, [1_000_003, 0])
