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


def test_mnist_on_a_2d_mesh_with_layout_rules():
  pytest.importorskip("sklearn")
  # conftest made 8 CPUs; the meshes take the first 2 and 4.
  dp = mnist.main(["--devices", "8", "--mesh", "batch:2", "--layout", "batch:batch", "--epochs", "3"])
  result = mnist.main(["--devices", "8", "--mesh", "batch:2,model:2", "--layout", "batch:batch,hidden:model",
                       "--epochs", "3"])
  assert result["replicas"] == 4 and dp["replicas"] == 2
  # The same model, data order and math: the same accuracy as data-parallel training.
  assert abs(result["test_accuracy"] - dp["test_accuracy"]) <= 0.01
  assert [round(h["loss"], 3) for h in result["history"]] == [round(h["loss"], 3) for h in dp["history"]]
  # w1, b1 and w2 are split in two along "model": each device holds half of them plus all of b2.
  full = (8 * 8 * 1024 + 1024 + 1024 * 10) * 4
  assert set(result["bytes_per_device"].values()) == {full // 2 + 10 * 4}
  assert set(dp["bytes_per_device"].values()) == {full + 10 * 4}
