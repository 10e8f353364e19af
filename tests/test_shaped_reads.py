"""rewrite.shape_reads: reads of fed variable handles checked to their variables' shapes, the nodes' order kept."""

import tensorflow as tf

import rewrite


def _step_graph():
  """A function of a fed handle (a resource placeholder: no shape) reading it twice; its GraphDef."""
  graph = tf.Graph()
  with graph.as_default():
    handle = tf.compat.v1.placeholder(tf.resource, shape=[], name="handle")
    first = tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32, name="read")
    tf.identity(first * 2.0, name="twice")
    tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32, name="read_again")
  return graph.as_graph_def()


def _shapes(graph_def):
  graph = tf.Graph()
  with graph.as_default():
    tf.graph_util.import_graph_def(graph_def, name="")
  return {op.name: op.outputs[0].shape.as_list() if op.outputs and op.outputs[0].shape.rank is not None else None
          for op in graph.get_operations()}


def test_reads_of_a_fed_handle_get_its_variables_shape_in_the_same_order():
  graph_def = _step_graph()
  assert _shapes(graph_def)["twice"] is None  # (TensorFlow cannot know it)
  shaped = rewrite.shape_reads(graph_def, {"handle": [3, 4]})
  found = _shapes(shaped)
  assert found["read"] == found["twice"] == found["read_again"] == [3, 4]
  names = [node.name for node in shaped.node]
  # Each read renamed, its check under its name right after it; every other node where it was.
  assert names == ["handle", "read/replicator_read", "read", "mul/y", "mul", "twice", "read_again/replicator_read",
                   "read_again"]
  check = next(node for node in shaped.node if node.name == "read")
  assert check.op == "EnsureShape" and list(check.input) == ["read/replicator_read"]
  assert list(check.attr["_class"].list.s) == [b"loc:@read/replicator_read"]


def test_a_graph_without_such_reads_is_returned_as_it_is():
  graph_def = _step_graph()
  assert rewrite.shape_reads(graph_def, {"other": [3]}) is graph_def
  assert rewrite.shape_reads(graph_def, {}) is graph_def
