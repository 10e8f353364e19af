"""Rules for control flow: an ``If`` whose branches run on each device's pieces without communicating.

Keras emits conditionals inside a training step (an optimizer's
``gradient_accumulation_steps``: accumulate, or apply and reset; a loss's
check of its labels; a ``LossScaleOptimizer``: apply if the gradients are
finite). The predicate is a scalar, so every device has the same value (a
reduction that produced it was all-reduced) and takes the same branch. Each
branch's body is partitioned like the step (``_partition``), its arguments in
the layouts they have outside; a split argument from which a branch would
gather a value is gathered before the ``If`` instead, and the branches
partitioned again. If then no op of either branch needs a collective and both
branches give their outputs the same layouts, each device runs a conditional
over its own copies of the branches, made per device. Otherwise the op falls
back (gathered, replicated), or, on a sharded variable's handle, is refused.
Collectives inside branches are not placed yet. ``While`` loops: ``_loops``, which shares the
branches' checks (:func:`first_gather`, :func:`computed_from`, :func:`sliced_from`).
"""

from __future__ import annotations

import functools
import weakref

import numpy as np
import tensorflow as tf

from rewrite import _functions
from rewrite.rules import _base
from rewrite.rules import _random


def needs_gather(have, want) -> bool:
  """Whether a value in layout ``have`` needs a collective to be in layout ``want`` (a dimension's split changes)."""
  return want is not None and have is not None and any(h and h != w for h, w in zip(have, want))


def _communicates(partition) -> str:
  """The first op of a partitioned body that would need a collective ("" if none)."""
  for name, d in partition.decisions.items():
    if any(r is not None for r in d.reduce) or d.communicates or d.fallback or d.unsupported:
      return name
  return ""


_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # graph -> {(op, layouts, mesh): answer}


def _branches(view, layouts):
  """Both branches partitioned, or None and why not (cached: rules run on every propagation pass)."""
  by_op = _CACHE.setdefault(view.op.graph, {})
  key = (view.op.name, repr(layouts), id(view.mesh))
  if key not in by_op:
    by_op[key] = _partitioned_branches(view, layouts)
  return by_op[key]


def _partitioned_branches(view, layouts):
  """Both branches partitioned, or None and why not; a split argument a branch would gather is gathered first.

  A branch that gathers a value computed from split arguments (Keras's
  ``LossScaleOptimizer`` applies Adam in its branch: a replicated variable's
  gradient arrives split when its layer's input is) cannot communicate there,
  but the arguments can be gathered before the ``If``, where a step without
  the conditional would have gathered them too. So those arguments (tensors,
  not a sharded variable's handle) are asked for replicated, and the branches
  partitioned again. Returns ``((parts, output layouts, input layouts), "")``.
  """
  op = view.op
  layouts = list(layouts)
  wanted = [None] * len(op.inputs)  # the If's inputs: as they are, or replicated (gathered before it)
  while True:
    branches, why, gather = _try_branches(view, layouts)
    if branches is not None:
      parts, unified = branches
      return (parts, unified, wanted), ""
    if not gather:
      return None, why
    for k in gather:
      layouts[1 + k] = wanted[1 + k] = _base.replicated(_base.rank_of(op.inputs[1 + k]))


def _try_branches(view, layouts):
  """``(branches or None, why not, the split tensor arguments whose gathering before the If would help)``."""
  op = view.op
  args = list(op.inputs[1:])
  parts = []
  for side, attr in enumerate(("then_branch", "else_branch")):
    body = _functions.body(op, attr, args)
    given = {x.name: _side(layout, side) for x, layout in zip(body.inputs, layouts[1:]) if layout is not None}
    handle_shapes = {x.name: view.handle_shapes[t.name] for x, t in zip(body.inputs, args)
                     if t.name in view.handle_shapes}
    summed = {x.name for x, t in zip(body.inputs, args) if t.name in view.summed}
    partition = view.bodies.propagate(body, view.mesh, given, handle_shapes, summed,
                                      random_salt=_random.body_salt(op, attr))
    gather = first_gather(body, partition)
    if gather is not None:
      o, t = gather
      return None, f"{o.type} {o.name} in its {attr} gathers a split input", _split_arguments(body, [t], layouts)
    busy = _communicates(partition)
    if busy:  # a partial sum, say: gathering its inputs would send more than its collective (left to the fallback)
      return None, f"{busy} in its {attr} needs communication", []
    parts.append((body, partition))
  outs = [[p.layouts.get(t.name) for t in body.outputs] for body, p in parts]
  unified = [_unify(a, b) for a, b in zip(*outs)]
  if any(u is _DIFFERENT for u in unified):
    return None, "its branches give their outputs different layouts", []
  return (parts, unified), "", []


def _split_arguments(body, tensors, layouts) -> list[int]:
  """The branch arguments that ``tensors`` are computed from, if every split one among them is a tensor.

  Empty if none is split, or if one is a sharded variable's handle or a
  variant (neither can be gathered): then gathering arguments cannot help.
  """
  found = set()
  for k in computed_from(body, tensors):
    layout = layouts[1 + k]
    if isinstance(layout, _base.Contents):
      if _base.holds_split(layout):
        return []
    elif layout is not None and any(layout):
      if body.inputs[k].dtype in (tf.resource, tf.variant):
        return []
      found.add(k)
  return sorted(found)


def computed_from(body, tensors) -> list[int]:
  """The positions of the arguments of function body ``body`` that ``tensors`` (its tensors) are computed from.

  A variable's handle is followed no further than the handle (a read is
  computed from it, not from what wrote the variable).
  """
  position = {x.name: k for k, x in enumerate(body.inputs)}
  found, seen, stack = set(), set(), [t for t in tensors if t.dtype != tf.resource]
  while stack:
    t = stack.pop()
    if t.name in seen:
      continue
    seen.add(t.name)
    k = position.get(t.name)
    if k is None:
      # IdentityN passes each input to its output alone (tf.distribute's all_reduce of a replica context that
      # has one replica: every gradient through one op).
      stack.extend([t.op.inputs[t.value_index]] if t.op.type == "IdentityN" else t.op.inputs)
      continue
    found.add(k)
  return sorted(found)


def first_gather(body, partition):
  """``(op, tensor)``: the first op of a partitioned body that would gather a split input ``tensor``; else None."""
  for o in body.get_operations():
    d = partition.decisions.get(o.name)
    if d is None:
      continue
    for i, t in enumerate(o.inputs):
      want = d.inputs[i] if i < len(d.inputs) else None
      if t.dtype != tf.resource and needs_gather(partition.layouts.get(t.name), want):
        return o, t
  return None


_DIFFERENT = object()


class Either(_base.Contents):
  """A variant output of an ``If`` that holds different things per branch: ``(then's, else's)`` contents.

  A ``tf.cond`` under a gradient tape returns both branches' intermediates
  in shared optional slots (the same position holds a then-intermediate or
  an else-intermediate); its gradient's ``If`` reads each with the same
  predicate, so each of its branches sees its own side.
  """


def _side(layout, side: int):
  return layout[side] if isinstance(layout, Either) else layout


def sliced_from(target, source) -> bool:
  """Whether a value in layout ``source`` becomes one in ``target`` by a local slice (no communication)."""
  return (target is not None and source is not None and len(target) == len(source)
          and all(not s or s == t for s, t in zip(source, target)))


def _unify(a, b):
  """One layout for an output both branches give (variants: what each branch's holds).

  Tensors: the same layout, or the more split one where the other branch's
  value is sliced to it (a branch returning zeros, say), locally.
  """
  if isinstance(a, _base.Contents) and isinstance(b, _base.Contents):
    return a if a == b or not b else b if not a else Either((a, b))
  if a == b or sliced_from(a, b):
    return a
  return b if sliced_from(b, a) else _DIFFERENT


@_base.register("OptionalFromValue")
def optional_from_value(view, layouts):
  return _base.Decision(inputs=[None] * len(layouts), outputs=[_base.Contents(layouts)])


@_base.register("OptionalNone")
def optional_none(view, layouts):
  return _base.Decision(inputs=[], outputs=[_base.Contents(())])


@_base.register("OptionalGetValue")
def optional_get_value(view, layouts):
  contents = layouts[0]
  if not isinstance(contents, _base.Contents) or len(contents) != len(view.op.outputs):
    return _base.fallback(view, layouts)  # what it holds is not known: replicated
  shapes = [view.local_shape(t.shape.as_list(), layout, np.int64).tolist() if layout else t.shape
            for t, layout in zip(view.op.outputs, contents)]
  types = [t.dtype for t in view.op.outputs]

  def lower(r, inputs):  # the attribute that states its outputs' shapes gets the local ones
    return tf.raw_ops.OptionalGetValue(optional=inputs[0], output_types=types, output_shapes=shapes)

  return _base.Decision(inputs=[None], outputs=list(contents), lower=lower)


@_base.register("OptionalHasValue")
def optional_has_value(view, layouts):
  return _base.Decision(inputs=[None], outputs=[()])


@_base.register("If", "StatelessIf")
def if_(view, layouts):
  branches, why = _branches(view, layouts)
  if branches is None:
    decision = _base.fallback(view, layouts)
    if decision.unsupported:
      decision.unsupported = f"{decision.unsupported} ({why})"
    elif decision.fallback:
      decision.why = why
    return decision
  parts, out_layouts, in_layouts = branches
  (then_body, then_part), (else_body, else_part) = parts
  kept = []

  def lower(r, inputs):
    pred, args = inputs[0], list(inputs[1:])
    specs = [tf.TensorSpec(x.shape, x.dtype) for x in args]
    branches = [tf.function(functools.partial(_on_device, view, body, part, r, out_layouts),
                            autograph=False).get_concrete_function(*specs)
                for body, part in ((then_body, then_part), (else_body, else_part))]
    for branch in branches:
      branch.add_to_graph()  # into the expansion's graph, whose library goes with it
    # Alive as long as the decision (the built step keeps its partition): a collected function is removed
    # from TensorFlow's runtime by name, and the step's imported copy of it with it.
    kept.extend(branches)
    make = tf.raw_ops.If if view.op.type == "If" else tf.raw_ops.StatelessIf
    outputs = make(cond=pred, input=args, Tout=[t.dtype for t in view.op.outputs], then_branch=branches[0],
                   else_branch=branches[1])
    return list(outputs) if isinstance(outputs, (list, tuple)) else []

  return _base.Decision(inputs=in_layouts, outputs=out_layouts, lower=lower)


def _on_device(view, body, partition, r, outputs, *args):
  """Device ``r``'s copy of a branch, made in the function being traced, with the functions it calls."""
  _functions.import_called(view.op)
  return view.bodies.expand_on_device(body, view.mesh, partition, r, *args, outputs=outputs)
