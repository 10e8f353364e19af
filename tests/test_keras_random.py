"""Keras's random draws in a pipeline's stages (integrations/_keras_random.py): the unpipelined step's numbers."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_held_gradients
from conftest import cpus
from test_pipeline import IN
from test_pipeline import _data

import mesh
import replicator
from replicator.integrations import _keras_random


def _dropout_stages(p, seed=5, noise=lambda k: keras.layers.Dropout(0.5, seed=20 + k)):
  """``p`` Sequential stages: Dense(8, tanh) and ``noise(k)`` (Dropout(0.5)) each but the last, Dense(1) last;
  built."""
  keras.utils.set_random_seed(seed)
  stages, d = [], IN
  for k in range(p):
    layers = [keras.layers.Dense(1)] if k == p - 1 else [keras.layers.Dense(8, activation="tanh"), noise(k)]
    stage = keras.Sequential(layers)
    stage.build((None, d))
    stages.append(stage)
    d = 8
  return stages


def _dropout_steps(stages, x, y, steps):
  """One device: the stages on the whole batch in training, ``steps`` times (each step draws anew)."""
  out = []
  for _ in range(steps):
    with tf.GradientTape() as tape:
      h = tf.constant(x)
      for stage in stages:
        h = stage(h, training=True)
      loss = tf.reduce_mean(keras.losses.mean_squared_error(y, h))
    out.append((float(loss), [g.numpy() for g in tape.gradient(loss, replicator.pipeline_variables(stages))]))
  return out


@pytest.mark.parametrize("schedule,p,m", [("1f1b", 2, 4), ("gpipe", 4, 3)])
def test_dropout_in_the_stages_draws_what_the_unpipelined_step_draws(schedule, p, m):
  # Keras's Dropout in each stage, in training: each microbatch keeps its rows of the mask one call on the whole batch
  # draws, from the seed that call draws (the generator's state advanced once a step, not once a microbatch), so two
  # steps equal one device's two steps. Measured: loss and gradients 7.2e-7 (1f1b, p = 2) and 2.0e-7 from one device
  # at most (the microbatches' sums in another order, the dropout's 1 / (1 - rate) doubling the values), so 2e-6;
  # drawing a mask a microbatch from each device's own stream (as before) is 1.4 and 2.0 off.
  x, y = _data(12)
  expected = _dropout_steps(_dropout_stages(p), x, y, 2)
  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": p}, devices=cpus(p)))
  with repl.context():
    stages = _dropout_stages(p)
  variables = replicator.pipeline_variables(stages)
  training = [lambda h, s=s: s(h, training=True) for s in stages]

  def step():
    return repl.pipeline(training, tf.constant(x), tf.constant(y), keras.losses.mean_squared_error,
                         microbatches=m, schedule=schedule, variables=variables)

  for expected_loss, expected_grads in expected:
    loss, grads = repl.run(step)
    np.testing.assert_allclose([float(value) for value in loss], [expected_loss] * p, atol=2e-6)
    assert_held_gradients(grads, variables, expected_grads, atol=2e-6)
  assert abs(expected[0][0] - expected[1][0]) > 1e-3  # (the steps drew different masks)
  assert _keras_random._backend() is not None  # (Keras's private dropout as the hook expects it: Keras 3.15)


NOISES = {  # Keras's other random layers: a draw of the input's shape (normal, uniform), and one broadcast over rows
    "GaussianNoise": lambda k: keras.layers.GaussianNoise(0.5, seed=30 + k),
    "GaussianDropout": lambda k: keras.layers.GaussianDropout(0.4, seed=40 + k),
    "AlphaDropout": lambda k: keras.layers.AlphaDropout(0.3, seed=50 + k),
    "Dropout over the rows": lambda k: keras.layers.Dropout(0.5, noise_shape=(1, 8), seed=60 + k),
}


@pytest.mark.parametrize("noise", sorted(NOISES))
def test_other_random_layers_in_the_stages_draw_what_the_unpipelined_step_draws(noise):
  # GaussianNoise and GaussianDropout draw keras.random.normal of their input's shape, AlphaDropout uniform; a
  # Dropout whose noise_shape is one row draws one mask for every row. Each microbatch keeps its rows of the whole
  # batch's draw (or the one broadcast draw), from the seed one call draws: two steps, 3 microbatches over 2 stages,
  # equal one device's. Measured: loss and gradients 4.8e-7 from one device at most (2.4e-7 but for the broadcast
  # Dropout), so 2e-6 as above; without the hook (each microbatch's numbers from its own seed, as before for all
  # but Dropout) 1.4 to 2.1 off.
  x, y = _data(12)
  expected = _dropout_steps(_dropout_stages(2, noise=NOISES[noise]), x, y, 2)
  repl = replicator.Replicator(mesh=mesh.Mesh({"stage": 2}, devices=cpus(2)))
  with repl.context():
    stages = _dropout_stages(2, noise=NOISES[noise])
  variables = replicator.pipeline_variables(stages)
  training = [lambda h, s=s: s(h, training=True) for s in stages]

  def step():
    return repl.pipeline(training, tf.constant(x), tf.constant(y), keras.losses.mean_squared_error,
                         microbatches=3, schedule="1f1b", variables=variables)

  for expected_loss, expected_grads in expected:
    loss, grads = repl.run(step)
    np.testing.assert_allclose([float(value) for value in loss], [expected_loss] * 2, atol=2e-6)
    assert_held_gradients(grads, variables, expected_grads, atol=2e-6)
  assert abs(expected[0][0] - expected[1][0]) > 1e-4  # (the steps drew different numbers)
