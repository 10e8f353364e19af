"""The Replicator: replicated variables, ``run``, collectives and reductions."""

from __future__ import annotations

import contextlib
import functools
import numbers
import threading
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf
import tree

import mesh as mesh_lib
import rewrite
from replicator.core import _collective_methods
from replicator.core import _config
from replicator.core import _context
from replicator.core import _errors
from replicator.core import _gc
from replicator.core import _pipeline
from replicator.core import _primitives
from replicator.core._values import PerReplica
from replicator.guarantees import _run_state
from replicator.input import _distributed_dataset
from replicator.input import _process_shards
from replicator.integrations import _keras
from replicator.integrations import _keras_attention  # noqa: F401  (registers its trace hook: blockwise attention)
from replicator.integrations import _keras_distribution
from replicator.integrations import _keras_hub_sequence
from replicator.integrations import _keras_outputs  # noqa: F401  (registers its trace hook: Keras's output keys)
from replicator.integrations import _keras_random
from replicator.integrations import _keras_spatial
from replicator.state import _layout_state
from replicator.state import _optimizer
from replicator.state import _restore
from replicator.state import _variables
from replicator.views import _auto_layouts
from replicator.views import _calibration
from replicator.views import _global
from replicator.views import _global_step
from replicator.views import _in_function
from replicator.views import _local

NESTED_RUN = (
    "repl.{name}() was called inside a step being built (replica {replica} of a Replicator's "
    "step_fn): steps do not nest. Fix: call the inner step's function directly; it runs on this replica."
)
RUN_IN_FUNCTION = (
    "repl.{name}() was called while a tf.function is being traced (graph {graph!r}). It builds the step "
    "and returns what it found without running anything, from Python. Fix: call repl.{name}(...) outside the "
    "function (repl.run, not explain, may be called inside one)."
)

NO_BATCH_AXES = (
    "This Replicator's mesh {shape} has no 'batch' or 'replica' axis, so it cannot tell how "
    "to split input batches across devices. Fix: pass Replicator(mesh=..., batch_axes=...) "
    "naming the axes to split the batch over (one of {names}), or batch_axes=() to give "
    "every device the same input."
)


# repl.reduce's ops: each reduces a stack (or concatenation) of the replicas' values along an axis.
REDUCERS = {"sum": tf.reduce_sum, "mean": tf.reduce_mean, "max": tf.reduce_max, "min": tf.reduce_min}

AXIS_TYPE = (
    "repl.{name}(..., axis={axis!r}): axis must be {expected}, found {found}. Fix: pass a dimension of the "
    "values as an int (axis=0: the first; axis=-1: the last)."
)
AXIS_OUT_OF_RANGE = (
    "repl.{name}(..., axis={axis}) is out of range: {path} have rank {rank} (shape {shape}{scalars}), "
    "so axis must be in [{low}, {high}). Fix: pass an axis in [{low}, {high}) (a negative one counts from the "
    "last dimension){extra}."
)
SCALAR_AXIS = (
    "repl.reduce(..., axis={axis}): {path} are scalars (rank 0), which have no dimension to reduce "
    "along; an int axis needs values of rank >= 1. Fix: pass axis=None (the default: the replicas' scalars "
    "combined), or return values of rank >= 1 from the step."
)


def _shape(value) -> tf.TensorShape:
  return tf.TensorShape(value.shape if hasattr(value, "shape") else np.shape(value))


def check_axis(name: str, axis, per_replica) -> None:
  """Refuses ``repl.<name>(per_replica, axis=axis)`` (reduce or gather) before anything runs, unless valid.

  Valid: an int in ``[-rank, rank)`` for every value (gather stacks scalars, so there they count as rank 1), or
  None for reduce.
  """
  if axis is None and name == "reduce":
    return
  if not isinstance(axis, numbers.Integral) or isinstance(axis, bool):
    expected = "None or an int" if name == "reduce" else "an int"
    raise _errors.ArgumentTypeError(AXIS_TYPE.format(name=name, axis=axis, expected=expected,
                                                     found=type(axis).__name__))
  axis = int(axis)
  for path, leaf in tree.flatten_with_path(per_replica):
    values = leaf.values if isinstance(leaf, PerReplica) else (leaf,) if isinstance(leaf, tf.Tensor) else ()
    for value in values:
      shape = _shape(value)
      if shape.rank is None:
        continue  # known only when it runs: TensorFlow checks it
      where = f"the values at {'/'.join(str(p) for p in path)}" if path else "the values"
      if shape.rank == 0 and name == "reduce":
        raise _errors.ArgumentError(SCALAR_AXIS.format(axis=axis, path=where))
      rank = max(shape.rank, 1)  # gather stacks scalars into a vector
      if not -rank <= axis < rank:
        raise _errors.ArgumentError(AXIS_OUT_OF_RANGE.format(
            name=name, axis=axis, path=where, rank=shape.rank, shape=tuple(shape.as_list()), low=-rank, high=rank,
            scalars=", scalars: stacked into a vector" if shape.rank == 0 else "",
            extra=", or axis=None to combine the replicas elementwise only" if name == "reduce" else ""))


CONTEXT_PARALLEL = ("all_gather", "ring", "ulysses")


def _placed_on_stages(variables, own, axes: tuple[str, ...], devices: int, reads: dict) -> list:
  """Places each of a pipeline's ``variables`` on the devices (positions along ``axes``) of the stages that read it
  (``reads``: ``{stage: [variable]}``), its optimizer slots alike; returns each one's positions (None: every
  device's: a variable split over ``axes`` or over others, each replica's own, read by every device's stages, or
  by none)."""
  readers: dict[int, set[int]] = {}
  read = {}
  for stage, found in reads.items():
    for variable in found:
      readers.setdefault(id(variable), set()).add(stage % devices)
      read[id(variable)] = variable
  for variable in read.values():
    _variables.share_stream(variable, axes)  # (a random-seed state: one stream over the stages)
  out = []
  for k, variable in enumerate(variables):
    replicated = _variables.underlying(variable)
    positions = None if replicated is None or k in own else readers.get(id(replicated))
    if positions is not None:  # (else not read by the stages: where it is)
      _variables.place(variable, axes, positions)
    # (a variable split over other axes, or each replica's own, stays where it is)
    placed = None if replicated is None else replicated.placement
    out.append(placed[1] if placed is not None and placed[0] == axes else None)
  return out


def _split_over(layout, axes: tuple[str, ...]) -> bool:
  """Whether ``layout`` (a sharded variable's, or None) splits its first dimension over exactly ``axes``."""
  return layout is not None and layout.rank > 0 and tuple(layout.axes(0)) == tuple(axes)


def _check_input_layouts(input_layouts, mesh: mesh_lib.Mesh, view: str):
  """``input_layouts`` as the Config keeps it: None, a callable, or a spec as axes per dimension."""
  if input_layouts is None:
    return None
  if view != "global":
    raise _errors.ArgumentError(
        f"Replicator(input_layouts={input_layouts!r}, view={view!r}): input layouts split a step's inputs beyond "
        "their batch in the global view, which partitions the single-device step. In the local view each "
        "replica's step sees its own input: split a sequence there with replicator.shard_sequence. Fix: pass "
        "view='global', or leave input_layouts out.")
  if callable(input_layouts):
    return input_layouts
  layout = mesh_lib.Layout(input_layouts, mesh)  # raises LayoutError naming a bad entry or an unknown axis
  return tuple(layout.axes(d) for d in range(layout.rank))


def _check_view(view: str) -> str:
  if view not in ("local", "global"):
    raise _errors.ArgumentError(f"view={view!r}: expected \"local\" (step_fn sees each device's piece, "
                                "today's behaviour) or \"global\" (step_fn sees global values).")
  return view


def _as_layout_map(layouts):
  if layouts is None or isinstance(layouts, mesh_lib.LayoutMap):
    return layouts
  if _keras_distribution.is_layout_map(layouts):
    return _keras_distribution.as_layout_map(layouts)
  if isinstance(layouts, dict):
    return mesh_lib.LayoutMap(layouts)
  raise _errors.ArgumentTypeError(f"layouts must be a mesh.LayoutMap, a keras.distribution.LayoutMap or a dict of "
                                  f"variable path pattern to layout spec, "
                  f"found {type(layouts).__name__}.")


@_context.no_autograph
class Replicator(_collective_methods.CollectiveMethods):
  """Runs a single-device training step on several devices, in one graph.

  Variables created in :meth:`context` get one identical component per
  device. :meth:`run` traces ``step_fn`` once per replica, each trace under its
  device; collectives called inside it (:meth:`all_reduce`, :meth:`broadcast`,
  :meth:`all_gather`, :meth:`reduce_scatter`, :meth:`all_to_all`,
  :meth:`permute`, ``wrap_optimizer``'s gradient reduction) leave
  placeholders that a rewrite pass replaces with real cross-device
  communication. The result is cached: later calls run one graph.
  Collectives take ``axis=``: the mesh axis name (or tuple of names) whose
  groups communicate; by default all replicas do.

  Examples:
    >>> repl = Replicator(devices=["cpu:0", "cpu:1"])
    >>> with repl.context():
    ...   v = tf.Variable(1.0)
    >>> def step_fn():
    ...   v.assign_add(repl.all_sum(tf.cast(repl.replica_id, tf.float32)))
    ...   return v.read_value()
    >>> [float(x) for x in repl.run(step_fn)]  # 1 + (0 + 1) on both replicas
    [2.0, 2.0]

  Args:
    devices: device strings, or None for all local logical devices of the
      preferred type (GPUs if any, else CPUs).
    mesh: a :class:`mesh.Mesh` (or a ``keras.distribution.DeviceMesh``) to run
      on instead of ``devices`` (one replica per mesh device). By default a
      one-dimensional mesh ``{"replica": N}``.
    implementation: collective implementation: ``"auto"`` (chosen per
      collective) or a registered lowering name (``"one_device"``,
      ``"collective_ops"``).
    autograph: convert ``step_fn`` with AutoGraph, as ``tf.function`` does.
    prefetch_to_device: elements of each ``input_fn`` dataset to prefetch onto
      its replica's device (0: iterate on the host). By default 2 on
      accelerators and 0 on CPUs, where device memory is host memory (on 4
      logical CPUs it made an overhead-bound step 1.37x slower).
    batch_axes: mesh axes the input batch is split over (input pipelines are
      one per position along them; devices that differ only along the other
      axes get the same elements). By default the mesh's ``"batch"`` axis, or
      its ``"replica"`` axis (the default one-dimensional mesh); ``()`` gives
      every device the same input.
    layouts: a :class:`mesh.LayoutMap` (or dict, or ``keras.distribution.LayoutMap``)
      choosing the layout of variables created in :meth:`context` and in
      steps; see :meth:`context`. ``"auto"`` (global view): the first step
      built chooses them by a search priced by the cost model (variables are
      replicated until then; see :attr:`layouts` and the docs' "Automatic
      layouts").
    memory_per_device: with ``layouts="auto"``, the bytes a device may hold:
      its variables, their optimizer slots and the step's tensors at their
      peak (None: no limit); a layout that needs more is not chosen, or is
      made to fit by rematerializing the fewest blocks of the step (their
      activations computed again in the backward pass; ``explain`` names
      them).
    drop_remainder: when the replicas' ``input_fn`` datasets have different
      lengths, end the epoch as soon as one runs out, dropping the rows left
      on the others. By default (False) the epoch ends when every dataset has
      run out, and a replica whose dataset already has runs the step on an
      empty batch (as tf.distribute does), so every row is used; divide a
      summed loss by ``repl.all_sum(tf.shape(x)[0])`` and use
      ``wrap_optimizer(reduction="sum")`` to match one device then.
    input_layouts: in the global view, how a step's inputs are split beyond
      their batch dimension: a layout spec (one entry per dimension, as
      :class:`mesh.LayoutMap`'s) applied to every input of its rank, e.g.
      ``("batch", "seq")`` for token ids and their labels (their sequence
      split over a ``"seq"`` axis), ``("batch", "rows", "cols", None)`` for
      images split into tiles; or a function ``(index, spec) -> spec or None``
      of each input's position in the flattened batch and its
      ``tf.TensorSpec``. Inputs given no spec are split over ``batch_axes``
      alone. The split is kept through the layers whose rules allow it;
      ``explain`` says where it is gathered and why. In one process of a
      multi-client job, only the batch dimension may be split
      (``UnsupportedError`` otherwise).
    context_parallel: in the global view, how Keras's attention
      (``MultiHeadAttention``, ``keras.ops.dot_product_attention``, and
      KerasHub's Llama and Gemma attention, routed to it) exchanges
      a sequence split over the mesh's non-batch axes: ``"all_gather"`` (the
      default: the keys and values gathered, blockwise softmax, their
      gradients reduce-scattered), ``"ring"`` (ring attention: the keys and
      values passed from device to device a tile a step, point to point, the
      scores of one tile pair at a time, their gradients passed back around
      the ring; where the sequence's axes span worker processes, or its
      length does not divide, the all-gather) or ``"ulysses"`` (DeepSpeed-Ulysses: the
      queries, keys and values moved by all-to-all from a split of the tokens
      to a split of the heads, attention computed on whole sequences of each
      device's heads, the output moved back; the heads must divide over those
      axes). See the concepts page on sequences.
    view: ``"local"`` (the default): ``step_fn`` sees each device's piece and
      calls collectives itself. ``"global"`` (experimental): ``step_fn`` is the
      single-device step, seeing global values, partitioned by the layouts
      alone (see the README's "The global view").
    strict: in the global view, refuse (``UnsupportedError``, when the step is
      built) an op without a layout rule whose inputs are split, instead of
      gathering its inputs and running it on whole values with a warning.
      Use it to make sure a step communicates only what its layouts require.
      In both views it also makes a layouts key that matches no variable a
      ``mesh.LayoutError`` (otherwise a warning).
    update: in the global view, how the optimizer updates a variable that is
      replicated over the batch axes: ``"sharded"``, by one owner device of
      each batch group (its slots current there only), which broadcasts the
      new value to the group; ``"replicated"``, by every device; ``"auto"``
      (default), sharded on the CPUs of one process, as
      ``wrap_optimizer(update="auto")`` does for the local view (where this
      argument has no effect). Results are the same either way.
    atomic: a call of :meth:`run` that fails at run time (an assertion, a
      ``check_numerics``, on any device) writes no variable (True, the
      default): the step's writes wait for every op of the step that can
      fail, and a variable written before such an op (one a later check reads)
      is kept at the start of the call and written back after a failure, as
      is every variable a call of ``steps=k`` writes (see the docs'
      Performance page). False orders nothing and keeps no copy: a failed
      step may leave some devices' copies written, which is detected for
      replicated variables (``ReplicasDivergedError``) but not for sharded
      ones. A step that Keras's ``fit``/``evaluate`` calls in the global
      view is written back when the error leaves Keras's function (a failure
      in the call that traces it: at the start of the next step); a step
      called inside your own ``tf.function``, at the start of its next call.
  """

  def __init__(self, devices: Sequence[str] | None = None, *, mesh: mesh_lib.Mesh | None = None,
               implementation: str = "auto", autograph: bool = True, prefetch_to_device: int | None = None,
               batch_axes: str | Sequence[str] | None = None, layouts=None, drop_remainder: bool = False,
               view: str = "local", strict: bool = False, update: str = "auto", atomic: bool = True,
               memory_per_device: int | None = None, input_layouts=None, context_parallel: str = "all_gather"):
    if mesh is not None and devices is not None:
      raise _errors.ArgumentError("Pass either `devices` or `mesh` to Replicator, not both "
                       "(a mesh already lists its devices).")
    if _keras_distribution.is_device_mesh(mesh):  # code written for Keras's distribution API
      mesh = _keras_distribution.as_mesh(mesh)
    self._mesh = mesh if mesh is not None else mesh_lib.Mesh.from_devices(devices)
    view = _check_view(view)
    if not isinstance(atomic, bool):
      raise _errors.ArgumentTypeError(
          f"Replicator(atomic={atomic!r}): expected True (a step that fails writes no variable; the default) or "
          f"False (no copy kept; a failed step may leave some devices' variables written), a bool. "
          f"Fix: atomic=True, or atomic=False.")
    if update not in _global_step.UPDATES:
      raise _errors.ArgumentError(f"Replicator(update={update!r}): update must be one of {_global_step.UPDATES}.")
    if batch_axes is None:
      batch_axes = next(((a,) for a in ("batch", "replica") if a in self._mesh.shape), None)
    batch_axes = None if batch_axes is None else self._mesh.normalize_axes(batch_axes)
    auto = None  # layouts="auto": the search's state (_auto_layouts.Auto)
    if isinstance(layouts, str) and layouts == "auto":
      if view != "global":
        raise _errors.ArgumentError(
            f"Replicator(layouts='auto', view={view!r}): automatic layouts are chosen by partitioning the "
            "single-device step, in the global view. Fix: pass view='global', or give the layouts (a "
            "mesh.LayoutMap).")
      auto = _auto_layouts.Auto(memory_per_device, machine=_machine)
      layouts = None
    elif memory_per_device is not None:
      raise _errors.ArgumentError(
          f"Replicator(memory_per_device={memory_per_device!r}) bounds the layouts a search chooses, but layouts="
          f"{layouts!r} were given. Fix: pass layouts='auto', or leave memory_per_device out.")
    self._layouts = _layout_state.LayoutState(_as_layout_map(layouts), auto)
    input_layouts = _check_input_layouts(input_layouts, self._mesh, view)
    if context_parallel not in CONTEXT_PARALLEL:
      raise _errors.ArgumentError(
          f"Replicator(context_parallel={context_parallel!r}): expected one of {CONTEXT_PARALLEL} (how the global "
          "view's attention exchanges a split sequence). Fix: context_parallel='all_gather' (the default), "
          "'ring' or 'ulysses'.")
    if context_parallel != "all_gather" and view != "global":
      raise _errors.ArgumentError(
          f"Replicator(context_parallel={context_parallel!r}, view={view!r}): the scheme chooses how the global "
          "view's attention exchanges a split sequence; in the local view a step calls it itself. Fix: call "
          f"repl.{'ring' if context_parallel == 'ring' else 'ulysses'}_attention(q, k, v, axis=...) in the step, or "
          "pass view='global'.")
    if implementation != "auto":
      rewrite.get_lowering(implementation)  # raises a clear error if unknown
    self._keras_strategy = None
    if prefetch_to_device is not None and (not isinstance(prefetch_to_device, int)
                                           or isinstance(prefetch_to_device, bool) or prefetch_to_device < 0):
      raise _errors.ArgumentTypeError(
          f"Replicator(prefetch_to_device={prefetch_to_device!r}): expected None (the default: 2 on "
          f"accelerators, 0 on CPUs) or how many elements to prefetch onto each device, an int >= 0. "
          f"Fix: prefetch_to_device=2, or 0 to keep the input on the host.")
    if prefetch_to_device is None:
      on_cpu = all(tf.DeviceSpec.from_string(d).device_type == "CPU" for d in self.devices)
      prefetch_to_device = 0 if on_cpu else 2
    self._config = _config.Config(
        mesh=self._mesh, view=view, strict=bool(strict), atomic=atomic, update=update, batch_axes=batch_axes,
        autograph=autograph, implementation=implementation, prefetch_to_device=prefetch_to_device,
        drop_remainder=bool(drop_remainder), host=mesh_lib.canonical_name("CPU:0"), input_layouts=input_layouts,
        context_parallel=context_parallel)
    self._config = self._configured(self._config)
    # What the calls share (the state of runs), what makes variables, and the two views that build and run steps.
    self._state = _run_state.RunState(self._layouts, self._config.strict)
    self._creator = _variables.make_creator(self, self._config, self._layouts, self._state)
    self._views = {"local": _local.LocalView(self, self._config, self._state, self._creator),
                   "global": _global.GlobalView(self, self._config, self._state, self._layouts, self._creator)}
    # One call at a time: two calls of one step at once would pair their collectives across calls.
    self._running = threading.Lock()

  def _configured(self, config: _config.Config) -> _config.Config:
    """The configuration this Replicator runs with: ``config``, as a subclass completes it (its lowerings)."""
    return config

  @property
  def trace_count(self) -> int:
    """How many steps this Replicator has built (traced, planned and rewritten) so far."""
    return self._state.trace_count

  @property
  def steps_run(self) -> int:
    """How many steps the last call of :meth:`run` ran (fewer than ``steps`` when the input ended)."""
    return self._state.steps_run

  # -- placement ---------------------------------------------------------------

  @property
  def mesh(self) -> mesh_lib.Mesh:
    """The mesh the replicas run on."""
    return self._mesh

  @property
  def devices(self) -> tuple[str, ...]:
    """One device per replica, in replica order."""
    return self._mesh.devices

  @property
  def num_replicas(self) -> int:
    """The number of replicas."""
    return self._mesh.size

  @property
  def batch_axes(self) -> tuple[str, ...]:
    """Mesh axes the input batch is split over (see the constructor)."""
    if self._config.batch_axes is None:
      raise _errors.ArgumentError(NO_BATCH_AXES.format(shape=self._mesh.shape, names=self._mesh.axis_names))
    return self._config.batch_axes

  @property
  def num_input_pipelines(self) -> int:
    """How many different input streams feed the replicas: the size of ``batch_axes``."""
    return self._mesh.axis_size(self.batch_axes)

  def pipeline(self, stages, inputs, targets, loss_fn, *, axis="stage", microbatches: int, schedule: str = "1f1b",
               variables=None, outputs: bool = False, stage_losses: bool = False, loss_scale=None):
    """``(loss, grads)`` of ``stages`` run in a row on the batch, as a pipeline over the devices along ``axis``.

    The replica at position ``s`` along ``axis`` runs ``stages[s]`` (a Keras model or layer, or any callable
    of one value: the previous stage's output, or ``inputs`` for the first) on each of ``microbatches`` pieces
    of its batch, and the last applies ``loss_fn(targets, outputs)`` (a mean over the rows). Activations go
    forward and their gradients back between neighbours (in one process, plain cross-device edges);
    ``schedule`` orders each device's passes: ``"gpipe"`` (every forward pass, then every backward pass),
    ``"1f1b"`` (one forward and one backward pass in turn after ``p - s - 1`` forward ones: at most ``p - s``
    microbatches' activations kept) or ``"interleaved"`` (Megatron-LM's interleaved 1F1B: ``v`` stages a
    device, given as ``v p`` stages, device ``d`` running stages ``d, d + p, ...``; a bubble ``v`` times
    smaller; ``microbatches`` a multiple of ``p``). Both give one device's loss and gradients for the rows (a ragged last
    microbatch weighted by its rows). See ``docs/concepts/stages.md``.

    Each stage's variables live on its devices only: the first time the step is traced, each of ``variables``
    is placed on the devices of the stages that read it (replicated over the mesh's other axes), and the
    optimizer slots ``repl.wrap_optimizer`` makes for it follow, so a device keeps its stages' weights and slots
    alone (``1 / p`` of them for stages of equal size). Their gradients stay there: no collective over ``axis``;
    ``wrap_optimizer`` reduces each over the other axes and updates it on its own devices. A weight several stages
    read (an embedding tied to the output layer) lives on the devices of each of them, its gradient the sum of
    their parts (sent between them). A variable every device's stages read stays on every replica, its gradient
    summed over ``axis``. Variables may also be split over ``axis`` along their first dimension, one block a
    stage (identical blocks' weights stacked, as praxis and JAX's ``shard_map`` pipelines hold them). Steps built
    before the first pipelined one hold the variables' old copies: build them again. A step must not use a
    stage's variable outside its stage (an ``UnsupportedError`` names it), and a wrapped optimizer that couples
    every gradient (``global_clipnorm``) is refused; a wrapped ``LossScaleOptimizer`` skips a step on every stage
    if any stage's gradients are not finite (give it ``loss_scale=``).

    State a stage writes that every replica holds alike is written once a step on every replica, from its
    microbatches' values averaged by their rows: BatchNormalization normalizes each microbatch by its own
    statistics, and its moving mean moves by the batch's mean, its moving variance by the microbatches' mean
    variance (as Keras 2's ``virtual_batch_size``). A write by a delta, of a trainable variable, or of a variable
    two stages write is an ``UnsupportedError``.

    Examples:
      >>> import keras, mesh
      >>> repl = Replicator(mesh=mesh.Mesh({"stage": 2}, devices=["cpu:0", "cpu:1"]))
      >>> with repl.context():
      ...   stages = [keras.Sequential([keras.layers.Dense(4)]), keras.Sequential([keras.layers.Dense(1)])]
      ...   stages[0].build((None, 3)); stages[1].build((None, 4))
      >>> x, y = tf.ones([8, 3]), tf.zeros([8, 1])
      >>> loss, grads = repl.run(lambda: repl.pipeline(stages, x, y, keras.losses.mean_squared_error,
      ...                                              microbatches=4))
      >>> len(grads) == len(replicator.pipeline_variables(stages)), float(loss[0]) == float(loss[1])
      (True, True)

    Args:
      stages: one callable a device along ``axis``, in order (a multiple of the devices with ``"interleaved"``
        and ``"gpipe"``: device ``d`` runs stages ``d, d + p, ...``); their variables built.
      inputs: the replica's batch for the first stage (a tensor or nest; rows along the first dimension).
      targets: the last stage's targets (a tensor or nest, the same rows).
      loss_fn: ``loss_fn(targets, outputs)``: the loss, a mean over the rows (or per-row losses, averaged).
      axis: the mesh axis (or tuple of axes) of the stages.
      microbatches: how many pieces each replica's batch is split into (the last smaller if they do not divide).
      schedule: ``"1f1b"`` (the default), ``"gpipe"`` or ``"interleaved"``.
      variables: the variables to differentiate (default: ``replicator.pipeline_variables(stages)``, each
        stage's ``trainable_variables``): give them where the stages are functions reading variables, stacked
        ones among them.
      outputs: also return the last stage's outputs for the replica's rows (its microbatches' joined in order), on
        every replica along ``axis`` (they travel in the all-reduce of the loss): for metrics of the predictions.
      stage_losses: add the losses Keras stages add themselves, as one device's ``loss + sum(model.losses)``: a
        loss a layer adds in its call (``add_loss``, an activity regularizer) on each microbatch, weighted by its
        rows as the loss is (a mean over the rows, as Keras's activity penalty is, or a value that does not depend
        on them, is one device's; a sum over the rows counts as their mean), and each regularized weight's penalty
        once a step, on its stage's devices; their gradients join the stages'.
      loss_scale: the gradients of the loss times this float32 scalar (or of a function giving it, called once the
        variables are placed): a ``LossScaleOptimizer``'s ``scale_loss(1.0)``, for ``mixed_float16``. Each
        backward pass is seeded with it, as one device's gradient of the scaled loss is; the loss is returned
        unscaled. ``repl.wrap_optimizer`` of the ``LossScaleOptimizer`` then agrees on every stage whether the
        step's gradients are finite.

    Returns:
      ``(loss, grads)``: the batch's loss, the same on every replica of the axis, and the gradients of
      ``variables``: each on the replicas that hold its variable (zeros on the others); of a variable split
      over it, each replica's block's, as the local view gives a split variable's gradient (times the stages:
      ``repl.wrap_optimizer``, which a split variable needs, divides by them). With ``outputs=True``,
      ``(loss, grads, outputs)``.
    """
    ctx = _primitives.require_context(self, "pipeline")
    axes, variables, own, place = self._pipeline_placement(stages, axis, variables)
    with _keras_random.one_call_draws(ctx):  # (Keras's random draws: the unpipelined step's numbers)
      return _pipeline.pipeline(ctx, stages, inputs, targets, loss_fn, axes, microbatches, schedule,
                                _primitives.user_location(), variables, own, place, outputs, stage_losses,
                                loss_scale)

  def pipeline_forward(self, stages, inputs, *, axis="stage", microbatches: int, variables=None,
                       stage_losses: bool = False):
    """The outputs of ``stages`` run in a row on the batch, as a pipeline over the devices along ``axis``: a
    forward pass only (evaluation, prediction).

    Each stage's forward pass runs on each microbatch on its devices, as in :meth:`pipeline` (the same stages,
    the same placement of ``variables`` on their stages' devices: whichever of the two is traced first places
    them), and its output goes to the next stage's device; no activation is kept for a backward pass. The last
    stage's outputs for the replica's rows, joined in order, reach every replica along ``axis`` (an all-reduce,
    zeros from the other stages).

    Examples:
      >>> import keras, mesh
      >>> repl = Replicator(mesh=mesh.Mesh({"stage": 2}, devices=["cpu:0", "cpu:1"]))
      >>> with repl.context():
      ...   stages = [keras.Sequential([keras.layers.Dense(4)]), keras.Sequential([keras.layers.Dense(1)])]
      ...   stages[0].build((None, 3)); stages[1].build((None, 4))
      >>> out = repl.run(lambda: repl.pipeline_forward(stages, tf.ones([8, 3]), microbatches=4))
      >>> out[0].shape, bool(tf.reduce_all(out[0] == out[1]))
      (TensorShape([8, 1]), True)

    Args:
      stages: one callable a device along ``axis`` (or a multiple of them: device ``d`` runs stages ``d, d + p,
        ...``), as for :meth:`pipeline`.
      inputs: the replica's batch for the first stage (a tensor or nest; rows along the first dimension).
      axis: the mesh axis (or tuple of axes) of the stages.
      microbatches: how many pieces each replica's batch is split into.
      variables: the variables the stages read that :meth:`pipeline` differentiates (default:
        ``replicator.pipeline_variables(stages)``): placed on their stages' devices.
      stage_losses: also return the losses Keras stages add themselves, as :meth:`pipeline` adds them (for
        evaluation's loss): ``(outputs, added)``, ``added`` the same on every replica along ``axis``.
    """
    ctx = _primitives.require_context(self, "pipeline_forward")
    axes, variables, own, place = self._pipeline_placement(stages, axis, variables)
    with _keras_random.one_call_draws(ctx):
      return _pipeline.forward(ctx, stages, inputs, axes, microbatches, _primitives.user_location(), variables,
                               own, place, stage_losses)

  def pipeline_stages(self, stages, *, microbatches: int, schedule: str = "1f1b", axis: str = "stage") -> None:
    """Global view: the one-device step run as a pipeline of ``stages`` over the devices along ``axis``.

    ``stages`` lists what each position along ``axis`` runs, in order: a Keras layer or model, or a list of
    them (``replicator.split_stages(model, p)`` cuts a Keras chain so, by cost or at ``split_points``). The
    step stays the one-device step: every op of it that reads a stage's variables runs on that stage's devices,
    and so do the ops after it until the next stage's (the loss on the last stage's), and their gradients and
    optimizer updates; a value one stage computes and the next reads goes from device to device. Each
    stage's variables, with their optimizer slots, are placed on its devices (``1 / p`` of the model a
    device, for stages of equal size). Each device's rows are split into ``microbatches`` pieces, each
    computed apart: stage 0 can start microbatch 1 while stage 1 works on microbatch 0, and each
    microbatch's backward pass as soon as its forward pass and the next stage's gradient are done. The
    gradients are summed over the microbatches, so the step computes what one device computes: an op that
    needs the whole batch (BatchNormalization's statistics in training) combines the microbatches, and waits
    for them. ``schedule`` orders each device's passes: ``"gpipe"`` in the order TensorFlow's executor finds
    (any ready pass: the forward passes first, every microbatch's activations held), ``"1f1b"`` (the default)
    with microbatch ``j``'s forward pass on stage ``s`` after microbatch ``j - (p - s)``'s backward pass
    (PipeDream-Flush: at most ``p - s`` microbatches' activations held; a step that combines the microbatches
    in its forward pass is refused, naming the op: use ``"gpipe"``).

    Steps built before are built again. Applies to the steps of this Replicator built after it (``repl.run``,
    Keras's ``fit``). See ``docs/concepts/stages.md``.

    Examples:
      >>> import keras, mesh
      >>> repl = Replicator(mesh=mesh.Mesh({"stage": 2}, devices=["cpu:0", "cpu:1"]), view="global", batch_axes=())
      >>> with repl.context():
      ...   model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
      >>> repl.pipeline_stages([model.layers[0], model.layers[1]], microbatches=2)
      >>> def step(batch):
      ...   with tf.GradientTape() as tape:
      ...     loss = tf.reduce_mean((model(batch) - 1.0) ** 2)
      ...   return tape.gradient(loss, model.trainable_variables)
      >>> grads = repl.run(step, inputs=tf.ones([8, 3]))
      >>> [tuple(g.shape) for g in grads]
      [(3, 4), (4,), (4, 1), (1,)]

    Args:
      stages: one Keras layer or model, or a variable (or a list of them) a device along ``axis``, built
        (their variables made in this Replicator's context).
      microbatches: how many pieces each device's rows are split into (dividing them).
      schedule: ``"1f1b"`` or ``"gpipe"``.
      axis: the stage axis: one mesh axis, not a batch axis.

    Raises:
      ArgumentError: not a global-view Replicator, an unknown or batch axis, as many stages as not its devices,
        a stage without variables or a variable in two stages, ``microbatches`` not a positive int.
    """
    where = f"repl.pipeline_stages(axis={axis!r})"
    if self._config.view != "global":
      raise _errors.ArgumentError(f"{where} partitions a global-view step; this Replicator's view is "
                                  f"{self._config.view!r}. Fix: Replicator(view='global'), or write the local "
                                  "view's step with repl.pipeline.")
    if not isinstance(axis, str) or axis not in self._mesh.shape or axis in (self._config.batch_axes or ()):
      raise _errors.ArgumentError(f"{where}: expected one axis of the mesh {self._mesh.shape} that is not a batch "
                                  f"axis (batch axes: {self._config.batch_axes}). Fix: Mesh({{'stage': p, ...}}) and "
                                  "axis='stage'.")
    _pipeline.check_microbatches(microbatches, "repl.pipeline_stages", where, "each device's rows")
    if schedule not in ("1f1b", "gpipe"):
      raise _errors.ArgumentError(f"repl.pipeline_stages(schedule={schedule!r}): expected '1f1b' or 'gpipe' (the "
                                  "interleaved schedule is repl.pipeline's, in the local view).")
    stages = list(stages)
    count = self._mesh.shape[axis]
    if len(stages) != count:
      raise _errors.ArgumentError(f"{where}: {len(stages)} stages for the {count} devices along {axis!r}; "
                                  "expected one a device. Fix: replicator.split_stages(model, "
                                  f"{count}, input_shape=...).")
    stage_of = {}
    for s, stage in enumerate(stages):
      layers = stage if isinstance(stage, (list, tuple)) else [stage]
      found = [v for layer in layers for v in (
          [layer] if _variables.underlying(layer) is not None or isinstance(layer, tf.Variable)
          else getattr(layer, "weights", ()))]
      if not found:
        raise _errors.ArgumentError(f"{where}: stage {s} ({stages[s]!r}) has no variables; expected Keras layers "
                                    "or models, built. Fix: build them (call them once, or model.build(shape)) in "
                                    "repl.context(), or join a layer without weights to a stage with them.")
      for variable in found:
        replicated = _variables.underlying(variable)
        if replicated is None:
          raise _errors.ArgumentError(f"{where}: stage {s}'s variable {getattr(variable, 'path', variable.name)!r} "
                                      "was not made in this Replicator's context. Fix: make the model inside "
                                      "`with repl.context():`.")
        if stage_of.get(id(replicated), s) != s:
          raise _errors.ArgumentError(f"{where}: the variable {replicated.name.split(':')[0]!r} is in stages "
                                      f"{stage_of[id(replicated)]} and {s}. Fix: give each layer to one stage (a "
                                      "weight two stages share stays where its layer is).")
        stage_of[id(replicated)] = s
    self._views["global"].set_stages(_global_step.Stages(axis, microbatches, stage_of, schedule))

  def _pipeline_placement(self, stages, axis, variables):
    """``(axes, variables, own, place)`` of a pipeline over ``axis``: see :meth:`pipeline`."""
    axes = self._axes(axis)
    variables = _pipeline.pipeline_variables(stages) if variables is None else list(variables)
    own = {k for k, v in enumerate(variables) if _split_over(_variables.layout_of(v), axes)}
    place = None if self._config.multi_client else functools.partial(
        _placed_on_stages, variables, own, axes, self._mesh.axis_size(axes))
    return axes, variables, own, place

  def sequence_parallel(self, axis="seq", *, order: str = "contiguous"):
    """A context for a local-view step: KerasHub's Llama run on this replica's tokens as on the whole sequence.

    Each replica holds its tokens of every sequence along ``axis`` (``replicator.shard_sequence(x, i, P,
    order=order)``, ``i`` the replica's ``repl.axis_index(axis)``). Inside, while the step is traced, the rotary
    embeddings take the tokens' global positions and Llama's attention is ``repl.ring_attention`` over ``axis``
    (causal by global positions, the padding mask's keys with it), so each replica computes its tokens' rows of
    the whole sequence's model; its gradients, summed over ``axis``, are the whole sequence's (a mean of the
    replicas' losses: their mean). Other layers are per token. See
    ``replicator/integrations/_keras_hub_sequence.py``.

    Examples:
      >>> import keras_hub  # doctest: +SKIP
      >>> def step_fn(batch):  # doctest: +SKIP
      ...   index = int(tf.get_static_value(repl.axis_index("seq")))
      ...   mine = {k: replicator.shard_sequence(v, index, 2) for k, v in batch.items()}
      ...   with tf.GradientTape() as tape, repl.sequence_parallel("seq"):
      ...     hidden = backbone({"token_ids": mine["token_ids"], "padding_mask": mine["padding_mask"]})
      ...     ...

    Args:
      axis: the mesh axis (or tuple of axes) the sequence is split over.
      order: ``"contiguous"`` or ``"zigzag"`` (balanced causal attention): which tokens each replica holds, as
        ``replicator.shard_sequence`` took them.
    """
    _primitives.require_context(self, "sequence_parallel")
    return _keras_hub_sequence.split(self, self._axes(axis), order, _primitives.user_location())

  def spatial_parallel(self, *axes):
    """A context for a local-view step: Keras's convolution layers run on this replica's tile of each image.

    ``axes[i]``: the mesh axis (or tuple of axes) splitting spatial dimension ``i + 1`` of channels-last images
    (``repl.spatial_parallel("rows", "cols")``: height and width), or None for a dimension kept whole; each
    replica holds its tile (the ``repl.axis_index`` of each axis picks it). Inside, while the step is traced,
    ``Conv1D``/``Conv2D``/``Conv3D`` extend each tile by the rows their windows need of the neighbours'
    (``halo_exchange``, zeros at the image's edges: ``"same"``'s padding; any kernel, stride and dilation whose
    stride divides the tile), pooling runs on the tile where its windows stay in it, global pooling combines
    the tiles', and BatchNormalization's statistics span every tile and the batch axes: each replica computes its
    tile of the whole images' model. Its gradients averaged over the axes (``wrap_optimizer``), with a loss that
    is a mean over each tile's pixels, are one device's. Layers that would compute across tiles otherwise
    (transposed, separable or depthwise convolutions, bilinear upsampling, padding, cropping, ``Flatten``) are an
    ``UnsupportedError``. See ``replicator/integrations/_keras_spatial.py``.

    Args:
      *axes: one per spatial dimension, in order (height, width, depth), a mesh axis, a tuple of axes, or None.
    """
    _primitives.require_context(self, "spatial_parallel")
    return _keras_spatial.split(self, [None if a is None else self._axes(a) for a in axes],
                                _primitives.user_location())

  def input_pipeline(self, replica: int) -> int:
    """The input pipeline (batch shard) that feeds ``replica``."""
    return self._mesh.axis_index(replica, self.batch_axes) if self.batch_axes else 0

  @property
  def replica_id(self) -> int:
    """The replica being built (inside ``step_fn`` only), a Python int."""
    return _primitives.require_context(self, "replica_id").replica_id

  # -- variables ---------------------------------------------------------------

  @contextlib.contextmanager
  def context(self, layouts=None):
    """Replicates (or shards) every variable created inside (Keras, tf.Module, Sonnet, tf.Variable).

    Examples:
      >>> repl = Replicator(devices=["cpu:0", "cpu:1"])
      >>> with repl.context():
      ...   v = tf.Variable([1.0, 2.0])
      >>> len(v.components), v.components[1].device
      (2, '/job:localhost/replica:0/task:0/device:CPU:1')

    With ``layouts``, a variable whose path matches is sharded: its global
    initial value is computed once and each device keeps its piece.

    Examples:
      >>> import mesh
      >>> m = mesh.Mesh({"model": 2}, devices=["cpu:0", "cpu:1"])
      >>> repl = Replicator(mesh=m)
      >>> with repl.context(layouts=mesh.LayoutMap({"w": (None, "model")})):
      ...   w = tf.Variable(tf.reshape(tf.range(8.0), [2, 4]), name="w")
      >>> [c.shape.as_list() for c in w.components], w.shape.as_list()
      ([[2, 2], [2, 2]], [2, 4])

    Args:
      layouts: a :class:`mesh.LayoutMap` (or a dict of path pattern to layout
        spec). It stays in effect after the block for variables that steps
        create later (Keras layers built on first call, optimizer slots);
        optimizer slots made through ``wrap_optimizer`` take the layout of the
        variable they belong to.
    """
    if layouts is not None:
      self._layouts.use(_as_layout_map(layouts))  # new keys: checked afresh
    # Keras models made here record the strategy, and their fit/evaluate/predict run on the replicas.
    with self.keras_strategy.scope(), tf.variable_creator_scope(self._creator):
      yield self

  @property
  def keras_strategy(self) -> tf.distribute.Strategy:
    """The ``tf.distribute.Strategy`` that :meth:`context` presents to Keras's trainer.

    A Keras model created in ``repl.context()`` records it, and its
    ``fit``, ``evaluate`` and ``predict`` run every step on the replicas (see
    the README's "Keras fit" section). Its ``run`` serves Keras's trainer
    only; custom loops call :meth:`run`.
    """
    if self._keras_strategy is None:
      self._keras_strategy = _keras.KerasStrategy(self._config, self._creator, self._views["global"], self)
    return self._keras_strategy

  @property
  def input_layouts(self):
    """``Replicator(input_layouts=)``: how the global view splits the step's inputs beyond the batch (None: not)."""
    return self._config.input_layouts

  @property
  def context_parallel(self) -> str:
    """``Replicator(context_parallel=)``: how the global view's attention exchanges a split sequence."""
    return self._config.context_parallel

  @property
  def view(self) -> str:
    """``Replicator(view=)``: ``"local"`` (a step sees each device's piece) or ``"global"``."""
    return self._config.view

  @property
  def strict(self) -> bool:
    """Whether this Replicator refuses what it would otherwise warn of (``Replicator(strict=)``)."""
    return self._config.strict

  @property
  def layouts(self) -> mesh_lib.LayoutMap | None:
    """The layout map in use: the one given, or with ``layouts="auto"`` the one chosen (None before the first step).

    A chosen map names each variable it splits by its exact path; print it,
    or pass it to another Replicator as a hand-written map.
    """
    return self._layouts.map

  def layout_spec(self, path: str):
    """The layout spec the LayoutMap gives the variable at ``path`` (None: replicated)."""
    return self._layouts.spec(path)  # (remembers the key that matched, for explain)

  # -- running -------------------------------------------------------------------

  def run(self, step_fn: Callable, input_fn: Callable | None = None, *, inputs: Any = None,
          steps: int = 1, all_steps: bool = False, view: str | None = None):
    """Runs one step of ``step_fn`` on every replica.

    Args:
      step_fn: the per-replica step. Called with the replica's input element
        (from ``input_fn``'s dataset or ``inputs``), or with no argument.
      input_fn: ``input_fn(ctx: InputContext) -> tf.data.Dataset``, called once
        per replica per epoch; its iterators are reused on later calls until the
        input ends. Or a dataset of global batches (a ``tf.data.Dataset`` or
        ``repl.distribute_dataset(...)``), split across the replicas each step.
      inputs: explicit inputs: a ``PerReplica`` with one nest of tensors per
        replica (or a nest with ``PerReplica`` leaves), or any other nest of
        tensors, given to every replica.
      steps: run this many steps in one graph call (an in-graph loop), paying
        the per-call overhead once. With an ``input_fn`` each step takes the
        next elements; the loop stops early when the input ends.
      all_steps: return every step's results stacked along a new leading
        dimension (one entry per step run), instead of the last step's.

    A call is all or nothing: if it fails at run time, no variable is written
    on any device (``Replicator(atomic=True)``, the default). Calls from
    several threads run one at a time.

    Called while a ``tf.function`` is traced (as ``strategy.run`` is), the
    step is built once and called from that function's graph, on ``inputs=``
    (``next(iterator)`` of ``repl.distribute_dataset(...)``); it returns that
    graph's values. There a failure reaches the function's caller, where
    what the step wrote stays written until the step's next call writes the
    values from before it back; a dataset source and ``steps=k`` are refused.

    Raises:
      EndOfInput: the input ended before any step ran (a ``StopIteration``).
      StepFailedError: an op of the step failed at run time (also of the
        TensorFlow error's class); no variable was written.

    Returns:
      The nest ``step_fn`` returns, with a ``PerReplica`` (one value per
      replica) at each tensor leaf, as ``tf.distribute`` does: a step returning
      ``loss, accuracy`` can be unpacked as ``loss, accuracy = repl.run(...)``.
    """
    if not tf.executing_eagerly() and self._check_not_in_step("run"):  # in a tf.function being traced
      with self._running:
        chosen = self._views[self._config.view if view is None else _check_view(view)]
        _in_function.check_call(input_fn, steps, all_steps)
        return chosen.run_in_function(step_fn, inputs)
    with self._running, _gc.paused():  # a first call builds the step: collections would scan every object
      self._layouts.raise_refused()
      _restore.release()  # a restore before this step is over: the values it kept to undo itself go
      if not isinstance(all_steps, bool):
        raise _errors.ArgumentTypeError(
            f"repl.run(all_steps={all_steps!r}): expected True (every step's results, stacked) or False (the "
            f"last step's), a bool. Fix: all_steps=True.")
      chosen = self._views[self._config.view if view is None else _check_view(view)]
      return chosen.run(step_fn, input_fn, inputs, steps, all_steps)

  def _check_not_in_step(self, name: str) -> bool:
    """Refuses ``run``/``explain`` inside a step being built; whether a tf.function is being traced."""
    ctx = _context.current_context()
    if ctx is not None:
      raise _errors.ReplicaContextError(NESTED_RUN.format(name=name, replica=ctx.replica_id))
    return tf.inside_function()

  def _check_called_from_python(self, name: str) -> None:
    """``explain`` builds the step without running it: from Python, not inside a step or a tf.function."""
    if tf.executing_eagerly():  # the usual case, checked first: cheap
      return
    if self._check_not_in_step(name):
      raise _errors.ReplicaContextError(RUN_IN_FUNCTION.format(
          name=name, graph=getattr(tf.compat.v1.get_default_graph(), "name", "?")))

  def distribute_dataset(self, dataset: tf.data.Dataset, prefetch: int = 2) -> _distributed_dataset.DistributedDataset:
    """Splits every global batch of ``dataset`` across the replicas.

    Pass the result as ``repl.run(step_fn, distributed)`` (split in the step's
    graph, no extra host round trip), or iterate it for ``inputs=``. A partial
    last batch is split as evenly as possible; replicas without rows run the
    step on an empty batch. Average a loss over the true global batch with
    ``tf.reduce_sum(per_example) / repl.all_sum(tf.shape(x)[0])`` and
    ``wrap_optimizer(..., reduction="sum")``.

    Examples:
      >>> repl = Replicator(devices=["cpu:0", "cpu:1"])
      >>> ds = tf.data.Dataset.range(5).batch(5)
      >>> [b.numpy().tolist() for b in next(iter(repl.distribute_dataset(ds)))]
      [[0, 1, 2], [3, 4]]
    """
    pipelines = [self.input_pipeline(r) for r in range(self.num_replicas)]  # every replica's
    mine = [pipelines[r] for r in self._config.local_replicas]  # (a multi-client job's process: its own)
    shard = None
    if (self._config.multi_client and isinstance(dataset, tf.data.Dataset)
        and _process_shards.policy(dataset) in _process_shards.SHARDED):  # each process reads its own shard
      shard = _process_shards.shard_of(_process_shards.by_process(self.devices, pipelines), mine,
                                       _process_shards.POLICY(_process_shards.policy(dataset)).name)
    return _distributed_dataset.DistributedDataset(dataset, mine, self._config.host, prefetch, max(pipelines) + 1,
                                                   shard=shard, agree=self._config.agree)

  def explain(self, step_fn: Callable, input_fn: Callable | None = None, *,
              inputs: Any = None) -> rewrite.Plan | rewrite.PartitionReport:
    """Returns the rewrite plan of ``step_fn``: every collective, its size and implementation.

    Builds (and caches) the step like :meth:`run` but does not run it. ``print``
    the result for a table.

    In the global view (``input_fn``: the dataset of global batches) it returns
    a :class:`rewrite.PartitionReport`: the layout and bytes per device of every
    variable and input, every collective with the op and source line that
    required it, every relayout and every fallback. Its ``collectives``,
    ``bytes_per_step`` and ``devices`` are the plan's (``.plan``).
    """
    self._check_called_from_python("explain")
    _refuse_local_keras_step(step_fn, "explain")
    return self._views[self._config.view].explain(step_fn, input_fn, inputs)  # what the next run would call

  def memory(self, step_fn: Callable, input_fn: Callable | None = None, *, inputs: Any = None):
    """What each device holds in memory during a step of ``step_fn``: variables, saved activations, the peak.

    Builds (and caches) the step like :meth:`explain`, without running it,
    and reads its graph: the local view's per-replica graph, the global
    view's partition. Returns a :class:`rewrite.MemoryReport` (``print`` it
    for tables); per device (``report.devices``):

    * ``variable_bytes``: the variables and optimizer slots it holds;
    * ``saved_bytes``: the tensors the forward pass keeps for the backward pass
      (``report.saved``: each with its shape, dtype, layout in the global
      view, bytes on the device and the line of ``step_fn`` that made it);
    * ``peak_bytes``: the variables plus the most bytes of the step's tensors
      live at once, the ops run one at a time as their inputs become ready
      (``peak_op`` and ``live_at_peak``: what runs and what is held then).

    ``repl.explain(...)`` carries the same report as ``.memory`` and prints it
    after its own tables. For the step of a Keras model's ``fit``, pass
    ``model.train_step`` and the dataset of global batches given to ``fit``
    (batched with ``drop_remainder=True``): Keras's steps run as in the global
    view, in either view, and are reported so. The figures are of the graph
    as built, before TensorFlow's optimizations (its fusions may keep fewer
    intermediate tensors) and on one thread (its executor runs some ops at
    once); measured against TensorFlow's allocator they were within 10%.
    """
    self._check_called_from_python("memory")
    _refuse_local_keras_step(step_fn, "memory")
    view = self._config.view
    owner = getattr(step_fn, "__self__", None)
    if getattr(step_fn, "__name__", "") in _keras.KERAS_STEPS and hasattr(owner, "make_train_function"):
      view = "global"  # a Keras model's step: fit and evaluate run it as the global view does, in either view
    return self._views[view].memory(step_fn, input_fn, inputs)

  # -- optimizers ------------------------------------------------------------------

  def wrap_optimizer(self, optimizer, reduction: str = "mean", accumulation_steps: int = 1,
                     bucket_bytes: int | None = _optimizer.DEFAULT_BUCKET_BYTES,
                     update: str = "auto", densify_above: float | None = None) -> _optimizer.ReplicatedOptimizer:
    """Wraps a Keras 3 or Sonnet 2 optimizer so updates use gradients reduced over replicas.

    Args:
      optimizer: the optimizer (create it inside :meth:`context`).
      reduction: ``"mean"`` (default: each replica's loss is a per-replica
        mean) or ``"sum"`` (the loss is already divided by the global batch).
      accumulation_steps: accumulate gradients locally for this many steps,
        then reduce them across replicas once and apply their mean: equal to
        one step on a ``accumulation_steps`` times larger batch. The step is
        traced twice (an accumulate-only variant without communication, and
        the applying one); run one step per call. The accumulator of a
        variable ``repl.pipeline`` placed on its stages' devices lives on
        those devices only, and moves with it.
      bucket_bytes: fuse gradients of one dtype into buckets of at most this
        many bytes, one all-reduce per bucket; a larger gradient keeps its
        own (default 1 MB: fuses biases and small kernels; None or 0: one
        all-reduce per gradient). Under the sharded update a bucket holds
        one owner's gradients and is reduced on the owner.
      update: ``"sharded"``: each variable is updated by one owner device and
        broadcast to the others, so the optimizer's work is done once, not
        once per replica (Keras 3 optimizers without ``global_clipnorm``,
        ``use_ema`` or ``gradient_accumulation_steps``); ``"replicated"``:
        every replica applies every update; ``"auto"`` (default): sharded
        when every device is a CPU of one process and the optimizer allows
        it, else replicated. A variable ``repl.pipeline`` placed on its
        stages' devices is owned by one of them along the other axes (its
        stage's batch replicas), its new value broadcast among those.
      densify_above: a sparse gradient (``tf.IndexedSlices``) is reduced as
        rows: every replica's rows and indices are gathered, which gives
        every optimizer one device's result. With a fraction here, a sparse
        gradient whose gathered rows (this replica's times the group size)
        reach that fraction of the variable's rows is made dense and
        all-reduced instead: cheaper for very dense slices, but exact only
        for optimizers linear in the gradient (SGD, momentum; not Adam,
        whose second moment sums a repeated row's squares). None (default):
        always rows.
    """
    wrapped = _optimizer.ReplicatedOptimizer(self, optimizer, reduction, accumulation_steps, bucket_bytes,
                                             update, densify_above)
    if accumulation_steps > 1:
      self._state.accumulating.add(wrapped)
    return wrapped

  # -- results (outside step_fn) --------------------------------------------------------

  def reduce(self, op: str, per_replica, axis: int | None = None):
    """Combines ``PerReplica`` values into ordinary tensors.

    Args:
      op: "sum", "mean", "max" or "min" (or ``tf.distribute.ReduceOp.SUM``,
        ``MEAN``, as ``strategy.reduce`` takes).
      per_replica: a ``PerReplica``, or a nest of them (what :meth:`run` returns).
      axis: None reduces across replicas only (elementwise); an int also
        reduces along that dimension of the values concatenated across
        replicas (e.g. the mean over a global batch of per-example losses).
    """
    if isinstance(op, tf.distribute.ReduceOp):  # code written for strategy.reduce
      op = op.value.lower()
    if op not in _primitives.REDUCE_OPS:
      raise _errors.ArgumentError(f"repl.reduce(op={op!r}): op must be one of {_primitives.REDUCE_OPS} "
                                  f"(or tf.distribute.ReduceOp.SUM / MEAN).")
    check_axis("reduce", axis, per_replica)
    reducer = REDUCERS[op]

    def one(leaves):
      with tf.device(self._config.host):
        tensors = [tf.convert_to_tensor(t) for t in leaves]
        if axis is None:
          return reducer(tf.stack(tensors), axis=0)
        return reducer(tf.concat(tensors, axis=axis), axis=axis)

    return self._map_per_replica(one, per_replica, "reduce")

  def gather(self, per_replica, axis: int = 0):
    """Concatenates ``PerReplica`` values (or a nest of them) along ``axis``."""
    check_axis("gather", axis, per_replica)

    def one(leaves):
      with tf.device(self._config.host):
        tensors = [tf.convert_to_tensor(t) for t in leaves]
        if all(t.shape.rank == 0 for t in tensors):  # scalars (a loss per replica): one value each
          return tf.stack(tensors)
        return tf.concat(tensors, axis=axis)

    return self._map_per_replica(one, per_replica, "gather")

  def _map_per_replica(self, fn, per_replica, name):
    def leaf(value):
      if value is None:
        return None
      if self._config.view == "global" and isinstance(value, tf.Tensor):
        return value  # a global-view output: already the global value
      if not isinstance(value, PerReplica):
        raise _errors.ArgumentTypeError(f"repl.{name}() takes the PerReplica values returned by repl.run (or a nest of "
                        f"them), found {type(value).__name__}.")
      if len(value) != len(self._config.local_replicas):
        raise _errors.ArgumentError(f"repl.{name}() got a PerReplica of {len(value)} values, but this "
                         f"Replicator has {len(self._config.local_replicas)} replicas.")
      return fn(value.values)

    return tree.map_structure(leaf, per_replica)

  def __repr__(self):
    return f"Replicator(num_replicas={self.num_replicas}, mesh={self._mesh!r})"


LOCAL_KERAS_STEP = (
    "repl.{name}({model}.{step}): the Keras steps of a {kind} run as local-view steps its own code builds "
    "(a pipeline over its stages), not as the step Keras's {step} traces. Fix: write the step with repl.pipeline "
    "(see docs/concepts/stages.md) and pass that to repl.{name}.")


def _refuse_local_keras_step(step_fn, name: str) -> None:
  """Refuses ``explain``/``memory`` of a Keras step of a model whose steps are local-view ones (PipelineModel)."""
  owner = getattr(step_fn, "__self__", None)
  if getattr(owner, "replicator_local_step", None) is not None:
    raise _errors.UnsupportedError(LOCAL_KERAS_STEP.format(name=name, model=getattr(owner, "name", "model"),
                                                           step=getattr(step_fn, "__name__", "step"),
                                                           kind=type(owner).__name__))


def _machine(devices):
  """The machine's rates on ``devices`` for the layout search (``replicator.calibrate``'s, cached)."""
  return _calibration.measure(devices, True, Replicator)
