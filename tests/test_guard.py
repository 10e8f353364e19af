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


def _record(seconds, loss=2.5):
  return dict(seconds=seconds, cpu_seconds=seconds * 0.9, loss=loss)


def test_builds_alternate_ours_and_the_peers_swapping_the_order_every_round():
  calls = []

  def run(side):
    calls.append(side)
    return len(calls)

  ours, peer = guard.alternate(run, 3)
  assert calls == ["ours", "peer", "peer", "ours", "ours", "peer"]
  assert ours == [1, 4, 5] and peer == [2, 3, 6]  # round by round: (1, 2), (4, 3), (5, 6)


def test_a_build_ratio_is_the_median_of_the_rounds_ratios_with_their_range_and_the_seconds_as_context():
  # A machine slowing down round after round: every build takes longer, the ratio of a round's two does not.
  ours = [_record(27.0), _record(32.0), _record(40.0)]
  peer = [_record(30.0), _record(40.0), _record(40.0)]
  entry = guard.build_ratio(ours, peer)
  assert abs(entry["median"] - 0.9) < 1e-9  # the rounds' ratios: 0.9, 0.8, 1.0
  assert abs(entry["ci_low"] - 0.8) < 1e-9 and abs(entry["ci_high"] - 1.0) < 1e-9 and entry["n"] == 3
  assert entry["build_s"] == dict(ours=[27.0, 32.0, 40.0], peer=[30.0, 40.0, 40.0])
  assert entry["cpu_s"]["peer"] == [27.0, 36.0, 36.0]
  assert guard.loss_mismatch(entry) == 0.0
  assert guard.loss_mismatch(guard.build_ratio([_record(1.0, 2.5)], [_record(1.0, 2.0)])) == 0.25
  # Regressions: as any ratio's, against its recorded interval widened by the builds' drift between runs (10%);
  # a build recorded in seconds (before its peer) is not compared.
  assert guard.regressed(guard.build_ratio([_record(12.0)] * 3, [_record(10.0)] * 3), entry)
  assert not guard.regressed(guard.build_ratio([_record(10.5)] * 3, [_record(10.0)] * 3), entry)
  assert not guard.regressed(entry, dict(seconds=25.9))


def test_the_table_names_targets_and_regressions():
  build = guard.build_ratio([_record(27.0), _record(32.0), _record(40.0)],
                            [_record(30.0), _record(40.0), _record(40.0)])
  entries = {"mlp_deep": dict(_ratio(0.50, 0.49, 0.50)), "build mobilenet_v2 local / MirroredStrategy": build,
             "build transformer 2x4 global / one device": guard.build_ratio([_record(3.0)], [_record(2.0)])}
  recorded = {"mlp_deep": dict(_ratio(0.41, 0.40, 0.42), commit="abc1234")}
  text = guard.table(entries, recorded)
  assert "| mlp_deep | 0.50 [0.49, 0.50] | 0.41 [0.40, 0.42] | abc1234 | <= 0.4 (NOT MET) | REGRESSED |" in text
  assert ("| build mobilenet_v2 local / MirroredStrategy | 0.90 [0.80, 1.00] (32.0 / 40.0 s) |  |  | <= 1 (met) "
          "| ok |") in text
  assert "| build transformer 2x4 global / one device | 1.50 [1.50, 1.50] (3.0 / 2.0 s) |  |  |" in text


def test_a_build_against_another_commit_compares_medians_measured_alternating():
  v = guard.build_verdict([3.1, 3.3], [3.0, 3.2])
  assert abs(v["ratio"] - 3.2 / 3.1) < 1e-9 and not v["regressed"]
  assert guard.build_verdict([3.6, 3.8], [3.1, 3.3])["regressed"]  # 3.7 / 3.2 = 1.16
  assert not guard.build_verdict([2.5, 2.7], [3.1, 3.3])["regressed"]  # faster
