"""Keras's random draws in a pipeline's stages: one call's numbers, not one a microbatch.

A stage of ``repl.pipeline`` runs once a microbatch. Keras's random layers on
TensorFlow (``Dropout``, ``GaussianNoise``, ``GaussianDropout``,
``AlphaDropout``, and ``keras.random.dropout``, ``normal``, ``uniform``,
``truncated_normal`` in a layer's ``call``) draw stateless numbers of a shape
from a seed their ``SeedGenerator`` hands out, advancing the generator's state
each call: a stage run on ``m`` microbatches would draw ``m`` tensors of a
microbatch's rows from ``m`` seeds, where the same step without a pipeline
draws one tensor of the replica's batch from one seed. While a pipeline runs
(:func:`one_call_draws`), the first microbatch a replica runs through a draw
draws its seed as Keras does
(the state advances once a step), the later microbatches reuse it, and a draw
whose first dimension is the microbatch's rows draws the whole batch's shape
and keeps its own rows (``ReplicaContext.microbatch``): the numbers the
unpipelined step draws for those rows, ``m`` times the random numbers made. A
draw of another shape (a mask broadcast over the rows, a ``noise_shape`` whose
first dimension is 1) is drawn as it is, from the same seed for every
microbatch, as the unpipelined step draws it once for every row. An integer
seed draws the same numbers every call, as on one device.

Private Keras API, in this module only (Keras 3.15.1; tests/test_keras_random.py
fails if it changes): ``keras.src.backend.tensorflow.random``'s ``dropout``,
``normal``, ``uniform`` and ``truncated_normal`` (which ``keras.random`` and
the layers call) are replaced while a pipeline is traced, with its helpers
``draw_seed``, ``_cast_seed`` and ``_get_concrete_noise_shape``.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect

import tensorflow as tf

_MODULE = "keras.src.backend.tensorflow.random"
PARAMETERS = {  # the draws replaced, and their parameters (Keras 3.15.1)
    "dropout": ("inputs", "rate", "noise_shape", "seed"),
    "normal": ("shape", "mean", "stddev", "dtype", "seed"),
    "uniform": ("shape", "minval", "maxval", "dtype", "seed"),
    "truncated_normal": ("shape", "mean", "stddev", "dtype", "seed"),
}
HELPERS = ("draw_seed", "_cast_seed", "_get_concrete_noise_shape", "floatx")
_STATELESS = {"normal": "stateless_normal", "uniform": "stateless_uniform",
              "truncated_normal": "stateless_truncated_normal"}  # tf.random's, each draw's


def _backend():
  """Keras's TensorFlow random module, if its draws and helpers are as this module expects; else None."""
  try:
    module = importlib.import_module(_MODULE)
  except ImportError:
    return None
  for name, parameters in PARAMETERS.items():
    draw = getattr(module, name, None)
    if draw is None or tuple(inspect.signature(draw).parameters) != parameters:
      return None
  if not all(callable(getattr(module, name, None)) for name in HELPERS):
    return None
  return module


@contextlib.contextmanager
def one_call_draws(ctx):
  """While entered (``repl.pipeline`` on the replica of ``ctx``), Keras's random draws are as one call on the batch."""
  module = _backend()
  if module is None or ctx is None:
    yield
    return
  originals = {name: getattr(module, name) for name in PARAMETERS}
  seeds = {}  # what drew them (a seed generator's id) -> the seed its first microbatch drew

  def seed_of(seed):
    """The seed of this draw: the first microbatch's (which advances the generator once a step)."""
    key = id(seed) if seed is not None else None  # (None: Keras's global generator)
    drawn = seeds.get(key)
    if drawn is None:
      drawn = seeds[key] = module._cast_seed(module.draw_seed(seed))  # pylint: disable=protected-access
    return drawn

  def whole(shape, rows):
    """``shape`` with the replica's batch's rows for the microbatch's, or None where its first dimension is 1 or
    not the microbatch's rows (a draw broadcast over them, as a ``noise_shape`` of first dimension 1: the same
    numbers for every microbatch; a dimension known only at run time is taken for the rows)."""
    start, stop, total = rows
    if isinstance(shape, (list, tuple)):
      first = tf.get_static_value(shape[0])  # (a Python int, or a tensor: a dimension of the input's shape)
      shape = tf.stack([tf.cast(d, tf.int32) for d in shape])
    else:
      shape = tf.convert_to_tensor(shape)
      first = None if shape.shape.rank != 1 else tf.get_static_value(shape)
      first = None if first is None else first[0]
    if first is not None and (first == 1 or first != stop - start):
      return None
    return tf.concat([[total], tf.cast(shape, tf.int32)[1:]], 0)

  def dropout(inputs, rate, noise_shape=None, seed=None):
    rows = ctx.microbatch
    if rows is None or rate in (0.0, 1.0) or isinstance(seed, int):
      return originals["dropout"](inputs, rate, noise_shape=noise_shape, seed=seed)
    drawn = seed_of(seed)
    inputs = tf.convert_to_tensor(inputs)
    shape = module._get_concrete_noise_shape(inputs, noise_shape)  # pylint: disable=protected-access
    batch = whole(shape, rows)
    if batch is None:  # (broadcast over the rows: the same for every microbatch)
      return tf.nn.experimental.stateless_dropout(inputs, rate=rate, noise_shape=shape, seed=drawn)
    start, stop, _ = rows
    kept = tf.nn.experimental.stateless_dropout(tf.ones(batch, inputs.dtype), rate=rate, seed=drawn)[start:stop]
    return inputs * kept

  def draw(name, shape, dtype, seed, **bounds):
    """``name``'s draw (normal, uniform, truncated normal) of ``shape``: the microbatch's rows of the batch's."""
    rows = ctx.microbatch
    if rows is None or isinstance(seed, int):
      return originals[name](shape, **bounds, dtype=dtype, seed=seed)
    dtype = dtype or module.floatx()
    if name == "uniform":  # (as Keras's: its bounds in the draw's dtype)
      bounds = {k: tf.cast(v, dtype) for k, v in bounds.items()}
    stateless = getattr(tf.random, _STATELESS[name])
    drawn = seed_of(seed)
    batch = whole(shape, rows)
    if batch is None:
      return stateless(shape=shape, seed=drawn, dtype=dtype, **bounds)
    start, stop, _ = rows
    return stateless(shape=batch, seed=drawn, dtype=dtype, **bounds)[start:stop]

  def normal(shape, mean=0.0, stddev=1.0, dtype=None, seed=None):
    return draw("normal", shape, dtype, seed, mean=mean, stddev=stddev)

  def uniform(shape, minval=0.0, maxval=1.0, dtype=None, seed=None):
    return draw("uniform", shape, dtype, seed, minval=minval, maxval=maxval)

  def truncated_normal(shape, mean=0.0, stddev=1.0, dtype=None, seed=None):
    return draw("truncated_normal", shape, dtype, seed, mean=mean, stddev=stddev)

  replaced = {"dropout": dropout, "normal": normal, "uniform": uniform, "truncated_normal": truncated_normal}
  for name, replacement in replaced.items():
    setattr(module, name, replacement)
  try:
    yield
  finally:
    for name, original in originals.items():
      setattr(module, name, original)
