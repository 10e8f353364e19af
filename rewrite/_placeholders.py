"""Placeholder nodes: stand-ins left in a replica's subgraph at a communication point.

While a replica's step is traced, a communication primitive does not
communicate. It adds a ``Placeholder`` node with the dtype and shape of its
result and records a :class:`Placeholder` describing what it needs. The plan
pass later matches these records across replicas and the apply pass replaces
each node with a real cross-device implementation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

from rewrite import _errors

PLACEHOLDER_SCOPE = "replicator_placeholder"

# The kinds of collective and their params (the primitive computes the result
# shape): all_reduce(op), broadcast(source), all_gather(concat_dimension),
# reduce_scatter(op, scatter_dimension), all_to_all(split_dimension,
# concat_dimension), permute(perm: sorted (source, destination) group positions).
KINDS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "permute")


@dataclasses.dataclass(frozen=True)
class Placeholder:
  """One communication point in one replica's subgraph.

  Attributes:
    replica: the replica (device position) whose subgraph holds the node.
    index: position among this replica's placeholders, in call order.
    kind: one of :data:`KINDS`.
    params: sorted ``(name, value)`` pairs, e.g. ``(("op", "sum"),)``.
    axes: mesh axes the collective communicates over.
    dtype: dtype of input and result.
    shape: static result shape (dimensions may be None).
    input_shape: static input shape.
    input: name of the input tensor in the traced graph.
    node: name of the placeholder node in the traced graph.
    device: device of the replica.
    location: where the user called the primitive ("file.py:12 in step_fn").
    call: the primitive call (several tensors of one nest share a call).
  """

  replica: int
  index: int
  kind: str
  params: tuple[tuple[str, Any], ...]
  axes: tuple[str, ...]
  dtype: tf.DType
  shape: tf.TensorShape
  input_shape: tf.TensorShape
  input: str
  node: str
  device: str
  location: str
  call: str

  @property
  def param_dict(self) -> dict[str, Any]:
    return dict(self.params)

  def describe(self) -> str:
    """A one-line human description: kind, params, dtype, shape, location."""
    params = ", ".join(f"{k}={v!r}" for k, v in self.params)
    axes = f", axis={self.axes if len(self.axes) != 1 else self.axes[0]!r}"
    return (f"{self.kind}({params}{axes}) of {self.dtype.name}{shape_str(self.input_shape)}"
            f" [{self.call}] at {self.location}")


def shape_str(shape: tf.TensorShape) -> str:
  if shape.rank is None:
    return "[<unknown rank>]"
  return "[" + ",".join("?" if d is None else str(d) for d in shape.as_list()) + "]"


def emit(x: tf.Tensor, *, replica: int, index: int, kind: str,
         params: dict[str, Any], axes: tuple[str, ...], result_shape: tf.TensorShape,
         device: str, location: str, call: str) -> tuple[tf.Tensor, Placeholder]:
  """Adds a placeholder node for a collective on ``x`` to the current graph.

  Args:
    x: the replica's input tensor.
    replica: replica id.
    index: call-order position within the replica.
    kind: one of :data:`KINDS`.
    params: kind-specific parameters (must be hashable values).
    axes: mesh axes of the collective.
    result_shape: static shape of the result.
    device: the replica's device.
    location: user source location for error messages.
    call: description of the primitive call.

  Returns:
    The placeholder's output tensor (stands for the collective's result) and
    the record describing it.
  """
  _check_kind(kind)
  with tf.name_scope(PLACEHOLDER_SCOPE):
    y = tf.raw_ops.Placeholder(dtype=x.dtype, shape=result_shape, name=kind)
  return y, _record(x, y.op.name, replica=replica, index=index, kind=kind, params=params, axes=axes,
                    result_shape=result_shape, device=device, location=location, call=call)


def emit_node(x, name: str, *, replica: int, index: int, kind: str, params: dict[str, Any], axes: tuple[str, ...],
              result_shape: tf.TensorShape, device: str, location: str,
              call: str) -> tuple[tf.compat.v1.NodeDef, Placeholder]:
  """:func:`emit` as a ``NodeDef`` named ``name`` (for a graph built as a ``GraphDef``), and its record.

  ``x`` needs only ``name``, ``dtype`` and ``shape`` (a tensor, or a node's
  output not made yet).
  """
  _check_kind(kind)
  node = tf.compat.v1.NodeDef(name=name, op="Placeholder", device=device)
  node.attr["dtype"].type = x.dtype.as_datatype_enum
  node.attr["shape"].shape.CopyFrom(tf.TensorShape(result_shape).as_proto())
  return node, _record(x, name, replica=replica, index=index, kind=kind, params=params, axes=axes,
                       result_shape=result_shape, device=device, location=location, call=call)


def _check_kind(kind: str) -> None:
  if kind not in KINDS:
    raise _errors.ArgumentError(f"Unknown collective kind {kind!r}; expected one of {KINDS}.")


def _record(x, node: str, *, replica, index, kind, params, axes, result_shape, device, location, call) -> Placeholder:
  return Placeholder(
      replica=replica, index=index, kind=kind,
      params=tuple(sorted(params.items())), axes=tuple(axes), dtype=x.dtype,
      shape=tf.TensorShape(result_shape), input_shape=x.shape, input=x.name,
      node=node, device=device, location=location, call=call)
