"""Collectives for the backward pass alone, run when it nears them: an FSDP kernel gathered for its gradient.

A global view step with a kernel split over the batch axes (fully sharded data
parallelism by a layout) gathers the kernel whole for the backward pass (the
gradient of the layer's input reads it). That all-gather's input is the
variable's read, which exists when the step starts, so TensorFlow's executor
runs it at once: every layer's gathered kernel was made at the start and held
through the forward pass, as many bytes as the whole model replicated
(measured with ``repl.memory``: every gathered kernel live at the forward
pass's peak).

:func:`defer` makes such a collective wait: a collective whose input is of the
forward pass and whose every reader is of the backward pass reads its input
through an ``Identity`` with control inputs on the backward nodes that precede
the readers of the collective *before it* in the backward pass (so each gather
runs one layer ahead, while the layer after it computes, as PyTorch FSDP's
``BACKWARD_PRE`` prefetch does); the first one waits for its own readers'
(``rewrite._backward.Flow.triggers``). Its result then lives from about one
layer before its use to its last reader.

Deadlock-free by construction: a control input comes from a node that
precedes the collective's readers in the traced graph, and every collective
that node depends on was emitted for an op before them, hence comes before
this one in each device's order of collectives.
"""

from __future__ import annotations

import collections
import dataclasses

import tensorflow as tf

from rewrite import _backward

# The scope of the Identity a deferred collective reads its input through: under gradient_tape, so that the memory
# report counts it with the backward pass (and what it reads as saved for it).
DEFERRED = "gradient_tape/deferred"


@dataclasses.dataclass(frozen=True)
class Deferred:
  """What :func:`defer` did.

  Attributes:
    graph_def: the graph, with the ``Identity`` nodes.
    records: the placeholders' records, the deferred ones reading those nodes.
    deferred: the placeholder node names deferred.
  """

  graph_def: tf.compat.v1.GraphDef
  records: list
  deferred: tuple[str, ...]


def defer(graph_def, records, draws: bool = False) -> Deferred:
  """``graph_def`` with each collective of the backward pass alone waiting for it (see the module).

  Args:
    graph_def: a global view's expansion, its collectives as placeholders.
    records: per device its placeholders' records (``rewrite._placeholders.Placeholder``), or None.
    draws: also make the forward pass's random draws wait (:func:`defer_draws`, on the same graph).
  """
  out = tf.compat.v1.GraphDef()
  out.CopyFrom(graph_def)
  flow = _backward.Flow(out)
  position = {node.name: i for i, node in enumerate(out.node)}
  by_device: dict[str, list] = collections.defaultdict(list)  # device -> (first reader's position, record)
  for device_records in records:
    for record in device_records or ():
      source = _backward.node_of(record.input)
      if record.node not in flow.nodes or source not in flow.nodes or source in flow.backward:
        continue
      readers = flow.data_readers(record.node)
      if readers and all(r in flow.backward for r in readers):
        by_device[record.device].append((min(position[r] for r in readers), record, readers))
  replaced, deferred = {}, []
  for found in by_device.values():
    found.sort(key=lambda entry: entry[0])
    previous: list[str] = []
    for _, record, readers in found:
      after = flow.after(readers)
      own = flow.triggers(readers, besides=[record.node], after=after)
      if not own:
        continue
      early = previous if previous and not any(t in after for t in previous) else own
      previous = own
      waited = flow.waiting(f"{DEFERRED}/{record.node}", record.input, record.dtype, record.device, early)
      replaced[record.node] = dataclasses.replace(record, input=waited)
      deferred.append(record.node)
  new_records = [None if device_records is None else [replaced.get(r.node, r) for r in device_records]
                 for device_records in records]
  if draws and any(node.op in RANDOM for node in out.node):
    defer_draws(out, flow)
  return Deferred(out, new_records, tuple(deferred))


# Random ops (stateless and stateful): their inputs are seeds and shapes, ready when the step starts.
RANDOM = frozenset({
    "StatelessRandomUniformV2", "StatelessRandomNormalV2", "StatelessTruncatedNormalV2", "StatelessRandomUniformIntV2",
    "StatelessRandomUniformFullIntV2", "StatelessRandomUniform", "StatelessRandomNormal", "StatelessTruncatedNormal",
    "StatelessRandomUniformInt", "StatelessRandomUniformFullInt", "StatelessRandomBinomial", "StatelessRandomPoisson",
    "StatelessRandomGammaV2", "StatelessRandomGammaV3", "StatelessMultinomial", "RandomUniform", "RandomStandardNormal",
    "TruncatedNormal", "RandomUniformInt", "StatefulUniform", "StatefulStandardNormalV2", "StatefulTruncatedNormal",
    "StatefulUniformInt", "StatefulUniformFullInt"})
_LOOK_AHEAD = 16  # readers followed from a draw to the first one that meets the step's data


def _data_nodes(flow: _backward.Flow) -> set[str]:
  """The nodes that depend on the step's data: its inputs' placeholders, collectives' results (not handles)."""
  return flow.closure(node.name for node in flow.graph_def.node if node.op == "Placeholder"
                      and node.attr["dtype"].type != tf.resource.as_datatype_enum)


def defer_draws(graph_def, flow: _backward.Flow | None = None) -> tuple[tf.compat.v1.GraphDef, int]:
  """``graph_def`` with each forward random draw waiting for the activation it meets; and how many wait.

  A draw's inputs (its seeds, its shape) exist when the step starts, so TensorFlow's executor makes every
  draw of the forward pass then: every Dropout's uniform noise at once, held until its layer runs (measured
  with ``repl.memory`` on four rematerialized blocks with Dropout: the four draws were the peak). A draw gets
  control inputs on the nodes making the data inputs of its first readers that meet the step's data (the
  activation a Dropout masks; readers of the forward pass only), of which none depends on the draw: it is made
  as its layer runs. ``flow``: the graph's (changed in place), if the caller has one; else ``graph_def`` is copied.
  """
  if flow is None:
    if not any(node.op in RANDOM for node in graph_def.node):
      return graph_def, 0
    out = tf.compat.v1.GraphDef()
    out.CopyFrom(graph_def)
    flow = _backward.Flow(out)
  out = flow.graph_def
  data = _data_nodes(flow)
  count = 0
  for name in [n.name for n in out.node if n.op in RANDOM and n.name not in flow.backward and n.name not in data]:
    after = flow.after([name], forward_only=True)  # (the waits are of the forward pass: see below)
    meet, seen, frontier = set(), {name}, [name]
    for _ in range(_LOOK_AHEAD):
      frontier = [r for n in frontier for r in flow.data_readers(n) if r not in seen and r not in flow.backward]
      seen.update(frontier)
      meet.update(r for r in frontier if r in data)
      frontier = [r for r in frontier if r not in data]
      if meet or not frontier:
        break
    waits = sorted({_backward.node_of(ref) for r in meet for ref in flow.nodes[r].input if not ref.startswith("^")
                    and _backward.node_of(ref) in data and _backward.node_of(ref) not in after
                    and _backward.node_of(ref) not in flow.backward})
    if waits:
      node = flow.nodes[name]
      flow.rewire(name, list(node.input) + ["^" + w for w in waits if "^" + w not in node.input])
      count += 1
  return out, count
