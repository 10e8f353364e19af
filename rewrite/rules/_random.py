"""Rules for random ops: every device's numbers are those of the one draw one device would make.

Stateless ops: each device draws only its piece of the global draw. For
"layouts do not change results" a random tensor must be the same global
tensor whatever the layout (dropout masks included). The Philox generator of
TensorFlow's stateless ops is counter-based: element ``i`` of a draw comes
from counter ``+ i // per_call``, so a device whose piece is a contiguous block
of the flattened tensor (a split of the first dimension) draws exactly that
block by starting from the counter advanced to the block's first element.
Other splits draw the whole tensor and slice it (the consumers' relayout).

Stateful ops (``tf.random.uniform``, ``tf.nn.dropout`` without a seed): each
device's copy has its own generator, seeded from the op's ``seed`` and
``seed2``; with both 0 (no seed given) each copy seeds itself at random, and
the devices would draw different numbers for one replicated tensor (the
pieces of a split activation masked by different masks). Such an op gets a
seed pair per traced step and op, the same on every device, so every copy
draws the same stream: one draw, whole on every device.
"""

from __future__ import annotations

import math
import random
import weakref
import zlib

import numpy as np
import tensorflow as tf

from rewrite import _op_kinds
from rewrite.rules import _base

PHILOX = (1, 3)  # RNG_ALG_PHILOX and RNG_ALG_AUTO_SELECT (Philox on CPUs and GPUs)
_PER_CALL = {tf.float16: 4, tf.bfloat16: 4, tf.float32: 4, tf.float64: 2}  # samples per Philox call


def _advance(counter: tf.Tensor, steps: int) -> tf.Tensor:
  """The 128-bit Philox ``counter`` (two uint64 words, low first) advanced by ``steps``."""
  low = counter[0] + tf.constant(steps, tf.uint64)
  carry = tf.cast(low < counter[0], tf.uint64)
  return tf.concat([tf.stack([low, counter[1] + carry]), counter[2:]], axis=0)


@_base.register("StatelessRandomUniformV2", "StatelessRandomNormalV2")
def stateless_random(view, layouts):
  shape, alg = view.const(0), view.const(3)
  out_rank = len(view.out_shape())
  whole = _base.Decision(inputs=[None] * 4, outputs=[_base.replicated(out_rank)])
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

  return _base.Decision(inputs=[None] * 4, outputs=[(axes,) + ((),) * (out_rank - 1)], lower=lower)


_SALTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # traced graph -> its seed (one per trace)


def use_salt(graph, salt: int) -> None:
  """Gives ``graph``'s unseeded stateful random ops the seed ``salt`` (and each its op's ``seed2``)."""
  _SALTS[graph] = salt


def _salt(graph) -> int:
  """``graph``'s salt: the one it was given, or one drawn for it (a new trace draws new numbers, as on one device)."""
  if graph not in _SALTS:
    _SALTS[graph] = random.SystemRandom().randrange(1, 2**31)
  return _SALTS[graph]


def body_salt(op, attr: str) -> int:
  """The salt of the body that ``op``'s function attribute ``attr`` names (an ``If``'s ``then_branch``).

  Derived from the salt of ``op``'s graph, ``op``'s name and ``attr``: the
  names a trace gives its ops are the same in every process that traces one
  step, unlike the names of its functions (they carry a per-process counter),
  so processes that agreed on the step's salt draw the same numbers in its
  branches too, and a body met twice (each propagation round) gets one salt.
  """
  return zlib.crc32(f"{_salt(op.graph)}/{op.name}/{attr}".encode()) & 0x7FFFFFFF or 1


@_base.register(*_op_kinds.STATEFUL_RANDOM)
def stateful_random(view, layouts):
  """One draw, whole on every device: an unseeded op gets a seed pair, the same on every device."""
  attrs = {}
  if view.attr("seed") == 0 and view.attr("seed2") == 0:
    attrs = {"seed": _salt(view.op.graph), "seed2": zlib.crc32(view.op.name.encode()) & 0x7FFFFFFF or 1}
  return _base.Decision(inputs=[_base.replicated(_base.rank_of(t)) for t in view.op.inputs],
                        outputs=[_base.replicated(_base.rank_of(t)) for t in view.op.outputs], attrs=attrs)
