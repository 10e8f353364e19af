"""The training step the multi-worker scenarios and their one-device references share.

Importable by a multi-client worker script before its runtime starts: it sets
nothing up (unlike ``multiworker_scenarios``, which makes logical CPUs).
"""

import tensorflow as tf


def mse_step(model, optimizer):
  """``step((x, y))``: mean squared error of ``model``, one update with ``optimizer``; returns the loss."""

  def step(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean((model(x) - y) ** 2)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss

  return step
