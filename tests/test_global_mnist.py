"""The global view on the MNIST model of examples/mnist.py (Mesh TensorFlow's README network).

The same model and step, 3 Adam steps, on meshes 1x4, 2x2, 4x1 and 2x4 under
layout rules over named dimensions (batch only; hidden units over "model";
image rows over "model", whose contraction leaves partial sums): every
variable and Adam slot within 1e-5 of one device, losses equal step by step.
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_every_copy
from conftest import cpus
from conftest import mesh_sweep

import mesh
import replicator
from examples import mnist

RULES = {"batch": [("batch", "batch")], "hidden": [("batch", "batch"), ("hidden", "model")],
         "rows": [("batch", "batch"), ("rows", "model")]}
REPRESENTATIVE = {((2, 2), "hidden"), ((1, 4), "rows"), ((4, 1), "batch"), ((2, 4), "hidden")}
BATCH, STEPS = 16, 3


def train(repl):
  with repl.context() if repl else contextlib.nullcontext():
    model = mnist.build_model(tf, 8, 8, hidden=32)
    opt = keras.optimizers.Adam(1e-2)
    opt.build(model.trainable_variables)

  def step_fn(batch):  # the single-device step
    x, y = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss

  rng = np.random.default_rng(0)
  x = rng.normal(size=(BATCH * STEPS, 8, 8)).astype("float32")
  y = rng.integers(0, 10, size=BATCH * STEPS).astype("int32")
  data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)
  if repl is None:
    step = tf.function(step_fn)
    return model, opt, [float(step(b)) for b in data]
  return model, opt, [float(repl.run(step_fn, data)) for _ in range(STEPS)]


@pytest.fixture(scope="module")
def one_device():
  return train(None)


@pytest.mark.parametrize("shape,rules", list(mesh_sweep(RULES, REPRESENTATIVE)))
def test_mnist_model_equals_one_device(shape, rules, one_device):
  m = mesh.Mesh({"batch": shape[0], "model": shape[1]}, devices=cpus(shape[0] * shape[1]))
  layout_rules = mesh.LayoutRules(RULES[rules])
  repl = replicator.Replicator(mesh=m, layouts=layout_rules.layout_map(mnist.DIMENSIONS),
                               batch_axes=layout_rules.mesh_axes("batch"), view="global")
  model, opt, losses = train(repl)
  one_model, one_opt, one_losses = one_device
  np.testing.assert_allclose(losses, one_losses, rtol=0, atol=1e-5)
  mine = list(model.trainable_variables) + opt.variables
  theirs = list(one_model.trainable_variables) + one_opt.variables
  assert len(mine) == len(theirs) == 4 + 2 + 8
  assert_every_copy(mine, theirs)
  k = shape[1] if rules != "batch" else 1
  w1 = model.w1
  assert replicator.bytes_per_device([w1]) == {d: 8 * 8 * 32 * 4 // k for d in repl.devices}
