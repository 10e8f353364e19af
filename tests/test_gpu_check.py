"""The GPU check (``benchmarks/gpu_check.py``): it skips cleanly without a GPU and runs its checks on logical CPUs."""

import json
import os
import subprocess
import sys

import pytest
from conftest import cpus

from benchmarks import gpu_check
from benchmarks import step_time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*flags, timeout=240):
  # CUDA_VISIBLE_DEVICES="" hides any GPU, so the skip is tested on a GPU machine too.
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT)
  return subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", *flags], cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout, env=env)


def test_without_a_gpu_it_says_so_in_one_line_writes_the_reason_and_exits_0(tmp_path):
  out = tmp_path / "skip.json"
  done = _run("--json", str(out))
  assert done.returncode == 0, done.stderr[-3000:]
  lines = [line for line in done.stdout.splitlines() if line.startswith("gpu_check: skipped")]
  assert len(lines) == 1, done.stdout
  line = lines[0]
  assert "no GPU visible to TensorFlow" in line and "4 virtual GPUs" in line and "MirroredStrategy" in line
  assert "python -m benchmarks.gpu_check" in line and "--device CPU" in line  # how to run it, there and here
  result = json.loads(out.read_text())
  assert result["skipped"] == gpu_check.NO_GPU and result["message"] == line


def test_on_logical_cpus_every_case_equals_one_device_and_is_timed_against_mirrored_strategy(tmp_path):
  out = tmp_path / "cpu.json"
  done = _run("--device", "CPU", "--virtual", "2", "--rounds", "2", "--json", str(out))
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  result = json.loads(out.read_text())
  assert result["device"] == "CPU" and result["virtual"] == 2 and result["mesh_global"] == {"batch": 1, "model": 2}
  lowerings = result["lowerings"]
  assert {name for name, e in lowerings.items() if e["status"] == "ran"} == {"collective_ops", "one_device"}
  assert lowerings["hierarchical"]["status"] == "skipped" and "worker process" in lowerings["hierarchical"]["skipped"]
  assert lowerings["nccl"]["status"] == "skipped" and "no NCCL lowering" in lowerings["nccl"]["skipped"]
  for name in ("collective_ops", "one_device"):
    cases = lowerings[name]["cases"]
    assert set(cases) == {gpu_check.ONE, gpu_check.MS, gpu_check.MS_R2OD, f"data-parallel/{name}", f"global/{name}"}
    for case_name, case in cases.items():
      assert "error" not in case, (case_name, case)
      assert case["step"]["n"] == 2 and case["step"]["median"] > 0
      assert len(case["losses"]) == gpu_check.CHECK_STEPS
    for kind in ("data-parallel", "global"):
      case = cases[f"{kind}/{name}"]
      assert case["equal_to_one_device"] and case["max_abs_param_diff_vs_one_device"] <= gpu_check.TOLERANCE
      assert all(c.endswith(f"({name})") for c in case["collectives"]), case["collectives"]  # the lowering asked for
      for base in ("/ MirroredStrategy", "/ MirroredStrategy R2OD", "/ one device", "/ MirroredStrategy best"):
        assert case["ratios"][base]["n"] == 2 and case["ratios"][base]["median"] > 0
  assert result["all_equal_to_one_device"] is True
  assert "| data-parallel/one_device | yes |" in done.stdout  # the summary table


def test_the_lowerings_it_runs_and_why_it_skips_the_others():
  plan = gpu_check.lowering_plan("CPU", ["collective_ops", "hierarchical", "one_device"])
  assert plan["collective_ops"] is None and plan["one_device"] is None
  assert "worker process" in plan["hierarchical"] and "no NCCL lowering" in plan["nccl"]
  with_nccl = ["collective_ops", "nccl", "one_device"]
  assert "no CPU kernel" in gpu_check.lowering_plan("CPU", with_nccl)["nccl"]
  assert gpu_check.lowering_plan("GPU", with_nccl) == {"collective_ops": None, "nccl": None, "one_device": None}


def test_a_failing_case_is_recorded_and_the_others_still_run_and_are_timed():
  record = gpu_check.measure_lowering("CPU", cpus(2), "no_such_lowering", rounds=2, budget_seconds=5)
  cases = record["cases"]
  for kind in ("data-parallel", "global"):
    assert "Unknown collective implementation 'no_such_lowering'" in cases[f"{kind}/no_such_lowering"]["error"]
  for name in (gpu_check.ONE, gpu_check.MS, gpu_check.MS_R2OD):
    assert "error" not in cases[name] and cases[name]["step"]["n"] == 2


def test_the_check_sees_a_sum_for_a_mean():
  # The tolerance is far below what a wrong reduction leaves: the optimizer (SGD) is linear in the gradients.
  import keras
  spec = gpu_check.model_spec()
  keras.utils.set_random_seed(0)
  weights = spec.build().get_weights()
  x, y = spec.batch()
  one = step_time.single_device(spec, weights, x, y, make_optimizer=gpu_check.optimizer)
  wrong = step_time.ours(spec, weights, x, y, cpus(2), make_optimizer=gpu_check.optimizer, reduction="sum")
  for _ in range(gpu_check.CHECK_STEPS):
    one.call()
    wrong.call()
  reference = [v.numpy() for v in one.model.trainable_variables]
  assert gpu_check._difference(wrong, reference) > 100 * gpu_check.TOLERANCE  # pylint: disable=protected-access


@pytest.mark.parametrize("flags, expected", [(["--rounds", "0"], "expected a positive number of timed rounds"),
                                             (["--virtual", "3"], "invalid choice")])
def test_wrong_flags_say_what_was_expected(flags, expected, capsys):
  with pytest.raises(SystemExit):
    gpu_check.parse(flags)
  assert expected in capsys.readouterr().err


def test_a_lowering_whose_child_cannot_make_its_devices_is_recorded_as_failed(monkeypatch):
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU for the child, even on a GPU machine
  args = gpu_check.parse(["--device", "GPU", "--virtual", "2"])
  record = gpu_check.run_child("one_device", args, timeout=120)
  assert record["status"] == "failed"
  assert "expected a GPU, found none" in record["error"] and "Fix: run on a GPU machine" in record["error"]
  row = gpu_check.summary(dict(lowerings={"one_device": record}))
  assert "| one_device | failed: making 2 virtual GPUs failed (the JSON says more) |" in row
