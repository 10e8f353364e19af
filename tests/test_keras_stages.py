"""``replicator.split_stages`` (``replicator/integrations/_keras_stages.py``): a Keras model cut into stages.

Checked: the linear partition against hand-derived cuts; on an uneven model (wide layers first and last) the
cost-balanced stages' largest estimated cost against the mean and against cutting by layer count; the stages in
a row equal to the model; a pipeline of them equal to one device; the errors.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_held_gradients
from conftest import cpus

import mesh
import replicator
from replicator.integrations import _keras_stages


def test_the_cuts_make_the_largest_stage_least():
  assert _keras_stages.balanced_cuts([5, 1, 1, 1, 1, 1, 5], 3) == [0, 1, 6]  # 5 | 5 x 1 | 5
  assert _keras_stages.balanced_cuts([1] * 8, 4) == [0, 2, 4, 6]
  assert _keras_stages.balanced_cuts([1, 2, 3, 4, 5], 2) == [0, 3]  # 6 | 9, not 10 | 5
  assert _keras_stages.balanced_cuts([3, 3], 2) == [0, 1]


def _uneven():
  """Wide layers first and last (each about twice a middle layer's cost), ten narrow ones between."""
  keras.utils.set_random_seed(0)
  layers = [keras.Input((64,)), keras.layers.Dense(320, name="wide_in"), keras.layers.Dense(64, name="narrow_in")]
  layers += [keras.layers.Dense(64, activation="tanh", name=f"mid_{k}") for k in range(10)]
  layers += [keras.layers.Dense(320, name="wide_out"), keras.layers.Dense(1, name="head")]
  return keras.Sequential(layers)


def test_an_uneven_model_is_balanced_by_cost_where_layer_counts_are_not():
  model = _uneven()
  layers = _keras_stages.chain_of(model)
  costs = _keras_stages.layer_costs(layers, (16, 64))
  assert min(costs[0], costs[-2]) > 1.5 * costs[5]  # (the wide layers' estimates against a middle one's)
  stages = replicator.split_stages(model, 3, input_shape=(16, 64))
  sizes = [len(s.layers) for s in stages]
  assert sum(sizes) == len(layers) and sizes[1] > max(sizes[0], sizes[2])  # fewer layers where they are wide
  totals = _totals(costs, sizes)
  assert max(totals) <= 1.15 * np.mean(totals), totals
  by_count = _totals(costs, [5, 5, 4])  # 14 layers, as evenly as counts go
  assert max(by_count) > 1.15 * np.mean(by_count), by_count


def _totals(costs, sizes):
  edges = np.cumsum([0] + list(sizes))
  return [sum(costs[a:b]) for a, b in zip(edges, edges[1:])]


def test_the_stages_in_a_row_are_the_model_and_pipeline_as_one_device():
  # Loss and gradients of the model's weights: 1e-6 (measured 1.2e-7 for repl.pipeline's other tests).
  model = _uneven()
  stages = replicator.split_stages(model, 3, input_shape=(4, 64))
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(12, 64)).astype("float32"), rng.normal(size=(12, 1)).astype("float32")
  h = tf.constant(x)
  for stage in stages:
    h = stage(h)
  np.testing.assert_array_equal(h.numpy(), model(x).numpy())
  assert replicator.pipeline_variables(stages) == model.trainable_variables  # the model's own weights, in order
  with tf.GradientTape() as tape:
    loss = tf.reduce_mean(keras.losses.mean_squared_error(y, model(x)))
  expected = tape.gradient(loss, model.trainable_variables)

  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": 3}, devices=cpus(3)))
  with repl.context():
    copy = _uneven()
  for a, b in zip(copy.weights, model.weights):
    a.assign(b)
  split = replicator.split_stages(copy, 3, input_shape=(4, 64))
  got_loss, grads = repl.run(lambda: repl.pipeline(split, tf.constant(x), tf.constant(y),
                                                   keras.losses.mean_squared_error, microbatches=3))
  np.testing.assert_allclose(float(got_loss[0]), float(loss), atol=1e-6)
  assert_held_gradients(grads, copy.trainable_variables, [g.numpy() for g in expected], atol=1e-6)


def test_split_points_name_where_stages_begin():
  stages = replicator.split_stages(_uneven(), split_points=["mid_0", "wide_out"])
  assert [[layer.name for layer in s.layers][0] for s in stages] == ["wide_in", "mid_0", "wide_out"]


def test_what_cannot_be_cut_is_named():
  with pytest.raises(replicator.ArgumentError, match=r"no layer of .* is named \['nope'\]"):
    replicator.split_stages(_uneven(), split_points=["nope"])
  with pytest.raises(replicator.ArgumentError, match=r"pass input_shape="):
    replicator.split_stages(_uneven(), 2)
  inputs = keras.Input((8,))
  h = keras.layers.Dense(8, name="a")(inputs)
  residual = keras.Model(inputs, keras.layers.Add(name="add")([h, keras.layers.Dense(8, name="b")(h)]))
  with pytest.raises(replicator.ArgumentError, match=r"is not a chain of layers \(layer 'add' takes"):
    replicator.split_stages(residual, split_points=["b"])
