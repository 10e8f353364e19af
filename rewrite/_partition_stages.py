"""The global view's pipeline stages: which device along a stage axis runs each op of a one-device step.

A step traced at global shapes reads variables; the caller says which stage
each of some variables (a model's layers, cut into stages) belongs to. This
pass gives every op of the step a stage, or none (it runs on every device):

- an op that reads a variable (a ``ReadVariableOp``, a gather of its rows)
  runs on the variable's stage;
- an op of the forward pass or of the optimizer's update runs on the latest
  stage of its inputs' (a layer of stage 1 reads stage 0's activations and
  stage 1's weights; the loss reads the last stage's outputs);
- an op of the backward pass (``tf.GradientTape`` names them
  ``gradient_tape/<forward op>/...``) runs where its forward op ran, and one
  whose forward op is not named on the earliest stage of its inputs' (a
  layer's gradient reads the next stage's gradient and its own activations);
- an op whose inputs have no stage (constants, shapes, the optimizer's step
  counter) has none.

A variable the caller did not place (an optimizer's slot) belongs to the
one stage that writes it and uses what it reads, if one; its reads then run
there too, which can give more ops a stage: the pass repeats until nothing
changes (a variable found on one stage, then another, belongs to none: the
pass ends). A variable several stages' ops use (a scale two layers of
different stages read) belongs to none: each device reads its own copy, and
its writes run on every device, each given the new value from the stage that
computes it. Ops that pass values through (``Identity``, ``IdentityN``) take
no stage: each output is its input's.

The result is an ``Ownership`` whose owners are positions along the stage
axis, ``pipelined``: ``_expansion`` runs a stage's ops on its devices only and
hands a value from one stage to the next device to device. This module knows
nothing about Keras: it sees the traced graph, its partition and which
stage each variable handle belongs to.
"""

from __future__ import annotations

import collections
import dataclasses

import tensorflow as tf

from rewrite import _partition_owners

BACKWARD_SCOPE = "gradient_tape/"
_PASS_THROUGH = ("Identity", "IdentityN", "StopGradient", "Snapshot")
_WRITES = _partition_owners.ASSIGNS


@dataclasses.dataclass
class Stages:
  """Each op's and variable's stage (``assign``'s result, with what the caller needs to act on it).

  Attributes:
    ownership: the ops and variables of each stage, as owners along the stage axis (``pipelined``).
    variables: handle tensor name -> its stage, for a variable one stage's ops alone use.
    shared: handle tensor names of the variables several stages' ops use (kept on every device).
    refused: ``(op name, why)`` of the ops a stage cannot run yet.
  """

  ownership: _partition_owners.Ownership
  variables: dict
  shared: set
  refused: list


def assign(graph: tf.Graph, partition, axis: str, handle_stage: dict, microbatch_axis: str | None = None,
           mesh=None, summed: frozenset = frozenset()) -> Stages:
  """The stage of every op of ``graph`` (see the module).

  Args:
    graph: the traced global graph.
    partition: its ``Partition`` (ops it leaves out are dead: not assigned).
    axis: the stage axis.
    handle_stage: resource handle tensor name -> the stage of its variable (those the caller places).
    microbatch_axis: the axis whose positions are each device's microbatches (``Mesh.with_repeats``), if any:
      an op that computes the same value at each of them (nothing it reads or computes is split over it) runs
      at its first position alone, once a device; the others read its value there.
    mesh: the mesh (with ``microbatch_axis``), if given.
    summed: handle tensor names of variables whose value is the sum of the devices' components (a metric's
      state): on every stage (each device's component its part), as a weight several stages use.
  """
  ops = [op for op in graph.get_operations() if op.name in partition.decisions or op.type == "Placeholder"]
  forward = {op.name for op in ops if not op.name.startswith(BACKWARD_SCOPE)}
  users: dict = {}  # handle tensor name -> the ops it is an input of
  for op in ops:
    for t in op.inputs:
      if t.dtype == tf.resource:
        users.setdefault(t.name, []).append(op)
  shared: set = set(summed)
  handles = {name: stage for name, stage in handle_stage.items() if name not in shared}
  moved: collections.Counter = collections.Counter()  # how often a variable's stage changed (twice: shared)
  while True:
    stage_of = _op_stages(ops, forward, handles, shared)
    found = {}
    for name, used_by in users.items():
      if name in handle_stage or name in shared:
        continue
      stages = set()  # where it is written, and where what reads it is used
      for op in used_by:
        if op.type in _WRITES:
          stages.add(stage_of.get(op.name))
        else:
          stages.update(stage_of.get(c.name) for t in op.outputs for c in t.consumers())
      stages.discard(None)
      if len(stages) == 1:
        found[name] = stages.pop()
      elif len(stages) > 1:
        found[name] = None
    changed = False
    for name, stage in found.items():
      moving = stage is not None and name in handles and handles[name] != stage
      moved[name] += moving
      if (stage is None or moved[name] > 1) and name not in shared:  # (a variable found on two stages in turn too)
        shared.add(name)
        handles.pop(name, None)
        changed = True
      elif stage is not None and name not in shared and handles.get(name) != stage:
        handles[name] = stage
        changed = True
    for name, stage in handle_stage.items():  # a placed variable another stage's ops also use: shared
      if name not in shared and any(stage_of.get(op.name) not in (None, stage) and op.type not in _WRITES
                                    for op in users.get(name, ())):
        shared.add(name)
        handles.pop(name, None)
        changed = True
    if not changed:
      break
  ownership = _partition_owners.Ownership(pipelined=True)
  refused = []
  once = microbatch_axis is not None and mesh.shape[microbatch_axis] > 1
  for op in ops:
    stage = stage_of.get(op.name)
    if op.type == "Placeholder" or op.type in _PASS_THROUGH:
      continue
    decision = partition.decisions[op.name]
    if decision.values:
      continue  # (a constant on every device)
    if stage is not None and decision.lower is not None and decision.communicates:
      refused.append((op.name, "its layout rule communicates while lowering itself"))
    if once and _same_at_each(op, decision, partition.layouts, microbatch_axis):
      if stage is None:
        ownership.ops[op.name] = _partition_owners.Owner((microbatch_axis,), 0)
      else:
        ownership.ops[op.name] = _partition_owners.Owner((axis, microbatch_axis), stage * mesh.shape[microbatch_axis])
    elif stage is not None:
      ownership.ops[op.name] = _partition_owners.Owner((axis,), stage)
  for name, stage in handles.items():
    ownership.variables[name] = _partition_owners.Owner((axis,), stage)
  return Stages(ownership, dict(handles), shared, refused)


def _same_at_each(op, decision, layouts, axis: str) -> bool:
  """Whether ``op`` computes the same value at every position of ``axis``: nothing it reads, computes or
  reduces is split over it (a variable's update, the optimizer's step counter)."""
  if decision.lower is not None and decision.communicates:
    return False
  if any(r is not None and axis in r[1] for r in decision.reduce):
    return False
  for layout in decision.outputs:
    if layout is not None and any(axis in a for a in layout if a):
      return False
  for k, t in enumerate(op.outputs):
    if t.dtype != tf.resource and (k >= len(decision.outputs) or decision.outputs[k] is None):
      return False  # (a value whose layout is unknown: where it is computed)
  for t in op.inputs:
    if t.dtype == tf.resource:
      continue
    have = layouts.get(t.name)
    if have is None or any(axis in a for a in tuple(have) if a):
      return False
  return True


def _op_stages(ops, forward: set, handles: dict, shared: set) -> dict:
  """Op name -> its stage (ops with none left out), given the handles' stages so far."""
  stage_of: dict = {}
  tensor: dict = {}  # tensor name -> the stage of the op computing it (a pass-through's output: its input's)
  for op in ops:
    if op.type == "Placeholder":
      continue
    resources = [t.name for t in op.inputs if t.dtype == tf.resource]
    stage = None
    if resources and op.type in _WRITES:
      handle = resources[0]
      stage = None if handle in shared else handles.get(handle, _latest(op.inputs[1:], tensor))
    elif resources and any(h in handles for h in resources):
      stage = min(handles[h] for h in resources if h in handles)
    elif op.type in _PASS_THROUGH:
      for x, y in zip(op.inputs, op.outputs):
        if x.name in tensor:
          tensor[y.name] = tensor[x.name]
      continue
    elif op.name in forward:
      stage = _latest(op.inputs, tensor)
    else:
      stage = _backward_stage(op, stage_of, forward, tensor)
    if stage is not None:
      stage_of[op.name] = stage
      for t in op.outputs:
        tensor[t.name] = stage
  return stage_of


def _latest(inputs, tensor: dict):
  stages = [tensor[t.name] for t in inputs if t.name in tensor]
  return max(stages) if stages else None


def _backward_stage(op, stage_of: dict, forward: set, tensor: dict):
  """The stage of a backward-pass op: its forward op's (named in its own name), else its inputs' earliest."""
  parts = op.name[len(BACKWARD_SCOPE):].split("/")
  for k in range(len(parts) - 1, 0, -1):
    name = "/".join(parts[:k])
    if name in forward:
      return stage_of.get(name, _earliest(op.inputs, tensor))
  return _earliest(op.inputs, tensor)


def _earliest(inputs, tensor: dict):
  stages = [tensor[t.name] for t in inputs if t.name in tensor]
  return min(stages) if stages else None
