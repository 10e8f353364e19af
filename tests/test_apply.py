"""Tests for rewrite.apply: GraphDef surgery, with no Keras and no Replicator."""

import numpy as np
import pytest
import tensorflow as tf
from conftest import IMPLEMENTATIONS
from conftest import cpus

import mesh
import rewrite


def traced(n, kinds):
  """Traces a function with one placeholder per (kind, params) per replica."""
  records = [[] for _ in range(n)]

  def fn(x):
    outs = []
    for r in range(n):
      with tf.device(f"/device:CPU:{r}"):
        h = x * float(r + 1)
        for i, (kind, params, shape) in enumerate(kinds):
          y, rec = rewrite.emit(h, replica=r, index=i, kind=kind, params=params, axes=("replica",),
                                result_shape=shape(h.shape), device=f"/device:CPU:{r}",
                                location="here", call=f"call {i}")
          records[r].append(rec)
          h = y + 0.0
        outs.append(h)
    return outs

  concrete = tf.function(fn).get_concrete_function(tf.TensorSpec([2], tf.float32))
  return concrete, records


def run_rewritten(concrete, rewritten, x):
  names = [rewritten.output_name(t.name) for t in concrete.outputs]
  captures = [(i.name, e) for e, i in concrete.graph.captures] + list(rewritten.external_inputs.items())

  @tf.function
  def execute(x):
    input_map = {concrete.graph.inputs[0].name: x}
    input_map.update({name: tf.identity(e).op.inputs[0] for name, e in captures})
    return tf.graph_util.import_graph_def(rewritten.graph_def, input_map=input_map, return_elements=names)

  return [t.numpy() for t in execute(x)]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_chain_of_collectives(impl):
  n = 4
  same = lambda s: s  # noqa: E731
  concrete, records = traced(n, [("all_reduce", {"op": "sum"}, same),
                                 ("broadcast", {"source": 2}, same),
                                 ("all_reduce", {"op": "max"}, same)])
  plan = rewrite.plan(records, mesh.Mesh({"replica": n}, cpus(n)), lambda c: impl)
  rewritten = rewrite.apply(concrete.graph.as_graph_def(), plan)
  placeholder_nodes = {m.node for c in plan.collectives for m in c.members}
  assert not placeholder_nodes & {node.name for node in rewritten.graph_def.node}
  assert all(i.lstrip("^").split(":")[0] not in placeholder_nodes
             for node in rewritten.graph_def.node for i in node.input)
  out = run_rewritten(concrete, rewritten, tf.constant([1.0, -2.0]))
  x = np.array([1.0, -2.0])
  expected = sum(x * (r + 1) for r in range(n))  # all_reduce sum, then broadcast of an equal value
  for r in range(n):
    np.testing.assert_allclose(out[r], expected)


def test_all_gather_shapes():
  n = 2

  def gathered(s):
    return tf.TensorShape([s[0] * n])

  concrete, records = traced(n, [("all_gather", {"concat_dimension": 0}, gathered)])
  plan = rewrite.plan(records, mesh.Mesh({"replica": n}, cpus(n)), lambda c: "one_device")
  rewritten = rewrite.apply(concrete.graph.as_graph_def(), plan)
  out = run_rewritten(concrete, rewritten, tf.constant([1.0, 2.0]))
  np.testing.assert_allclose(out[1], [1.0, 2.0, 2.0, 4.0])


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_exchange_kinds(impl):
  n = 2
  same = lambda s: s  # noqa: E731
  concrete, records = traced(n, [("all_to_all", {"split_dimension": 0, "concat_dimension": 0}, same),
                                 ("permute", {"perm": ((0, 1), (1, 0))}, same),
                                 ("reduce_scatter", {"op": "sum", "scatter_dimension": 0},
                                  lambda s: tf.TensorShape([s[0] // n]))])
  plan = rewrite.plan(records, mesh.Mesh({"replica": n}, cpus(n)), lambda c: impl)
  rewritten = rewrite.apply(concrete.graph.as_graph_def(), plan)
  graph_def = rewritten.graph_def
  out = run_rewritten(concrete, rewritten, tf.constant([1.0, -2.0]))
  # Inputs [1, -2] and [2, -4]; exchanged: [1, 2] and [-2, -4]; swapped; summed and split.
  np.testing.assert_allclose(out[0], [-1.0])
  np.testing.assert_allclose(out[1], [-2.0])
  if impl == "collective_ops":
    ordered = rewrite.get_lowering(impl).ordered_op_types
    # The permute is a two-member group each way; device 0, the least of the cycle, sends first, device 1
    # receives first (each sending first would wait for the other's receive forever).
    sends_first = {0: ["CollectiveBcastSendV2", "CollectiveBcastRecvV2"], 1: ["CollectiveBcastRecvV2",
                                                                            "CollectiveBcastSendV2"]}
    for d, device in enumerate(cpus(n)):
      chain = [node for node in graph_def.node if node.op in ordered and node.device == device]
      assert [node.op for node in chain] == ["CollectiveAllToAllV2", *sends_first[d], "CollectiveAllToAllV2"]
      for before, after in zip(chain, chain[1:]):
        assert f"^{before.name}" in after.input
  else:
    assert not any(node.op.startswith("Collective") for node in graph_def.node)


def test_collective_ops_are_chained_per_device():
  n = 2
  same = lambda s: s  # noqa: E731
  concrete, records = traced(n, [("all_reduce", {"op": "sum"}, same)] * 3)
  plan = rewrite.plan(records, mesh.Mesh({"replica": n}, cpus(n)), lambda c: "collective_ops")
  graph_def = rewrite.apply(concrete.graph.as_graph_def(), plan).graph_def
  reduces = [node for node in graph_def.node if node.op == "CollectiveReduceV2"]
  assert len(reduces) == 6
  for device in cpus(n):
    on_device = [node for node in reduces if node.device == device]
    for before, after in zip(on_device, on_device[1:]):
      assert f"^{before.name}" in after.input


def test_missing_placeholder_is_an_error():
  concrete, records = traced(2, [("all_reduce", {"op": "sum"}, lambda s: s)])
  plan = rewrite.plan(records, mesh.Mesh({"replica": 2}, cpus(2)), lambda c: "one_device")
  empty = tf.compat.v1.GraphDef()
  with pytest.raises(rewrite.RewriteError, match="are not in the graph"):
    rewrite.apply(empty, plan)


def test_unknown_lowering():
  with pytest.raises(ValueError, match=r"Unknown collective implementation 'nccl'\. Registered implementations: \['collective_ops', 'hierarchical', 'one_device'\]"):
    rewrite.get_lowering("nccl")


def test_custom_lowering_plugs_in():
  class Doubling(rewrite.Lowering):
    name = "test_doubling"

    def lower_group(self, collective, inputs, devices, ctx):
      with tf.device(devices[0]):
        total = tf.add_n(list(inputs)) * 2.0
      return [tf.identity(total) for _ in devices]

  rewrite.register_lowering(Doubling())
  concrete, records = traced(2, [("all_reduce", {"op": "sum"}, lambda s: s)])
  plan = rewrite.plan(records, mesh.Mesh({"replica": 2}, cpus(2)), lambda c: "test_doubling")
  out = run_rewritten(concrete, rewrite.apply(concrete.graph.as_graph_def(), plan), tf.constant([1.0, 1.0]))
  np.testing.assert_allclose(out[0], [6.0, 6.0])
