"""Smoke tests of examples/transformer.py: the Keras 3 transformer in the global view.

The same single-device model and step, on a 2x2 mesh under each named layout
set (``--layout data``, ``megatron``, ``2d``), give the losses of the same
script on one device (``--one-device``) step by step, and learn. A fallback
(an op without a layout rule) would warn, and warnings are errors in the tests.
"""

import math

import numpy as np
import pytest

from examples import transformer

TINY = ["--d-model", "32", "--heads", "4", "--ff", "64", "--layers", "1", "--seq-len", "16", "--batch-size", "8",
        "--epochs", "2", "--steps-per-epoch", "3", "--learning-rate", "1e-2", "--seed", "1", "--generate", "0",
        "--devices", "8"]  # conftest made 8 CPUs; the 2x2 mesh takes the first 4


def _run(*extra):
  return transformer.main(TINY + list(extra))


@pytest.fixture(scope="module", name="one_device")
def _one_device():
  return _run("--one-device", "--eval-batches", "1")


def test_one_device_learns(one_device):
  losses = one_device["losses"]
  assert len(losses) == 6 and one_device["replicas"] == 1
  assert abs(losses[0] - math.log(one_device["vocabulary"])) < 0.2
  assert losses[-1] < losses[0] - 0.5
  assert one_device["heldout_loss"] < losses[0] - 0.5


# Each run builds its steps (the bulk of its time): only "megatron" also builds the evaluation step.
EXTRA = {"data": ["--eval-batches", "0"], "megatron": ["--eval-batches", "1"],
         "2d": ["--eval-batches", "0", "--explain"]}


@pytest.mark.parametrize("layout", ["data", "megatron", "2d"])
def test_layouts_give_the_losses_of_one_device(layout, one_device, capsys):
  # Only --layout changes: the model, the step and the data are the same.
  result = _run("--mesh", "batch:2,model:2", "--layout", layout, *EXTRA[layout])
  assert result["replicas"] == 4 and result["trace_count"] == (2 if layout == "megatron" else 1)
  if layout == "2d":
    assert "collective" in capsys.readouterr().out  # --explain printed the plan
  np.testing.assert_allclose(result["losses"], one_device["losses"], rtol=0, atol=1e-5)
  assert result["losses"][-1] < result["losses"][0] - 0.5
  # "data" replicates every weight; the other layouts keep only a piece of the split ones on each device.
  assert result["weight_bytes"] == one_device["weight_bytes"]
  per_device = set(result["bytes_per_device"].values())
  if layout == "data":
    assert per_device == {one_device["weight_bytes"]}
  else:
    assert len(per_device) == 1 and per_device.pop() < 0.8 * one_device["weight_bytes"]
  if layout == "megatron":
    np.testing.assert_allclose(result["heldout_loss"], one_device["heldout_loss"], rtol=0, atol=1e-5)
