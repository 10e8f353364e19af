"""Keras's random draws in a pipeline's stages: one call's numbers, not one a microbatch.

A stage of ``repl.pipeline`` runs once a microbatch. Keras's ``Dropout`` (and
``keras.random.dropout``) on TensorFlow draws a stateless mask of its input's
shape from a seed its ``SeedGenerator`` hands out, advancing the generator's
state each call: a stage run on ``m`` microbatches would draw ``m`` masks of a
microbatch's rows from ``m`` seeds, where the same step without a pipeline
draws one mask of the replica's batch from one seed. While a pipeline runs
(:func:`one_call_draws`), the first microbatch a replica runs through a
layer draws its seed as Keras does (the state advances once a step), the
later ones reuse it, and each draws the mask of the whole batch's shape and
keeps its own rows (``ReplicaContext.microbatch``): the numbers the
unpipelined step draws for those rows, ``m`` times the random numbers made.
A mask broadcast over the batch (a ``noise_shape`` whose first dimension is
1) is drawn as it is; an integer seed draws the same numbers every call, as
on one device.

Private Keras API, in this module only (Keras 3.15.1; tests/test_keras_dropout.py
fails if it changes): ``keras.src.backend.tensorflow.random.dropout`` (which
``keras.random.dropout`` and ``Dropout`` call) is replaced while a pipeline
is traced, with its helpers ``draw_seed``, ``_cast_seed`` and
``_get_concrete_noise_shape``.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect

import tensorflow as tf

_MODULE = "keras.src.backend.tensorflow.random"
PARAMETERS = ("inputs", "rate", "noise_shape", "seed")  # dropout's (Keras 3.15.1)
HELPERS = ("draw_seed", "_cast_seed", "_get_concrete_noise_shape")


def _backend():
  """Keras's TensorFlow random module, if its ``dropout`` and helpers are as this module expects; else None."""
  try:
    module = importlib.import_module(_MODULE)
  except ImportError:
    return None
  dropout = getattr(module, "dropout", None)
  if dropout is None or tuple(inspect.signature(dropout).parameters) != PARAMETERS:
    return None
  if not all(callable(getattr(module, name, None)) for name in HELPERS):
    return None
  return module


@contextlib.contextmanager
def one_call_draws(ctx):
  """While entered (``repl.pipeline`` on the replica of ``ctx``), Keras's dropout draws as one call on the batch."""
  module = _backend()
  if module is None or ctx is None:
    yield
    return
  original = module.dropout
  seeds = {}  # what drew them (a seed generator's id) -> the seed its first microbatch drew

  def dropout(inputs, rate, noise_shape=None, seed=None):
    rows = ctx.microbatch
    if rows is None or rate in (0.0, 1.0) or isinstance(seed, int):
      return original(inputs, rate, noise_shape=noise_shape, seed=seed)
    key = id(seed) if seed is not None else None  # (None: Keras's global generator)
    drawn = seeds.get(key)
    if drawn is None:
      drawn = seeds[key] = module._cast_seed(module.draw_seed(seed))  # pylint: disable=protected-access
    inputs = tf.convert_to_tensor(inputs)
    shape = module._get_concrete_noise_shape(inputs, noise_shape)  # pylint: disable=protected-access
    start, stop, total = rows
    if isinstance(shape, (list, tuple)):
      if isinstance(shape[0], int) and shape[0] == 1:  # (broadcast over the rows: the same for every microbatch)
        return tf.nn.experimental.stateless_dropout(inputs, rate=rate, noise_shape=shape, seed=drawn)
      shape = tf.stack([tf.cast(d, tf.int32) for d in shape])
    whole = tf.concat([tf.reshape(tf.cast(total, tf.int32), [1]), tf.cast(shape, tf.int32)[1:]], 0)
    kept = tf.nn.experimental.stateless_dropout(tf.ones(whole, inputs.dtype), rate=rate, seed=drawn)[start:stop]
    return inputs * kept

  module.dropout = dropout
  try:
    yield
  finally:
    module.dropout = original
