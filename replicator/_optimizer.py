"""``wrap_optimizer``: reduce gradients across replicas before every update."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from replicator import _context

REDUCTIONS = ("mean", "sum")


@_context.no_autograph
class ReplicatedOptimizer(tf.Module):
  """An optimizer whose updates use gradients reduced across replicas.

  Returned by ``repl.wrap_optimizer(opt)``. ``apply_gradients`` / ``apply``
  all-reduce the gradients (mean by default; ``"sum"`` when the loss is already
  scaled by the global batch size), then hand them to the wrapped optimizer on
  every replica, so replicated variables receive identical updates. Every other
  attribute (``learning_rate``, ``iterations``, ``variables``, ...) is the
  wrapped optimizer's.

  Works with Keras 3 optimizers (``apply_gradients(grads_and_vars)``,
  ``apply(grads, variables)``) and Sonnet 2 optimizers (``apply(updates,
  parameters)``).

  For checkpoints the wrapper is transparent: ``tf.train.Checkpoint(optimizer=
  wrapped)`` writes exactly what the wrapped optimizer would, so it restores
  into an unwrapped optimizer (one device) and back.
  """

  def __init__(self, replicator, optimizer, reduction: str = "mean"):
    if reduction not in REDUCTIONS:
      raise ValueError(f"wrap_optimizer(reduction={reduction!r}): reduction must be one of {REDUCTIONS}.")
    if not (hasattr(optimizer, "apply_gradients") or hasattr(optimizer, "apply")):
      raise TypeError(
          f"wrap_optimizer() needs a Keras 3 or Sonnet 2 optimizer (an object with "
          f"apply_gradients() or apply()), but found {type(optimizer).__name__}.")
    object.__setattr__(self, "_replicator", replicator)
    object.__setattr__(self, "_optimizer", optimizer)
    object.__setattr__(self, "_reduction", reduction)

  @property
  def optimizer(self):
    """The wrapped optimizer."""
    return self._optimizer

  @property
  def reduction(self) -> str:
    """How gradients are combined across replicas: "mean" or "sum"."""
    return self._reduction

  def reduce_gradients(self, grads: list[Any]) -> list[Any]:
    """All-reduces ``grads`` across replicas; ``None`` entries stay ``None``."""
    dense = [None if g is None else tf.convert_to_tensor(g) for g in grads]
    present = [g for g in dense if g is not None]
    reduced = iter(self._replicator.all_reduce(present, op=self._reduction) if present else [])
    return [None if g is None else next(reduced) for g in dense]

  def build(self, variables, *args, **kwargs):
    """Creates the optimizer's slot variables now, replicated like the model's."""
    with self._replicator.context():
      return self._optimizer.build(variables, *args, **kwargs)

  def apply_gradients(self, grads_and_vars, *args, **kwargs):
    """Reduces the gradients across replicas, then applies them (Keras API)."""
    grads_and_vars = list(grads_and_vars)
    grads = self.reduce_gradients([g for g, _ in grads_and_vars])
    return self._optimizer.apply_gradients(
        list(zip(grads, [v for _, v in grads_and_vars])), *args, **kwargs)

  def apply(self, grads, variables=None, *args, **kwargs):
    """Reduces the gradients across replicas, then applies them.

    Keras 3: ``apply(grads, trainable_variables)``. Sonnet 2:
    ``apply(updates, parameters)``.
    """
    grads = self.reduce_gradients(list(grads))
    if variables is None:
      return self._optimizer.apply(grads, *args, **kwargs)
    return self._optimizer.apply(grads, variables, *args, **kwargs)

  # -- checkpoints: the wrapper's dependencies are the wrapped optimizer's -----

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    return self._optimizer._trackable_children(save_type, **kwargs)  # pylint: disable=protected-access

  def _lookup_dependency(self, name, cached_dependencies=None):
    return self._optimizer._lookup_dependency(name, cached_dependencies)  # pylint: disable=protected-access

  @property
  def _deferred_dependencies(self):
    return self._optimizer._deferred_dependencies  # pylint: disable=protected-access

  def __getattr__(self, name):
    return getattr(self._optimizer, name)

  def __setattr__(self, name, value):
    setattr(self._optimizer, name, value)

  def __repr__(self):
    return f"ReplicatedOptimizer({self._optimizer!r}, reduction={self._reduction!r})"
