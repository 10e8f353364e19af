"""All-or-nothing steps: a call of ``repl.run`` that fails at run time writes no variable on any device.

A step runs on every device at once, and TensorFlow aborts a function call at
its first failing op (a ``tf.debugging.assert_*``, a ``check_numerics``, an
out-of-range index): by then some devices may have written some variables,
and a sharded variable may be half updated. Nothing in a graph can undo a
write, so the step keeps the values to return to:

1. at the start of the call, each component the step writes is read and the
   value kept in a *shadow* variable of its own (one per component, on its
   device). TensorFlow variables are copy-on-write: a kept value shares the
   variable's buffer, and the step's first in-place update of the variable
   copies it instead (one copy per written variable per call, the whole cost
   in time; its memory is held only while the call runs);
2. every op of the step that uses a written variable waits for its value to
   be kept (the step's handles pass through a ``tf.identity`` with the
   keeping as control input);
3. when every op of the call has run, the shadows are emptied (released);
4. if the call fails, the shadows still hold the values of before the call:
   :meth:`Snapshot.restore` writes them back (from Python), and empties them.

A loop of ``steps=k`` is one call: it succeeds or fails as a whole. Input read
by a failed call stays read (an iterator cannot be rewound). Random draws from
a ``tf.random.Generator`` are state in a variable, restored with the rest.
Only public ops are used.
"""

from __future__ import annotations

import tensorflow as tf

from replicator import _variables


class Snapshot:
  """The shadows of the variable components a step writes.

  Args:
    written: ``(name in the step's graph, eager resource handle)`` of every
      captured handle the step writes (handles of components the Replicator
      made, or their first-run flags; others are skipped).
  """

  def __init__(self, written: list[tuple[str, tf.Tensor]]):
    self._pairs: list[tuple[str, tf.Variable, tf.Variable]] = []  # (name, component, shadow)
    with tf.init_scope():
      for name, handle in written:
        component = _variables.component_of(handle)
        if component is None:
          continue
        with tf.device(component.device), _variables._creating_components():  # pylint: disable=protected-access
          shadow = _variables._new_component(  # pylint: disable=protected-access
              initial_value=tf.zeros([0], component.dtype), shape=tf.TensorShape(None), trainable=False,
              name="shadow")
        self._pairs.append((name, component, shadow))

  def __len__(self) -> int:
    return len(self._pairs)

  @property
  def names(self) -> list[str]:
    """The step graph's names of the handles the step writes (those kept)."""
    return [name for name, _, _ in self._pairs]

  def keep(self, input_map: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    """In the function being built: keeps every written value; ``input_map`` with their handles made to wait."""
    gated = dict(input_map)
    for name, component, shadow in self._pairs:
      handle = input_map[name]
      with tf.device(component.device):
        kept = shadow.assign(tf.raw_ops.ReadVariableOp(resource=handle, dtype=component.dtype), read_value=False)
        with tf.control_dependencies([kept]):
          gated[name] = tf.identity(handle)
    return gated

  def release(self, ops: list[tf.Operation]) -> None:
    """In the function being built: empties the shadows once every op of ``ops`` has run."""
    if not self._pairs:
      return
    with tf.control_dependencies(ops):
      done = tf.no_op(name="step_done")
    empty = {}
    with tf.control_dependencies([done]):
      for _, component, shadow in self._pairs:
        key = (component.device, component.dtype)
        if key not in empty:
          with tf.device(component.device):
            empty[key] = tf.zeros([0], component.dtype)
        with tf.device(component.device):
          shadow.assign(empty[key], read_value=False)

  def restore(self) -> int:
    """After a failed call: writes back every kept value; returns how many components were restored."""
    restored = 0
    for _, component, shadow in self._pairs:
      value = shadow.read_value()
      if value.shape == component.shape:  # kept by the failed call (an emptied shadow is [0])
        component.assign(value)
        restored += 1
      shadow.assign(tf.zeros([0], component.dtype))
    return restored


def function_ops() -> list[tf.Operation]:
  """The operations of the graph being built so far (what :meth:`Snapshot.release` waits for).

  Not placeholders: an imported step's placeholders whose values are mapped
  to other tensors stay in the graph, unfed, and must not run.
  """
  return [op for op in tf.compat.v1.get_default_graph().get_operations() if op.type != "Placeholder"]
