"""Rules for stateless random ops: each device draws only its piece of the global draw.

For "layouts do not change results" a random tensor must be the same global
tensor whatever the layout (dropout masks included). The Philox generator of
TensorFlow's stateless ops is counter-based: element ``i`` of a draw comes
from counter ``+ i // per_call``, so a device whose piece is a contiguous block
of the flattened tensor (a split of the first dimension) draws exactly that
block by starting from the counter advanced to the block's first element.
Other splits draw the whole tensor and slice it (the consumers' relayout).
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from rewrite import _rules

PHILOX = (1, 3)  # RNG_ALG_PHILOX and RNG_ALG_AUTO_SELECT (Philox on CPUs and GPUs)
_PER_CALL = {tf.float16: 4, tf.bfloat16: 4, tf.float32: 4, tf.float64: 2}  # samples per Philox call


def _advance(counter: tf.Tensor, steps: int) -> tf.Tensor:
  """The 128-bit Philox ``counter`` (two uint64 words, low first) advanced by ``steps``."""
  low = counter[0] + tf.constant(steps, tf.uint64)
  carry = tf.cast(low < counter[0], tf.uint64)
  return tf.concat([tf.stack([low, counter[1] + carry]), counter[2:]], axis=0)


@_rules.register("StatelessRandomUniformV2", "StatelessRandomNormalV2")
def stateless_random(view, layouts):
  shape, alg = view.const(0), view.const(3)
  out_rank = len(view.out_shape())
  whole = _rules.Decision(inputs=[None] * 4, outputs=[_rules.replicated(out_rank)])
  want = view.want()
  per_call = _PER_CALL.get(view.attr("dtype"))
  if shape is None or alg is None or int(alg) not in PHILOX or per_call is None or not want or not want[0]:
    return whole
  shape = [int(n) for n in shape]
  axes = want[0]
  k = view.shards(axes)
  block = shape[0] // k * math.prod(shape[1:])  # elements of each device's piece
  if shape[0] % k or block % per_call:
    return whole
  local = np.asarray([shape[0] // k] + shape[1:], dtype=view.const(0).dtype)
  op_type = view.op.type

  def lower(r, inputs):
    _, key, counter, algorithm = inputs
    start = view.mesh.axis_index(r, axes) * block
    draw = getattr(tf.raw_ops, op_type)
    return [draw(shape=tf.constant(local), key=key, counter=_advance(counter, start // per_call), alg=algorithm,
                 dtype=view.attr("dtype"))]

  return _rules.Decision(inputs=[None] * 4, outputs=[(axes,) + ((),) * (out_rank - 1)], lower=lower)
