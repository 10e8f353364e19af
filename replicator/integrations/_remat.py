"""``replicator.remat``, and Keras's own rematerialization (``keras.RematScope``, ``keras.remat``) on TensorFlow.

``replicator.remat(fn)`` is ``core/_remat``'s rematerialization with Keras's
implicit call state carried into the recomputation; ``replicator.remat(layer)``
wraps a Keras layer in :class:`Remat`.

Keras 3.15's TensorFlow backend implements ``keras.remat`` (which
``keras.RematScope`` applies to every layer call it covers) as
``tf.recompute_grad``, which inside a ``tf.function`` refuses keyword
arguments (every Keras layer is called with ``training=``:
keras-team/keras#21207) and replays no random draw. :func:`install` makes the
TensorFlow backend's ``remat`` this module's: it is called by
``replicator.enable_keras_distribution()`` and when a Replicator's Keras
strategy is made (the first ``repl.context()``), and stays installed for the
process (the replaced function fails for every Keras layer called in a
``tf.function``, and gives the same values wherever it works).

Private Keras API, in this module only (checked on Keras 3.15.1;
tests/test_remat.py fails if it changes):

* ``keras.src.backend.tensorflow.core.remat`` is replaced (Keras's
  ``keras.src.backend.common.remat.remat`` looks it up at each call);
* the recomputation sets Keras's global state ``current_call_ctx`` (the
  ``training`` value and call-context arguments that outer layer calls pass
  to inner ones) and ``autocast_scope`` (mixed precision) to what they were in
  the forward pass (``keras.src.backend.common.global_state``);
* ``keras.src.backend.common.stateless_scope.in_stateless_scope``: inside a
  ``StatelessScope`` (Keras building a model symbolically, ``layer.stateless_call``)
  variables are read and written without ops, which cannot be replayed: the
  function runs there as without remat (its values are the same).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import threading

import keras
import tensorflow as tf
from keras.src.backend.common import global_state  # private: see the module docstring
from keras.src.backend.common import stateless_scope  # private: see the module docstring

from replicator.core import _errors
from replicator.core import _remat

KERAS_STATE = ("current_call_ctx", "autocast_scope")  # what a layer call reads implicitly from the ones around it

NOT_BUILT = (
    "replicator.remat({name}) wraps a layer that is not built, and building it from the call's arguments "
    "(shapes {found}) failed: {error}. Fix: build the layer before wrapping it (layer.build(...) with every "
    "input's shape, or call it once)."
)

_lock = threading.Lock()
_installed = False


def keras_state():
  """Keras's implicit call state now (see :data:`KERAS_STATE`); returns what sets it again for the recomputation."""
  context = global_state.get_global_attribute("current_call_ctx")
  saved = {"current_call_ctx": None if context is None else copy.copy(context),
           "autocast_scope": global_state.get_global_attribute("autocast_scope")}

  @contextlib.contextmanager
  def enter():
    previous = {name: global_state.get_global_attribute(name) for name in KERAS_STATE}
    for name in KERAS_STATE:
      value = saved[name]
      global_state.set_global_attribute(name, copy.copy(value) if name == "current_call_ctx" else value)
    try:
      yield
    finally:
      for name in KERAS_STATE:
        global_state.set_global_attribute(name, previous[name])

  return enter


def _function(fn, name: str):
  rematerialized = _remat.remat(fn, ambient=keras_state, name=name)

  @tf.autograph.experimental.do_not_convert
  def call(*args, **kwargs):
    if stateless_scope.in_stateless_scope():  # Keras building a model, or stateless_call: no ops to replay
      return fn(*args, **kwargs)
    return rematerialized(*args, **kwargs)

  call.__wrapped__ = fn
  call.__name__ = getattr(fn, "__name__", name)
  call.__doc__ = getattr(fn, "__doc__", None)
  return call


def remat(fn):
  """Rematerializes a function or a Keras layer: its backward pass computes its forward pass again.

  A rematerialized block keeps only its inputs for the backward pass and
  computes its intermediate values again there, from the inputs, when its
  gradient is asked for: the memory of its activations for the time of one
  more forward pass of the block. Unlike ``tf.recompute_grad`` (and
  ``keras.RematScope`` on TensorFlow, which uses it), it works inside a
  ``tf.function``, Keras's ``fit`` and ``repl.run`` (both views), with keyword
  arguments, and the recomputed pass draws the first pass's random numbers,
  so a rematerialized step's gradients are the plain step's:

  * arguments: the tensors among the arguments (nested structures too) are
    the recomputation's inputs; other values (``training=True``, ``None``,
    numbers, layers) are passed as they were;
  * variables the block reads get their gradients, as without remat;
  * random draws: stateless ops (Keras's Dropout and ``keras.random`` on
    TensorFlow) draw from the same seeds again; stateful ops
    (``tf.random.uniform``, ``tf.random.Generator``) give the first pass's
    values, which the backward pass keeps (as it keeps the inputs);
  * variables are read as the first pass read them (its weights, and what
    it writes: Keras's seed generators, BatchNormalization's moving
    statistics), and written once, as without remat.

  What is saved for the backward pass: the block's inputs, the outputs of its
  stateful random ops, and the values it read of variables (the variables'
  own buffers, no copy unless they are written before the backward pass).
  Everything else is recomputed, once the gradient of the block's outputs
  exists. Executed eagerly (outside any ``tf.function``) the block runs as
  without remat: the recomputation needs a graph to replay draws in; so does
  a block called inside a ``tf.while_loop`` or ``tf.cond`` body (a Keras RNN
  cell): the function around the loop is what to rematerialize. Random ops
  and variable writes inside a ``tf.cond``, ``tf.while_loop`` or nested
  ``tf.function`` of the block are refused (``replicator.UnsupportedError``,
  with the fix). Blocks nest: a rematerialized block inside another is
  computed once more per level in the backward pass (``keras.RematScope
  (mode="full")`` rematerializes the model's call and each layer's).

  After ``replicator.enable_keras_distribution()`` or a first
  ``repl.context()``, Keras's own ``keras.RematScope`` and ``keras.remat``
  on TensorFlow use this function.

  Args:
    fn: a function, called as ``fn(*args, **kwargs)``; or a Keras layer, for
      which a layer (:class:`Remat`) that calls it rematerialized is returned.

  Returns:
    The rematerialized function, or a Keras layer.

  Raises:
    ArgumentTypeError: ``fn`` is neither a function nor a layer.

  Examples:
    >>> import keras
    >>> dense = keras.layers.Dense(4, activation="relu")
    >>> dense.build((None, 3))
    >>> @replicator.remat
    ... def block(x, training=False):
    ...   return dense(x) * 2.0
    >>> @tf.function
    ... def gradient(x):
    ...   with tf.GradientTape() as tape:
    ...     loss = tf.reduce_sum(block(x, training=True))
    ...   return tape.gradient(loss, dense.kernel)
    >>> gradient(tf.ones([2, 3])).shape
    TensorShape([3, 4])
    >>> layer = replicator.remat(keras.layers.Dense(4))  # a layer: use it as the Dense
    >>> layer(tf.ones([2, 3])).shape
    TensorShape([2, 4])
  """
  if isinstance(fn, keras.layers.Layer):
    return Remat(fn)
  if not callable(fn):
    raise _errors.ArgumentTypeError(_remat.NOT_CALLABLE.format(found=fn, kind=type(fn).__name__))
  return _function(fn, getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__)


def _accepts(layer, argument: str) -> bool:
  """Whether ``layer.call`` takes ``argument`` (by name, or through ``**kwargs``)."""
  parameters = inspect.signature(layer.call).parameters
  return argument in parameters or any(p.kind == p.VAR_KEYWORD for p in parameters.values())


@keras.saving.register_keras_serializable(package="replicator")
class Remat(keras.layers.Wrapper):
  """A Keras layer whose calls are rematerialized: ``replicator.remat(layer)`` (see :func:`remat`).

  It calls the wrapped layer with the arguments it is given (and the
  ``training`` and ``mask`` that Keras resolves for it), and owns the wrapped
  layer's variables. Built as Keras's wrappers are, from its first input's
  shape; a layer of several inputs is built on its first call, from them.
  """

  def __init__(self, layer, **kwargs):
    super().__init__(layer, **kwargs)
    self.supports_masking = getattr(layer, "supports_masking", False)
    self._rematerialized = _function(self._call_layer, f"{type(layer).__name__} {layer.name!r}")

  def _call_layer(self, *args, **kwargs):
    return self.layer(*args, **kwargs)

  def build(self, input_shape=None):
    if not self.layer.built and input_shape is not None:
      try:
        self.layer.build(input_shape)
      except (TypeError, ValueError):
        pass  # several inputs: built on the first call (see call)
    self.built = True

  def call(self, inputs, *args, training=None, mask=None, **kwargs):
    if training is not None and _accepts(self.layer, "training"):
      kwargs["training"] = training
    if mask is not None and _accepts(self.layer, "mask"):
      kwargs["mask"] = mask
    if not self.layer.built:  # several inputs: built by a symbolic call (no op, no draw), outside the remat
      self._build_symbolically((inputs, *args), kwargs)
    return self._rematerialized(inputs, *args, **kwargs)

  def _build_symbolically(self, args, kwargs):
    def symbolic(x):
      return keras.KerasTensor(x.shape, dtype=x.dtype.name) if isinstance(x, tf.Tensor) else x

    found = tf.nest.map_structure(lambda x: getattr(x, "shape", x), (args, kwargs))
    try:
      self.layer(*tf.nest.map_structure(symbolic, args), **tf.nest.map_structure(symbolic, kwargs))
    except Exception as e:  # pylint: disable=broad-except  (any failure of the layer's own build)
      raise _errors.UnsupportedError(NOT_BUILT.format(name=f"{type(self.layer).__name__} {self.layer.name!r}",
                                                      found=found, error=e)) from e

  def compute_output_spec(self, inputs, *args, training=None, mask=None, **kwargs):
    if mask is not None and _accepts(self.layer, "mask"):
      kwargs["mask"] = mask
    if training is not None and _accepts(self.layer, "training"):
      kwargs["training"] = training
    return self.layer.compute_output_spec(inputs, *args, **kwargs)

  def compute_mask(self, inputs, mask=None):
    return self.layer.compute_mask(inputs, mask)


def _keras_remat(f):
  """``keras.remat`` on the TensorFlow backend: :func:`remat` (installed by :func:`install`)."""
  return _function(f, getattr(f, "__qualname__", None) or getattr(f, "__name__", None) or type(f).__name__)


def install() -> None:
  """Makes Keras's TensorFlow backend rematerialize with :func:`remat` (once; a no-op on other backends)."""
  global _installed
  with _lock:
    if _installed or keras.backend.backend() != "tensorflow":
      return
    from keras.src.backend.tensorflow import core  # pylint: disable=import-outside-toplevel  (private: see above)
    _keras_remat.__doc__ = core.remat.__doc__
    core.remat = _keras_remat
    _installed = True
