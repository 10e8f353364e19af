"""The memory benchmark (``benchmarks/memory.py``) runs in its smallest configuration, and its figures move as they must."""

from conftest import cpus

import mesh
import replicator
from benchmarks import memory


def _figures(result, variant):
  return [(d["variable_bytes"], d["saved_bytes"], d["peak_bytes"]) for d in result["variants"][variant]["devices"]]


def test_the_memory_benchmark_runs_quick_on_one_device_and_on_a_2x2_megatron_mesh():
  one = memory.measure("mlp, 1 device", "mlp", memory.SIZES["mlp"][1],
                       lambda: replicator.Replicator(devices=cpus(1)), rounds=2)
  m = mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4))
  megatron = memory.measure("transformer, 2x2", "transformer", memory.SIZES["transformer"][1],
                            lambda: replicator.Replicator(mesh=m, view="global", batch_axes=("batch",)), rounds=2,
                            layouts=memory.MEGATRON, global_view=True)
  for result, devices in ((one, 1), (megatron, 4)):
    plain, remat = _figures(result, "plain"), _figures(result, "remat")
    assert len(plain) == len(remat) == devices
    assert [p[0] for p in plain] == [r[0] for r in remat]  # the same variables and slots
    assert all(r[1] < p[1] for p, r in zip(plain, remat))  # less saved for backward
    variants = result["variants"].values()
    assert all(len(v["step_seconds"]) == 2 and len(v["measured_peak_bytes"]) == 5 for v in variants)
    losses = [v["loss_after_build"] for v in variants]
    assert abs(losses[0] - losses[1]) <= 1e-6 * abs(losses[0])  # remat computes the plain step
  rows = memory.rows([one, megatron])
  assert len(rows) == 2 * 1 + 2 * 4 and all(len(row) == len(memory.HEADER) for row in rows)
