"""A variable's initial value computed in a step's graph: evaluated once, outside the step.

A module built lazily on its first call (Sonnet's ``snt.Linear``, any
``tf.Variable(initializer(shape))`` inside ``step_fn``) creates its variable
with an initial value that is a tensor of the step graph. As ``tf.function``
does, the value's ops are lifted out: if they depend on nothing the step
computes at run time (no step input, no collective, no stateful op other
than variable reads and random draws), they are copied into a graph of their
own and run once, eagerly. Otherwise the value is computed by the step
itself and the variable is initialised in the graph on the first run
(``_variables``).
"""

from __future__ import annotations

import tensorflow as tf

# Stateful ops that are safe to run once more outside the step: reads and random draws.
_SAFE_STATEFUL = frozenset({
    "ReadVariableOp", "RandomStandardNormal", "RandomUniform", "RandomUniformInt", "TruncatedNormal",
    "RandomShuffle", "RandomGamma", "RandomPoisson", "RandomPoissonV2", "Multinomial", "VariableShape",
})


def _captures(graph) -> dict[str, tf.Tensor]:
  """Op name of each captured placeholder -> the outside value it stands for."""
  captures = getattr(graph, "captures", ())
  return {internal.op.name: external for external, internal in captures}


def liftable_ops(tensor: tf.Tensor) -> set[str] | None:
  """The names of the ops ``tensor`` needs, if it can be computed outside its graph; else None."""
  captured = _captures(tensor.graph)
  needed: set[str] = set()
  stack = [tensor.op]
  while stack:
    op = stack.pop()
    if op.name in needed:
      continue
    needed.add(op.name)
    if op.name in captured:
      continue  # fed with the outside value
    if op.type == "Placeholder":
      return None  # a step input or a collective's result
    if op.op_def.is_stateful and op.type not in _SAFE_STATEFUL:
      return None  # running it again would change state (an iterator, an assignment)
    stack.extend(t.op for t in op.inputs)
    stack.extend(op.control_inputs)
  return needed


def lift(tensor: tf.Tensor, lifted: set[str] | None = None) -> tf.Tensor | None:
  """``tensor``'s value computed once, eagerly, from a copy of the ops it needs; None if it cannot be.

  Args:
    tensor: a tensor of a function graph being traced.
    lifted: if given, the names of the lifted ops (not the graph's inputs)
      are added to it, for :func:`prune`.
  """
  needed = liftable_ops(tensor)
  if needed is None:
    return None
  captured = _captures(tensor.graph)
  graph_def = tensor.graph.as_graph_def()
  sub = tf.compat.v1.GraphDef()
  sub.versions.CopyFrom(graph_def.versions)
  sub.library.CopyFrom(graph_def.library)
  sub.node.extend(n for n in graph_def.node if n.name in needed)
  feeds = {f"{name}:0": value for name, value in captured.items() if name in needed}

  def run():
    return tf.graph_util.import_graph_def(sub, input_map=feeds, return_elements=[tensor.name])[0]

  with tf.init_scope():
    value = tf.compat.v1.wrap_function(run, [])()
  if lifted is not None:
    lifted.update(name for name in needed if name not in captured)
  return value


def prune(graph_def: tf.compat.v1.GraphDef, lifted: set[str]) -> tf.compat.v1.GraphDef:
  """``graph_def`` without the lifted ops that nothing else uses.

  Once an initial value has been computed outside the step, its ops (a
  random draw, say) would still run in every step (stateful ops run even
  when unused); ``tf.function`` leaves lifted initializers out of its graph
  too. Ops that something outside ``lifted`` reads stay.
  """
  drop: set[str] = set()
  while True:
    used = {i.split(":")[0] for n in graph_def.node if n.name not in drop for i in n.input if not i.startswith("^")}
    more = {name for name in lifted - drop if name not in used}
    if not more:
      break
    drop |= more
  if not drop:
    return graph_def
  out = tf.compat.v1.GraphDef()
  out.versions.CopyFrom(graph_def.versions)
  out.library.CopyFrom(graph_def.library)
  for node in graph_def.node:
    if node.name in drop:
      continue
    copy = out.node.add()
    copy.CopyFrom(node)
    if any(i.startswith("^") and i[1:] in drop for i in node.input):
      kept = [i for i in node.input if not (i.startswith("^") and i[1:] in drop)]
      copy.ClearField("input")
      copy.input.extend(kept)
  return out
