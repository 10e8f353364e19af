"""Interleaved timing and robust summaries (medians and interquartile ranges).

Timings on a shared 2-core machine drift (thermal, other processes), so
configurations are never timed one after the other: every round calls each
configuration once, in an order shuffled from round to round (seeded), and
the summary is the median with its interquartile range. (A rotated order keeps
each configuration's neighbours fixed; a configuration that always ran right
after another was measured 1-3% slow against neutral variants.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence

import numpy as np


def interleaved(calls: Mapping[str, Callable[[], object]], rounds: int, warmup: int = 2,
                per_call: Mapping[str, int] | None = None, every: Mapping[str, int] | None = None,
                budget_seconds: float | None = None) -> dict[str, list[float]]:
  """Times ``calls`` in rounds (each in a new shuffled order); returns seconds per step of every timed call, by name.

  Args:
    calls: name -> a function that runs (and waits for) one call.
    rounds: timed rounds; each round calls every function once.
    warmup: untimed rounds first (the first call of a step builds it).
    per_call: name -> steps one call runs (time per call is divided by it).
    every: name -> call it only every k-th round (for calls that run many steps).
    budget_seconds: stop early (after at least 5 timed rounds) once the
      timed rounds have taken this long.
  """
  names = list(calls)
  order = np.random.default_rng(0)
  per_call, every = per_call or {}, every or {}
  for _ in range(warmup):
    for name in names:
      calls[name]()
  times: dict[str, list[float]] = {name: [] for name in names}
  start = time.perf_counter()
  for r in range(rounds):
    for i in order.permutation(len(names)):  # neither position nor neighbours fixed
      name = names[i]
      if r % every.get(name, 1):
        continue
      t0 = time.perf_counter()
      calls[name]()
      times[name].append((time.perf_counter() - t0) / per_call.get(name, 1))
    if budget_seconds is not None and r >= 4 and time.perf_counter() - start > budget_seconds:
      break
  return times


def timed(fn: Callable[[], object]) -> tuple[float, object]:
  """``(seconds, result)`` of one call."""
  t0 = time.perf_counter()
  result = fn()
  return time.perf_counter() - t0, result


def summary(samples) -> dict[str, float]:
  """Median, quartiles, IQR, min and count of ``samples`` (seconds)."""
  a = np.asarray(samples, dtype=np.float64)
  q1, median, q3 = np.percentile(a, [25, 50, 75])
  return dict(median=float(median), q1=float(q1), q3=float(q3), iqr=float(q3 - q1), min=float(a.min()), n=int(a.size))


def paired_ratio(numerator, denominator, resamples: int = 2000, seed: int = 0) -> dict[str, float]:
  """Round-by-round ratios of two configurations timed in the same rounds.

  ``numerator[i]`` and ``denominator[i]`` come from round ``i`` of
  :func:`interleaved`, so machine drift between rounds cancels in their ratio.
  Returns the median ratio, its quartiles, and a 95% bootstrap interval of the
  median (``ci_low``, ``ci_high``) -- how far the median could move on a rerun.
  """
  a, b = np.asarray(numerator, np.float64), np.asarray(denominator, np.float64)
  if a.size != b.size:
    raise ValueError(f"paired_ratio needs one sample per round from each; got {a.size} and {b.size}.")
  r = a / b
  q1, median, q3 = np.percentile(r, [25, 50, 75])
  rng = np.random.default_rng(seed)
  medians = np.median(r[rng.integers(0, r.size, size=(resamples, r.size))], axis=1)
  low, high = np.percentile(medians, [2.5, 97.5])
  return dict(median=float(median), q1=float(q1), q3=float(q3), ci_low=float(low), ci_high=float(high),
              n=int(r.size))


def interval(p: dict[str, float]) -> str:
  """A :func:`paired_ratio` as text: ``0.51 [0.49, 0.53]``."""
  return f"{p['median']:.2f} [{p['ci_low']:.2f}, {p['ci_high']:.2f}]"


def ms(seconds: float) -> str:
  """Seconds as a short millisecond string: 0.62 ms, 20.7 ms, 148 ms."""
  v = seconds * 1e3
  return f"{v:.3g} ms" if v < 100 else f"{v:.0f} ms"


def table(header: list[str], rows: list[list[object]], align: str | None = None) -> str:
  """A markdown table; ``align`` has one character per column (l or r, default r but the first)."""
  align = align or "l" + "r" * (len(header) - 1)
  cells = [[str(c) for c in row] for row in rows]
  lines = ["| " + " | ".join(header) + " |",
           "|" + "|".join(":---" if a == "l" else "---:" for a in align) + "|"]
  lines += ["| " + " | ".join(row) + " |" for row in cells]
  return "\n".join(lines)


def save_json(results, path: str | None) -> None:
  """Writes ``results`` to ``path`` (``--json``), if given."""
  if path:
    with open(path, "w", encoding="utf-8") as f:
      json.dump(results, f, indent=1)


def fresh_builds(module: str, children: Mapping[str, Sequence[str]], rounds: int) -> dict[str, list[float]]:
  """``{name: [build seconds a round]}``: ``python -m module --child *args`` for each of ``children`` in a fresh
  process, ``rounds`` times, the order reversed every other round (a machine's speed drifts; neighbours' ratio not).

  Each child prints a JSON object with ``build_s`` on its last line.
  """
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  builds = {name: [] for name in children}
  for r in range(rounds):
    for name in (list(children) if r % 2 == 0 else list(children)[::-1]):
      out = subprocess.run([sys.executable, "-m", module, "--child", *children[name]], capture_output=True,
                           text=True, check=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"), cwd=root)
      builds[name].append(json.loads(out.stdout.strip().splitlines()[-1])["build_s"])
  return builds


def round_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
  """The ratio of each round's two builds, sorted (its median: the middle one)."""
  return sorted(a / b for a, b in zip(numerators, denominators))
