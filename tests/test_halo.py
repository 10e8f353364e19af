"""repl.halo_exchange: tiles of a split dimension extended by their neighbours' rows, against one device."""

import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus

import mesh
import replicator


def test_rows_from_each_neighbour_and_zeros_at_the_ends():
  repl = replicator.Replicator(mesh=mesh.Mesh({"rows": 4}, devices=cpus(4)))
  whole = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)

  def step(width, periodic):
    def fn():
      tile = tf.constant(whole)[2 * repl.replica_id:2 * repl.replica_id + 2]
      return repl.halo_exchange(tile, axis="rows", dim=0, width=width, periodic=periodic)
    return [t.numpy() for t in repl.run(fn)]

  padded = np.concatenate([np.zeros((1, 3)), whole, np.zeros((1, 3))])
  for r, tile in enumerate(step(1, False)):
    np.testing.assert_array_equal(tile, padded[2 * r:2 * r + 4])
  wrapped = np.concatenate([whole[-1:], whole, whole[:2]])
  for r, tile in enumerate(step((1, 2), True)):
    np.testing.assert_array_equal(tile, wrapped[2 * r:2 * r + 5])


def test_a_same_convolution_over_2x2_tiles_equals_one_device_with_its_gradients():
  repl = replicator.Replicator(mesh=mesh.Mesh({"rows": 2, "cols": 2}, devices=cpus(4)))
  rng = np.random.default_rng(0)
  image = rng.normal(size=(2, 8, 8, 3)).astype(np.float32)
  kernel = rng.normal(size=(3, 3, 3, 4)).astype(np.float32)
  weights = rng.normal(size=(2, 8, 8, 4)).astype(np.float32)  # the loss: sum(conv * weights)

  def whole():
    x, k = tf.constant(image), tf.constant(kernel)
    with tf.GradientTape() as tape:
      tape.watch([x, k])
      y = tf.nn.conv2d(x, k, 1, "SAME")
      loss = tf.reduce_sum(y * weights)
    return (y, *tape.gradient(loss, [x, k]))

  expected = [t.numpy() for t in whole()]

  def tiled():
    r, c = (int(tf.get_static_value(repl.axis_index(a))) for a in ("rows", "cols"))  # (constants of the trace)
    rows, cols = slice(4 * r, 4 * r + 4), slice(4 * c, 4 * c + 4)
    x, k = tf.constant(image[:, rows, cols]), tf.constant(kernel)
    with tf.GradientTape() as tape:
      tape.watch([x, k])
      haloed = repl.halo_exchange(repl.halo_exchange(x, axis="rows", dim=1, width=1), axis="cols", dim=2, width=1)
      y = tf.nn.conv2d(haloed, k, 1, "VALID")
      loss = tf.reduce_sum(y * weights[:, rows, cols])
    dx, dk = tape.gradient(loss, [x, k])
    return y, dx, repl.all_sum(dk)

  for device, (y, dx, dk) in enumerate(zip(*[list(t) for t in repl.run(tiled)])):
    r, c = divmod(device, 2)
    rows, cols = slice(4 * r, 4 * r + 4), slice(4 * c, 4 * c + 4)
    np.testing.assert_allclose(y.numpy(), expected[0][:, rows, cols], atol=1e-5)
    np.testing.assert_allclose(dx.numpy(), expected[1][:, rows, cols], atol=1e-5)  # halos' gradients sent back
    np.testing.assert_allclose(dk.numpy(), expected[2], atol=1e-4)


def test_a_width_larger_than_a_tile_is_named():
  repl = replicator.Replicator(mesh=mesh.Mesh({"rows": 2}, devices=cpus(2)))
  with pytest.raises(replicator.ArgumentError, match=r"each side takes at most the 2 rows of a tile"):
    repl.run(lambda: repl.halo_exchange(tf.zeros([2, 3]), axis="rows", dim=0, width=3))
  with pytest.raises(replicator.ArgumentTypeError, match=r"expected an int or a pair \(before, after\)"):
    repl.run(lambda: repl.halo_exchange(tf.zeros([2, 3]), axis="rows", dim=0, width=1.5))
