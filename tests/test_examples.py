"""Smoke tests of the examples: they run and learn."""

import pytest

from examples import mnist


def test_mnist_learns():
  pytest.importorskip("sklearn")
  result = mnist.main(["--devices", "8", "--epochs", "6"])  # conftest made 8 CPUs; 4 replicas default
  assert result["replicas"] == 8
  assert result["test_accuracy"] > 0.90
  losses = [h["loss"] for h in result["history"]]
  assert losses[-1] < losses[0] / 3
