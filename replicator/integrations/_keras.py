"""Keras's trainer on a Replicator: ``model.fit``, ``evaluate``, ``predict`` and the ``*_on_batch`` calls.

Keras 3's TensorFlow trainer runs each step through the
``tf.distribute.Strategy`` that was current when the model was created:
``strategy.experimental_distribute_dataset`` for its data and
``strategy.run(train_step, args=(batch,))`` inside its own ``tf.function``.
``repl.context()`` (and a Keras distribution after
``replicator.enable_keras_distribution()``) makes :class:`KerasStrategy`
current, so a model built there is trained by the Replicator.

Keras's steps (``train_step``, ``test_step``, ``predict_step``, Keras's or a
subclass's own) are written for one device, so in either view of the
Replicator ``strategy.run`` runs them as the global view runs a step: traced
once at the global batch's shapes, partitioned over the mesh (the batch split
over the batch axes, the variables by their layouts) and imported into
Keras's function, where Keras's loop (``steps_per_execution``), callbacks,
validation and progress bar run as usual. What the step returns, the losses,
gradients, metrics, random draws (Dropout) and batch statistics
(BatchNormalization) are then one device's, whatever the step computes: a
loss summed rather than averaged, metrics updated without sample weights, a
``repl.wrap_optimizer`` wrapper (it reduces nothing in the one program).

Batches of unknown size (a dataset batched without ``drop_remainder``,
arrays whose rows ``batch_size`` does not divide) are handed to Keras's step
one concrete batch at a time (``_keras_batches``): full batches are split
over the batch axes, a short last batch is taken whole by every device.

A model with a ``replicator_local_step(fn, batch)`` method (``replicator.PipelineModel``, whose steps call
``repl.pipeline``) runs its steps itself, as the local view's (``repl.run`` from Keras's function): ``run``
hands it Keras's step and the global batch.

Making the strategy also makes ``keras.RematScope`` and ``keras.remat``
rematerialize as ``replicator.remat`` does (``_remat.install``).

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

from replicator.core import _context
from replicator.core import _errors
from replicator.core import _primitives
from replicator.core import _tf_distribute
from replicator.integrations import _keras_batches
from replicator.integrations import _remat
from replicator.state import _restore
from replicator.state import _variables

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
ONE_DEVICE_UPDATE = (
    "{where} outside any Replicator step updated {name!r} through an optimizer, with the Replicator's strategy "
    "current (repl.context(), or a Keras distribution after replicator.enable_keras_distribution()): that code is "
    "one device's program (the batch it is given, whole, on one device; every update written to each device's "
    "copy), so it trains as one device does, without the others. Fix, to use every device: run the step as the "
    "Replicator's, `repl.run(step_fn, dataset)` with `repl = replicator.distribution_replicator()` (or your "
    "Replicator) and step_fn taking one batch (a tf.function works unchanged inside it), or train with model.fit."
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
SHARDED_END = (
    "Keras's fit/evaluate on a dataset that each process of the multi-client job reads in its own shard (its "
    "auto_shard_policy is FILE or HINT): the shards can end at different steps, and Keras's loop ends a process's "
    "epoch at the end of its own shard, while the others wait for it in their next step. Fix: repeat the dataset "
    "(dataset.repeat()) and pass steps_per_epoch= (and validation_steps=) to fit, or run the loop with repl.run, "
    "whose steps agree on the end, or leave the policy at AUTO (every process reads every global batch)."
)
# Where Keras 3's TensorFlow trainer calls strategy.run (keras/src/backend/tensorflow/trainer.py, 3.15).
KERAS_CALLERS = ("one_step_on_data", "one_step_on_data_distributed")
KERAS_STEPS = ("train_step", "test_step")  # steps that train or evaluate (predict_step: per example)


def _extended_class():
  """The default strategy's extended class with the Replicator's overrides (made once)."""
  base = type(_tf_distribute.default_strategy().extended)

  class Extended(base):  # pylint: disable=abstract-method
    """Cross-replica behaviour of :class:`KerasStrategy` (see the module docstring)."""

    def __init__(self, container_strategy, config, creator, global_view):
      super().__init__(container_strategy)
      # Weak references: the Replicator owns them and keeps this strategy (no cycle through it).
      self._creator_ref = weakref.ref(creator)
      self._global_view_ref = weakref.ref(global_view)
      self.replicator_config = config

    @property
    def global_view(self):
      """The Replicator's ``_global.GlobalView``: Keras's steps run in the global view."""
      return self._global_view_ref()

    def _scope(self, strategy):
      # A strategy's own scope (cross-replica mode, variables made by
      # _create_variable), not the default strategy's no-op one.
      return tf.distribute.StrategyExtended._scope(self, strategy)  # pylint: disable=protected-access

    def _create_variable(self, next_creator, **kwargs):
      kwargs.pop("distribute_strategy", None)  # added by the strategy's scope (with use_resource)
      kwargs.pop("use_resource", None)
      return self._creator_ref()(next_creator, **kwargs)

    @property
    def _num_replicas_in_sync(self):
      # Keras's losses divide by this (scale_loss_for_distribution) wherever the strategy is current: in Keras's
      # step (one program on the global batch), in a plain tf.function or eager loop (one device's program).
      # Each computes the loss of the whole batch it sees, so none may divide it: one replica. (Inside a
      # local-view replica of repl.run the replica context's strategy is TensorFlow's default one.)
      return 1

    def colocate_vars_with(self, colocate_with_variable):
      # Keras optimizers made in repl.context() place slots through their strategy, also inside
      # repl.run steps (outside this strategy's scope). The Replicator's variable creator places
      # every component on its own device, so no colocation is needed. In the global view the
      # optimizer is a plain one: its slots take their variable's layout here.
      if self.replicator_config.view == "global":
        return _variables.reference_scope(colocate_with_variable)
      return contextlib.nullcontext()

    def _update(self, var, fn, args, kwargs, group):
      if _context.current_context() is None and _context.current_global_trace() is None:
        if not tf.executing_eagerly() and _tf_distribute.called_by(KERAS_CALLERS, depth=40):  # Keras's trainer, on one device
          raise _errors.UnsupportedError(MODEL_OUTSIDE)
        self._warn_one_device(var)
      return super()._update(var, fn, args, kwargs, group)

    def _warn_one_device(self, var):
      """Warns (once) that an optimizer update outside any step trains as one device, not on the mesh."""
      if getattr(self, "_warned_one_device", False) or _variables.underlying(var) is None:
        return
      self._warned_one_device = True
      warnings.warn(ONE_DEVICE_UPDATE.format(name=getattr(var, "path", None) or var.name,
                                             where="A tf.function" if tf.inside_function() else "Eager code"),
                    stacklevel=_primitives.user_stacklevel())

    def _use_merge_call(self):
      return False  # Keras's optimizers then update each variable directly

    def _experimental_distribute_dataset(self, dataset, options):
      shard = self.global_view.shard_for(dataset, keep=False)
      if shard is not None:  # a multi-client job's process reads its own shard (the dataset's sharding policy)
        if shard.agree is not None:
          raise _errors.UnsupportedError(SHARDED_END)
        return shard.dataset
      # Keras's epoch iterator: batches of unknown size reach Keras's step one at a time, at their shapes.
      if not _keras_batches.static(dataset.element_spec):
        return _keras_batches.ConcreteBatches(dataset)
      return super()._experimental_distribute_dataset(dataset, options)

    def _call_for_each_replica(self, fn, args, kwargs):
      raise _errors.UnsupportedError(RUN_OUTSIDE_KERAS.format(name=getattr(fn, "__name__", "fn")))

  return Extended


_EXTENDED = None


class KerasStrategy(tf.distribute.Strategy):
  """The ``tf.distribute.Strategy`` a Replicator presents to Keras's trainer (``repl.context()``)."""

  def __init__(self, config, creator, global_view, replicator=None):
    global _EXTENDED
    if _EXTENDED is None:
      _EXTENDED = _extended_class()
    _remat.install()  # keras.RematScope and keras.remat rematerialize as replicator.remat does (see _remat)
    super().__init__(_EXTENDED(self, config, creator, global_view))
    self._replicator_ref = (lambda: None) if replicator is None else weakref.ref(replicator)

  @property
  def replicator(self):
    """The Replicator whose context presents this strategy (a model made there keeps the strategy: its Replicator)."""
    return self._replicator_ref()

  def run(self, fn, args=(), kwargs=None, options=None):  # pylint: disable=unused-argument
    extended = self.extended
    if kwargs or len(args) != 1 or not _tf_distribute.called_by(KERAS_CALLERS):
      raise _errors.UnsupportedError(RUN_OUTSIDE_KERAS.format(name=getattr(fn, "__name__", "fn")))
    if tf.executing_eagerly():
      what = "predict" if getattr(fn, "__name__", "") not in KERAS_STEPS else "fit/evaluate"
      raise _errors.UnsupportedError(RUN_EAGERLY.format(what=what))
    model = _model_of(fn)
    if getattr(model, "jit_compile", False) is True:
      raise _errors.UnsupportedError(JIT_COMPILE)
    local = getattr(model, "replicator_local_step", None)
    if local is not None:  # a model whose steps are the local view's (replicator.PipelineModel): it runs them
      _wrap_function(extended.global_view, extended.replicator_config.atomic, model, fn,
                     extended.replicator_config.agree)
      return local(fn, args[0])
    variables = getattr(model, "variables", None) or ()
    if (getattr(fn, "__name__", "") == "train_step" and variables
        and all(_variables.underlying(v) is None for v in variables)):
      raise _errors.UnsupportedError(FOREIGN_MODEL)
    # One program at global shapes, split model or not: outputs, metrics and random draws as on one device.
    for variable in variables:  # a local-view Replicator gave seed states per-replica streams: one here
      replicated = _variables.underlying(variable)
      if replicated is not None:
        _variables.single_stream(replicated)
    _wrap_function(extended.global_view, extended.replicator_config.atomic, model, fn,
                   extended.replicator_config.agree)
    return run_global(extended.global_view, fn, args[0])


_FUNCTIONS = {"train_step": "train_function", "test_step": "test_function"}  # predict writes no variable


def _wrap_function(global_view, atomic: bool, model, fn, agree=None) -> None:
  """Wraps the Keras function that calls ``fn`` (``model.train_function``, ``test_function``), once.

  Keras calls its function through the model's attribute
  (``model.train_function(iterator)``) for every ``steps_per_execution``
  batches, so the attribute is wrapped:

  * all-or-nothing (``Replicator(atomic=True)``): the steps keep the values
    they write, but a step in Keras's ``tf.function`` fails in Keras's call,
    where ``repl.run`` cannot restore them: a failed call writes the kept
    values back before the error leaves it;
  * batches of unknown size given from Python (``_keras_batches``): each call
    starts a group of steps, which the iterator needs to end the data the way
    Keras's loop expects;
  * in a multi-client job (``agree``, the processes' ``Agreement``): each call
    is one the watchdog watches, as ``repl.run``'s are (a worker late to it is
    named).

  This runs while Keras traces its function, inside its first call: a failure
  of that call is undone at the start of the next step instead
  (``_atomic.Snapshot._keep``), and its group is the iterator's first.
  """
  name = _FUNCTIONS.get(getattr(fn, "__name__", ""))
  function = getattr(model, name, None) if name is not None else None
  if function is None or getattr(function, "_replicator_wraps", False):
    return

  @functools.wraps(function)
  def wrapped(iterator, *args, **kwargs):
    _restore.release()  # a restore before this step is over: the values it kept to undo itself go
    if isinstance(iterator, _keras_batches.Iterator):
      iterator.begin_call()
    with agree.watched("this Keras step") if agree is not None else contextlib.nullcontext():
      try:
        return function(iterator, *args, **kwargs)
      except tf.errors.OpError as e:
        if atomic and not isinstance(e, tf.errors.OutOfRangeError):  # the end of the data: nothing ran
          global_view.restore_failed()
        raise

  wrapped._replicator_wraps = True  # pylint: disable=protected-access
  setattr(model, name, wrapped)


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


def run_global(global_view, fn, data):
  """Keras's ``fn`` on one global batch in the global view: traced once at global shapes and partitioned.

  Its outputs are global values (metrics read in the step are combined
  there; predictions are whole), as Keras expects of one device's step.
  A batch dimension of unknown size is not split (``_global_step.build``).
  """
  leaves = tree.flatten(data)
  step = global_view.step_for(fn, data)
  if step.accumulating:
    raise _errors.UnsupportedError(ACCUMULATING)
  return step(leaves)
