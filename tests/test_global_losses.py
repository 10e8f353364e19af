"""Every loss in ``keras.losses`` in the global view: equal to one device, with no fallback (strict)."""

import contextlib
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_every_copy
from conftest import cpus

import mesh
import replicator

BATCH, FEATURES, CLASSES, STEPS = 8, 6, 4, 2

# loss -> (constructor, targets: "onehot" | "binary" | "sparse" | "positive" | "real", output activation)
LOSSES = {
    "BinaryCrossentropy": (lambda: keras.losses.BinaryCrossentropy(), "binary", "sigmoid"),
    "BinaryFocalCrossentropy": (lambda: keras.losses.BinaryFocalCrossentropy(), "binary", "sigmoid"),
    "CategoricalCrossentropy": (lambda: keras.losses.CategoricalCrossentropy(from_logits=True), "onehot", None),
    "CategoricalFocalCrossentropy": (lambda: keras.losses.CategoricalFocalCrossentropy(), "onehot", "softmax"),
    "CategoricalGeneralizedCrossEntropy": (lambda: keras.losses.CategoricalGeneralizedCrossEntropy(), "sparse",
                                           "softmax"),
    "CategoricalHinge": (lambda: keras.losses.CategoricalHinge(), "onehot", None),
    "Circle": (lambda: keras.losses.Circle(), "sparse", None),
    "CosineSimilarity": (lambda: keras.losses.CosineSimilarity(), "real", None),
    "Dice": (lambda: keras.losses.Dice(), "binary", "sigmoid"),
    "Hinge": (lambda: keras.losses.Hinge(), "binary", None),
    "Huber": (lambda: keras.losses.Huber(), "real", None),
    "KLDivergence": (lambda: keras.losses.KLDivergence(), "onehot", "softmax"),
    "LogCosh": (lambda: keras.losses.LogCosh(), "real", None),
    "MeanAbsoluteError": (lambda: keras.losses.MeanAbsoluteError(), "real", None),
    "MeanAbsolutePercentageError": (lambda: keras.losses.MeanAbsolutePercentageError(), "positive", None),
    "MeanSquaredError": (lambda: keras.losses.MeanSquaredError(), "real", None),
    "MeanSquaredLogarithmicError": (lambda: keras.losses.MeanSquaredLogarithmicError(), "positive", "softplus"),
    "Poisson": (lambda: keras.losses.Poisson(), "positive", "softplus"),
    "SparseCategoricalCrossentropy": (lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                                      "sparse", None),
    "SquaredHinge": (lambda: keras.losses.SquaredHinge(), "binary", None),
    "Tversky": (lambda: keras.losses.Tversky(), "binary", "sigmoid"),
}
# CTC takes label sequences and per-step logits, not a classifier's outputs: its own test below.
LAYOUTS = {
    "batch": None,
    "classes": {r"out/kernel$": (None, "model"), r"out/bias$": ("model",)},  # the loss reduces a split dimension
}


def _targets(kind, rng):
  if kind == "sparse":
    return rng.integers(0, CLASSES, size=(BATCH * STEPS,)).astype("int32")
  if kind == "onehot":
    return np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, size=BATCH * STEPS)]
  if kind == "binary":
    return rng.integers(0, 2, size=(BATCH * STEPS, CLASSES)).astype("float32")
  if kind == "positive":
    return rng.uniform(0.5, 2.0, size=(BATCH * STEPS, CLASSES)).astype("float32")
  return rng.normal(size=(BATCH * STEPS, CLASSES)).astype("float32")


def _dataset(kind):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(BATCH * STEPS, FEATURES)).astype("float32")
  return tf.data.Dataset.from_tensor_slices((x, _targets(kind, rng))).batch(BATCH, drop_remainder=True)


def _train(name, repl):
  make_loss, kind, activation = LOSSES[name]
  with repl.context() if repl else contextlib.nullcontext():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.layers.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh", name="hidden"),
                              keras.layers.Dense(CLASSES, activation=activation, name="out")])
    opt = keras.optimizers.Adam(1e-2)
    opt.build(model.trainable_variables)
  loss_fn = make_loss()

  def step_fn(batch):  # the single-device step
    x, y = batch
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  dataset = _dataset(kind)
  if repl is None:
    step = tf.function(step_fn)
    losses = [float(step(batch)) for batch in dataset]
  else:
    losses = [float(repl.run(step_fn, dataset)) for _ in range(STEPS)]
  return losses, model.variables + opt.variables


# Every loss runs strict (a fallback is an error). Hinge and SquaredHinge check whether the labels are 0/1
# (tf.reduce_all over the split labels: an all-reduce) and convert them in a tf.cond, whose branches run on
# each device's labels.
FALLING_BACK: dict = {}


# CI runs every loss with the class split (the loss reduces a split dimension) and these with the batch split
# only; --full-grid runs all.
BATCH_REPRESENTATIVE = {"BinaryCrossentropy", "CategoricalCrossentropy", "Circle", "Hinge", "MeanSquaredError",
                        "SparseCategoricalCrossentropy"}


def _cases():
  cases = []  # a list: pytest refuses iterators
  for name in sorted(LOSSES):
    for layout in sorted(LAYOUTS):
      full = layout == "batch" and name not in BATCH_REPRESENTATIVE
      cases.append(pytest.param(name, layout, marks=(pytest.mark.full_grid,) if full else (), id=f"{name}-{layout}"))
  return cases


@pytest.mark.parametrize("name,layout", _cases())
def test_loss_equals_one_device(name, layout):
  expected, reference = _train(name, None)
  m = mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4))
  strict = name not in FALLING_BACK  # elsewhere a fallback is an error
  repl = replicator.Replicator(mesh=m, layouts=mesh.LayoutMap(LAYOUTS[layout]) if LAYOUTS[layout] else None,
                               batch_axes=("batch",), view="global", strict=strict)
  with contextlib.ExitStack() as stack:
    if not strict:
      caught = stack.enter_context(pytest.warns(UserWarning, match="has no layout rule"))
    losses, ours = _train(name, repl)
  if not strict:
    assert {re.search(r"no layout rule for (\w+)", str(w.message)).group(1) for w in caught} == set(FALLING_BACK[name])
  np.testing.assert_allclose(losses, expected, rtol=1e-5, atol=1e-6)
  assert_every_copy(ours, reference, rtol=1e-5)


def _train_ctc(repl, classes=6, time=10, labels=3):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(BATCH * STEPS, time, FEATURES)).astype("float32")
  y = rng.integers(1, classes, size=(BATCH * STEPS, labels)).astype("int32")  # 0 is the blank
  with repl.context() if repl else contextlib.nullcontext():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.layers.Input((time, FEATURES)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(classes, name="out")])
    opt = keras.optimizers.Adam(1e-2)
    opt.build(model.trainable_variables)
  loss_fn = keras.losses.CTC()

  def step_fn(batch):  # the single-device step
    x, y = batch
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True))
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss

  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)
  step = tf.function(step_fn) if repl is None else lambda batch: repl.run(step_fn, dataset)
  losses = [float(step(batch)) for batch in dataset]
  return losses, model.variables + opt.variables


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_ctc_runs_its_loops_on_each_device_s_rows_and_equals_one_device(layout):
  # Keras's CTC is TensorFlow's dense CTC: two tf.while_loops over time, each step calling functions of its own.
  # Was: the loops ran on gathered inputs (a fallback, with its warning). Now each device runs them on its rows
  # (strict: nothing falls back). Measured: the losses equal, every variable within 6e-8.
  expected, reference = _train_ctc(None)
  m = mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4))
  repl = replicator.Replicator(mesh=m, layouts=mesh.LayoutMap(LAYOUTS[layout]) if LAYOUTS[layout] else None,
                               batch_axes=("batch",), view="global", strict=True)
  losses, ours = _train_ctc(repl)
  np.testing.assert_allclose(losses, expected, rtol=1e-5, atol=1e-6)
  assert_every_copy(ours, reference, rtol=1e-5)
