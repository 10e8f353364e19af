"""Keras's trainer on a Replicator: ``model.fit``, ``evaluate`` and ``predict`` across the replicas.

Keras 3's TensorFlow trainer runs each step through the
``tf.distribute.Strategy`` that was current when the model was created:
``strategy.experimental_distribute_dataset`` for its data and
``strategy.run(train_step, args=(batch,))`` inside its own ``tf.function``.
``repl.context()`` makes :class:`KerasStrategy` current, so a model built
there is trained by the Replicator:

* its datasets stay datasets of global batches (Keras batches them globally);
* ``strategy.run`` splits each global batch across the replicas (as
  ``repl.distribute_dataset`` does, in the graph), builds the step through
  the same trace -> plan -> rewrite pipeline as ``repl.run`` (cached per step
  function and input signature) and imports the rewritten step into Keras's
  function, where Keras's loop (``steps_per_execution``), callbacks,
  validation and progress bar run as usual;
* gradients: Keras's optimizers sum gradients over the replica context
  themselves; in a step run for Keras each replica's gradient of its mean
  loss is weighted by its share of the global batch before that sum, which
  gives one device's gradient of the global mean loss (also for a last,
  uneven batch), as ``wrap_optimizer`` does;
* metrics: Keras's metric variables add up their state (``aggregation``
  SUM), which the Replicator combines across replicas on write, so every
  replica's result is the global one; ``train_step``/``test_step`` results
  are returned once, ``predict``'s outputs concatenated in batch order.

A model with sharded variables needs the global view
(``Replicator(view="global")``): there ``strategy.run`` traces Keras's step
once at the global batch's shapes and partitions it by the layouts, as
``repl.run`` does for a global-view step; its outputs are already global. A
batch of unknown size (a dataset batched without ``drop_remainder``, arrays
whose rows ``batch_size`` does not divide, ``predict`` on fewer rows) is
taken whole by every device: the variables stay split, the batch is not.

The strategy is TensorFlow's default strategy with these overrides (its
class is taken from the default strategy object, no private import). Outside
Keras's trainer, ``strategy.run`` raises: custom loops call ``repl.run``.

TensorFlow coupling, in this module only: the overrides are
``tf.distribute.StrategyExtended``'s protected hooks (``_scope``,
``_create_variable``, ``_update``, ``_use_merge_call``, ...), the interface
TensorFlow's own strategies implement; which Keras frames call
``strategy.run`` (``KERAS_CALLERS``) and the name of Keras's gradient sum
(``_tf_distribute``) are Keras's. Checked on TensorFlow 2.21 and Keras 3.15;
tests/test_keras.py fails if either changes.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
import weakref

import tensorflow as tf
import tree

from replicator import _context
from replicator import _distributed_dataset
from replicator import _errors
from replicator import _inputs
from replicator import _primitives
from replicator import _tf_distribute
from replicator import _variables

RUN_OUTSIDE_KERAS = (
    "The tf.distribute.Strategy that repl.context() presents is there for Keras's trainer "
    "(model.fit, evaluate, predict); strategy.run({name}) from other code is not supported. "
    "Fix: call repl.run(step_fn, ...) for a custom training loop."
)
MODEL_OUTSIDE = (
    "Keras's trainer (model.fit) outside any Replicator step updates a variable through an optimizer made in "
    "repl.context(): the model was created outside the context (or compiled outside it), so Keras "
    "trains it on one device and its variables are not the Replicator's. Fix: create and compile the "
    "model inside `with repl.context():`."
)
FOREIGN_MODEL = (
    "model.fit of a model whose variables are not this Replicator's: it was made before `with repl.context():` "
    "(or before the Keras distribution was set, after replicator.enable_keras_distribution()), so its variables "
    "are one device's, and TensorFlow's current strategy is the Replicator's. Fix: make and compile the model "
    "inside the context (or while the distribution is set); to train it on one device, call fit outside them "
    "(keras.distribution.set_distribution(None))."
)
SHARDED_MODEL = (
    "model.{what} of a model with sharded variables ({name!r} has layout {spec}) is not supported: "
    "Keras's step is written for whole variables, and in the local view a step reads each device's "
    "piece. Fix: make the Replicator with view=\"global\" (it partitions Keras's unchanged step by the "
    "layouts; fit then takes a tf.data.Dataset batched with drop_remainder=True), or leave the model's "
    "variables replicated (no layouts)."
)
PER_REPLICA_FIT = (
    "model.{what} in a global-view Replicator: Keras traced its step with batches of unknown size (NumPy arrays "
    "whose rows batch_size does not divide, or a dataset batched without drop_remainder=True), which the global "
    "view cannot trace at static global shapes; with no variable split, the step runs data-parallel per replica "
    "instead. The results equal one device's except for random ops: each replica draws its own stream, so a "
    "Dropout mask differs from one device's. Fix, for results equal to one device: pass a tf.data.Dataset batched "
    "with drop_remainder=True, or arrays whose rows batch_size divides."
)
ACCUMULATING = (
    "An optimizer wrapped with accumulation_steps > 1 is used by a Keras train_step run by "
    "model.fit: not supported. Fix: use keras.optimizers.Optimizer(gradient_accumulation_steps=...) "
    "in fit, or repl.run for a custom loop with accumulation.")
JIT_COMPILE = (
    "model.fit/evaluate with jit_compile=True is not supported for a model made in repl.context(): "
    "XLA would compile Keras's step function around the Replicator's collectives, which run between "
    "devices outside any one XLA program. Fix: compile with jit_compile=False."
)
RUN_EAGERLY = (
    "model.{what} with run_eagerly=True is not supported for a model made in repl.context(): the "
    "Replicator builds each step as one graph for all replicas. Fix: compile with run_eagerly=False "
    "(the default); to debug a step, run it with repl.run and print inside it with tf.print."
)
# Where Keras 3's TensorFlow trainer calls strategy.run (keras/src/backend/tensorflow/trainer.py, 3.15).
KERAS_CALLERS = ("one_step_on_data", "one_step_on_data_distributed")
KERAS_STEPS = ("train_step", "test_step")  # their results are one value (metrics); other steps: per example


def _extended_class():
  """The default strategy's extended class with the Replicator's overrides (made once)."""
  base = type(_tf_distribute.default_strategy().extended)

  class Extended(base):  # pylint: disable=abstract-method
    """Cross-replica behaviour of :class:`KerasStrategy` (see the module docstring)."""

    def __init__(self, container_strategy, replicator):
      super().__init__(container_strategy)
      self._replicator_ref = weakref.ref(replicator)

    @property
    def replicator(self):
      return self._replicator_ref()

    def _scope(self, strategy):
      # A strategy's own scope (cross-replica mode, variables made by
      # _create_variable), not the default strategy's no-op one.
      return tf.distribute.StrategyExtended._scope(self, strategy)  # pylint: disable=protected-access

    def _create_variable(self, next_creator, **kwargs):
      kwargs.pop("distribute_strategy", None)  # added by the strategy's scope (with use_resource)
      kwargs.pop("use_resource", None)
      return self.replicator._creator(next_creator, **kwargs)  # pylint: disable=protected-access

    @property
    def _num_replicas_in_sync(self):
      if _context.current_global_trace() is not None:
        # A global-view step is one program on the global batch: one replica, whose loss Keras must not divide
        # by the batch replicas (scale_loss_for_distribution, when fit runs in the strategy's scope).
        return 1
      return _tf_distribute.batch_replicas(self.replicator)[0]

    def colocate_vars_with(self, colocate_with_variable):
      # Keras optimizers made in repl.context() place slots through their strategy, also inside
      # repl.run steps (outside this strategy's scope). The Replicator's variable creator places
      # every component on its own device, so no colocation is needed. In the global view the
      # optimizer is a plain one: its slots take their variable's layout here.
      if self.replicator._view == "global":  # pylint: disable=protected-access
        return _variables.reference_scope(colocate_with_variable)
      return contextlib.nullcontext()

    def _update(self, var, fn, args, kwargs, group):
      if (_context.current_context() is None and _context.current_global_trace() is None
          and not tf.executing_eagerly() and _tf_distribute.called_by(KERAS_CALLERS, depth=40)):  # Keras's trainer, on one device
        raise _errors.UnsupportedError(MODEL_OUTSIDE)
      return super()._update(var, fn, args, kwargs, group)

    def _use_merge_call(self):
      return False  # Keras's optimizers then update each variable directly

    def _call_for_each_replica(self, fn, args, kwargs):
      raise _errors.UnsupportedError(RUN_OUTSIDE_KERAS.format(name=getattr(fn, "__name__", "fn")))

  return Extended


_EXTENDED = None


class KerasStrategy(tf.distribute.Strategy):
  """The ``tf.distribute.Strategy`` a Replicator presents to Keras's trainer (``repl.context()``)."""

  def __init__(self, replicator):
    global _EXTENDED
    if _EXTENDED is None:
      _EXTENDED = _extended_class()
    super().__init__(_EXTENDED(self, replicator))

  def run(self, fn, args=(), kwargs=None, options=None):  # pylint: disable=unused-argument
    replicator = self.extended.replicator
    if kwargs or len(args) != 1 or not _tf_distribute.called_by(KERAS_CALLERS):
      raise _errors.UnsupportedError(RUN_OUTSIDE_KERAS.format(name=getattr(fn, "__name__", "fn")))
    if tf.executing_eagerly():
      what = "predict" if getattr(fn, "__name__", "") not in KERAS_STEPS else "fit/evaluate"
      raise _errors.UnsupportedError(RUN_EAGERLY.format(what=what))
    model = _model_of(fn)
    if getattr(model, "jit_compile", False) is True:
      raise _errors.UnsupportedError(JIT_COMPILE)
    what = "fit/evaluate" if getattr(fn, "__name__", "") in KERAS_STEPS else "predict"
    variables = getattr(model, "variables", None) or ()
    if (getattr(fn, "__name__", "") == "train_step" and variables
        and all(_variables.underlying(v) is None for v in variables)):
      raise _errors.UnsupportedError(FOREIGN_MODEL)
    for variable in variables:
      layout = _variables.layout_of(variable)
      if layout is None:
        continue
      if replicator._view != "global":  # pylint: disable=protected-access
        raise _errors.UnsupportedError(SHARDED_MODEL.format(what=what, name=variable.path, spec=layout.spec))
      _restore_on_failure(replicator, model, fn)
      return run_global(replicator, fn, args[0])
    if replicator._view == "global":  # pylint: disable=protected-access
      if _static(args[0]):  # one program at global shapes, as for a split model: Dropout draws as on one device
        _restore_on_failure(replicator, model, fn)
        return run_global(replicator, fn, args[0])
      _warn_per_replica_draws(model, what)
    return run_in_graph(replicator, fn, args[0])


_FUNCTIONS = {"train_step": "train_function", "test_step": "test_function"}  # predict writes no variable


def _restore_on_failure(replicator, model, fn) -> None:
  """Makes the Keras function that calls ``fn`` (fit's, evaluate's) write back what a failed call of it wrote.

  The global view's steps keep the values they write (``Replicator(atomic=
  True)``), but a step in Keras's ``tf.function`` fails in Keras's call, where
  ``repl.run`` cannot restore them. Keras calls its function through the
  model's attribute (``model.train_function(iterator)``) on every batch, so
  the attribute is wrapped: a failed call writes the kept values back before
  the error leaves it. This runs while Keras traces its function, inside its
  first call: a failure of that call is undone at the start of the next step
  instead (``_atomic.Snapshot._keep``).
  """
  name = _FUNCTIONS.get(getattr(fn, "__name__", ""))
  function = getattr(model, name, None) if name is not None and replicator._atomic else None  # pylint: disable=protected-access
  if function is None or getattr(function, "_replicator_restores", False):
    return

  @functools.wraps(function)
  def restoring(*args, **kwargs):
    try:
      return function(*args, **kwargs)
    except tf.errors.OpError as e:
      if not isinstance(e, tf.errors.OutOfRangeError):  # the end of the data: nothing ran
        for step in replicator._global_steps.values():  # pylint: disable=protected-access
          for variants in step.values():
            for variant in variants.values():
              if variant.snapshot is not None:
                variant.snapshot.restore()
      raise

  restoring._replicator_restores = True  # pylint: disable=protected-access
  setattr(model, name, restoring)


def _static(data) -> bool:
  """Whether every tensor of a batch has a static shape (the global view traces at static shapes)."""
  leaves = tree.flatten(data)
  return bool(leaves) and all(isinstance(t, tf.Tensor) and t.shape.is_fully_defined() for t in leaves)


def _warn_per_replica_draws(model, what: str) -> None:
  """Warns (once per model that draws random numbers) that a step of batches of unknown size runs per replica."""
  if getattr(model, "_replicator_warned_dynamic", False):
    return
  if not any("seed_generator" in getattr(v, "path", "") for v in getattr(model, "variables", None) or ()):
    return  # nothing drawn at random (Keras layers that draw own a SeedGenerator's state): equal to one device
  model._replicator_warned_dynamic = True  # pylint: disable=protected-access
  warnings.warn(PER_REPLICA_FIT.format(what=what), stacklevel=_primitives.user_stacklevel())


def _model_of(fn):
  """The Keras model whose step ``fn`` is: ``train_step``'s object, or predict's closure's ``self``."""
  model = getattr(fn, "__self__", None)
  inner = fn
  for _ in range(4):  # decorators (functools.wraps) and a tf.function (jit_compile) around Keras's function
    if model is not None or not callable(inner):
      break
    inner = inspect.unwrap(getattr(inner, "python_function", inner))
    if inspect.isfunction(inner):
      model = inspect.getclosurevars(inner).nonlocals.get("self")
  return model


class GlobalBatch(_inputs.Source):
  """A step's input given as one global batch in the calling graph, split across the input pipelines."""

  def __init__(self, data, pipelines):
    self._structure = data
    leaves = tree.flatten(data)
    self._present = [leaf is not None for leaf in leaves]
    tensors = [leaf for leaf in leaves if leaf is not None]
    self._n = n = max(pipelines) + 1
    self.slots = tuple(pipelines)
    even = _distributed_dataset._even_parts([t.shape for t in tensors], n)  # pylint: disable=protected-access
    specs = [_distributed_dataset._replica_spec(tf.TensorSpec(t.shape, t.dtype), n if even else None)  # pylint: disable=protected-access
             for t in tensors]
    self.element_specs = tuple(specs) * n
    self.counts = (len(specs),) * n
    self.structures = (data,) * n
    self.key = ("keras", tuple(specs), str(tree.map_structure(lambda _: 0, data)))

  def step_args(self, replica, flat_elements):
    slot = self.slots[replica]
    start = slot * self.counts[0]
    tensors = iter(flat_elements[start:start + self.counts[0]])
    leaves = [next(tensors) if present else None for present in self._present]
    return (tree.unflatten_as(self._structure, leaves),)

  def fetch(self, flat_args):
    parts = _distributed_dataset.split(list(flat_args), self._n)
    return [t for part in parts for t in part]


def _weighted(replicator):
  """Wraps a step so each replica's gradients are weighted by its share of the global batch."""

  def wrap(fn):
    def step(data):
      ctx = _context.current_context()
      rows = next((tf.shape(t)[0] for t in tree.flatten(data) if t is not None and t.shape.rank), None)
      if rows is not None:
        axes = _tf_distribute.batch_replicas(replicator)[1]
        rows = tf.cast(rows, tf.float32)
        total = _primitives.all_reduce(ctx, rows, "sum", axes, "Keras step (rows per replica)") if axes else rows
        ctx.gradient_weight = tf.math.divide_no_nan(rows, total)
      return fn(data)

    return step

  return wrap


def run_in_graph(replicator, fn, data):
  """Builds (or reuses) the replicated step of Keras's ``fn`` and imports it into the current graph."""
  pipelines = [replicator.input_pipeline(r) for r in range(replicator.num_replicas)]
  source = GlobalBatch(data, pipelines)
  step = replicator._compiled_keras(fn, source, _weighted(replicator))  # pylint: disable=protected-access
  tensors = [t for t in tree.flatten(data) if t is not None]
  # Keras's own tf.function runs this step: a failure surfaces from its call, where nothing is restored.
  results = step.unflatten(step._import(source.fetch(tensors), step.captures.input_map()))  # pylint: disable=protected-access
  if getattr(fn, "__name__", "") in KERAS_STEPS:
    return results[0]  # metrics: combined across replicas, the same on each
  firsts = [pipelines.index(p) for p in range(max(pipelines) + 1)]  # one replica per batch part
  return tree.map_structure(lambda *parts: _concat(parts), *[results[r] for r in firsts])


def run_global(replicator, fn, data):
  """Keras's ``fn`` on one global batch in the global view: traced once at global shapes and partitioned.

  Its outputs are global values (metrics read in the step are combined
  there; predictions are whole), as Keras expects of one device's step.
  A batch dimension of unknown size is not split (``_global_view.build``).
  """
  leaves = tree.flatten(data)
  step = replicator._global_step(fn, data)  # pylint: disable=protected-access
  if step.accumulating:
    raise _errors.UnsupportedError(ACCUMULATING)
  return step(leaves)


def _concat(parts):
  if parts[0] is None:
    return None
  if parts[0].shape.rank == 0:
    return tf.stack(parts)
  return tf.concat(parts, axis=0)
