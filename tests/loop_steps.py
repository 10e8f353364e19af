"""The steps with loops and branches whose bodies communicate, shared by a multi-client scenario and its reference.

``tests/multi_client_scenarios.py`` trains them in every worker process of a job (the global view, weights split
over a model axis), ``tests/test_multi_client.py`` on one device. Importable by a worker's script before its
runtime starts: it makes nothing when imported.
"""

import keras
import numpy as np
import tensorflow as tf
from mse_step import keras_step

STEPS = 3
RNN_BATCH = 12
DECODER_BATCH = 8


def rnn(kind: str):
  """Keras's ``LSTM`` or ``GRU`` (8 units) and a dense head, named alike wherever it is made, and its Adam."""
  keras.utils.set_random_seed(1)
  name = kind.lower()
  model = keras.Sequential([keras.layers.Input((5, 3)), getattr(keras.layers, kind)(8, name=name),
                            keras.layers.Dense(4, name=f"{name}_head")], name=f"{name}_model")
  optimizer = keras.optimizers.Adam(1e-2)
  optimizer.build(model.trainable_variables)
  return model, optimizer


def rnn_data() -> tf.data.Dataset:
  rng = np.random.default_rng(0)
  x = rng.normal(size=(RNN_BATCH * STEPS, 5, 3)).astype("float32")
  y = rng.integers(0, 4, size=RNN_BATCH * STEPS).astype("int32")
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(RNN_BATCH, drop_remainder=True)




def decoder():
  """A decoding loop's weights (``w_in`` column-parallel, ``w_out`` row-parallel where split) and their Adam."""
  rng = np.random.default_rng(2)
  values = {"w_in": rng.normal(size=(6, 8)) * 0.5, "w_out": rng.normal(size=(8, 6)) * 0.5,
            "embedding": rng.normal(size=(6, 6))}
  weights = [keras.Variable(v.astype("float32"), name=name) for name, v in values.items()]
  optimizer = keras.optimizers.Adam(1e-2)
  optimizer.build(weights)
  return weights, optimizer


def decoder_data() -> tf.data.Dataset:
  x = np.random.default_rng(3).normal(size=(DECODER_BATCH * STEPS, 6)).astype("float32")
  return tf.data.Dataset.from_tensor_slices(x).batch(DECODER_BATCH, drop_remainder=True)


def decoder_step(weights, optimizer):
  """Four greedy decoding steps over the rows of ``x``, each a column-parallel layer (its softmax gathers the
  columns), a row-parallel one (partial sums), the greedy token's embedding; then a ``tf.cond`` whose branches
  reduce over the batch."""
  w_in, w_out, embedding = weights

  def step(x):
    def body(t, h, total):
      hidden = tf.nn.softmax(tf.matmul(h, w_in))
      logits = tf.matmul(hidden, w_out)
      h = tf.tanh(tf.gather(embedding, tf.argmax(logits, axis=-1)) + logits + x)
      return t + 1, h, total + h

    with tf.GradientTape() as tape:
      _, h, total = tf.while_loop(lambda t, h, total: t < 4, body,
                                  [tf.constant(0), tf.zeros_like(x), tf.zeros_like(x)])
      pooled = tf.cond(tf.reduce_max(h) > 0.0, lambda: tf.reduce_sum(total, axis=0),
                       lambda: tf.reduce_max(total, axis=0))
      loss = tf.reduce_mean(tf.square(total)) + 0.1 * tf.reduce_sum(h) + 0.01 * tf.reduce_sum(pooled)
    optimizer.apply_gradients(zip(tape.gradient(loss, weights), weights))
    return loss

  return step


# Where the model axis is on 2 workers x 2 devices ("device": each worker's devices hold the pieces of a split
# weight, the batch over the workers; "worker": the pieces in different processes, the batch over each worker's
# devices), and which steps run there: each RNN in one placement, the decoder in both.
PLACEMENTS = {"within": ("device", ("worker",), ("LSTM", "decoder")),
              "across": ("worker", ("device",), ("GRU", "decoder"))}


def layouts(model_axis: str, names) -> dict:
  """The layouts splitting the RNNs' kernels and the decoder's weights over ``model_axis`` (those of ``names``)."""
  found = {}
  for name in names:
    if name == "decoder":
      found.update({r"^w_in$": (None, model_axis), r"^w_out$": (model_axis, None)})
    else:
      found[rf"{name.lower()}/{name.lower()}_cell/(recurrent_)?kernel$"] = (None, model_axis)
  return found


def made(names) -> dict:
  """Name -> ``(step, dataset, variables)`` of each of ``names`` ("LSTM", "GRU", "decoder"), made in the current
  context (the variables: the model's, then its optimizer's)."""
  found = {}
  for name in names:
    if name == "decoder":
      weights, optimizer = decoder()
      found[name] = (decoder_step(weights, optimizer), decoder_data(), list(weights) + optimizer.variables)
    else:
      model, optimizer = rnn(name)
      found[name] = (keras_step(model, optimizer), rnn_data(), model.variables + optimizer.variables)
  return found


def numbered(variables) -> dict:
  """``"<position>/<path>"`` -> the value of each variable (a split one's pieces assembled)."""
  return {f"{k:02d}/{v.path}": np.asarray(v.numpy()) for k, v in enumerate(variables)}


def inside_rows(plan) -> list[str]:
  """``repl.explain``'s rows of the collectives inside loop bodies and branches: kind, axes, op, shape, why."""
  return [f"{r.kind}|{','.join(r.axes)}|{r.op}|{r.shape}|{r.why}" for r in plan.inside_rows]
