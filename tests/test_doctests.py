"""Runs the ``>>>`` examples in the public modules' docstrings."""

import doctest
import importlib

import pytest
import tensorflow as tf

import replicator

MODULES = ["mesh._devices", "mesh._mesh", "mesh._layout", "mesh._sharded", "replicator", "replicator._replicator", "replicator.core._collective_methods",
           "replicator.core._values", "replicator.core._sequence",
           "replicator.input._inputs", "replicator.core._context", "replicator.core._errors",
           "replicator.integrations._remat", "replicator.integrations._pipeline_plan",
           "replicator.integrations._keras_pipeline"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, extraglobs={"tf": tf, "replicator": replicator, "Replicator": replicator.Replicator},
                           optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0, f"{name} has no doctest examples"
  assert result.failed == 0
