"""``replicator.StackedBlocks``: a Keras layer of identical blocks whose weights are stacked, run as a pipeline.

``StackedBlocks(block, stages, microbatches=m)`` holds ``stages`` copies of ``block`` (a Keras layer that keeps
its input's shape: a transformer block, a residual MLP) as one variable a weight of the block, the copies'
values stacked along a first dimension (``<name>/<weight name>_<k>``: ``blocks/kernel_2`` the block's third
weight), and calls them in a row through ``replicator.stacked_pipeline``: the block, built once as a template
without storage, reads each copy's values through a ``keras.StatelessScope``. On one device it is the blocks in
a row. Made in a global-view Replicator's context with its stacked weights laid out over a stage axis
(``mesh.LayoutMap({r"^blocks/": ("stage",)}, pad=True)``), a model holding it trains as a pipeline in Keras's
entry points (``fit``, ``train_on_batch``, a custom ``train_step``): each device keeps its stage's weights and
slots, and an activation a microbatch goes to the next stage's device (``docs/concepts/stages.md``).

Each stage's weights start as a block of the same config built alone would start (its initializers' draws,
stacked): a model of ``stages`` such blocks in a row, given those values, is the one-device model it equals.
The block may hold no other state (no BatchNormalization statistics, no Dropout seed): a stage's writes to it
would be the stage's own.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from replicator.core import _errors
from replicator.core import _stacked_pipeline

STATEFUL_BLOCK = (
    "replicator.StackedBlocks({name!r}): the block {block!r} holds state besides its trainable weights ({found}); "
    "expected a block of trainable weights only (each stage's copy reads its values through a keras.StatelessScope, "
    "and writes to state would be its stage's alone). Fix: LayerNormalization for BatchNormalization, no Dropout "
    "inside the block (put it before or after the StackedBlocks layer).")


class _Untracked:
  """Holds a layer out of Keras's tracking (an attribute of any other type is not looked into)."""

  def __init__(self, layer):
    self.layer = layer


def _built_empty(layer, input_shape) -> list:
  """Builds ``layer`` on ``input_shape`` with no storage; returns its trainable weights' initial values.

  Its variables are made with an empty value (``tf.variable_creator_scope``: a tensor of no element, its dimensions
  unknown to TensorFlow; Keras keeps their shapes) and are only read under a ``keras.StatelessScope`` mapping them
  to the stacked weights' values; their initializers' values are returned, in ``layer.trainable_variables``' order
  (eager tensors on the host).
  """
  drawn = {}

  def creator(next_creator, **kwargs):
    value = kwargs["initial_value"]
    value = tf.convert_to_tensor(value() if callable(value) else value)
    # (no element, the dimensions left unknown: the layer's own first call, symbolic, reads its variables)
    rank = value.shape.rank
    kwargs["initial_value"] = tf.zeros([0] * rank, value.dtype) if rank else tf.zeros([], value.dtype)
    kwargs["shape"] = tf.TensorShape([None] * rank)
    kwargs["name"] = "variable"
    with tf.name_scope("replicator_template/"):  # (an absolute scope: not a path a LayoutMap lays out)
      made = next_creator(**kwargs)
    drawn[id(made)] = value
    return made

  if not layer.built:
    with tf.init_scope(), tf.variable_creator_scope(creator):
      layer(keras.KerasTensor(tuple(input_shape)))  # (built by a symbolic call: its sublayers too)
  values = []
  for variable in layer.trainable_variables:
    value = drawn.get(id(variable.value))
    if value is None:
      raise _errors.UnsupportedError(
          f"replicator.StackedBlocks: the block {layer.name!r} was built before (its weight {variable.path!r} "
          "holds a value); expected a block not yet built, which StackedBlocks builds as a template. Fix: pass "
          "a new block (keras.layers.Dense(...), not one already called).")
    values.append(value)
  return values


@keras.saving.register_keras_serializable("replicator")
class StackedBlocks(keras.layers.Layer):
  """``stages`` copies of a Keras block (``repeats`` rounds of them), their weights stacked, called in a row as a
  pipeline over a stage axis.

  On one device the copies run in a row: ``block_{n-1}( ... block_0(x))``, ``n = repeats * stages``. In the global
  view, with the stacked weights laid out over a stage axis (below), a microbatch's activation goes from stage to
  stage (``replicator.stacked_pipeline``: GPipe's schedule, or with ``repeats = v`` the circular one, each
  microbatch going round the stages ``v`` times; each block computed again in the backward pass, the graph the
  same for any number of microbatches); Keras's ``fit`` trains a model holding it so.

  Examples:
    >>> layer = replicator.StackedBlocks(keras.layers.Dense(4), stages=3, microbatches=2, name="blocks")
    >>> layer(tf.ones([6, 4])).shape, [(w.path, tuple(w.shape)) for w in layer.trainable_weights]
    (TensorShape([6, 4]), [('blocks/kernel_0', (3, 4, 4)), ('blocks/bias_1', (3, 4))])

  Their layouts over a stage axis, for every stacked weight whatever its rank:
  ``mesh.LayoutMap({r"^blocks/": ("stage",)}, pad=True)``; with ``repeats > 1`` the weights are stacked
  ``[repeats, stages, ...]`` (block ``r * stages + s`` at ``[r, s]``, on stage ``s``):
  ``mesh.LayoutMap({r"^blocks/": (None, "stage")}, pad=True)``.

  Args:
    block: a Keras layer, not built, whose output has its input's shape (its config is what the stages copy).
    stages: how many copies a round, one a device along the stage axis.
    microbatches: how many pieces the batch is split into (dividing its rows; at least ``stages`` with repeats).
    repeats: how many rounds of the stages (``repeats * stages`` blocks in a row, ``repeats`` a device).
    **kwargs: Keras's layer arguments (``name``: the stacked weights' paths start with it).
  """

  def __init__(self, block, stages: int, microbatches: int, repeats: int = 1, **kwargs):
    super().__init__(**kwargs)
    if not isinstance(block, keras.layers.Layer):
      raise _errors.ArgumentError(f"replicator.StackedBlocks(block={block!r}): expected a Keras layer (the block "
                                  "the stages copy).")
    if not _errors.positive_int(stages):
      raise _errors.ArgumentError(f"replicator.StackedBlocks(stages={stages!r}): expected a positive int.")
    if not _errors.positive_int(repeats):
      raise _errors.ArgumentError(f"replicator.StackedBlocks(repeats={repeats!r}): expected a positive int.")
    self.stages, self.microbatches, self.repeats = stages, microbatches, repeats
    self._template = _Untracked(block)  # (not a sublayer: its weights are not the model's)
    self._stacked = []
    self._given = None  # (from_layers: the stages' values, given)

  @classmethod
  def from_layers(cls, layers, microbatches: int, repeats: int = 1, **kwargs) -> "StackedBlocks":
    """``StackedBlocks`` of built layers of one kind and config (a backbone's transformer layers), holding their
    current values: stage ``s``'s weights are ``layers[s]``'s (trained or loaded ones kept).

    Build the layers where their values cost no device memory (outside a Replicator, or loaded on the host), and
    make this layer in the Replicator's context: only the stacked weights are then the Replicator's.

    Args:
      layers: the blocks in their order, each built, of one class and the same weights' shapes (the first is the
        template every stage calls, given its values).
      microbatches: how many pieces the batch is split into.
      repeats: how many rounds of the stages: ``len(layers) / repeats`` stages, ``layers[r * stages + s]`` on
        stage ``s``.
      **kwargs: Keras's layer arguments (``name``).
    """
    layers = list(layers)
    if not layers or not all(isinstance(layer, keras.layers.Layer) and layer.built for layer in layers):
      raise _errors.ArgumentError(f"replicator.StackedBlocks.from_layers({layers!r}): expected built Keras layers, "
                                  "the blocks in their order.")

    kinds = {(type(layer).__name__, tuple(tuple(w.shape) for w in layer.trainable_weights)) for layer in layers}
    if len(kinds) != 1:
      raise _errors.ArgumentError(
          f"replicator.StackedBlocks.from_layers: the layers {[layer.name for layer in layers]} differ in their "
          "class or their weights' shapes; expected identical blocks (only their values may differ). Fix: stack "
          "the repeated blocks only; keep the others (an embedding, a head) before or after.")
    if not _errors.positive_int(repeats) or len(layers) % repeats:
      raise _errors.ArgumentError(
          f"replicator.StackedBlocks.from_layers(repeats={repeats!r}): expected a positive int dividing the "
          f"{len(layers)} layers (each round of the stages holds len(layers) / repeats of them).")
    # The first layer is the template (read through a StatelessScope only: its own values are never read).
    made = cls(layers[0], stages=len(layers) // repeats, microbatches=microbatches, repeats=repeats, **kwargs)
    made._given = [[tf.convert_to_tensor(w.numpy()) for w in layer.trainable_weights] for layer in layers]
    return made

  def build(self, input_shape):
    template = self._template.layer
    if self._given is None:  # (from_layers: the first layer, built, is the template)
      _built_empty(template, input_shape)
    stateful = [v.path for v in template.non_trainable_variables]
    if stateful:
      raise _errors.UnsupportedError(STATEFUL_BLOCK.format(name=self.name, block=template.name,
                                                           found=", ".join(stateful)))
    # Each stage's initial values drawn as a block of its own would draw them (a copy built alone, its values kept).
    draws = self._given or [_built_empty(template.__class__.from_config(template.get_config()), input_shape)
                             for _ in range(self.stages * self.repeats)]
    self._given = None
    self._stacked = []
    for k, variable in enumerate(template.trainable_variables):
      # Named by position (kernel_2: the block's third weight, a kernel): its sublayers' names are Keras's counters'.
      path = f"{variable.name}_{k}"
      values = tf.stack([draw[k] for draw in draws])
      if self.repeats > 1:  # [repeats, stages, ...]: block r * stages + s at [r, s]
        values = tf.reshape(values, [self.repeats, self.stages] + values.shape[1:].as_list())
      self._stacked.append(self.add_weight(shape=tuple(values.shape), dtype=variable.dtype, name=path,
                                           initializer=lambda shape, dtype=None, v=values: tf.cast(v, dtype)))
    self.built = True

  def call(self, inputs):
    template = self._template.layer

    def block(weights, x):
      with keras.StatelessScope(state_mapping=list(zip(template.trainable_variables, weights))):
        return template(x)

    return _stacked_pipeline.stacked_pipeline(block, [w.value for w in self._stacked], inputs,
                                              microbatches=self.microbatches, repeats=self.repeats)

  def compute_output_shape(self, input_shape):
    return input_shape

  def get_config(self):
    block = keras.layers.serialize(self._template.layer)
    block.pop("build_config", None)  # (the template is built here, by build(), not by Keras's loader)
    return {**super().get_config(), "block": block, "stages": self.stages, "microbatches": self.microbatches,
            "repeats": self.repeats}

  @classmethod
  def from_config(cls, config):
    config = dict(config)
    config["block"] = keras.layers.deserialize(config["block"])
    return cls(**config)
