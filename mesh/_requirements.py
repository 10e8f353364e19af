"""The supported Python, TensorFlow and Keras versions, checked when the packages are imported.

The ranges are stated once, in the distribution's metadata (``setup.py``);
this module reads them back from the installed metadata, so a range is never
written twice. ``mesh`` is imported first by ``replicator`` and ``rewrite``
alike, so the check runs before anything touches TensorFlow's API. A source
tree used without ``pip install`` has no metadata and is not checked.

Set ``REPLICATOR_SKIP_VERSION_CHECK=1`` to try versions outside the ranges.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion
from packaging.version import Version

DISTRIBUTION = "replicator"
SKIP_VARIABLE = "REPLICATOR_SKIP_VERSION_CHECK"
_TENSORFLOW_NAMES = ("tensorflow", "tensorflow-cpu")

_OUT_OF_RANGE = (
    "replicator {version} supports {what} {supported}, but found {what} {found}{where}. Fix: {fix} "
    "(or set {skip}=1 to try it anyway).")
_MISSING = (
    "replicator {version} needs {what} {supported}, which is not installed. Fix: {fix}.")
_FIXES = {
    "Python": "run replicator with a Python in that range (a virtualenv made from it)",
    "TensorFlow": "pip install 'replicator[cpu]' (or 'replicator[gpu]') in a fresh virtualenv, "
                  "or pip install 'tensorflow-cpu{supported}'",
    "Keras": "pip install 'keras{supported}'",
}


def _distribution() -> importlib.metadata.Distribution | None:
  """The installed distribution (its metadata read once), or None if not installed."""
  try:
    return importlib.metadata.distribution(DISTRIBUTION)
  except importlib.metadata.PackageNotFoundError:
    return None


def supported(distribution: importlib.metadata.Distribution | None = None) -> dict[str, SpecifierSet] | None:
  """``{"Python": ..., "TensorFlow": ..., "Keras": ...}`` from the installed metadata; None if not installed."""
  distribution = distribution or _distribution()
  if distribution is None:
    return None
  ranges = {"Python": SpecifierSet(distribution.metadata.get("Requires-Python") or "")}
  for line in distribution.requires or []:
    requirement = Requirement(line)
    if requirement.name in _TENSORFLOW_NAMES:
      ranges["TensorFlow"] = requirement.specifier
    elif requirement.name == "keras":
      ranges["Keras"] = requirement.specifier
  return ranges


def _installed_tensorflow() -> tuple[str | None, str]:
  try:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
  except ModuleNotFoundError as e:
    if e.name != "tensorflow":
      raise  # installed, but something it needs is missing: TensorFlow's own error says what
    return None, ""
  return tf.__version__, f" at {os.path.dirname(tf.__file__)}"


def _installed_keras() -> tuple[str | None, str]:
  try:
    return importlib.metadata.version("keras"), ""
  except importlib.metadata.PackageNotFoundError:
    return None, ""


def _spelled(specifier: SpecifierSet) -> str:
  """">=2.21,<3": lower bounds first, as people write a range."""
  return ",".join(sorted((str(s) for s in specifier), key=lambda s: (not s.startswith(">"), s))) or "(any version)"


def problems(ranges: dict[str, SpecifierSet], found: dict[str, tuple[str | None, str]],
             version: str = "") -> list[str]:
  """One message for each of ``found``'s ``{what: (version or None, where)}`` outside ``ranges``."""
  messages = []
  for what, (found_version, where) in found.items():
    specifier = ranges.get(what)
    if specifier is None:
      continue
    args = dict(version=version, what=what, supported=_spelled(specifier), skip=SKIP_VARIABLE)
    args["fix"] = _FIXES[what].format(**args)
    if found_version is None:
      messages.append(_MISSING.format(**args))
      continue
    try:
      ok = specifier.contains(Version(found_version), prereleases=True)
    except InvalidVersion:
      continue  # a local build with an unparsable version: nothing to compare
    if not ok:
      messages.append(_OUT_OF_RANGE.format(found=found_version, where=where, **args))
  return messages


def check() -> None:
  """Raises ImportError, saying what to install, if Python, TensorFlow or Keras is outside the supported ranges."""
  if os.environ.get(SKIP_VARIABLE, "") not in ("", "0"):
    return
  distribution = _distribution()
  if distribution is None:
    return
  ranges, version = supported(distribution), distribution.version
  found = {"Python": (platform.python_version(), f" at {sys.executable}")}
  messages = problems(ranges, found, version)
  if not messages:  # TensorFlow's import is needed anyway; Keras's version is read from its metadata
    found = {"TensorFlow": _installed_tensorflow(), "Keras": _installed_keras()}
    messages = problems(ranges, found, version)
  if messages:
    raise ImportError("\n".join(messages))


check()  # on import: `mesh/__init__.py` imports this module before any other
