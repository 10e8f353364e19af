"""``replicator.PipelineModel``: a Keras model cut into stages that ``fit``, ``evaluate`` and ``predict`` run as a
pipeline in the local view.

``PipelineModel(stages, microbatches=m)``, made and compiled in a local-view Replicator's ``context()`` on a mesh
with a stage axis, is the stages in a row (``call``: on one device, in Keras's symbolic build). Keras's trainer
hands its steps to the model (``KerasStrategy.run`` calls :meth:`PipelineModel.replicator_local_step`), which
runs them as the local view's (``repl.run`` from Keras's ``tf.function``):

* the global batch Keras gives is split over the batch axes as ``np.array_split`` splits it, a piece an input
  pipeline (every replica of a batch position takes the same rows);
* ``train_step``: ``repl.pipeline`` with the compiled loss (``model.compute_loss``, each microbatch's weighted by
  its rows) returns the replica's loss, its stages' gradients and the last stage's outputs; the compiled optimizer,
  wrapped by ``repl.wrap_optimizer`` at ``compile``, averages each gradient over the batch axes and updates each
  variable on its stage's devices (its slots there too). A batch the batch replicas cannot share evenly (a short
  last batch) has each replica's gradient weighted by its rows, so the update is the mean over the batch's rows;
* ``test_step``: ``repl.pipeline_forward`` (a forward pass only) and the compiled loss on its outputs;
* ``predict_step``: ``repl.pipeline_forward``; the batch positions' outputs are joined in the batch's order.

The losses the stages add (``model.losses``: weight penalties, activity penalties, ``add_loss``) are added by the
pipeline where they are (``stage_losses=True``: each weight's penalty once a step on its stage's devices, a loss a
layer adds in its call on each microbatch, weighted by its rows), not by ``compute_loss``, which would read every
stage's on the last stage's devices: ``losses`` is empty while a step computes the compiled loss. An optimizer whose
update spans every weight (``gradient_accumulation_steps``, ``use_ema``, ``global_clipnorm``) is refused at
``compile``: each stage's devices update their stage's weights alone. ``mixed_float16``'s ``LossScaleOptimizer``
trains as one device's: each backward pass is seeded with its scale (``repl.pipeline(loss_scale=...)``), and the
wrapped optimizer skips the step on every stage if any stage's gradients are not finite.

Metrics (the loss's mean and the compiled metrics) are updated on the last stage's replicas only, each with its
rows: Keras's metric variables are each replica's own and read as their sum outside a step, so the results read
after the step (in Keras's function) are those of the whole batch, as one device's.

Keras coupling, in this module only (``tests/test_keras_pipeline.py`` pins it): the loss's mean is Keras's
``Trainer._loss_tracker``, which its ``train_step`` and ``test_step`` update and no public method does.
"""

from __future__ import annotations

import keras
import tensorflow as tf
import tree

from replicator.core import _context
from replicator.core import _errors
from replicator.core import _pipeline
from replicator.core._values import PerReplica

NOT_IN_CONTEXT = (
    "replicator.PipelineModel was made outside a Replicator's context ({found}): its steps run on the "
    "Replicator's devices, which it finds there. Fix: make and compile it inside `with repl.context():`.")
GLOBAL_VIEW = (
    "replicator.PipelineModel was made in a global-view Replicator's context: its steps are local-view steps "
    "(each replica runs its stage on its rows). Fix: make the Replicator with view='local' (the default), or, "
    "in the global view, stack identical blocks with replicator.StackedBlocks.")
NO_STAGE_AXIS = (
    "replicator.PipelineModel(axis={axis!r}): the Replicator's mesh {shape} has no such axis; expected the "
    "mesh axis its {stages} stages run along. Fix: make the Replicator on a mesh with it, e.g. "
    "mesh.Mesh({{{axis!r}: {stages}, 'batch': ...}}), or pass axis= one of {names}.")
STAGE_COUNT = (
    "replicator.PipelineModel: {stages} stages over the axis {axis!r} of {devices} devices; expected {expected}. "
    "Fix: {fix}")
NOT_CALLABLE = (
    "replicator.PipelineModel(stages=...): stage {index} is {found!r} ({kind}), not a callable; expected each "
    "stage a Keras layer or model (replicator.split_stages(model, p) cuts a keras.Sequential into them), or a "
    "function of one value.")
OPTIMIZER_COUPLED = (
    "replicator.PipelineModel.compile: the optimizer {name} {found}; expected an optimizer that updates each "
    "weight from its own gradient, as each stage's devices update their stage's weights alone. {why} Fix: {fix}")
COUPLED = {
    "accumulation": ("has gradient_accumulation_steps={value}",
                     "Its accumulators and its update every k steps span every stage's weights.",
                     "a batch {value} times larger and {value} times the microbatches (the pipeline accumulates "
                     "its microbatches' gradients within a step: one update of the {value} batches' mean "
                     "gradient, one step where Keras counts {value})."),
    "ema": ("has use_ema=True",
            "Its moving average of the weights is updated over every stage's weights at once.",
            "use_ema=False (keep an average of the weights in a callback, outside the step)."),
    "global_clipnorm": ("has global_clipnorm={value}",
                        "It clips by the norm of every stage's gradients together.",
                        "clipnorm= (each weight's gradient by its own norm), or no clipping."),
}
FEW_ROWS = (
    "replicator.PipelineModel: a batch of {rows} cannot be split over the {pipelines} batch replicas (the "
    "axes {axes}); expected at least one row each. Fix: batch_size of at least {pipelines} (and a last batch of "
    "at least {pipelines} rows: choose a batch_size that leaves one, or drop the remainder).")
STAGE_BATCH = (
    "replicator.PipelineModel(axis={axis!r}): the Replicator splits the batch over {batch}, which holds the stage "
    "axis; expected the stages' devices to take the same rows. Fix: Replicator(batch_axes=...) without the stage "
    "axis (the other axes, or ()).")
MULTI_CLIENT = (
    "replicator.PipelineModel in a multi-client job: not supported yet (its stages' variables stay on every "
    "device there). Fix: write the step with repl.pipeline and run it with repl.run.")
PREDICT, TRAIN, TEST = "predict", "train_step", "test_step"


def _is_layer(stage) -> bool:
  return isinstance(stage, keras.layers.Layer)


def _as_called(stage, training: bool):
  """``stage`` as the pipeline calls it: a Keras layer with ``training`` (its losses and weights seen through,
  for ``repl.pipeline(stage_losses=True)``), any other callable as it is."""
  return _Called(stage, training) if _is_layer(stage) else stage


class _Called:
  """A Keras layer called with ``training``; its ``losses`` and ``trainable_weights`` are the layer's."""

  def __init__(self, layer, training: bool):
    self.layer, self.training = layer, training

  def __call__(self, x):
    return self.layer(x, training=self.training)

  @property
  def losses(self):
    return self.layer.losses

  @property
  def trainable_weights(self):
    return self.layer.trainable_weights


@keras.saving.register_keras_serializable("replicator")
class PipelineModel(keras.Model):
  """A Keras model of ``stages`` in a row that ``fit``, ``evaluate`` and ``predict`` run as a pipeline over a stage
  axis (a local-view Replicator's).

  Made and compiled in ``repl.context()`` of a local-view Replicator whose mesh has ``axis`` (and, optionally,
  batch axes): the replica at position ``s`` along ``axis`` runs ``stages[s]`` on ``microbatches`` pieces of its
  rows (``repl.pipeline``), each stage's weights and the compiled optimizer's slots for them live on its devices
  only, and the gradients are averaged over the batch axes. The history's losses and metrics, the weights after
  ``fit``, ``evaluate`` and ``predict`` are one device's for the stages in a row (``keras.Sequential(stages)``),
  up to float32 rounding. On one device (outside the context), or called directly, it is the stages in a row.

  Examples:
    >>> import keras, mesh
    >>> repl = replicator.Replicator(mesh=mesh.Mesh({"stage": 2}, devices=["cpu:0", "cpu:1"]))
    >>> with repl.context():
    ...   stages = [keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh")]),
    ...             keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])]
    ...   model = replicator.PipelineModel(stages, microbatches=2)
    ...   model.compile(optimizer="sgd", loss="mse")
    >>> history = model.fit(tf.ones([8, 3]), tf.zeros([8, 1]), batch_size=4, epochs=1, verbose=0)
    >>> model.predict(tf.ones([4, 3]), verbose=0).shape
    (4, 1)

  Args:
    stages: one callable a device along ``axis``, in order (Keras layers or models, built; or functions of one
      value, whose variables are not the model's), as ``repl.pipeline`` takes them (a multiple of the devices
      with ``schedule="gpipe"`` or ``"interleaved"``).
    microbatches: how many pieces each batch replica's rows are split into (fewer for a batch with fewer rows).
    schedule: ``"1f1b"`` (the default), ``"gpipe"`` or ``"interleaved"``: the training step's order of passes
      (evaluation and prediction run the forward passes alone).
    axis: the mesh axis (or tuple of axes) of the stages.
    **kwargs: Keras's model arguments (``name``).
  """

  def __init__(self, stages, *, microbatches: int, schedule: str = "1f1b", axis="stage", **kwargs):
    super().__init__(**kwargs)
    stages = list(stages)
    for index, stage in enumerate(stages):
      if not callable(stage):
        raise _errors.ArgumentTypeError(NOT_CALLABLE.format(index=index, found=stage, kind=type(stage).__name__))
    if schedule not in _pipeline.SCHEDULES:
      raise _errors.ArgumentError(f"replicator.PipelineModel(schedule={schedule!r}): expected one of "
                                  f"{_pipeline.SCHEDULES}.")
    _pipeline.check_microbatches(microbatches, "replicator.PipelineModel", "its construction", "each batch replica's rows")
    repl = getattr(tf.distribute.get_strategy(), "replicator", None)
    if repl is None:
      raise _errors.ReplicaContextError(NOT_IN_CONTEXT.format(found=f"the current strategy is "
                                                              f"{type(tf.distribute.get_strategy()).__name__}"))
    if repl.view != "local":
      raise _errors.UnsupportedError(GLOBAL_VIEW)
    if getattr(repl, "task", None) is not None:  # (a MultiWorkerReplicator's process)
      raise _errors.UnsupportedError(MULTI_CLIENT)
    names = repl.mesh.axis_names
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    if not axes or any(a not in names for a in axes):
      raise _errors.ArgumentError(NO_STAGE_AXIS.format(axis=axis, shape=dict(repl.mesh.shape), stages=len(stages),
                                                       names=names))
    devices = repl.mesh.axis_size(axes)
    if schedule == "1f1b" and len(stages) != devices:
      raise _errors.ArgumentError(STAGE_COUNT.format(
          stages=len(stages), axis=axis, devices=devices, expected="one stage a device",
          fix=f"cut the model into {devices} stages (replicator.split_stages(model, {devices})), or, for several "
              "stages a device, schedule='gpipe' or 'interleaved'."))
    if not stages or len(stages) % devices:
      raise _errors.ArgumentError(STAGE_COUNT.format(
          stages=len(stages), axis=axis, devices=devices, expected=f"a multiple of {devices}",
          fix=f"cut the model into {devices} stages (replicator.split_stages(model, {devices})) or a multiple."))
    self.stages = stages  # (Keras tracks the layers among them: their weights are the model's)
    self.microbatches, self.schedule, self.axis = microbatches, schedule, axis
    self._repl, self._stage_axes, self._stage_devices = repl, axes, devices
    self._pipeline_optimizer = None  # the compiled optimizer, wrapped (compile)
    # Each stage as the pipeline calls it, in training and not (made once: the pipeline caches by the callables).
    self._train_calls = [_as_called(stage, True) for stage in stages]
    self._infer_calls = [_as_called(stage, False) for stage in stages]
    if all(stage.built for stage in stages if _is_layer(stage)):
      self.built = True  # (its weights exist: load_weights and summary need no call first)

  def call(self, inputs, training=None):
    """The stages in a row (one device's model)."""
    x = inputs
    for stage in self.stages:
      x = stage(x, training=training) if _is_layer(stage) else stage(x)
    return x

  def compile(self, *args, **kwargs):  # pylint: disable=signature-differs
    """Keras's ``compile``; the optimizer is then wrapped (``repl.wrap_optimizer``): its slots for each stage's
    weights are made on that stage's devices, and it averages the gradients over the batch axes. An optimizer
    whose update couples every weight (``gradient_accumulation_steps``, ``use_ema``, ``global_clipnorm``) is
    refused. A ``LossScaleOptimizer`` (``mixed_float16``'s) scales the loss inside the pipeline, and its check of
    the gradients is every stage's (``repl.wrap_optimizer`` agrees on it across the stages)."""
    super().compile(*args, **kwargs)
    if self.optimizer is not None:
      _check_optimizer(self.optimizer)
    self._pipeline_optimizer = self._repl.wrap_optimizer(self.optimizer) if self.optimizer is not None else None

  def compile_from_config(self, config):
    """Compiles as ``compile`` does (``keras.saving.load_model``), the optimizer built for the weights."""
    self.compile(**keras.saving.deserialize_keras_object(config))
    if self.optimizer is not None and self.built:
      self.optimizer.build(self.trainable_variables)

  def get_config(self):
    """The stages (Keras layers: a stage that is a function has no config) and the pipeline's arguments."""
    functions = [k for k, stage in enumerate(self.stages) if not _is_layer(stage)]
    if functions:
      raise _errors.UnsupportedError(
          f"replicator.PipelineModel.get_config: stages {functions} are functions, not Keras layers, which have no "
          "config to save. Fix: save the weights (model.save_weights) and make the model again to load them.")
    return {**super().get_config(), "stages": [keras.saving.serialize_keras_object(stage) for stage in self.stages],
            "microbatches": self.microbatches, "schedule": self.schedule, "axis": self.axis}

  @classmethod
  def from_config(cls, config):
    """A PipelineModel of ``config``'s stages (in a Replicator's context, as the model is made)."""
    config = dict(config)
    config["stages"] = [keras.saving.deserialize_keras_object(stage) for stage in config["stages"]]
    return cls(**config)

  # -- the steps, run by the Replicator ---------------------------------------------------------------------------

  def replicator_local_step(self, fn, data):
    """Runs Keras's step ``fn`` (``train_step``, ``test_step``, or predict's) on the global batch ``data`` as the
    local view's step, from Keras's function; returns what Keras's step returns (the metrics' results, or the
    predictions). Called by the Replicator's Keras strategy."""
    kind = getattr(fn, "__name__", "")
    kind = kind if kind in (TRAIN, TEST) else PREDICT
    repl = self._repl
    data = keras.utils.pack_x_y_sample_weight(*keras.utils.unpack_x_y_sample_weight(data))  # (no None: no input)
    pipelines = self._pipelines()
    pieces = self._split(data, max(pipelines) + 1)
    replicas = range(repl.num_replicas)
    inputs = PerReplica([pieces[pipelines[r]] for r in replicas])
    step = {TRAIN: self._train_replica, TEST: self._test_replica, PREDICT: self._predict_replica}[kind]
    out = repl.run(step, inputs=inputs, view="local")
    if kind == PREDICT:  # each batch position's rows, from its first replica (every replica along the axis has them)
      first = {}
      for r in replicas:
        first.setdefault(pipelines[r], r)
      return tree.map_structure(lambda *parts: tf.concat(parts, 0),
                                *[tree.map_structure(lambda v, r=first[k]: v.values[r], out) for k in sorted(first)])
    with tf.control_dependencies([v for r in replicas for v in tree.flatten(tree.map_structure(
        lambda v, r=r: v.values[r], out))]):
      return self.get_metrics_result()  # (each metric's replicas' parts summed: the whole batch's)

  def _pipelines(self) -> list[int]:
    """Each replica's input pipeline (its batch position): all 0 where the Replicator has no batch axes."""
    repl = self._repl
    try:
      axes = repl.batch_axes
    except _errors.ArgumentError:  # (a mesh of stages alone, its batch axes not given: every replica the batch)
      axes = ()
    if set(axes) & set(self._stage_axes):
      raise _errors.ArgumentError(STAGE_BATCH.format(axis=self.axis, batch=axes))
    return [repl.input_pipeline(r) if axes else 0 for r in range(repl.num_replicas)]

  def _split(self, data, count: int) -> list:
    """The global batch ``data`` in ``count`` pieces, one an input pipeline (``np.array_split``'s rows), each with
    its weight: its rows times the pipelines over the batch's rows (1 where they divide)."""
    repl = self._repl
    leaves = [t for t in tree.flatten(data) if t is not None]
    first = tf.convert_to_tensor(leaves[0])
    rows = first.shape[0] if first.shape.rank and first.shape[0] is not None else tf.shape(first)[0]
    if isinstance(rows, int) and rows < count:
      raise _errors.ArgumentError(FEW_ROWS.format(rows=f"{rows} rows", pipelines=count, axes=repl.batch_axes))
    if isinstance(rows, int):
      sizes = [rows // count + (1 if k < rows % count else 0) for k in range(count)]
      weights = [tf.constant(size * count / rows, tf.float32) for size in sizes]
    else:  # (a batch of unknown rows: refused when it runs if too small)
      with tf.control_dependencies([tf.debugging.assert_greater_equal(rows, count, message=FEW_ROWS.format(
          rows="fewer rows", pipelines=count, axes=repl.batch_axes if count > 1 else ()))]):
        rows = tf.identity(rows)
      sizes = [rows // count + tf.cast(k < rows % count, rows.dtype) for k in range(count)]
      weights = [tf.cast(size * count, tf.float32) / tf.cast(rows, tf.float32) for size in sizes]
    edges = [(sum(sizes[:k]), sum(sizes[:k + 1])) for k in range(count)]

    def piece(a, b):
      return tree.map_structure(lambda t: None if t is None else t[a:b], data)

    return [(piece(a, b), w) for (a, b), w in zip(edges, weights)]

  def _last_stage(self) -> bool:
    """Whether this replica (a step's, being traced) runs the last stage."""
    ctx = _context.current_context()
    return self._repl.mesh.axis_index(ctx.replica_id, self._stage_axes) == (len(self.stages) - 1) % self._stage_devices

  def _microbatches(self, x) -> int:
    leaf = next(t for t in tree.flatten(x) if t is not None)
    rows = leaf.shape[0]
    return self.microbatches if rows is None else max(1, min(self.microbatches, int(rows)))

  def _update_metrics(self, x, y, y_pred, sample_weight, loss, rows) -> None:
    if self._last_stage():
      self._loss_tracker.update_state(loss, sample_weight=rows)  # pylint: disable=protected-access
      self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

  @property
  def losses(self):
    """Keras's ``losses`` (the stages' added losses and weight penalties), or none while a step computes the
    compiled loss: the pipeline adds the stages' own losses on their devices (``repl.pipeline(stage_losses=True)``)."""
    return [] if getattr(self, "_compiled_loss_only", False) else super().losses

  def _compiled_loss(self, y, y_pred, sample_weight, training):
    """``compute_loss`` without the stages' losses (the pipeline adds them where they are)."""
    self._compiled_loss_only = True
    try:
      return self.compute_loss(x=None, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)
    finally:
      self._compiled_loss_only = False

  def _train_replica(self, batch):
    data, weight = batch
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    variables = list(self.trainable_variables)

    def loss_fn(targets, outputs):
      y_part, weight_part = (targets, None) if sample_weight is None else targets
      return self._compiled_loss(y_part, outputs, weight_part, training=True)

    targets = y if sample_weight is None else (y, sample_weight)
    # A LossScaleOptimizer (mixed_float16's): the backward passes seeded with its scale times the replica's share of
    # the batch's rows (each row's gradient then one device's, in float16 too), its gradients times the batch
    # replicas (their mean the batch's); else each replica's gradient weighted by its rows (a batch split unevenly).
    scaled = hasattr(self.optimizer, "inner_optimizer")
    count = max(self._pipelines()) + 1
    loss, grads, y_pred = self._repl.pipeline(
        self._train_calls, x, targets, loss_fn, axis=self.axis, microbatches=self._microbatches(x),
        schedule=self.schedule, variables=variables, outputs=True, stage_losses=True,
        loss_scale=(lambda: self._loss_scale() * tf.cast(weight, tf.float32) / count) if scaled else None)
    factor = count if scaled else weight
    grads = [g * tf.cast(factor, g.dtype) for g in grads]
    self._pipeline_optimizer.apply_gradients(zip(grads, variables))
    self._update_metrics(x, y, y_pred, sample_weight, loss, _rows(x))
    return loss

  def _loss_scale(self):
    """The LossScaleOptimizer's scale (called once the variables are placed): ``scale_loss`` of one, the optimizer
    built first (its scale a variable; its slots on their stages' devices)."""
    if not self.optimizer.built:
      with keras.name_scope(self.optimizer.name, caller=self.optimizer):
        self.optimizer.build(self.trainable_variables)
    return self.optimizer.scale_loss(tf.ones([]))

  def _test_replica(self, batch):
    data, _ = batch
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    y_pred, added = self._forward(x, stage_losses=True)
    loss = tf.zeros([])
    if self._last_stage():
      loss = tf.cast(self._compiled_loss(y, y_pred, sample_weight, training=False), tf.float32) + added
    self._update_metrics(x, y, y_pred, sample_weight, loss, _rows(x))
    return loss

  def _predict_replica(self, batch):
    data, _ = batch
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    return self._forward(x)

  def _forward(self, x, stage_losses=False):
    return self._repl.pipeline_forward(self._infer_calls, x, axis=self.axis, microbatches=self._microbatches(x),
                                       variables=list(self.trainable_variables), stage_losses=stage_losses)


def _check_optimizer(optimizer) -> None:
  """Refuses an optimizer whose update couples every weight (each stage's devices update their weights alone)."""
  found = ("accumulation" if getattr(optimizer, "gradient_accumulation_steps", None) else
           "ema" if getattr(optimizer, "use_ema", False) else
           "global_clipnorm" if getattr(optimizer, "global_clipnorm", None) else None)
  if found is None:
    return
  value = {"accumulation": getattr(optimizer, "gradient_accumulation_steps", None),
           "global_clipnorm": getattr(optimizer, "global_clipnorm", None)}.get(found)
  what, why, fix = (part.format(value=value) for part in COUPLED[found])
  raise _errors.UnsupportedError(OPTIMIZER_COUPLED.format(name=type(optimizer).__name__, found=what, why=why, fix=fix))


def _rows(x):
  leaf = next(t for t in tree.flatten(x) if t is not None)
  return tf.shape(leaf)[0]

