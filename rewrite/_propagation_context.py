"""The propagation's context: what a rule sees besides its op, and what the propagation remembers of ops.

A :class:`Context` holds the mesh, the variables' shapes, how a function's body is partitioned, the values that
shape arithmetic folds to (small integer ops run once on constants), and the rules' decisions by op and layouts;
a :class:`Record` is what the propagation asks of one op, asked of TensorFlow once.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from rewrite.rules import _base

SOURCES = ("Placeholder", "Const")  # ops whose one output takes a layout of its own (given, or replicated)

_FOLDED_DTYPES = (tf.int32, tf.int64, tf.bool)
MAX_FOLDED_ELEMENTS = 64


class Context:
  """What rules see besides the op: the mesh, the variables' shapes, constant shape arithmetic, function bodies.

  ``bodies`` (``rules._base.Bodies``): how a rule partitions and expands the body of
  a function its op calls (an ``If``'s branches).
  """

  def __init__(self, mesh, handle_shapes, summed=frozenset(), bodies=None, pinned=None):
    self.mesh = mesh
    self.pinned: dict = pinned or {}  # op name -> the layout its one output must have (Propagator's ``pinned``)
    self.handle_shapes = handle_shapes
    self.summed = summed
    self.bodies = bodies
    self.data: frozenset = frozenset()  # tensors computed from the step's data inputs
    self.data_axes: frozenset = frozenset()  # the batch axes (where the batch is split)
    self._values: dict = {}
    self.decided: dict = {}  # (op, its inputs' layouts, its outputs' wanted layouts) -> the rule's decision
    self.alike = False  # ops alike share decisions (see Propagator)
    self._records: dict = {}
    self._kinds: dict = {}

  def record(self, op) -> Record:
    """What the propagation asks of ``op`` by the million, asked of TensorFlow once (its properties are slow)."""
    found = self._records.get(op)
    if found is None:
      found = self._records[op] = Record(op, self._kind(op))
    return found

  def _kind(self, op):
    """What ``op``'s decisions are remembered by: its name; or, with ``alike``, a number for what makes ops alike."""
    if not self.alike:
      return op.name
    attrs = tuple(sorted((k, v.SerializeToString(deterministic=True)) for k, v in op.node_def.attr.items()
                         if not k.startswith("_")))
    ins = tuple((t.dtype, str(t.shape), str(self.handle_shapes.get(t.name)), t.name in self.summed,
                 t.name in self.data, self._constant(t)) for t in op.inputs)
    kind = (op.type, attrs, ins, tuple((t.dtype, str(t.shape)) for t in op.outputs), summed_after(op),
            self.pinned.get(op.name))
    return self._kinds.setdefault(kind, len(self._kinds))  # (a number: a key hashed by the million)

  def _constant(self, t):
    """``t``'s value as a key, if it is a small integer one the traced shapes determine (a shape operand)."""
    if t.dtype not in _FOLDED_DTYPES or not t.shape.is_fully_defined() or t.shape.num_elements() > MAX_FOLDED_ELEMENTS:
      return None
    value = self.value(t)
    if value is None:
      return None
    value = np.asarray(value)
    return value.shape, value.dtype.str, value.tobytes()

  def know(self, t: tf.Tensor, value) -> None:
    """Records ``t``'s value (a shape query's global answer)."""
    self._values[t.name] = value

  def value(self, t: tf.Tensor):
    """``t``'s value if the traced shapes determine it (``tf.get_static_value``, or shape arithmetic folded)."""
    if t.name not in self._values:
      value = tf.get_static_value(t)
      if value is None and _foldable(t.op):
        inputs = [self.value(x) for x in t.op.inputs]
        if all(x is not None and x.size <= MAX_FOLDED_ELEMENTS for x in inputs):
          value = _evaluate(t.op, inputs)[t.value_index]
      self._values[t.name] = value
    return self._values[t.name]


NOT_SOURCE = object()


class Record:
  """One op's names, as the propagation asks them (see :meth:`Context.record`).

  ``source``: a constant's or placeholder's own layout (replicated, unless given), else ``NOT_SOURCE``.
  """

  __slots__ = ("name", "source", "inputs", "outputs", "data_inputs", "kind", "variant")

  def __init__(self, op, kind):
    self.name = op.name
    self.source = _base.replicated(_base.rank_of(op.outputs[0])) if op.type in SOURCES else NOT_SOURCE
    self.inputs = tuple(t.name for t in op.inputs)
    self.outputs = tuple(t.name for t in op.outputs)
    self.data_inputs = tuple(None if t.dtype == tf.resource else t.name for t in op.inputs)  # (handles: None)
    self.kind = kind
    self.variant = any(t.dtype == tf.variant for t in list(op.inputs) + list(op.outputs))


def _foldable(op) -> bool:
  """Small integer arithmetic without state (on shapes: gradient broadcasting, slices of shapes)."""
  if op.op_def.is_stateful or not op.inputs or op.type in ("Placeholder", "ReadVariableOp"):
    return False
  for t in op.outputs:
    if t.dtype not in _FOLDED_DTYPES or (t.shape.is_fully_defined() and t.shape.num_elements() > MAX_FOLDED_ELEMENTS):
      return False
  return all(x.dtype in _FOLDED_DTYPES for x in op.inputs)


def _evaluate(op, inputs):
  """Runs ``op`` on constant ``inputs`` (numpy values of each output)."""
  graph = tf.Graph()
  with graph.as_default():
    consts = [tf.constant(v, dtype=x.dtype) for v, x in zip(inputs, op.inputs)]
    graph_def = tf.compat.v1.GraphDef()
    graph_def.versions.producer = op.graph.graph_def_versions.producer
    node = graph_def.node.add()
    node.CopyFrom(op.node_def)
    node.device = ""
    if "_class" in node.attr:
      del node.attr["_class"]
    del node.input[:]
    node.input.extend(c.op.name for c in consts)
    (copy,) = tf.graph_util.import_graph_def(graph_def, input_map={c.op.name: c for c in consts},
                                             return_elements=[node.name], name="fold")
  with tf.compat.v1.Session(graph=graph) as session:
    return session.run(list(copy.outputs))


CONTRACTIONS = ("MatMul", "BatchMatMulV2", "BatchMatMulV3", "BatchMatMul", "Einsum")


def summed_after(op) -> bool:
  """Whether ``op`` is a contraction whose one output only a ``Sum`` reads (a kernel's gradient, broadcast over the
  batch: ``[batch, in, out]`` summed over the batch), or only a ``ConcatV2`` of such contractions alone (the keys'
  gradient of blockwise attention, a block each), so its partial sums can wait for that op."""
  if op.type not in CONTRACTIONS or len(op.outputs) != 1:
    return False
  consumers = op.outputs[0].consumers()
  returned = {t.name for t in getattr(op.graph, "outputs", ()) or ()}
  if len(consumers) != 1 or op.outputs[0].name in returned:
    return False
  if consumers[0].type == "Sum":
    return True
  return consumers[0].type == "ConcatV2" and _concat_of_contractions(consumers[0], returned)


def _concat_of_contractions(concat, returned) -> bool:
  """Whether every value ``concat`` joins is a contraction of one type, read by it alone (and not returned)."""
  values = list(concat.inputs)[:-1]
  kinds = {t.op.type for t in values}
  return (len(values) > 1 and len(kinds) == 1 and kinds <= set(CONTRACTIONS)
          and all(len(t.consumers()) == 1 and t.name not in returned for t in values))
