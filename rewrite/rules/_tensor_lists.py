"""Rules for ``TensorList`` ops: a list's layout is the layout of its elements, ``Contents((element_layout,))``.

TensorFlow 2 keeps a ``tf.TensorArray`` as a ``TensorList`` variant, and a
``tf.while_loop`` under a gradient tape pushes the intermediates its
gradient needs onto lists (accumulators), one element an iteration, which
the gradient's loop pops. Keras's recurrent layers (``LSTM``, ``GRU``) and
``tf.scan`` read the sequence from one list and write the outputs to
another. Every element of a list has one layout: a list made from a tensor
split along a dimension other than its first holds pieces of its elements;
an element set or pushed takes the list's layout (a whole one sliced, for
free). A list made empty (``EmptyTensorList``, ``TensorListReserve``) holds
nothing known, ``Contents(())``, until its consumers want pieces of
elements (a loop that pushes split values onto it): it is made with the
pieces' shape then.

Ops that state their elements' shape (an ``element_shape`` operand) get the
local shape: as a constant (``Decision.consts``), or, for a shape computed
in the step, divided on each device. A list's ``TensorListElementShape``
answers with the global shape, as every shape in the traced step is (a
loop's gradient makes its lists of zeros from it). A list op without a rule
here (``TensorListConcat``, ``TensorListSplit``), or one on a list holding
split values of a layout not known, falls back: refused if the list holds
split values (a list cannot be gathered). ``AddN`` of lists (a list's
gradients added up) is here too, its rule for tensors ``_elementwise``'s.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from rewrite.rules import _base
from rewrite.rules import _elementwise


def element(layout):
  """The layout of the elements of a list in ``layout`` (None: not known, or the list holds nothing known).

  The elements of a list of lists (a loop's accumulator in a loop) are lists: their layout is a ``Contents``.
  """
  if isinstance(layout, _base.Contents) and len(layout) == 1:
    return layout[0]
  return None


def holding(element_layout) -> _base.Contents:
  """The layout of a list whose elements are in ``element_layout``."""
  return _base.Contents((element_layout,))


def _local_shape(view, index: int, layout) -> dict:
  """What makes the element shape operand ``index`` (a global shape) the pieces' shape in ``layout``.

  ``Decision`` arguments: ``consts`` for a constant shape; a ``lower`` that
  divides it on each device for a computed one (a list's
  ``TensorListElementShape``); none where the elements are whole or the shape
  is of unknown rank (``-1``). Unknown dimensions (``-1``) take any piece.
  """
  if layout is None or isinstance(layout, _base.Contents) or not any(layout):
    return {}  # (a list of lists: its elements are scalars)
  value = view.const(index)
  if value is not None:
    if np.ndim(value) != 1 or len(value) != len(layout):
      return {}
    value = np.asarray(value)
    return {"consts": {index: np.asarray([n if n < 0 or not axes else n // view.shards(axes)
                                          for n, axes in zip(value, layout)], dtype=value.dtype)}}
  shards = [view.shards(axes) for axes in layout]
  op = view.op
  inferred = {name for arg in op.op_def.input_arg for name in (arg.type_attr, arg.number_attr, arg.type_list_attr)}
  attrs = {a.name: op.get_attr(a.name) for a in op.op_def.attr if a.name not in inferred}
  names = [arg.name for arg in op.op_def.input_arg]

  def lower(r, inputs):  # the op again, its element shape divided on each device
    inputs = list(inputs)
    inputs[index] = tf.math.floordiv(inputs[index], tf.constant(shards, inputs[index].dtype))
    outputs = getattr(tf.raw_ops, op.type)(**dict(zip(names, inputs)), **attrs)
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]

  return {"lower": lower}


def _divides(view, index: int, layout) -> bool:
  """Whether the element shape operand ``index`` (if constant) splits into pieces in ``layout``."""
  value = view.const(index)
  if value is None or np.ndim(value) != 1 or isinstance(layout, _base.Contents):
    return True
  return len(value) == len(layout) and all(n < 0 or not axes or n % view.shards(axes) == 0
                                           for n, axes in zip(np.asarray(value).tolist(), layout))


def _wanted_element(view, index: int = 0):
  """The element layout the consumers of list output ``index`` want, or None."""
  return element(view.want(index))


@_base.register("EmptyTensorList", "TensorListReserve")
def new_list(view, layouts):
  """An empty list: holds nothing known, or, where its consumers want them, pieces of elements.

  Its element shape, a global one, becomes the pieces' shape: a constant
  one is replaced, one computed in the step (a list's
  ``TensorListElementShape``, which answers globally) is divided on each
  device.
  """
  want = _wanted_element(view)
  if want is None or not _divides(view, 0, want):
    return _base.Decision(inputs=[None] * len(layouts), outputs=[_base.Contents(())])
  return _base.Decision(inputs=[None] * len(layouts), outputs=[holding(want)], **_local_shape(view, 0, want))


@_base.register("TensorListFromTensor")
def from_tensor(view, layouts):
  """A list of a tensor's rows: its elements keep the tensor's split of their dimensions (its first whole), or
  take the split its consumers want (a loop that falls back wants them whole: a list cannot be gathered)."""
  layout = layouts[0]
  if layout is None:
    return _base.fallback(view, layouts)
  want = _wanted_element(view)
  if want is not None and not isinstance(want, _base.Contents) and len(want) == len(layout) - 1 and _divides(
      view, 1, want):
    elements = tuple(want)
  else:
    elements = tuple(layout[1:])
  return _base.Decision(inputs=[((),) + elements, None], outputs=[holding(elements)],
                        **_local_shape(view, 1, elements))


@_base.register("TensorListStack", "TensorListGather")
def stack(view, layouts):
  """The elements (all, or those at the indices) stacked: a new first dimension, whole; the others as theirs."""
  elements = element(layouts[0])
  shape_at = 1 if view.op.type == "TensorListStack" else 2
  if isinstance(elements, _base.Contents):  # (lists stacked: a tensor of variants, not followed)
    return _base.fallback(view, layouts)
  if elements is None:
    elements = _base.replicated(view.op.outputs[0].shape.rank - 1) if view.op.outputs[0].shape.rank else None
    if elements is None or _base.holds_split(layouts[0] if isinstance(layouts[0], _base.Contents) else ()):
      return _base.fallback(view, layouts)
  inputs = [None] * len(layouts)
  if view.op.type == "TensorListGather":
    inputs[1] = _base.replicated(_base.rank_of(view.op.inputs[1]))
  return _base.Decision(inputs=inputs, outputs=[((),) + tuple(elements)], **_local_shape(view, shape_at, elements))


@_base.register("TensorListGetItem")
def get_item(view, layouts):
  """One element, in the list's element layout."""
  elements = element(layouts[0])
  if elements is None:
    if _base.holds_split(layouts[0] if isinstance(layouts[0], _base.Contents) else ()):
      return _base.fallback(view, layouts)
    elements = _base.replicated(_base.rank_of(view.op.outputs[0]))
  return _base.Decision(inputs=[None, (), None], outputs=[elements], **_local_shape(view, 2, elements))


@_base.register("TensorListSetItem", "TensorListPushBack")
def set_item(view, layouts):
  """An element written: in the list's element layout (sliced, or gathered, to it); a list holding nothing known
  takes the element's layout (wanted of the list's maker, which makes it with the pieces' shape)."""
  value = len(layouts) - 1  # (SetItem: list, index, item; PushBack: list, tensor)
  elements, item = element(layouts[0]), layouts[value]
  if item is None:
    return _base.fallback(view, layouts)
  if elements is None:
    if _base.holds_split(layouts[0] if isinstance(layouts[0], _base.Contents) else ()):
      return _base.fallback(view, layouts)
    elements = item if isinstance(item, _base.Contents) else _base.with_wanted(item, _wanted_element(view))
    # A list holding nothing known: its maker is asked for pieces (a list of unknown layout is left as it is).
    inputs = [holding(elements) if isinstance(layouts[0], _base.Contents) else None] + [()] * (value - 1) + [elements]
  else:
    inputs = [None] + [()] * (value - 1) + [elements]
  return _base.Decision(inputs=inputs, outputs=[holding(elements)])


@_base.register("TensorListPopBack")
def pop_back(view, layouts):
  """The last element, in the list's element layout; the list without it."""
  elements = element(layouts[0])
  if elements is None:
    if _base.holds_split(layouts[0] if isinstance(layouts[0], _base.Contents) else ()):
      return _base.fallback(view, layouts)
    elements = _base.replicated(_base.rank_of(view.op.outputs[1]))
  return _base.Decision(inputs=[None, None], outputs=[layouts[0], elements], **_local_shape(view, 1, elements))


@_base.register("TensorListScatterV2", "TensorListScatter", "TensorListScatterIntoExistingList")
def scatter(view, layouts):
  """Rows of a tensor written at indices: the elements keep the tensor's split of their dimensions."""
  into = view.op.type == "TensorListScatterIntoExistingList"
  tensor = layouts[1] if into else layouts[0]
  if tensor is None:
    return _base.fallback(view, layouts)
  elements = element(layouts[0]) if into else None
  if elements is None:
    if into and _base.holds_split(layouts[0] if isinstance(layouts[0], _base.Contents) else ()):
      return _base.fallback(view, layouts)
    elements = _base.with_wanted(tuple(tensor[1:]), _wanted_element(view))
  indices = _base.replicated(_base.rank_of(view.op.inputs[2 if into else 1]))
  if into:
    inputs = [holding(elements) if isinstance(layouts[0], _base.Contents) and element(layouts[0]) is None else None,
              ((),) + tuple(elements), indices]
    return _base.Decision(inputs=inputs, outputs=[holding(elements)])
  inputs = [((),) + tuple(elements), indices] + [None] * (len(layouts) - 2)
  return _base.Decision(inputs=inputs, outputs=[holding(elements)], **_local_shape(view, 2, elements))


@_base.register("TensorListLength")
def length(view, layouts):
  return _base.Decision(inputs=[None], outputs=[()])


@_base.register("TensorListElementShape")
def element_shape(view, layouts):
  """The elements' shape, global: a device's list of pieces answers with the pieces' shape, multiplied back."""
  elements = element(layouts[0])
  if elements is None:
    if _base.holds_split(layouts[0] if isinstance(layouts[0], _base.Contents) else ()):
      return _base.fallback(view, layouts)
    return _base.Decision(inputs=[None], outputs=[_base.replicated(_base.rank_of(view.op.outputs[0]))])
  out = [_base.replicated(_base.rank_of(view.op.outputs[0]))]
  if not any(elements):
    return _base.Decision(inputs=[None], outputs=out)
  shards = [view.shards(axes) for axes in elements]
  shape_type = view.op.get_attr("shape_type")

  def lower(r, inputs):
    shape = tf.raw_ops.TensorListElementShape(input_handle=inputs[0], shape_type=shape_type)
    return [tf.where(shape < 0, shape, shape * tf.constant(shards, shape_type))]  # (-1: a dimension of any size)

  return _base.Decision(inputs=[None], outputs=out, lower=lower)


@_base.register("TensorListResize")
def resize(view, layouts):
  return _base.Decision(inputs=[None, ()], outputs=[layouts[0]])


@_base.register("AddN")  # (after _elementwise's, imported above: this one also takes lists)
def add_n(view, layouts):
  """A sum of lists (a list's gradients added up: element by element) holds what they hold; of tensors, as any
  elementwise sum (``_elementwise``)."""
  if view.op.outputs[0].dtype != tf.variant:
    return _elementwise.binary(view, layouts)
  known = {element(layout) for layout in layouts} - {None}
  if len(known) > 1:
    return _base.fallback(view, layouts)
  out = holding(known.pop()) if known else _base.Contents(())
  return _base.Decision(inputs=[None] * len(layouts), outputs=[out])


MAKERS = ("TensorListFromTensor", "EmptyTensorList", "TensorListReserve")  # their lists take the layout wanted
