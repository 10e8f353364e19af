"""rewrite.fuse: independent all-reduces across processes become one; dependent ones stay apart.

The step here is traced on a 2-task job's device names (no processes: the
graph is only built) with ``rewrite.emit`` placeholders, as the global view's
expansion leaves them. What the fused graph computes is checked by running it
with its devices mapped to this process's CPUs and the in-graph lowering; the
multi-client tests (tests/test_multi_client.py) run it across processes.
"""

import dataclasses

import numpy as np
import tensorflow as tf
from conftest import cpus

import mesh
import rewrite

DEVICES = tuple(f"/job:worker/replica:0/task:{t}/device:CPU:0" for t in range(2))


class JobMesh:
  """A mesh's groups over the job's device names (a real Mesh checks that its devices are this process's)."""

  def __init__(self):
    self._mesh = mesh.Mesh({"worker": 2}, cpus(2))
    self.size, self.devices = 2, DEVICES

  def groups(self, axes):
    return self._mesh.groups(axes)


def _step(ops=("sum", "sum", "sum"), depends=True):
  """Per replica: a = all_reduce(x), b = all_reduce(2x) (independent of a), c = all_reduce(a + 1) if ``depends``
  (else of x + 1), with ``ops`` as their ops; returns the three results' sum, its graph and the records."""
  records = [[], []]

  def fn(x, y):
    outs = []
    for r in range(2):
      with tf.device(DEVICES[r]):
        x_r = x * float(r + 1)
        y_r = y * float(r + 1)

        def emit(t, i, op, r=r):
          result, record = rewrite.emit(t, replica=r, index=i, kind="all_reduce", params={"op": op},
                                        axes=("worker",), result_shape=t.shape, device=DEVICES[r],
                                        location=f"line {i}", call=f"call {i}")
          records[r].append(record)
          return result

        a = emit(x_r, 0, ops[0])
        b = emit(2.0 * y_r, 1, ops[1])
        c = emit((a if depends else x_r) + 1.0, 2, ops[2])
        outs.append(tf.reduce_sum(a) + tf.reduce_sum(b) * 10.0 + tf.reduce_sum(c) * 100.0)
    return outs

  concrete = tf.function(fn).get_concrete_function(tf.TensorSpec([3], tf.float32), tf.TensorSpec([2, 2], tf.float32))
  return concrete, records


def _plan(records):
  return rewrite.plan(records, JobMesh(), lambda c: "collective_ops")


def _run_locally(graph_def, plan, concrete, x, y):
  """The fused step, its devices this process's CPUs and its collectives in-graph: each replica's result."""
  local = dict(zip(DEVICES, cpus(2)))
  mapped = tf.compat.v1.GraphDef()
  mapped.CopyFrom(graph_def)
  for node in mapped.node:
    node.device = local.get(node.device, node.device)
  collectives = []
  for c in plan.collectives:
    members = tuple(dataclasses.replace(m, device=local[m.device]) for m in c.members)
    collectives.append(dataclasses.replace(c, members=members, devices=tuple(local[d] for d in c.devices),
                                           implementation="one_device"))
  local_plan = rewrite.Plan(collectives=tuple(collectives), devices=tuple(cpus(2)))
  rewritten = rewrite.apply(mapped, local_plan)
  inputs = [t.name for t in concrete.inputs]
  outputs = [rewritten.output_name(t.name) for t in concrete.outputs]

  def call(x, y):
    return tf.graph_util.import_graph_def(rewritten.graph_def, input_map=dict(zip(inputs, (x, y))),
                                          return_elements=outputs)

  return [float(v) for v in tf.function(call)(x, y)]


def test_independent_all_reduces_become_one_and_a_dependent_one_stays_after_it():
  concrete, records = _step()
  plan = _plan(records)
  graph_def, fused = rewrite.fuse(concrete.graph.as_graph_def(), plan)
  assert [c.index for c in fused.collectives] == [0, 1]
  first, second = fused.collectives
  assert first.shape.as_list() == [3 + 4] and first.kind == "all_reduce" and first.param_dict == {"op": "sum"}
  assert all("fused_all_reduce" in m.node for m in first.members)
  assert second.members == plan.collectives[2].members  # c reads a's result: not fused, after the bucket
  # The members' placeholders are their pieces of the fused result now: their consumers are unchanged.
  nodes = {n.name: n for n in graph_def.node}
  for c in plan.collectives[:2]:
    for m in c.members:
      assert nodes[m.node].op == "Identity"
  order = [n.name for n in graph_def.node]
  for r in range(2):  # the fused op comes before what reads a's result (c's input), per replica
    assert order.index(first.members[r].node) < order.index(plan.collectives[2].members[r].node)
  x = tf.constant([1.0, 2.0, 3.0])
  y = tf.constant([[1.0, -1.0], [0.5, 2.0]])
  # By hand: replica r holds x*(r+1), 2y*(r+1); the sums over the 2 replicas are 3x, 6y, and c = sum(3x + 1).
  a, b = 3 * x.numpy(), 6 * y.numpy()
  expected = a.sum() + b.sum() * 10 + (2 * (a + 1)).sum() * 100
  found = _run_locally(graph_def, fused, concrete, x, y)
  np.testing.assert_allclose(found, [expected, expected], rtol=1e-6)
  unfused = _run_locally(concrete.graph.as_graph_def(), plan, concrete, x, y)
  np.testing.assert_allclose(found, unfused, rtol=1e-6)


def test_all_three_fuse_when_none_depends_on_another():
  concrete, records = _step(depends=False)
  _, fused = rewrite.fuse(concrete.graph.as_graph_def(), _plan(records))
  assert [c.shape.as_list() for c in fused.collectives] == [[3 + 4 + 3]]


def test_a_large_bucket_is_two_the_values_made_first_reduced_first(monkeypatch):
  """With OVERLAP_BYTES at 8 bytes, the three independent all-reduces (12, 16 and 12 bytes a replica) are two: the
  first two (28 bytes, half or more of the 40) before the third; the same results as unfused."""
  monkeypatch.setattr(rewrite._fusion, "OVERLAP_BYTES", 8)  # pylint: disable=protected-access
  concrete, records = _step(depends=False)
  plan = _plan(records)
  graph_def, fused = rewrite.fuse(concrete.graph.as_graph_def(), plan)
  assert [c.shape.as_list() for c in fused.collectives] == [[3 + 4], [3]]
  x = tf.constant([1.0, 2.0, 3.0])
  y = tf.constant([[1.0, -1.0], [0.5, 2.0]])
  np.testing.assert_allclose(_run_locally(graph_def, fused, concrete, x, y),
                             _run_locally(concrete.graph.as_graph_def(), plan, concrete, x, y), rtol=1e-6)


def test_overlap_split_takes_half_the_bytes_first_and_keeps_small_buckets_whole():
  mb = 1 << 20
  assert rewrite.overlap_split([1024, 4 * mb, 16384, 4 * mb]) == 3  # a wide MLP's gradients, in backward order
  assert rewrite.overlap_split([4 * mb, 4 * mb]) == 1
  assert rewrite.overlap_split([8 * mb, 1024]) == 1  # at least one value left for the second part
  assert rewrite.overlap_split([64 * 1024] * 16) == 16  # 1 MB: one all-reduce
  assert rewrite.overlap_split([8 * mb]) == 1


def test_what_does_not_fuse_stays_as_planned():
  concrete, records = _step(ops=("sum", "max", "sum"), depends=False)
  graph_def = concrete.graph.as_graph_def()
  _, fused = rewrite.fuse(graph_def, _plan(records))  # another op: its own bucket; the two sums fuse
  assert [(c.param_dict["op"], c.shape.as_list()) for c in fused.collectives] == [("max", [2, 2]), ("sum", [6])]
  plan = _plan(_step(depends=False)[1])
  same_def, same = rewrite.fuse(graph_def, plan, bucket_bytes=4 * 3)  # a bucket of one all-reduce's bytes
  assert same is plan and same_def is graph_def
  local_records = [[dataclasses.replace(m, device=d) for m in rs] for rs, d in zip(records, cpus(2))]
  local = rewrite.plan(local_records, mesh.Mesh({"worker": 2}, cpus(2)), lambda c: "collective_ops")
  assert rewrite.fuse(graph_def, local)[1] is local  # one process: no round trip to save


def test_the_scale_study_builds_one_process_part_with_its_collectives_fused():
  from benchmarks import scale
  row = scale.measure(2)  # process 0 of 2 workers x 8: 16 devices, 8 of them its own
  assert (row["devices"], row["local_replicas"]) == (16, 8)
  assert (row["collectives_planned"], row["collectives_run"]) == (33, 1)
  assert row["cross_process_ops"] == 1 and row["group_sizes"] == [2]  # one op, on this process's leader device
