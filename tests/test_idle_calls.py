"""rewrite.without_idle: what a pipelined step's idle collective calls leave, removed."""

import tensorflow as tf

import rewrite


def _graph():
  graph_def = tf.compat.v1.GraphDef()
  graph_def.node.add(name="x", op="Placeholder")
  graph_def.node.add(name="shape", op="Const")
  graph_def.node.add(name="zeros", op="Fill", input=["shape", "shape"])  # (an idle call's zeros)
  graph_def.node.add(name="summed", op="AddN", input=["zeros", "zeros"])  # a group of idle calls: unused
  graph_def.node.add(name="copy", op="Identity", input=["summed", "^x"])
  graph_def.node.add(name="mixed", op="AddN", input=["x", "zeros"])  # a group mixing real calls: used
  graph_def.node.add(name="out", op="Identity", input=["mixed"])
  return graph_def


def test_what_is_made_from_idle_zeros_alone_and_unused_is_removed():
  kept = rewrite.without_idle(_graph(), {"zeros"}, keep={"out"})
  assert [n.name for n in kept.node] == ["x", "shape", "zeros", "mixed", "out"]


def test_a_node_the_step_returns_or_another_reads_is_kept():
  kept = rewrite.without_idle(_graph(), {"zeros"}, keep={"copy"})
  assert [n.name for n in kept.node] == ["x", "shape", "zeros", "summed", "copy", "mixed", "out"]
  assert rewrite.without_idle(_graph(), set()) == _graph()
