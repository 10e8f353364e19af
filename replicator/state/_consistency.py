"""After a failed step: are the replicas' copies of the state still equal?

A step runs on every device at once. If one replica fails at run time (a
``tf.debugging.check_numerics``, an out-of-memory), the others may already
have written their copies of a replicated variable, and the copies then
differ. :func:`diverged` compares, for each replicated variable the step
writes, the copies that must agree (within each group of devices along the
axes it is replicated on); the Replicator then reports which variables
differ and refuses further steps until they agree again (a checkpoint
restored, or the variables assigned from outside a step).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from replicator.state import _variables

DIVERGED = (
    "The step failed at run time ({error}) after some replicas had already updated their state: "
    "the copies of {variables} now differ between replicas (e.g. {first!r}: replica {a} vs replica {b}). Further "
    "steps are refused until the replicas agree again. Fix: restore the last checkpoint "
    "(tf.train.Checkpoint(...).restore(path)), or assign the variables from outside a step; then "
    "fix what failed."
)
STILL_DIVERGED = (
    "The replicas' copies of {variables} still differ since a step failed at run time ({error}), so "
    "this step would start from different states. Fix: restore the last checkpoint "
    "(tf.train.Checkpoint(...).restore(path)), or assign the variables from outside a step."
)


class Written:
  """The replicated variables a step writes, and which of their components (by replica)."""

  def __init__(self, handles):
    by_variable: dict[int, tuple[weakref.ref, set[int]]] = {}
    for handle in handles:
      variable = _variables.owner_of(handle)
      if variable is None or _variables.per_replica_by_design(variable):
        continue  # each replica's own value by design
      for index, component in enumerate(variable.components):
        if component.handle is handle:
          by_variable.setdefault(id(variable), (weakref.ref(variable), set()))[1].add(index)
    self._variables = list(by_variable.values())

  def _snapshot(self, only=None) -> list[tuple[Any, dict[int, np.ndarray]]]:
    values = []
    for ref, indices in self._variables:
      variable = ref()
      if variable is not None and (only is None or variable is only):
        values.append((variable, {r: variable.components[r].numpy() for r in sorted(indices)}))
    return values

  def diverged(self, only=None) -> list[tuple[str, int, int]]:
    """``(name, replica a, replica b)`` for each written variable (or only ``only``) whose written copies differ."""
    found = []
    for variable, values in self._snapshot(only):
      for group in _variables.agreeing_groups(variable):
        members = [r for r in group if r in values]
        if len(members) < 2:
          continue
        first = values[members[0]]
        other = next((r for r in members[1:] if not np.array_equal(values[r], first)), None)
        if other is not None:
          found.append((variable.name, variable.replicas[members[0]], variable.replicas[other]))
          break
    return found


def describe(found: list[tuple[str, int, int]]) -> dict:
  """Format arguments for :data:`DIVERGED` / :data:`STILL_DIVERGED`."""
  names = [name for name, _, _ in found]
  shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
  name, a, b = found[0]
  return dict(variables=shown, first=name, a=a, b=b)
