"""The key under which a checkpoint written with ``tf.train.Checkpoint`` holds each object's value.

A multi-client job's checkpoint of a variable split across processes is
written in parts: worker 0 writes the checkpoint (with its own pieces), and
every other process its pieces, in a file of its own, under the same keys
(TensorFlow merges the files; its reader assembles the pieces). The other
processes learn the keys from worker 0, which reads them here from the object
graph it wrote: node ``i`` of the ``_CHECKPOINTABLE_OBJECT_GRAPH`` proto is the
``i``-th object of ``tf.train.TrackableView(root).descendants()`` (both are
TensorFlow's breadth-first walk from the root; checked on TensorFlow 2.21.0,
and :func:`keys` refuses a graph whose node count differs).

The proto's Python module, ``tensorflow.core.protobuf.trackable_object_graph_pb2``,
has no public alias: this module is the one place that imports it.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.core.protobuf import trackable_object_graph_pb2  # private: see the module docstring

_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"


def keys(root, save_path: str) -> list[tuple[object, str]]:
  """``(object, key of its value)`` for every object with a value in the checkpoint ``root`` wrote at ``save_path``."""
  graph = trackable_object_graph_pb2.TrackableObjectGraph()
  graph.ParseFromString(tf.train.load_checkpoint(save_path).get_tensor(_GRAPH_KEY))
  objects = tf.train.TrackableView(root).descendants()
  if len(objects) != len(graph.nodes):
    raise RuntimeError(f"The checkpoint at {save_path} holds {len(graph.nodes)} objects, its root {len(objects)} "
                       f"now: the objects changed while it was written.")
  found = []
  for node, obj in zip(graph.nodes, objects):
    for attribute in node.attributes:
      if attribute.name == "VARIABLE_VALUE":
        found.append((obj, attribute.checkpoint_key))
  return found
