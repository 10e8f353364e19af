"""``replicator.calibrate``: the machine's rates for the cost model, measured once and cached."""

import math
import os

import pytest
from conftest import cpus

import replicator
from replicator.views import _calibration


def test_calibration_measures_rates_and_reads_them_back_from_its_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("REPLICATOR_CACHE", str(tmp_path))
  machine = replicator.calibrate(cpus(4))
  assert machine.devices == 4 and 1.0 <= machine.parallel_devices <= 4.0
  for rate in (machine.flops_per_second, machine.bytes_per_second, machine.collective_bytes_per_second):
    assert math.isfinite(rate) and rate > 0
  assert 0 < machine.op_seconds < 1e-3 and 0 <= machine.collective_seconds < 1e-2
  assert set(machine.collectives) == {"all_reduce", "all_gather", "all_to_all", "reduce_scatter"}  # each kind's own
  for fixed, rate in machine.collectives.values():
    assert 0 <= fixed < 1e-2 and math.isfinite(rate) and rate > 0
  assert machine.collective("all_reduce") == (machine.collective_seconds, machine.collective_bytes_per_second)
  assert machine.collective("broadcast") == machine.collective("all_reduce")  # not measured: as an all-reduce
  (kept,) = os.listdir(tmp_path)
  assert kept.startswith("machine-") and kept.endswith(".json")

  def measured(*_):
    raise AssertionError("measured again")

  monkeypatch.setattr(_calibration, "_seconds", measured)
  assert replicator.calibrate(cpus(4)) == machine  # read back, not measured
  with pytest.raises(AssertionError, match="measured again"):
    replicator.calibrate(cpus(2))  # other devices: another measurement
  with pytest.raises(AssertionError, match="measured again"):
    replicator.calibrate(cpus(4), cache=False)
