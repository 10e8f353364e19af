"""The body of a function-valued attribute (an ``If``'s branches, a ``While``'s) as a graph at given input shapes.

TensorFlow has no public API that turns a ``FunctionDef`` back into a graph:
``function_def_to_graph_def`` is the one its own control-flow gradients use,
and ``handle_data_util`` gives a resource argument its variable's dtype and
shape, and a ``TensorList`` argument its elements' (without them a branch's
``ReadVariableOp`` has no shape, as with ``function_def_to_graph``, which
sets them after importing, nor a loop gradient's ``TensorListPopBack``).
Both are private, so they are used only here. Checked on TF 2.21.
"""

from __future__ import annotations

import weakref

import tensorflow as tf
from tensorflow.python.framework import function_def_to_graph  # private: see the module docstring
from tensorflow.python.ops import handle_data_util  # private: see the module docstring

_LIBRARIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # graph -> (version, name -> FunctionDef)
_PATHS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # a body's graph -> its place in the step (path)


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
  for node in graph_def.node:  # colocation with ops of other functions (a loop's gradient, the loop's): not here
    if "_class" in node.attr:
      del node.attr["_class"]
  args = [a.name for a in fdef.signature.input_arg]
  graph = tf.Graph()
  with graph.as_default():
    inputs = []
    for arg, t in zip(args, arguments):
      x = tf.raw_ops.Placeholder(dtype=t.dtype, shape=t.shape, name=f"{arg}_argument")
      if t.dtype in (tf.resource, tf.variant):  # a variable's dtype and shape; a list's element dtype and shape
        handle_data_util.copy_handle_data(t, x)
      inputs.append(x)
    # The function's own placeholders are imported too, unused (the importer wants every mapped input).
    tf.graph_util.import_graph_def(graph_def, input_map={flat[a]: x for a, x in zip(args, inputs)}, name="")
  graph.inputs = inputs
  # An output that is an argument (a while loop's body passes loop-invariant values on) is the argument's
  # placeholder, not the function's own (imported, unused).
  passed = {flat[a]: x for a, x in zip(args, inputs)}
  returned = [flat[fdef.ret[a.name]] for a in fdef.signature.output_arg]
  graph.outputs = [passed[name] if name in passed else graph.get_tensor_by_name(name) for name in returned]
  graph.control_outputs = [graph.get_operation_by_name(fdef.control_ret[n]) for n in fdef.signature.control_output]
  _PATHS[graph] = f"{path(op.graph)}{op.name}/{attr}/"
  return graph


def path(graph) -> str:
  """Where ``graph`` sits in the step: ``"<op>/<attr>/"`` of each op down to it whose function it is the body of.

  Empty for the step's own graph (any graph not made by :func:`body`); ``"outer/body/inner/cond/"`` for the
  condition of a loop ``inner`` in the body of a loop ``outer``. The names a trace gives its ops are the same in every process that
  traces one step (unlike its functions' names, which carry a per-process counter), so every process of a
  multi-client job names a body alike.
  """
  return _PATHS.get(graph, "")


def _called(attrs) -> list:
  """Names of the functions a node's attributes name (an ``If``'s branches, a call's function)."""
  names = []
  for value in attrs.values():
    if value.HasField("func"):
      names.append(value.func.name)
    names.extend(f.name for f in value.list.func)
  return names


def _nested(op: tf.Operation) -> tuple[list, list]:
  """``(names, nodes)``: every function ``op`` runs and those they call (each once), and their NodeDefs.

  A function is called by an attribute (an ``If``'s branch, a ``PartitionedCall``'s ``f``) or as a node's op
  type (a ``Defun``'s call).
  """
  names = _called(op.node_def.attr)
  if not names:
    return [], []
  library, seen, nodes = _library(op.graph), [], []
  while names:
    name = names.pop()
    if name in seen or name not in library:
      continue
    seen.append(name)
    for node in library[name].node_def:
      nodes.append(node)
      names.extend(_called(node.attr) + ([node.op] if node.op in library else []))
  return seen, nodes


def nested_nodes(op: tf.Operation) -> list:
  """The NodeDefs of every function ``op`` runs, and of the functions those call (each once).

  Empty for an op without function-valued attributes.
  """
  return _nested(op)[1]


def import_called(op: tf.Operation) -> None:
  """Imports into the current graph every function that ``op``'s functions call (nested).

  A copy of a function's body made in another graph (each device's copy of a
  loop's body, traced as a ``tf.function``) calls them too.
  """
  names, _ = _nested(op)
  library = _library(op.graph)
  graph_def = tf.compat.v1.GraphDef()
  graph_def.versions.CopyFrom(op.graph.graph_def_versions)
  own = set(_called(op.node_def.attr))
  graph_def.library.function.extend(library[name] for name in names if name not in own)
  if graph_def.library.function:
    tf.graph_util.import_graph_def(graph_def, name="")
