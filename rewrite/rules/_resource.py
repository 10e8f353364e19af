"""Rules for resource variables: reads give, and writes take, the variable's layout.

The layout of a variable's handle is given to the partitioner (``handle_layouts``).

A variable whose value is the sum of the devices' copies (on-read, ``SUM``
aggregation: a metric's total and count) keeps that invariant in the global
view: a read all-reduces the copies, a delta is added to the first device's
copy only, and an assigned value goes to the first device's copy, zeros to the
others'.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from rewrite.rules import _base


@_base.register("ReadVariableOp")
def read(view, layouts):
  if view.is_summed(0):  # (the sum of each device's component: one a device, where positions repeat one)
    axes = tuple(a for a in view.mesh.axis_names if view.mesh.shape[a] > 1 and a not in view.mesh.repeated_axes)
    reduce = [("sum", axes) if axes else None]
    return _base.Decision(inputs=[None], outputs=[_base.replicated(view.op.outputs[0].shape.rank)], reduce=reduce)
  out = layouts[0] if layouts[0] is not None else _base.replicated(view.op.outputs[0].shape.rank)  # a plain variable
  return _base.Decision(inputs=[None], outputs=[out])


@_base.register("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")
def write(view, layouts):
  if not view.is_summed(0):
    return _base.Decision(inputs=[None, layouts[0]], outputs=[])
  whole = _base.replicated(view.op.inputs[1].shape.rank)
  if view.op.type != "AssignVariableOp":
    return _base.Decision(inputs=[None, whole], outputs=[], once=True)  # the sum moves by the delta

  def lower(r, inputs):
    handle, value = inputs
    tf.raw_ops.AssignVariableOp(resource=handle, value=value if r == 0 else tf.zeros_like(value))
    return []

  return _base.Decision(inputs=[None, whole], outputs=[], lower=lower)


@_base.register("VariableShape")
def variable_shape(view, layouts):
  """The variable's global shape, on every device (as every shape in the traced step; a loop's gradient makes its
  weights' zeros from it)."""
  t = view.op.inputs[0]
  while t.name not in view.handle_shapes and t.op.type in ("Identity", "While", "StatelessWhile"):
    t = t.op.inputs[0 if t.op.type == "Identity" else t.value_index]  # (a loop passes a handle on unchanged)
  if t.name not in view.handle_shapes:
    return _base.fallback(view, layouts)
  shape = np.asarray(view.handle_shapes[t.name], dtype=view.attr("out_type").as_numpy_dtype)
  return _base.Decision(inputs=[None], outputs=[((),)], values={0: shape})


@_base.register("NoOp")
def no_op(view, layouts):
  return _base.Decision(inputs=[], outputs=[])
