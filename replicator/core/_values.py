"""Per-replica values."""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import tensorflow as tf
import tree

from replicator.core import _errors
from replicator.core import _tf_types

NOT_TENSORS = (
    "A PerReplica is passed to a tf.function as its values' tensors, but its values are {values!r}. Fix: give it "
    "tensors (or nests of tensors), e.g. PerReplica([tf.constant(v) for v in values])."
)


class PerReplica(_tf_types.CompositeTensor):
  """One value per replica, in replica order (device order of the Replicator).

  ``repl.run`` returns the step's nest with a ``PerReplica`` at each tensor
  leaf; turn one into an ordinary tensor with ``repl.reduce`` or
  ``repl.gather``, or read ``.values``. Also accepted as
  ``repl.run(..., inputs=PerReplica([...]))`` to give each replica its input.

  Examples:
    >>> v = PerReplica([1, 2])
    >>> v.values, len(v), v[1]
    ((1, 2), 2, 2)
  """

  __slots__ = ("_values",)

  def __init__(self, values: Sequence[Any]):
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
      raise _errors.ArgumentTypeError(f"PerReplica needs a sequence with one value per replica, found {type(values).__name__}.")
    self._values = tuple(values)

  @property
  def values(self) -> tuple[Any, ...]:
    """The per-replica values."""
    return self._values

  def __len__(self) -> int:
    return len(self._values)


  def __getitem__(self, replica: int) -> Any:
    return self._values[replica]

  def __iter__(self) -> Iterator[Any]:
    return iter(self._values)

  @property
  def _type_spec(self) -> PerReplicaSpec:
    # A composite tensor, as tf.distribute's PerReplica: a tf.function takes it as its values' tensors (one trace
    # for every PerReplica of the same specs), and tf.nest takes it as one leaf unless expand_composites=True.
    try:
      return PerReplicaSpec(*[tree.map_structure(tf.type_spec_from_value, v) for v in self._values])
    except (TypeError, ValueError) as e:
      raise _errors.ArgumentTypeError(NOT_TENSORS.format(values=self._values)) from e

  def __repr__(self) -> str:
    body = ",\n".join(f"  {i}: {v!r}" for i, v in enumerate(self._values))
    return f"PerReplica({{\n{body}\n}})"


class PerReplicaSpec(tf.TypeSpec):
  """The type of a :class:`PerReplica` of tensors: one spec (nest) per replica."""

  __slots__ = ("_value_specs",)

  def __init__(self, *value_specs):
    self._value_specs = tuple(value_specs)

  @property
  def value_type(self):
    return PerReplica

  def _serialize(self):
    return self._value_specs

  @property
  def _component_specs(self):
    return self._value_specs

  def _to_components(self, value):
    return value.values

  def _from_components(self, components):
    return PerReplica(components)


def combine(per_replica_nests: Sequence[Any]) -> Any:
  """[nest_0, ..., nest_n-1] -> one nest with a PerReplica at each leaf (None stays None)."""
  def leaf(*values):
    return None if values[0] is None else PerReplica(values)

  return tree.map_structure(leaf, *per_replica_nests)


def split(value: Any, num_replicas: int) -> list[Any] | None:
  """The per-replica nests of ``value`` if it holds PerReplica leaves, else None.

  Accepts a PerReplica of nests or a nest with PerReplica leaves (what
  ``repl.run`` returns).
  """
  if isinstance(value, PerReplica):
    return list(value.values)
  leaves = tree.flatten(value)
  if not any(isinstance(v, PerReplica) for v in leaves):
    return None
  return [tree.map_structure(lambda v, r=r: v[r] if isinstance(v, PerReplica) else v, value)
          for r in range(num_replicas)]


def first_mismatch(nests: Sequence[Any], check_shapes: bool = False) -> tuple[int, str] | None:
  """Compares every replica's nest with replica 0's.

  Leaves are tensors, TensorSpecs or None. Returns ``(replica, what)`` for the
  first replica that differs in structure, dtype (or, with ``check_shapes``,
  incompatible shape), e.g. ``(2, "dtype float32 vs int32")``; None if all agree.
  """
  first = nests[0]
  for r, other in enumerate(nests[1:], start=1):
    try:
      tree.assert_same_structure(first, other)
    except (ValueError, TypeError):
      return r, "structure"
    for a, b in zip(tree.flatten(first), tree.flatten(other)):
      if (a is None) != (b is None):
        return r, "structure"
      if a is None:
        continue
      if a.dtype != b.dtype:
        return r, f"dtype {a.dtype.name} vs {b.dtype.name}"
      if check_shapes and not a.shape.is_compatible_with(b.shape):
        return r, f"shape {a.shape} vs {b.shape}"
  return None
