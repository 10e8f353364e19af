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


def test_convnet_learns_and_resumes_from_a_checkpoint(tmp_path):
  pytest.importorskip("sklearn")
  from examples import convnet
  result = convnet.main(["--devices", "8", "--epochs", "4", "--resume-at", "2",
                         "--checkpoint-dir", str(tmp_path)])
  assert result["replicas"] == 8
  assert [h["epoch"] for h in result["history"]] == [1, 2, 3, 4]  # resumed after epoch 2, no epoch repeated
  assert result["test_accuracy"] > 0.75
  assert (tmp_path / "checkpoint").exists()
