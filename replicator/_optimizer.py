"""``wrap_optimizer``: reduce gradients across replicas before every update."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from replicator import _context

REDUCTIONS = ("mean", "sum")


@_context.no_autograph
class ReplicatedOptimizer:
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

  def __getattr__(self, name):
    return getattr(self._optimizer, name)

  def __setattr__(self, name, value):
    setattr(self._optimizer, name, value)

  def __repr__(self):
    return f"ReplicatedOptimizer({self._optimizer!r}, reduction={self._reduction!r})"
