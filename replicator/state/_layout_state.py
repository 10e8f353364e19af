"""The layouts a Replicator gives its variables, and what they have matched so far.

One :class:`LayoutState` per Replicator, owned by it and handed to what
needs it: the variable creator asks it for a new variable's layout spec
(``spec``), ``repl.explain`` for the key that chose it (``chosen_key``), a
built step checks its keys against the variables made so far (``check``),
and with ``layouts="auto"`` the layout search (``auto``) records the map it
chose (``chosen``).
"""

from __future__ import annotations

from typing import Any

import mesh as mesh_lib
from replicator.state import _layout_check


class LayoutState:
  """A Replicator's layout map (given, or chosen by the search), and the paths looked up in it."""

  def __init__(self, layouts: mesh_lib.LayoutMap | None, auto: Any = None):
    self._map = layouts
    self.auto = auto  # layouts="auto": the search's state (_auto_layouts.Auto); None otherwise
    self._chosen_by: dict[str, str | None] = {}  # every path looked up, in order -> the key that matched it
    self._reported: set = set()
    self._error: mesh_lib.LayoutError | None = None  # strict: a key that matches no variable

  @property
  def map(self) -> mesh_lib.LayoutMap | None:
    """The layout map in use: the one given, or the one the search chose (None: every variable replicated)."""
    return self._map

  def use(self, layouts: mesh_lib.LayoutMap | None) -> None:
    """Uses ``layouts`` from now on (``repl.context(layouts=...)``): its keys are checked afresh."""
    self._map = layouts
    self._reported, self._error = set(), None

  def chosen(self, layouts: mesh_lib.LayoutMap | None) -> None:
    """Records the map the layout search chose (the variables it names are laid out already)."""
    self._map = layouts

  def spec(self, path: str):
    """The layout spec the map gives the variable at ``path`` (None: replicated); remembers the key."""
    found = None if self._map is None else self._map.match(path)
    self._chosen_by[path] = None if found is None else found[0]
    return None if found is None else found[1]

  def spec_for(self, spec: tuple, rank: int) -> tuple:
    """``spec`` fitted to a value of ``rank`` dimensions, as the map's ``pad`` setting says."""
    return self._map.spec_for(spec, rank)

  def chosen_key(self, path: str) -> str | None:
    """The key that chose the layout of the variable at ``path`` (None: none matched, or never looked up)."""
    return self._chosen_by.get(path)

  def check(self, strict: bool) -> None:
    """After a build: reports the keys that match no variable made so far (``_layout_check``).

    With ``strict`` the error is raised again by every later call (``raise_refused``) until the layouts change.
    """
    self.raise_refused()
    try:
      _layout_check.check(self._map, list(self._chosen_by), self._reported, strict)
    except mesh_lib.LayoutError as e:
      self._error = e
      raise

  def raise_refused(self) -> None:
    """Raises the strict check's error again, if it refused the layouts."""
    if self._error is not None:
      raise self._error
