"""A multi-client job's process plans and lowers only its own replicas' part (rewrite, no processes).

Each process traces its own replicas; the plan matches their placeholders
against the job-wide groups, and the lowering builds only this process's
members' ops, with keys that another process, building the other members,
computes alike. Here two "processes" are simulated in one: each half of a
4-replica trace is planned and lowered alone, and the two halves' ops must
form one group (sizes and keys equal). That they then meet at run time is
tests/test_multi_client.py's, with real processes.
"""

import pytest
import tensorflow as tf
from conftest import cpus

import mesh
import rewrite

DEVICES = tuple(f"/job:worker/replica:0/task:{t}/device:CPU:{d}" for t in range(2) for d in range(2))
SAME = lambda s: s  # noqa: E731


class JobMesh:
  """A mesh's groups over the job's device names (a real Mesh checks that its devices are this process's)."""

  def __init__(self, axes):
    self._mesh = mesh.Mesh(axes, cpus(4))
    self.size, self.devices = 4, DEVICES

  def groups(self, axes):
    return self._mesh.groups(axes)


MESH = JobMesh({"worker": 2, "device": 2})


def traced(n, kinds, axes=("worker", "device")):
  """A function with one placeholder per (kind, params) per replica, each replica on its job device."""
  records = [[] for _ in range(n)]

  def fn(x):
    outs = []
    for r in range(n):
      with tf.device(DEVICES[r]):
        h = x * float(r + 1)
        for i, (kind, params, shape) in enumerate(kinds):
          y, rec = rewrite.emit(h, replica=r, index=i, kind=kind, params=params, axes=axes,
                                result_shape=shape(h.shape), device=DEVICES[r], location="here", call=f"call {i}")
          records[r].append(rec)
          h = y + 0.0
        outs.append(h)
    return outs

  return tf.function(fn).get_concrete_function(tf.TensorSpec([2], tf.float32)), records


def _half(task: int, kinds, lowering):
  """Plan and lowering of worker ``task``'s replicas only: the collective ops' (group, instance, size) keys."""
  concrete, records = traced(4, kinds)
  mine = [records[r] if r // 2 == task else None for r in range(4)]
  plan = rewrite.plan(mine, MESH, lambda c: lowering.name)
  rewritten = rewrite.apply(concrete.graph.as_graph_def(), plan, {lowering.name: lowering})
  consts = {n.name: n for n in rewritten.graph_def.node if n.op == "Const"}

  def value(ref):
    node = consts[ref.split(":")[0]]
    return tf.make_ndarray(node.attr["value"].tensor).item()

  ops = [n for n in rewritten.graph_def.node if n.op.startswith("Collective")]
  first = lambda n: 0 if n.op == "CollectiveBcastRecvV2" else 1  # noqa: E731  (a receive has no input value)
  return plan, [(n.op, n.device, *(value(n.input[first(n) + k]) for k in range(3))) for n in ops]


@pytest.mark.parametrize("name", ["collective_ops", "hierarchical"])
def test_each_process_builds_its_members_and_both_halves_agree_on_keys(name, monkeypatch):
  # The ordering tokens are variables on the members' devices: here, where no job's devices exist, on this CPU.
  monkeypatch.setattr(rewrite.CollectiveOps, "external_value", lambda self, key: tf.Variable(0.0).handle)
  kinds = [("all_reduce", {"op": "sum"}, SAME), ("broadcast", {"source": 3}, SAME)]
  halves = []
  for task in (0, 1):
    lowering = rewrite.CollectiveOps(5.0, agreed_keys=True) if name == "collective_ops" else \
        rewrite.Hierarchical(5.0, agreed_keys=True)
    plan, ops = _half(task, kinds, lowering)
    assert [m is not None for m in plan.collectives[0].members] == [r // 2 == task for r in range(4)]
    assert plan.collectives[0].devices == DEVICES
    assert all(f"/task:{task}/" in device for _, device, *_ in ops)  # this process's devices only
    halves.append(ops)
  # collective_ops: one op per member device (2 here, of a group of 4); hierarchical: one per task leader.
  per_half = 2 if name == "collective_ops" else 1
  assert [len(h) for h in halves] == [per_half * 2] * 2  # two collectives
  for (op0, _, size0, group0, instance0), (op1, _, size1, group1, instance1) in zip(halves[0], halves[1]):
    assert (op0, size0, group0, instance0) == (op1, size1, group1, instance1)
    assert size0 == (4 if name == "collective_ops" else 2)
  instances = {i for _, _, _, _, i in halves[0]}
  assert len(instances) == 2  # one key per collective, not per member


@pytest.mark.parametrize("permute", ["pairs", "gather"])
def test_a_permute_across_processes_is_a_send_and_a_receive_for_each_pair(permute, monkeypatch):
  # Replicas 1 -> 2 (device 1 of worker 0 to device 0 of worker 1) and 3 -> 0 over the 4 replicas: with pairs,
  # each half builds a send for its source and a receive for its destination, two-member groups whose keys the
  # halves agree on, and nothing on the replicas of no pair; the gather (kept to compare) is a group of all 4.
  monkeypatch.setattr(rewrite.CollectiveOps, "external_value", lambda self, key: tf.Variable(0.0).handle)
  halves = []
  for task in (0, 1):
    _, ops = _half(task, [("permute", {"perm": ((1, 2), (3, 0))}, SAME)],
                   rewrite.CollectiveOps(5.0, agreed_keys=True, permute=permute))
    halves.append(ops)
  if permute == "gather":
    assert [[(op, size) for op, _, size, _, _ in h] for h in halves] == [[("CollectiveGatherV2", 4)] * 2] * 2
    return
  by_device = {device: (op, size, group, instance) for h in halves for op, device, size, group, instance in h}
  assert [by_device[d][0] for d in DEVICES] == ["CollectiveBcastRecvV2", "CollectiveBcastSendV2",
                                                "CollectiveBcastRecvV2", "CollectiveBcastSendV2"]
  assert all(size == 2 for _, size, _, _ in by_device.values())
  pair = lambda a, b: (by_device[DEVICES[a]][2:], by_device[DEVICES[b]][2:])  # noqa: E731
  (one, two), (three, zero) = pair(1, 2), pair(3, 0)
  assert one == two and three == zero and one != three  # each pair's (group, instance) keys agree, pairs differ


def test_keys_depend_on_what_the_processes_share_not_on_build_order():
  keys = rewrite.AgreedKeys()
  other = rewrite.AgreedKeys()
  other.group_key(DEVICES[:2])  # another process built something else first
  assert keys.group_key(DEVICES) == other.group_key(DEVICES)
  assert keys.group_key(DEVICES) != keys.group_key(DEVICES[:2])
  assert keys.named_key(7, "initial value #0") == other.named_key(7, "initial value #0") != \
      keys.named_key(7, "initial value #1")
  assert all(2**30 <= k < 2**31 for k in (keys.group_key(DEVICES), keys.named_key(7, "x")))


def test_a_hash_collision_is_a_named_error_not_a_wrong_shape_at_run_time(monkeypatch):
  keys = rewrite.AgreedKeys()
  monkeypatch.setattr(rewrite.AgreedKeys, "_LOW", 1)  # every key 1 + h % 1 = 1: the next two collide
  keys.named_key(3, "all_reduce of float32[2]")
  with pytest.raises(rewrite.RewriteError, match=r"drew the same collective key 1 .*all_reduce of float32\[2\].*"
                                                 r"all_gather of int32\[5\]"):
    keys.named_key(3, "all_gather of int32[5]")


def test_a_lowering_that_builds_whole_groups_refuses_a_group_across_processes():
  concrete, records = traced(4, [("all_reduce", {"op": "sum"}, SAME)], axes=("replica",))
  plan = rewrite.plan([records[0], records[1], None, None], JobMesh({"replica": 4}), lambda c: "one_device")
  with pytest.raises(rewrite.RewriteError, match=r"spans processes, and lowering 'one_device' builds whole groups "
                                                 r"only\. Fix: use implementation='auto'"):
    rewrite.apply(concrete.graph.as_graph_def(), plan)


def test_auto_lowers_groups_within_a_process_in_graph_and_across_processes_over_the_runtime():
  _, records = traced(4, [("all_reduce", {"op": "sum"}, SAME)])
  across = rewrite.plan([records[0], records[1], None, None], MESH, rewrite.auto_lowering)
  assert across.collectives[0].implementation == "hierarchical"  # the group spans both workers
  _, records = traced(4, [("all_reduce", {"op": "sum"}, SAME)], axes=("device",))
  within = rewrite.plan([records[0], records[1], None, None], MESH, rewrite.auto_lowering)
  assert within.collectives[0].implementation == "one_device"  # each group within one worker
  assert within.collectives[0].groups == ((0, 1), (2, 3))
