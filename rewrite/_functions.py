"""The body of a function-valued attribute (an ``If``'s branches) as a graph at given input shapes.

TensorFlow has no public API that turns a ``FunctionDef`` back into a graph:
``function_def_to_graph_def`` is the one its own control-flow gradients use,
and ``handle_data_util`` gives a resource argument its variable's dtype and
shape (without them a branch's ``ReadVariableOp`` has no shape, as with
``function_def_to_graph``, which sets them after importing). Both are
private, so they are used only here. Checked on TF 2.21.
"""

from __future__ import annotations

import weakref

import tensorflow as tf
from tensorflow.python.framework import function_def_to_graph  # private: see the module docstring
from tensorflow.python.ops import handle_data_util  # private: see the module docstring

_LIBRARIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # graph -> (version, name -> FunctionDef)


def _library(graph: tf.Graph) -> dict:
  version, functions = _LIBRARIES.get(graph, (None, None))
  if version != graph.version:
    functions = {f.signature.name: f for f in graph.as_graph_def().library.function}
    _LIBRARIES[graph] = (graph.version, functions)
  return functions


def body(op: tf.Operation, attr: str, arguments: list) -> tf.Graph:
  """The function ``op``'s attribute ``attr`` names, as a graph on arguments shaped like ``arguments``.

  Args:
    op: an op with a function-valued attribute (``If``).
    attr: the attribute (``"then_branch"``).
    arguments: the tensors the function is called with (their dtypes,
      shapes, and a resource's variable dtype and shape are used).

  Returns:
    A ``tf.Graph`` with ``inputs`` (placeholders), ``outputs`` and
    ``control_outputs`` attributes, like a ``FuncGraph``'s.
  """
  name = op.get_attr(attr).name
  fdef = _library(op.graph).get(name)
  if fdef is None:
    raise KeyError(f"{op.type} {op.name}: its {attr} function {name} is not in the graph's library.")
  # It looks the functions the body calls up in the default graph (eagerly: the eager context); they are
  # op.graph's, which is not the default one when the step is traced inside another tf.function (Keras's).
  with op.graph.as_default():
    graph_def, flat = function_def_to_graph.function_def_to_graph_def(
        fdef, [t.shape for t in arguments], include_library_functions=True)
  args = [a.name for a in fdef.signature.input_arg]
  graph = tf.Graph()
  with graph.as_default():
    inputs = []
    for arg, t in zip(args, arguments):
      x = tf.raw_ops.Placeholder(dtype=t.dtype, shape=t.shape, name=f"{arg}_argument")
      if t.dtype == tf.resource:
        handle_data_util.copy_handle_data(t, x)
      inputs.append(x)
    # The function's own placeholders are imported too, unused (the importer wants every mapped input).
    tf.graph_util.import_graph_def(graph_def, input_map={flat[a]: x for a, x in zip(args, inputs)}, name="")
  graph.inputs = inputs
  graph.outputs = [graph.get_tensor_by_name(flat[fdef.ret[a.name]]) for a in fdef.signature.output_arg]
  graph.control_outputs = [graph.get_operation_by_name(fdef.control_ret[n]) for n in fdef.signature.control_output]
  return graph


def _called(attrs) -> list:
  """Names of the functions a node's attributes name (an ``If``'s branches, a call's function)."""
  names = []
  for value in attrs.values():
    if value.HasField("func"):
      names.append(value.func.name)
    names.extend(f.name for f in value.list.func)
  return names


def nested_nodes(op: tf.Operation) -> list:
  """The NodeDefs of every function ``op`` runs, and of the functions those call (each once).

  Empty for an op without function-valued attributes.
  """
  names = _called(op.node_def.attr)
  if not names:
    return []
  library, seen, nodes = _library(op.graph), set(), []
  while names:
    name = names.pop()
    if name in seen or name not in library:
      continue
    seen.add(name)
    for node in library[name].node_def:
      nodes.append(node)
      names.extend(_called(node.attr))
  return nodes
