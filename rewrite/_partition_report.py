"""What a partition of a global graph does, row by row: the report ``repl.explain`` prints in the global view.

It answers "why does this step communicate that much?": the layout and size per
device of every variable and input, every collective with the op that required
it and the user's source line, every relayout (an op input whose required layout
differs from the tensor's: a free local slice or an ``all_gather``) and every
fallback (an op without a rule, run on gathered inputs).

Built from what the partitioner and the plan pass already know (a
:class:`_propagation.Partition`, the traced global graph and a :class:`Plan`);
the caller names the inputs and variables. This module knows nothing about
Keras.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from rewrite import _communication
from rewrite import _cost as cost_model
from rewrite import _fusion
from rewrite import _recompute
from rewrite._plan import Collective
from rewrite._plan import Plan
from rewrite.rules import _base

Layout = tuple  # per dimension, the mesh axes it is split over; () for a scalar


def format_layout(layout: Layout | None) -> str:
  """``[batch, -]``: per dimension the axes it is split over (``-``: whole); ``?`` if unknown.

  A dimension merged from several (rows of ``[batch, seq]``) shows its parts' splits: ``batch*seq``.
  """
  if layout is None:
    return "?"
  dims = [_format_merged(axes) if isinstance(axes, _base.Merged) else "-" if not axes else axes[0] if len(axes) == 1
          else "(" + ",".join(axes) + ")" for axes in layout]
  return "[" + ", ".join(dims) + "]"


def _format_merged(merged) -> str:
  return "*".join("-" if not axes else axes[0] if len(axes) == 1 else "(" + ",".join(axes) + ")"
                  for _, axes in merged.parts)


def _format_shape(shape: Sequence[int | None] | None) -> str:
  if shape is None:
    return "?"
  return "[" + ",".join("?" if d is None else str(d) for d in shape) + "]"


def _format_bytes(n: int | None) -> str:
  return "?" if n is None else f"{n:,}"


@dataclasses.dataclass(frozen=True)
class TensorRow:
  """A variable or an input of the step: its global shape and how it is laid out.

  Attributes:
    name: the caller's label (a variable's name, an input's position in the batch).
    tensor: the tensor of the global graph (a variable's resource handle).
    shape: the global shape.
    dtype: the dtype's name.
    layout: per dimension, the mesh axes it is split over.
    bytes_per_device: bytes of one device's piece.
    owner: for a variable a sharded update keeps current on one device of each
      batch group only (an optimizer's slot): "position p along <axes>"; else "".
    chosen_by: for a variable, what chose its layout, as the caller says it
      (the layout map's key that matched its path, say); else "".
  """

  name: str
  tensor: str
  shape: tuple[int, ...]
  dtype: str
  layout: Layout
  bytes_per_device: int | None
  owner: str = ""
  chosen_by: str = ""


@dataclasses.dataclass(frozen=True)
class CollectiveRow:
  """One collective of the plan, with the op of the global graph that required it.

  Attributes:
    index: position in call order.
    kind: "all_reduce", "all_gather", ...
    op: its reduction ("sum", ...) for reductions, else "".
    axes: mesh axes communicated over.
    dtype: the payload's dtype name.
    shape: one device's input shape.
    bytes_per_device: bytes of one device's input (None if not static).
    bytes_per_step: bytes of every device's input, summed.
    op_type: type of the op that required it (a contraction over a split dimension, say).
    op_name: that op's name in the global graph.
    why: what it completes: "partial sum" (the op's output holds partial sums),
      "gather <tensor> dim d (input i)" (a relayout of the op's input i),
      "sharded update: ..." (a value one device of each group computed, for the op).
    location: the user's source line of that op.
  """

  index: int
  kind: str
  op: str
  axes: tuple[str, ...]
  dtype: str
  shape: tuple[int | None, ...] | None
  bytes_per_device: int | None
  bytes_per_step: int
  op_type: str
  op_name: str
  why: str
  location: str


@dataclasses.dataclass(frozen=True)
class RelayoutRow:
  """An op input whose required layout differs from the layout its producer gave the tensor.

  Attributes:
    tensor: the tensor of the global graph.
    source: its layout.
    target: the layout the consuming op requires.
    op_type: the consuming op's type ("return" for a step output, gathered whole).
    op_name: the consuming op's name ("output k" for a step output).
    input: the input's position among the op's inputs (the output's among the step's).
    location: the user's source line of the consuming op (of the producer, for a step output).
    gathered: ``(dimension, axes)`` of every dimension gathered (one ``all_gather``
      each); empty if the relayout only slices locally.
    moved: ``(from dimension, to dimension, axes)`` of every ``all_to_all``
      (axes that split one dimension split another after it).
  """

  tensor: str
  source: Layout
  target: Layout
  op_type: str
  op_name: str
  input: int
  location: str
  gathered: tuple[tuple[int, tuple[str, ...]], ...]
  moved: tuple[tuple[int, int, tuple[str, ...]], ...] = ()

  @property
  def free(self) -> bool:
    """Whether it only slices (every changed dimension goes from whole to split): no communication."""
    return not self.gathered and not self.moved


@dataclasses.dataclass(frozen=True)
class FallbackRow:
  """An op without a layout rule whose inputs were split: it runs on gathered, whole inputs.

  Attributes:
    op_type: the op's type.
    op_name: its name in the global graph.
    location: the user's source line.
    inputs: its input tensors.
    input_layouts: their layouts (before gathering).
    why: for an op whose rule could not partition it, why ("": it has no rule); a loop names the op of its
      body that would communicate.
  """

  op_type: str
  op_name: str
  location: str
  inputs: tuple[str, ...]
  input_layouts: tuple[Layout | None, ...]
  why: str = ""


@dataclasses.dataclass(frozen=True)
class OpTypeTotal:
  """The collectives that ops of one type required: how many of each kind, and their bytes per step."""

  op_type: str
  counts: tuple[tuple[str, int], ...]  # (kind, count), by kind
  bytes_per_step: int


@dataclasses.dataclass
class PartitionReport:
  """How a global-view step is partitioned: layouts, collectives, relayouts and fallbacks.

  ``print`` it for tables; :meth:`summary` gives JSON-able dicts. The plan's
  :attr:`collectives`, :attr:`bytes_per_step` and :attr:`devices` read as on
  the :class:`Plan` it wraps (:attr:`plan`).

  Attributes:
    plan: the rewrite plan of the expanded step.
    mesh_shape: the mesh's axis sizes.
    variables: one row per variable the step uses, in the order given.
    inputs: one row per input of the step, in the order given.
    collective_rows: one row per collective of the plan, in call order.
    inside_rows: one row per collective placed inside a function an op calls (a loop's condition or body, a
      branch of a conditional), which each device's copy makes itself (a loop's, each iteration), not in the
      plan: its ``why`` says where; its ``index``, its position there; ``op_type`` and ``op_name``, the op of
      the body that needs it; ``bytes_per_step``, every device's of one call (a loop's: of one iteration).
    relayouts: every op input (and step output) relayouted, in graph order.
    fallbacks: every op that ran on gathered inputs for want of a rule.
    work: what each device does a step, for the cost model (:meth:`estimate`).
    layout_search: with automatic layouts, the search that chose them
      (``rewrite._search.Result``: every assignment tried, its estimate and
      bytes a device); None otherwise.
    memory_report: set by ``repl.explain``: makes :attr:`memory` on first use.
    runs_as: the plan that runs, if :func:`rewrite.fuse` made some of
      :attr:`plan`'s collectives one; None if it is :attr:`plan`.
  """

  plan: Plan
  mesh_shape: dict[str, int]
  variables: list[TensorRow]
  inputs: list[TensorRow]
  collective_rows: list[CollectiveRow]
  relayouts: list[RelayoutRow]
  fallbacks: list[FallbackRow]
  work: cost_model.Work | None = None
  layout_search: Any = None
  runs_as: Plan | None = None
  memory_report: Callable[[], Any] | None = dataclasses.field(default=None, compare=False, repr=False)
  inside_rows: list[CollectiveRow] = dataclasses.field(default_factory=list)

  @property
  def memory(self):
    """What each device holds in the step (:class:`rewrite.MemoryReport`), if ``repl.explain`` made the report."""
    return None if self.memory_report is None else self.memory_report()

  @classmethod
  def from_partition(cls, graph: tf.Graph, partition, plan: Plan, mesh_shape: Mapping[str, int], *,
                     inputs: Mapping[str, str], variables: Mapping[str, tf.TensorSpec],
                     outputs: Sequence[tf.Tensor] = (),
                     locate: Callable[[tf.Operation], str] = lambda op: "<unknown location>",
                     ownership=None, chosen_by: Mapping[str, str] | None = None) -> PartitionReport:
    """The report of ``partition`` of ``graph``, expanded and planned into ``plan``.

    Args:
      graph: the traced global graph.
      partition: its ``Partition`` (``layouts``: tensor name -> layout;
        ``decisions``: op name -> decision with ``inputs``, ``outputs``,
        ``reduce``, ``fallback``; ``fallbacks``: op names).
      plan: the plan of the expanded graph's placeholders.
      mesh_shape: axis name -> size.
      inputs: tensor name of each of the step's inputs -> its label.
      variables: tensor name of each variable's resource handle -> a spec with
        its label (``name``), global shape and dtype.
      outputs: the step's outputs (gathered whole on every device).
      locate: the user's source line of an op.
      ownership: the sharded update's owners (``_partition_owners.Ownership``), if any.
      chosen_by: tensor name of a variable's handle -> what chose its layout.

    Returns:
      The report.
    """
    mesh_shape = dict(mesh_shape)
    layouts = partition.layouts
    owned = ownership.variables if ownership is not None else {}
    chosen_by = chosen_by or {}
    variable_rows = [_tensor_row(spec.name, name, spec.shape, spec.dtype, layouts.get(name), mesh_shape,
                                 _owner_label(owned.get(name)), chosen_by.get(name, ""))
                     for name, spec in variables.items()]
    input_rows = []
    for name, label in inputs.items():
      t = graph.get_tensor_by_name(name)
      input_rows.append(_tensor_row(label, name, t.shape, t.dtype, layouts.get(name), mesh_shape))
    relayouts, expected = _relayouts(graph, partition, outputs, locate, mesh_shape)
    for (op_name, index), owner in (ownership.broadcasts.items() if ownership is not None else ()):
      why = f"sharded update: input {index}, computed by {_owner_label(owner)} only"
      expected[op_name].appendleft(("broadcast", owner.axes, why))
    fallbacks = []
    for name in partition.fallbacks:
      op = graph.get_operation_by_name(name)
      fallbacks.append(FallbackRow(op.type, name, locate(op), tuple(t.name for t in op.inputs),
                                   tuple(layouts.get(t.name) for t in op.inputs),
                                   getattr(partition.decisions.get(name), "why", "")))
    rows = [_collective_row(c, expected) for c in plan.collectives]
    inside = [_inside_row(graph.get_operation_by_name(name), where, record, why, locate, math.prod(mesh_shape.values()))
              for name, d in partition.decisions.items() for where, record, why in getattr(d, "inside", ())]
    work = cost_model.work(graph, partition, mesh_shape, outputs, ownership)
    return cls(plan, mesh_shape, variable_rows, input_rows, rows, relayouts, fallbacks, work, inside_rows=inside)

  def estimate(self, machine: cost_model.Machine) -> cost_model.Estimate:
    """The step's estimated time on ``machine`` (``replicator.calibrate()``), from :attr:`work`.

    The cost model (``rewrite._cost``) prices each device's ops by their
    flops or bytes and each collective by its bytes; it ranks layouts of one
    step, it does not predict a step time to the millisecond.
    """
    return self.work.estimate(machine)

  # -- the plan's ---------------------------------------------------------------

  @property
  def collectives(self) -> tuple[Collective, ...]:
    """The plan's collectives, in call order."""
    return self.plan.collectives

  @property
  def bytes_per_step(self) -> int:
    """Payload bytes entering collectives per step, summed over devices."""
    return self.plan.bytes_per_step

  @property
  def devices(self) -> tuple[str, ...]:
    """The plan's devices, in mesh order."""
    return self.plan.devices

  @property
  def num_replicas(self) -> int:
    """The number of devices."""
    return self.plan.num_replicas

  # -- totals ---------------------------------------------------------------------

  def by_op_type(self) -> list[OpTypeTotal]:
    """The collectives grouped by the type of the op that required them, most bytes first."""
    counts: dict = collections.defaultdict(collections.Counter)
    nbytes: dict = collections.Counter()
    for row in self.collective_rows:
      counts[row.op_type][row.kind] += 1
      nbytes[row.op_type] += row.bytes_per_step
    totals = [OpTypeTotal(t, tuple(sorted(counts[t].items())), nbytes[t]) for t in counts]
    return sorted(totals, key=lambda total: (-total.bytes_per_step, total.op_type))

  def summary(self) -> dict[str, Any]:
    """Every table as lists of dicts (JSON-able: strings, numbers, lists)."""
    return {
        "devices": list(self.devices),
        "mesh": dict(self.mesh_shape),
        "bytes_per_step": self.bytes_per_step,
        "variables": [_jsonable(r) for r in self.variables],
        "inputs": [_jsonable(r) for r in self.inputs],
        "collectives": [_jsonable(r) for r in self.collective_rows],
        "inside": [_jsonable(r) for r in self.inside_rows],
        "by_op_type": [dict(op_type=t.op_type, counts=dict(t.counts), bytes_per_step=t.bytes_per_step)
                       for t in self.by_op_type()],
        "relayouts": [dict(_jsonable(r), free=r.free) for r in self.relayouts],
        "fallbacks": [_jsonable(r) for r in self.fallbacks],
    }

  def __str__(self) -> str:
    mesh = ", ".join(f"{a}: {n}" for a, n in self.mesh_shape.items())
    lines = [f"Global view on {len(self.devices)} device(s), mesh {{{mesh}}}: {len(self.collective_rows)} "
             f"collective(s), {self.bytes_per_step:,} bytes/step"]
    for title, rows in (("Variables", self.variables), ("Inputs", self.inputs)):
      total = sum(r.bytes_per_device or 0 for r in rows)
      lines.append(f"\n{title} ({len(rows)}, {total:,} bytes/device):")
      owners, chosen = any(r.owner for r in rows), any(r.chosen_by for r in rows)
      lines += _table(("name", "shape", "dtype", "layout", "bytes/device") + (("kept current on",) if owners else ())
                      + (("layout from",) if chosen else ()),
                      [(r.name, _format_shape(r.shape), r.dtype, format_layout(r.layout),
                        _format_bytes(r.bytes_per_device)) + ((r.owner or "every device",) if owners else ())
                       + ((r.chosen_by,) if chosen else ()) for r in rows])
    lines.append(f"\nCollectives ({len(self.collective_rows)}, {self.bytes_per_step:,} bytes/step):")
    lines += _table(("#", "collective", "axes", "shape", "bytes/device", "bytes/step", "op", "why", "called at"),
                    [(str(r.index), f"{r.kind}({r.op})" if r.op else r.kind, ",".join(r.axes), _format_shape(r.shape),
                      _format_bytes(r.bytes_per_device), f"{r.bytes_per_step:,}", f"{r.op_type} {r.op_name}", r.why,
                      r.location) for r in self.collective_rows])
    if self.inside_rows:
      lines.append(f"\nInside loop bodies and branches ({len(self.inside_rows)}: each device's copy makes them, "
                   "a loop's each iteration; not in the plan above):")
      lines += _table(("#", "collective", "axes", "shape", "bytes/device", "op", "why", "called at"),
                      [(str(r.index), f"{r.kind}({r.op})" if r.op else r.kind, ",".join(r.axes),
                        _format_shape(r.shape), _format_bytes(r.bytes_per_device), f"{r.op_type} {r.op_name}", r.why,
                        r.location) for r in self.inside_rows])
    if self.collective_rows:
      lines.append("\nBy op type:")
      lines += _table(("op type", "collectives", "bytes/step"),
                      [(t.op_type, ", ".join(f"{n} {kind}" for kind, n in t.counts), f"{t.bytes_per_step:,}")
                       for t in self.by_op_type()])
    communicating = sum(not r.free for r in self.relayouts)
    lines.append(f"\nRelayouts ({len(self.relayouts)}, {communicating} communicating):")
    lines += _table(("tensor", "from", "to", "cost", "for", "at"),
                    [(r.tensor, format_layout(r.source), format_layout(r.target), _cost(r),
                      f"{r.op_type} {r.op_name} input {r.input}", r.location) for r in self.relayouts])
    lines.append(f"\nFallbacks ({len(self.fallbacks)}: ops without a layout rule, run on gathered inputs):")
    why = any(r.why for r in self.fallbacks)  # (a column where a rule said why it could not partition its op)
    lines += _table(("op", "input layouts", "at") + (("why",) if why else ()),
                    [(f"{r.op_type} {r.op_name}", ", ".join(format_layout(x) for x in r.input_layouts), r.location)
                     + ((r.why,) if why else ()) for r in self.fallbacks])
    if self.runs_as is not None:
      fused = [c for c in self.runs_as.collectives if c.present[0].node.startswith(_fusion.SCOPE)]
      lines.append(f"\nFused (across processes): the {len(self.collective_rows)} collective(s) run as "
                   f"{len(self.runs_as.collectives)}; {len(fused)} fused all-reduce(s) of "
                   f"{', '.join(f'{c.shape[0]:,}' for c in fused)} element(s).")
    if self.layout_search is not None:
      lines += _search_lines(self.layout_search)
    if self.memory_report is not None:
      lines += ["", str(self.memory)]
    return "\n".join(lines)


def _cost(row: RelayoutRow) -> str:
  if row.free:
    return "free (local slice)"
  return ", ".join([f"all_to_all dim {a} -> {b} over {','.join(axes)}" for a, b, axes in row.moved]
                   + [f"all_gather dim {d} over {','.join(axes)}" for d, axes in row.gathered])


def _search_lines(result) -> list[str]:
  """The automatic layouts' search: each assignment tried (a move from the best so far)."""
  held = result.bytes_per_device - result.activation_bytes
  lines = [f"\nAutomatic layouts ({len(result.tried)} assignments tried in {result.search_seconds:.1f} s; the chosen "
           f"one is estimated at {result.seconds * 1e3:.2f} ms a step, {result.bytes_per_device:,} bytes/device: "
           f"{held:,} of variables and slots, {result.activation_bytes:,} of the step's tensors at their peak; each "
           "row changes one group's layout, or every group's dimension of one size, from the best so far):"]
  remat = any(t.remat for t in result.tried)
  rows = [(t.group, format_layout(t.layout) if t.layout else "-", f"{t.seconds * 1e3:.3f} ms",
           f"{t.bytes_per_device:,}", "yes" if t.fits else "no") + ((str(len(t.remat)),) if remat else ())
          for t in result.tried]
  lines += _table(("group", "layout tried", "estimated step", "bytes/device", "fits")
                  + (("blocks rematerialized",) if remat else ()), rows)
  if result.remat:
    lines.append(f"Rematerialized to fit the memory budget: {len(result.remat)} block(s), their activations "
                 f"computed again in the backward pass (in the estimate above): {', '.join(result.remat)}.")
  fitting = [t for t in result.tried if t.fits]
  others = sorted((t for t in fitting if t.seconds > result.seconds), key=lambda t: t.seconds)
  why = f"Chosen: the lowest estimate of the {len(fitting)} assignment(s) that fit"
  if others:
    runner = others[0]
    what = runner.group + (f" {format_layout(runner.layout)}" if runner.layout else "")
    why += (f"; the next best tried (a move of {what}) is estimated at {runner.seconds * 1e3:.3f} ms, "
            f"{100 * (runner.seconds / result.seconds - 1):.1f}% slower")
  return lines + [why + "."]


def _table(header: Sequence[str], rows: list[Sequence[str]]) -> list[str]:
  if not rows:
    return ["  (none)"]
  widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
  lines = ["  " + "  ".join(v.ljust(w) for v, w in zip(header, widths)).rstrip(),
           "  " + "  ".join("-" * w for w in widths)]
  lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
  return lines


def _jsonable(row) -> dict[str, Any]:
  def convert(value):
    if isinstance(value, (tuple, list)):
      return [convert(v) for v in value]
    return value
  return {k: convert(v) for k, v in dataclasses.asdict(row).items()}


def _owner_label(owner) -> str:
  return "" if owner is None else f"position {owner.position} along {','.join(owner.axes)}"


def _tensor_row(label, name, shape, dtype, layout, mesh_shape, owner="", chosen_by="") -> TensorRow:
  shape = tf.TensorShape(shape)
  dims = tuple(shape.as_list()) if shape.rank is not None else None
  nbytes = None
  if shape.is_fully_defined() and layout is not None and len(layout) == len(dims):
    pieces = math.prod(math.prod(mesh_shape[a] for a in axes) for axes in layout)
    nbytes = math.prod(dims) // pieces * tf.as_dtype(dtype).size
  return TensorRow(label, name, dims, tf.as_dtype(dtype).name, layout, nbytes, owner, chosen_by)


def _relayouts(graph, partition, outputs, locate, mesh_shape):
  """Every relayout the expander makes, and per op the collectives it emits, in order (kind, axes, why)."""
  rows = []
  expected: dict = collections.defaultdict(collections.deque)
  for event in _communication.walk(graph, partition, outputs, mesh_shape):
    if isinstance(event, _communication.Relayout):
      op_type, op_name = ("return", f"output {event.index}") if event.returned else (event.op.type, event.op.name)
      rows.append(RelayoutRow(event.tensor.name, event.source, event.target, op_type, op_name, event.index,
                              locate(event.op), event.steps.gathered, event.steps.moved))
    else:
      expected[event.op_name].append((event.kind, event.axes, event.why))
  return rows, expected


def _inside_row(op, where: str, record, why: str, locate, devices: int) -> CollectiveRow:
  """A row of a collective placed inside the function ``where`` that ``op`` calls (``Decision.inside``)."""
  op_type, _, op_name = record.call.partition(" ")
  shape = tuple(record.input_shape.as_list()) if record.input_shape.rank is not None else None
  nbytes = record.input_shape.num_elements() * record.dtype.size if record.input_shape.is_fully_defined() else None
  kind = "loop" if op.type in ("While", "StatelessWhile") else "conditional"
  return CollectiveRow(index=record.index, kind=record.kind, op=str(record.param_dict.get("op", "")),
                       axes=record.axes, dtype=record.dtype.name, shape=shape, bytes_per_device=nbytes,
                       bytes_per_step=(nbytes or 0) * devices, op_type=op_type, op_name=op_name,
                       why=f"inside the {kind} {op.name}, its {where}" + (f": {why}" if why else ""), location=locate(op))


def _collective_row(c: Collective, expected: dict) -> CollectiveRow:
  op_type, _, op_name = c.present[0].call.partition(" ")
  why = ""
  if f"/{_recompute.RECOMPUTE_SCOPE}/" in c.present[0].node:  # a rematerialization's own collective
    why = "again for the backward pass (the value recomputed there, not held from the forward pass)"
  else:
    queue = expected.get(op_name, ())
    for item in queue:
      if item[0] == c.kind and item[1] == c.axes:
        queue.remove(item)
        why = item[2]
        break
  shape = tuple(c.shape.as_list()) if c.shape.rank is not None else None
  return CollectiveRow(index=c.index, kind=c.kind, op=str(c.param_dict.get("op", "")), axes=c.axes,
                       dtype=c.dtype.name, shape=shape, bytes_per_device=c.nbytes,
                       bytes_per_step=sum(b or 0 for b in c.member_nbytes), op_type=op_type, op_name=op_name,
                       why=why, location=c.location)

