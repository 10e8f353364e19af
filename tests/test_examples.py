"""Smoke tests of the examples: they run and learn."""

import glob
import os

import numpy as np
import pytest
import tensorflow as tf

from examples import mnist


@pytest.fixture(scope="module", name="mnist_data_parallel")
def _mnist_data_parallel():
  pytest.importorskip("sklearn")
  return mnist.main(["--devices", "8", "--epochs", "6"])  # conftest made 8 CPUs; 4 replicas default


def test_mnist_learns(mnist_data_parallel):
  result = mnist_data_parallel
  assert result["replicas"] == 8
  assert result["test_accuracy"] > 0.90
  losses = [h["loss"] for h in result["history"]]
  assert losses[-1] < losses[0] / 3


def test_convnet_learns_and_resumes_from_a_checkpoint(tmp_path):
  pytest.importorskip("sklearn")
  from examples import convnet
  result = convnet.main(["--devices", "8", "--epochs", "3", "--resume-at", "2",  # (0.83 after 3 epochs)
                         "--checkpoint-dir", str(tmp_path)])
  assert result["replicas"] == 8
  assert [h["epoch"] for h in result["history"]] == [1, 2, 3]  # resumed after epoch 2, no epoch repeated
  assert result["test_accuracy"] > 0.75
  assert (tmp_path / "checkpoint").exists()
  # The TensorBoard log, read back: one series per tag (not one per replica), one point per step.
  events = {}
  for path in glob.glob(os.path.join(result["logdir"], "events.out.tfevents.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        events.setdefault(value.tag, []).append((event.step, float(tf.make_ndarray(value.tensor))))
  assert set(events) == {"train/loss", "train/accuracy", "train/learning_rate", "test/accuracy"}
  steps = 3 * result["steps_per_epoch"]
  assert sorted(s for s, _ in events["train/loss"]) == list(range(1, steps + 1))
  assert all(abs(v - 3e-3) < 1e-9 for _, v in events["train/learning_rate"])
  assert all(0.0 <= v <= 1.0 for _, v in events["train/accuracy"])
  np.testing.assert_allclose([v for _, v in sorted(events["test/accuracy"])],
                             [h["test_accuracy"] for h in result["history"]], atol=1e-6)  # float32 in the log
  epoch_losses = [v for _, v in sorted(events["train/loss"])][-result["steps_per_epoch"]:]
  assert abs(np.mean(epoch_losses) - result["history"][-1]["loss"]) < 0.05 * result["history"][-1]["loss"]


def test_mnist_on_a_2d_mesh_with_layout_rules(mnist_data_parallel):
  # The same model code and step in the global view, hidden layer split over "model" (conftest made 8 CPUs;
  # the mesh takes the first 4). The data order does not depend on the mesh.
  result = mnist.main(["--devices", "8", "--mesh", "batch:2,model:2", "--layout", "batch:batch,hidden:model",
                       "--epochs", "3"])
  dp = mnist_data_parallel
  assert result["replicas"] == 4 and dp["replicas"] == 8
  # The same model, data order and math: the losses and accuracies of data-parallel training, epoch by epoch.
  np.testing.assert_allclose([h["loss"] for h in result["history"]], [h["loss"] for h in dp["history"][:3]],
                             rtol=0, atol=1e-5)
  for key in ("train_accuracy", "test_accuracy"):
    assert [h[key] for h in result["history"]] == [h[key] for h in dp["history"][:3]], key
  losses = [h["loss"] for h in result["history"]]
  assert losses[-1] < losses[0] / 3 and result["test_accuracy"] > 0.85
  # w1, b1 and w2 are split in two along "model": each device holds half of them plus all of b2.
  full = (8 * 8 * 1024 + 1024 + 1024 * 10) * 4
  assert set(result["bytes_per_device"].values()) == {full // 2 + 10 * 4}
  assert set(dp["bytes_per_device"].values()) == {full + 10 * 4}


@pytest.mark.parametrize("view", ["local", "global"])
def test_multi_client_example_trains_on_every_worker_like_one_device(view):
  import io
  import os

  from replicator import launch
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = io.TextIOWrapper(io.BytesIO(), write_through=True)
  err = io.TextIOWrapper(io.BytesIO(), write_through=True)
  code = launch.launch(["-m", "examples.multi_client", "--steps", "20", "--view", view], 2, 2, timeout=300, grace=5.0,
                       env=dict(os.environ, PYTHONPATH=root), out=out, err=err)
  text = out.buffer.getvalue().decode()
  assert code == 0, err.buffer.getvalue().decode()[-3000:]
  for task, replicas in ((0, "[0, 1]"), (1, "[2, 3]")):
    line = next(line for line in text.splitlines() if line.startswith(f"[worker {task}] worker {task} of 2"))
    assert f"replicas {replicas} of 4" in line
    assert float(line.rsplit(" ", 1)[1]) < 1e-5, line  # float32 noise: 2.4e-7 measured after 40 steps


def test_sharded_embedding_example_splits_the_table_over_workers_and_equals_one_device():
  # The table split by rows over 2 worker processes: each holds half of it, the step never gathers it, and the
  # weights equal one device's on the global batches (1.9e-7 measured after 10 steps; float32 noise).
  import io
  import os

  from replicator import launch
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = io.TextIOWrapper(io.BytesIO(), write_through=True)
  err = io.TextIOWrapper(io.BytesIO(), write_through=True)
  code = launch.launch(["-m", "examples.sharded_embedding", "--steps", "10", "--rows", "20000"], 2, 1, timeout=300,
                       grace=5.0, env=dict(os.environ, PYTHONPATH=root), out=out, err=err)
  text = out.buffer.getvalue().decode()
  assert code == 0, err.buffer.getvalue().decode()[-3000:]
  assert "table 20000 x 32: 1,280,000 bytes a device of 2,560,000" in text and "the table gathered: never" in text
  for task in (0, 1):
    line = next(line for line in text.splitlines() if line.startswith(f"[worker {task}] worker {task} of 2"))
    assert float(line.rsplit(" ", 1)[1]) < 1e-5, line
