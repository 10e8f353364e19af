"""Building one replicated step: trace -> plan -> lower -> one cached graph call.

1. trace: ``step_fn`` is traced once per replica, under that replica's device
   and replica context (ours and ``tf.distribute``'s, ``_tf_distribute``), into
   one scratch graph. Primitives leave placeholders.
2. plan: :func:`rewrite.plan` matches the placeholders across replicas.
3. lower: :func:`rewrite.apply` replaces them with real collectives in the
   scratch graph's ``GraphDef``.
4. execute: the rewritten ``GraphDef`` is imported into a ``tf.function``
   (mapping the scratch graph's inputs and captured resources to the real
   ones, the handles stacked per device: ``_captures``); its concrete
   function is what every later call runs.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any
from typing import Callable

import tensorflow as tf
import tree

import rewrite
from replicator.core import _callables
from replicator.core import _config
from replicator.core import _context
from replicator.core import _errors
from replicator.core import _gradient_registry
from replicator.core import _primitives
from replicator.core import _summaries
from replicator.core import _tf_distribute
from replicator.core import _values
from replicator.guarantees import _atomic
from replicator.guarantees import _failures
from replicator.guarantees import _ordered_writes
from replicator.input import _inputs
from replicator.state import _access
from replicator.state import _consistency
from replicator.state import _invariance
from replicator.state import _lifting
from replicator.state import _variables
from replicator.views import _captures

OUTPUT_MISMATCH = (
    "step_fn returned different {what} on replicas 0 and {r}:\n"
    "  replica 0: {a}\n  replica {r}: {b}\n"
    "repl.run returns one value per replica with a single structure, so every "
    "replica must return the same nest of tensors with the same dtypes. Fix: "
    "return the same structure on every replica (use zeros where a replica has "
    "nothing to report)."
)


WRITE_OUTSIDE = (
    "The step writes {what} at {location}, but it was created outside every Replicator context "
    "(not in `with repl.context():` nor inside a step; with replicator.enable_keras_distribution(), "
    "not while a distribution was set), so it is one variable that every replica's step would update "
    "(with 4 replicas, assign_add(1.0) would add 4.0). Fix: create it inside "
    "`with repl.context():` (each replica then has a component, and writes that differ between "
    "replicas are combined by its aggregation); an optimizer's own variables (its step counter) "
    "are created with it: create the optimizer, and wrap it with repl.wrap_optimizer, inside the context "
    "(a Keras model and optimizer: inside `distribution.scope()`)."
)

FOREIGN_STRATEGY = (
    "The step entered another tf.distribute strategy's scope while the Replicator's is current ({error}). "
    "Most often an optimizer made before `with repl.context():` (or before the Keras distribution was set, "
    "with replicator.enable_keras_distribution()): a Keras optimizer keeps the strategy current when it was "
    "created, one device's, and enters it to apply updates. Fix: create the optimizer (and the model) inside "
    "the context (inside `distribution.scope()`, or after keras.distribution.set_distribution)."
)


def _spec_str(structure) -> str:
  return str(tree.map_structure(
      lambda v: None if v is None else f"{v.dtype.name}{v.shape}", structure))


@dataclasses.dataclass
class CompiledStep:
  """A traced and rewritten step; builds (and caches) the functions that run it."""

  plan: rewrite.Plan
  graph_def: Any
  input_names: list[str]  # the step graph's argument tensors (flat step inputs)
  captures: _captures.Captures  # step graph tensor name -> eager value to feed (handles stacked)
  output_names: list[str]
  output_dtypes: list[tf.DType]
  output_shapes: list[tf.TensorShape]  # as traced (an imported graph's outputs may have lost them)
  structure: Any  # output nest of replica 0 (leaves: tensors or None)
  tensor_leaves: list[bool]  # which leaves of one replica's output are tensors
  source: _inputs.Source
  accumulating: tuple = ()  # gradient-accumulating optimizers the step uses
  written: _consistency.Written | None = None  # replicated state the step writes
  snapshot: _atomic.AllOrNothing | None = None  # all-or-nothing calls: what they keep of the written components
  locate: Any = None  # failing node name -> (traced op, user location) (_failures.locator)
  workers: tuple = ()  # the cluster's worker addresses by task (Config.workers): a failure names a device's worker
  replicas: tuple = ()  # the replicas this process runs, whose outputs the step returns
  _executables: dict = dataclasses.field(default_factory=dict)

  def _import(self, flat_elements, captured: dict[str, tf.Tensor]) -> list[tf.Tensor]:
    # tf.identity captures tensors of an enclosing graph (a loop body's inputs).
    input_map = {name: tf.identity(t) for name, t in zip(self.input_names, flat_elements)}
    input_map.update(_captures.into_current_graph(captured))
    if not self.output_names:
      tf.graph_util.import_graph_def(self.graph_def, input_map=input_map, name="step")
      return []
    outputs = tf.graph_util.import_graph_def(
        self.graph_def, input_map=input_map, return_elements=self.output_names, name="step")
    for t, shape in zip(outputs, self.output_shapes):
      t.set_shape(shape)  # as traced: the rewritten graph's outputs may have lost it
    return outputs

  def use_source(self, source: _inputs.Source) -> None:
    """Runs on ``source`` from now on (new values, or a new epoch's iterators)."""
    if source is not self.source:
      self.source = source
      if source.stateful:
        self._executables.clear()  # they captured the old iterators

  def _single(self, steps: int, all_steps: bool) -> bool:
    """Whether one unguarded step runs (no step count returned).

    An iterator's next elements are taken without a check that they exist
    (one step, fewer ops: no ``tf.cond`` around the step) when the call is all
    or nothing: the step's writes wait for its inputs (``_ordered_writes``),
    so a call that finds the end of the input fails having written nothing.
    Otherwise a plain ``get_next`` at the end would abort the call after the
    writes that need no input (an optimizer's step counter) may have run.
    """
    if steps != 1 or all_steps:
      return False
    return not self.source.stateful or (self.snapshot is not None and self.source.fetches_plainly)

  def _build(self, steps: int, all_steps: bool, stop=None, atomic: bool = True, in_graph: bool = False):
    source = self.source
    captured = {}  # the function's captured tensors, set by `atomic` before the step's ops are made

    def one_step(*flat_args):
      return self._import(source.fetch(flat_args), captured)

    def loop(*flat_args):
      arrays = [tf.TensorArray(d, size=0, dynamic_size=True, infer_shape=False) for d in self.output_dtypes]

      def body(i, more, *arrays):
        has_value, get = source.fetch_optional(flat_args)

        def run():
          outputs = self._import(get(), captured)
          return [i + 1] + [a.write(i, o) for a, o in zip(arrays, outputs)]

        def stop():
          return [i] + list(arrays)

        results = tf.cond(has_value, run, stop)
        return [results[0], has_value] + list(results[1:])

      def cond(i, more, *_):
        going = tf.logical_and(i < steps, more)
        return going if stop is None else tf.logical_and(going, stop.keep_going())

      i, _, *arrays = tf.while_loop(cond, body, [tf.constant(0), tf.constant(True)] + arrays)
      if all_steps:
        return [i] + [a.stack() for a in arrays]
      return [i] + [tf.cond(i > 0, lambda a=a: a.read(i - 1), lambda a=a, d=d: tf.zeros([0], d))
                    for a, d in zip(arrays, self.output_dtypes)]

    # With iterators, fetch through optionals even for one step: a plain get_next
    # that hits the end aborts the call after input-independent stateful ops
    # (an optimizer's step counter) may already have run.
    def guarded_step(*flat_args):
      has_value, get = source.fetch_optional(flat_args)
      outputs = tf.cond(has_value, lambda: [tf.constant(1)] + list(self._import(get(), captured)),
                        lambda: [tf.constant(0)] + [tf.zeros([0], d) for d in self.output_dtypes])
      return outputs

    if self._single(steps, all_steps):
      fn = one_step
    elif steps == 1 and not all_steps:
      fn = guarded_step
    else:
      fn = loop

    snapshot = self.snapshot.for_call(fn is not loop) if atomic and self.snapshot is not None else None

    def call(*flat_args):
      captured.update(_atomic.input_map(snapshot, self.captures, in_graph))
      outputs = fn(*flat_args)
      if snapshot is not None:
        snapshot.release(_atomic.function_ops(outputs))
      return outputs

    return tf.function(call, autograph=False).get_concrete_function(*source.arg_specs)

  def call_in_graph(self, args: list[tf.Tensor]) -> list[Any]:
    """One step called from the graph of the function being traced (``_in_function``): each replica's outputs.

    A failure reaches that function's caller, where nothing of this library
    runs: the values the call kept are written back at the start of the
    step's next call (``_atomic.Snapshot._keep``). No step count (an explicit
    input never ends).
    """
    function = self._executables.get("in_graph")
    if function is None:
      function = self._executables["in_graph"] = self._build(1, False, in_graph=True)
    flat = function(*args)
    return self.unflatten(list(flat) if isinstance(flat, (list, tuple)) else [flat])

  def __call__(self, args: list[tf.Tensor], steps: int = 1, all_steps: bool = False,
               stop=None) -> tuple[list[Any], int]:
    """Runs the step; returns each replica's output nest and the number of steps run.

    ``stop``: a ``_interrupt.StopFlag`` a loop of steps reads before each step.
    """
    key = (steps, all_steps)
    function = self._executables.get(key)
    if function is None:
      function = self._executables[key] = self._build(steps, all_steps, stop)
    try:
      flat = function(*args)
    except tf.errors.OpError as e:
      error = _failures.after_failure(e, self.snapshot, self.written, self.locate, tuple(self.plan.devices),
                                      self.workers)
      if error is e:  # the end of the input
        raise _errors.EndOfInput(self.source.end_message()) from None
      raise error from e
    flat = list(flat) if isinstance(flat, (list, tuple)) else [flat]
    steps_run = steps
    if not self._single(steps, all_steps):
      steps_run, flat = int(flat[0]), flat[1:]
      if steps_run == 0:
        raise _errors.EndOfInput(self.source.end_message())
    return self.unflatten(flat), steps_run

  def unflatten(self, flat) -> list[Any]:
    """The step's flat outputs (every replica's, in order) as one output nest per replica."""
    results = []
    it = iter(flat)
    for _ in self.replicas:
      leaves = [next(it) if is_tensor else None for is_tensor in self.tensor_leaves]
      results.append(tree.unflatten_as(self.structure, leaves))
    return results


STEP_OUTPUT = (
    "step_fn returned {found} at {path}: a step's results are tensors, or values TensorFlow converts to tensors "
    "(numbers, NumPy arrays), in any nest of lists, tuples and dicts, or None. Fix: return tensors "
    "(tf.constant(value) for a Python value), and keep other objects outside the step."
)


def step_outputs(result):
  """``result`` (what a step returned) with every leaf a tensor (None kept); refuses a leaf that is not one."""

  def convert(path, value):
    if value is None or isinstance(value, tf.Tensor):
      return value
    try:
      return tf.convert_to_tensor(value)
    except (TypeError, ValueError):
      where = "/".join(str(p) for p in path) or "its top level"
      raise _errors.ArgumentTypeError(STEP_OUTPUT.format(found=f"a value of type {type(value).__name__}", path=where)) from None

  return tree.map_structure_with_path(convert, result)


def convert(fn: Callable, autograph: bool) -> Callable:
  """The callable to trace for step ``fn`` (``_callables.to_trace``; with ``autograph``, converted).

  Not cached here (a converted function holds ``fn``, and steps must not
  keep their step_fn alive); AutoGraph caches conversions by code.
  """
  return explaining_foreign_strategies(_callables.to_trace(fn, autograph, _autograph))


def _autograph(fn: Callable) -> Callable:
  """``fn`` converted with AutoGraph (its source map kept for error locations), or ``fn`` if it cannot be."""
  try:
    converted = tf.autograph.to_graph(fn)
  except Exception:  # pylint: disable=broad-except  # not convertible: run as written
    return fn
  _primitives.register_source_map(converted)
  return converted


def build(replicator, config: _config.Config, creator: Callable, step_fn: Callable,
          source: _inputs.Source) -> CompiledStep:
  """Traces ``step_fn`` (converted) on every replica, plans and rewrites it.

  ``replicator``: the Replicator whose step it is (what the step's code calls: ``repl.all_reduce``, its variables);
  ``creator``: its variable creator.
  """
  devices = replicator.devices
  replicas = config.local_replicas  # every replica, or in a multi-client job this process's
  # Each replica's placeholders; None for another process's replicas.
  placeholders: list = [None] * len(devices)
  for replica in replicas:
    placeholders[replica] = []
  gradient_names = []
  accumulating = set()
  created = []
  lifted = set()
  outputs = [None] * len(replicas)
  fn = convert(step_fn, config.autograph)

  retracing = []  # non-empty while tracing again after a trace that created variables

  def trace(*flat_elements):
    # TF may trace more than once; only the records of the last trace count.
    for replica in replicas:
      del placeholders[replica][:]
    _gradient_registry.release(gradient_names)
    del gradient_names[:]
    accumulating.clear()
    if not retracing:  # tracing again: the variables made the first time are reused, in order
      del created[:]
    lifted.clear()
    graph = tf.compat.v1.get_default_graph()
    mesh = replicator.mesh
    all_axes = frozenset(a for a in mesh.axis_names if mesh.shape[a] > 1)
    analysis = _invariance.Analysis(all_axes, source.varying_axes(mesh) & all_axes,
                                    {t.op.name for t in flat_elements},
                                    lambda handle: _variables.read_axes(handle, all_axes))
    flat_outputs, shared = [], {}
    with tf.variable_creator_scope(creator):
      for position, replica in enumerate(replicas):
        device = devices[replica]
        ctx = _context.ReplicaContext(replicator=replicator, replica_id=replica, device=device,
                                      graph=graph, placeholders=placeholders[replica],
                                      gradient_names=gradient_names, accumulating=accumulating, created=created,
                                      lifted=lifted, analysis=analysis, batch_axes=config.batch_axes,
                                      first=position == 0, shared=shared)
        with (tf.name_scope(f"replica_{replica}"), tf.device(device), _context.replica_scope(ctx),
              _tf_distribute.replica_context(ctx), _callables.inline_functions()):
          result = fn(*source.step_args(position, flat_elements))
          result = step_outputs(result)
        outputs[position] = result
    _variables.check_control_flow_writes(analysis)  # writes inside control flow: now that the trace is complete
    for result in outputs:
      flat_outputs.extend(t for t in tree.flatten(result) if t is not None)
    return flat_outputs

  try:
    with tf.variable_creator_scope(creator):
      scratch = tf.function(trace, autograph=False).get_concrete_function(*source.element_specs)
      if created and not any(hasattr(v, "_initialized") for _, _, v in created):
        # As a tf.function traces again after a first call that created variables: replica 0's trace
        # created them (an optimizer's first apply_gradients), and code that chose on whether they
        # existed yet (Keras's LossScaleOptimizer.scale_loss: the initial scale as a constant) would
        # differ between replica 0 and the others. Variables created again are the first trace's, by
        # position. Not when an initial value comes from the step's data: the first trace's graph
        # assigns it on the first run.
        retracing.append(True)
        scratch = tf.function(trace, autograph=False).get_concrete_function(*source.element_specs)
  finally:
    _gradient_registry.release(gradient_names)  # the backward functions ran during the trace
  written = _access.written_placeholders(scratch.graph)
  check_writes(scratch.graph, written)
  plan = rewrite.plan(placeholders, replicator.mesh, config.lowering_for)  # collective mismatches first:
  _check_outputs(outputs, replicas)  # they are the usual cause of output mismatches
  written_state = _consistency.Written([external for external, internal in scratch.graph.captures
                                       if internal.op.name in written])
  graph_def = _lifting.prune(scratch.graph.as_graph_def(), lifted)  # initializers computed outside the step
  graph_def = _independent_replicas(graph_def)
  graph_def = _summaries.single_series(graph_def)
  rewritten = rewrite.apply(graph_def, plan, config.lowerings)
  graph = scratch.graph
  graph_def, snapshot = rewritten.graph_def, None
  ops = {op.name: op for op in graph.get_operations()}
  if config.atomic:
    kept = _ordered_writes.order(graph_def, written, _ordered_writes.classifier(plan, ops.get),
                                 _ordered_writes.placed(graph.inputs[:len(source.element_specs)]))
    snapshot = _atomic.AllOrNothing([(internal.name, external) for external, internal in graph.captures
                                     if internal.op.name in written], kept)
  merged = rewrite.merge_reads(graph_def, rewrite.small_reads(ops.get))  # after the ordering (control inputs)
  flat0 = tree.flatten(outputs[0])
  captures = _captures.Captures([(internal.name, external) for external, internal in graph.captures]
                                + list(rewritten.external_inputs.items()))
  return CompiledStep(
      # No shape checks of the reads of stacked handles (Captures.with_read_shapes): the global view's steps
      # need them, the local view's did not run faster with them (deep MLP, transformer, ResNet: 1.00 of
      # without) and built slower (MobileNetV2: 2,790 more nodes).
      plan=plan, graph_def=graph_def,
      input_names=[t.name for t in graph.inputs[:len(source.element_specs)]], captures=captures,
      output_names=[rewrite.renamed_tensor(rewritten.output_name(t.name), merged) for t in scratch.outputs],
      output_dtypes=[t.dtype for t in scratch.outputs], output_shapes=[t.shape for t in scratch.outputs],
      structure=outputs[0], tensor_leaves=[t is not None for t in flat0], source=source, replicas=replicas,
      accumulating=tuple(sorted(accumulating, key=id)), written=written_state, snapshot=snapshot,
      locate=_failures.locator(scratch.graph, strip_replica=False, plan=plan), workers=config.workers)


_REPLICA = re.compile(r"^replica_(\d+)/")


def _independent_replicas(graph_def):
  """``graph_def`` without control edges from one replica's ops to another's.

  The replicas are traced one after the other into one function graph, whose
  automatic control dependencies order stateful ops without a resource
  (``tf.debugging.check_numerics``, ``tf.print``, stateful random draws) in
  program order: replica 0's last such op before replica 1's first. Across a
  collective that is a cycle (replica 0's op after the all-reduce waits for
  replica 1's op before it, which the all-reduce waits for). Replicas are
  independent programs, so these edges go; the ordering of a variable's
  first-run initialisation (traced by replica 0, ``INITIALIZE_SCOPE``)
  before every replica's uses stays.
  """
  for node in graph_def.node:
    mine = _REPLICA.match(node.name)
    if mine is None or not any(i.startswith("^replica_") for i in node.input):
      continue
    kept = []
    for ref in node.input:
      other = _REPLICA.match(ref[1:]) if ref.startswith("^") else None
      if other is None or other.group(1) == mine.group(1) or _variables.INITIALIZE_SCOPE in ref:
        kept.append(ref)
    if len(kept) != len(node.input):
      del node.input[:]
      node.input.extend(kept)
  return graph_def


def explaining_foreign_strategies(fn: Callable) -> Callable:
  """``fn``, raising :data:`FOREIGN_STRATEGY` for TensorFlow's "Must not nest" error while it is traced.

  A Keras optimizer made outside the context (one device's strategy current
  then) enters that strategy's scope to apply updates; TensorFlow's own
  message names neither the optimizer nor the fix.
  """

  @functools.wraps(fn)
  def call(*args, **kwargs):
    try:
      return fn(*args, **kwargs)
    except RuntimeError as e:
      if isinstance(e, _errors.ReplicatorError) or "Must not nest tf.distribute.Strategy scopes" not in str(e):
        raise
      raise _errors.UnreplicatedStateError(FOREIGN_STRATEGY.format(error=str(e).strip())) from None

  return call


def check_writes(graph, written: dict[str, str], replicated=_variables.is_replicated_handle) -> None:
  """Every variable the step writes (``written``: placeholder -> writing op) must be the Replicator's.

  ``replicated(handle)`` says whether a captured handle is one of the
  Replicator's (a component's; in the global view, a global stand-in's).
  """
  for external, internal in graph.captures:
    if internal.op.name in written and external.dtype == tf.resource and not replicated(external):
      variable = _variables.variable_of(external)
      name = "a resource" if variable is None else f"the variable {variable.name!r}"
      location = _primitives.location_of(graph.get_operation_by_name(written[internal.op.name]))
      raise _errors.UnreplicatedStateError(WRITE_OUTSIDE.format(what=name, location=location))


def _check_outputs(outputs: list, replicas) -> None:
  mismatch = _values.first_mismatch(outputs)
  if mismatch is not None:
    r, difference = mismatch
    raise _errors.OutputMismatchError(OUTPUT_MISMATCH.format(
        what=difference.split()[0] + "s", r=replicas[r], a=_spec_str(outputs[0]), b=_spec_str(outputs[r])))
