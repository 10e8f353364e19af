"""``replicator.split_stages`` (``replicator/integrations/_keras_stages.py``): a Keras model cut into stages.

Checked: the linear partition against hand-derived cuts; on an uneven model (wide layers first and last) the
cost-balanced stages' largest estimated cost against the mean and against cutting by layer count; measured costs
(``costs="measured"``) on a fake clock against hand-derived ones and their cut, and on the real one; costs the
caller gives; the stages in a row equal to the model; a pipeline of them equal to one device; the errors.
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


def _fake_passes(fixed, now):
  """A stand-in for ``_keras_stages._passes`` whose calls take, on the fake clock ``now``, ``fixed`` a pass plus a
  Dense layer's multiply-adds a row over 64 x 64 (the uneven model: 5 for a wide layer or the one after it, 1 for a
  narrow one, 320 / 4096 for the head)."""
  def passes(layer, x, repeats):
    cost = fixed + (0.0 if layer is None else x.shape[-1] * layer.units / 4096)

    def call():
      now[0] += repeats * cost
    return call
  return passes


def test_measured_costs_take_each_pass_fixed_cost_out(monkeypatch):
  now = [0.0]
  monkeypatch.setattr(_keras_stages, "_clock", lambda: now[0])
  monkeypatch.setattr(_keras_stages, "_passes", _fake_passes(2.0, now))
  model = _uneven()
  costs = _keras_stages.measured_layer_costs(_keras_stages.chain_of(model), (16, 64), rounds=3, warmup=1)
  np.testing.assert_allclose(costs, [5, 5] + [1] * 10 + [5, 320 / 4096])
  # Balanced on those: 5 + 5 | 6 x 1 | 4 x 1 + 5 + 0.08 (largest 10); the passes' times as they are (each layer 2
  # more) would give 7 + 7 + 3 | 6 x 3 | 4 x 3 + 7 + 2.08 (largest 21.1), a stage of many layers priced high.
  now[0] = 0.0
  sizes = [len(s.layers) for s in replicator.split_stages(model, 3, input_shape=(16, 64), costs="measured")]
  assert sizes == [2, 6, 6]
  assert _keras_stages.balanced_cuts([c + 2.0 for c in costs], 3) == [0, 3, 9]
  # The bound the docstring gives, at the defaults (20 rounds, 2 untimed, 4 passes a call): every layer once a
  # round and the empty pass 3 times, each call 4 passes.
  assert now[0] == pytest.approx((2 + 20) * 4 * ((14 + _keras_stages.EMPTY_CALLS) * 2.0 + 3 * 5 + 10 + 320 / 4096))


def test_measured_costs_run_on_this_device():
  # Real timing (too noisy to order layers this small): a cost a layer, finite and at least 0, and a cut.
  model = _uneven()
  costs = _keras_stages.measured_layer_costs(_keras_stages.chain_of(model), (16, 64), rounds=3, warmup=1)
  assert len(costs) == 14 and all(np.isfinite(c) and c >= 0 for c in costs), costs
  keras.utils.set_random_seed(0)
  embedded = keras.Sequential([keras.Input((3,)), keras.layers.Embedding(10, 8), keras.layers.Flatten(),
                               keras.layers.Dense(4)])
  costs = _keras_stages.measured_layer_costs(embedded.layers, (4, 3), dtype=tf.int32, rounds=2, warmup=1)
  assert len(costs) == 3 and min(costs) >= 0  # (integer inputs: no gradient of them)
  assert [len(s.layers) for s in replicator.split_stages(embedded, 3, input_shape=(4, 3), costs="measured")] == [
      1, 1, 1]


def test_given_costs_are_cut_as_they_are():
  # 6 + 1 + 1 | 8 x 1 | 1 + 1 + 6, each 8 (any other cut has a stage over 8): the given costs decide, not the
  # layers' widths (no input_shape needed).
  stages = replicator.split_stages(_uneven(), 3, costs=[6] + [1] * 12 + [6])
  assert [len(s.layers) for s in stages] == [3, 8, 3]


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
  with pytest.raises(replicator.ArgumentError, match=r"pass input_shape="):
    replicator.split_stages(_uneven(), 2, costs="measured")
  with pytest.raises(replicator.ArgumentError, match=r"costs='fast'\): expected 'estimated' \(the cost model\), "
                     r"'measured' \(each layer timed here\) or a list of seconds, one a layer. Fix: costs='measured'"):
    replicator.split_stages(_uneven(), 2, input_shape=(4, 64), costs="fast")
  with pytest.raises(replicator.ArgumentError, match=r"expected 14 costs, one a layer of '.*'; found 2. Fix: "
                     r"costs=\[seconds a layer\] in the order of its layers \['wide_in', 'narrow_in', 'mid_0'"):
    replicator.split_stages(_uneven(), 2, costs=[1.0, 2.0])
  with pytest.raises(replicator.ArgumentError, match=r"expected finite seconds at least 0, not all 0; found "
                     r"\[\('mid_0', -1.0\), \('head', nan\)\]. Fix:"):
    replicator.split_stages(_uneven(), 2, costs=[1.0] * 2 + [-1.0] + [1.0] * 10 + [float("nan")])
  with pytest.raises(replicator.ArgumentError, match=r"not all 0; found all 0. Fix:"):
    replicator.split_stages(_uneven(), 2, costs=[0] * 14)
  with pytest.raises(replicator.ArgumentError, match=r"list of 14 numbers \(seconds, one a layer of '.*'\); found "
                     r"list. Fix:"):
    replicator.split_stages(_uneven(), 2, costs=["a"] * 14)
  with pytest.raises(replicator.ArgumentError, match=r"costs balance stages=; split_points= says where the cuts go. "
                     r"Fix: one of the two."):
    replicator.split_stages(_uneven(), split_points=["mid_0"], costs="measured")
  with pytest.raises(replicator.ArgumentError, match=r"measured costs are timed. Fix: drop machine="):
    replicator.split_stages(_uneven(), 2, input_shape=(4, 64), costs="measured", machine=_keras_stages.NOMINAL)
  inputs = keras.Input((8,))
  h = keras.layers.Dense(8, name="a")(inputs)
  residual = keras.Model(inputs, keras.layers.Add(name="add")([h, keras.layers.Dense(8, name="b")(h)]))
  with pytest.raises(replicator.ArgumentError, match=r"is not a chain of layers \(layer 'add' takes"):
    replicator.split_stages(residual, split_points=["b"])
