"""State that lives exactly as long as what it is about: a dataset, a step function.

A Replicator caches per dataset (its iterators) and per step function (its
built steps); a plain dict keyed by them would keep them, and everything they
hold, alive forever. These keep nothing alive.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any


def attached(owner, name: str) -> "weakref.WeakKeyDictionary[Any, Any]":
  """Per-Replicator state kept on ``owner`` (a dataset) itself, so that it lives exactly as long.

  A map of the Replicator's from datasets to their iterators would keep every
  dataset alive: an iterator reads its dataset. ``None`` gives a throwaway map.
  """
  if owner is None:
    return weakref.WeakKeyDictionary()
  return owner.__dict__.setdefault(name, weakref.WeakKeyDictionary())


class CallableMap:
  """A map keyed by callables that does not keep them alive (nor what they hold).

  A bound method is keyed by its object and function (each attribute access
  makes a new method object); its entry goes when the object goes. A
  callable that cannot be weakly referenced is kept.
  """

  def __init__(self):
    self._entries: dict[tuple, tuple[Callable[[], Any], Any]] = {}

  def _key(self, fn) -> tuple[tuple, Any]:
    if inspect.ismethod(fn):
      return ("method", id(fn.__self__), fn.__func__), fn.__self__
    return ("callable", id(fn)), fn

  def get(self, fn):
    key, owner = self._key(fn)
    entry = self._entries.get(key)
    return entry[1] if entry is not None and entry[0]() is owner else None

  def set(self, fn, value) -> None:
    key, owner = self._key(fn)
    try:
      ref = weakref.ref(owner, lambda _, key=key: self._entries.pop(key, None))
    except TypeError:  # not weakly referenceable: kept
      ref = lambda owner=owner: owner  # noqa: E731
    self._entries[key] = (ref, value)

  def setdefault(self, fn, default):
    """The value for ``fn``, set to ``default`` first if there is none."""
    value = self.get(fn)
    if value is None:
      self.set(fn, default)
      value = default
    return value

  def values(self) -> list:
    return [value for _, value in self._entries.values()]

  def discard(self, value) -> None:
    for key in [k for k, (_, v) in self._entries.items() if v is value]:
      del self._entries[key]
