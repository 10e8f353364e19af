"""Smoke tests of examples/transformer_local.py (the local view): it learns, and its mesh layouts agree.

A tiny configuration trains on a 2x2 mesh (batch and heads/ff split); the
same configuration on a pure data-parallel mesh (4x1, with no layout rule for
heads or ff, so no model all-reduce at all) and on a pure model-parallel mesh
(1x4) must give the same loss history, since the data order and the initial
values do not depend on the mesh.
"""

import math

import numpy as np
import pytest

from examples import transformer_local as transformer

TINY = ["--d-model", "32", "--heads", "4", "--ff", "64", "--layers", "1", "--seq-len", "32",
        "--batch-size", "16", "--learning-rate", "3e-3", "--seed", "1"]
STEPS = 40
COMPARED_STEPS = 8
SPLIT = ("wq", "wk", "wv", "wo", "w_in", "b_in", "w_out")  # split over "model"; the rest is replicated


def _run(mesh, *extra, steps=COMPARED_STEPS, generate=0):
  # conftest made 8 CPUs; each mesh takes the first 4.
  return transformer.main(TINY + ["--devices", "8", "--mesh", mesh, "--steps", str(steps), "--steps-per-call", "4",
                                  "--eval-batches", "2", "--generate", str(generate), *extra])


@pytest.fixture(scope="module", name="two_by_two")
def _two_by_two():
  return _run("batch:2,model:2", steps=STEPS, generate=20)


@pytest.fixture(scope="module", name="data_parallel")
def _data_parallel():
  return _run("batch:4,model:1", "--layout", "batch:batch")  # heads and ff not split: no model all-reduce


def test_learns_on_a_2x2_mesh(two_by_two):
  result = two_by_two
  assert result["replicas"] == 4
  assert len(result["history"]) == STEPS
  assert abs(result["initial_loss"] - math.log(result["vocabulary"])) < 0.15
  assert result["final_loss"] < result["initial_loss"] - 1.0
  assert result["heldout_loss"] < result["initial_loss"] - 1.0
  # The global weights, read outside a step, give the distributed held-out loss on one device.
  np.testing.assert_allclose(result["heldout_loss_host"], result["heldout_loss"], rtol=1e-5)
  assert result["sample"].startswith("The ") and len(result["sample"]) == len("The ") + 20


def test_data_and_model_parallel_meshes_give_the_same_losses(two_by_two, data_parallel):
  model_parallel = _run("batch:1,model:4")
  reference = two_by_two["history"][:COMPARED_STEPS]
  for name, result in (("batch:4,model:1", data_parallel), ("batch:1,model:4", model_parallel)):
    np.testing.assert_allclose(result["history"], reference, rtol=1e-4, err_msg=name)
  np.testing.assert_allclose(model_parallel["heldout_loss"], data_parallel["heldout_loss"], rtol=1e-4)
  # Per block, the attention and FFN partial sums over "model" and their gradients (the gradient
  # reductions are means); without rules for heads and ff, none.
  for result, expected in ((two_by_two, 4), (model_parallel, 4), (data_parallel, 0)):
    sums = [c for c in result["collectives"] if c["axes"] == ("model",) and c["params"].get("op") == "sum"]
    assert len(sums) == expected


def test_one_device_gives_the_same_losses(data_parallel):
  # Tied embeddings: the embedding's gradient (a gather's rows plus the output
  # projection's dense gradient) is dense, all-reduced as before.
  one_device = _run("batch:1,model:1", "--layout", "batch:batch")
  np.testing.assert_allclose(data_parallel["history"], one_device["history"], rtol=1e-4)
  assert one_device["replicas"] == 1 and not one_device["collectives"]


def test_model_axis_of_2_halves_the_split_weights(two_by_two, data_parallel):
  for kind, by_device in two_by_two["bytes_by_kind"].items():
    full = data_parallel["bytes_by_kind"][kind]
    assert set(full.values()) == {full["/device:CPU:0"]}, kind  # 4 identical replicas
    expected = full["/device:CPU:0"] // 2 if kind in SPLIT else full["/device:CPU:0"]
    assert by_device == {device: expected for device in full}, kind
  total = sum(data_parallel["bytes_by_kind"][kind]["/device:CPU:0"] for kind in SPLIT)
  saved = {d: data_parallel["bytes_per_device"][d] - b for d, b in two_by_two["bytes_per_device"].items()}
  assert saved == {device: total // 2 for device in saved}
