"""Lowering onto TensorFlow's collective ops V2 (``CollectiveReduceV2`` and friends).

Each member runs its own collective op on its own device; the ops rendezvous by
group and instance key. On logical CPUs they need an ordering token per device
(without one they can hang), and the rewrite pass chains them per device in
plan order (``ordered_op_types``) so every device launches them in the same order.
This is the implementation that also works across worker processes.

Kinds and the ops they use (TF 2.21, measured on logical CPUs):

* all_reduce: ``CollectiveReduceV2``; broadcast: ``CollectiveReduceV2`` of the
  source's value and zeros; all_gather: ``CollectiveGatherV2`` (a ragged gather
  whose members differ in size gathers the sizes first and pads to the longest).
* all_to_all: ``CollectiveAllToAllV2``, which has a CPU kernel and works with
  ordering tokens. It exchanges slices along dimension 0 and needs dimension 0
  to equal the group size, so inputs are transposed and reshaped to
  ``[group_size, -1]`` around it.
* reduce_scatter: ``CollectiveReduceScatterV2`` has no CPU implementation
  (it fails with "CollectiveRegistry::Lookup did not find collective
  implementation" and aborts the process's collective executor), so it is an
  all-to-all of the chunks followed by a local reduction: half the traffic of
  all-reduce-then-slice, and about 2x faster on 4 logical CPUs (4 MB and 64 MB).
* permute: ``CollectivePermute`` is XLA/TPU-only. Each (source, destination)
  pair is a group of two: ``CollectiveBcastSendV2`` on the source,
  ``CollectiveBcastRecvV2`` on the destination, so a value crosses once, from
  its source to its destination, and members of no pair do nothing (a
  pipeline's neighbours, across worker processes too). A send finishes when
  its receiver has the value, so a device's sends and receives are ordered to
  make no cycle wait on itself: each device receives first and then sends,
  except one device of each cycle of the permutation, which sends first. These
  two ops take no ordering token; the rewrite pass chains them with the
  device's other collectives by control edges. ``permute="gather"`` lowers it
  as before instead: a ``CollectiveGatherV2`` of every member's value, from
  which each destination takes its source's (the group's size times the
  traffic; kept to measure against).
"""

from __future__ import annotations

import threading
import uuid

import tensorflow as tf

from rewrite import _errors
from rewrite import _lowering
from rewrite._plan import Collective

_MERGE = {"sum": ("Add", "Id"), "mean": ("Add", "Div"), "max": ("Max", "Id"), "min": ("Min", "Id")}


def ordering_token(device: str) -> tf.Tensor:
  """A resource handle on ``device`` that collectives take as ``ordering_token`` (made eagerly, now).

  TensorFlow's collective ops V2 on one device must run in one order in every
  process and on every device; a tf.function orders ops that use one resource,
  so each device's collectives share its token. It is a never-initialized
  variable's handle, made by ``VarHandleOp``: no kernel reads it, and no
  ``tf.variable_creator_scope`` around the caller (a Replicator's, a Keras
  distribution's) sees it, as it would a ``tf.Variable``.
  """
  with tf.init_scope(), tf.device(device):
    return tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[], shared_name=f"ordering_token_{uuid.uuid4().hex}")


class CollectiveOps(_lowering.Lowering):
  """TF collective ops V2, one op per member device, ordered by per-device tokens.

  Args:
    timeout_seconds: how long a member waits for the others before failing
      (0 waits forever).
    agreed_keys: keys every process of a multi-client job computes alike
      (``_lowering.AgreedKeys``), for groups whose members several processes
      build; by default keys are counted in this process.
    permute: ``"pairs"`` (a send and a receive for each source and
      destination) or ``"gather"`` (every member's value gathered on every
      member; the emulation to measure the pairs against).
  """

  name = "collective_ops"
  ordered_op_types = frozenset({"CollectiveReduceV2", "CollectiveGatherV2", "CollectiveAllToAllV2",
                                "CollectiveBcastSendV2", "CollectiveBcastRecvV2"})
  partial_groups = True
  fusible = True

  def __init__(self, timeout_seconds: float = 0.0, agreed_keys: bool = False, permute: str = "pairs"):
    if permute not in ("pairs", "gather"):
      raise _errors.ArgumentError(f"CollectiveOps(permute={permute!r}): expected 'pairs' or 'gather'.")
    self.timeout_seconds = timeout_seconds
    self.permute = permute
    self.keys = _lowering.AgreedKeys() if agreed_keys else _lowering.ProcessKeys()
    self._tokens: dict[str, tf.Tensor] = {}  # device -> its ordering token (a resource handle)
    self._lock = threading.Lock()

  def supports(self, collective: Collective) -> bool:
    return collective.dtype in (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64)

  def cache_key(self, collective):
    return None  # every instance needs its own instance key

  def external_value(self, key: str) -> tf.Tensor:
    device = key.split("@", 1)[1]
    with self._lock:
      if device not in self._tokens:
        self._tokens[device] = ordering_token(device)
      return self._tokens[device]

  def lower_group(self, collective: Collective, inputs, devices, ctx):
    _lowering.check_group_inputs(collective, inputs, devices)
    n = len(devices)
    params = collective.param_dict
    if collective.kind == "permute" and self.permute == "pairs":
      return self._permute_pairs(collective, params["perm"], inputs, devices)
    group_key = self.keys.group_key(devices)
    instance_key = self.keys.instance_key(group_key, collective)
    sizes_key = self.keys.instance_key(group_key, collective, "sizes") if collective.ragged else None
    outputs = []
    for i, (x, device) in enumerate(zip(inputs, devices)):
      if x is None:  # another process builds this member's op
        outputs.append(None)
        continue
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
          axis = params["concat_dimension"]
          rank = x.shape.rank
          perm = None if axis == 0 else [axis] + [d for d in range(rank) if d != axis]
          front = _transpose(x, perm)
          if collective.ragged and collective.shape[axis] is None:
            gathered = _ragged_gather(front, n, dict(common, instance_key=sizes_key), common)
          else:
            gathered = tf.raw_ops.CollectiveGatherV2(input=front, **common)
          y = _transpose(gathered, None if perm is None else [perm.index(d) for d in range(rank)])
        elif collective.kind == "reduce_scatter":
          received, inverse = _exchange(x, params["scatter_dimension"], n, common)
          y = _transpose(_reduce_first(params["op"], received, n), inverse)
        elif collective.kind == "all_to_all":
          received, inverse = _exchange(x, params["split_dimension"], n, common)
          y = tf.concat([_transpose(c, inverse) for c in tf.unstack(received, n)],
                        axis=params["concat_dimension"])
        elif collective.kind == "permute":
          sources = {d: s for s, d in params["perm"]}
          if not sources:
            y = tf.zeros_like(x)
          else:  # every member must join the gather, even if it is no source or destination
            everyone = tf.raw_ops.CollectiveGatherV2(input=tf.expand_dims(x, 0), **common)
            y = everyone[sources[i]] if i in sources else tf.zeros_like(x)
        else:
          raise _errors.UnsupportedError(f"{self.name} cannot lower {collective.kind}.")
        outputs.append(y)
    return outputs

  def _permute_pairs(self, collective: Collective, perm, inputs, devices) -> list:
    """A permute as one two-member group a pair: the source sends, the destination receives."""
    dest = {s: d for s, d in perm}
    source = {d: s for s, d in perm}
    keys = {}  # (source, destination) -> (group key, instance key), alike in every process
    for s, d in perm:
      if s != d:
        group_key = self.keys.group_key([devices[min(s, d)], devices[max(s, d)]])
        keys[(s, d)] = (group_key, self.keys.instance_key(group_key, collective, f"pair {s}->{d}"))
    outputs = []
    for i, (x, device) in enumerate(zip(inputs, devices)):
      if x is None:  # another process builds this member's ops
        outputs.append(None)
        continue
      with tf.device(device):
        common = dict(group_size=2, timeout_seconds=self.timeout_seconds)

        def send(i=i, x=x, common=common):
          group_key, instance_key = keys[(i, dest[i])]
          return tf.raw_ops.CollectiveBcastSendV2(input=x, group_key=group_key, instance_key=instance_key, **common)

        def receive(i=i, x=x, common=common):
          group_key, instance_key = keys[(source[i], i)]
          return tf.raw_ops.CollectiveBcastRecvV2(shape=tf.shape(x), T=x.dtype, group_key=group_key,
                                                  instance_key=instance_key, **common)

        order = []
        if dest.get(i, i) != i:
          order.append(send)
        if source.get(i, i) != i:
          order.insert(0 if not _leads_cycle(i, dest) else len(order), receive)
        done, received = [], None
        for op in order:
          with tf.control_dependencies(done[-1:]):
            y = op()
          done.append(y)
          if op is receive:
            received = y
        if received is None:
          received = tf.identity(x) if source.get(i) == i else tf.zeros_like(x)
        with tf.control_dependencies(done):  # a send no output reads would be pruned
          outputs.append(tf.identity(received))
    return outputs


def _leads_cycle(i: int, dest: dict[int, int]) -> bool:
  """Whether member ``i`` is the least of a cycle of ``dest`` (of two or more members): it sends first."""
  j = dest.get(i)
  for _ in range(len(dest)):  # (a permutation: from i, either back to i or to a member with no destination)
    if j is None or j == i:
      break
    if j < i:
      return False
    j = dest.get(j)
  return j == i


def _transpose(x: tf.Tensor, perm: list[int] | None) -> tf.Tensor:
  return x if perm is None else tf.transpose(x, perm)


def _exchange(x: tf.Tensor, split: int, n: int, common: dict) -> tuple[tf.Tensor, list[int] | None]:
  """All-to-all of ``x``'s n chunks along ``split``.

  Returns:
    The received chunks stacked in source order, ``[n, chunk...]`` with the
    split dimension moved first, and the permutation that moves it back
    (None if it was first already).
  """
  rank = x.shape.rank
  perm = None if split == 0 else [split] + [d for d in range(rank) if d != split]
  front = _transpose(x, perm)
  shape = tf.shape(front)
  # CollectiveAllToAllV2 needs dimension 0 to equal the group size.
  flat = tf.reshape(front, [n, -1])
  received = tf.raw_ops.CollectiveAllToAllV2(input=flat, **common)
  received = tf.reshape(received, tf.concat([[n, shape[0] // n], shape[1:]], 0))
  chunk = None if front.shape[0] is None else front.shape[0] // n
  received.set_shape([n, chunk] + front.shape[1:].as_list())
  return received, None if perm is None else [perm.index(d) for d in range(rank)]


def _ragged_gather(front: tf.Tensor, n: int, sizes_common: dict, common: dict) -> tf.Tensor:
  """All-gather along dimension 0 of inputs whose dimension 0 differs between members.

  ``CollectiveGatherV2`` needs equal shapes (it fails with "Shape mismatch in
  the collective instance" and aborts the collective executor), so members
  first gather their lengths, pad to the longest, gather, and drop the padding.
  """
  length = tf.shape(front)[:1]
  sizes = tf.raw_ops.CollectiveGatherV2(input=length, **sizes_common)  # [n], in member order
  longest = tf.reduce_max(sizes)
  padding = tf.concat([[[0, longest - length[0]]], tf.zeros([front.shape.rank - 1, 2], tf.int32)], 0)
  gathered = tf.raw_ops.CollectiveGatherV2(input=tf.pad(front, padding), **common)
  gathered = tf.reshape(gathered, tf.concat([[n, longest], tf.shape(front)[1:]], 0))
  return tf.boolean_mask(gathered, tf.sequence_mask(sizes, longest))


def _reduce_first(op: str, stacked: tf.Tensor, n: int) -> tf.Tensor:
  """Reduces over dimension 0 with op sum/mean/max/min (integer mean truncates)."""
  if op == "max":
    return tf.reduce_max(stacked, axis=0)
  if op == "min":
    return tf.reduce_min(stacked, axis=0)
  total = tf.reduce_sum(stacked, axis=0)
  if op == "sum":
    return total
  if total.dtype.is_integer:  # truncates toward zero, like tf.reduce_mean
    return tf.truncatediv(total, tf.constant(n, total.dtype))
  return total / tf.constant(n, total.dtype)


_lowering.register(CollectiveOps())
