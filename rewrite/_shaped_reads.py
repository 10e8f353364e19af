"""Reads of fed variable handles given their variables' shapes, in a ``GraphDef``.

A variable handle fed to a step (a ``Placeholder`` of dtype resource, a
handle taken out of a stack) carries no shape, so its reads, and every op
after them, are of unknown shape to TensorFlow's shape inference and to
Grappler. :func:`shape_reads` follows each such read by an ``EnsureShape``
of its variable's shape under the read's name (its readers read the check),
the read renamed beside it: the nodes keep their order, which is the order a
function importing them makes its ops, and so the order in which it sequences
each variable's uses. The check is colocated with the read (a read has no
device in a ``GraphDef``: the placer puts it with its resource).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tensorflow as tf


def shape_reads(graph_def, shapes: Mapping[str, Any], suffix: str = "/replicator_read"):
  """``graph_def`` with each ``ReadVariableOp`` of a handle node in ``shapes`` checked to that shape.

  Args:
    graph_def: a ``GraphDef``.
    shapes: a handle's node name -> its variable's shape (a ``tf.TensorShape``, a list, or a
      ``TensorShapeProto``).
    suffix: added to a read's name to rename it (made unique).

  Returns:
    A new ``GraphDef`` (``graph_def`` itself when no read is of such a handle).
  """
  protos = {name: tf.TensorShape(shape).as_proto() for name, shape in shapes.items()}
  if not any(node.op == "ReadVariableOp" and node.input and _node_of(node.input[0]) in protos
             for node in graph_def.node):
    return graph_def
  result = type(graph_def)()
  result.CopyFrom(graph_def)
  del result.node[:]
  taken = {node.name for node in graph_def.node}
  for node in graph_def.node:
    copy = result.node.add()
    copy.CopyFrom(node)
    if node.op != "ReadVariableOp" or not node.input or _node_of(node.input[0]) not in protos:
      continue
    read = node.name + suffix
    while read in taken:
      read += "_"
    taken.add(read)
    copy.name = read
    check = result.node.add(name=node.name, op="EnsureShape", input=[read], device=node.device)
    # With the read, on the variable's device: an unplaced check went to the default device, a send and a
    # receive each.
    check.attr["_class"].list.s.append(b"loc:@" + read.encode())
    check.attr["T"].CopyFrom(node.attr["dtype"])
    check.attr["shape"].shape.CopyFrom(protos[_node_of(node.input[0])])
  return result


def _node_of(ref: str) -> str:
  return ref.split(":")[0]
