"""1F1B for the global view's pipelines: each device's next forward pass waits for a backward pass.

An expanded pipelined step (``_partition_stages``: microbatches as the
positions of a repeated mesh axis) runs by dataflow: TensorFlow's executor
starts any op whose inputs are ready, so every microbatch's forward pass on a
stage can run before any backward pass, and the stage holds every
microbatch's activations until their backward passes (GPipe's memory).
PipeDream-Flush's 1F1B bounds them: on stage ``s`` of ``p``, microbatch
``j``'s forward pass starts once microbatch ``j - (p - s)``'s backward pass
has finished, so at most ``p - s`` microbatches' activations are held there.
The gradients are unchanged: this pass adds control edges only.

Which nodes. A copy's name says its device position (``replica_<r>``) and
the global op it copies; ops of the backward pass are named
``gradient_tape/...`` by ``tf.GradientTape``. A microbatch's forward pass on
a device position is its copies of the other ops; the edges go into the
ones that read a value from outside the pass (its entries), from a ``NoOp``
after the last ops of the backward pass (the ones whose values no other op of
the pass reads).

Where an op combines the microbatches before their backward passes
(BatchNormalization's statistics over the batch), a forward pass cannot wait
for an earlier microbatch's backward pass, which needs the combined value:
the edges would make a cycle. The pass finds it and raises, naming the op.
"""

from __future__ import annotations

import collections

import tensorflow as tf

from rewrite import _errors
from rewrite import _expansion
from rewrite._partition_stages import BACKWARD_SCOPE

_GATE = "pipeline/backward_done"  # (a NoOp after a microbatch's backward pass on a device position)

CYCLE = (
    "The 1F1B schedule cannot run this step: {op} ({location}) combines every microbatch's value before their "
    "backward passes (a statistic over the batch, such as BatchNormalization's in training), so a microbatch's "
    "forward pass cannot wait for an earlier one's backward pass. Fix: schedule='gpipe' (every forward pass first), "
    "or a layer that normalizes each row (LayerNormalization).")


def one_f_one_b(graph_def: tf.compat.v1.GraphDef, mesh, axis: str, microbatch_axis: str,
                locate=lambda name: name) -> tf.compat.v1.GraphDef:
  """``graph_def`` (an expanded, rewritten pipelined step) with 1F1B's control edges (see the module).

  Args:
    graph_def: the step's graph, its copies named ``expand/replica_<r>/<op>``.
    mesh: the expansion's mesh (with ``microbatch_axis``, the microbatches' repeated axis).
    axis: the stage axis.
    microbatch_axis: the microbatches' axis.
    locate: names where a node's op came from, for the error.

  Raises:
    RewriteError: the edges would make a cycle (an op combining the microbatches before their backward passes).
  """
  p, m = mesh.shape[axis], mesh.shape[microbatch_axis]
  copies = [(node, _expansion.copy_of(node.name)) for node in graph_def.node]
  # A microbatch's ops: those copied at every position of the microbatches' axis (not those run once a device,
  # at its first: a variable's read, what follows the microbatches' sum).
  each = {copy[1] for _, copy in copies if copy is not None and mesh.coords(copy[0])[microbatch_axis] > 0}
  forward, backward = collections.defaultdict(list), collections.defaultdict(list)  # replica -> nodes
  for node, copy in copies:
    if copy is None or copy[1] not in each:
      continue
    r, op = copy
    (backward if op.startswith(BACKWARD_SCOPE) else forward)[r].append(node)
  out = tf.compat.v1.GraphDef()
  out.CopyFrom(graph_def)
  nodes = {node.name: node for node in out.node}
  done = {}  # replica -> the NoOp after its backward pass
  for r in range(mesh.size):
    coords = mesh.coords(r)
    s, j = coords[axis], coords[microbatch_axis]
    if j + p - s >= m or not backward[r]:
      continue  # (no forward pass waits for this one)
    names = {node.name for node in backward[r]}
    read = {_source(i) for node in backward[r] for i in node.input}
    last = sorted(n for n in names if n not in read)
    gate = out.node.add()
    gate.name, gate.op, gate.device = _expansion.copy_name(r, _GATE), "NoOp", nodes[last[0]].device
    gate.input.extend(f"^{n}" for n in last)
    done[r] = gate.name
  for r in range(mesh.size):
    coords = mesh.coords(r)
    s, j = coords[axis], coords[microbatch_axis]
    if j < p - s:
      continue  # (the first p - s forward passes wait for none)
    before = done.get(mesh.index({**coords, microbatch_axis: j - (p - s)}))
    if before is None:
      continue
    names = {node.name for node in forward[r]}
    for node in forward[r]:
      inputs = [i for i in node.input if not i.startswith("^")]
      if inputs and any(_source(i) not in names for i in inputs):
        nodes[node.name].input.append(f"^{before}")
  cycle = _cycle(out, lambda r: mesh.coords(r)[microbatch_axis] == 0)
  if cycle is not None:
    raise _errors.RewriteError(CYCLE.format(op=cycle, location=locate(cycle)))
  return out


def _source(ref: str) -> str:
  """The node an input names (``"^a"``, ``"a:1"``, ``"a"``: ``"a"``)."""
  return ref.lstrip("^").split(":")[0]


def _cycle(graph_def, first_microbatch) -> str | None:
  """The global op of a node on a cycle of ``graph_def`` (its data and control edges), or None if it has none.

  The cycle's nodes: those Kahn's order never reaches, less those no other of them reads (repeatedly). Of them,
  the first copy in the graph's order of a forward op on a ``first_microbatch(r)`` position: microbatch 0's
  forward pass waits for no other, so its ops on the cycle are those after the microbatches were combined.
  """
  inputs = {node.name: {_source(i) for i in node.input} for node in graph_def.node}
  readers = collections.defaultdict(set)
  waiting = {}
  for name, sources in inputs.items():
    sources = {s for s in sources if s in inputs}
    waiting[name] = len(sources)
    for source in sources:
      readers[source].add(name)
  ready = [name for name, count in waiting.items() if count == 0]
  while ready:
    name = ready.pop()
    for reader in readers[name]:
      waiting[reader] -= 1
      if waiting[reader] == 0:
        ready.append(reader)
  core = {name for name, count in waiting.items() if count > 0}
  if not core:
    return None
  leaves = [name for name in core if not readers[name] & core]
  while leaves:
    core.difference_update(leaves)
    leaves = {source for name in leaves for source in inputs[name] if source in core and not readers[source] & core}
  for node in graph_def.node:
    copy = _expansion.copy_of(node.name) if node.name in core else None
    if copy is not None and not copy[1].startswith((BACKWARD_SCOPE, _GATE)) and first_microbatch(copy[0]):
      return copy[1]
  return next(iter(sorted(core)))
