"""``replicator.plan_pipeline``: the stages, microbatches and schedule for a Keras chain on some devices, priced.

The devices are a mesh ``{"stage": p, "batch": b}`` (``p b`` of them); each candidate is ``p`` (a divisor of the
devices; ``p = 1``: plain data parallelism), ``m`` microbatches (a divisor of a replica's rows) and a schedule
(``"gpipe"``, ``"1f1b"``, or ``"interleaved"`` with ``v = 2`` stages a device where the model has ``2 p`` layers
or more and ``p`` divides ``m``). Each is priced from the model's layers (``replicator.split_stages``' cost model:
``rewrite._cost`` on a ``Machine``), and the cheapest that fits ``memory_bytes`` is chosen:

* each layer's forward and backward pass on a microbatch, at its rows (a fixed cost an op makes a small
  microbatch dearer than its share of the rows), the stages cut where the largest costs least
  (``split_stages``' cuts, at those rows); ``costs="measured"``: each layer's pass timed at those rows instead
  (``split_stages(costs="measured")``');
* a send between stages: a microbatch's activation forward and its gradient back, each two ops (a send and a
  receive) and its bytes copied once;
* a stage's gradients summed over its microbatches (``m - 1`` additions of its weights' bytes), its optimizer's
  update (the optimizer's ``apply`` traced on stand-ins of its variables and priced the same way), and the
  gradients' all-reduce over the ``b`` replicas of the batch axis (``wrap_optimizer``'s: one flattened tensor a
  device), and the loss's over the stages;
* the step: the longer of the pipeline's critical path (the slowest stage's time for each microbatch after the
  first, plus every stage's once: ``(m + p - 1)`` stage times when they are equal, the bubble ``(p - 1) / (m +
  p - 1)``; interleaved: ``m`` times the slowest device's and ``p - 1`` of the slowest stage's) and every
  device's work over the devices that run at once (``Machine.parallel_devices``: logical CPUs share the
  cores), the collectives added;
* memory a device: its stages' weights, their gradients and the optimizer's slots, and the activations its
  schedule keeps at most (``core._pipeline.device_order`` walked: GPipe ``m`` microbatches', 1F1B ``p - s`` on
  stage ``s``), a microbatch's being what its layers' forward passes make (every op's outputs: an upper bound
  of what the tape keeps).

Not modelled: the overlap of sends and collectives with compute (they add up), the executor's threads (a
device waiting for a thread: ``benchmarks/pipeline_bubble.py``), a step's input and its other collectives.
``benchmarks/pipeline_plan.py`` checks the choice against measured steps on 8 logical CPUs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import tensorflow as tf

from replicator.core import _errors
from replicator.core import _pipeline
from replicator.integrations import _keras_stages
from rewrite import _cost

SCHEDULES = _pipeline.SCHEDULES
CHUNKS = 2  # the interleaved schedule's stages a device
_VIEWS = ("Const", "Placeholder", "Identity", "IdentityN", "NoOp", "ReadVariableOp", "VarHandleOp", "Shape",
          "Reshape", "StopGradient")  # ops that make no new buffer (as rewrite._cost counts none of them)


@dataclasses.dataclass(frozen=True)
class Layers:
  """What the plan knows of a chain's layers (machine-independent but for ``seconds``).

  Attributes:
    seconds: ``seconds(rows)``: each layer's forward and backward pass on a microbatch of ``rows`` rows.
    made: each layer's forward pass's outputs, bytes a row (the activations a microbatch keeps, at most).
    sent: each layer's output, bytes a row (what goes to the next stage).
    weights: each layer's weights' bytes (trainable and not).
    trained: each layer's trainable weights' bytes (its gradients').
    slots: each layer's optimizer slots' bytes.
    update: each layer's optimizer update, seconds.
    variables: each layer's trainable variables (how many gradients it sums a microbatch).
    names: the layers' names.
  """

  seconds: Callable[[int], list]
  made: tuple
  sent: tuple
  weights: tuple
  trained: tuple
  slots: tuple
  update: tuple
  variables: tuple
  names: tuple = ()


@dataclasses.dataclass(frozen=True)
class PipelineCandidate:
  """One priced candidate of :func:`plan_pipeline` (a row of :attr:`PipelinePlan.candidates`).

  Attributes:
    stages: ``p``, the devices along the stage axis (1: no pipeline, plain data parallelism).
    replicas: ``b``, the devices along the batch axis.
    microbatches: ``m``, the pieces of each replica's batch.
    schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"`` (None where ``stages == 1``).
    chunks: the stages a device (2 for ``"interleaved"``, else 1).
    cuts: the index of the first layer of each of the ``chunks * stages`` stages.
    seconds: the predicted step time.
    path_seconds: the pipeline's critical path with the update and collectives.
    work_seconds: every device's work over the devices that run at once, with the collectives.
    memory_bytes: the most bytes a device holds (weights, gradients, slots, kept activations).
    rejected: why the candidate was not chosen though cheaper (over the memory), else None.
  """

  stages: int
  replicas: int
  microbatches: int
  schedule: str | None
  chunks: int
  cuts: tuple
  seconds: float
  path_seconds: float
  work_seconds: float
  memory_bytes: float
  rejected: str | None = None


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
  """The candidate :func:`plan_pipeline` chose, and every candidate it priced.

  Attributes:
    mesh_shape: ``{"stage": p, "batch": b}``, for ``mesh.Mesh``.
    microbatches: for ``repl.pipeline(microbatches=...)``.
    schedule: for ``repl.pipeline(schedule=...)`` (None where ``p == 1``: the plain data-parallel step).
    split_points: the names of the layers that begin each stage but the first, for
      ``replicator.split_stages(model, split_points=...)`` (:meth:`split` does it).
    seconds: the chosen candidate's predicted step time.
    memory_bytes: its predicted bytes a device at most.
    candidates: every candidate, cheapest first (those over the memory too, with the reason).
  """

  mesh_shape: dict
  microbatches: int
  schedule: str | None
  split_points: tuple
  seconds: float
  memory_bytes: float
  candidates: tuple

  @property
  def chosen(self) -> PipelineCandidate:
    """The chosen candidate's row."""
    return next(c for c in self.candidates if c.rejected is None)

  def split(self, model, input_shape=None) -> list:
    """``model`` cut into the plan's stages (``replicator.split_stages(model, split_points=...)``).

    Args:
      model: the model planned.
      input_shape: a microbatch's shape, rows first, to build the stages with (optional).

    Returns:
      The stages, ``keras.Sequential`` s of the model's layers, in order.
    """
    return _keras_stages.split_stages(model, split_points=list(self.split_points), input_shape=input_shape)


def _divisors(n: int) -> list[int]:
  return [k for k in range(1, n + 1) if n % k == 0]


def _traced_work(fn, specs) -> _cost.Work:
  """What one device does running ``fn`` on ``specs`` (traced, every value whole)."""
  return _keras_stages.unsplit_work(tf.function(fn, autograph=False).get_concrete_function(*specs).graph)


def _nbytes(values) -> int:
  return sum(math.prod(v.shape) * tf.as_dtype(v.dtype).size for v in values)


def _optimizer_costs(optimizer, variables, machine) -> tuple[float, float]:
  """``(update seconds, slot bytes)`` of a fresh copy of ``optimizer`` on stand-ins of ``variables``."""
  import keras  # pylint: disable=import-outside-toplevel
  if not variables:
    return 0.0, 0.0
  fresh = lambda: optimizer.__class__.from_config(optimizer.get_config())  # noqa: E731
  empty = fresh()
  empty.build([])
  copy = fresh()
  stand_ins = [keras.Variable(tf.zeros(v.shape, v.dtype), name=f"w{k}") for k, v in enumerate(variables)]
  copy.build(stand_ins)
  slots = _nbytes(copy.variables) - _nbytes(empty.variables)
  specs = [tf.TensorSpec(v.shape, v.dtype) for v in stand_ins]
  work = _traced_work(lambda *grads: copy.apply(list(grads), stand_ins), specs)
  return work.estimate(machine).seconds, float(slots)


def _forward_bytes(layers, row_shape, dtype) -> tuple[list[float], list[float]]:
  """Each layer's forward pass's outputs and its output, bytes a row (traced with unknown rows: counted as 1)."""
  made, sent = [], []
  spec = tf.TensorSpec((None,) + tuple(row_shape), dtype)
  for layer in layers:
    traced = tf.function(lambda x, layer=layer: layer(x, training=True), autograph=False).get_concrete_function(spec)
    total = 0
    for op in traced.graph.get_operations():
      if op.type in _VIEWS:
        continue
      for t in op.outputs:
        if t.dtype not in (tf.resource, tf.variant, tf.string) and t.shape.rank is not None:
          total += math.prod(1 if n is None else n for n in t.shape.as_list()) * t.dtype.size
    out = traced.structured_outputs
    made.append(float(total))
    sent.append(float(math.prod(out.shape[1:]) * out.dtype.size))
    spec = tf.TensorSpec(out.shape, out.dtype)
  return made, sent


def layers_of(model, row_shape, machine: _cost.Machine, optimizer=None, dtype=tf.float32,
              costs: str = "estimated") -> Layers:
  """The :class:`Layers` of ``model`` (a chain, ``split_stages``'), rows of ``row_shape``, priced on ``machine``
  (the layers' passes timed on this device instead where ``costs="measured"``, once a microbatch size)."""
  import keras  # pylint: disable=import-outside-toplevel
  layers = _keras_stages.chain_of(model)
  optimizer = keras.optimizers.Adam() if optimizer is None else optimizer
  known = {}

  def seconds(rows: int) -> list[float]:
    if rows not in known:
      shape = (rows,) + tuple(row_shape)
      known[rows] = (_keras_stages.measured_layer_costs(layers, shape, dtype) if costs == "measured"
                     else _keras_stages.layer_costs(layers, shape, dtype, machine))
    return known[rows]

  made, sent = _forward_bytes(layers, row_shape, dtype)
  updates = [_optimizer_costs(optimizer, layer.trainable_variables, machine) for layer in layers]
  return Layers(seconds=seconds, made=tuple(made), sent=tuple(sent),
                weights=tuple(float(_nbytes(layer.weights)) for layer in layers),
                trained=tuple(float(_nbytes(layer.trainable_variables)) for layer in layers),
                slots=tuple(s for _, s in updates), update=tuple(u for u, _ in updates),
                variables=tuple(len(layer.trainable_variables) for layer in layers),
                names=tuple(layer.name for layer in layers))


def _send_seconds(nbytes: float, machine: _cost.Machine) -> float:
  """One value to the next device: a send and a receive op, its bytes copied once."""
  return 2 * machine.op_seconds + nbytes / machine.bytes_per_second


def price(layers: Layers, rows: int, devices: int, stages: int, microbatches: int, schedule: str | None,
          machine: _cost.Machine) -> PipelineCandidate:
  """One candidate: ``stages`` devices along the stage axis (the rest the batch axis), ``rows`` the global batch's
  rows, priced on ``machine`` (see the module)."""
  p, m = stages, microbatches
  b = devices // p
  v = CHUNKS if schedule == "interleaved" else 1
  k = p * v
  r = rows // b // m
  costs = layers.seconds(r)
  cuts = [0] if k == 1 else _keras_stages.balanced_cuts(costs, k)
  spans = list(zip(cuts, cuts[1:] + [len(costs)]))
  total = lambda values, a, z: sum(values[a:z])  # noqa: E731
  stage_seconds = []  # a microbatch's pass through each stage, its sends included
  for g, (a, z) in enumerate(spans):
    sends = (_send_seconds(layers.sent[z - 1] * r, machine) if g < k - 1 else 0.0) + (
        _send_seconds(layers.sent[a - 1] * r, machine) if g > 0 else 0.0)
    stage_seconds.append(total(costs, a, z) + sends)
  owned = [[d + c * p for c in range(v)] for d in range(p)]  # each device's stages

  def device_sum(values):
    return [sum(total(values, *spans[g]) for g in mine) for mine in owned]

  trained = device_sum(layers.trained)
  accumulate = [(m - 1) * (n * machine.op_seconds + 3 * nbytes / machine.bytes_per_second)
                for n, nbytes in zip(device_sum(layers.variables), trained)]
  update = device_sum(layers.update)
  per_device = [sum(stage_seconds[g] for g in mine) for mine in owned]
  if v == 1:
    path = sum(stage_seconds) + (m - 1) * max(stage_seconds)
  else:
    path = m * max(per_device) + (p - 1) * max(stage_seconds)
  path += max(a + u for a, u in zip(accumulate, update))
  work = b * sum(m * t + a + u for t, a, u in zip(per_device, accumulate, update))
  work /= max(1.0, min(machine.parallel_devices, devices))
  fixed, rate = machine.collective("all_reduce")
  collectives = (fixed if p > 1 else 0.0) + (fixed + 2 * (b - 1) / b * max(trained) / rate if b > 1 else 0.0)
  memory = []
  for d, mine in enumerate(owned):
    kept, most = 0.0, 0.0
    made = {g: total(layers.made, *spans[g]) * r for g in mine}
    for kind, g, _ in _pipeline.device_order(schedule or "gpipe", d, p, v, m):
      kept += made[g] if kind == "F" else -made[g]
      most = max(most, kept)
    held = sum(total(values, *spans[g]) for g in mine for values in (layers.weights, layers.trained, layers.slots))
    memory.append(held + most)
  return PipelineCandidate(stages=p, replicas=b, microbatches=m, schedule=schedule, chunks=v, cuts=tuple(cuts),
                           seconds=max(path, work) + collectives, path_seconds=path + collectives,
                           work_seconds=work + collectives, memory_bytes=max(memory))


def candidates(layers: Layers, rows: int, devices: int, stages=None, microbatches=None,
               schedules=SCHEDULES) -> list[tuple[int, int, str | None]]:
  """Every ``(p, m, schedule)`` to price (see the module), ``stages`` and ``microbatches`` limiting ``p`` and ``m``."""
  out = []
  count = len(layers.made)
  for p in _divisors(devices):
    b = devices // p
    if (stages is not None and p not in stages) or p > count or rows % b:
      continue
    if p == 1:
      out.append((1, 1, None))
      continue
    for m in _divisors(rows // b):
      if microbatches is not None and m not in microbatches:
        continue
      for schedule in schedules:
        if schedule != "interleaved" or (count >= CHUNKS * p and m % p == 0):
          out.append((p, m, schedule))
  return out


def choose(layers: Layers, rows: int, devices: int, machine: _cost.Machine, memory_bytes=None, stages=None,
           microbatches=None, schedules=SCHEDULES) -> PipelinePlan:
  """The cheapest candidate that fits ``memory_bytes`` (see :func:`plan_pipeline`, which checks the arguments)."""
  found = [price(layers, rows, devices, p, m, s, machine)
           for p, m, s in candidates(layers, rows, devices, stages, microbatches, schedules)]
  if not found:
    raise _errors.ArgumentError(
        f"replicator.plan_pipeline: no candidate for {rows} rows on {devices} devices ({len(layers.made)} layers; "
        f"stages={stages}, microbatches={microbatches}): expected a stage count dividing the devices, at most the "
        "layers, whose batch axis divides the rows. Fix: a batch of a multiple of the devices' rows, or other "
        "stages= / microbatches=.")
  order = {s: k for k, s in enumerate(("1f1b", None, "gpipe", "interleaved"))}  # ties: the least memory first
  found.sort(key=lambda c: (c.seconds, c.memory_bytes, order.get(c.schedule, 9), c.stages, c.microbatches))
  if memory_bytes is not None:
    found = [c if c.memory_bytes <= memory_bytes else dataclasses.replace(
        c, rejected=f"{c.memory_bytes:,.0f} bytes a device, over memory_bytes={memory_bytes:,.0f}") for c in found]
  fitting = [c for c in found if c.rejected is None]
  if not fitting:
    least = min(found, key=lambda c: c.memory_bytes)
    raise _errors.ArgumentError(
        f"replicator.plan_pipeline(memory_bytes={memory_bytes:,.0f}): no candidate fits; the least needs "
        f"{least.memory_bytes:,.0f} bytes a device ({least.stages} stages, {least.microbatches} microbatches, "
        f"{least.schedule}). Fix: more devices, fewer rows, or a larger memory_bytes.")
  best = fitting[0]
  names = layers.names or tuple(str(k) for k in range(len(layers.made)))
  return PipelinePlan(mesh_shape={"stage": best.stages, "batch": best.replicas}, microbatches=best.microbatches,
                      schedule=best.schedule, split_points=tuple(names[c] for c in best.cuts[1:]),
                      seconds=best.seconds, memory_bytes=best.memory_bytes, candidates=tuple(found))


def _check_counts(name, value, what):
  if value is None:
    return None
  values = (value,) if isinstance(value, int) and not isinstance(value, bool) else tuple(value)
  if not values or not all(_errors.positive_int(v) for v in values):
    raise _errors.ArgumentError(f"replicator.plan_pipeline({name}={value!r}): expected positive ints, {what}. Fix: "
                                f"{name}=None (every one) or, say, {name}=(1, 2, 4).")
  return values


def plan_pipeline(model, devices: int, *, input_shape, memory_bytes: float | None = None,
                  machine: _cost.Machine | None = None, schedules=SCHEDULES, stages=None, microbatches=None,
                  optimizer=None, costs: str = "estimated") -> PipelinePlan:
  """The stage count, microbatches and schedule for ``model`` on ``devices`` devices, chosen by the cost model.

  Every candidate (``p`` stages dividing the devices, the rest a batch axis; ``m`` microbatches dividing a
  replica's rows; each schedule) is priced from the model's layers as ``replicator.split_stages`` prices them,
  with the bubble, the sends between stages, the optimizer's update, the batch axis's all-reduce and the memory
  a device holds (see ``docs/concepts/stages.md``); the cheapest that fits ``memory_bytes`` is chosen.

  Examples:
    >>> import keras
    >>> model = keras.Sequential([keras.Input((8,))] + [keras.layers.Dense(8) for _ in range(4)])
    >>> plan = replicator.plan_pipeline(model, 4, input_shape=(32, 8), stages=(2,), microbatches=(2, 4))
    >>> plan.mesh_shape["stage"], plan.microbatches in (2, 4), len(plan.candidates)
    (2, True, 6)

  Args:
    model: a ``keras.Sequential``, or a functional model whose layers form a chain (``split_stages``').
    devices: how many devices, an int.
    input_shape: the shape of a global batch of the model's inputs, rows first.
    memory_bytes: the most bytes a device may hold (weights, gradients, the optimizer's slots, the activations
      its schedule keeps); None: no limit.
    machine: the rates to price with (``replicator.calibrate()``); default: ``split_stages``' nominal rates,
      each device running at once.
    schedules: the schedules to consider (of ``"gpipe"``, ``"1f1b"``, ``"interleaved"``).
    stages: the stage counts to consider (default: every divisor of ``devices``; 1 is plain data parallelism).
    microbatches: the microbatch counts to consider (default: every divisor of a replica's rows).
    optimizer: the Keras optimizer whose update and slots to count (a fresh copy is priced; default: Adam).
    costs: the layers' passes priced by the cost model (``"estimated"``) or timed on the current device
      (``"measured"``: ``split_stages(costs="measured")``'s timing, once for each microbatch size the candidates
      have, about 1.5 s each for 14 Dense layers on a shared 2-core CPU; a pass's fixed cost taken out). The
      sends, the update and the collectives are priced on ``machine`` either way.

  Returns:
    A :class:`PipelinePlan`: the mesh shape, microbatches, schedule and split points chosen, their predicted step
    seconds and bytes a device, and every candidate's prices.
  """
  if not _errors.positive_int(devices):
    raise _errors.ArgumentError(f"replicator.plan_pipeline(devices={devices!r}): expected a positive int, how many "
                                "devices. Fix: devices=len(devices) for a list of them.")
  shape = tuple(input_shape) if isinstance(input_shape, (tuple, list, tf.TensorShape)) else None
  if not shape or len(shape) < 2 or not _errors.positive_int(shape[0]):
    raise _errors.ArgumentError(f"replicator.plan_pipeline(input_shape={input_shape!r}): expected a global batch's "
                                "shape, its rows first (an int) and a row's shape after. Fix: input_shape=(rows, "
                                "features), say (256, 64).")
  unknown = [s for s in schedules if s not in SCHEDULES]
  if unknown or not schedules:
    raise _errors.ArgumentError(f"replicator.plan_pipeline(schedules={schedules!r}): expected some of {SCHEDULES}; "
                                f"found {unknown or 'none'}. Fix: schedules=('gpipe', '1f1b'), say.")
  if memory_bytes is not None and not memory_bytes > 0:
    raise _errors.ArgumentError(f"replicator.plan_pipeline(memory_bytes={memory_bytes!r}): expected a positive "
                                "number of bytes a device, or None (no limit). Fix: memory_bytes=16e9 for 16 GB a "
                                "device, say.")
  if not (isinstance(costs, str) and costs in ("estimated", "measured")):
    raise _errors.ArgumentError(f"replicator.plan_pipeline(costs={costs!r}): expected 'estimated' (the cost model) "
                                "or 'measured' (each layer's pass timed here, at each candidate's microbatch rows). "
                                "Fix: costs='measured', say.")
  stages = _check_counts("stages", stages, "stage counts dividing the devices")
  microbatches = _check_counts("microbatches", microbatches, "microbatch counts dividing a replica's rows")
  if machine is None:  # (nominal rates, each device a processor of its own)
    machine = dataclasses.replace(_keras_stages.NOMINAL, parallel_devices=devices, devices=devices)
  layers = layers_of(model, shape[1:], machine, optimizer, costs=costs)
  return choose(layers, int(shape[0]), devices, machine, memory_bytes, stages, microbatches, tuple(schedules))
