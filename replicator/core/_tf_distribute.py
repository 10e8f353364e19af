"""``tf.distribute``'s replica context while a replica is traced.

Keras, Sonnet and most TensorFlow model code that needs the other replicas
asks ``tf.distribute.get_replica_context()`` for them:
``BatchNormalization(synchronized=True)`` all-reduces its batch sums through
it, ``snt.distribute.CrossReplicaBatchNorm`` its means, user code reads
``num_replicas_in_sync``. Outside a strategy that is TensorFlow's default
context (one replica, collectives are identities), so without this module
such code silently computes per replica under ``repl.run``.

While replica ``r`` is traced, :func:`replica_context` enters a
:class:`ReplicaContext` whose collectives are the Replicator's placeholders.
Its replicas are the data-parallel ones: positions along the Replicator's
``batch_axes`` (all devices on the default one-dimensional mesh); devices that
differ only along model axes hold pieces of the same replica. Its strategy is
TensorFlow's default strategy, so ``tf.distribute.has_strategy()`` stays
False and code that scales losses by the strategy's replica count (Keras
losses, ``tf.nn.compute_average_loss``) sees 1, as on one device: gradient
reduction stays ``wrap_optimizer``'s job. Entering the context also makes
``tf.summary`` record on replica 0 only (``tf.distribute.ReplicaContext``
does that for every strategy).

Only public API: ``tf.distribute.ReplicaContext`` is subclassed and its
methods overridden.
"""

from __future__ import annotations

import contextlib
import inspect

import tensorflow as tf

from replicator.core import _context
from replicator.core import _errors
from replicator.core import _primitives

MERGE_CALL = (
    "tf.distribute.get_replica_context().merge_call() was called while a Replicator step is built "
    "(at {location}). merge_call hands control to a tf.distribute.Strategy in cross-replica mode, and a "
    "Replicator step has none: every replica is traced as its own program. Fix: use the replica "
    "context's all_reduce / all_gather (or repl.all_reduce, repl.all_gather), which the Replicator "
    "turns into collectives; for an optimizer, wrap it with repl.wrap_optimizer."
)

_default_strategy = None
_default_replica_context = None

# Keras 3's TensorFlow optimizers sum gradients over the replica context
# themselves (``TFOptimizer._all_reduce_sum_gradients``, checked on Keras
# 3.15) and rely on the strategy having divided the loss by the replica
# count. A Replicator step's loss is not divided (see the module docstring):
# the sum would be N times one device's gradient. Those calls therefore pass
# the gradients through unchanged: under ``wrap_optimizer`` they are already
# reduced, and a Keras optimizer used without it is refused by the
# invariance check with a message that says to wrap it.
_KERAS_GRADIENT_SUM = "_all_reduce_sum_gradients"
# ``strategy.extended.update(var, fn)`` called in a replica context (Keras
# optimizers' update of each variable) reaches ``merge_call`` through
# ``StrategyExtendedV2._replica_ctx_update`` (TF 2.21); with the default
# strategy that runs ``fn(var)`` on this replica's variable, as on one device.
# Every other merge_call would hand per-replica values to a strategy that
# cannot see the other replicas, so it is refused.
_STRATEGY_UPDATE = "_replica_ctx_update"


def default_strategy() -> tf.distribute.Strategy:
  """TensorFlow's default (single-replica, no-op) strategy."""
  global _default_strategy, _default_replica_context
  if _default_strategy is None:
    with tf.Graph().as_default():  # a fresh graph has no strategy scope entered
      _default_strategy = tf.distribute.get_strategy()
      _default_replica_context = tf.distribute.get_replica_context()
  return _default_strategy


@contextlib.contextmanager
def one_device_context():
  """``tf.distribute``'s context of a step on one device: the default strategy's replica context.

  A global-view step is the one-device step, traced once: inside a
  strategy's scope (``repl.context()``, a Keras distribution after
  ``enable_keras_distribution()``, Keras's trainer) it would otherwise be
  traced in that strategy's cross-replica context, which code written for one
  device does not expect (Keras's ``LossScaleOptimizer.apply`` refuses it:
  "apply() must be called in a replica context"). In this context
  ``tf.distribute.has_strategy()`` is False, ``get_replica_context()`` is the
  default one and its collectives are identities, as on one device.
  """
  default_strategy()
  with _default_replica_context:
    yield


def batch_replicas(mesh, batch_axes) -> tuple[int, tuple[str, ...]]:
  """``tf.distribute``'s replicas of a Replicator: how many, and the mesh axes (of size > 1) they lie along."""
  axes = tuple(a for a in (batch_axes or ()) if mesh.shape[a] > 1)
  return (mesh.axis_size(axes) if axes else 1), axes


def called_by(names: str | tuple[str, ...], depth: int = 4) -> bool:
  """Whether one of the ``depth`` frames above the caller runs a function named in ``names``."""
  names = (names,) if isinstance(names, str) else names
  frame = inspect.currentframe()
  try:
    frame = frame.f_back.f_back if frame is not None else None
    for _ in range(depth):
      if frame is None:
        return False
      if frame.f_code.co_name in names:
        return True
      frame = frame.f_back
    return False
  finally:
    del frame


def _reduce_op(reduce_op) -> str:
  if isinstance(reduce_op, tf.distribute.ReduceOp):
    return reduce_op.value.lower()
  if isinstance(reduce_op, str) and reduce_op.lower() in ("sum", "mean"):
    return reduce_op.lower()
  raise _errors.ArgumentError(
      f"tf.distribute ReplicaContext.all_reduce(reduce_op={reduce_op!r}): expected "
      "tf.distribute.ReduceOp.SUM or MEAN (or 'sum' / 'mean').")


@_context.no_autograph  # AutoGraph would convert these methods and all they call in each step (1.8 s a build)
class ReplicaContext(tf.distribute.ReplicaContext):
  """The ``tf.distribute`` replica context of one replica of a Replicator step."""

  def __init__(self, ctx: _context.ReplicaContext):
    replicator = ctx.replicator
    self._ctx = ctx
    self._num, self._axes = batch_replicas(replicator.mesh, ctx.batch_axes)
    self._id = replicator.mesh.axis_index(ctx.replica_id, self._axes) if self._axes else 0
    super().__init__(default_strategy(), replica_id_in_sync_group=self._id)

  @property
  def num_replicas_in_sync(self) -> int:
    return self._num

  @property
  def replica_id_in_sync_group(self) -> tf.Tensor:
    return tf.constant(self._id, tf.int32)

  @property
  def _replica_id(self):
    return self.replica_id_in_sync_group

  @property
  def devices(self) -> tuple[str, ...]:
    return (self._ctx.device,)

  def all_reduce(self, reduce_op, value, options=None):  # pylint: disable=unused-argument
    op = _reduce_op(reduce_op)
    if not self._axes:
      return value
    if called_by(_KERAS_GRADIENT_SUM):  # reduced by wrap_optimizer, or refused unreduced (see above)
      return value
    return _primitives.all_reduce(self._ctx, value, op, self._axes, _primitives.user_location())

  def all_gather(self, value, axis, options=None):  # pylint: disable=unused-argument
    if not self._axes:
      return value
    return _primitives.all_gather(self._ctx, value, axis, self._axes, _primitives.user_location())

  def merge_call(self, merge_fn, args=(), kwargs=None):
    if called_by(_STRATEGY_UPDATE):  # a local variable update: the default strategy runs it as written
      return super().merge_call(merge_fn, args, kwargs)
    raise _errors.UnsupportedError(MERGE_CALL.format(location=_primitives.user_location()))


@contextlib.contextmanager
def replica_context(ctx: _context.ReplicaContext):
  """Makes ``tf.distribute.get_replica_context()`` this replica's context (see the module docstring)."""
  with ReplicaContext(ctx):
    yield
