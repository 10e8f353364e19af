"""``wrap_optimizer``: reduce gradients across replicas before every update."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

import rewrite
from replicator.core import _context
from replicator.core import _errors
from replicator.core import _primitives
from replicator.core import _tf_distribute
from replicator.state import _access
from replicator.state import _variables

REDUCTIONS = ("mean", "sum")
UPDATES = ("auto", "sharded", "replicated")

SHARDED_UPDATE_UNSUPPORTED = (
    "wrap_optimizer(update=\"sharded\") cannot shard the updates of {optimizer}: {reason}. "
    "Fix: use update=\"replicated\" (every replica applies every update; the default "
    "\"auto\" chooses it for this optimizer)."
)

ROWS_THEN_DENSE = (
    "wrap_optimizer(accumulation_steps=...) accumulates the rows of {name!r}'s sparse gradient "
    "(tf.IndexedSlices, as its first accumulated step gave), but this step gives a dense gradient. "
    "Fix: give the variable the same kind of gradient in every step (tf.convert_to_tensor(g) makes "
    "a sparse gradient dense), or use one wrapped optimizer per kind."
)

INSIDE_LOSS_SCALING = (
    "keras.optimizers.LossScaleOptimizer(repl.wrap_optimizer(...)) applies the wrapped optimizer inside its "
    "tf.cond on whether the gradients are finite, and checks each replica's own gradients: the wrapper's "
    "gradient all-reduce cannot run inside the cond (it could not be matched across replicas), and replicas "
    "whose checks differ would diverge. Fix: wrap the LossScaleOptimizer instead: "
    "repl.wrap_optimizer(keras.optimizers.LossScaleOptimizer(opt)); it then checks the reduced gradients, "
    "the same on every replica."
)
# Keras 3's LossScaleOptimizer applies its inner optimizer from this method, inside its tf.cond on whether the
# gradients are finite (keras/src/optimizers/loss_scale_optimizer.py, checked on Keras 3.15).
_LOSS_SCALE_BRANCH = "_stateful_handle_finite_grads"

PLACED_COUPLED = (
    "wrap_optimizer: {optimizer} updates variables repl.pipeline placed on their stages' devices, each stage's "
    "devices applying their own stages' gradients only; expected an update of each variable from its own gradient, "
    "but {reason}, which no stage's devices see alone. Fix: clip each variable's gradient (clipnorm=, clipvalue=), "
    "or keep the optimizer's coupled option out of a pipelined step."
)

SHARDED_EXTRA_ARGUMENTS = (
    "A sharded optimizer update takes only gradients and variables, but found the extra "
    "argument(s) {extra}. Fix: drop them, or wrap the optimizer with update=\"replicated\"."
)


@dataclasses.dataclass(frozen=True)
class Owner:
  """Which device updates a variable under a sharded update.

  ``position`` is the owner's place (``Mesh.axis_index``) within each group
  of devices along ``axes``, the mesh axes the variable is replicated on (with
  more than one device); each such group holds one piece of the variable.
  ``pending``: not decided yet, position 0 applies the first update.
  """
  position: int
  axes: tuple[str, ...]
  pending: bool = False  # a first sparse update decides (see ReplicatedOptimizer.owners)


def sharded_update_unsupported(optimizer) -> str | None:
  """Why ``optimizer``'s updates cannot be split among replicas, or None if they can.

  A sharded update hands each replica a subset of the variables. That needs a
  Keras 3 optimizer (its slots are made per variable through
  ``add_variable_from_reference``, and ``apply`` takes any known subset),
  and no option that couples variables: clipping by the global norm of all
  gradients, a moving average of all weights, or Keras's own gradient
  accumulation.
  """
  if not all(hasattr(optimizer, a) for a in ("add_variable_from_reference", "iterations", "build", "apply")):
    return ("only Keras 3 optimizers are supported, whose slot variables are made per variable "
            f"(found {type(optimizer).__name__})")
  if hasattr(optimizer, "inner_optimizer"):
    return "a LossScaleOptimizer's loss-scale checks span all gradients"
  if getattr(optimizer, "global_clipnorm", None):
    return "global_clipnorm clips by the norm of all gradients together"
  if getattr(optimizer, "use_ema", False):
    return "use_ema keeps a moving average of all weights"
  if getattr(optimizer, "gradient_accumulation_steps", None):
    return "its gradient_accumulation_steps (use wrap_optimizer(accumulation_steps=...) instead)"
  return None


def stays_sparse(gradient: tf.IndexedSlices, group_size: int, densify_above: float | None) -> bool:
  """Whether a ``tf.IndexedSlices`` gradient is reduced as rows (gathered) rather than densely.

  Gathering rows gives every replica the slices one device would have had, so
  every optimizer computes what it computes on one device (Keras 3's Adam, for
  one, adds a duplicated row's squares to its second moment: the sum of
  squares, not the square of the sum). A dense all-reduce adds the replicas'
  slices into one table: exact only for optimizers linear in the gradient
  (SGD), but cheaper when the gathered rows approach the table's size.

  Args:
    gradient: the replica's gradient.
    group_size: replicas it is reduced over.
    densify_above: reduce densely when this replica's static row count times
      ``group_size`` is at least this fraction of the variable's rows (0:
      always; where the row count has no static size, only 0 densifies);
      None: always as rows.
  """
  if densify_above is None or group_size == 1:
    return True
  if densify_above == 0:
    return False
  rows = gradient.values.shape[0] if gradient.values.shape.rank else None
  dense_shape = None if gradient.dense_shape is None else tf.get_static_value(gradient.dense_shape)
  if rows is None or dense_shape is None or not len(dense_shape):
    return True  # unknown sizes: exact
  return rows * group_size < densify_above * int(dense_shape[0])


def one_cpu_process(devices) -> bool:
  """Whether every device is a CPU of one process (copies between them are hand-overs)."""
  return (all((tf.DeviceSpec.from_string(d).device_type or "CPU").upper() == "CPU" for d in devices)
          and len({rewrite.task_of(d) for d in devices}) == 1)


SHARDED_UPDATE_MULTI_CLIENT = (
    "{where}: this Replicator is one process of a multi-client job, and the sharded update (each update computed "
    "by one owner of each group, then sent to the others) does not run across processes yet. Fix: leave update= "
    "at \"auto\" (replicated across processes: every replica updates its own copy, as MultiWorkerMirroredStrategy "
    "does), or pass update=\"replicated\"."
)


def sharded_by_default(devices) -> bool:
  """``update="auto"``'s choice (both views): sharded on more than one CPU of one process."""
  return len(devices) > 1 and one_cpu_process(devices)


def _replication(mesh, layout) -> tuple[tuple[str, ...], int]:
  """A variable's mesh axes it is replicated on (size-1 axes left out) and its number of pieces."""
  if layout is None:
    return tuple(a for a in mesh.axis_names if mesh.shape[a] > 1), 1
  return tuple(a for a in layout.replicated_axes if mesh.shape[a] > 1), mesh.axis_size(layout.sharded_axes)


def _owner_axes(mesh, replicated) -> tuple[tuple[str, ...], int]:
  """The axes a sharded update shares ``replicated``'s update along, and its pieces: a variable placed on some
  stages (``_variables.place``) along the axes other than the stages' (its holders along them: one stage's devices),
  whole; else as :func:`_replication`."""
  placement = replicated.placement
  if placement is not None:
    return tuple(a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in placement[0]), 1
  return _replication(mesh, replicated.sharding)


@_context.no_autograph
class ReplicatedOptimizer(tf.Module):
  """An optimizer whose updates use gradients reduced across replicas.

  Returned by ``repl.wrap_optimizer(opt)``. ``apply_gradients`` / ``apply``
  all-reduce the gradients (mean by default; ``"sum"`` when the loss is already
  scaled by the global batch size), then hand them to the wrapped optimizer
  (on every replica, or, with the sharded update below, on each variable's
  owner), so replicated variables receive identical updates. Every other
  attribute (``learning_rate``, ``iterations``, ``variables``, ...) is the
  wrapped optimizer's.

  Works with Keras 3 optimizers (``apply_gradients(grads_and_vars)``,
  ``apply(grads, variables)``) and Sonnet 2 optimizers (``apply(updates,
  parameters)``).

  For checkpoints the wrapper is transparent: ``tf.train.Checkpoint(optimizer=
  wrapped)`` writes exactly what the wrapped optimizer would, so it restores
  into an unwrapped optimizer (one device) and back.

  On a mesh, a gradient is reduced only over the mesh axes its variable is
  replicated on, never over the axes it is sharded on. The step's objective is
  the mean of every device's loss, so with ``"mean"`` the reduced gradient is
  divided by the number of devices (the mean over the replicated axes, divided
  by the number of pieces); with ``"sum"`` (a loss already divided by the
  global batch) by the number of devices that share each batch shard. Keras
  optimizer slots take the layout of their variable.

  A sparse gradient (``tf.IndexedSlices``, an embedding's) is reduced as rows:
  every replica gets every replica's rows and indices in replica order, scaled
  as above, as ``tf.IndexedSlices`` (see :func:`stays_sparse` and
  ``densify_above``). With gradient accumulation the rows of every step are
  kept. A variable ``repl.pipeline`` placed on its stages' devices keeps its
  accumulator there (not on every device).

  With ``update="sharded"`` each replicated variable (each piece of a sharded
  one) is updated by one owner device of the group that holds it, and the new
  value is broadcast to the others: the optimizer's arithmetic runs once
  instead of once per replica. Owners are chosen to balance bytes across
  devices; a variable first updated with a sparse gradient is either applied
  by every replica or owned by position 0, as :func:`rows_everywhere` decides
  from how the step reads and writes it. Slot variables are then current only
  on their owner; reads from outside a step and checkpoints take the owner's
  copy. A variable ``repl.pipeline`` placed on its stages' devices is owned
  along the mesh axes other than the stages' (by one of its stage's batch
  replicas), its gradient reduced for the owner and its new value broadcast
  within the stage's group only. ``"auto"`` (default)
  shards when every device is a CPU of one process (the broadcast is a
  hand-over of buffers there) and the optimizer allows it (see
  :func:`sharded_update_unsupported`); otherwise every replica applies every
  update (``"replicated"``).
  """

  def __init__(self, replicator, optimizer, reduction: str = "mean", accumulation_steps: int = 1,
               bucket_bytes: int | None = None, update: str = "auto", densify_above: float | None = None):
    if not _errors.positive_int(accumulation_steps):
      raise _errors.ArgumentError(f"wrap_optimizer(accumulation_steps={accumulation_steps!r}): needs a positive integer.")
    if reduction not in REDUCTIONS:
      raise _errors.ArgumentError(f"wrap_optimizer(reduction={reduction!r}): reduction must be one of {REDUCTIONS}.")
    if not (hasattr(optimizer, "apply_gradients") or hasattr(optimizer, "apply")):
      raise _errors.ArgumentTypeError(
          f"wrap_optimizer() needs a Keras 3 or Sonnet 2 optimizer (an object with "
          f"apply_gradients() or apply()), but found {type(optimizer).__name__}.")
    object.__setattr__(self, "_replicator", replicator)
    object.__setattr__(self, "_optimizer", optimizer)
    object.__setattr__(self, "_reduction", reduction)
    object.__setattr__(self, "accumulation_steps", accumulation_steps)
    if bucket_bytes is not None and (not isinstance(bucket_bytes, int) or bucket_bytes < 0):
      raise _errors.ArgumentError(f"wrap_optimizer(bucket_bytes={bucket_bytes!r}): needs None or a byte count >= 0.")
    object.__setattr__(self, "bucket_bytes", bucket_bytes)
    if densify_above is not None and (isinstance(densify_above, bool) or not isinstance(densify_above, (int, float))
                                      or densify_above < 0):
      raise _errors.ArgumentError(f"wrap_optimizer(densify_above={densify_above!r}): needs None or a fraction >= 0 "
                       "(of a variable's rows).")
    object.__setattr__(self, "densify_above", densify_above)
    object.__setattr__(self, "_accumulators", None)
    object.__setattr__(self, "calls", 0)  # steps run through this optimizer (Python side)
    object.__setattr__(self, "_apply_now", True)  # set by the Replicator before tracing
    if update not in UPDATES:
      raise _errors.ArgumentError(f"wrap_optimizer(update={update!r}): update must be one of {UPDATES}.")
    unsupported = sharded_update_unsupported(optimizer)
    if update == "sharded" and unsupported:
      raise _errors.ArgumentError(SHARDED_UPDATE_UNSUPPORTED.format(optimizer=type(optimizer).__name__, reason=unsupported))
    if update == "sharded" and getattr(replicator, "task", None) is not None:
      raise _errors.UnsupportedError(SHARDED_UPDATE_MULTI_CLIENT.format(where='wrap_optimizer(update="sharded")'))
    if update == "auto":
      update = "sharded" if unsupported is None and sharded_by_default(replicator.devices) else "replicated"
    object.__setattr__(self, "update", update)
    # Per wrapped optimizer, shared by every wrapper of it (slots live on their owner):
    # slots by variable, id(ReplicatedVariable) -> (variable, Owner), bytes owned per device.
    record = _give_slots_their_variables_layout(optimizer)
    if getattr(optimizer, "inner_optimizer", None) is not None:  # (a LossScaleOptimizer's slots are its inner one's)
      _give_slots_their_variables_layout(optimizer.inner_optimizer)
    object.__setattr__(self, "_slots", record["slots"])
    object.__setattr__(self, "_owners", record["owners"])
    object.__setattr__(self, "_load", record.setdefault("load", [0] * len(replicator.devices)))

  def phase(self) -> bool:
    """Whether the next step applies (True) or only accumulates (False)."""
    return self.accumulation_steps == 1 or self.calls % self.accumulation_steps == self.accumulation_steps - 1

  def prepare_trace(self) -> None:
    """Makes the next trace build the variant of the next step's phase."""
    object.__setattr__(self, "_apply_now", self.phase())

  def advance(self, steps: int) -> None:
    """Counts steps that ran through this optimizer."""
    object.__setattr__(self, "calls", self.calls + steps)

  @property
  def optimizer(self):
    """The wrapped optimizer."""
    return self._optimizer

  # tf.Module defines these, which would hide the wrapped optimizer's.
  @property
  def variables(self):
    """The wrapped optimizer's variables."""
    return self._optimizer.variables

  @property
  def trainable_variables(self):
    """The wrapped optimizer's trainable variables."""
    return self._optimizer.trainable_variables

  @property
  def reduction(self) -> str:
    """How gradients are combined across replicas: "mean" or "sum"."""
    return self._reduction

  def reduce_gradients(self, grads: list[Any], variables: list[Any] | None = None) -> list[Any]:
    """All-reduces ``grads`` across replicas; ``None`` entries stay ``None``.

    With ``variables``, each gradient is reduced over the mesh axes its
    variable is replicated on (see the class docstring); one all-reduce call
    per distinct set of axes. A ``tf.IndexedSlices`` gradient stays sparse:
    its rows and indices are gathered from every replica (see
    :func:`stays_sparse`).
    """
    return self._reduce(grads, variables)

  def _reduce(self, grads: list[Any], variables: list[Any] | None, owners: list[Owner | None] | None = None):
    """:meth:`reduce_gradients`; a dense gradient with an ``owners`` entry is reduced for its owner alone."""
    repl = self._replicator
    if _in_global_trace(repl):  # the global view: the step's gradients are the global batch's already
      return list(grads)
    mesh = repl.mesh
    variables = [None] * len(grads) if variables is None else list(variables)
    if len(variables) != len(grads):
      raise _errors.ArgumentError(f"reduce_gradients got {len(grads)} gradients for {len(variables)} variables.")
    # "sum": every device that differs only along non-batch axes computes the
    # same batch shard's loss; count it once.
    ctx = _context.current_context()  # (outside a step the reduction below refuses to run)
    batch_axes = mesh.axis_names if ctx is None or ctx.batch_axes is None else ctx.batch_axes
    copies = mesh.axis_size(tuple(a for a in mesh.axis_names if a not in batch_axes))
    plans = []  # (replicated axes, divisor) per gradient
    for v in variables:
      axes, pieces = _replication(mesh, None if v is None else _variables.layout_of(v))
      plans.append((axes, copies if self._reduction == "sum" else pieces))
    reduced: list[Any] = [None] * len(grads)
    placed = [i for i, v in enumerate(variables) if v is not None and _variables.placement_of(v) is not None]
    if placed:
      self._reduce_placed(grads, variables, placed, batch_axes, reduced, owners)
    dense_by_axes: dict[tuple[str, ...], list[int]] = {}
    sparse_by_axes: dict[tuple[str, ...], list[int]] = {}
    for i, (g, (axes, _)) in enumerate(zip(grads, plans)):
      if g is None or i in placed:
        continue
      if self._stays_sparse(g, axes):
        sparse_by_axes.setdefault(axes, []).append(i)
      else:
        dense_by_axes.setdefault(axes, []).append(i)
    for axes, indices in dense_by_axes.items():
      values = [tf.convert_to_tensor(grads[i]) for i in indices]
      if axes:
        members = None
        if owners is not None:  # only the owner applies the gradient: reduce it there
          members = [o.position if o is not None and not o.pending and o.axes == axes else None
                     for o in (owners[i] for i in indices)]
        values = fused_all_reduce(repl, values, self._reduction, axes, self.bucket_bytes, members)
      for i, value in zip(indices, values):
        divisor = plans[i][1]
        reduced[i] = value if divisor == 1 else value / tf.cast(divisor, value.dtype)
    for axes, indices in sparse_by_axes.items():
      # The mean over the group (for "mean") and the divisor, applied to the rows.
      group = mesh.axis_size(axes) if self._reduction == "mean" else 1
      for i in indices:
        g, scale = grads[i], 1.0 / (group * plans[i][1])
        if axes:
          ctx = _primitives.require_context(repl, "wrap_optimizer")
          reduced[i] = _primitives.sparse_gradient_sum(
              ctx, g, tuple(a for a in axes if a in batch_axes), tuple(a for a in axes if a not in batch_axes),
              _primitives.user_location(), scale)
        else:
          reduced[i] = g if scale == 1.0 else tf.IndexedSlices(g.values * tf.cast(scale, g.values.dtype),
                                                                g.indices, g.dense_shape)
    return reduced

  def _reduce_placed(self, grads, variables, placed: list[int], batch_axes, reduced: list,
                     owners: list[Owner | None] | None = None) -> None:
    """The gradients of variables a pipeline placed on some stages (``_variables.place``), into ``reduced``.

    Each is reduced over the mesh axes other than its stages' (the batch replicas of its stage), never over
    the stage axis: the stage's gradient is the whole gradient already (``repl.pipeline`` sums a weight two
    stages share between those two). Every replica makes the same calls, one all-reduce of each dtype, set of
    axes and owner, of its own stages' gradients flattened into one tensor (its size differs between the stages'
    groups, as batch shards of different sizes may); a variable this replica does not hold gets None. Under the
    sharded update (``owners``) a group's gradients are reduced for their owner alone (``reduce_for``).
    """
    repl, mesh = self._replicator, self._replicator.mesh
    ctx = _primitives.require_context(repl, "wrap_optimizer")
    groups: dict[tuple[tuple[str, ...], tf.DType, int, int | None], list[int]] = {}
    for i in placed:
      where, _ = _variables.placement_of(variables[i])
      axes = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in where)
      # "sum": a loss already divided by the global batch; count once the copies along the axes reduced over
      copies = mesh.axis_size(tuple(a for a in axes if a not in batch_axes))
      owner = None if owners is None else owners[i]
      member = owner.position if owner is not None and owner.axes == axes else None
      groups.setdefault((axes, tf.as_dtype(variables[i].dtype), copies, member), []).append(i)
    for (axes, dtype, copies, member), indices in groups.items():
      mine = [i for i in indices if _variables.holds(variables[i], ctx.replica_id)]
      parts = [tf.reshape(tf.zeros(variables[i].shape, dtype) if grads[i] is None
                          else tf.cast(tf.convert_to_tensor(grads[i]), dtype), [-1]) for i in mine]
      flat = tf.concat(parts, 0) if parts else tf.zeros([1], dtype)  # (nothing of this group here: a stand-in)
      if axes and member is not None:
        (flat,) = _primitives.reduce_for(ctx, [flat], self._reduction, axes, member, _primitives.user_location())
      elif axes:
        flat = repl.all_reduce(flat, op=self._reduction, axis=axes)
      if axes and self._reduction == "sum" and copies > 1:
        flat = flat / tf.cast(copies, dtype)
      shapes = [tf.TensorShape(variables[i].shape) for i in mine]
      pieces = tf.split(flat, [shape.num_elements() for shape in shapes]) if mine else []
      for i, piece, shape in zip(mine, pieces, shapes):
        reduced[i] = None if grads[i] is None else tf.reshape(piece, shape)

  def _held(self, grads, variables) -> tuple[list, list]:
    """``grads`` and ``variables`` without the variables this replica does not hold (placed on other stages), the
    optimizer built for all of them first (:meth:`_build_for_placed`)."""
    self._build_for_placed(list(variables))
    ctx = _context.current_context()
    if ctx is None or ctx.replicator is not self._replicator:
      return list(grads), list(variables)
    keep = [k for k, v in enumerate(variables) if _variables.holds(v, ctx.replica_id)]
    return [grads[k] for k in keep], [variables[k] for k in keep]

  def _loss_scaled_placed(self, variables) -> bool:
    """Whether this step applies a LossScaleOptimizer to variables a pipeline placed on their stages."""
    return hasattr(self._optimizer, "inner_optimizer") and any(
        _variables.placement_of(v) is not None for v in variables)

  def _apply_loss_scaled(self, grads, variables):
    """A LossScaleOptimizer's step on this replica's stages' ``variables``: the
    step is skipped (and the scale halved) on every replica if any replica's gradients are not finite, as one
    device's check of every stage's gradients decides; else each replica applies its own, unscaled, with the inner
    optimizer, and the scale grows as the LossScaleOptimizer's does (its public ``step_counter``, ``dynamic_scale``
    and ``dynamic_growth_steps``: its own ``apply`` would check this replica's gradients alone)."""
    optimizer = self._optimizer
    present = [tf.convert_to_tensor(g) for g in grads if g is not None]
    bad = tf.zeros([]) if not present else tf.cast(tf.logical_not(tf.reduce_all(tf.stack(
        [tf.reduce_all(tf.math.is_finite(g)) for g in present]))), tf.float32)
    bad = self._replicator.all_reduce(bad, op="sum", axis=tuple(self._replicator.mesh.axis_names))

    def finite():
      scale = optimizer.dynamic_scale
      unscaled = [None if g is None else tf.convert_to_tensor(g) / tf.cast(scale, tf.convert_to_tensor(g).dtype)
                  for g in grads]
      if variables:
        optimizer.inner_optimizer.apply(unscaled, variables)
      else:  # (every variable on other stages)
        optimizer.inner_optimizer.iterations.assign_add(1)
      grow = tf.equal(optimizer.step_counter, optimizer.dynamic_growth_steps - 1)
      optimizer.step_counter.assign(tf.where(grow, tf.zeros_like(optimizer.step_counter), optimizer.step_counter + 1))
      optimizer.dynamic_scale.assign(tf.where(grow, optimizer.dynamic_scale * 2.0, optimizer.dynamic_scale))
      return tf.constant(True)

    def skip():
      optimizer.step_counter.assign(tf.zeros_like(optimizer.step_counter))
      optimizer.dynamic_scale.assign(optimizer.dynamic_scale * 0.5)
      return tf.constant(False)

    return tf.cond(bad > 0, skip, finite)

  def _build_for_placed(self, variables) -> None:
    """Builds a Keras optimizer's slots for every variable before a replica applies those it holds: each
    replica's apply names its own stages' variables only, which a first apply would build the optimizer for."""
    if not any(_variables.placement_of(v) is not None for v in variables):
      return
    coupled = ("global_clipnorm clips by the norm of every stage's gradients together"
               if getattr(self._optimizer, "global_clipnorm", None) else None)
    if coupled:
      raise _errors.UnsupportedError(PLACED_COUPLED.format(optimizer=type(self._optimizer).__name__, reason=coupled))
    if hasattr(self._optimizer, "built"):
      self._build_slots(variables)

  def _stays_sparse(self, g, axes: tuple[str, ...]) -> bool:
    """Whether gradient ``g``, reduced over ``axes``, stays a ``tf.IndexedSlices``."""
    return isinstance(g, tf.IndexedSlices) and stays_sparse(g, self._replicator.mesh.axis_size(axes),
                                                            self.densify_above)

  def _sharded_owners(self, grads, variables) -> list[Owner | None] | None:
    """The owners of ``variables`` under this step's sharded update, before their gradients are reduced."""
    mesh = self._replicator.mesh
    if len(grads) != len(variables) or all(g is None for g in grads):
      return None  # _reduce names the mismatch, _apply_sharded the missing gradients
    self._build_slots(variables)  # an owner is given the slots of the variables it owns
    return self.owners(variables, [
        g is not None and self._stays_sparse(g, _replication(mesh, _variables.layout_of(v))[0])
        for g, v in zip(grads, variables)])

  def build(self, variables, *args, **kwargs):
    """Creates the optimizer's slot variables now, replicated like the model's."""
    with self._replicator.context():
      return self._optimizer.build(variables, *args, **kwargs)

  def _accumulate(self, grads, variables):
    """Adds this step's local gradients to the accumulators.

    Returns the accumulated sums when this step applies (accumulators are then
    reset), or None when it only accumulates. A sparse gradient accumulates
    its rows (see :class:`_RowAccumulator`), so the applied gradient holds
    every row of the k steps, as one device's gradient of a k times larger
    batch would.

    The accumulator of a variable a pipeline placed on its stages' devices
    lives on those devices only (made like its variable,
    ``_variables.reference_scope``); a replica that does not hold the
    variable (its gradient there is zeros) neither keeps nor adds to one,
    and passes the gradient on as it is.
    """
    if self.accumulation_steps == 1:
      return grads
    ctx = _context.current_context()
    if ctx is not None:
      ctx.accumulating.add(self)
    trace = _context.current_global_trace()
    if trace is not None and self not in trace.accumulating:
      trace.accumulating.append(self)
    if self._accumulators is None:
      object.__setattr__(self, "_accumulators", [_new_accumulator(v, g) for v, g in zip(variables, grads)])
    if len(self._accumulators) != len(variables):
      raise _errors.ArgumentError(f"This optimizer accumulates gradients for {len(self._accumulators)} variables, "
                       f"but got {len(variables)}. Use one wrapped optimizer per set of variables.")
    for acc, g, v in zip(self._accumulators, grads, variables):
      if isinstance(acc, _RowAccumulator) and g is not None and not isinstance(g, tf.IndexedSlices):
        raise _errors.ArgumentTypeError(ROWS_THEN_DENSE.format(name=getattr(v, "path", None) or v.name))
    held = [ctx is None or ctx.replicator is not self._replicator or _variables.holds(v, ctx.replica_id)
            for v in variables]  # (False: placed on other stages' devices, its accumulator too)
    if not self._apply_now:
      for acc, g, here in zip(self._accumulators, grads, held):
        if isinstance(acc, _RowAccumulator) and g is not None and here:
          acc.add(g)
        elif g is not None and here:
          acc.assign_add(tf.convert_to_tensor(g))
      return None
    totals = []
    for acc, g, here in zip(self._accumulators, grads, held):
      if not here:
        totals.append(g)  # (zeros, or None: a variable this replica does not hold is not applied here)
        continue
      if g is None:
        totals.append(None)
      elif isinstance(acc, _RowAccumulator):
        totals.append(acc.total(g, self.accumulation_steps))
      else:
        totals.append((acc.read_value() + tf.convert_to_tensor(g)) / self.accumulation_steps)
      if isinstance(acc, _RowAccumulator):
        acc.reset()
      else:
        acc.assign(tf.zeros_like(acc))
    return totals

  def apply_gradients(self, grads_and_vars, *args, **kwargs):
    """Reduces the gradients across replicas, then applies them (Keras API).

    With ``accumulation_steps=k``, only every k-th step reduces and applies
    the mean of the k steps' gradients; the other steps add them up locally.
    """
    grads_and_vars = list(grads_and_vars)
    variables = [v for _, v in grads_and_vars]
    grads = self._accumulate([g for g, _ in grads_and_vars], variables)
    if grads is None:
      return None
    gathered_bytes = self._gathered_bytes(grads, variables)
    if self._sharding_now(args, kwargs):
      owners = self._sharded_owners(grads, variables)
      self._apply_sharded(self._reduce(grads, variables, owners), variables, gathered_bytes, owners)
      return self._optimizer.iterations
    every = variables
    grads, variables = self._held(self.reduce_gradients(grads, variables), variables)
    if self._loss_scaled_placed(every):
      return self._apply_loss_scaled(grads, variables)
    if not variables:  # (every variable on other stages)
      return self._optimizer.iterations.assign_add(1)
    return self._optimizer.apply_gradients(list(zip(grads, variables)), *args, **kwargs)

  def apply(self, grads, variables=None, *args, **kwargs):
    """Reduces the gradients across replicas, then applies them.

    Keras 3: ``apply(grads, trainable_variables)``. Sonnet 2:
    ``apply(updates, parameters)``.
    """
    ctx = _context.current_context()
    if ctx is not None and ctx.replicator is self._replicator and _tf_distribute.called_by(_LOSS_SCALE_BRANCH):
      raise _errors.UnsupportedError(INSIDE_LOSS_SCALING)  # the global view has no collective there: it runs
    if self.accumulation_steps != 1:
      if variables is None:
        raise _errors.ArgumentError("apply(grads) without variables cannot accumulate gradients; pass the variables.")
      grads = self._accumulate(list(grads), list(variables))
      if grads is None:
        return None
    grads = list(grads)
    if self._sharding_now(args, kwargs) and variables is None:
      variables = list(self._optimizer._trainable_variables)  # pylint: disable=protected-access
    gathered_bytes = None if variables is None else self._gathered_bytes(grads, list(variables))
    if self._sharding_now(args, kwargs):
      variables = list(variables)
      owners = self._sharded_owners(grads, variables)
      return self._apply_sharded(self._reduce(grads, variables, owners), variables, gathered_bytes, owners)
    grads = self.reduce_gradients(grads, None if variables is None else list(variables))
    if variables is None:
      return self._optimizer.apply(grads, *args, **kwargs)
    every = list(variables)
    grads, variables = self._held(grads, list(variables))
    if self._loss_scaled_placed(every):
      return self._apply_loss_scaled(grads, variables)
    if not variables:  # (every variable on other stages)
      return self._optimizer.iterations.assign_add(1)
    return self._optimizer.apply(grads, variables, *args, **kwargs)

  # -- sharded update -------------------------------------------------------------

  def _sharding_now(self, args=(), kwargs=None) -> bool:
    """Whether this call, inside a step, applies a sharded update (extra arguments: an error)."""
    ctx = _context.current_context()
    sharding = self.update == "sharded" and ctx is not None and ctx.replicator is self._replicator
    if sharding and (args or kwargs):
      # Falling back to a replicated update here would update slots that are
      # current only on their owner from stale copies.
      raise _errors.ArgumentTypeError(SHARDED_EXTRA_ARGUMENTS.format(extra=list(args) + sorted(kwargs or {})))
    return sharding

  def owners(self, variables, sparse: Sequence[bool] | None = None) -> list[Owner | None]:
    """The owner of each variable under a sharded update (None: every replica updates it).

    Owners are assigned once per variable, the first time it is updated,
    largest variables first, each to the position whose devices own the fewest
    bytes so far; the assignment then stays fixed (slots live on the owner).

    A variable first updated with a sparse gradient (``sparse[i]``) is
    pending: position 0 (traced first) applies its first update, and
    :meth:`_settle` then decides from how the step reads and writes it.

    A variable a pipeline placed on its stages' devices (``_variables.place``)
    is owned along the mesh axes other than the stages' (its batch replicas:
    :func:`_owner_axes`), by a position chosen among the devices that hold it;
    it is always updated densely (its gradient is reduced densely). One
    device a stage (no other axis): None, its stage's device updates it. A
    variable whose axes changed since its owner was chosen (placed, moved
    back, laid out anew) gets a new owner; one moved to other stages along
    the same axes keeps its position, its slots owned there again.
    """
    mesh = self._replicator.mesh
    sparse = [False] * len(variables) if sparse is None else sparse
    result: list[Owner | None] = []
    new = []  # (index, ReplicatedVariable, replicated axes, bytes per piece)
    for i, v in enumerate(variables):
      replicated = _variables.underlying(v)
      record = None if replicated is None else self._owners.get(id(replicated))
      result.append(None if record is None else record[1])  # ordinary variables: not shared
      if replicated is None:
        continue
      axes, pieces = _owner_axes(mesh, replicated)
      placed = replicated.placement is not None
      if record is not None and (record[1] is None or record[1].axes == axes):
        if record[1] is not None:
          self._keep_slots_owned(replicated, record[1])
        continue
      if record is not None:  # (its axes changed: owned anew; the old owner's bytes stay counted, for balance only)
        del self._owners[id(replicated)]
        result[i] = None
      if placed and not axes:
        continue  # (one device a stage: it updates the variable)
      if sparse[i] and not placed:
        result[i] = Owner(0, axes, pending=True)
      else:
        new.append((i, replicated, axes, _piece_bytes(replicated, pieces)))
    for i, replicated, axes, nbytes in sorted(new, key=lambda n: -n[3]):  # stable: ties keep variable order
      groups = [g for g in mesh.groups(axes) if _variables.holds(replicated, g[0])]  # (placed: its stages' groups)
      best = min(range(len(groups[0])), key=lambda p: (max(self._load[g[p]] for g in groups), p))
      result[i] = self._own(replicated, Owner(best, axes), nbytes)
    return result

  def _count(self, replicated, owner: Owner, nbytes: int) -> None:
    """Adds ``nbytes`` to the load of ``owner``'s device in each group along its axes that holds ``replicated``."""
    for g in self._replicator.mesh.groups(owner.axes):
      if _variables.holds(replicated, g[0]):
        self._load[g[owner.position]] += nbytes

  def _keep_slots_owned(self, replicated, owner: Owner) -> None:
    """Marks ``replicated``'s slots owned by ``owner`` again where their components were replaced since (a placed
    variable moved to other stages: its slots with it, each device's copy its own)."""
    for slot in self._slots.get(id(replicated), ()):
      if slot.owner != (owner.position, owner.axes):
        slot.set_owner(owner.position, owner.axes)

  def _own(self, replicated, owner: Owner, nbytes: int) -> Owner:
    """Records ``owner`` for ``replicated`` (and its slots) and counts its bytes."""
    self._count(replicated, owner, nbytes)
    self._owners[id(replicated)] = (replicated, owner)
    # Only the slots are current on their owner alone; the variable's new value
    # is broadcast and written on every device, each of which reads its own.
    for slot in self._slots.get(id(replicated), ()):
      slot.set_owner(owner.position, owner.axes)
    return owner

  def _settle(self, owners: list[Owner | None], variables, update_ops: Sequence[tf.Operation],
              gathered_bytes: Sequence[int | None]) -> list[Owner | None]:
    """Decides the pending owners after position 0 traced their first update (``update_ops``).

    Every replica applies the gathered rows itself (None: nothing is
    broadcast) or position 0 owns the variable and broadcasts it, as
    :func:`rows_everywhere` decides.
    """
    settled = list(owners)
    graph = tf.compat.v1.get_default_graph()
    everything = graph.get_operations()
    ctx = _context.current_context()
    for i, owner in enumerate(owners):
      if owner is None or not owner.pending:
        continue
      replicated = _variables.underlying(variables[i])
      component = _variables.component_for(replicated, ctx.replica_id)
      nbytes = _piece_bytes(replicated, _replication(self._replicator.mesh, replicated.sharding)[1])
      if rows_everywhere(_access.writes_rows_only(graph, update_ops, component),
                         _access.reads_whole(graph, everything, component), nbytes, gathered_bytes[i]):
        self._owners[id(replicated)] = (replicated, None)
        settled[i] = None
      else:
        settled[i] = self._own(replicated, Owner(0, owner.axes), nbytes)
    return settled

  def _gathered_bytes(self, grads, variables) -> list[int | None]:
    """For each sparse gradient, the static bytes of the rows every replica will hold once gathered."""
    mesh = self._replicator.mesh
    result: list[int | None] = []
    for g, v in zip(grads, variables):
      values = g.values if isinstance(g, tf.IndexedSlices) else None
      if values is None or not values.shape.is_fully_defined():
        result.append(None)
        continue
      axes, _ = _replication(mesh, _variables.layout_of(v))
      result.append(values.shape.num_elements() * values.dtype.size * mesh.axis_size(axes))
    return result

  def _build_slots(self, variables) -> None:
    """Builds the optimizer (every slot, whichever replica traces first), named as ``apply()`` would."""
    optimizer = self._optimizer
    if not optimizer.built:
      import keras  # pylint: disable=import-outside-toplevel  (only Keras optimizers get here)
      with keras.name_scope(optimizer.name, caller=optimizer):
        optimizer.build(variables)

  def _apply_sharded(self, grads, variables, gathered_bytes, owners: list[Owner | None] | None):
    """This replica applies the updates it owns, then owners broadcast the new values.

    ``owners``: :meth:`_sharded_owners`, decided before the gradients were reduced (None: no gradient).
    """
    ctx = _context.current_context()
    optimizer = self._optimizer
    held = [i for i, v in enumerate(variables) if _variables.holds(v, ctx.replica_id)]
    if held and all(grads[i] is None for i in held):  # (none held: a pipeline's stage without variables)
      return optimizer.apply(grads, variables)  # Keras's own error
    mesh = self._replicator.mesh
    mine = [i for i, o in enumerate(owners) if (o is None or mesh.axis_index(ctx.replica_id, o.axes) == o.position)
            and _variables.holds(variables[i], ctx.replica_id)]
    graph = tf.compat.v1.get_default_graph()
    pending = any(o is not None and o.pending for o in owners)
    first_op = len(graph.get_operations()) if pending else 0  # the update's ops follow
    if any(grads[i] is not None for i in mine):
      # The owner's new values are broadcast: the other copies will share their buffers, so update out of place.
      shared_out = [_variables.underlying(variables[i]) for i in mine if owners[i] is not None and owners[i].axes]
      with _variables.updated_out_of_place([v for v in shared_out if v is not None]):
        optimizer.apply([grads[i] for i in mine], [variables[i] for i in mine])
    else:
      optimizer.iterations.assign_add(1)  # what apply() would have counted
    if pending:
      owners = self._settle(owners, variables, graph.get_operations()[first_op:], gathered_bytes)
    shared: dict[Owner, list[int]] = {}
    placed: dict[tuple[Owner, tf.DType], list[int]] = {}
    for i, o in enumerate(owners):
      if o is not None and o.axes and _variables.placement_of(variables[i]) is not None:
        placed.setdefault((o, tf.as_dtype(variables[i].dtype)), []).append(i)  # (whatever this replica holds)
      elif o is not None and o.axes and grads[i] is not None:
        shared.setdefault(o, []).append(i)
    location = "wrap_optimizer (sharded update)"
    for owner, indices in shared.items():
      values = [tf.convert_to_tensor(variables[i]) for i in indices]
      received = fused_broadcast(ctx, values, owner.position, owner.axes, location, self.bucket_bytes)
      if mesh.axis_index(ctx.replica_id, owner.axes) != owner.position:
        for i, value in zip(indices, received):
          _variables.underlying(variables[i]).assign(value)  # the local piece (Keras checks global shapes)
    for (owner, dtype), indices in placed.items():
      self._broadcast_placed(ctx, variables, owner, dtype, indices, location)
    return optimizer.iterations

  def _broadcast_placed(self, ctx, variables, owner: Owner, dtype: tf.DType, indices: list[int], location: str):
    """The owner's new values of variables placed on some stages, to the other devices of its stage's group.

    As :meth:`_reduce_placed`: every replica makes the same call, one broadcast along ``owner.axes`` (within
    each stage's group: a stage's batch replicas) of the variables of ``indices`` it holds, flattened into one
    tensor (the groups' sizes differ as their stages' variables do; a stand-in where it holds none of them).
    """
    mine = [i for i in indices if _variables.holds(variables[i], ctx.replica_id)]
    parts = [tf.reshape(tf.cast(tf.convert_to_tensor(variables[i]), dtype), [-1]) for i in mine]
    flat = tf.concat(parts, 0) if parts else tf.zeros([1], dtype)
    (received,) = _primitives.broadcast(ctx, [flat], owner.position, owner.axes, location)
    if mine and self._replicator.mesh.axis_index(ctx.replica_id, owner.axes) != owner.position:
      shapes = [tf.TensorShape(variables[i].shape) for i in mine]
      for i, piece, shape in zip(mine, tf.split(received, [n.num_elements() for n in shapes]), shapes):
        _variables.underlying(variables[i]).assign(tf.reshape(piece, shape))

  # -- checkpoints: the wrapper's dependencies are the wrapped optimizer's -----

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    return self._optimizer._trackable_children(save_type, **kwargs)  # pylint: disable=protected-access

  def _lookup_dependency(self, name, cached_dependencies=None):
    return self._optimizer._lookup_dependency(name, cached_dependencies)  # pylint: disable=protected-access

  @property
  def _deferred_dependencies(self):
    return self._optimizer._deferred_dependencies  # pylint: disable=protected-access

  def __getattr__(self, name):
    return getattr(self._optimizer, name)

  def __setattr__(self, name, value):
    setattr(self._optimizer, name, value)

  def __repr__(self):
    return (f"ReplicatedOptimizer({self._optimizer!r}, reduction={self._reduction!r}, "
            f"accumulation_steps={self.accumulation_steps}, update={self.update!r})")


class _RowAccumulator:
  """The rows and indices of a replica's sparse gradients over the accumulated steps.

  Two variables whose first dimension grows by each step's rows (sync on
  read: every replica keeps its own) and is emptied when the step applies.
  """

  def __init__(self, gradient: tf.IndexedSlices):
    values, indices = gradient.values, gradient.indices
    if not values.shape[1:].is_fully_defined():
      raise _errors.ArgumentError(f"Accumulating a sparse gradient needs rows of a static shape, found values of shape "
                       f"{values.shape}. Fix: give the rows a static shape, or convert the gradient with "
                       "tf.convert_to_tensor (accumulated densely).")
    row = values.shape[1:].as_list()
    kwargs = dict(trainable=False, synchronization=tf.VariableSynchronization.ON_READ,
                  aggregation=tf.VariableAggregation.NONE)
    self.values = tf.Variable(lambda: tf.zeros([0] + row, values.dtype), shape=[None] + row,
                              name="gradient_accumulator_rows", **kwargs)
    self.indices = tf.Variable(lambda: tf.zeros([0], indices.dtype), shape=[None],
                               name="gradient_accumulator_indices", **kwargs)
    self._dense_shape = gradient.dense_shape

  def add(self, gradient: tf.IndexedSlices) -> None:
    self.values.assign(tf.concat([self.values.read_value(), gradient.values], 0))
    self.indices.assign(tf.concat([self.indices.read_value(), tf.cast(gradient.indices, self.indices.dtype)], 0))

  def total(self, gradient: tf.IndexedSlices, steps: int) -> tf.IndexedSlices:
    """The accumulated rows and this step's, divided by ``steps``."""
    values = tf.concat([self.values.read_value(), gradient.values], 0)
    indices = tf.concat([self.indices.read_value(), tf.cast(gradient.indices, self.indices.dtype)], 0)
    return tf.IndexedSlices(values / tf.cast(steps, values.dtype), indices, gradient.dense_shape)

  def reset(self) -> None:
    self.values.assign(tf.zeros([0] + self.values.shape[1:].as_list(), self.values.dtype))
    self.indices.assign(tf.zeros([0], self.indices.dtype))


def _in_global_trace(repl) -> bool:
  """Whether a global-view step of ``repl`` is being traced (its values are global: nothing to reduce)."""
  trace = _context.current_global_trace()
  return trace is not None and trace.replicator is repl


def _new_accumulator(variable, gradient):
  """A replica's accumulator for ``variable``'s gradients: rows for a sparse gradient, else a dense sum."""
  if _context.current_global_trace() is not None:
    # The global view: the step's gradient is global, and so is the sum of k of them: an ordinary variable
    # laid out like its variable (a sparse gradient is summed densely: its rows vary in number).
    with _variables.reference_scope(variable):
      return tf.Variable(lambda: tf.zeros(variable.shape, variable.dtype), trainable=False,
                         name="gradient_accumulator")
  # A variable a pipeline placed on its stages' devices (_variables.place): its accumulator made like it, on the same
  # devices (and moved with it); elsewhere its gradient is zeros, never accumulated.
  placed = _variables.placement_of(variable) is not None
  with _variables.reference_scope(variable) if placed else contextlib.nullcontext():
    if isinstance(gradient, tf.IndexedSlices):
      return _RowAccumulator(gradient)
    # Per-replica sums of local gradients: on-read, so outside a step they read
    # as the sum over replicas.
    return tf.Variable(lambda: tf.zeros(variable.shape, variable.dtype), trainable=False,
                       synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=tf.VariableAggregation.SUM, name="gradient_accumulator")


def _piece_bytes(replicated, pieces: int) -> int:
  """Bytes of one device's piece of a replicated (``pieces=1``) or sharded variable."""
  return replicated.shape.num_elements() * replicated.dtype.size // pieces


# Under the sharded update, every replica applies a sparse update itself (no
# broadcast) only if the variable has at least this many times the bytes of
# the rows gathered per step: scattering rows costs more per byte than the
# broadcast's copy. Keras SGD on a table read by tf.gather, 2,048 rows of 128
# floats gathered per step (1 MB) on 4 logical CPUs: every replica applying
# the rows against one owner broadcasting the table, each over one device's
# step, two runs (python -m benchmarks.sparse --part owners): 1.84-1.90 vs
# 1.24-1.30 for a 1 MB table, 2.24-2.25 vs 1.70-1.75 (4 MB), 2.11-2.33 vs
# 2.30-2.34 (8 MB: break-even), 2.19-2.22 vs 4.40-4.80 (25.6 MB).
ROWS_EVERYWHERE_MIN_RATIO = 8


def rows_everywhere(writes_rows_only: bool, reads_whole: bool, variable_bytes: int,
                    gathered_bytes: int | None) -> bool:
  """Whether every replica should apply a sparse update itself rather than one owner broadcasting it.

  Only when the update writes only rows, the step reads the variable only
  by rows, and the variable holds at least :data:`ROWS_EVERYWHERE_MIN_RATIO`
  times the bytes of the rows gathered per step (unknown: yes). Otherwise:

  * an update that moves every row (Keras Adam, AdamW, SGD with momentum
    decay their slots) must reach every replica whole; recomputing it on
    every replica took 3.7x one device's step for a 50,000 x 128 table, the
    owner's broadcast 1.1x;
  * a whole read (Keras ``Embedding`` converts its table to a tensor) of a
    variable written by rows makes TensorFlow copy the table on every read,
    on every replica that scatters into it (Keras SGD, 50,000 x 128: 2.38x
    with every replica scattering against 1.44x with one owner);
  * a small table is cheaper to copy than its rows are to scatter.
  """
  if not writes_rows_only or reads_whole:
    return False
  return gathered_bytes is None or variable_bytes >= ROWS_EVERYWHERE_MIN_RATIO * gathered_bytes


def _give_slots_their_variables_layout(optimizer) -> dict[str, Any]:
  """Makes a Keras optimizer's slots (``add_variable_from_reference``) inherit their variable's layout.

  Keras names a slot after its variable (``adam/dense_1_kernel_momentum``), so a
  LayoutMap pattern for ``dense_1/kernel`` does not match it. The optimizer's
  own method is wrapped, on this instance only, to create the slot inside
  :func:`replicator.state._variables.reference_scope`.

  Returns this optimizer's record, kept on the wrapped method so every
  wrapper of the optimizer shares it: ``"slots"`` maps ``id`` of a variable's
  ReplicatedVariable to its slots' ReplicatedVariables (made so far and
  later); ``"owners"`` holds the sharded update's owners.
  """
  original = getattr(optimizer, "add_variable_from_reference", None)
  if original is None:
    return {"slots": {}, "owners": {}}
  if getattr(original, "_replicator_wrapped", False):
    return original.record

  slots: dict[int, list] = {}

  def add_variable_from_reference(reference_variable, *args, **kwargs):
    with _variables.reference_scope(reference_variable):
      slot = original(reference_variable, *args, **kwargs)
    reference, replicated = _variables.underlying(reference_variable), _variables.underlying(slot)
    if reference is not None and replicated is not None:
      slots.setdefault(id(reference), []).append(replicated)
    return slot

  add_variable_from_reference._replicator_wrapped = True  # pylint: disable=protected-access
  add_variable_from_reference.record = {"slots": slots, "owners": {}}
  object.__setattr__(optimizer, "add_variable_from_reference", add_variable_from_reference)
  return add_variable_from_reference.record


# Gradient buckets for a Replicator in one process: tensors under 1 MB are
# fused into buckets of at most 1 MB (under the sharded update, one owner's
# gradients a bucket, reduced on the owner), larger ones keep their own
# all-reduce. benchmarks.levers, 60 rounds on 4 logical CPUs of 2 cores, each
# variant against 1 MB per round: 256 KB 1.09 [1.06, 1.16] on the deep MLP,
# 4 MB 1.03 [0.99, 1.08], no buckets 1.18 [1.08, 1.22]; ResNet, transformer
# and the wide MLP 0.98-1.01 under every variant. (Before the buckets were
# reduced on their owner, 256 KB was the best: one 4 MB bucket waited for the
# whole backward pass, 1.11-1.21x.) See benchmarks/README.md, "Levers".
DEFAULT_BUCKET_BYTES = 1 << 20


def fused_all_reduce(repl, values: list[tf.Tensor], op: str, axes: tuple[str, ...],
                     bucket_bytes: int | None, members: list[int | None] | None = None) -> list[tf.Tensor]:
  """``repl.all_reduce(values, op, axis=axes)``, fusing small tensors into buckets.

  Tensors of one dtype and static shape are flattened and concatenated into
  buckets of at most ``bucket_bytes`` (a tensor larger than that is a bucket
  of its own), each bucket is reduced as one tensor, and the results are
  split back. Fewer, larger collectives pay the per-collective cost (a
  network round trip across workers) once per bucket. None or 0: no fusion.

  ``members[i]``, when given and not None, is the one group member that uses
  ``values[i]``'s result: buckets then hold one member's tensors, reduced for
  that member (:func:`_primitives.reduce_for`).
  """
  members = [None] * len(values) if members is None else members
  buckets = _buckets(values, bucket_bytes, members)
  fused = _fuse(values, buckets)
  reduced: list[tf.Tensor] = [None] * len(buckets)
  by_member: dict[int | None, list[int]] = {}
  for k, bucket in enumerate(buckets):
    by_member.setdefault(members[bucket[0]], []).append(k)
  for member, ks in by_member.items():
    if member is None:
      out = repl.all_reduce([fused[k] for k in ks], op=op, axis=axes)
    else:
      ctx = _primitives.require_context(repl, "wrap_optimizer")
      out = _primitives.reduce_for(ctx, [fused[k] for k in ks], op, axes, member, _primitives.user_location())
    for k, r in zip(ks, out):
      reduced[k] = r
  return _unfuse(values, buckets, reduced)


def fused_broadcast(ctx, values: list[tf.Tensor], source: int, axes: tuple[str, ...], location: str,
                    bucket_bytes: int | None) -> list[tf.Tensor]:
  """:func:`_primitives.broadcast` of ``values``, fused into buckets as :func:`fused_all_reduce` does."""
  buckets = _buckets(values, bucket_bytes, [None] * len(values))
  received = _primitives.broadcast(ctx, _fuse(values, buckets), source, axes, location)
  return _unfuse(values, buckets, received)


# A bucket of at least twice rewrite.OVERLAP_BYTES is reduced in two parts, the
# gradients of its last variables first: in the backward pass they exist first,
# and their all-reduce then runs while the first variables' gradients are
# computed (one more collective, whose round trip the overlap must pay for).
# The wide MLP (8.4 MB of gradients; Adam) in a multi-client job on loopback
# workers, its 64 MB bucket in two parts against one, 3 alternated runs each:
# 4 workers 109.5-115.6 ms against 134.8-136.7 ms (MultiWorkerMirroredStrategy:
# 119.6-121.3 ms), 2 workers 61.1-66.0 against 63.2-65.0 (60.5-62.9), 8 workers
# 253.8-267.3 against 234.5-267.8 (247.3-258.9, 2 runs). The deep MLP's 1 MB in
# two parts cost 1-2 ms at 2 workers, 6 ms at 4 and 20 ms at 8 (one more round
# trip, nothing to overlap): below this size a bucket stays whole.


def _buckets(values: list[tf.Tensor], bucket_bytes: int | None, keys: list[Any]) -> list[list[int]]:
  """Indices of ``values`` in buckets of at most ``bucket_bytes``, one dtype and one key each.

  A tensor without a static shape, or larger than ``bucket_bytes``, is a
  bucket of its own; None or 0: every tensor is. A bucket of at least
  ``2 * rewrite.OVERLAP_BYTES`` is two: its last tensors (half its bytes or
  more) first, then the others (``rewrite.overlap_split``).
  """
  buckets = _filled(values, bucket_bytes, keys)
  return [part for bucket in buckets for part in _overlapped(values, bucket)]


def _overlapped(values: list[tf.Tensor], bucket: list[int]) -> list[list[int]]:
  """``bucket`` as one, or as two (its last tensors first) if it holds ``2 * rewrite.OVERLAP_BYTES`` or more."""
  if len(bucket) < 2:  # (a bucket of several tensors: each of a static shape)
    return [bucket]
  last_first = [values[i].shape.num_elements() * values[i].dtype.size for i in reversed(bucket)]
  k = rewrite.overlap_split(last_first)
  return [bucket[len(bucket) - k:], bucket[:len(bucket) - k]] if k < len(bucket) else [bucket]


def _filled(values: list[tf.Tensor], bucket_bytes: int | None, keys: list[Any]) -> list[list[int]]:
  """Indices of ``values`` in buckets of at most ``bucket_bytes`` (filled in order), one dtype and one key each."""
  buckets: list[list[int]] = []
  open_bucket: dict[tuple[tf.DType, Any], tuple[list[int], int]] = {}
  for i, v in enumerate(values):
    if not bucket_bytes or not v.shape.is_fully_defined():
      buckets.append([i])
      continue
    nbytes = v.shape.num_elements() * v.dtype.size
    key = (v.dtype, keys[i])
    bucket, size = open_bucket.get(key, (None, 0))
    if bucket is None or size + nbytes > bucket_bytes:
      bucket, size = [], 0
      buckets.append(bucket)
    bucket.append(i)
    open_bucket[key] = (bucket, size + nbytes)
  return buckets


def _fuse(values: list[tf.Tensor], buckets: list[list[int]]) -> list[tf.Tensor]:
  return [values[b[0]] if len(b) == 1 else tf.concat([tf.reshape(values[i], [-1]) for i in b], 0) for b in buckets]


def _unfuse(values: list[tf.Tensor], buckets: list[list[int]], fused: list[tf.Tensor]) -> list[tf.Tensor]:
  results: list[tf.Tensor] = [None] * len(values)
  for bucket, r in zip(buckets, fused):
    if len(bucket) == 1:
      results[bucket[0]] = r
      continue
    sizes = [values[i].shape.num_elements() for i in bucket]
    for i, piece in zip(bucket, tf.split(r, sizes)):
      results[i] = tf.reshape(piece, values[i].shape)
  return results
