"""The global view: ``step_fn`` written for one device, partitioned over the mesh by layouts alone.

1. trace ``step_fn`` once at static GLOBAL shapes (a global batch), every
   replicated variable presenting a global-shaped stand-in (``_global_handles``);
2. propagate layouts over the traced graph (``rewrite._partition``): the
   arguments are split over the batch axes along their first dimension, the
   variables' handles take their variables' layouts;
3. expand it into one subgraph per device at local shapes, with collective
   placeholders where a layout needs communication (``rewrite._expansion``);
   in a multi-client job, for this process's devices only;
4. plan the placeholders (``rewrite.plan``), fuse independent all-reduces
   across processes (``rewrite.fuse``), lower them (``rewrite.apply``) and
   import the result into one function, as for the local view;
5. report what the partition does (``rewrite.PartitionReport``, what
   ``repl.explain`` returns), the variables and inputs named.
"""

from __future__ import annotations

import dataclasses
import random
import re
import warnings
from typing import Any
from typing import Callable

import tensorflow as tf
import tree

import mesh as mesh_lib
import rewrite
from replicator.core import _callables
from replicator.core import _context
from replicator.core import _errors
from replicator.core import _primitives
from replicator.core import _tf_distribute
from replicator.guarantees import _atomic
from replicator.guarantees import _failures
from replicator.guarantees import _ordered_writes
from replicator.state import _access
from replicator.state import _consistency
from replicator.state import _lifting
from replicator.state import _optimizer
from replicator.state import _variables
from replicator.views import _auto_layouts
from replicator.views import _captures
from replicator.views import _local_step
from rewrite import _deferred
from rewrite import _expansion
from rewrite import _partition
from rewrite import _partition_owners
from rewrite import _partition_report
from rewrite import _partition_stages
from rewrite import _pipeline_order
from rewrite import _propagation
from rewrite import _recompute
from rewrite import _regather

NOT_DATASET = (
    "repl.run(step_fn, {what}) in the global view takes a tf.data.Dataset of global batches (each "
    "element is one global batch, split over the batch axes {axes} by the partitioner). Fix: pass "
    "the dataset itself: repl.run(step_fn, dataset)."
)

INDIVISIBLE = (
    "The global batch's dimension 0 ({inputs}) is not divided by the batch axes {axes} (of size {n}): this "
    "step takes those inputs whole on every device, and computes what depends on them on each (the result is "
    "the same; the work is not shared). A partial last batch does this once per epoch. Fix, if every batch "
    "warns: batch the dataset by a multiple of {n}."
)

FALLBACK = (
    "The global view has no layout rule for {type} ({name}, at {location}) and one of its inputs is "
    "split ({layouts}): its inputs are gathered and it runs on whole values on every device, as do "
    "the ops after it that only see its output. The result is right; the step communicates and "
    "computes more than it needs to."
)
FALLBACK_WHY = (
    "The global view cannot partition {type} ({name}, at {location}), one of whose inputs is split ({layouts}): "
    "{why}. Its inputs are gathered and it runs on whole values on every device, as do the ops after it that only "
    "see its output. The result is right; the step communicates and computes more than it needs to."
)

STRICT_FALLBACK = (
    "Replicator(strict=True): the global view has no layout rule for {count} op(s) whose inputs are "
    "split; each would gather its inputs and run on whole values on every device:\n{ops}\n"
    "Fix: add a layout rule for the op type (rewrite/rules/_*.py), keep the op's inputs replicated (leave "
    "the variables they come from out of the layouts), or pass Replicator(strict=False) to run it on "
    "gathered inputs, with a warning."
)

UNSUPPORTED = (
    "The global view cannot partition {type} ({name}, at {location}): {why}. Fix: {fix}."
)
FIX_UNSUPPORTED = "keep the variables this op uses replicated (leave them out of the layouts) until the op has a rule"
FIX_CONTROL_FLOW = (
    "a tf.cond or tf.while_loop runs partitioned with the collectives its body needs inside it: move the op named "
    "above out of it (e.g. compute both branches' values and choose with tf.where), or keep the variables it uses "
    "replicated (leave them out of the layouts)"
)
_CONTROL_FLOW = ("If", "StatelessIf", "While", "StatelessWhile")

CHANGES_SHAPE = (
    "step_fn assigns a value of shape {value} to the variable {name!r} of global shape {shape}: in the global "
    "view every variable keeps its global shape (a sharded one is split by it). Fix: assign a value of shape "
    "{shape}, or make a new variable outside the step."
)

CREATES_VARIABLES = (
    "step_fn created the variable {name!r} during the global view's trace from an initial value computed "
    "from the step's data (its inputs, or what a collective returns). The global view makes variables "
    "created in the step once, eagerly, before the step runs: from a constant, a callable, or a value "
    "computed in the step from nothing but shapes, random draws and variables (a Sonnet module built by "
    "its first call). Fix: make the variable before the step, inside `with repl.context():` (so that its "
    "layouts apply), e.g. by calling the module once on a batch of the right shape there."
)


@dataclasses.dataclass
class GlobalStep:
  """A traced, partitioned and rewritten global-view step."""

  partition: _propagation.Partition
  plan: rewrite.Plan
  graph_def: Any
  input_names: list
  captures: _captures.Captures
  output_names: list
  structure: Any
  functions: dict = dataclasses.field(default_factory=dict)  # (atomic, in another graph) -> concrete fn
  ownership: _partition_owners.Ownership | None = None  # the sharded update's owners
  report: rewrite.PartitionReport | None = None  # what repl.explain returns
  accumulating: tuple = ()  # wrapped optimizers accumulating gradients in the step (their phase is traced)

  loops: dict = dataclasses.field(default_factory=dict)  # steps k -> tf.function of k steps over an iterator
  snapshot: _atomic.AllOrNothing | None = None  # all-or-nothing calls: what they keep of the written components
  locate: Any = None  # failing node name -> (traced op, user location) (_failures.locator)
  workers: tuple = ()  # the cluster's worker addresses by task (Config.workers): a failure names a device's worker
  written: _consistency.Written | None = None  # replicated components the step writes (atomic=False: checked)

  def _import(self, args, captured: dict) -> list:
    input_map = dict(zip(self.input_names, args))
    input_map.update(_captures.into_current_graph(captured))
    outputs = tf.graph_util.import_graph_def(self.graph_def, input_map=input_map, return_elements=self.output_names,
                                             name="step")
    for t, traced in zip(outputs, tree.flatten(self.structure)):
      t.set_shape(traced.shape)  # as traced: the rewritten graph's outputs may have lost it
    return outputs


  def concrete(self, specs, atomic: bool = True, in_graph: bool = False):
    """The step as one function of the flattened global batch (imported on first use).

    ``atomic=False``: without keeping the written values (``Replicator(atomic=False)``).
    ``in_graph``: to be called in another function's graph (Keras's, the user's).
    """
    key = (atomic, in_graph)
    if key not in self.functions:

      snapshot = self.snapshot.for_call(True) if atomic and self.snapshot is not None else None

      def call(*args):
        outputs = self._import(args, _atomic.input_map(snapshot, self.captures, in_graph))
        if snapshot is not None:
          snapshot.release(_atomic.function_ops(outputs))
        return outputs

      self.functions[key] = tf.function(call, autograph=False).get_concrete_function(*specs)
    return self.functions[key]

  def _run(self, function, args):
    """``function(*args)``; a failure restores what the call wrote (atomic) and says one line."""
    try:
      return function(*args)
    except tf.errors.OpError as e:
      error = _failures.after_failure(e, self.snapshot, self.written, self.locate, tuple(self.plan.devices),
                                      self.workers)
      if error is e:  # the end of the input: the caller's
        raise
      raise error from e

  def __call__(self, flat_args):
    flat_args = [a for a in flat_args if a is not None]  # absent parts of the batch are not inputs
    specs = [tf.TensorSpec(a.shape, a.dtype) for a in flat_args]
    if not tf.executing_eagerly():  # called in another function's graph (Keras's): its caller sees a failure
      # Atomic still: the values kept are written back by whoever catches the failure (Keras's functions,
      # _keras.restoring), or at the start of this step's next call (_atomic.Snapshot._keep).
      function = self.concrete(specs, atomic=self.snapshot is not None, in_graph=True)
      return tree.unflatten_as(self.structure, list(function(*flat_args)))
    flat = self._run(self.concrete(specs), flat_args)
    return tree.unflatten_as(self.structure, list(flat))

  def run_steps(self, iterator, element, steps: int, all_steps: bool = False, stop=None, job_flag=None):
    """Up to ``steps`` steps in one graph call, on ``element`` then the next batches of ``iterator``.

    Returns the last step's results (``all_steps``: every step's, stacked
    along a new leading dimension) and the number of steps run (fewer at the
    end of the dataset). The call is all or nothing: if a step fails, none of
    its steps' writes stay (``atomic``). ``stop``: a ``_interrupt.StopFlag``
    read before each step after the first. ``element`` None: every step's
    batch from ``iterator`` (zero steps at its end); ``job_flag(has_value)``:
    whether every process has a next batch (a multi-client job's shards).
    """
    first_given = element is not None
    loop = self.loops.get((steps, all_steps, first_given, job_flag is not None))
    if loop is None:
      arrays_kept = all_steps or not first_given  # the loop carries TensorArrays (else the last outputs)

      def keep(kept, i, outputs):
        """What the loop carries of a step's ``outputs``: the outputs, or ``kept`` arrays with them written at ``i``."""
        return [a.write(i, o) for a, o in zip(kept, outputs)] if arrays_kept else list(outputs)

      snapshot = self.snapshot.for_call(False) if self.snapshot is not None else None

      def run(first, it):
        captured = _atomic.input_map(snapshot, self.captures)

        def cond(i, more, *_):
          going = tf.logical_and(i < steps, more)
          return going if stop is None else tf.logical_and(going, stop.keep_going())

        def body(i, more, *kept):
          del more
          optional = it.get_next_as_optional()
          has_value = optional.has_value() if job_flag is None else job_flag(optional.has_value())

          def step():
            return [tf.constant(True)] + keep(kept, i, self._import(tree.flatten(optional.get_value()), captured))

          def stop():
            return [tf.constant(False)] + list(kept)

          more, *kept = tf.cond(has_value, step, stop)
          return [i + tf.cast(more, tf.int32), more] + kept

        traced = tree.flatten(self.structure)
        arrays = [tf.TensorArray(o.dtype, size=0, dynamic_size=True, element_shape=o.shape) for o in traced]
        if first_given:
          outputs = list(self._import(first, captured))
          count, more, *kept = tf.while_loop(cond, body, [tf.constant(1), tf.constant(True)] + keep(arrays, 0, outputs))
        else:
          count, more, *kept = tf.while_loop(cond, body, [tf.constant(0), tf.constant(True)] + arrays)
        if all_steps:
          kept = [a.stack() for a in kept]
        elif not first_given:  # the last step's outputs (none at the end of the input)
          kept = [tf.cond(count > 0, lambda a=a: a.read(count - 1), lambda o=o: tf.zeros([0], o.dtype))
                  for a, o in zip(kept, traced)]
        results = [count, more] + kept
        if snapshot is not None:
          snapshot.release(_atomic.function_ops(results))
        return results

      loop = self.loops[(steps, all_steps, first_given, job_flag is not None)] = tf.function(run, autograph=False)
    count, _, *flat = self._run(loop, (tree.flatten(element) if first_given else [], iterator))
    return tree.unflatten_as(self.structure, flat), int(count)


def _batch_layout(spec: tf.TensorSpec, axes: tuple[str, ...]) -> tuple:
  return (axes,) + ((),) * (spec.shape.rank - 1) if spec.shape.rank else ()


INPUT_LAYOUTS_MULTI_CLIENT = (
    "Replicator(input_layouts=...) splits input {index} (shape {shape}) over {axes} beyond its batch, but this is "
    "one process of a multi-client job, whose inputs are read in process shards along the batch alone. Fix: split "
    "only the batch dimension of inputs in a multi-client job (its first entry, over batch axes), or run the job in "
    "one process.")


def input_layout(config, mesh, index: int, spec: tf.TensorSpec, batch: tuple[str, ...]) -> tuple:
  """The layout of the step's input ``index`` (``spec``): ``Replicator(input_layouts=)``'s, else split over ``batch``.

  ``batch``: the batch axes (empty where the batch is taken whole: of
  unknown or indivisible size; then a given layout's first dimension is whole
  too).
  """
  chosen = config.input_layouts
  rank = spec.shape.rank
  if callable(chosen):
    chosen = chosen(index, spec)
    if chosen is not None:
      layout = mesh_lib.Layout(chosen, mesh)
      chosen = tuple(layout.axes(d) for d in range(layout.rank))
  elif chosen is not None and len(chosen) != rank:
    chosen = None  # (a spec applies to the inputs of its rank)
  if chosen is None or not rank:
    return _batch_layout(spec, batch)
  layout = mesh_lib.Layout(tuple(a or None for a in chosen), mesh)
  shape = spec.shape.as_list()
  if not batch:  # the batch taken whole (its size unknown, or not divisible)
    layout = mesh_lib.Layout((None,) + tuple(layout.axes(d) or None for d in range(1, rank)), mesh)
  layout.check([n if d or batch else 1 for d, n in enumerate(shape)], what=f"input {index} of the step")
  split = tuple(_split_axes(mesh, layout.axes(d)) for d in range(rank))
  if config.multi_client and any(split[1:]):
    raise _errors.UnsupportedError(INPUT_LAYOUTS_MULTI_CLIENT.format(index=index, shape=spec.shape, axes=split))
  return split


def stated_layouts(trace, graph, mesh) -> dict:
  """Op name -> layout of each value the step lays out itself (``repl.with_layout``; a Keras output key).

  Checked against the mesh and the value's shape here (a mesh axis it does not have, a dimension the axes do not
  divide: ``mesh.LayoutError`` naming where it was stated).
  """
  pinned = {}
  for op, spec, location in trace.pinned:
    if op.graph is not graph:  # (a first trace, tracing again; or a function's body)
      continue
    try:
      layout = mesh_lib.Layout(tuple(a or None for a in spec), mesh)
      layout.check(op.outputs[0].shape.as_list(), what="the value")
    except mesh_lib.LayoutError as e:
      raise mesh_lib.LayoutError(f"The layout stated for the value laid out at {location} ({op.name}): {e}") from None
    pinned[op.name] = tuple(_split_axes(mesh, layout.axes(d)) for d in range(layout.rank))
  return pinned


@dataclasses.dataclass(frozen=True)
class Stages:
  """A global-view step's pipeline (``repl.pipeline_stages``): its variables' stages along ``axis``.

  Attributes:
    axis: the stage axis.
    microbatches: how many pieces each device's rows are split into (each a position of a mesh axis
      :data:`MICROBATCH_AXIS` whose positions are the same device).
    stage_of: ``id(variable)`` -> its stage, for the variables of the stages' layers.
    schedule: ``"gpipe"`` (by dataflow) or ``"1f1b"`` (control edges, ``rewrite._pipeline_order``).
  """

  axis: str
  microbatches: int
  stage_of: dict
  schedule: str = "1f1b"


MICROBATCH_AXIS = "_microbatch"

PIPELINE_ROWS = (
    "repl.pipeline_stages(microbatches={m}): the global batch's {rows} rows do not divide into {n} pieces ({m} "
    "microbatches on each of the {b} replica(s) of the batch axes {axes}). Fix: batch the dataset by a multiple "
    "of {n} (drop_remainder=True), or choose microbatches dividing the rows of each replica.")
PIPELINE_REFUSED = (
    "repl.pipeline_stages: the global view's pipeline cannot run {type} ({name}, at {location}) on one stage's "
    "devices: {why}. Fix: keep the variables it reads replicated (out of the layouts), or write the step with "
    "repl.pipeline in the local view.")
PIPELINE_UNSUPPORTED = (
    "repl.pipeline_stages: {what} is not supported with a global-view pipeline yet. Fix: {fix}")


def build(replicator, config, layouts, creator: Callable, owner_load: dict, step_fn: Callable,
          element_spec, stages: Stages | None = None) -> GlobalStep:
  """Traces ``step_fn`` once at the global shapes of ``element_spec`` and partitions it.

  ``layouts``: the Replicator's ``_layout_state.LayoutState`` (with ``layouts="auto"``, chosen here by the
  first build); ``creator``: its variable creator; ``owner_load``: the sharded update's bytes owned so far by
  each position of the batch axes (by axes), which the next build's owners balance. ``stages``: run as a
  pipeline (``repl.pipeline_stages``), else None.
  """
  mesh = replicator.mesh
  axes = tuple(a for a in replicator.batch_axes if mesh.shape[a] > 1)
  repeats = 1
  if stages is not None:  # each device's rows split into microbatches: positions of one more axis, on it
    _check_stages(config, layouts)
    repeats = stages.microbatches
    mesh = mesh.with_repeats(MICROBATCH_AXIS, repeats)
    axes = axes + (MICROBATCH_AXIS,)
  leaves = tree.flatten(element_spec)  # None: an absent part of the batch (Keras's sample weights)
  specs = [spec for spec in leaves if spec is not None]
  n = mesh.axis_size(axes) if axes else 1
  for i, spec in enumerate(specs):
    if not (spec.shape.rank is not None and spec.shape[1:].is_fully_defined()):
      raise _errors.ArgumentError(
          f"The global view traces at static global shapes (the batch dimension aside), but input {i} has shape "
          f"{spec.shape}. Fix: give every dimension after the first a static size.")
  # A batch of unknown size (a dataset batched without drop_remainder) is taken whole by every device.
  dynamic = [i for i, spec in enumerate(specs) if spec.shape.rank and spec.shape[0] is None]
  whole = dynamic + [i for i, spec in enumerate(specs) if spec.shape.rank and spec.shape[0] is not None
                     and spec.shape[0] % n]
  if stages is not None and whole:
    rows = specs[whole[0]].shape[0]
    raise _errors.ArgumentError(PIPELINE_ROWS.format(m=stages.microbatches, rows="unknown" if rows is None else rows,
                                                     n=n, b=n // stages.microbatches, axes=axes[:-1]))
  if len(whole) > len(dynamic):
    inputs = ", ".join(f"input {i}: {specs[i].shape[0]} rows" for i in whole if i not in dynamic)
    warnings.warn(INDIVISIBLE.format(inputs=inputs, axes=axes, n=n), stacklevel=_primitives.user_stacklevel())
  structure = {}
  trace = _context.GlobalTrace(replicator)

  replicated_creator = creator

  created = []  # (name, variable) of each variable the first trace made
  again = []  # while tracing again: how many of them were asked for so far

  def creator(next_creator, **kwargs):
    if again:  # tracing again: the first trace's variables, in order
      i = again[0]
      again[0] += 1
      if i < len(created) and created[i][0] == kwargs.get("name"):
        return created[i][1]
    # A variable made during the trace (a Keras optimizer's slots, built by its first apply_gradients; a
    # Keras layer built by its first call) is made once, eagerly, by the Replicator. A callable initial
    # value is called eagerly, as a tf.function lifts it out of its first trace on one device.
    initial_value = kwargs.get("initial_value")
    if callable(initial_value):
      with tf.init_scope(), _context.global_trace_scope(None):
        initial_value = initial_value()
    if tf.is_tensor(initial_value) and tf.is_symbolic_tensor(initial_value):
      # Computed in the step (a Sonnet module built by its first call): its ops are lifted out and run once,
      # eagerly, as tf.function does; a value that needs the step's data cannot be.
      value = tf.get_static_value(initial_value)
      if value is None:
        value = _lifting.lift(initial_value)
      if value is None:
        raise _errors.UnsupportedError(CREATES_VARIABLES.format(name=kwargs.get("name")))
      initial_value = value
    kwargs["initial_value"] = initial_value
    with tf.init_scope(), _context.global_trace_scope(None):
      variable = replicated_creator(next_creator, **kwargs)
    if not again:
      created.append((kwargs.get("name"), variable))
    return variable

  fn = _local_step.convert(step_fn, config.autograph)  # AutoGraph, as tf.function on one device

  def traced(*flat):
    given = iter(flat)
    with _tf_distribute.one_device_context():  # as on one device, also inside a strategy's scope
      result = fn(tree.unflatten_as(element_spec, [None if spec is None else next(given) for spec in leaves]))
    result = _local_step.step_outputs(result)
    structure["value"] = result
    return tree.flatten(result)

  with _context.global_trace_scope(trace), _context.trace_hooks(replicator), tf.variable_creator_scope(creator), \
      _callables.inline_functions():
    try:
      concrete = tf.function(traced, autograph=False).get_concrete_function(*specs)
      if created:
        # As a tf.function traces again after a first call that created variables: code that chose on
        # whether they existed yet (Keras's LossScaleOptimizer.scale_loss before its first apply: the
        # initial scale as a constant) now reads them. Variables made again are the first trace's.
        again.append(0)
        concrete = tf.function(traced, autograph=False).get_concrete_function(*specs)
    except ValueError as e:
      changed = re.search(r"Cannot assign value to variable ' ?([^']*?)(:0)?': Shape mismatch.*variable shape "
                          r"(\([^)]*\)), and the assigned value shape (\([^)]*\))", str(e), re.S)
      if changed is None:
        raise
      raise _errors.ArgumentError(CHANGES_SHAPE.format(name=changed.group(1), shape=changed.group(3),
                                                       value=changed.group(4))) from None
  graph = concrete.graph
  # A variable made outside the Replicator is one resource: every device's copy of a write would write it.
  written = _access.written_placeholders(graph)
  _local_step.check_writes(graph, written, replicated=lambda h: id(h) in trace.owners)
  # The devices this process expands (every one, unless multi-client; a pipeline's: each device's microbatches).
  local = frozenset(config.local_replicas) if stages is None else frozenset(range(mesh.size))
  given = {}
  for i, (placeholder, spec) in enumerate(zip(graph.inputs[:len(specs)], specs)):
    given[placeholder.name] = input_layout(config, mesh, i, spec, () if i in whole else axes)
  handles, handle_shapes, summed = {}, {}, set()
  for external, internal in graph.captures:
    variable = trace.owners.get(id(external))
    if variable is not None:
      given[internal.name] = tuple(_split_axes(mesh, variable.layout.axes(d)) for d in range(variable.shape.rank))
      handles[internal.name] = _handles(variable, mesh, local, repeats)
      handle_shapes[internal.name] = variable.shape.as_list()
      if _variables.summed_on_read(variable):  # a metric's state: the copies add up to its value
        summed.add(internal.name)
  data = frozenset(placeholder.name for placeholder in graph.inputs[:len(specs)])
  pinned = stated_layouts(trace, graph, mesh)  # (checked once: the layouts the step states)
  auto = layouts.auto
  if auto is not None and auto.result is None:  # layouts="auto": chosen now, from this step
    captured = {internal.name: trace.owners[id(external)] for external, internal in graph.captures
                if id(external) in trace.owners}
    _auto_layouts.choose(replicator, layouts, graph, mesh, given, handle_shapes, frozenset(summed), data,
                         tuple(axes), captured, pinned=pinned)
    for name, variable in captured.items():  # laid out anew: new layouts, new components
      given[name] = tuple(_split_axes(mesh, variable.layout.axes(d)) for d in range(variable.shape.rank))
      handles[name] = _handles(variable, mesh, local, repeats)
  # The seed of the step's unseeded random ops: one draw per build, and in a multi-client job worker 0's.
  salt = random.SystemRandom().randrange(1, 2**31)
  if config.agree is not None:
    with tf.init_scope():  # (built from Keras's function too)
      salt = int(config.agree(tf.constant(salt, tf.int64)))
  partition = _partition.propagate(graph, mesh, given, handle_shapes, frozenset(summed), data, tuple(axes),
                                   random_salt=salt, pinned=pinned)
  for name, why in partition.unsupported:
    op = graph.get_operation_by_name(name)
    fix = FIX_CONTROL_FLOW if op.type in _CONTROL_FLOW else FIX_UNSUPPORTED
    raise _errors.UnsupportedError(UNSUPPORTED.format(type=op.type, name=name, why=why, fix=fix,
                                                      location=_primitives.location_of(op)))
  _check_fallbacks(graph, partition, config.strict)
  variables = {internal.name: trace.owners[id(external)] for external, internal in graph.captures
               if id(external) in trace.owners}
  if stages is None:
    ownership = _ownership(replicator, config, owner_load, graph, partition, axes, variables, whole=bool(whole))
  else:
    ownership = _stage_ownership(graph, partition, stages, variables, mesh)
    for name, variable in variables.items():  # (placed: new components)
      handles[name] = _handles(variable, mesh, local, repeats)

  # The expansion is one GraphDef (rewrite._expansion.expand), with the step's inputs and the variables'
  # handles as placeholders of a plain graph: GlobalStep.concrete imports it once, into the step's function.
  expansion_graph, n = tf.Graph(), len(mesh.devices)
  fed = []  # (placeholder tensor name, eager value) of each value the step reads from outside
  with expansion_graph.as_default():

    def feed(value, name):
      fed.append((f"{name}:0", value))
      return _expansion.Feed(name, value.dtype, value.shape)

    inputs, local_inputs = [], {}
    for i, (placeholder, spec) in enumerate(zip(graph.inputs[:len(specs)], specs)):
      whole = tf.raw_ops.Placeholder(dtype=spec.dtype, shape=spec.shape, name=f"input_{i}")
      inputs.append(whole)
      pieces = []
      for r, device in enumerate(mesh.devices):
        if r not in local:
          pieces.append(None)  # another process's device
          continue
        with tf.device(device):
          pieces.append(_expansion.local_piece(whole, given[placeholder.name], mesh, r))
      local_inputs[placeholder.name] = pieces
    for k, (external, internal) in enumerate(graph.captures):
      if internal.name in handles:
        local_inputs[internal.name] = [None if h is None else feed(h, f"handle_{k}_{r}")
                                       for r, h in enumerate(handles[internal.name])]
      else:
        local_inputs[internal.name] = [feed(external, f"capture_{k}")] * n
    expansion = _expansion.expand(graph, mesh, partition, local_inputs, graph.outputs,
                                  locate=_primitives.location_of, ownership=ownership,
                                  only=None if len(local) == n else local, lowerings=config.lowerings)
  expanded, records = expansion.graph_def, expansion.records
  chosen = []
  if auto is not None and auto.result is not None and auto.result.remat:  # blocks the search rematerialized
    chosen = [b for b in _recompute.blocks(graph) if b.scope in auto.result.remat]
  # Activations gathered for the forward pass (attention's keys and values over a split sequence) are gathered
  # again for the backward pass, not held until it (rewrite._regather); those a chosen block recomputes aside.
  recomputed = {name for block in chosen for name in block.recomputed}
  chosen += [b for b in _regather.blocks(graph, partition) if recomputed.isdisjoint(b.recomputed)]
  if chosen:
    position = {op.name: i for i, op in enumerate(graph.get_operations())}
    rematerialized = _recompute.rematerialize(expanded, chosen, records=records, position=position)
    expanded, records = rematerialized.graph_def, rematerialized.records
  # A gather for the backward pass alone (an FSDP kernel's) runs as the backward pass nears it, not at the start;
  # a random draw of the forward pass as its layer runs (rewrite._deferred).
  deferred = _deferred.defer(expanded, records, draws=True)
  expanded = deferred.graph_def
  partition_plan = rewrite.plan(deferred.records, mesh, config.lowering_for)  # what repl.explain shows
  # Independent all-reduces across processes as one (each pays a round trip); what runs.
  fused_def, plan = rewrite.fuse(expanded, partition_plan, config.lowerings)
  rewritten = rewrite.apply(fused_def, plan, config.lowerings)
  # A captured value the expansion never reads has no node (a Feed is made where it is used): nothing to feed.
  present = {node.name for node in rewritten.graph_def.node}
  fed = [(name, value) for name, value in fed if name.split(":")[0] in present]
  report = _report(graph, partition, partition_plan, mesh, trace, element_spec, layouts.auto, ownership)
  report.runs_as = None if plan is partition_plan else plan
  written_handles = [(f"handle_{k}_{r}:0", h) for k, (external, internal) in enumerate(graph.captures)
                     if internal.name in handles and internal.op.name in written
                     for r, h in enumerate(handles[internal.name]) if h is not None]
  graph_def, snapshot = rewritten.graph_def, None
  if expansion.idle:  # (a pipeline's idle calls, lowered: unused)
    graph_def = rewrite.without_idle(graph_def, expansion.idle, keep={
        rewritten.output_name(name).split(":")[0] for per_device in expansion.outputs for name in per_device})
  if stages is not None and stages.schedule == "1f1b":  # each device's forward passes wait for backward ones
    try:
      graph_def = _pipeline_order.one_f_one_b(
          graph_def, mesh, stages.axis, MICROBATCH_AXIS,
          locate=lambda name: _primitives.location_of(graph.get_operation_by_name(name)))
    except rewrite.RewriteError as e:
      raise _errors.UnsupportedError(str(e)) from None
  traced = _traced_ops(graph, expansion_graph)
  if config.atomic:
    kept = _ordered_writes.order(graph_def, {name.split(":")[0] for name, _ in written_handles},
                                 _ordered_writes.classifier(plan, traced), _ordered_writes.placed(inputs))
    snapshot = _atomic.AllOrNothing(written_handles, kept)
  # After the ordering (which gives reads control inputs): reads of small values only (rewrite.merge_reads).
  merged = rewrite.merge_reads(graph_def, rewrite.small_reads(traced))
  captures = _captures.Captures(fed + list(rewritten.external_inputs.items()))
  return GlobalStep(
      partition=partition, plan=plan, report=report, graph_def=captures.with_read_shapes(graph_def),
      ownership=ownership, input_names=[t.name for t in inputs], captures=captures,
      output_names=[rewrite.renamed_tensor(rewritten.output_name(per_device[0]), merged)
                    for per_device in expansion.outputs],  # all whole
      structure=structure["value"], accumulating=tuple(trace.accumulating), snapshot=snapshot,
      written=_consistency.Written([h for _, h in written_handles]),
      locate=_failures.locator(graph, strip_replica=True, plan=plan), workers=config.workers)


def _handles(variable, mesh, local: frozenset, repeats: int = 1) -> list:
  """Each device's component handle of ``variable``; None for another process's device (a multi-client job), or
  one that does not hold it (placed on a pipeline's stage). ``repeats``: each device's positions in ``mesh`` (a
  pipeline's microbatches: ``Mesh.with_repeats``)."""
  return [_variables.component_for(variable, r // repeats).handle
          if r in local and _variables.holds(variable, r // repeats) else None for r in range(mesh.size)]


def _check_stages(config, layouts) -> None:
  """Refuses what a global-view pipeline does not run yet, by name."""
  if config.multi_client:
    raise _errors.UnsupportedError(PIPELINE_UNSUPPORTED.format(
        what="a multi-client job", fix="write the step with repl.pipeline in the local view (its stages on "
        "different workers are supported there)."))
  if config.implementation not in ("auto", "one_device"):
    raise _errors.UnsupportedError(PIPELINE_UNSUPPORTED.format(
        what=f"Replicator(implementation={config.implementation!r})", fix="leave implementation='auto' (a "
        "microbatch's collectives with the others of its device are local copies)."))
  if layouts.auto is not None:
    raise _errors.UnsupportedError(PIPELINE_UNSUPPORTED.format(
        what='layouts="auto"', fix="give the layouts (the search does not price a stage axis)."))


def _stage_ownership(graph, partition, stages: Stages, variables: dict, mesh) -> _partition_owners.Ownership:
  """The ops of each stage (``rewrite._partition_stages``); each variable one stage alone uses placed on its
  devices (an optimizer's slots with it), or, if it cannot move (split, or a metric's), read from them."""
  handle_stage = {}
  for name, v in variables.items():  # (an optimizer's slot, an accumulator: its variable's stage, moving with it)
    reference = _variables.slot_reference(v)
    given = v if id(v) in stages.stage_of else _variables.underlying(reference) if reference is not None else None
    if given is not None and id(given) in stages.stage_of:
      handle_stage[name] = stages.stage_of[id(given)]
  summed = frozenset(name for name, v in variables.items() if _variables.summed_on_read(v))
  found = _partition_stages.assign(graph, partition, stages.axis, handle_stage, MICROBATCH_AXIS, mesh, summed)
  for name, why in found.refused:
    op = graph.get_operation_by_name(name)
    raise _errors.UnsupportedError(PIPELINE_REFUSED.format(type=op.type, name=name, why=why,
                                                           location=_primitives.location_of(op)))
  for name, stage in found.variables.items():
    variable = variables.get(name)
    if variable is None:
      continue
    if not _variables.place(variable, (stages.axis,), [stage]) and _variables.placement_of(variable) is None \
        and not _variables.summed_on_read(variable):
      variable.set_owner(stage, (stages.axis,))
  return found.ownership


def _traced_ops(graph: tf.Graph, expansion_graph: tf.Graph):
  """Node name of the expansion -> the op with its static shapes: a copy's global op, or the op made for it."""
  made = {op.name: op for op in expansion_graph.get_operations()}
  ops = {op.name: op for op in graph.get_operations()}

  def traced(name: str):
    original = _expansion.global_name(name)
    return ops.get(original) if original is not None else made.get(name)

  return traced


UPDATES = ("auto", "sharded", "replicated")

STALE_OWNER = (
    "The variable {name!r} is kept current only on one device of each group along {axes} (a sharded optimizer "
    "update owns it), but this global-view step uses it on every device. Fix: run the step that updates it and "
    "this one with the same kind of update: Replicator(update=\"replicated\") for the global view, "
    "wrap_optimizer(update=\"replicated\") for the local view; or give every step batches of one kind (all of one "
    "static size, e.g. a dataset batched with drop_remainder=True, or all of unknown size): a batch of unknown size, "
    "taken whole by every device, after batches split over the batch axes can find some updates owned."
)


def sharded_update(config) -> bool:
  """Whether the global view gives each optimizer update one owner per batch group (``Replicator(update=)``)."""
  if config.multi_client:
    if config.update == "sharded":
      raise _errors.UnsupportedError(_optimizer.SHARDED_UPDATE_MULTI_CLIENT.format(where='Replicator(update="sharded")'))
    return False
  if config.update == "auto":
    # As wrap_optimizer's "auto": on CPUs of one process a broadcast is a hand-over, cheaper than the repeats.
    return _optimizer.sharded_by_default(config.mesh.devices)
  return config.update == "sharded"


def _ownership(replicator, config, owner_load: dict, graph, partition, axes, variables,
               whole: bool = False) -> _partition_owners.Ownership:
  """The sharded update's owners (none if the update is replicated); marks the variables they own.

  ``whole``: some input is taken whole by every device (a batch of unknown or
  indivisible size); then the whole step repeats along the batch axes, and
  owners could claim the model's own variables (every read of them), leaving
  them stale for a step that splits the batch: such a step owns only what an
  earlier step made owned (optimizer slots), and updates the rest everywhere.
  """
  ownership = _partition_owners.Ownership()
  if sharded_update(config):
    fixed = {}
    for name, variable in variables.items():
      if variable.owner is not None and variable.owner[1] == axes:
        fixed[name] = variable.owner[0]
    handle_bytes = {name: v.shape.num_elements() * v.dtype.size for name, v in variables.items()}
    load = owner_load.setdefault(axes, [0] * replicator.mesh.axis_size(axes) if axes else [])
    ownership = _partition_owners.assign(graph, partition, replicator.mesh, axes, handle_bytes, fixed, load,
                                         may_own=set(fixed) if whole else None)
  for name, variable in variables.items():
    owner = ownership.variables.get(name)
    if variable.owner is not None and (owner is None or (owner.position, owner.axes) != variable.owner):
      raise _errors.UnsupportedError(STALE_OWNER.format(name=variable.name.split(":")[0], axes=variable.owner[1]))
    if owner is not None:
      variable.set_owner(owner.position, owner.axes)
  return ownership


def _check_fallbacks(graph, partition, strict: bool) -> None:
  """Warns of every fallback (an op without a rule on split inputs), or refuses them all if ``strict``."""
  rows = []
  for name in partition.fallbacks:
    op = graph.get_operation_by_name(name)
    layouts = [partition.layouts.get(t.name) for t in op.inputs]
    location = _primitives.location_of(op)
    why = getattr(partition.decisions.get(name), "why", "")
    if not strict:
      message = FALLBACK_WHY if why else FALLBACK
      warnings.warn(message.format(type=op.type, name=name, location=location, layouts=layouts, why=why),
                    stacklevel=_primitives.user_stacklevel())
    shown = ", ".join(_partition_report.format_layout(x) for x in layouts)
    rows.append(f"  {op.type} ({name}, at {location}): input layouts {shown}" + (f" ({why})" if why else ""))
  if strict and rows:
    raise _errors.UnsupportedError(STRICT_FALLBACK.format(count=len(rows), ops="\n".join(rows)))


def _report(graph, partition, plan, mesh, trace, element_spec, auto, ownership=None) -> rewrite.PartitionReport:
  """The partition's report, the step's inputs named by their place in the batch and variables by their names."""
  paths = [path for path, spec in tree.flatten_with_path(element_spec) if spec is not None]
  inputs = {t.name: "input" + "".join(f"[{p!r}]" for p in path)
            for t, path in zip(graph.inputs[:len(paths)], paths)}
  variables, chosen_by = {}, {}
  for external, internal in graph.captures:
    variable = trace.owners.get(id(external))
    if variable is not None:
      variables[internal.name] = tf.TensorSpec(variable.shape, variable.dtype, name=variable.name.split(":")[0])
      chosen_by[internal.name] = _variables.layout_chosen_by(variable)
  report = rewrite.PartitionReport.from_partition(graph, partition, plan, mesh.shape, inputs=inputs,
                                                  variables=variables, outputs=graph.outputs,
                                                  locate=_primitives.location_of, ownership=ownership,
                                                  chosen_by=chosen_by)
  report.layout_search = None if auto is None else auto.result
  return report


def _split_axes(mesh, axes) -> tuple[str, ...]:
  """``axes`` without those of size 1 (they split nothing, and need no communication)."""
  return tuple(a for a in axes if mesh.shape[a] > 1)
