"""Per-replica values."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any


class PerReplica:
  """One value per replica, in replica order (device order of the Replicator).

  Returned by ``repl.run``; turn it into an ordinary tensor with
  ``repl.reduce`` or ``repl.gather``, or read ``.values``. Also accepted as
  ``repl.run(..., inputs=PerReplica([...]))`` to give each replica its input.

  >>> v = PerReplica([1, 2])
  >>> v.values, len(v), v[1]
  ((1, 2), 2, 2)
  """

  __slots__ = ("_values",)

  def __init__(self, values: Sequence[Any]):
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
      raise TypeError(f"PerReplica needs a sequence with one value per replica, found {type(values).__name__}.")
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

  def __repr__(self) -> str:
    body = ",\n".join(f"  {i}: {v!r}" for i, v in enumerate(self._values))
    return f"PerReplica({{\n{body}\n}})"
