"""Export for serving: a replicated variable saves as one ordinary variable holding its global value.

``tf.saved_model.save`` (and Keras 3's ``model.export``, which calls it) asks
every saved object for a copy of itself in the export graph
(``_export_to_saved_model_graph``) and rewires the functions it saves: each
resource handle a function captured is replaced by the copy that handle was
mapped to. A :class:`ReplicatedVariable` exports one variable of its global
shape, restored from the value it checkpoints (``_serialize_to_tensors``: the
global value), and maps every component's handle to it.

That is right for a replicated variable: a function traced outside a step
reads one component, and every component holds the global value. A sharded
variable, or an on-read variable aggregated by SUM or MEAN, is read outside a
step by combining components (concatenating pieces, adding the replicas'
values); mapped onto one global variable, that function would concatenate
or add the global value to itself. So inside a function such a read is a
choice made when the function runs::

    tf.cond(VarIsInitializedOp(serving), lambda: read(serving), combine_components)

``serving`` is a handle of the global shape that nothing ever assigns: in
the training process it is uninitialized and the function combines the
components as before; in the export it maps to the exported variable, which
loading restores, so the loaded function reads the global value and never
takes the components' branch. This works whenever the function was traced
(``model.export`` traces its endpoints before ``tf.saved_model.save``
starts). The handle costs no memory: a variable's buffer is made by its
first assignment.

The function records the variable itself, not its components, as what it
reads (``ConcreteFunction.variables``): ``model.export`` saves those as the
variables its functions use, so it saves the exported global variable and
no per-device pieces (a ``GradientTape`` in such a function does not see
the components either; outside a step a sharded variable's gradient was
never one). Recording uses the graph's ``watch_variable`` method
where the graph has one (as TensorFlow's own variables do); everything else
is public TensorFlow API, and the Trackable hooks are methods of our own
class. Checked on TensorFlow 2.21.0 with Keras 3.15.1.
"""

from __future__ import annotations

import contextlib
import uuid

import tensorflow as tf

_SERVING_PREFIX = "replicator_serving_"


def combines_components(variable) -> bool:
  """Whether a read outside a step combines several components (sharded, or on-read SUM/MEAN)."""
  if variable.sharding is not None:
    return True
  return (variable.synchronization == tf.VariableSynchronization.ON_READ and
          variable.aggregation in (tf.VariableAggregation.SUM, tf.VariableAggregation.MEAN))


class Serving:
  """A variable's export state: its never-assigned handle of the global shape (made once, eagerly, when needed).

  The variable keeps one and makes a new one when its components change
  (a relayout); it hands it, and the component that exports it (its home),
  to the functions below.
  """

  def __init__(self):
    self._handle = None

  @property
  def handle(self) -> tf.Tensor | None:
    """The serving handle, or None if no function has read the variable yet."""
    return self._handle

  def handle_for(self, variable, home: tf.Variable) -> tf.Tensor:
    """The serving handle, made now (on ``home``'s device) if it is not yet."""
    if self._handle is None:
      with tf.init_scope(), tf.device(home.device):
        self._handle = tf.raw_ops.VarHandleOp(dtype=variable.dtype, shape=variable.shape,
                                              shared_name=_SERVING_PREFIX + uuid.uuid4().hex)
    return self._handle


def _unrecorded_read(component: tf.Variable) -> tf.Tensor:
  return tf.raw_ops.ReadVariableOp(resource=component.handle, dtype=component.dtype)


def servable_read(variable, serving: Serving, home: tf.Variable, combine) -> tf.Tensor:
  """Inside a function, outside a step: ``combine(read)`` (the components' value), or, once exported, the
  exported variable's. See the module docstring."""
  handle = serving.handle_for(variable, home)
  watch = getattr(tf.compat.v1.get_default_graph(), "watch_variable", None)
  if watch is not None:
    watch(variable)

  def exported():
    value = tf.raw_ops.ReadVariableOp(resource=handle, dtype=variable.dtype)
    value.set_shape(variable.shape)
    return value

  return tf.cond(tf.raw_ops.VarIsInitializedOp(resource=handle), exported,
                 lambda: combine(read=_unrecorded_read))


def _saves_devices(options) -> bool:
  policy = getattr(options, "experimental_variable_policy", None)
  return policy == tf.saved_model.experimental.VariablePolicy.SAVE_VARIABLE_DEVICES


def export_to_graph(variable, serving: Serving, home: tf.Variable, object_map, tensor_map, options) -> list:
  """``_export_to_saved_model_graph``: one variable of the global shape in the export graph.

  Maps every component's handle and the serving handle to it, except a
  component handle already mapped by the component's own export (Keras's
  ``model.export`` saves the components its functions read as objects of
  their own; their copies are the ones its graph restores). Exporting the
  variable again in the same save (Keras exports it once for each object
  that wraps it) reuses the copy. Returns the handles mapped to the copy, so
  that loading binds them to the loaded variable.
  """
  exported = object_map.get(variable)
  if exported is None:
    shape, dtype = variable.shape, variable.dtype
    with tf.device(home.device) if _saves_devices(options) else contextlib.nullcontext():
      # The component's concrete class (a resource variable) called directly: no
      # variable creator sees the copy. Its initializer never runs; loading
      # restores the saved value.
      exported = type(home)(
          initial_value=lambda: tf.zeros(shape, dtype), dtype=dtype, trainable=variable.trainable,
          name=variable.name.split(":")[0], synchronization=variable.synchronization,
          aggregation=variable.aggregation)
    object_map[variable] = exported
  captured = [component.handle for component in variable.components]
  if serving.handle is not None:
    captured.append(serving.handle)
  mapped = []
  for handle in captured:
    if tensor_map.get(handle) is None:
      tensor_map[handle] = exported.handle
    if tensor_map[handle] is exported.handle:
      mapped.append(handle)
  return mapped


def global_object_proto(variable, proto) -> None:
  """``_write_object_proto``, after the home component wrote itself into ``proto``: the global shape."""
  proto.variable.shape.CopyFrom(variable.shape.as_proto())
