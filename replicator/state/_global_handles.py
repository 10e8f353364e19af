"""Global-shaped stand-in variables for the global view's trace (TensorFlow internals, isolated here).

While a global-view step is traced, every replicated variable presents a
variable of its GLOBAL shape: an eager resource handle (``VarHandleOp`` with
that shape and dtype) that is never assigned, so it holds no memory, wrapped
as a resource variable so that reads, writes and ``tf.GradientTape`` (which
watches ``.handle``) behave as for any variable. The traced graph captures the
handle; the partitioner maps it to each device's component.

Why internals: no public API builds a ``tf.Variable`` around an existing
handle, nor a handle with shape information for function captures
(``_variable_handle_from_shape_and_dtype`` sets it). Checked on TensorFlow 2.21.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops  # pylint: disable=g-direct-tensorflow-import


def global_variable(shape: tf.TensorShape, dtype: tf.DType, name: str, trainable: bool) -> tf.Variable:
  """A variable of ``shape`` whose handle is never assigned (no memory)."""
  with tf.init_scope():
    handle = resource_variable_ops._variable_handle_from_shape_and_dtype(  # pylint: disable=protected-access
        tf.TensorShape(shape), dtype, None, "global_view", False)
    return resource_variable_ops.BaseResourceVariable(
        trainable=trainable, shape=tf.TensorShape(shape), dtype=dtype, handle=handle, name=name,
        unique_id=f"{name}_global_view_{id(handle)}", handle_name=name, in_graph_mode=False)
