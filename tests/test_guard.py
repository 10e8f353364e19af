"""The benchmark guard's verdicts (``benchmarks/guard.py``): what counts as a regression, what the table says."""

from benchmarks import guard


def _ratio(median, low, high):
  return dict(median=median, ci_low=low, ci_high=high)


def test_a_ratio_regresses_only_when_worse_beyond_both_intervals_and_the_drift_between_runs():
  recorded = _ratio(0.41, 0.40, 0.42)
  assert not guard.regressed(_ratio(0.42, 0.41, 0.43), recorded)  # inside the recorded interval
  assert not guard.regressed(_ratio(0.45, 0.43, 0.46), recorded)  # above it, but within the drift (3%)
  assert guard.regressed(_ratio(0.50, 0.49, 0.50), recorded)
  assert guard.regressed(_ratio(0.45, 0.44, 0.46), recorded)
  assert not guard.regressed(_ratio(0.30, 0.29, 0.31), recorded)  # better
  assert not guard.regressed(_ratio(0.9, 0.8, 1.0), None)  # nothing recorded yet


def test_a_build_regresses_beyond_its_tolerance():
  assert not guard.regressed(dict(seconds=28.0), dict(seconds=26.0))  # within 10%
  assert guard.regressed(dict(seconds=29.0), dict(seconds=26.0))


def test_the_table_names_targets_and_regressions():
  entries = {"mlp_deep": dict(_ratio(0.50, 0.49, 0.50)), "build mobilenet_v2 local": dict(seconds=25.9)}
  recorded = {"mlp_deep": dict(_ratio(0.41, 0.40, 0.42), commit="abc1234")}
  text = guard.table(entries, recorded)
  assert "| mlp_deep | 0.50 [0.49, 0.50] | 0.41 [0.40, 0.42] | abc1234 | <= 0.4 (NOT MET) | REGRESSED |" in text
  assert "| build mobilenet_v2 local | 25.9 s |  |  | <= 27.3 (met) | ok |" in text


def test_a_build_against_another_commit_compares_medians_measured_alternating():
  v = guard.build_verdict([3.1, 3.3], [3.0, 3.2])
  assert abs(v["ratio"] - 3.2 / 3.1) < 1e-9 and not v["regressed"]
  assert guard.build_verdict([3.6, 3.8], [3.1, 3.3])["regressed"]  # 3.7 / 3.2 = 1.16
  assert not guard.build_verdict([2.5, 2.7], [3.1, 3.3])["regressed"]  # faster
