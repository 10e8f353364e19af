"""wrap_optimizer(accumulation_steps=k): k accumulated steps == one step on a k-times larger batch."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus
from conftest import mse_step

import replicator

SMALL = 8  # global batch per step
K = 3
X = np.random.RandomState(0).randn(2 * K * SMALL, 5).astype(np.float32)
Y = np.random.RandomState(1).randn(2 * K * SMALL, 2).astype(np.float32)


def make():
  keras.utils.set_random_seed(5)
  return keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(2)])


def reference():
  """Two Adam steps on batches of K * SMALL rows."""
  model, opt = make(), keras.optimizers.Adam(0.05)
  for big in np.split(np.arange(len(X)), 2):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(model(X[big]) - Y[big]))
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
  return [v.numpy() for v in model.trainable_variables], int(opt.iterations.numpy())


@pytest.mark.parametrize("n", [1, 2, 4])
def test_accumulation_equals_a_larger_batch(n):
  want, want_iterations = reference()
  keras.backend.clear_session()
  repl = replicator.Replicator(cpus(n))
  with repl.context():
    model = make()
    base = keras.optimizers.Adam(0.05)
    opt = repl.wrap_optimizer(base, accumulation_steps=K)

  step_fn = mse_step(model, opt)

  plans = []
  for step in range(2 * K):
    rows = np.arange(step * SMALL, (step + 1) * SMALL)
    inputs = replicator.PerReplica([(X[r], Y[r]) for r in np.split(rows, n)])
    plans.append(sum(c.kind == "all_reduce" for c in repl.explain(step_fn, inputs=inputs).collectives))
    repl.run(step_fn, inputs=inputs)
  # Only every K-th step communicates: the gradients of the 4 variables, once, fused into one bucket per
  # owner (the sharded update's owners, one variable each with 4 replicas; one replica reduces nothing).
  assert plans == [0, 0, min(n, 4) if n > 1 else 0] * 2
  assert repl.trace_count == 2  # the accumulate-only and the applying variant
  assert int(base.iterations.numpy()) == want_iterations
  for got, expected in zip(model.trainable_variables, want, strict=True):
    for component in got.value.components:
      np.testing.assert_allclose(component.numpy(), expected, atol=1e-5)


def test_accumulation_rejects_multi_step_calls():
  repl = replicator.Replicator(cpus(2))
  with repl.context():
    v = tf.Variable(1.0)
    opt = repl.wrap_optimizer(keras.optimizers.SGD(0.1), accumulation_steps=2)

  def step_fn():
    with tf.GradientTape() as tape:
      loss = v * v
    opt.apply_gradients([(tape.gradient(loss, v), v)])

  with pytest.raises(ValueError, match=r"steps=3\) with an optimizer wrapped with accumulation_steps > 1"):
    repl.run(step_fn, steps=3)
  with pytest.raises(ValueError, match="needs a positive integer"):
    repl.wrap_optimizer(keras.optimizers.SGD(0.1), accumulation_steps=0)
