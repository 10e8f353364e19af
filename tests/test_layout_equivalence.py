"""Layouts do not change results: data-, model- and 2-D-parallel training equals one device.

The same MLP, data and step (written in the local view, with the model
all-reduce over "model") are trained under LayoutRules that split the
batch over "batch" and the hidden layer over "model", on meshes where either
axis may have size 1. Final parameters must match single-device training.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus

import mesh
import replicator

D_IN, HIDDEN, D_OUT, BATCH, STEPS = 8, 16, 4, 16, 3
RULES = mesh.LayoutRules([("batch", "batch"), ("hidden", "model")])
DIMENSIONS = {"w1": ("inputs", "hidden"), "b1": ("hidden",), "w2": ("hidden", "outputs")}
NAMES = ("w1", "b1", "w2", "b2")


def _data():
  rng = np.random.RandomState(0)
  return (rng.randn(STEPS * BATCH, D_IN).astype(np.float32), rng.randn(STEPS * BATCH, D_OUT).astype(np.float32))


def _variables():
  return dict(w1=tf.Variable(keras.initializers.GlorotUniform(1)([D_IN, HIDDEN]), name="w1"),
              b1=tf.Variable(keras.initializers.RandomNormal(seed=2)([HIDDEN]), name="b1"),
              w2=tf.Variable(keras.initializers.GlorotUniform(3)([HIDDEN, D_OUT]), name="w2"),
              b2=tf.Variable(tf.zeros([D_OUT]), name="b2"))


def _make_step(v, optimizer, model_sum):
  def step(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      h = tf.nn.relu(x @ v["w1"] + v["b1"])  # this device's slice of the hidden layer
      out = model_sum(h @ v["w2"]) + v["b2"]  # partial products summed over "model"
      loss = tf.reduce_mean((out - y) ** 2)
    params = [v[n] for n in NAMES]
    optimizer.apply_gradients(zip(tape.gradient(loss, params), params))
    return loss
  return step


def _single_device():
  x, y = _data()
  v = _variables()
  step = tf.function(_make_step(v, keras.optimizers.Adam(0.01), lambda t: t))
  for batch in tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH):
    step(batch)
  return {n: v[n].numpy() for n in NAMES}


@pytest.fixture(scope="module", name="reference")
def _reference():
  keras.backend.clear_session()
  return _single_device()


def _replicated(shape, implementation):
  x, y = _data()
  repl = replicator.Replicator(mesh=mesh.Mesh(shape, devices=cpus(shape["batch"] * shape["model"])),
                               implementation=implementation, batch_axes=RULES.mesh_axes("batch"))
  with repl.context(layouts=RULES.layout_map(DIMENSIONS)):
    v = _variables()
    optimizer = repl.wrap_optimizer(keras.optimizers.Adam(0.01))
  step = _make_step(v, optimizer, lambda t: repl.all_reduce(t, axis="model"))
  repl.run(step, tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH), steps=STEPS)
  assert repl.steps_run == STEPS
  return repl, v, optimizer


LAYOUTS = {  # name: mesh shape
    "data_parallel_4": {"batch": 4, "model": 1},
    "model_parallel_4": {"batch": 1, "model": 4},
    "2d_2x2": {"batch": 2, "model": 2},
    "data_parallel_8": {"batch": 8, "model": 1},
    "model_parallel_8": {"batch": 1, "model": 8},
    "2d_2x4": {"batch": 2, "model": 4},
    "2d_4x2": {"batch": 4, "model": 2},
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_layouts_match_single_device(name, reference):
  repl, v, optimizer = _replicated(LAYOUTS[name], "auto")
  for n in NAMES:
    np.testing.assert_allclose(v[n].numpy(), reference[n], atol=1e-5, rtol=0, err_msg=f"{name}: {n}")
  # Adam's slots follow their variables' layouts, and the hidden layer is really split.
  pieces = LAYOUTS[name]["model"]
  assert v["w1"].components[0].shape.as_list() == [D_IN, HIDDEN // pieces]
  slots = [s for s in optimizer.optimizer.variables if "w1" in s.path]
  assert slots and all(s.value.components[0].shape.as_list() == [D_IN, HIDDEN // pieces] for s in slots)


def test_2d_layout_with_collective_ops(reference):
  _, v, _ = _replicated({"batch": 2, "model": 2}, "collective_ops")
  for n in NAMES:
    np.testing.assert_allclose(v[n].numpy(), reference[n], atol=1e-5, rtol=0, err_msg=n)


def _keras_mlp():
  keras.utils.set_random_seed(5)
  dense_1 = keras.layers.Dense(HIDDEN, activation="relu", name="dense_1")
  dense_1.build((None, D_IN))
  dense_2 = keras.layers.Dense(D_OUT, use_bias=False, name="dense_2")
  dense_2.build((None, HIDDEN))
  # dense_2 gets this device's slice of the hidden layer; its input_spec would
  # insist on the global width.
  dense_2.input_spec = None
  bias = tf.Variable(tf.zeros([D_OUT]), name="output_bias")
  return dense_1, dense_2, bias


def _keras_train(repl):
  x, y = _data()
  layouts = {r"dense_1/kernel": (None, "model"), r"dense_1/bias": ("model",), r"dense_2/kernel": ("model", None)}
  if repl is None:
    dense_1, dense_2, bias = _keras_mlp()
    optimizer, model_sum = keras.optimizers.Adam(0.01), lambda t: t
  else:
    with repl.context(layouts=layouts):
      dense_1, dense_2, bias = _keras_mlp()
      optimizer = repl.wrap_optimizer(keras.optimizers.Adam(0.01))
    model_sum = lambda t: repl.all_reduce(t, axis="model")  # noqa: E731
  params = dense_1.trainable_variables + dense_2.trainable_variables + [bias]

  def step(batch):
    inputs, targets = batch
    with tf.GradientTape() as tape:
      out = model_sum(dense_2(dense_1(inputs))) + bias
      loss = tf.reduce_mean((out - targets) ** 2)
    optimizer.apply_gradients(zip(tape.gradient(loss, params), params))
    return loss

  ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
  if repl is None:
    fn = tf.function(step)
    for batch in ds:
      fn(batch)
  else:
    repl.run(step, ds, steps=STEPS)
  return [np.asarray(p.numpy()) for p in params], dense_1


def test_keras_dense_megatron_mlp_matches_single_device():
  expected, _ = _keras_train(None)
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4)))
  got, dense_1 = _keras_train(repl)
  assert dense_1.kernel.value.sharding.spec == (None, "model")
  for a, b in zip(got, expected):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
