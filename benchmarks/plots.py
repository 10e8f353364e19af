"""PNG plots of the three parts (matplotlib, headless)."""

from __future__ import annotations

import os

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import build_cost  # noqa: E402
from benchmarks import step_time  # noqa: E402
from benchmarks import throughput  # noqa: E402


def step_times(records: list[dict], path: str) -> None:
  """One panel per model: median step time per configuration, IQR as error bars."""
  fig, axes = plt.subplots(1, len(records), figsize=(4 * len(records), 4), squeeze=False)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for ax, rec in zip(axes[0], records):
    stats = [rec["stats"][name] for name in step_time.CONFIGS]
    medians = np.array([s["median"] for s in stats]) * 1e3
    errors = np.array([[s["median"] - s["q1"], s["q3"] - s["median"]] for s in stats]).T * 1e3
    ax.bar(range(len(medians)), medians, yerr=errors, color=colors[:len(medians)], capsize=3)
    ax.set_xticks(range(len(medians)), [c.replace("MirroredStrategy", "MS").replace(" ", "\n", 1)
                                        for c in step_time.CONFIGS], fontsize=7)
    ax.set_title(f"{rec['model']} (batch {rec['global_batch']})", fontsize=9)
    ax.set_ylabel("ms per step (median, IQR)")
  fig.suptitle(f"Step time on {len(records[0]['devices'])} logical CPUs")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def build_times(result: dict, path: str) -> None:
  """First-call time vs replicas, both frameworks, log-log with a linear reference."""
  fig, ax = plt.subplots(figsize=(6, 4.5))
  for name, marker in ((build_cost.OURS, "o"), (build_cost.MS, "s")):
    medians = result["summary"][name]["first_call_median_s"]
    if not medians:
      continue
    ns = [int(n) for n in medians]
    ax.plot(ns, list(medians.values()), marker=marker, label=name)
  ours = result["summary"][build_cost.OURS]["first_call_median_s"]
  if ours:
    n0, t0 = min((int(n), t) for n, t in ours.items())
    ns = np.array(sorted(int(n) for n in ours))
    ax.plot(ns, t0 * ns / n0, ":", color="gray", label="linear from ours at smallest n")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
  ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
  ax.set_xlabel("replicas")
  ax.set_ylabel("first call: seconds to first result")
  ax.set_title(f"Build cost ({result['model']})")
  ax.legend()
  ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def bus_bandwidth(result: dict, path: str) -> None:
  """busbw vs size: one panel per device count, a line per (collective, implementation)."""
  counts = sorted({r["devices"] for r in result["rows"]})
  limit = result["memcpy"][result["memcpy"]["physical_limit"]]["bytes_per_s"] / 1e9
  fig, axes = plt.subplots(1, len(counts), figsize=(6.5 * len(counts), 4.5), squeeze=False, sharey=True)
  for ax, n in zip(axes[0], counts):
    for kind, color in zip(throughput.KINDS, ("tab:blue", "tab:green", "tab:purple")):
      for impl, style in zip(throughput.IMPLEMENTATIONS, ("-o", "--s")):
        rows = sorted((r for r in result["rows"] if r["devices"] == n and r["kind"] == kind
                       and r["implementation"] == impl), key=lambda r: r["size"])
        if rows:
          ax.plot([r["size"] for r in rows], [r["busbw"] / 1e9 for r in rows], style, color=color, markersize=3,
                  label=f"{kind} {impl}")
          sizes = [r["size"] for r in rows]
    ax.axhline(limit, color="black", linewidth=1, label=f"memcpy ({result['memcpy']['physical_limit']})")
    ax.axhline(limit / 2, color="black", linewidth=0.6, linestyle=":", label="50% of memcpy")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [throughput.human(x) for x in sizes], fontsize=7)
    ax.set_yscale("log")
    ax.set_xlabel("size per replica (all_gather: output size)")
    ax.set_ylabel("busbw GB/s")
    ax.set_title(f"{n} logical CPUs")
    ax.grid(True, which="both", alpha=0.3)
  axes[0][-1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def save_all(results: dict, directory: str) -> list[str]:
  """Writes the plots of whichever parts ran; returns their paths."""
  os.makedirs(directory, exist_ok=True)
  paths = []
  for key, fn, name in (("step_time", step_times, "step_time.png"), ("build_cost", build_times, "build_cost.png"),
                        ("throughput", bus_bandwidth, "throughput.png")):
    if results.get(key):
      paths.append(os.path.join(directory, name))
      fn(results[key], paths[-1])
  return paths
