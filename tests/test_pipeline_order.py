"""rewrite._pipeline_order: 1F1B's control edges in an expanded pipelined step."""

import pytest
import tensorflow as tf
from conftest import cpus

import mesh
import rewrite
from rewrite import _pipeline_order

MICRO = "micro"


def _graph(combine=False):
  """Each device position's forward op ``f`` (reading the input) and backward op ``gradient_tape/b`` (reading
  ``f``), on a {"stage": 2} mesh with 4 microbatches; with ``combine``, stage 0's first position's ``sum`` of
  every microbatch's ``f``, which its backward op reads (a statistic over the batch)."""
  m = mesh.Mesh({"stage": 2}, devices=cpus(2)).with_repeats(MICRO, 4)
  graph_def = tf.compat.v1.GraphDef()
  x = graph_def.node.add(name="x", op="Placeholder")
  del x
  for r in range(m.size):
    graph_def.node.add(name=f"expand/replica_{r}/f", op="Identity", input=["x"], device=m.devices[r])
  if combine:
    graph_def.node.add(name="expand/replica_0/sum", op="AddN", input=[f"expand/replica_{r}/f" for r in range(4)])
  for r in range(m.size):
    source = "expand/replica_0/sum" if combine and r == 0 else f"expand/replica_{r}/f"
    graph_def.node.add(name=f"expand/replica_{r}/gradient_tape/b", op="Identity", input=[source], device=m.devices[r])
  return graph_def, m


def _control(graph_def, name):
  (node,) = [n for n in graph_def.node if n.name == name]
  return sorted(i[1:] for i in node.input if i.startswith("^"))


def test_each_forward_pass_waits_for_the_backward_pass_p_minus_s_microbatches_before():
  graph_def, m = _graph()
  ordered = _pipeline_order.one_f_one_b(graph_def, m, "stage", MICRO)
  # Stage 0 (positions 0-3): microbatches 2 and 3 after 0's and 1's backward passes; stage 1 (4-7): 1, 2, 3 after
  # 0, 1, 2.
  gate = "expand/replica_{}/pipeline/backward_done"
  assert [_control(ordered, f"expand/replica_{r}/f") for r in range(8)] == [
      [], [], [gate.format(0)], [gate.format(1)], [], [gate.format(4)], [gate.format(5)], [gate.format(6)]]
  assert _control(ordered, gate.format(0)) == ["expand/replica_0/gradient_tape/b"]
  assert len(graph_def.node) == 17 and len(ordered.node) == 17 + 5  # (the input's graph is left as it was)


def test_a_value_combining_the_microbatches_before_their_backward_passes_is_named():
  graph_def, m = _graph(combine=True)
  with pytest.raises(rewrite.RewriteError, match=r"The 1F1B schedule cannot run this step: sum \(at sum\) combines "
                     "every microbatch's value"):
    _pipeline_order.one_f_one_b(graph_def, m, "stage", MICRO, locate=lambda name: f"at {name}")
