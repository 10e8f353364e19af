"""The pipeline bubble benchmark (``benchmarks/pipeline_bubble.py``) at a small size: its timelines show the schedules.

Timings on a loaded 2-core machine are not checked; what the timeline must show whatever the load is: every pass
of each device, in its schedule's order (each pass waits for the one before it on the device), GPipe's forward
passes all ended before its first backward pass, 1F1B's first stage starting a backward pass before its last
forward pass, and idle fractions between 0 and 1.
"""

import pytest

from benchmarks import pipeline_bubble

P, M = 2, 4
ORDERS = {  # each device's passes, as the schedules' definitions give them (docs/concepts/stages.md)
    "gpipe": [["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]] * 2,
    "1f1b": [["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"], ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]],
}


@pytest.fixture(scope="module", params=sorted(ORDERS))
def recorded(request):
  return request.param, pipeline_bubble.measure(P, M, request.param, width=32, depth=2, rows=4, steps=1, warmup=1)


def test_each_device_runs_its_passes_in_the_schedules_order(recorded):
  schedule, record = recorded
  (step,) = record["timelines"]
  assert [[f"{kind}{j}" for kind, j, _, _ in device] for device in step["passes"]] == ORDERS[schedule]
  first_stage = {f"{kind}{j}": (start, end) for kind, j, start, end in step["passes"][0]}
  last_forward = max(start for name, (start, _) in first_stage.items() if name[0] == "F")
  first_backward = min(start for name, (start, _) in first_stage.items() if name[0] == "B")
  if schedule == "gpipe":  # every forward pass ended before the first backward pass started
    assert all(end <= first_backward for kind, _, _, end in step["passes"][0] if kind == "F")
  else:  # 1F1B: a backward pass started before the last forward pass
    assert first_backward < last_forward


def test_the_idle_fractions_are_fractions_of_the_span_and_the_formula_the_bubble(recorded):
  _, record = recorded
  (step,) = record["timelines"]
  assert len(record["idle"]) == P and all(0 <= i < 1 for i in record["idle"])
  assert all(0 < b <= step["span_ms"] for b in step["busy_ms"])
  assert record["bubble"] == pytest.approx(1 / 5)


def test_busy_time_is_the_union_of_the_intervals():
  assert pipeline_bubble.busy([(0, 2), (1, 3), (5, 6), (5.5, 5.6)]) == 4
  assert pipeline_bubble.busy([]) == 0


def test_the_interleaved_schedule_s_bubble_and_passes():
  # 2 stages a device (each half the depth): the formula (p - 1) / (v m + p - 1) = 1 / 9; each device runs a forward
  # and a backward pass of each of its 2 stages for each of the 4 microbatches (its 8 calls of a stage in the
  # trace: mb, mb_1, ..., mb_7).
  record = pipeline_bubble.measure(P, M, "interleaved", width=32, depth=2, rows=4, steps=1, warmup=1)
  (step,) = record["timelines"]
  assert record["bubble"] == pytest.approx(1 / 9)
  assert len(record["idle"]) == P and all(0 <= i < 1 for i in record["idle"])
  for device in step["passes"]:
    assert sorted(f"{kind}{j}" for kind, j, _, _ in device) == sorted(f"{k}{j}" for k in "FB" for j in range(8))
