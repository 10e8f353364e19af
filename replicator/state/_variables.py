"""Replicated variables: one component per replica device, used as one variable.

Inside replica ``i``'s step a replicated variable reads and writes component
``i``; outside a step it reads component 0 and writes every component, so the
components stay identical.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import re
import sys
import threading
import weakref

import numpy as np
import tensorflow as tf

import mesh as mesh_lib
from replicator.core import _context
from replicator.core import _errors
from replicator.state import _export
from replicator.state import _global_handles
from replicator.state import _lifting
from replicator.state import _restore

SYMBOLIC_INITIAL_VALUE = (
    "Variable {name!r} was created inside step_fn with an initial value computed from the "
    "step's data ({value!r}) whose shape is not static ({shape}), so it cannot be created "
    "before the step runs. Fix: give the initial value a static shape (e.g. tf.ensure_shape), "
    "or create the variable in `with repl.context():` before calling repl.run."
)
OTHER_VARIABLE = (
    "Replica {replica} created the variable {path!r} as the step's variable #{index}, where replica "
    "{first} created {first_path!r}. A variable created inside step_fn is created once, by the first "
    "replica that creates it, and the other replicas get the same variable; so every replica must "
    "create the same variables in the same order. Fix: create variables the same way on every "
    "replica (not depending on repl.replica_id), or create them in `with repl.context():` before "
    "calling repl.run."
)
EXTRA_VARIABLE = (
    "Replica {replica} created the variable {path!r} (the step's variable #{index}), but replica "
    "{first} created only {count} variable(s) in this step. A variable created inside step_fn is "
    "created once, for every replica, by the first one; a variable only some replicas create has no "
    "value on the others. Fix: create it on every replica (not depending on repl.replica_id), or in "
    "`with repl.context():` before calling repl.run."
)

PLACED_ELSEWHERE = (
    "Replica {replica} (position {position} along {axes}) uses the variable {name!r}, which lives only on the "
    "devices of stage(s) {positions} along {axes}: repl.pipeline placed it there, on the stages that read it, so "
    "that each device keeps its stages' weights and optimizer slots alone. Fix: use it inside its stage's "
    "function only, and apply its gradient with repl.wrap_optimizer (which updates it on its own devices); read "
    "it outside the step (its value), or pass it to repl.pipeline(variables=...) only if every stage may hold it."
)

SHARDED_ON_READ = (
    "Variable {name!r} matches a layout ({spec}) but is an on-read (sync-on-read) "
    "variable, such as a metric's or an accumulator's; those cannot be sharded. Fix: "
    "narrow the LayoutMap pattern so it matches only model weights."
)
SHARDED_UNKNOWN_SHAPE = (
    "Variable {name!r} matches a layout ({spec}) but was made with shape={shape}, which lets a step "
    "change its shape; a sharded variable's global shape is fixed (each device keeps its piece). Fix: "
    "make it without shape= (or with its full shape), or narrow the LayoutMap so it does not match it."
)
SHARDED_SCATTER = (
    "{method}() outside a step is not supported for the sharded variable {name!r} "
    "(layout {spec}). Fix: assign the whole global value with assign(), or scatter inside "
    "step_fn, where each replica updates its own shard."
)

UNREDUCED_UPDATE = (
    "The step writes the trainable variable {name!r} with a value that differs between replicas "
    "(it depends on per-replica data along mesh axes {axes}) at {location}: its gradients were not "
    "reduced across replicas, so the replicas' copies would drift apart. Fix: wrap the optimizer, "
    "opt = repl.wrap_optimizer(keras.optimizers.Adam(...)), which all-reduces the gradients, or "
    "reduce them yourself (repl.all_reduce(grads, \"mean\")) before applying them."
)
VARIANT_ROWS = (
    "The step calls {method}() on the replicated variable {name!r} (aggregation {aggregation}) with rows "
    "that differ between replicas (along mesh axes {axes}) at {location}; only scatter_add and "
    "scatter_sub of variables with aggregation NONE, MEAN or SUM can be combined across replicas. "
    "Fix: make the update the same on every replica (reduce it with repl.all_reduce first), or "
    "use assign with a dense value."
)

CONDITIONAL_WRITE = (
    "The step writes the replicated variable {name!r} at {location} inside {construct} at {condition} whose "
    "{decider} differs between replicas (it depends on per-replica data along mesh axes {axes}), so some "
    "replicas would write it and others not (or a different number of times) and its copies would drift apart. "
    "A replicated variable must be written on every replica or on none, as one device decides once for the "
    "whole batch. Fix: compute the {decider} from values reduced across replicas, as one device sees them (e.g. "
    "`if repl.all_reduce(tf.reduce_sum(x), \"sum\") > 0:`); or write on every replica with a value chosen by "
    "tf.where (v.assign_add(tf.where(c, 1, 0))), which the variable's aggregation combines "
    "(aggregation=tf.VariableAggregation.SUM adds the replicas' values); or, for a value each replica keeps for "
    "itself, create the variable with synchronization=tf.VariableSynchronization.ON_READ."
)
VARYING_IN_CONTROL_FLOW = (
    "The step writes the replicated variable {name!r} (aggregation {aggregation}) at {location} inside "
    "{construct} at {condition} with a value that differs between replicas (along mesh axes {axes}). Combining "
    "the replicas' values by the aggregation takes a collective, which cannot run inside control flow. Fix: "
    "compute the new value inside the control flow and write the variable after it, on every replica; or "
    "reduce the value across replicas (repl.all_reduce) before the control flow; or, for a value each replica "
    "keeps for itself, create the variable with synchronization=tf.VariableSynchronization.ON_READ."
)
# What decides whether code inside a control-flow op runs: (the construct, what of it decides).
_CONSTRUCTS = {"If": ("a tf.cond (an `if` on a tensor)", "predicate"),
               "StatelessIf": ("a tf.cond (an `if` on a tensor)", "predicate"),
               "Case": ("a tf.switch_case", "branch index"), "StatelessCase": ("a tf.switch_case", "branch index"),
               "While": ("a tf.while_loop (a `while` or `for` on a tensor)", "trip count"),
               "StatelessWhile": ("a tf.while_loop (a `while` or `for` on a tensor)", "trip count")}

INITIALIZE_SCOPE = "replicator_initialize"

_creating = threading.local()
# id(component handle) -> the ReplicatedVariable it belongs to (what the step graph captures).
_OWNERS: "weakref.WeakValueDictionary[int, ReplicatedVariable]" = weakref.WeakValueDictionary()
_plain_class = []
_references = threading.local()
_REPLICA_SCOPE = re.compile(r"^replica_\d+(/|$)")


@contextlib.contextmanager
def reference_scope(variable):
  """Variables created inside are slots of ``variable`` and get its layout (same shape only)."""
  stack = _references.__dict__.setdefault("stack", [])
  stack.append(variable)
  try:
    yield
  finally:
    stack.pop()


def _current_reference():
  stack = getattr(_references, "stack", None)
  return stack[-1] if stack else None


def underlying(variable):
  """The ReplicatedVariable behind ``variable`` (a Keras 3 variable wraps one), or None."""
  if isinstance(variable, ReplicatedVariable):
    return variable
  if not isinstance(variable, tf.Variable):
    inner = getattr(variable, "value", None)  # keras.Variable.value: its tf.Variable
    if isinstance(inner, ReplicatedVariable):
      return inner
  return None


def layout_of(variable) -> mesh_lib.Layout | None:
  """The layout of a sharded variable, or None for replicated and ordinary variables."""
  replicated = underlying(variable)
  return None if replicated is None else replicated.sharding


@contextlib.contextmanager
def creating_components():
  _creating.active = True
  try:
    yield
  finally:
    _creating.active = False


def _is_creating() -> bool:
  return getattr(_creating, "active", False)


_out_of_place = threading.local()


@contextlib.contextmanager
def updated_out_of_place(variables):
  """Within: a replica's ``assign_add``/``assign_sub`` of these ``ReplicatedVariable`` s writes a new buffer.

  For variables whose other copies share the replica's buffer (a sharded
  update's owner broadcasts its new value: in one process the other devices'
  copies take the same buffer). An update in place would first copy the
  whole buffer (copy on write: 1.2 ms for a 50,000 x 128 table on this
  machine); ``assign(value - delta)`` makes the new value in one pass.
  """
  previous = getattr(_out_of_place, "ids", frozenset())
  _out_of_place.ids = previous | {id(v) for v in variables}
  try:
    yield
  finally:
    _out_of_place.ids = previous


def _component_class() -> type:
  if not _plain_class:
    with tf.init_scope(), creating_components():
      _plain_class.append(type(tf.Variable(0.0)))
  return _plain_class[0]


def new_component(**kwargs) -> tf.Variable:
  """An ordinary eager resource variable, created without any variable creator.

  Components are created while a step is traced (optimizer slots). Going
  through the creator stack would hand them to tf.function's own creator, which
  registers them as "created in the trace" and makes TF trace the whole step a
  second time (checked on TF 2.21.0). Instantiating the concrete variable class
  directly skips the creator stack; the class is taken from a probe variable so
  no private module is imported.
  """
  return _component_class()(**kwargs)


@_context.no_autograph
class ReplicatedVariable(tf.Variable):
  """A variable with one component per replica.

  Created for you by every ``tf.Variable`` made inside ``repl.context()`` or a
  step of ``repl.run`` (Keras layers and optimizers, ``tf.Module``, Sonnet).
  To user code it is one variable: inside replica ``i``'s step it reads and
  writes component ``i``.

  Outside a step it depends on ``synchronization``:

  * on write (the default; weights, optimizer state): the components are kept
    identical; reads give component 0, writes go to every component.
  * ``tf.VariableSynchronization.ON_READ`` (Keras metrics, accumulators):
    each replica keeps its own value, and a read outside a step aggregates
    them by ``aggregation`` (SUM, MEAN or ONLY_FIRST_REPLICA). A write
    outside a step is spread so that the aggregated read returns the value
    written (for SUM: the value on component 0, zeros elsewhere).

  A *sharded* variable (one that matched a layout of ``repl.context(layouts=...)``)
  keeps only its piece on each device: inside a step it reads and writes the
  local piece (``shape`` stays the global shape); outside a step it reads as the
  global value, writes split the global value, and checkpoints hold the
  global value, so they restore on any layout, mesh or a single device.

  Exported for serving (``tf.saved_model.save``, Keras's ``model.export``),
  every replicated variable becomes one ordinary variable holding its global
  value, and the saved functions read it (see ``_export``).
  """

  # GradientTape, Keras and tf.Module treat objects with this attribute as
  # resource variables and differentiate with respect to `.handle`.
  _should_act_as_resource_variable = True

  def __init__(self, components, replicator, offsets=None, layout=None,
               replicas=None):  # pylint: disable=super-init-not-called
    self._components = tuple(components)
    # (kept when the components are replaced, by a relayout or a pipeline's placement: Keras's optimizers key their
    # slots by it, and one built before must still find the variable)
    self._id = f"{self._components[0]._unique_id}_replicated"  # pylint: disable=protected-access
    self._replicator = replicator
    # The replica each component belongs to: every replica, or in a multi-client job this process's.
    self._replicas = tuple(range(len(self._components))) if replicas is None else tuple(replicas)
    self._position = {r: i for i, r in enumerate(self._replicas)}
    # None: every component is the whole variable (replicated).
    self._sharding = None if layout is None or layout.is_fully_replicated else layout
    self._global_shape = None
    self._sources = None  # per replica of the job, the position of a component holding its piece (sharded)
    if self._sharding is not None:
      self._global_shape = tf.TensorShape(mesh_lib.global_shape(self._components[0].shape.as_list(), layout))
      self._sources = piece_sources(layout, self._replicas)
    # In a multi-client job, the sum of every process's value (an on-read variable's read); None: one process.
    self._across = None
    self._gathered = None  # its value read by every process for a save in progress (values_gathered)
    self._pieces = None  # {slice spec: piece} this process writes for a save in progress (pieces_written)
    # Per-replica additive offsets kept by writes from outside a step (random
    # seed state: each replica draws its own stream). None: no offsets.
    self._offsets = offsets
    # home[i]: the component that holds device i's current value (see set_owner).
    self._home = tuple(range(len(self._components)))
    self._owner = None  # (position, axes) once a sharded update owns it (set_owner)
    # (axes, positions): held only by the replicas whose index along ``axes`` is one of ``positions`` (a pipeline's
    # stages that read it: see place); None: by every replica.
    self._placement = None
    self._chosen_by = ""  # what chose its layout (a layouts key, its variable's for a slot), for repl.explain
    self._reference = None  # the variable it was made like (an optimizer's slot: its variable), if any
    # A never-assigned handle of the global shape, made by the first read inside a
    # function that combines components (see _export); None until then.
    self._serving = _export.Serving()
    self._run_state = None  # the Replicator's _run_state.RunState (set by its creator): saves check divergence
    for component in self._components:
      _OWNERS[id(component.handle)] = self

  # -- which component -----------------------------------------------------

  @property
  def components(self) -> tuple[tf.Variable, ...]:
    """The per-replica component variables, in replica order."""
    return self._components

  @property
  def replicas(self) -> tuple[int, ...]:
    """The replica of each component (in a multi-client job, this process's replicas only)."""
    return self._replicas

  @property
  def sharding(self) -> mesh_lib.Layout | None:
    """The layout of a sharded variable; None if every component holds the whole value."""
    return self._sharding

  @property
  def layout(self) -> mesh_lib.Layout:
    """How the variable is laid out over the replicator's mesh (replicated if not sharded)."""
    if self._sharding is not None:
      return self._sharding
    return mesh_lib.Layout.replicated(self._replicator.mesh, self._components[0].shape.rank)

  @property
  def owner(self) -> tuple[int, tuple[str, ...]] | None:
    """``(position, axes)`` of the device of each group kept current (``set_owner``), or None: all of them."""
    return self._owner

  def set_owner(self, position: int, axes: tuple[str, ...]) -> None:
    """Marks the member at ``position`` of each device group along ``axes`` as the one kept current.

    Used by a sharded optimizer update (``wrap_optimizer(update="sharded")``):
    only the owner of a slot variable updates it, so reads from outside a step
    and checkpoints take the owner's component; writes still go to every
    component.
    """
    self._owner = (position, tuple(axes))
    home = list(range(len(self._components)))
    for group in self._replicator.mesh.groups(axes):
      for device in group:
        if device in self._position:
          home[self._position[device]] = self._position.get(group[position], self._position[device])
    self._home = tuple(home)

  def relayout(self, layout: mesh_lib.Layout | None, chosen_by: str = "") -> None:
    """Lays the variable out anew (automatic layouts): new components holding the pieces of its value.

    The variable object stays (models and optimizers keep referring to it);
    its components are replaced. Steps built before hold the old components:
    the caller rebuilds them. Not for on-read variables.
    """
    layout = None if layout is None or layout.is_fully_replicated else layout
    if self._on_read or layout == self._sharding:
      return
    sources = None if layout is None else piece_sources(layout, self._replicas)
    with tf.init_scope(), _context.cross_replica_scope():
      with tf.device(self._replicator.devices[self._replicas[0]]):
        value = tf.identity(self.read_value())  # the global value (gathered if sharded)
        pieces = self._local(mesh_lib.split(value, layout)) if layout is not None else [value] * len(self._replicas)
    self._replace_components(self._replicas, pieces)
    self._sharding = layout
    self._sources = sources
    self._global_shape = None if layout is None else tf.TensorShape(
        mesh_lib.global_shape(self._components[0].shape.as_list(), layout))
    if chosen_by:
      self._chosen_by = chosen_by

  def _replace_components(self, replicas: tuple[int, ...], values) -> None:
    """New components on ``replicas``' devices holding ``values`` (one each) in place of the old ones (which steps
    built before still hold); each device's current value its own, no owner."""
    with tf.init_scope(), _context.cross_replica_scope():
      components = []
      for replica, value in zip(replicas, values):
        with tf.device(self._replicator.devices[replica]):
          components.append(new_component(initial_value=value, trainable=self.trainable,
                                           name=self.name.split(":")[0], dtype=self.dtype,
                                           synchronization=self.synchronization, aggregation=self.aggregation))
    for component in self._components:
      _OWNERS.pop(id(component.handle), None)
    self._components = tuple(components)
    self._replicas = tuple(replicas)
    self._position = {r: i for i, r in enumerate(replicas)}
    self._home = tuple(range(len(components)))
    self._owner = None
    self._serving = _export.Serving()
    for component in components:
      _OWNERS[id(component.handle)] = self

  @property
  def placement(self) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    """``(axes, positions)`` of a variable held only by the replicas at ``positions`` along ``axes``, else None."""
    return self._placement

  def place(self, axes: tuple[str, ...], positions) -> bool:
    """Keeps the variable on the replicas whose index along ``axes`` is one of ``positions`` only (a pipeline's
    stages that read it), replicated over the other axes; all of them: on every replica again.

    As :meth:`relayout`: the variable object stays, its components are replaced (new ones holding its value, or
    a sharded variable's its pieces: a layout over ``axes`` is not placed); steps built before hold the old
    ones. Returns whether it moved. Not for seeded variables, nor for on-read ones other than those made like a
    variable (a gradient accumulator of ``wrap_optimizer``, which moves with its variable keeping its aggregated
    value: a sum's total on the first new holder); those are left as they are. Not in a multi-client job.
    """
    mesh = self._replicator.mesh
    axes, positions = tuple(axes), tuple(sorted(set(positions)))
    placement = None if len(positions) == mesh.axis_size(axes) else (axes, positions)
    split_over = self._sharding is not None and any(
        set(axes) & set(self._sharding.axes(d) or ()) for d in range(self._sharding.rank))
    if placement == self._placement or split_over or (self._on_read and self._reference is None) \
        or self._offsets is not None:
      return False
    everyone = tuple(range(mesh.size))
    replicas = everyone if placement is None else tuple(
        r for r in everyone if mesh.axis_index(r, axes) in positions)
    with tf.init_scope(), _context.cross_replica_scope():
      if self._sharding is not None:  # (each kept replica its piece of the whole value)
        with tf.device(self._replicator.devices[self._replicas[0]]):
          pieces = mesh_lib.split(tf.identity(self.read_value()), self._sharding)
        values = [pieces[r] for r in replicas]
      else:
        value = tf.identity(self._combine_components() if self._on_read else self._home_component().read_value())
        values = [value] * len(replicas)
        if self._on_read and self.aggregation == tf.VariableAggregation.SUM:  # (the total on the first holder)
          values = [value] + [tf.zeros_like(value)] * (len(replicas) - 1)
    self._replace_components(replicas, values)
    if self._sharding is not None:
      self._sources = piece_sources(self._sharding, replicas)
    self._placement = placement
    return True

  def _current(self) -> tf.Variable:
    standin = self._global_standin()
    if standin is not None:
      return standin
    _context.note_read(self)
    ctx = _context.current_context()
    if ctx is not None and ctx.replicator is self._replicator:
      position = self._position.get(ctx.replica_id)
      if position is None and self._placement is not None:
        axes, positions = self._placement
        raise _errors.UnsupportedError(PLACED_ELSEWHERE.format(
            replica=ctx.replica_id, position=self._replicator.mesh.axis_index(ctx.replica_id, axes), axes=axes,
            name=self.name.split(":")[0], positions=list(positions)))
      return self._components[position]
    return self._home_component()

  def _local(self, pieces: list) -> list:
    """Of one value per replica of the job (``mesh.split``'s pieces), those of this process's components."""
    return [pieces[r] for r in self._replicas]

  def _home_component(self) -> tf.Variable:
    """The component reads outside a step use, and exports copy: the first of the first owner's devices."""
    return self._components[self._home[0]]

  def _global_standin(self) -> tf.Variable | None:
    """In a global-view trace of this variable's Replicator: its global-shaped stand-in, else None."""
    trace = _context.current_global_trace()
    if trace is None or trace.replicator is not self._replicator:
      return None
    standin = trace.standins.get(id(self))
    if standin is None:
      standin = trace.standins[id(self)] = _global_handles.global_variable(
          self.shape, self.dtype, self.name.split(":")[0], self.trainable)
      trace.owners[id(standin.handle)] = self
    return standin

  def _in_replica(self) -> bool:
    if self._global_standin() is not None:
      return True
    ctx = _context.current_context()
    return ctx is not None and ctx.replicator is self._replicator

  # -- properties ------------------------------------------------------------

  @property
  def name(self):
    return self._components[0].name

  @property
  def _shared_name(self):
    return self._components[0]._shared_name  # pylint: disable=protected-access

  @property
  def _unique_id(self):
    return self._id

  @property
  def dtype(self):
    return self._components[0].dtype

  @property
  def shape(self):
    """The global shape (also inside a step, where reads give the replica's piece).

    Code that creates variables "like" this one (optimizer slots) therefore
    creates global-shaped variables, which take this variable's layout.
    """
    return self._components[0].shape if self._sharding is None else self._global_shape

  def get_shape(self):
    return self.shape

  @property
  def device(self):
    return self._current().device

  @property
  def handle(self):
    if self._sharding is not None and not self._in_replica():
      # Outside a step a sharded variable is read whole (its pieces assembled) and has no handle of its global
      # value: a GradientTape asking for one would find no gradient, and Keras's optimizer would skip it.
      raise _errors.UnsupportedError(SHARDED_HANDLE.format(
          name=self.name.split(":")[0], spec=self._sharding.spec,
          where="a tf.function" if tf.inside_function() else "eager code"))
    return self._current().handle

  @property
  def op(self):
    return self._current().op

  @property
  def graph(self):
    return self._current().graph

  @property
  def trainable(self):
    return self._components[0].trainable

  @property
  def synchronization(self):
    return self._components[0].synchronization

  @property
  def aggregation(self):
    return self._components[0].aggregation

  @property
  def constraint(self):
    return self._components[0].constraint

  @property
  def initializer(self):
    return self._components[0].initializer

  @property
  def initial_value(self):
    return self._components[0].initial_value

  def _as_graph_element(self):
    return self._current()._as_graph_element()  # pylint: disable=protected-access

  # -- reads -------------------------------------------------------------------

  @property
  def _on_read(self) -> bool:
    return self.synchronization == tf.VariableSynchronization.ON_READ

  def _aggregate(self) -> tf.Tensor:
    """The value seen outside a step: component 0, the global value of a sharded
    variable, or the aggregate of an on-read variable.

    Inside a function (not a step's), a read that combines components is
    written so that, once exported for serving, it reads the one exported
    variable instead (``_export.servable_read``).
    """
    if tf.inside_function() and _context.current_context() is None and _export.combines_components(self):
      return _export.servable_read(self, self._serving, self._home_component(), self._combine_components)
    return self._combine_components()

  def _combine_components(self, read=lambda component: component.read_value()) -> tf.Tensor:
    """The value outside a step, from the components (each read with ``read``)."""
    if self._sharding is not None and self._sources is None:  # some pieces are other processes' only
      return self._assembled_across(read)
    if self._sharding is not None:
      with tf.device(self._components[0].device):
        return mesh_lib.assemble([read(self._components[self._home[s]]) for s in self._sources], self._sharding)
    aggregation = self.aggregation
    if not self._on_read or aggregation in (tf.VariableAggregation.NONE, tf.VariableAggregation.ONLY_FIRST_REPLICA):
      return read(self._current())
    with tf.device(self._components[0].device):
      total = tf.add_n([read(c) for c in self._components])
      if self._across is not None:  # every process's part (each process reads it at the same point)
        total = self._across(total, f"read {self.name.split(':')[0]}")
      count = len(self._components) if self._placement is not None else self._replicator.num_replicas
      if aggregation == tf.VariableAggregation.MEAN:
        total = total / tf.cast(count, total.dtype) if total.dtype.is_floating else total // count
      return total

  def _assembled_across(self, read) -> tf.Tensor:
    """The global value of a variable whose pieces live in several processes (every process reads it at once).

    Each process assembles a global-shaped tensor holding the pieces whose
    first holder in the job is one of its replicas and zeros elsewhere; one
    all-reduce over the workers sums them into the value.
    """
    with tf.device(self._components[0].device):
      zeros = tf.zeros(self._components[0].shape, self.dtype)
      pieces = [read(self._components[self._position[r]]) if r in self._position else zeros
                for r in range(self._replicator.num_replicas)]
      mine = mesh_lib.assemble(pieces, self._sharding)  # (each piece from its first holder: here, or zeros)
      return self._across(mine, f"read {self.name.split(':')[0]}")

  @property
  def _whole_on_each(self) -> bool:
    """Whether outside a step component 0 is the value (not on-read, not sharded)."""
    return not self._on_read and self._sharding is None

  def value(self):
    return self._current().value() if self._in_replica() or self._whole_on_each else self._aggregate()

  def read_value(self):
    return self._current().read_value() if self._in_replica() or self._whole_on_each else self._aggregate()

  def sparse_read(self, indices, name=None):
    if self._in_replica() or self._whole_on_each:
      return self._current().sparse_read(indices, name=name)
    return tf.gather(self._aggregate(), indices, name=name)

  def gather_nd(self, indices, name=None):
    if self._in_replica() or self._whole_on_each:
      return self._current().gather_nd(indices, name=name)
    return tf.gather_nd(self._aggregate(), indices, name=name)

  def numpy(self):
    return self._current().numpy() if self._whole_on_each else self._aggregate().numpy()

  def __array__(self, dtype=None, copy=None):  # NumPy 2's protocol
    if copy is False:
      raise ValueError("np.array(ReplicatedVariable, copy=False): its value is read into a new array, so it cannot be "
                       "given without a copy. Fix: np.asarray(x) or np.array(x).")
    return np.asarray(self.numpy(), dtype=dtype)

  def __int__(self):  # int(optimizer.iterations), as for a resource variable
    return int(self.numpy())

  def __float__(self):
    return float(self.numpy())

  def _dense_var_to_tensor(self, dtype=None, name=None, as_ref=False):
    if not self._whole_on_each and not self._in_replica() and not as_ref:
      return tf.cast(self._aggregate(), dtype) if dtype is not None else self._aggregate()
    return self._current()._dense_var_to_tensor(dtype=dtype, name=name, as_ref=as_ref)  # pylint: disable=protected-access

  # -- writes ------------------------------------------------------------------

  def _replicated_axes(self) -> tuple[str, ...]:
    """The mesh axes (of more than one device) along which this variable's components must agree."""
    mesh = self._replicator.mesh
    sharded = () if self._sharding is None else self._sharding.sharded_axes
    if self._placement is not None:  # (its holders along the placement's axes agree by construction)
      sharded = tuple(sharded) + self._placement[0]
    return tuple(a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in sharded)

  def _alike_axes(self) -> tuple[str, ...]:
    """The axes along which replicas' writes must agree (none: each replica's own value, or one device)."""
    if self._on_read or self._offsets is not None:
      return ()
    return self._replicated_axes()

  def _checked_writes(self):
    """``(replica context, replicated axes)`` if this replica's writes must agree with the others', else None."""
    ctx = _context.current_context()
    axes = self._alike_axes()
    if ctx.analysis is None or not axes:
      return None  # not checked (a step built without analysis), each replica's own value, or one device
    return ctx, axes

  def _combined(self, method: str, value):
    """Inside a step: what this replica writes, combined across replicas where their values may differ.

    A value that is the same on every replica of the variable's group (see
    ``_invariance``) is written as it is. Otherwise the variable's
    ``aggregation`` says how to combine the replicas' values, as
    tf.distribute defines it: ``SUM`` (always, as tf.distribute sums even
    equal values), ``MEAN`` and ``NONE`` (the mean: Keras's BatchNormalization
    moving statistics), ``ONLY_FIRST_REPLICA`` (replica 0's). A trainable
    variable written with differing values is an error: its gradients were
    not reduced. On-read variables and per-replica random-seed states keep
    each replica's own value. Inside control flow see :meth:`_check_after_trace`.
    """
    checked = self._checked_writes()
    if checked is None:
      return value
    ctx, axes = checked
    from replicator.core import _primitives  # pylint: disable=import-outside-toplevel  (imports this module)
    value = tf.convert_to_tensor(value, self.dtype)
    aggregation = self.aggregation
    location = _primitives.user_location()
    if _in_control_flow(ctx):
      written = value * self._replicator.mesh.axis_size(axes) if aggregation == tf.VariableAggregation.SUM else value
      self._check_after_trace(ctx, axes, [value], written, location)
      return written
    if aggregation == tf.VariableAggregation.SUM:
      return _primitives.all_reduce(ctx, value, "sum", axes, location)
    varying = sorted(ctx.analysis.varying(value) & set(axes))
    if not varying:
      return value
    if self.trainable:
      raise _errors.ReplicaInvarianceError(UNREDUCED_UPDATE.format(name=self.name, axes=varying, location=location))
    if aggregation == tf.VariableAggregation.ONLY_FIRST_REPLICA:
      return _primitives.broadcast(ctx, value, 0, axes, location)
    return _primitives.all_reduce(ctx, value, "mean", axes, location)

  def _combined_rows(self, method: str, sparse_delta: tf.IndexedSlices) -> tf.IndexedSlices:
    """:meth:`_combined` for scatters: rows that differ between replicas are gathered from all of them."""
    checked = self._checked_writes()
    if checked is None:
      return sparse_delta
    ctx, axes = checked
    from replicator.core import _primitives  # pylint: disable=import-outside-toplevel
    aggregation = self.aggregation
    location = _primitives.user_location()
    summed = aggregation == tf.VariableAggregation.SUM and method in ("scatter_add", "scatter_sub")
    if _in_control_flow(ctx):
      written = sparse_delta
      if summed:
        written = tf.IndexedSlices(sparse_delta.values * self._replicator.mesh.axis_size(axes), sparse_delta.indices,
                                   sparse_delta.dense_shape)
      self._check_after_trace(ctx, axes, [sparse_delta.values, sparse_delta.indices], written.values, location)
      return written
    varying = sorted((ctx.analysis.varying(sparse_delta.values) | ctx.analysis.varying(sparse_delta.indices))
                     & set(axes))
    if not varying and not summed:
      return sparse_delta
    if self.trainable and varying:
      raise _errors.ReplicaInvarianceError(UNREDUCED_UPDATE.format(name=self.name, axes=varying, location=location))
    if method not in ("scatter_add", "scatter_sub") or aggregation == tf.VariableAggregation.ONLY_FIRST_REPLICA:
      raise _errors.ReplicaInvarianceError(VARIANT_ROWS.format(
          method=method, name=self.name, aggregation=aggregation.name, axes=varying, location=location))
    mean = aggregation != tf.VariableAggregation.SUM
    (rows,) = _primitives.sparse_sum(ctx, [sparse_delta], axes, location,
                                     1.0 / self._replicator.mesh.axis_size(axes) if mean else 1.0)
    return rows

  def _check_after_trace(self, ctx, axes: tuple[str, ...], values: list[tf.Tensor], written: tf.Tensor,
                         location: str) -> None:
    """A write inside a tf.cond branch or a tf.while_loop body: checked once the trace is complete.

    No collective can run there (a body may run a different number of
    times on each replica), so the write must be the same on every replica:
    made on every replica or on none (the control flow's predicate or trip
    count the same everywhere), with a value that is the same everywhere.
    Such a value is written as it is; with ``SUM`` aggregation, as the sum
    of the replicas' equal values (times the group's size), as outside
    control flow. See :func:`check_control_flow_writes`.
    """
    ctx.analysis.deferred.append(_ControlFlowWrite(
        name=self.name, trainable=self.trainable, aggregation=self.aggregation, axes=axes, values=values,
        written=written, graph=tf.compat.v1.get_default_graph(), location=location))

  def _deferred(self, method: str, value) -> bool:
    """Inside a pipeline's stage (run on its own devices only): a write of state every replica holds alike is
    handed to the pipeline, which makes it once a step on every replica (``ReplicaContext.stage_writes``)."""
    ctx = _context.current_context()
    placed = () if self._placement is None else self._placement[0]  # (on its stages only: written by them too)
    if ctx.stage_writes is None or (self._checked_writes() is None and not placed) or \
        not set(ctx.stage_axes) <= set(self._replicated_axes()) | set(placed):
      return False
    ctx.stage_writes.append((self, method, value))
    return True

  def _write(self, method: str, *args, **kwargs):
    standin = self._global_standin()
    if standin is not None:  # the global view: the partitioner decides the communication
      return getattr(standin, method)(*args, **kwargs)
    _context.note_write(self, method, self._alike_axes())
    if self._in_replica():
      if self._deferred(method, args[0]):
        return None if kwargs.get("read_value") is False else tf.convert_to_tensor(args[0], self.dtype)
      args = (self._combined(method, args[0]),) + args[1:]
      component = self._current()
      if method != "assign" and id(self) in getattr(_out_of_place, "ids", ()):
        delta = tf.convert_to_tensor(args[0], self.dtype)
        value = component.read_value()
        return component.assign(value + delta if method == "assign_add" else value - delta, *args[1:], **kwargs)
      return getattr(component, method)(*args, **kwargs)
    read_value = kwargs.pop("read_value", True)
    if self._sharding is not None:
      value = tf.convert_to_tensor(args[0], self.dtype)
      with tf.device(self._components[0].device):
        pieces = self._local(mesh_lib.split(value, self._sharding))
      for component, piece in zip(self._components, pieces):
        getattr(component, method)(piece, *args[1:], read_value=False, **kwargs)
    elif self._on_read and method in ("assign_add", "assign_sub") and \
        self.aggregation == tf.VariableAggregation.SUM:
      if holds_the_sum(self):  # replica 0's process (in a multi-client job)
        getattr(self._components[0], method)(*args, read_value=False, **kwargs)  # the sum moves by delta
    elif self._on_read and method == "assign":
      values = spread(args[0], self)
      for component, value in zip(self._components, values):
        component.assign(value, read_value=False)
    elif self._offsets is not None and method == "assign":
      for component, offset in zip(self._components, self._offsets):
        component.assign(tf.convert_to_tensor(args[0], self.dtype) + offset, read_value=False)
    else:
      for component in self._components:
        getattr(component, method)(*args, read_value=False, **kwargs)
    return self if read_value else None

  def _scatter(self, method: str, *args, **kwargs):
    standin = self._global_standin()
    if standin is not None:
      return getattr(standin, method)(*args, **kwargs)
    _context.note_write(self, method, self._alike_axes())
    if self._in_replica():
      if self._deferred(method, args[0]):
        return self
      if isinstance(args[0], tf.IndexedSlices):
        args = (self._combined_rows(method, args[0]),) + args[1:]
      return getattr(self._current(), method)(*args, **kwargs)
    if self._sharding is not None:
      raise _errors.UnsupportedError(SHARDED_SCATTER.format(method=method, name=self.name, spec=self._sharding.spec))
    for component in self._components:
      getattr(component, method)(*args, **kwargs)
    return self

  def assign(self, value, use_locking=False, name=None, read_value=True):
    return self._write("assign", value, use_locking=use_locking, name=name, read_value=read_value)

  def assign_add(self, delta, use_locking=False, name=None, read_value=True):
    return self._write("assign_add", delta, use_locking=use_locking, name=name, read_value=read_value)

  def assign_sub(self, delta, use_locking=False, name=None, read_value=True):
    return self._write("assign_sub", delta, use_locking=use_locking, name=name, read_value=read_value)

  def scatter_add(self, sparse_delta, use_locking=False, name=None):
    return self._scatter("scatter_add", sparse_delta, use_locking=use_locking, name=name)

  def scatter_sub(self, sparse_delta, use_locking=False, name=None):
    return self._scatter("scatter_sub", sparse_delta, use_locking=use_locking, name=name)

  def scatter_max(self, sparse_delta, use_locking=False, name=None):
    return self._scatter("scatter_max", sparse_delta, use_locking=use_locking, name=name)

  def scatter_min(self, sparse_delta, use_locking=False, name=None):
    return self._scatter("scatter_min", sparse_delta, use_locking=use_locking, name=name)

  def scatter_mul(self, sparse_delta, use_locking=False, name=None):
    return self._scatter("scatter_mul", sparse_delta, use_locking=use_locking, name=name)

  def scatter_div(self, sparse_delta, use_locking=False, name=None):
    return self._scatter("scatter_div", sparse_delta, use_locking=use_locking, name=name)

  def scatter_update(self, sparse_delta, use_locking=False, name=None):
    return self._scatter("scatter_update", sparse_delta, use_locking=use_locking, name=name)

  def scatter_nd_add(self, indices, updates, name=None):
    return self._scatter("scatter_nd_add", indices, updates, name=name)

  def scatter_nd_sub(self, indices, updates, name=None):
    return self._scatter("scatter_nd_sub", indices, updates, name=name)

  def scatter_nd_update(self, indices, updates, name=None):
    return self._scatter("scatter_nd_update", indices, updates, name=name)

  # -- checkpointing: one copy, restored into every component ------------------

  def _serialize_to_tensors(self):
    _refuse_diverged(self)
    if self._pieces is not None:  # this process's pieces of a variable split across processes (pieces_written)
      return {"VARIABLE_VALUE": dict(self._pieces)}
    if self._gathered is not None:  # read by every process before this save (values_gathered)
      return {"VARIABLE_VALUE": self._gathered}
    if not self._whole_on_each:  # the global value: restorable on any layout
      return {"VARIABLE_VALUE": self._aggregate()}
    return self._current()._serialize_to_tensors()  # pylint: disable=protected-access

  def _restore_from_tensors(self, restored_tensors):
    self._check_restorable(restored_tensors)
    if tf.executing_eagerly():
      _restore.keep(self.name.split(":")[0], self._components)  # put back if a later variable cannot restore
    if self._sharding is not None:
      (value,) = restored_tensors.values()
      with tf.device(self._components[0].device):
        pieces = self._local(mesh_lib.split(tf.convert_to_tensor(value, self.dtype), self._sharding))
      ops = [c.assign(p) for c, p in zip(self._components, pieces)]
    elif self._on_read:
      (value,) = restored_tensors.values()
      ops = [c.assign(v) for c, v in zip(self._components, spread(value, self))]
    elif self._offsets is not None:
      (value,) = restored_tensors.values()
      ops = [c.assign(value + offset) for c, offset in zip(self._components, self._offsets)]
    else:
      ops = [c._restore_from_tensors(restored_tensors) for c in self._components]  # pylint: disable=protected-access
    return tf.group(ops) if not tf.executing_eagerly() else None

  def _check_restorable(self, restored_tensors) -> None:
    """Refuses a checkpoint's tensor of another shape or dtype, putting back what this restore assigned before."""
    found = [t for t in restored_tensors.values() if hasattr(t, "shape")]
    if len(found) != 1 or (found[0].shape.is_compatible_with(self.shape) and found[0].dtype == self.dtype):
      return
    (value,) = found
    undone = _restore.undo() if tf.executing_eagerly() else []
    name = self.name.split(":")[0]
    raise _errors.ArgumentError(RESTORE_MISMATCH.format(
        name=name, shape=self.shape.as_list(), dtype=self.dtype.name, found_shape=value.shape.as_list(),
        found_dtype=value.dtype.name,
        undone=(f"the {len(undone)} variable(s) this restore had assigned before it ({', '.join(undone[:4])}"
                f"{', ...' if len(undone) > 4 else ''}) hold their values from before the restore again"
                if undone else "no variable of this Replicator had been assigned by it")))

  def _copy_trackable_to_cpu(self, object_map):
    self._current()._copy_trackable_to_cpu(object_map)  # pylint: disable=protected-access

  # -- export for serving (tf.saved_model.save, Keras model.export): one global variable

  def _export_to_saved_model_graph(self, object_map=None, tensor_map=None, options=None, **kwargs):
    del kwargs  # unused
    return _export.export_to_graph(self, self._serving, self._home_component(), object_map, tensor_map, options)

  def _write_object_proto(self, proto, options):
    self._home_component()._write_object_proto(proto, options)  # pylint: disable=protected-access  (Trackable's)
    _export.global_object_proto(self, proto)  # a variable of the global shape

  def __repr__(self):
    value = ""
    if tf.executing_eagerly():
      value = f", numpy={np.array2string(self.numpy(), threshold=8, edgeitems=2)}"
    sharding = "" if self._sharding is None else f" layout={self._sharding.spec}"
    if self._placement is not None:
      sharding += f" placed={self._placement[0]}:{list(self._placement[1])}"
    return (f"<ReplicatedVariable {self.name!r} shape={self.shape} dtype={self.dtype.name} "
            f"replicas={len(self._components)}{sharding}{value}>")


def _in_control_flow(ctx) -> bool:
  """Whether code runs in a function graph inside the step's graph (a tf.cond branch, a tf.while_loop body)."""
  return not tf.executing_eagerly() and tf.compat.v1.get_default_graph() is not ctx.graph


@dataclasses.dataclass
class _ControlFlowWrite:
  """A write of a replicated variable inside control flow, to check once the step's trace is complete."""

  name: str
  trainable: bool
  aggregation: tf.VariableAggregation
  axes: tuple[str, ...]  # the mesh axes along which its components must agree
  values: list[tf.Tensor]  # what it writes (a scatter's rows and indices)
  written: tf.Tensor  # the value its write op takes
  graph: tf.Graph  # the function graph (branch, loop body) it was traced in
  location: str  # where user code called the write, found as it was traced

  def where(self) -> str:
    """Where user code wrote: the write op's traceback, else the location found as it was traced.

    The op's traceback names the line in a helper function that AutoGraph
    converted (the innermost frame the trace saw is the step's call of it).
    """
    from replicator.core import _primitives  # pylint: disable=import-outside-toplevel  (imports this module)
    for op in self.written.consumers():
      if op.type.startswith(("Assign", "ResourceScatter")):
        where = _primitives.location_of(op)
        if where != "<unknown location>":
          return where
    return self.location


def check_control_flow_writes(analysis) -> None:
  """Refuses the step's writes inside control flow that could differ between replicas (``_check_after_trace``).

  Called once the step is traced: a loop's body is traced before the loop,
  so only then are its trip count and loop variables known. A write under a
  predicate or trip count that differs between replicas is one that differs
  (control dependence), even of a value that is the same everywhere.
  """
  from replicator.core import _primitives  # pylint: disable=import-outside-toplevel  (imports this module)
  for write in analysis.deferred:
    axes = set(write.axes)
    conditions = analysis.conditions(write.graph)
    for op, varying in conditions:
      if varying & axes and op.type in _CONSTRUCTS:
        construct, decider = _CONSTRUCTS[op.type]
        raise _errors.ReplicaInvarianceError(CONDITIONAL_WRITE.format(
            name=write.name, location=write.where(), construct=construct, condition=_primitives.location_of(op),
            decider=decider, axes=sorted(varying & axes)))
    varying = set()
    for value in write.values:
      varying |= analysis.varying(value)
    varying = sorted(varying & axes)
    if not varying:
      continue
    if write.trainable:
      raise _errors.ReplicaInvarianceError(UNREDUCED_UPDATE.format(name=write.name, axes=varying,
                                                                   location=write.where()))
    op = next((op for op, _ in conditions if op.type in _CONSTRUCTS), None)
    construct = _CONSTRUCTS[op.type][0] if op is not None else "a function"
    raise _errors.ReplicaInvarianceError(VARYING_IN_CONTROL_FLOW.format(
        name=write.name, aggregation=write.aggregation.name, location=write.where(), construct=construct,
        condition=_primitives.location_of(op) if op is not None else "<unknown location>", axes=varying))


SEED_STREAM_STRIDE = 1_000_003


def seed_offsets(name: str, value: tf.Tensor, n: int) -> list | None:
  """Per-replica offsets for a Keras random-seed state, so replicas draw different numbers.

  Keras 3 layers draw randomness (dropout, noise) from a ``SeedGenerator``
  whose state, an int ``[seed, counter]`` variable named
  ``seed_generator_state``, would otherwise be identical on every replica.
  Replica ``i`` gets seed ``seed + i * SEED_STREAM_STRIDE``: different
  streams per replica, the same streams on every run with the same seed.
  """
  if not name.endswith("seed_generator_state") or not value.dtype.is_integer or value.shape != (2,):
    return None
  return [tf.constant([i * SEED_STREAM_STRIDE, 0], value.dtype) for i in range(n)]


def single_stream(variable) -> None:
  """Makes a random-seed state that draws per replica (see :func:`seed_offsets`) draw one stream: every component
  holds the state without its offset from now on.

  For a program that runs once over the global batch (Keras's steps, ``_keras``): its draws must be one
  device's, the same state on every device. Does nothing to other variables.
  """
  if variable._offsets is None:  # pylint: disable=protected-access
    return
  with tf.init_scope():
    state = variable._components[0].read_value() - variable._offsets[0]  # pylint: disable=protected-access
    for component in variable._components:  # pylint: disable=protected-access
      component.assign(state)
  variable._offsets = None  # pylint: disable=protected-access


def share_stream(variable, axes: tuple[str, ...]) -> None:
  """Makes a random-seed state that draws per replica (see :func:`seed_offsets`) draw one stream along ``axes``:
  each replica takes the offset of the one at position 0 along ``axes`` with its other coordinates, its value
  moved by the difference (the replicas of a pipeline's stages, whose one step draws as one device).

  Streams along the other axes stay apart. Does nothing to other variables, or once done.
  """
  replicated = underlying(variable)
  if replicated is None or replicated._offsets is None:  # pylint: disable=protected-access
    return
  mesh = replicated._replicator.mesh  # pylint: disable=protected-access
  position = replicated._position  # pylint: disable=protected-access
  offsets = list(replicated._offsets)  # pylint: disable=protected-access
  moved = False
  with tf.init_scope():
    for r, k in position.items():
      root = mesh.index({**mesh.coords(r), **{a: 0 for a in axes}})
      if root == r or root not in position:
        continue
      shift = offsets[position[root]] - offsets[k]
      if bool(tf.reduce_any(shift != 0)):
        replicated._components[k].assign_add(shift)  # pylint: disable=protected-access
        offsets[k] = offsets[position[root]]
        moved = True
  if moved:
    replicated._offsets = offsets  # pylint: disable=protected-access


def placement_of(variable) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
  """``(axes, positions)`` of a variable held only by the replicas at ``positions`` along ``axes``, else None."""
  replicated = underlying(variable)
  return None if replicated is None else replicated.placement


def holds(variable, replica: int) -> bool:
  """Whether ``replica`` holds a component of ``variable`` (every replica does, unless it is placed)."""
  replicated = underlying(variable)
  return replicated is None or replicated.placement is None or replica in replicated._position  # pylint: disable=protected-access


def place(variable, axes: tuple[str, ...], positions) -> bool:
  """Places ``variable`` (:meth:`ReplicatedVariable.place`) and its optimizer slots made so far alike.

  Returns whether it moved.
  """
  replicated = underlying(variable)
  if replicated is None or not replicated.place(axes, positions):
    return False
  for other in variables_of(replicated._replicator):  # pylint: disable=protected-access
    if other._reference is replicated:  # pylint: disable=protected-access
      other.place(axes, positions)
  return True


def slot_reference(variable):
  """The variable ``variable`` was made like (an optimizer slot's variable), or None."""
  return variable._reference  # pylint: disable=protected-access  (this module's class)


def per_replica_by_design(variable) -> bool:
  """Whether each replica's copy of ``variable`` is its own value by design: on-read, or seeded apart."""
  return variable._on_read or variable._offsets is not None  # pylint: disable=protected-access


def written_in_pieces(variable) -> bool:
  """Whether a checkpoint holds ``variable`` as pieces each written by its process (split across processes)."""
  return read_by_every_process(variable) and not underlying(variable)._on_read  # (split, not a metric's parts)  # pylint: disable=protected-access


def own_pieces(variable) -> dict:
  """``{slice spec: value}`` of the pieces of ``variable`` (split across processes) that this process writes.

  A piece is written by the process of its first holder in the job (the
  lowest replica holding it). A slice spec is TensorFlow's: the global shape,
  then each dimension's ``start,length`` (``"8 4 0,4:0,4"``); a checkpoint's
  reader assembles a variable's pieces, written in several files, into its
  whole value.
  """
  v = underlying(variable)
  shape = v.shape.as_list()
  first = {}
  for replica in range(v._replicator.num_replicas):  # pylint: disable=protected-access
    first.setdefault(v.sharding.shard_index(replica), replica)
  pieces = {}
  for replica in sorted(first.values()):
    if replica in v._position:  # pylint: disable=protected-access
      begin, size = v.sharding.shard_slices(replica, shape)
      spec = " ".join(str(n) for n in shape) + " " + ":".join(f"{b},{n}" for b, n in zip(begin, size))
      with tf.init_scope():
        pieces[spec] = tf.identity(v._components[v._position[replica]].read_value())  # pylint: disable=protected-access
  return pieces


@contextlib.contextmanager
def pieces_written(variables):
  """While in it, each of ``variables`` (split across processes) saves as this process's pieces only."""
  variables = [underlying(v) for v in variables]
  try:
    for variable in variables:
      variable._pieces = own_pieces(variable)  # pylint: disable=protected-access
    yield
  finally:
    for variable in variables:
      variable._pieces = None  # pylint: disable=protected-access


@contextlib.contextmanager
def values_gathered(replicator, pieces: bool = False):
  """Reads, in every process of a multi-client job, the variables whose value needs every process; saves use them.

  A checkpoint is written by one process, but reading a variable split across
  processes (or a metric's parts) is a collective every process must join:
  every process calls this around the save, reads those variables here in
  creation order (the same in every process), and the writer's save takes
  the values read.
  """
  variables = [v for v in variables_of(replicator) if read_by_every_process(v)
               and not (pieces and written_in_pieces(v))]  # (with ``pieces``, those are written by their processes)
  try:
    for variable in variables:
      with tf.init_scope():
        variable._gathered = tf.identity(variable._aggregate())  # pylint: disable=protected-access
    yield
  finally:
    for variable in variables:
      variable._gathered = None  # pylint: disable=protected-access


def read_by_every_process(variable) -> bool:
  """Whether reading ``variable`` outside a step needs every process (pieces or parts in other processes)."""
  replicated = underlying(variable)
  if replicated is None or replicated._across is None:  # pylint: disable=protected-access
    return False
  return replicated._on_read or (replicated.sharding is not None and replicated._sources is None)  # pylint: disable=protected-access


def piece_sources(layout, replicas) -> tuple[int, ...] | None:
  """Per replica of the job, the position in ``replicas`` of one holding the same piece of a ``layout``.

  None if some piece is held by none of ``replicas`` (in a multi-client job, a
  variable sharded along an axis that crosses processes).
  """
  holder = {}
  for position, replica in enumerate(replicas):
    holder.setdefault(layout.shard_index(replica), position)
  sources = tuple(holder.get(layout.shard_index(r)) for r in range(layout.mesh.size))
  return None if None in sources else sources


def agreeing_groups(variable) -> list:
  """The groups of components (positions in ``variable.components``) that must be equal (its replicated axes).

  In a multi-client job, this process's members of each group.
  """
  position = variable._position  # pylint: disable=protected-access  (this module's class)
  groups = variable._replicator.mesh.groups(variable._replicated_axes())  # pylint: disable=protected-access
  found = [tuple(position[r] for r in group if r in position) for group in groups]
  return [group for group in found if group]  # (a placed variable: its stages' groups only)


def component_for(variable, replica: int) -> tf.Variable:
  """The component of ``variable`` that replica ``replica`` (an id in the whole job) holds."""
  return variable._components[variable._position[replica]]  # pylint: disable=protected-access


def layout_chosen_by(variable) -> str:
  """What chose ``variable``'s layout (a layouts key; its variable's, for a slot), as ``repl.explain`` says."""
  return variable._chosen_by  # pylint: disable=protected-access


def summed_on_read(variable) -> bool:
  """Whether ``variable``'s value is the sum of its components (on-read, ``SUM``): a metric's total or count."""
  return variable._on_read and variable.aggregation == tf.VariableAggregation.SUM  # pylint: disable=protected-access


def holds_the_sum(variable) -> bool:
  """Whether the on-read SUM ``variable``'s first component keeps a total written from outside a step: replica 0's
  (in a multi-client job, in that replica's process only), or a placed variable's first holder's."""
  return variable.replicas[0] == 0 or variable.placement is not None


def spread(value, variable) -> list:
  """Per-component values of the on-read ``variable`` whose aggregate should be ``value``.

  A sum's total lives on replica 0 (in a multi-client job, in that replica's process; the others' parts are 0), or
  on the first holder of a placed variable.
  """
  value = tf.convert_to_tensor(value, dtype=variable.dtype)
  n = len(variable.components)
  if variable.aggregation == tf.VariableAggregation.SUM:
    first = value if holds_the_sum(variable) else tf.zeros_like(value)
    return [first] + [tf.zeros_like(value)] * (n - 1)
  return [value] * n


tf.register_tensor_conversion_function(
    ReplicatedVariable,
    lambda v, dtype=None, name=None, as_ref=False: v._dense_var_to_tensor(dtype, name, as_ref))  # pylint: disable=protected-access


def _initial_value(initial_value, dtype, lifted: set | None = None):
  """The initial value, evaluated once, eagerly; or ``(None, tensor)`` for a value only the step can compute.

  A callable is called once. A tensor of the step graph is folded to a
  constant if it is one, else lifted out of the graph (``_lifting``); what
  depends on the step's data is returned as ``(None, tensor)``, to be
  assigned in the graph on the first run.
  """
  if callable(initial_value):
    initial_value = initial_value()
  if isinstance(initial_value, tf.Tensor) and tf.is_symbolic_tensor(initial_value):
    static = tf.get_static_value(initial_value)
    if static is not None:
      initial_value = static.astype(initial_value.dtype.as_numpy_dtype)
    else:
      value = _lifting.lift(initial_value, lifted)
      if value is None:
        return None, initial_value if dtype is None else tf.cast(initial_value, dtype)
      initial_value = value
  with tf.init_scope():  # an eager value, not a capture into the step graph
    return tf.convert_to_tensor(initial_value, dtype=dtype), None


def _reuse(ctx, path: str):
  """In a step: the variable an earlier replica created at this point (None: this replica creates it)."""
  index = ctx.creations
  ctx.creations += 1
  if index < len(ctx.created):
    first, first_path, variable = ctx.created[index]
    if first_path != path:
      raise _errors.VariableCreationError(OTHER_VARIABLE.format(
          replica=ctx.replica_id, path=path, index=index, first=first, first_path=first_path))
    return variable
  if not ctx.first:  # the first replica is traced first; it created fewer
    raise _errors.VariableCreationError(EXTRA_VARIABLE.format(
        replica=ctx.replica_id, path=path, index=index, first=0, count=len(ctx.created)))
  return None


def _initialize_in_graph(variable, value: tf.Tensor, sum_on_read: bool) -> None:
  """Assigns ``value`` (the step's) to every component the first time the step runs.

  As ``tf.function`` does for an initial value that depends on its inputs: a
  flag variable records that the first run initialised the variable; later
  runs skip the assignment. The step's later uses of the components are
  ordered after it (automatic control dependencies on their handles).
  """
  components = variable.components
  with tf.init_scope(), tf.device(components[0].device):
    flag = new_component(initial_value=False, trainable=False, name="initialized")
  variable._initialized = flag  # pylint: disable=protected-access  (kept alive with the variable)
  _OWNERS[id(flag.handle)] = variable
  if variable.sharding is not None:
    pieces = variable._local(mesh_lib.split(value, variable.sharding))  # pylint: disable=protected-access
  else:
    pieces = [value] + [tf.zeros_like(value) if sum_on_read else value] * (len(components) - 1)

  def initialize():
    assignments = []
    for component, piece in zip(components, pieces):
      with tf.device(component.device):
        assignments.append(component.assign(piece, read_value=False))
    with tf.control_dependencies(assignments):
      return tf.identity(flag.assign(True))

  with tf.name_scope(INITIALIZE_SCOPE):  # kept ordered before every replica's uses (see views/_local_step)
    tf.cond(flag.read_value(), lambda: tf.constant(True), initialize)


def variable_path(name: str) -> str:
  """``"dense_1/kernel"``: the current name scope (without the replica's) and ``name``."""
  scope = _REPLICA_SCOPE.sub("", tf.get_current_name_scope()).strip("/")
  name = name.split(":")[0]
  return f"{scope}/{name}" if scope and not name.startswith(scope + "/") else name


def _choose_layout(layouts, mesh, path: str, shape: tf.TensorShape, reference) -> mesh_lib.Layout | None:
  """The layout of a new variable: its reference's (optimizer slots), else the LayoutMap's."""
  reference = underlying(reference) if reference is not None else None
  if reference is not None:
    if reference.sharding is not None and shape == reference.shape:
      return reference.sharding
    return None
  spec = layouts.spec(path)
  if spec is None:
    return None
  spec = layouts.spec_for(tuple(spec), shape.rank)  # (pad=True maps)
  try:
    layout = mesh_lib.Layout(spec, mesh)
  except mesh_lib.LayoutError as e:  # an unknown or repeated axis: say which variable's layout it is
    raise mesh_lib.LayoutError(f"The layout of variable {path!r} (shape {shape.as_list()}): {e}") from None
  layout.check(shape.as_list(), what=f"variable {path!r}")
  return None if layout.is_fully_replicated else layout


def _chosen_by(layouts, path: str, reference) -> str:
  """What chose a new variable's layout, as ``repl.explain`` shows it."""
  reference = underlying(reference) if reference is not None else None
  if reference is not None:
    return f"as {reference.name.split(':')[0]} (a slot)"
  key = layouts.chosen_key(path)
  if key is not None:
    return f"key {key!r}"
  return "no key matched" if layouts.map is not None else "no layouts"


def variables_of(replicator) -> list:
  """Every live ReplicatedVariable of ``replicator``, once each."""
  found = {id(v): v for v in list(_OWNERS.values()) if v._replicator is replicator}  # pylint: disable=protected-access
  return list(found.values())


def owner_of(handle):
  """The ReplicatedVariable whose component (or first-run flag) has ``handle``, or None."""
  return _OWNERS.get(id(handle))


SHARDED_HANDLE = (
    "The handle of the sharded variable {name!r} (layout {spec}) was asked for in {where} outside any Replicator "
    "step (a GradientTape's gradient, or tape.watch): outside a step a sharded variable is one device's whole "
    "value assembled from its pieces, which has no handle, so no gradient can be taken for it there. Fix: run the "
    "training step as the Replicator's, `repl.run(step_fn, dataset)` (the global view partitions the step by the "
    "layouts; after replicator.enable_keras_distribution(), `repl = replicator.distribution_replicator()`), with "
    "step_fn taking one batch (a tf.function works unchanged inside it), or train with model.fit."
)


RESTORE_MISMATCH = (
    "Restoring the checkpoint into {name!r}: it holds a {found_dtype} tensor of shape {found_shape}, and the "
    "variable is {dtype} of shape {shape}. The restore stopped there, and {undone}: a failed restore changes none "
    "of the Replicator's variables. Fix: restore into a model built like the checkpoint's (the same layers and "
    "sizes), or restore only the objects that match (tf.train.Checkpoint of those objects)."
)


SAVE_DIVERGED = (
    "Saving {name!r}: its copies differ between replicas since a step failed at run time ({error}) (replica {a} "
    "vs replica {b}), so a checkpoint would store one replica's copy as if it were the value. Fix: restore the last "
    "checkpoint, or assign the variable from outside a step, before saving (Replicator(atomic=True), the "
    "default, leaves no such state)."
)


def _restoring() -> bool:
  """Whether a checkpoint restore is asking (it serializes a variable to learn what to restore: the way back).

  Told by the caller's frames: TensorFlow's restore (``tensorflow/python/checkpoint/restore.py``, TF 2.21) builds
  its saveables from ``_serialize_to_tensors`` too, and no API says which of save or restore calls.
  """
  frame = sys._getframe(1)  # pylint: disable=protected-access
  for _ in range(30):
    if frame is None:
      return False
    if frame.f_code.co_filename.replace("\\", "/").endswith("checkpoint/restore.py"):
      return True
    frame = frame.f_back
  return False


def _refuse_diverged(variable) -> None:
  """Refuses to save ``variable`` while a failed step (``atomic=False``) has left its copies different."""
  state = variable._run_state  # pylint: disable=protected-access  (this module's class)
  diverged = None if state is None else state.diverged
  if diverged is None or not tf.executing_eagerly() or _restoring():
    return
  written, error = diverged
  for name, a, b in written.diverged(only=variable):  # this variable's copies only: a save asks for each
    raise _errors.ReplicasDivergedError(SAVE_DIVERGED.format(name=name, error=error, a=a, b=b), [(name, a, b)])


def component_of(handle) -> tf.Variable | None:
  """The component (or first-run flag) of a variable the Replicator made whose handle is ``handle``, or None."""
  variable = _OWNERS.get(id(handle))
  if variable is None:
    return None
  flag = getattr(variable, "_initialized", None)
  for component in variable.components + ((flag,) if flag is not None else ()):
    if component.handle is handle:
      return component
  return None


def is_replicated_handle(handle) -> bool:
  """Whether ``handle`` is a component's (or its first-run flag's) of a variable the Replicator made."""
  return id(handle) in _OWNERS


def variable_of(handle):
  """The ``tf.Variable`` whose handle is ``handle`` (found among the objects referring to it), or None."""
  for referrer in gc.get_referrers(handle):
    owners = gc.get_referrers(referrer) if isinstance(referrer, dict) else [referrer]
    for owner in owners:
      if isinstance(owner, tf.Variable) and getattr(owner, "handle", None) is handle:
        return owner
  return None


def read_axes(handle, all_axes: frozenset[str]) -> frozenset[str]:
  """The mesh axes along which reads of the variable behind a captured ``handle`` differ between replicas.

  A replicated variable's components are equal (none), a sharded one's
  pieces differ along the axes it is sharded on, an on-read variable's or a
  random-seed state's components are each replica's own (every axis). A
  variable the Replicator does not know (created outside it) is one
  variable: none.
  """
  variable = _OWNERS.get(id(handle))
  if variable is None:
    return frozenset()
  if variable._on_read or variable._offsets is not None:  # pylint: disable=protected-access
    return all_axes
  if variable.placement is not None:  # (read on its stages' replicas only: a stage's value)
    return frozenset(variable.placement[0]) & all_axes
  if variable.sharding is not None:
    return frozenset(variable.sharding.sharded_axes) & all_axes
  return frozenset()


def bytes_per_device(variables) -> dict[str, int]:
  """Bytes of variable storage resident on each device.

  Counts, for each variable, the components (or, for ordinary variables, the
  variable) where their buffers live: a replicated variable costs its full
  size on every device, a variable sharded k ways 1/k of it.

  Args:
    variables: variables (``tf.Variable``, Keras variables), e.g.
      ``model.variables + optimizer.variables``.

  Returns:
    Device name to bytes.
  """
  totals: dict[str, int] = {}
  seen = set()
  for variable in variables:
    replicated = underlying(variable)
    # A Keras 3 variable made outside a Replicator wraps a tf.Variable (its own dtype is a string).
    inner = getattr(variable, "value", None)
    parts = replicated.components if replicated is not None else (
        (inner if isinstance(inner, tf.Variable) else variable),)
    for part in parts:
      if id(part) in seen:
        continue
      seen.add(id(part))
      device = mesh_lib.canonical_name(part.handle.device)
      totals[device] = totals.get(device, 0) + part.shape.num_elements() * part.dtype.size
  return totals


def make_creator(replicator, config, layouts, state=None):
  """A ``tf.variable_creator_scope`` creator that replicates every new variable.

  ``layouts`` (a ``_layout_state.LayoutState``) gives each new variable its layout; ``config`` its random streams;
  ``state`` (the Replicator's ``_run_state.RunState``) says when a failed step left its copies different.
  """
  _component_class()  # probe eagerly now, not later inside a trace

  def creator(next_creator, **kwargs):
    if _is_creating() or kwargs.get("variable_def") is not None:
      return next_creator(**kwargs)
    name = kwargs.get("name") or "Variable"
    path = variable_path(name)
    ctx = _context.current_context()
    step = ctx if ctx is not None and ctx.replicator is replicator and ctx.created is not None else None
    if step is not None:
      existing = _reuse(step, path)
      if existing is not None:
        return existing
    replicas = config.local_replicas  # this process's
    initial_value = kwargs.pop("initial_value")
    reference = _current_reference()
    placement = None if reference is None or underlying(reference) is None else underlying(reference).placement
    if placement is not None:  # a slot of a variable on some stages only: on the same replicas
      replicas = underlying(reference).replicas
    devices = [replicator.devices[r] for r in replicas]
    deferred = None  # an initial value only the step computes: assigned on its first run
    if isinstance(initial_value, tf.Tensor) and tf.is_symbolic_tensor(initial_value):
      value, deferred = _initial_value(initial_value, kwargs.get("dtype"), None if step is None else step.lifted)
      if deferred is not None and not deferred.shape.is_fully_defined():
        raise _errors.VariableCreationError(SYMBOLIC_INITIAL_VALUE.format(
            name=name, value=deferred, shape=deferred.shape))
    with tf.init_scope(), _context.cross_replica_scope():
      with tf.device(devices[0]):  # the global value, computed once
        if deferred is not None:
          value = tf.zeros(deferred.shape, deferred.dtype)  # until the first run assigns it
        elif not (isinstance(initial_value, tf.Tensor) and tf.is_symbolic_tensor(initial_value)):
          value, _ = _initial_value(initial_value, kwargs.get("dtype"))
        if config.agree is not None:  # a multi-client job: every process starts from worker 0's value
          value = config.agree(value)
      kwargs["dtype"] = value.dtype
      on_read = kwargs.get("synchronization") == tf.VariableSynchronization.ON_READ
      layout = _choose_layout(layouts, replicator.mesh, path, value.shape, reference)
      if layout is not None and on_read:
        raise _errors.VariableCreationError(SHARDED_ON_READ.format(name=path, spec=layout.spec))
      if layout is not None and kwargs.get("shape") is not None and not tf.TensorShape(kwargs["shape"]).is_fully_defined():
        raise _errors.VariableCreationError(SHARDED_UNKNOWN_SHAPE.format(name=path, spec=layout.spec,
                                                                         shape=tf.TensorShape(kwargs["shape"])))
      sum_on_read = on_read and kwargs.get("aggregation") == tf.VariableAggregation.SUM
      # The global view runs one program: one random stream, drawn at global shapes and sliced.
      offsets = None if config.view == "global" else seed_offsets(name, value, replicator.num_replicas)
      if offsets is not None:
        offsets = [offsets[r] for r in replicas]
      if layout is not None:
        with tf.device(devices[0]):  # slice where the value is; copy only the pieces
          pieces = mesh_lib.split(value, layout)
      components = []
      for i, (replica, device) in enumerate(zip(replicas, devices)):
        with tf.device(device):  # an on-read SUM variable starts with its total on replica 0
          initial = pieces[replica] if layout is not None else value
          if sum_on_read and replica != (replicas[0] if placement is not None else 0):
            initial = tf.zeros_like(value)
          if offsets is not None:
            initial = initial + offsets[i]
          components.append(new_component(initial_value=initial, **kwargs))
    variable = ReplicatedVariable(components, replicator, offsets, layout, replicas)
    variable._placement = placement  # pylint: disable=protected-access
    variable._run_state = state  # pylint: disable=protected-access
    if config.agree is not None:  # a read that needs other processes' parts (a metric's, a piece's) sums them
      variable._across = config.agree.total  # pylint: disable=protected-access
    variable._chosen_by = _chosen_by(layouts, path, reference)  # pylint: disable=protected-access
    variable._reference = None if reference is None else underlying(reference)  # pylint: disable=protected-access
    if deferred is not None:
      _initialize_in_graph(variable, deferred, sum_on_read)
    if step is not None:
      step.created.append((step.replica_id, path, variable))
    return variable

  return creator
