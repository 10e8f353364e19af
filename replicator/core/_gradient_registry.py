"""Releasing tf.custom_gradient's graph-mode registrations once a step is built.

Why this module uses a TensorFlow private API: inside a traced function,
``tf.custom_gradient`` registers each call's backward function in TensorFlow's
global gradient registry (as "CustomGradient-<uid>") and never removes it. The
registered closure references the forward tensors, hence the whole traced
graph and every resource it captured: input iterators and variables stay alive
until interpreter exit (a memory leak per built step), and destroying tf.data
iterators during interpreter finalization can hang the process. The backward
functions are only used while the step is traced (GradientTape calls them at
trace time), so after tracing this module removes the registrations our
primitives made. There is no public API to unregister a gradient.

Checked on TensorFlow 2.21.0. If the registry moves, :func:`release` does
nothing (the leak returns, results stay correct).
"""

from __future__ import annotations

from collections.abc import Iterable

import tensorflow as tf

try:  # pylint: disable=g-import-not-at-top
  from tensorflow.python.framework import ops as _tf_ops  # private: see module docstring
  _REGISTRY = getattr(getattr(_tf_ops, "_gradient_registry", None), "_registry", None)
except ImportError:  # pragma: no cover
  _REGISTRY = None


def gradient_name(tensor: tf.Tensor) -> str | None:
  """The custom-gradient registration behind ``tensor``'s op, if it has one."""
  try:
    return tensor.op.get_attr("_gradient_op_type").decode()
  except (ValueError, AttributeError):
    return None


def release(names: Iterable[str]) -> int:
  """Removes the named gradient registrations; returns how many were removed."""
  if not isinstance(_REGISTRY, dict):
    return 0
  removed = 0
  for name in names:
    if _REGISTRY.pop(name, None) is not None:
      removed += 1
  return removed
