"""Hierarchical lowering for groups that span worker processes.

Across a network the cost is the bytes each worker sends, not the number of
devices. So a group is reduced in two levels: the members on one task
(worker process) are combined on the task's first member device (pure
dataflow, as in ``one_device``), the task leaders run one TF collective op
across tasks (``collective_ops``, with its timeout), and each leader copies
the result to its task's members. Each worker sends one tensor per collective
instead of one per device.

Kinds: all_reduce and broadcast. Other kinds use ``collective_ops`` for the
whole group (the plan picks per collective).
"""

from __future__ import annotations

import tensorflow as tf

from rewrite import _errors
from rewrite import _lowering
from rewrite._collective_ops import CollectiveOps
from rewrite._one_device import reduce_values
from rewrite._plan import Collective

_CROSS_TASK_OP = {"sum": "sum", "mean": "sum", "max": "max", "min": "min"}


class Hierarchical(_lowering.Lowering):
  """Reduce within each task, one collective op across tasks, copy back.

  In a multi-client job each process builds its own task's part: the
  reduction of its members, its leader's cross-task op, the copies back.

  Args:
    timeout_seconds: timeout of the cross-task collective op (0: none).
    agreed_keys: keys every process computes alike (see :class:`CollectiveOps`).
  """

  name = "hierarchical"
  partial_groups = True
  fusible = True

  def __init__(self, timeout_seconds: float = 0.0, agreed_keys: bool = False):
    self._across = CollectiveOps(timeout_seconds, agreed_keys)
    self.ordered_op_types = self._across.ordered_op_types

  @property
  def timeout_seconds(self) -> float:
    return self._across.timeout_seconds

  def supports(self, collective: Collective) -> bool:
    return collective.kind in ("all_reduce", "broadcast") and self._across.supports(collective)

  def cache_key(self, collective):
    return None  # the cross-task op needs its own instance key

  def external_value(self, key: str) -> tf.Tensor:
    return self._across.external_value(key)

  def lower_group(self, collective: Collective, inputs, devices, ctx):
    _lowering.check_group_inputs(collective, inputs, devices)
    if not self.supports(collective):
      raise _errors.UnsupportedError(f"{self.name} cannot lower {collective.kind} of {collective.dtype.name}.")
    params = collective.param_dict
    tasks: dict[str, list[int]] = {}
    for i, device in enumerate(devices):
      tasks.setdefault(_lowering.task_of(device), []).append(i)
    leaders = [members[0] for members in tasks.values()]
    # A task whose members another process builds (a multi-client job) takes no part here: None.
    built = [all(inputs[i] is not None for i in members) for members in tasks.values()]
    if any(inputs[i] is not None for members, b in zip(tasks.values(), built) if not b for i in members):
      raise _errors.RewriteError(f"{self.name}: a task's members must all be built in one process.")
    op = "sum" if collective.kind == "broadcast" else params["op"]

    def task_value(members):  # on the task's first member: its part of the whole
      with tf.device(devices[members[0]]):
        if collective.kind == "broadcast":
          source = params["source"]
          return tf.identity(inputs[source]) if source in members else tf.zeros_like(inputs[members[0]])
        return reduce_values("sum" if op == "mean" else op, [inputs[i] for i in members])

    local = [task_value(members) if b else None for members, b in zip(tasks.values(), built)]
    # One member a task (a worker of one device): the cross-task op divides as it merges (its final op), no
    # separate pass over the result.
    fused_mean = op == "mean" and len(tasks) == len(devices) and collective.dtype.is_floating
    across = Collective(index=collective.index, kind="all_reduce",
                        params=(("op", "mean" if fused_mean else _CROSS_TASK_OP[op]),),
                        axes=collective.axes, dtype=collective.dtype, shape=collective.shape,
                        members=collective.members, groups=collective.groups, implementation=self.name,
                        devices=collective.devices)
    combined = self._across.lower_group(across, local, [devices[i] for i in leaders], ctx)
    outputs = [None] * len(devices)
    for members, value in zip(tasks.values(), combined):
      if value is None:
        continue
      with tf.device(devices[members[0]]):
        if collective.kind == "all_reduce" and op == "mean" and not fused_mean:
          value = _divide(value, len(devices))
      for i in members:
        with tf.device(devices[i]):
          outputs[i] = tf.identity(value)
    return outputs


def _divide(total: tf.Tensor, n: int) -> tf.Tensor:
  if total.dtype.is_integer:  # truncates toward zero, like tf.reduce_mean
    return tf.truncatediv(total, tf.constant(n, total.dtype))
  return total / tf.constant(n, total.dtype)


_lowering.register(Hierarchical())
