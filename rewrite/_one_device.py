"""Reduce-to-one-device lowering: gather on the group's first device, then copy out.

Within one process, copies between logical devices of the same host share
memory, so this is one pass over the inputs plus cheap hand-offs. It builds
pure dataflow (no blocking ops), so it can never deadlock. The exchanges need
no central device: reduce_scatter and all_to_all split each input on its own
device and reduce or concatenate the chunks on the receiving device; permute
copies each source's value to its destination.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from rewrite import _errors
from rewrite import _lowering
from rewrite._plan import Collective

# A sum of large tensors runs as one XLA-compiled fused add: on TF 2.21 CPU,
# AddN of 4 x 16 MB took 5.6 ms and the XLA sum 3.2 ms (64 MB: 20.4 vs 11.4 ms),
# while up to 8 MB (inputs still in cache) AddN was as fast or faster (4 MB: 0.83
# vs 0.95 ms). Measured by benchmarks/throughput.py's methodology on 2 cores.
XLA_SUM_MIN_BYTES = 8 * 2 ** 20 + 1
_XLA_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


@tf.function(jit_compile=True, autograph=False)
def _xla_sum(values):
  total = values[0]
  for v in values[1:]:
    total = total + v
  return total


def _add(values: Sequence[tf.Tensor]) -> tf.Tensor:
  x = values[0]
  if (len(values) > 1 and x.dtype in _XLA_DTYPES and x.shape.is_fully_defined()
      and x.shape.num_elements() * x.dtype.size >= XLA_SUM_MIN_BYTES):
    return _xla_sum(list(values))
  return values[0] if len(values) == 1 else tf.add_n(list(values))


def reduce_values(op: str, values: Sequence[tf.Tensor]) -> tf.Tensor:
  """Elementwise reduction of same-shaped tensors with op sum/mean/max/min.

  Sums of more than 8 MB per tensor are one XLA-compiled fused add
  (:data:`XLA_SUM_MIN_BYTES`), smaller ones ``tf.add_n``.
  """
  n = len(values)
  if op in ("sum", "mean"):
    total = _add(values)
    if op == "sum":
      return total
    if total.dtype.is_integer:  # truncates toward zero, like tf.reduce_mean
      return tf.truncatediv(total, tf.constant(n, total.dtype))
    return total / tf.constant(n, total.dtype)
  if n == 1:
    return values[0]
  reducer = {"max": tf.math.reduce_max, "min": tf.math.reduce_min}[op]
  return reducer(tf.stack(list(values)), axis=0)


class OneDevice(_lowering.Lowering):
  """All-reduce/gather on the first device of each group, then identity copies.

  reduce_scatter, all_to_all and permute are point-to-point dataflow between
  the members' devices (no central device).
  """

  name = "one_device"

  def lower_group(self, collective: Collective, inputs, devices, ctx):
    _lowering.check_group_inputs(collective, inputs, devices)
    params = collective.param_dict
    n = len(devices)
    if collective.kind == "broadcast":
      source = inputs[params["source"]]
      return [source if i == params["source"] else _copy(source, d) for i, d in enumerate(devices)]
    if collective.kind == "permute":
      sources = {d: s for s, d in params["perm"]}
      outputs = []
      for i, (x, device) in enumerate(zip(inputs, devices)):
        with tf.device(device):
          outputs.append(tf.identity(inputs[sources[i]]) if i in sources else tf.zeros_like(x))
      return outputs
    if collective.kind in ("reduce_scatter", "all_to_all"):
      split = params["scatter_dimension" if collective.kind == "reduce_scatter" else "split_dimension"]
      chunks = []  # chunks[i][j]: member i's chunk for member j, on member i's device
      for x, device in zip(inputs, devices):
        with tf.device(device):
          chunks.append(tf.split(x, n, axis=split) if n > 1 else [x])
      outputs = []
      for j, device in enumerate(devices):
        with tf.device(device):
          received = [chunks[i][j] for i in range(n)]
          if collective.kind == "reduce_scatter":
            outputs.append(reduce_values(params["op"], received))
          else:
            outputs.append(tf.concat(received, axis=params["concat_dimension"]))
      return outputs
    root = params.get("root", 0)  # an all-reduce whose result one member uses: made there
    if collective.kind == "all_reduce" and params["op"] in ("sum", "mean") and len(set(devices)) < n:
      result = _summed_in_turn(params["op"], inputs, devices, devices[root])
      return [result if i == root else _copy(result, d) for i, d in enumerate(devices)]
    with tf.device(devices[root]):
      if collective.kind == "all_reduce":
        result = reduce_values(params["op"], inputs)
      elif collective.kind == "all_gather":
        result = tf.concat(list(inputs), axis=params["concat_dimension"])
      else:
        raise _errors.UnsupportedError(f"{self.name} cannot lower {collective.kind}.")
    return [result if i == root else _copy(result, d) for i, d in enumerate(devices)]


def _summed_in_turn(op: str, inputs, devices, root: str) -> tf.Tensor:
  """The sum (mean) of a group whose members share devices (a pipeline's microbatches: ``Mesh.with_repeats``).

  On each device its members' values are added one at a time, in the members' order, so that each is freed
  once added (the microbatches' gradients, each ready after its backward pass: a running sum, not every
  microbatch's gradient held until the last's); then the devices' sums on ``root``.
  """
  totals = {}
  for x, device in zip(inputs, devices):
    with tf.device(device):
      totals[device] = x if device not in totals else totals[device] + x
  with tf.device(root):
    total = reduce_values("sum", list(totals.values()))
    return total if op == "sum" else (tf.truncatediv(total, tf.constant(len(inputs), total.dtype))
                                      if total.dtype.is_integer else total / tf.constant(len(inputs), total.dtype))


def _copy(x: tf.Tensor, device: str) -> tf.Tensor:
  with tf.device(device):
    return tf.identity(x)


_lowering.register(OneDevice())
