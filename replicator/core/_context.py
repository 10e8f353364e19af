"""The replica context: which replica of which Replicator is being built."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any

import tensorflow as tf


@dataclasses.dataclass
class ReplicaContext:
  """State of one replica's trace.

  Attributes:
    replicator: the Replicator whose step is being built.
    replica_id: the replica being traced.
    device: its device.
    graph: the step graph; collectives must be called directly in it.
    placeholders: placeholders recorded so far, in call order.
    calls: number of primitive calls so far (one call may hold several tensors).
    gradient_names: custom-gradient registrations made while tracing (released after).
    accumulating: gradient-accumulating optimizers this step uses.
    created: variables the step created, in creation order, shared by the
      replicas of one trace: the first replica to create the k-th variable
      creates it, the others get the same variable.
    creations: variables this replica's trace has asked for so far.
    lifted: names of step-graph ops that computed initial values lifted out
      of the step (left out of the rewritten graph).
    analysis: which mesh axes the trace's values vary along, shared by the
      replicas of one trace (``_invariance``).
    batch_axes: the Replicator's batch axes (``Config.batch_axes``; None: none).
    first: whether this is the first replica of the trace (replica 0, or in a
      multi-client job this process's first).
    shared: what the replicas of one trace find once and share, by key (a
      pipeline's stages' output shapes); None: nothing is shared.
    stage_writes: while a pipeline's stage runs (on its own devices only),
      ``(variable, method, value)`` of each write of a variable every replica
      holds alike along ``stage_axes``, which the pipeline makes once a step
      (not written there); None: not in a stage.
    stage_axes: the axes of the pipeline whose stage is running.
    microbatch: while a pipeline's stage runs, ``(start, stop, rows)``: the
      rows of the replica's batch its microbatch holds; None: not in a stage.
  """

  replicator: Any
  replica_id: int
  device: str
  graph: tf.Graph
  placeholders: list = dataclasses.field(default_factory=list)
  calls: int = 0
  gradient_names: list = dataclasses.field(default_factory=list)
  accumulating: set = dataclasses.field(default_factory=set)
  created: list | None = None
  creations: int = 0
  lifted: set | None = None
  analysis: Any = None  # _invariance.Analysis of this trace (None: writes are not checked)
  batch_axes: tuple[str, ...] | None = None
  first: bool = True
  shared: dict | None = None
  stage_writes: list | None = None
  stage_axes: tuple[str, ...] = ()
  microbatch: tuple | None = None


_state = threading.local()


def _stack() -> list[ReplicaContext]:
  if not hasattr(_state, "stack"):
    _state.stack = []
  return _state.stack


@contextlib.contextmanager
def recording_writes(axes: tuple[str, ...]):
  """Collects ``(variable, method)`` of each write, made outside a replica while entered, of a variable whose
  replicas along ``axes`` hold it alike (and keep it so: not each replica's own, as a seed state or a metric is).

  For code tracing what others will run (a pipeline traces its stages once for their shapes, and learns which
  state each stage writes, the same on every replica): the variables note their writes (:func:`note_write`).
  """
  saved = getattr(_state, "writes", None)
  _state.writes = (tuple(axes), found := [])
  try:
    yield found
  finally:
    _state.writes = saved


def note_write(variable, method: str, alike: tuple[str, ...]) -> None:
  """Notes a write for :func:`recording_writes`, if one is entered: of ``variable``, held alike along ``alike``."""
  recording = getattr(_state, "writes", None)
  if recording is not None and set(recording[0]) <= set(alike):
    recording[1].append((variable, method))


@contextlib.contextmanager
def recording_reads():
  """Collects each variable read (or differentiated) while entered, outside a replica: the variables note their
  reads (:func:`note_read`). A pipeline traces its stages once for their shapes, and learns so which variables each
  stage reads, the same on every replica."""
  saved = getattr(_state, "reads", None)
  _state.reads = found = []
  try:
    yield found
  finally:
    _state.reads = saved


def note_read(variable) -> None:
  """Notes a read of ``variable`` for :func:`recording_reads`, if one is entered."""
  recording = getattr(_state, "reads", None)
  if recording is not None:
    recording.append(variable)


def current_context() -> ReplicaContext | None:
  """The innermost replica context of this thread, or None."""
  stack = _stack()
  return stack[-1] if stack else None


@contextlib.contextmanager
def replica_scope(ctx: ReplicaContext):
  """Makes ``ctx`` the current replica context."""
  stack = _stack()
  stack.append(ctx)
  try:
    yield ctx
  finally:
    stack.pop()


@contextlib.contextmanager
def cross_replica_scope():
  """Hides any replica context (used when creating variables eagerly)."""
  stack = _stack()
  saved = list(stack)
  del stack[:]
  try:
    yield
  finally:
    stack[:] = saved


@dataclasses.dataclass
class GlobalTrace:
  """A global-view step being traced: variables present global-shaped stand-ins.

  Attributes:
    replicator: the Replicator whose step is traced.
    standins: id(ReplicatedVariable) -> its global-shaped stand-in variable.
    owners: id(stand-in handle) -> the ReplicatedVariable.
    accumulating: wrapped optimizers that accumulated gradients in the step
      (``wrap_optimizer(accumulation_steps=k)``), in order.
    pinned: ``(identity op, spec, location)`` of each layout the step states
      (``repl.with_layout``, a Keras ``LayoutMap`` key for a layer's output).
  """

  replicator: Any
  standins: dict = dataclasses.field(default_factory=dict)
  owners: dict = dataclasses.field(default_factory=dict)
  accumulating: list = dataclasses.field(default_factory=list)
  pinned: list = dataclasses.field(default_factory=list)


def current_global_trace() -> GlobalTrace | None:
  """The global-view trace under way on this thread, or None."""
  return getattr(_state, "global_trace", None)


@contextlib.contextmanager
def global_trace_scope(trace: GlobalTrace):
  """Makes ``trace`` the global-view trace under way."""
  saved = current_global_trace()
  _state.global_trace = trace
  try:
    yield trace
  finally:
    _state.global_trace = saved


_TRACE_HOOKS: list = []  # callables (replicator) -> context manager, entered around each global-view trace


def add_trace_hook(hook) -> None:
  """Enters ``hook(replicator)`` (a context manager) around every global-view trace from now on.

  For integrations above the views (Keras's layer-output layouts) that must act while a step is traced:
  the views call them without importing them.
  """
  if hook not in _TRACE_HOOKS:
    _TRACE_HOOKS.append(hook)


@contextlib.contextmanager
def trace_hooks(replicator):
  """Every hook of :func:`add_trace_hook`, entered for ``replicator``'s trace."""
  with contextlib.ExitStack() as stack:
    for hook in list(_TRACE_HOOKS):
      stack.enter_context(hook(replicator))
    yield


def current():
  """Returns the Replicator whose step is being built, or None outside a step.

  Library code (a layer that needs to communicate, say) uses it to find the
  collectives to call:

  Examples:
    >>> replicator.current() is None  # not inside repl.run
    True
  """
  ctx = current_context()
  return None if ctx is None else ctx.replicator


def no_autograph(cls):
  """Class decorator: AutoGraph runs this class's public methods as written.

  ``step_fn`` is converted with AutoGraph (as ``tf.function`` does), and
  AutoGraph converts every function it calls unless told not to. Library
  methods need no conversion; converting them costs build time and re-reads
  their source.
  """
  for name, value in list(vars(cls).items()):
    if callable(value) and not name.startswith("__") and not isinstance(value, type):
      setattr(cls, name, tf.autograph.experimental.do_not_convert(value))
  return cls
