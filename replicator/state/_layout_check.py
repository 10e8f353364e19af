"""Layout maps checked against the variables they are for.

A key of a ``LayoutMap`` that matches no variable is almost always a typo
(``ff_inn/kernel$``), and it fails silently: the variables it was meant for
are replicated and the model trains as if nothing were split. Once a step is
built (its model and the layers it builds lazily exist), every key is
checked against the paths of the variables made in the Replicator's context so
far: a key that matches none is reported once, with the closest paths, as a
warning, or as a ``mesh.LayoutError`` with ``Replicator(strict=True)``.
"""

from __future__ import annotations

import difflib
import re
import warnings
from collections.abc import Sequence

import mesh as mesh_lib

UNMATCHED = (
    "The layouts' key {key!r} matches none of the {count} variable path(s) made in this Replicator's context so "
    "far, so it splits nothing: the variables it was meant for are replicated.{closest} Fix: correct the key "
    "(keys are exact paths or {mode} patterns over paths such as 'dense_1/kernel' for a Keras layer's kernel "
    "or a tf.Variable's name), or remove it. The paths: {paths}."
)


UNMATCHED_OUTPUT = (
    "The layouts' key {key!r} (a layer's output) matches the output of none of the {count} Keras layer(s) the step "
    "called, so it lays out nothing.{closest} Fix: correct the key (the layer's path as Keras names it in a call, "
    "the path its variables' paths begin with, e.g. 'dense_1/output' for 'dense_1/kernel'; matched by {mode}), "
    "or remove it. The layers: {paths}."
)


def _closest(key: str, paths: Sequence[str]) -> list[str]:
  """The paths most like ``key``: its text (regex syntax removed) against their last as many components."""
  text = re.sub(r"[\^$\\.*+?()\[\]{}|]", "", key)
  depth = text.count("/") + 1
  tails = {}
  for path in paths:
    tails.setdefault("/".join(path.split("/")[-depth:]), path)
  return [tails[t] for t in difflib.get_close_matches(text, list(tails), n=3, cutoff=0.6)]


def check(layouts: mesh_lib.LayoutMap | None, paths: Sequence[str], reported: set, strict: bool) -> None:
  """Reports each key of ``layouts`` that matches none of ``paths`` (once per key: ``reported`` remembers)."""
  if layouts is None or not paths:
    return
  _report(layouts, layouts.unmatched(paths), paths, reported, strict, UNMATCHED)


def check_outputs(layouts: mesh_lib.LayoutMap, layer_paths: Sequence[str], reported: set, strict: bool) -> None:
  """Reports each output key of ``layouts`` that matches none of the layers at ``layer_paths`` (once per key)."""
  _report(layouts, layouts.unmatched(layer_paths, outputs=True), layer_paths, reported, strict, UNMATCHED_OUTPUT,
          suffix="/output")


def _report(layouts, keys, paths, reported: set, strict: bool, template: str, suffix: str = "") -> None:
  """Each of ``keys`` not ``reported`` yet, reported (``template``, with the closest of ``paths``, + ``suffix``)."""
  for key in keys:
    if key in reported:
      continue
    reported.add(key)
    closest = _closest(key[:-len(suffix)] if suffix and key.endswith(suffix) else key, paths)
    shown = ", ".join(repr(p) for p in paths[:12]) + (f" and {len(paths) - 12} more" if len(paths) > 12 else "")
    message = template.format(key=key, count=len(paths), paths=shown, mode=f"re.{layouts.match_mode}",
                              closest=f" The closest: {', '.join(repr(p + suffix) for p in closest)}." if closest
                              else "")
    if strict:
      raise mesh_lib.LayoutError(message)
    warnings.warn(message, UserWarning, stacklevel=5)
