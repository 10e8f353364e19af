"""The supported Python, TensorFlow and Keras ranges: read from the installed metadata, checked at import, and a
version out of range refused with a message that says what was found and what to install."""

import importlib.metadata
import platform

import keras
import pytest
import tensorflow as tf
from packaging.specifiers import SpecifierSet

from mesh import _requirements

RANGES = {"Python": SpecifierSet(">=3.11"), "TensorFlow": SpecifierSet(">=2.21,<3"), "Keras": SpecifierSet(">=3.15,<4")}


def test_ranges_come_from_the_installed_metadata():
  assert _requirements.supported() == RANGES
  assert importlib.metadata.version("replicator") == __import__("replicator").__version__


def test_this_environment_is_in_range():
  found = {"Python": (platform.python_version(), ""), "TensorFlow": (tf.__version__, ""),
           "Keras": (keras.__version__, "")}
  assert _requirements.problems(RANGES, found) == []


def test_out_of_range_messages_say_found_and_fix():
  found = {"Python": ("3.10.13", " at /usr/bin/python3.10"), "TensorFlow": ("2.15.1", " at /site/tensorflow"),
           "Keras": ("2.15.0", "")}
  python, tensorflow, keras_message = _requirements.problems(RANGES, found, "0.1.0")
  assert python == ("replicator 0.1.0 supports Python >=3.11, but found Python 3.10.13 at /usr/bin/python3.10. "
                    "Fix: run replicator with a Python in that range (a virtualenv made from it) "
                    "(or set REPLICATOR_SKIP_VERSION_CHECK=1 to try it anyway).")
  assert tensorflow == ("replicator 0.1.0 supports TensorFlow >=2.21,<3, but found TensorFlow 2.15.1 at "
                        "/site/tensorflow. Fix: pip install 'replicator[cpu]' (or 'replicator[gpu]') in a fresh "
                        "virtualenv, or pip install 'tensorflow-cpu>=2.21,<3' (or set "
                        "REPLICATOR_SKIP_VERSION_CHECK=1 to try it anyway).")
  assert keras_message.startswith("replicator 0.1.0 supports Keras >=3.15,<4, but found Keras 2.15.0. Fix: "
                                  "pip install 'keras>=3.15,<4'")


def test_missing_and_prerelease_versions():
  found = {"TensorFlow": (None, ""), "Keras": ("3.16.0.dev2026112503", "")}
  (message,) = _requirements.problems(RANGES, found, "0.1.0")  # a nightly Keras inside the range is accepted
  assert message == ("replicator 0.1.0 needs TensorFlow >=2.21,<3, which is not installed. Fix: pip install "
                     "'replicator[cpu]' (or 'replicator[gpu]') in a fresh virtualenv, or pip install "
                     "'tensorflow-cpu>=2.21,<3'.")
  assert _requirements.problems(RANGES, {"TensorFlow": ("2.22.0-rc1", "")}) == []


def test_check_raises_import_error_unless_skipped(monkeypatch):
  monkeypatch.setattr(_requirements, "supported", lambda _: dict(RANGES, TensorFlow=SpecifierSet(">=9")))
  monkeypatch.delenv(_requirements.SKIP_VARIABLE, raising=False)
  with pytest.raises(ImportError, match=r"supports TensorFlow >=9, but found TensorFlow 2\.\d+"):
    _requirements.check()
  monkeypatch.setenv(_requirements.SKIP_VARIABLE, "1")
  _requirements.check()  # skipped
