"""Lowering onto TensorFlow's collective ops V2 (``CollectiveReduceV2`` and friends).

Each member runs its own collective op on its own device; the ops rendezvous by
group and instance key. On logical CPUs they need an ordering token per device
(without one they can hang), and the rewrite pass chains them per device in
plan order (``ordered_op_types``) so every device launches them in the same order.
This is the implementation that also works across worker processes.
"""

from __future__ import annotations

import threading

import tensorflow as tf

from rewrite import _lowering
from rewrite._plan import Collective

_MERGE = {"sum": ("Add", "Id"), "mean": ("Add", "Div"), "max": ("Max", "Id"), "min": ("Min", "Id")}


class CollectiveOps(_lowering.Lowering):
  """TF collective ops V2, one op per member device, ordered by per-device tokens.

  Args:
    timeout_seconds: how long a member waits for the others before failing
      (0 waits forever).
  """

  name = "collective_ops"
  ordered_op_types = frozenset({"CollectiveReduceV2", "CollectiveGatherV2"})

  def __init__(self, timeout_seconds: float = 0.0):
    self.timeout_seconds = timeout_seconds
    self._tokens: dict[str, tf.Variable] = {}
    self._group_keys: dict[tuple[str, ...], int] = {}
    self._lock = threading.Lock()

  def supports(self, collective: Collective) -> bool:
    return collective.dtype in (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64)

  def cache_key(self, collective):
    return None  # every instance needs its own instance key

  def _group_key(self, devices) -> int:
    with self._lock:
      key = tuple(devices)
      if key not in self._group_keys:
        self._group_keys[key] = _lowering.new_key()
      return self._group_keys[key]

  def external_value(self, key: str) -> tf.Tensor:
    device = key.split("@", 1)[1]
    with self._lock:
      if device not in self._tokens:
        with tf.init_scope(), tf.device(device):
          self._tokens[device] = tf.Variable(0.0, trainable=False, name="ordering_token")
      return self._tokens[device].handle

  def lower_group(self, collective: Collective, inputs, devices, ctx):
    _lowering.check_group_inputs(collective, inputs, devices)
    n = len(devices)
    params = collective.param_dict
    group_key = self._group_key(devices)
    instance_key = _lowering.new_key()
    outputs = []
    for i, (x, device) in enumerate(zip(inputs, devices)):
      token = ctx.external(f"token@{device}", tf.resource)
      with tf.device(device):
        common = dict(group_size=n, group_key=group_key, instance_key=instance_key,
                      ordering_token=[token], timeout_seconds=self.timeout_seconds)
        if collective.kind == "all_reduce":
          merge_op, final_op = _MERGE[params["op"]]
          y = tf.raw_ops.CollectiveReduceV2(input=x, merge_op=merge_op, final_op=final_op, **common)
        elif collective.kind == "broadcast":
          # Sum of the source's value and zeros elsewhere: shape-agnostic and
          # ordered like every other reduction.
          masked = x if i == params["source"] else tf.zeros_like(x)
          y = tf.raw_ops.CollectiveReduceV2(input=masked, merge_op="Add", final_op="Id", **common)
        elif collective.kind == "all_gather":
          axis = params["axis"]
          rank = x.shape.rank
          if axis == 0:
            y = tf.raw_ops.CollectiveGatherV2(input=x, **common)
          else:
            perm = [axis] + [d for d in range(rank) if d != axis]
            inverse = [perm.index(d) for d in range(rank)]
            y = tf.transpose(tf.raw_ops.CollectiveGatherV2(input=tf.transpose(x, perm), **common), inverse)
        else:
          raise NotImplementedError(f"{self.name} cannot lower {collective.kind}.")
        outputs.append(y)
    return outputs


_lowering.register(CollectiveOps())
