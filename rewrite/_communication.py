"""The collectives a partition's expansion emits, op by op: one walk for ``repl.explain`` and the cost model.

The expander (``_expansion._Expander``) emits, for each op in the graph's
order: its inputs' relayouts (each tensor once per layout: later consumers
reuse it; a relayout's all-to-alls, then its all-gathers), a self-lowering
rule's own collectives (``Decision.communicates``), and the all-reduces (or
reduce-scatters, then all-reduces) that complete its partial sums; then the
step's outputs are gathered whole (each, every time). :func:`walk` yields
the same, in the same order, from the partition alone: the report
(``_partition_report``) attributes the plan's collectives to ops and reasons
with it, and the cost model (``_cost``) prices it. A sharded update's
broadcasts (``_partition_owners``) are the callers' to add.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator

import tensorflow as tf

from rewrite import _relayout
from rewrite.rules import _base


@dataclasses.dataclass(frozen=True)
class Relayout:
  """An input (or a returned output) whose required layout differs from the one its producer gave it.

  Attributes:
    tensor: the tensor.
    source: its layout.
    target: the layout required.
    op: the op whose input it is (for a returned output, its producer).
    index: the input's index (a returned output's index among the step's outputs).
    returned: whether it is returned whole, not an input.
    steps: the collectives that take it there (empty: a local slice, or a relayout made before for another
      consumer and reused).
  """

  tensor: tf.Tensor
  source: tuple
  target: tuple
  op: tf.Operation
  index: int
  returned: bool
  steps: _relayout.Steps


@dataclasses.dataclass(frozen=True)
class Needed:
  """One collective the expansion emits.

  Attributes:
    kind: ``all_to_all``, ``all_gather``, ``all_reduce``, ``reduce_scatter`` (or a rule's own).
    axes: the mesh axes it spans.
    op_name: the op it is attributed to (a returned output's: its producer).
    why: what ``repl.explain`` says of it.
    tensor: the tensor whose pieces it sends.
    layout: the layout of the piece each device sends (its bytes).
    nbytes: the bytes each device sends, where a rule said (``Decision.communicates``' fourth entry: a
      halo's rows); None: ``tensor``'s piece in ``layout``.
  """

  kind: str
  axes: tuple
  op_name: str
  why: str
  tensor: tf.Tensor
  layout: tuple | None
  nbytes: int | None = None


def walk(graph: tf.Graph, partition, outputs, mesh_shape, ops=None) -> Iterator[Relayout | Needed]:
  """Each relayout, and each collective after the event that needs it, in the expander's order.

  Args:
    graph: the traced global graph.
    partition: its ``_propagation.Partition``.
    outputs: the step's outputs (returned whole).
    mesh_shape: axis name -> size.
    ops: ``graph``'s ops as ``(op, its name, ((input, its name, whether a resource), ...), ((output, its
      name), ...))``, if the caller keeps them (TensorFlow's properties are slow to ask again); else asked here.
  """
  layouts = partition.layouts
  group = lambda axes: math.prod(mesh_shape[a] for a in axes)  # noqa: E731
  done: set = set()

  def relayout(t, name, target, op, index, returned=False, reason=""):
    source = layouts.get(name)
    if isinstance(source, _base.Pending):  # partial sums the Sum reading them sums
      source = tuple(source)
    if source is None or target is None or source == target or len(source) != len(target):
      return
    # An op's input is relayouted once per layout (later consumers reuse it, for free; a variable's read again for
    # the backward pass: _relayout.reuse_key); a returned output each time (the step's outputs apart).
    key = _relayout.reuse_key(t, target, op.name, source)
    if not returned and key in done:
      steps = _relayout.Steps()
    else:
      if not returned:
        done.add(key)
      steps = _relayout.steps(source, target, t.shape.as_list() if t.shape.rank is not None else None, group)
    yield Relayout(t, source, target, op, index, returned, steps)
    where, op_name = " to return it" if returned else f" (input {index})", op.name
    where += f": {reason}" if reason else ""
    current = list(source)
    for a, b, axes in steps.moved:  # all-to-alls, then all-gathers
      yield Needed("all_to_all", axes, op_name, f"move {name} dim {a} -> {b}{where}", t, tuple(current))
      current[a], current[b] = (), axes
    for d, axes in steps.gathered:
      yield Needed("all_gather", axes, op_name, f"gather {name} dim {d}{where}", t, tuple(current))
      current[d] = ()

  if ops is None:
    ops = [(op, op.name, tuple((t, t.name, t.dtype == tf.resource) for t in op.inputs),
            tuple((t, t.name) for t in op.outputs)) for op in graph.get_operations()]
  for op, op_name, inputs, outs in ops:
    decision = partition.decisions.get(op_name)
    if decision is None:
      continue
    for i, ((t, name, resource), target) in enumerate(zip(inputs, decision.inputs)):
      if not resource:
        yield from relayout(t, name, target, op, i, reason=decision.reasons.get(i, ""))
    out, out_name = outs[0] if outs else (None, None)
    for kind, axes, why, *nbytes in decision.communicates:  # a self-lowering rule's own collectives
      yield Needed(kind, tuple(axes), op_name, why, out, layouts.get(out_name), nbytes[0] if nbytes else None)
    for k, reduce in enumerate(decision.reduce[:len(outs)]):
      if reduce is None:
        continue
      combine, axes = reduce
      out, out_name = outs[k]
      why = f"partial {combine}" + (f" (output {k})" if len(outs) > 1 else "")
      computed = list(decision.computed(k) or ()) if decision.scatter.get(k) else list(layouts.get(out_name) or ())
      for d, over in decision.scatter.get(k, ()):
        yield Needed("reduce_scatter", tuple(over), op_name, f"{why}, scattered along dim {d}", out,
                     tuple(computed) if computed else None)
        axes = tuple(a for a in axes if a not in over)
      if axes:
        yield Needed("all_reduce", tuple(axes), op_name, why, out, layouts.get(out_name))
  for k, t in enumerate(outputs):
    if t.dtype != tf.resource and t.shape.rank is not None:
      yield from relayout(t, t.name, ((),) * t.shape.rank, t.op, k, returned=True)
