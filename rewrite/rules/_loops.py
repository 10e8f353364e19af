"""Rules for while loops: a ``While`` whose body runs on each device's pieces, its loop variables keeping their splits.

A ``tf.while_loop`` (Keras's ``LSTM`` and ``GRU`` on TensorFlow, ``tf.scan``,
AutoGraph's ``while`` and ``for`` over tensors) is one ``While`` op calling a
condition and a body; under a gradient tape its body pushes what the
gradient needs onto lists (``_tensor_lists``), and the gradient is another
``While`` that pops them. Both are partitioned alike: the condition and the
body as the step is (``OpView.bodies``), their arguments in the loop
variables' layouts, to a fixed point. A loop variable the body gives back
in another layout enters the loop in the one both reach by a local slice (a
batch-split input makes the recurrent state split: the initial state is
sliced, for free); a list made empty before the loop is made with the
pieces' shape; a split value from which the body would gather a value is
gathered before the loop instead, and stays whole in it. Counters and other
scalars are whole on every device, so every device runs the same number of
iterations.

A loop variable that only accumulates partial sums (the gradient of a
weight, summed over the time steps, each step's a sum over the split batch)
holds each device's part through the loop (one device starts from the value
it enters with, the others from zeros), and is all-reduced once, after the
loop. Then each device runs a ``While`` over its own copies of the condition
and the body, made per device (``OpView.bodies.expand_on_device``).

A loop whose condition or body needs other collectives (a sum or a maximum
over a split dimension read in the body, a column-parallel layer's output
gathered, a row-parallel one's all-reduced: Keras's ``LSTM`` with its kernel
split over a model axis, a decoding loop over split weights) is partitioned
again, with them allowed: each device's copies make them, as TensorFlow's
collective ops, every iteration (``_control_flow.InBody``). Every device
runs as many iterations as the others (the counters are whole on every
device) and asks for the same collectives in the same order; the loop
carries the device's ordering token. On a mesh whose devices are in several
processes (a multi-client job: each process makes its own devices' copies)
the keys of those collectives are ones every process computes alike, and
they wait at most the step's collective timeout. A print in the body runs
in the first device's copy, once an iteration (a summary's writer cannot go
to the other devices' copies: see below). Values the body passes on
unchanged are still gathered once before the loop; a loop variable the
body gives back in another layout is relayouted at the body's end; the
partial sums that only accumulate are still summed after the loop. So is
the gradient's loop, which pops the lists this loop pushes.

What still falls back (gathered, replicated), naming the op
(``Decision.why``): a loop whose body communicates and has an op that is
refused (a sharded variable used by an op without a rule: then the loop is
refused too, as it cannot gather the handle) or writes a summary (refused
too, its outputs being used: every device's copy would write it); a loop
whose gradient's loop would not run partitioned (the gradient could not
gather the lists of pieces this loop pushes: a loop in a loop under a
gradient tape). The lists a fallback takes are made of whole elements by
their makers (a list cannot be gathered; others are refused), as is a
sharded variable's handle.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

import tensorflow as tf

from rewrite import _functions
from rewrite.rules import _base
from rewrite.rules import _control_flow
from rewrite.rules import _random
from rewrite.rules import _tensor_lists

_MAKERS = ("EmptyTensorList", "TensorListReserve")  # ops making a list that holds nothing yet

# Ops linear in the inputs at these positions (None: every input), which must all hold partial sums over the same
# axes (a partial sum plus a whole value is not a partial sum): what may come between a partial sum and the loop
# variable that accumulates it.
_LINEAR = {
    "Identity": None, "Snapshot": None, "AddN": None, "AddV2": None, "Add": None, "Sub": None, "Neg": None,
    "Pack": None, "Reshape": (0,), "ExpandDims": (0,), "Squeeze": (0,), "Transpose": (0,), "StridedSlice": (0,),
    "Slice": (0,), "StridedSliceGrad": (4,), "ConcatV2": "values", "Mul": "scaled",
}


@dataclasses.dataclass
class _Loop:
  """A ``While`` partitioned: its condition and body, the loop variables' layouts, the partial sums it carries."""

  cond: tf.Graph
  cond_partition: object
  body: tf.Graph
  body_partition: object
  carried: list  # per loop variable, its layout through the loop
  summed: dict  # loop variable index -> the mesh axes its partial sums are summed over after the loop
  talk: bool = False  # whether its condition or body may communicate inside (each device's copy, each iteration)

  def ends(self) -> list:
    """Per output of the body, the layout it is sliced to at the body's end (None: as it is)."""
    return [None if self.body_partition.layouts.get(t.name) is None else layout
            for t, layout in zip(self.body.outputs, self.carried)]


_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # graph -> {(op, layouts, mesh): answer}
_GRAPHS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # graph -> {op name: (cond, body)}


def _graphs(op):
  """The loop's condition and body as graphs (made once: their partitions change, not they)."""
  by_op = _GRAPHS.setdefault(op.graph, {})
  if op.name not in by_op:
    args = list(op.inputs)
    by_op[op.name] = (_functions.body(op, "cond", args), _functions.body(op, "body", args))
  return by_op[op.name]


def _loop(view, layouts):
  """The loop partitioned, or None and why not (cached: rules run on every propagation pass)."""
  by_op = _CACHE.setdefault(view.op.graph, {})
  key = (view.op.name, repr(layouts), id(view.mesh))
  if key not in by_op:
    loop, why = _settled(view, layouts)
    if loop is not None:
      why = _gradient_fails(view, loop)
      loop = None if why else loop
    by_op[key] = loop, why
  return by_op[key]


def _gradient_fails(view, loop) -> str:
  """Why the gradient's loop of this loop could not run partitioned with it ("" if it can, or there is none).

  The gradient's loop pops the lists this loop pushes; if it fell back, it
  could not gather lists holding pieces (it would be refused). So a loop
  runs partitioned only if its gradient's does too, tried with the layouts
  this loop gives it (its other inputs, the incoming gradients, whole: the
  fixed point splits them as the body does).
  """
  for consumer in {c for t in view.op.outputs for c in t.consumers()}:
    if consumer.type not in ("While", "StatelessWhile") or not any(
        t.op is view.op and t.dtype == tf.variant and _base.holds_split(loop.carried[t.value_index] or ())
        for t in consumer.inputs):
      continue
    # (Its other lists, of layouts not known here, may hold whatever its body puts in them.)
    layouts = [loop.carried[t.value_index] if t.op is view.op else _base.replicated(_base.rank_of(t))
               for t in consumer.inputs]
    free = frozenset(k for k, t in enumerate(consumer.inputs) if t.op is not view.op and t.dtype == tf.variant)
    gradient, why = _settled(dataclasses.replace(view, op=consumer, wants=[]), layouts, free)
    if gradient is None:
      return f"its gradient's loop {consumer.name} would not run partitioned ({why})"
  return ""


def _settled(view, layouts, free=frozenset()):
  """The loop partitioned communicating nothing inside, if it can be; else with collectives inside; or None and why.

  The second try (``talk``) places in each device's copy of the condition and
  the body the collectives they need (``_control_flow.InBody``), where the
  first would fall back.
  """
  loop, why = _settled_as(view, layouts, free, talk=False)
  if loop is not None:
    return loop, ""
  loop, talked = _settled_as(view, layouts, free, talk=True)
  return (loop, "") if loop is not None else (None, talked or why)


def _settled_as(view, layouts, free, talk):
  """The loop variables' layouts at a fixed point of the body, and the partitions there; or None and why not.

  Each round partitions the condition and the body with the loop variables
  in their current layouts, and changes them where that is needed and free:
  a variable the body gives back more finely split enters so (sliced before
  the loop), a list that holds nothing known enters holding what the body
  puts in it, a split value the body would gather is gathered before the
  loop (and kept whole). Each change splits a variable more, or gathers one
  for good, so the rounds end.
  """
  carried = list(layouts)
  pinned: set = set()  # loop variables gathered before the loop: whole through it
  for _ in range(4 * len(carried) + 4):
    loop, why, change, gathered = _try(view, carried, pinned, free, talk)
    if loop is not None:
      return loop, ""
    if not change and not gathered:
      return None, why
    carried = [change.get(k, layout) for k, layout in enumerate(carried)]
    for k in gathered:
      carried[k] = _base.replicated(_base.rank_of(view.op.inputs[k]))
      pinned.add(k)
  return None, "its loop variables' layouts do not settle"


def _partition(view, graph, attr, carried):
  given = {x.name: layout for x, layout in zip(graph.inputs, carried) if layout is not None}
  args = list(view.op.inputs)
  handle_shapes = {x.name: view.handle_shapes[t.name] for x, t in zip(graph.inputs, args)
                   if t.name in view.handle_shapes}
  summed = {x.name for x, t in zip(graph.inputs, args) if t.name in view.summed}
  return view.bodies.propagate(graph, view.mesh, given, handle_shapes, summed,
                               random_salt=_random.body_salt(view.op, attr))


def _try(view, carried, pinned, free=frozenset(), talk=False):
  """``(loop or None, why not, loop variable -> a finer layout, loop variables to gather)``: the changes that may
  help (see :func:`_settled_as`). ``free``: lists that may enter holding anything (a trial's, see
  :func:`_gradient_fails`). ``talk``: the condition and the body may communicate inside; then only values the
  body passes on unchanged are gathered before the loop (once, not each iteration), and a loop variable the
  body gives back in a layout that no local slice takes to the one it enters with is relayouted at the body's
  end."""
  op = view.op
  cond, body = _graphs(op)
  partitions = {}
  for attr, graph in (("cond", cond), ("body", body)):
    partition = _partition(view, graph, attr, carried)
    gather = _control_flow.first_gather(graph, partition)
    if gather is not None:
      o, t = gather
      why = f"{o.type} {o.name} in its {attr} gathers a split input"
      before = _gathered_before(graph, t, carried, pinned)
      if not talk or (before and all(_passed_on(body, k) for k in before)):
        return None, why, {}, before
    if talk:
      refused = _control_flow.cannot_communicate(view, graph, partition)
      if refused:
        return None, f"its {attr} would communicate inside, and {refused}", {}, ()
    else:
      busy = _communicates(graph, partition, sums=attr == "body")
      if busy:
        return None, f"{busy} in its {attr} needs communication", {}, ()
    partitions[attr] = partition
  change, lists = {}, {}  # (the lists' layouts follow the values put in them: changed once those settle)
  for k, (x, t) in enumerate(zip(body.inputs, body.outputs)):
    have, out = carried[k], partitions["body"].layouts.get(t.name)
    if x.dtype == tf.resource or _same(have, out):
      continue
    if x.dtype == tf.variant:
      if isinstance(out, _base.Contents) and (k in free or _takes(view, op.inputs[k], out)):
        lists[k] = out  # a list made empty before the loop: made to hold the pieces the body puts in it
        continue
      return None, f"its body gives the list it carries as loop variable {k} another layout ({out}, not {have})", {}, ()
    if _control_flow.sliced_from(have, out) or (out is None and not any(have or ())):
      continue  # the body's value sliced to the loop variable's layout at its end; or whole (of unknown rank)
    finer = _refinement(view, op.inputs[k], have, out)
    if finer is None or k in pinned:
      if talk and have is not None and out is not None and len(have) == len(out):
        continue  # relayouted at the body's end (a gather, each iteration)
      return None, (f"its body gives loop variable {k} ({t.op.name}) the layout {out}, and it enters as {have}: "
                    "neither reaches the other by a local slice"), {}, ()
    change[k] = finer  # sliced before the loop
  if change or lists:
    return None, "its loop variables change their layouts", change or lists, ()
  summed, dropped, why = _partial_sums(body, partitions["body"], cond, talk)
  if summed is None:
    return None, why, {}, ()
  body_partition = partitions["body"]
  if dropped:  # each device's part of the sums, summed after the loop
    decisions = dict(body_partition.decisions)
    for name in dropped:
      decisions[name] = dataclasses.replace(decisions[name], reduce=[None] * len(decisions[name].reduce))
    body_partition = dataclasses.replace(body_partition, decisions=decisions)
  return _Loop(cond, partitions["cond"], body, body_partition, list(carried), summed, talk), "", {}, ()


def _passed_on(body, k) -> bool:
  """Whether the body gives loop variable ``k`` back as it got it (through identities)."""
  t = body.outputs[k]
  while t.op.type in ("Identity", "Snapshot"):
    t = t.op.inputs[0]
  return t is body.inputs[k]


def _same(a, b) -> bool:
  return a == b and isinstance(a, _base.Contents) == isinstance(b, _base.Contents)


def _takes(view, t, contents) -> bool:
  """Whether list ``t`` (a loop's input) is made empty before the loop, and can be made holding ``contents``."""
  t = _maker(t)
  if t.op.type not in _MAKERS:
    return False
  layout = _tensor_lists.element(contents)
  shape = view.values(t.op.inputs[0])
  if layout is None or shape is None or shape.ndim != 1 or isinstance(layout, _base.Contents):
    return layout is not None
  return len(shape) == len(layout) and all(n < 0 or not axes or n % view.shards(axes) == 0
                                           for n, axes in zip(shape.tolist(), layout))


def _refinement(view, t, a, b):
  """The layout that both ``a`` and ``b`` reach by a local slice (each dimension split as the one that splits it),
  if there is one and it divides ``t``'s shape; else None."""
  if a is None or b is None or len(a) != len(b) or t.shape.rank is None:
    return None
  out, used = [], set()
  for n, x, y in zip(t.shape.as_list(), a, b):
    axes = x or y
    if (x and y and x != y) or (axes and (n is None or n % view.shards(axes) or used & set(axes))):
      return None
    used |= set(axes)
    out.append(axes)
  return tuple(out)


def _gathered_before(graph, t, carried, pinned) -> list:
  """The split loop variables ``t`` is computed from, to gather before the loop (empty: that cannot help)."""
  found = []
  for k in _control_flow.computed_from(graph, [t]):
    layout, x = carried[k], graph.inputs[k]
    if isinstance(layout, _base.Contents):
      if _base.holds_split(layout):
        return []  # a list holding pieces cannot be gathered
    elif layout is not None and any(layout):
      if x.dtype in (tf.resource, tf.variant) or k in pinned:
        return []
      found.append(k)
  return found


def _communicates(graph, partition, sums: bool) -> str:
  """The first op of a partitioned condition or body that would need a collective, as ``"type name"`` ("" if none).

  With ``sums``, an op whose output holds partial sums is left to :func:`_partial_sums`.
  """
  for name, d in partition.decisions.items():
    if d.communicates or d.fallback or d.unsupported or (any(r is not None for r in d.reduce) and (
        not sums or any(d.scatter.values()) or any(r is not None and r[0] != "sum" for r in d.reduce))):
      return f"{graph.get_operation_by_name(name).type} {name}"
  return ""


def _partial_sums(body, partition, cond, talk=False):
  """``(loop variable -> axes, ops whose all-reduce is left out, "")`` of the partial sums a body accumulates.

  An op of the body that leaves partial sums (a contraction over the split
  batch: a weight's gradient at one time step) needs no all-reduce in the
  loop if its sums only add up into a loop variable (through ops linear in
  them, ``_LINEAR``) and nothing else reads them or it: each device carries
  its part, and the loop's output is summed once. Returns ``(None, None,
  why)`` if an op reads a partial sum otherwise; with ``talk``, the ops whose
  partial sums are read so are all-reduced inside the loop instead (as are
  partial maxima, and sums scattered), and the others left to the loop's end.
  """
  seeds = {}  # tensor name -> (axes, the op whose partial sums it holds)
  for o in body.get_operations():
    d = partition.decisions.get(o.name)
    if d is not None:
      seeds.update({o.outputs[j].name: (tuple(r[1]), o.name) for j, r in enumerate(d.reduce)
                    if r is not None and (not talk or (r[0] == "sum" and not d.scatter.get(j)))})
  while True:
    carried, why, culprits = _accumulated(body, partition, cond, seeds)
    if carried is not None:
      return carried, tuple(sorted({name for _, name in seeds.values()})), ""
    if not talk or not culprits:
      return None, None, why
    seeds = {t: seed for t, seed in seeds.items() if seed[1] not in culprits}  # all-reduced inside the loop


def _accumulated(body, partition, cond, seeds):
  """``(loop variable -> axes, "", ())`` of the loop variables accumulating the partial sums ``seeds``; or
  ``(None, why, the ops whose partial sums are read otherwise)``."""
  if not seeds:
    return {}, "", ()
  partial, why, culprits = _spread(body, partition, seeds, lenient=True)  # which loop variables accumulate, at most
  if partial is None:
    return None, why, culprits
  carried = {k: partial[t.name] for k, t in enumerate(body.outputs) if t.name in partial}
  for _ in range(len(body.outputs) + 1):
    partial, why, culprits = _spread(body, partition, {**seeds, **{body.inputs[k].name: a for k, a in carried.items()}},
                                     lenient=False)
    if partial is None:
      return None, why, culprits
    now = {k: partial[t.name] for k, t in enumerate(body.outputs) if t.name in partial}
    if now == carried:
      break
    carried = now
  else:
    return None, "the partial sums its body carries do not settle", {name for _, name in seeds.values()}
  for k, (_, origins) in carried.items():
    if body.inputs[k].dtype == tf.bool:
      return None, f"loop variable {k} would carry partial sums of booleans", origins
    if cond.inputs[k].consumers():
      return None, f"its condition reads loop variable {k}, which carries partial sums", origins
  return {k: axes for k, (axes, _) in carried.items()}, "", ()


def _spread(body, partition, seeds: dict, lenient: bool):
  """``(tensor name -> (axes, origins), "", ())``: the tensors of ``body`` holding partial sums, from ``seeds``
  (origins: the ops whose partial sums they hold); or ``(None, why, the origins of those an op reads otherwise)``.

  ``lenient``: an op adding a partial sum and a value that is not one is let
  through (the value may be a loop variable that accumulates, found after).
  """
  partial = {name: (axes, frozenset([origin]) if isinstance(origin, str) else origin)
             for name, (axes, origin) in seeds.items()}
  for o in body.get_operations():
    d = partition.decisions.get(o.name)
    ins = [partial.get(t.name) for t in o.inputs]
    if d is None or all(a is None for a in ins):
      continue
    need = f"{o.type} {o.name} in its body reads a partial sum (it needs communication)"
    culprits = frozenset().union(*(a[1] for a in ins if a is not None))
    if any(r is not None for r in d.reduce):
      return None, need, culprits
    if o.type == "IdentityN":
      partial.update({t.name: a for t, a in zip(o.outputs, ins) if a is not None})
      continue
    positions = _LINEAR.get(o.type, False)
    if positions is False:
      return None, need, culprits
    if positions == "scaled":  # one factor a partial sum, the other the same on every device it is summed over
      summed = [(i, a) for i, a in enumerate(ins) if a is not None]
      if len(summed) != 1:
        return None, need, culprits
      (i, (axes, origins)), = summed
      other = partition.layouts.get(o.inputs[1 - i].name)
      if isinstance(other, _base.Contents) or set(axes) & _base.axes_in(other):
        return None, need, culprits
    else:
      if positions is None:
        positions = range(len(o.inputs))
      elif positions == "values":
        positions = range(len(o.inputs) - 1)
      if any(a is not None for i, a in enumerate(ins) if i not in positions):
        return None, need, culprits
      found = {ins[i][0] if ins[i] is not None else None for i in positions}
      if len(found - {None}) != 1 or (None in found and not lenient):
        return None, need, culprits
      (axes,) = found - {None}
      origins = frozenset().union(*(ins[i][1] for i in positions if ins[i] is not None))
    for t in o.outputs:
      partial[t.name] = (axes, origins)
  return partial, "", ()


@_base.register("While", "StatelessWhile")
def while_(view, layouts):
  """Each device loops over its pieces (its own copies of the condition and body); else the fallback, saying why."""
  loop, why = _loop(view, layouts)
  if loop is None:
    return _fallback(view, layouts, why)
  op, mesh = view.op, view.mesh
  inputs = [layout if t.dtype == tf.resource else carried
            for t, layout, carried in zip(op.inputs, layouts, loop.carried)]
  shapes = [_local_shape(view, t, layout) for t, layout in zip(op.outputs, loop.carried)]
  inside: list = []  # the collectives inside its condition and body (repl.explain's)
  talks = (None, None)
  if loop.talk:  # (each device's copy lowers its own; the loop carries the device's ordering token)
    talks = (_control_flow.InBody(view, loop.cond, loop.cond_partition, "cond", inside),
             _control_flow.InBody(view, loop.body, loop.body_partition, "body", inside,
                                  again="relayouted at the body's end, for the next iteration"))
  nested = _control_flow.Nested(inside, [("cond", loop.cond, loop.cond_partition),
                                         ("body", loop.body, loop.body_partition)])
  kept = []

  def lower(r, args):
    args = list(args)
    for k, axes in loop.summed.items():  # one device of each group starts the sum from the value, the others from 0
      if mesh.axis_index(r, axes):
        args[k] = tf.zeros_like(args[k])
    if loop.talk:
      args.append(_control_flow.ordering_token(r))
    specs = [tf.TensorSpec(x.shape, x.dtype) for x in args]
    cond = tf.function(functools.partial(_on_device, view, loop.cond, loop.cond_partition, r, None, talks[0]),
                       autograph=False).get_concrete_function(*specs)
    body = tf.function(functools.partial(_on_device, view, loop.body, loop.body_partition, r, loop.ends(), talks[1]),
                       autograph=False).get_concrete_function(*specs)
    nested.lowered(r)
    for function in (cond, body):
      function.add_to_graph()  # into the expansion's graph, whose library goes with it
    kept.extend((cond, body))  # alive as long as the decision (see the If's rule)
    make = tf.raw_ops.While if op.type == "While" or loop.talk else tf.raw_ops.StatelessWhile
    outputs = make(input=args, cond=cond, body=body, output_shapes=shapes + [tf.TensorShape([])] * loop.talk,
                   parallel_iterations=op.get_attr("parallel_iterations"))
    return list(outputs)[:len(op.outputs)]

  reduce = [("sum", loop.summed[k]) if k in loop.summed else None for k in range(len(op.outputs))]
  return _base.Decision(inputs=inputs, outputs=list(loop.carried), reduce=reduce, lower=lower, inside=inside)


def _fallback(view, layouts, why):
  """The fallback (``why`` said), its lists of pieces made of whole elements by their makers instead.

  A list cannot be gathered; a list made before the loop from a split tensor
  (the sequence of an RNN), or made empty, is made of whole elements where
  the loop wants it so. Other lists holding pieces are refused.
  """
  wanted = {}
  for k, (t, layout) in enumerate(zip(view.op.inputs, layouts)):
    elements = _tensor_lists.element(layout)
    if t.dtype == tf.variant and elements is not None and not isinstance(elements, _base.Contents) \
        and any(elements) and _maker(t).op.type in _tensor_lists.MAKERS:
      wanted[k] = _tensor_lists.holding(_base.replicated(len(elements)))
  decision = _base.fallback(view, [wanted.get(k, layout) for k, layout in enumerate(layouts)])
  for k, layout in wanted.items():
    decision.inputs[k] = layout  # (asked of its maker: the next propagation pass gives it)
  if decision.unsupported:
    decision.unsupported = f"{decision.unsupported} ({why})"
  elif decision.fallback:
    decision.why = why
  return decision


def _maker(t):
  """The tensor ``t`` is an Identity of (itself if none)."""
  while t.op.type == "Identity":
    t = t.op.inputs[0]
  return t


def _on_device(view, graph, partition, r, outputs, talk, *args):
  """Device ``r``'s copy of the loop's condition or body (``graph``), made in the function being traced.

  Beyond the loop variables, a loop whose copies communicate carries the device's ordering token (the last
  argument): its collectives take it (``talk``, its ``InBody``; None: this one does not communicate), and the
  body gives it back.
  """
  _functions.import_called(view.op)  # the functions it calls (a Defun's, as CTC's loops call them)
  n = len(graph.inputs)
  token = list(args[n:])
  extra = {} if talk is None else {"collectives": functools.partial(talk, token[0])}
  pieces = view.bodies.expand_on_device(graph, view.mesh, partition, r, *args[:n], outputs=outputs, **extra)
  return pieces if outputs is None else pieces + token  # (the condition gives its predicate; the body, the token)


def _local_shape(view, t, layout) -> tf.TensorShape:
  """Loop variable ``t``'s shape on each device (a list's or a handle's: a scalar)."""
  if t.dtype in (tf.resource, tf.variant) or layout is None or t.shape.rank is None:
    return t.shape
  return tf.TensorShape([n if n is None or not axes else n // view.shards(axes)
                         for n, axes in zip(t.shape.as_list(), layout)])
