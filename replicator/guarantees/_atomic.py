"""All-or-nothing steps: a call of ``repl.run`` that fails at run time writes no variable on any device.

A step runs on every device at once, and TensorFlow aborts a function call at
its first failing op (a ``tf.debugging.assert_*``, a ``check_numerics``, an
out-of-range index): by then some devices may have written some variables,
and a sharded variable may be half updated. Nothing in a graph can undo a
write. Most writes need no undoing: they wait for every op that can fail
(``_ordered_writes``). The variables written before such an op (and, in a
call of several steps, every written variable) are kept instead, here:

1. at the start of the call, each component the step writes is read, and the
   values of one device and dtype are kept together in one *shadow* variable
   on that device, as a list (a ``TensorList``; a few shadows in all, not one
   per component). TensorFlow variables are copy-on-write: a kept value shares
   the variable's buffer, and the step's first in-place update of the variable
   copies it instead (one copy per written variable per call: the whole cost in
   time; its memory is held only while the call runs);
2. every op of the step that uses a written variable waits for the values of
   its device to be kept (the device's handles pass through one
   ``tf.identity`` with the keeping as control input, ``_captures``);
3. when every op of the call has run, the shadows are emptied;
4. if the call fails, a shadow holding a full list still has the values of
   before the call: :meth:`Snapshot.restore` writes them back (from Python),
   and empties it. A shadow is written once, whole, so it is either full or
   empty; an empty one's variables were not written (their uses wait for it).

A loop of ``steps=k`` is one call: it succeeds or fails as a whole. Input read
by a failed call stays read (an iterator cannot be rewound). Random draws from
a ``tf.random.Generator`` are state in a variable, restored with the rest.
Only public ops are used (``tf.raw_ops`` TensorList ops).
"""

from __future__ import annotations

import tensorflow as tf

from replicator.state import _variables


def _empty_list(dtype: tf.DType) -> tf.Tensor:
  return tf.raw_ops.EmptyTensorList(element_shape=tf.constant(-1), max_num_elements=-1, element_dtype=dtype)


class _Group:
  """The written components of one device and dtype, and the shadow that keeps their values."""

  def __init__(self, device: str, dtype: tf.DType):
    self.device, self.dtype = device, dtype
    self.members: list[tuple[str, tf.Variable]] = []  # (step graph name of the handle, component)
    with tf.init_scope(), tf.device(device), _variables.creating_components():
      self.shadow = _variables.new_component(initial_value=_empty_list(dtype), trainable=False,
                                              name="kept_before_step")


class AllOrNothing:
  """What a step's calls keep to be all or nothing.

  A call of one step writes its variables only after every op that can fail
  (``_ordered_writes``): it keeps only the variables written before such an op
  (``kept``; usually none). A call of several steps (an in-graph loop) keeps
  every variable the step writes (``whole``): a later step can fail after an
  earlier one wrote.

  Args:
    written: ``(name in the step's graph, eager resource handle)`` of every
      captured handle the step writes.
    kept: the names of the placeholders (ops) among them whose values a call of
      one step must keep.
  """

  def __init__(self, written: list[tuple[str, tf.Tensor]], kept):
    self.whole = Snapshot(written)
    kept = [(name, handle) for name, handle in written if name.split(":")[0] in kept]
    self.kept = Snapshot(kept) if kept else None

  def for_call(self, one_step: bool) -> "Snapshot | None":
    """The snapshot a call of one step (``one_step``) or of several keeps (None: nothing to keep)."""
    return self.kept if one_step else self.whole

  def restore(self) -> int:
    """After a failed call: writes back what it kept; returns how many components were restored."""
    return self.whole.restore() + (self.kept.restore() if self.kept is not None else 0)


def input_map(snapshot: "Snapshot | None", captures, put_back: bool = False) -> dict[str, tf.Tensor]:
  """In the function being built: ``captures``' input map, through ``snapshot`` if there is one (atomic)."""
  return captures.input_map() if snapshot is None else snapshot.input_map(captures, put_back)


class Snapshot:
  """The shadows of the variable components a step writes.

  Args:
    written: ``(name in the step's graph, eager resource handle)`` of every
      captured handle the step writes (handles of components the Replicator
      made, or their first-run flags; others are skipped).
  """

  def __init__(self, written: list[tuple[str, tf.Tensor]]):
    groups: dict[tuple[str, tf.DType], _Group] = {}
    self._group_of: dict[str, _Group] = {}
    for name, handle in written:
      component = _variables.component_of(handle)
      if component is None:
        continue
      key = (component.device, component.dtype)
      if key not in groups:
        groups[key] = _Group(*key)
      groups[key].members.append((name, component))
      self._group_of[name] = groups[key]
    self._groups = list(groups.values())

  def input_map(self, captures, put_back: bool = False) -> dict[str, tf.Tensor]:
    """In the function being built: ``captures``' input map, the written values kept before any use of them.

    ``put_back``: for a function called in another function's graph (Keras's,
    or the user's), where a failure reaches code that cannot :meth:`restore`:
    a shadow still full at the start of a call was left by such a failed call,
    and its values are written back first, so that the call starts from the
    state before the failed one. (A ``tf.cond`` per shadow: it costs a step's
    build more than its run, so calls from Python, which restore at once,
    leave it out.)
    """
    return captures.input_map(gate=lambda handles: self._keep(handles, put_back))

  def _keep(self, handles: dict[str, tf.Tensor], put_back: bool) -> list[tf.Operation]:
    """Keeps the values of the written ones among ``handles`` (one device's); the ops to wait for."""
    kept = []
    for group in {id(g): g for g in (self._group_of.get(n) for n in handles) if g is not None}.values():
      if not all(name in handles for name, _ in group.members):
        raise AssertionError("a device's written handles are captured together")  # Captures stacks per device
      with tf.device(group.device):
        with tf.control_dependencies([self._put_back_if_full(group, handles)] if put_back else []):
          values = _empty_list(group.dtype)
          for name, component in group.members:
            read = tf.raw_ops.ReadVariableOp(resource=handles[name], dtype=component.dtype)
            values = tf.raw_ops.TensorListPushBack(input_handle=values, tensor=read)
        kept.append(tf.raw_ops.AssignVariableOp(resource=group.shadow.handle, value=values))
    return kept

  @staticmethod
  def _put_back_if_full(group: _Group, handles: dict[str, tf.Tensor]) -> tf.Tensor:
    """In the function being built: writes back the values ``group``'s shadow holds, if it holds them all."""
    held = tf.raw_ops.ReadVariableOp(resource=group.shadow.handle, dtype=tf.variant)
    full = tf.equal(tf.raw_ops.TensorListLength(input_handle=held), len(group.members))

    def put_back():
      writes = [tf.raw_ops.AssignVariableOp(
          resource=handles[name], value=tf.raw_ops.TensorListGetItem(
              input_handle=held, index=i, element_shape=tf.constant(-1), element_dtype=group.dtype))
                for i, (name, _) in enumerate(group.members)]
      with tf.control_dependencies(writes):
        return tf.constant(True)

    return tf.cond(full, put_back, lambda: tf.constant(False))

  def release(self, ops: list[tf.Operation]) -> None:
    """In the function being built: empties the shadows once every op of ``ops`` has run."""
    if not self._groups:
      return
    by_device: dict[str, list[tf.Operation]] = {}
    for op in ops:
      by_device.setdefault(op.device, []).append(op)
    done = []  # one wait per device: a control edge between devices costs a send and a receive
    for device, group in by_device.items():
      with tf.device(device), tf.control_dependencies(group):
        done.append(tf.no_op(name="step_done"))
    with tf.control_dependencies(done):
      for group in self._groups:
        with tf.device(group.device):
          tf.raw_ops.AssignVariableOp(resource=group.shadow.handle, value=_empty_list(group.dtype))

  def restore(self) -> int:
    """After a failed call: writes back every kept value; returns how many components were restored."""
    restored = 0
    for group in self._groups:
      with tf.device(group.device):
        values = group.shadow.read_value()
        if int(tf.raw_ops.TensorListLength(input_handle=values)) == len(group.members):  # kept by the failed call
          for i, (_, component) in enumerate(group.members):
            component.assign(tf.raw_ops.TensorListGetItem(input_handle=values, index=i,
                                                          element_shape=tf.constant(-1), element_dtype=group.dtype))
            restored += 1
        group.shadow.assign(_empty_list(group.dtype))
    return restored


def function_ops(outputs) -> list[tf.Operation]:
  """What :meth:`Snapshot.release` waits for: every op of the function being built that runs, by its sinks.

  A function runs only the ops its outputs or its stateful ops need (the rest
  is pruned), so an op that can fail is one of those or runs before them:
  waiting for the stateful ops and the ops of ``outputs`` waits for all. Not
  placeholders: an imported step's placeholders whose values are mapped to
  other tensors stay in the graph, unfed, and must not run.
  """
  ops = [op for op in tf.compat.v1.get_default_graph().get_operations()
         if op.type != "Placeholder" and op.op_def.is_stateful]
  ops += [t.op for t in tf.nest.flatten(outputs) if isinstance(t, tf.Tensor) and t.op.type != "Placeholder"]
  return ops
