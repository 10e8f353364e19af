"""A pipeline of identical blocks written at global shapes: the stacked form, for the global view.

``replicator.stacked_pipeline(block, weights, inputs, microbatches=m)`` computes what running the ``p`` blocks
in a row on ``inputs`` computes, ``block(weights[p - 1], ... block(weights[0], inputs))``, where each leaf of
``weights`` stacks the ``p`` blocks' values along its first dimension. It is one-device TensorFlow: on one
device it is a slower way to run the blocks; in the global view, with the stacked weights laid out over a
stage axis (``("stage", None, ...)``), it is a pipeline, as praxis and MaxText write theirs on JAX:

- a state ``[p, rows, ...]`` holds what each stage works on; every one of ``m + p - 1`` iterations applies each
  stage's block to its row of the state (``tf.vectorized_map`` over the stage dimension: with the weights and the
  state split over ``"stage"``, each device computes its own stage's block, nothing gathered), then rolls the
  state one stage on (``tf.roll`` by one tile along a split dimension: the partitioner's point-to-point
  ``permute`` to the next device);
- stage 0 takes microbatch ``t`` at iteration ``t``; the last stage's result at iteration ``t`` is microbatch
  ``t - p + 1``'s output (selected by a sum over the stage dimension: an all-reduce of one microbatch's output an
  iteration);
- the iterations are a ``tf.while_loop``, so the graph does not grow with ``m``; TensorFlow's gradient of the loop
  runs the iterations back, the rolls' gradients rolling the other way.

The schedule is GPipe's: the forward passes of every microbatch, then the backward passes. By default
(``remat=True``, as GPipe) the blocks' gradient computes each block again from its input: the loop keeps each
stage's block inputs of the ``m`` microbatches, not their activations, and the gradient loop's body holds its own
ops (their shapes and constant operands known: a block vectorized by ``tf.vectorized_map``, KerasHub's attention
among them, has values whose shapes TensorFlow's loop accumulators lose, and a gradient of the loop reading them
could not be split). In the ``p - 1`` iterations that fill the pipeline and the ``p - 1`` that drain it, stages
compute on values whose results are never kept (zeros, or a microbatch again): the bubble, ``(p - 1) / (m + p -
1)`` of the step, is spent computing rather than waiting.

With ``repeats=v`` the weights are stacked ``[v, p, ...]`` (block ``r p + s`` at ``[r, s]``, on stage ``s``) and
each microbatch goes round the stages ``v`` times (the circular schedule of praxis and MaxText): in iteration
``t`` stage ``s`` works on pass ``k = t - s``, microbatch ``k mod m`` in round ``k // m``, with its block of that
round (a select over the rounds: elementwise, the weights keep their split); the last stage's output of a pass is
kept a row a microbatch, the next round's input on stage 0 (``m >= p``: it is ready ``p`` iterations after the
microbatch left stage 0) and, after the last round, the result. ``v m + p - 1`` iterations: the bubble is
``(p - 1) / (v m + p - 1)``.

The microbatches are strided: microbatch ``j`` holds rows ``j, j + m, j + 2 m, ...`` of the batch, so that a
batch split over batch axes splits every microbatch alike (each device's rows of a microbatch are its own
rows); the outputs come back in the inputs' order.
"""

from __future__ import annotations

import tensorflow as tf
import tree

from replicator.core import _errors
from replicator.core import _pipeline
from replicator.core import _primitives

NOT_A_BLOCK = (
    "replicator.stacked_pipeline at {location}: block(weights, x) returned {found} for x of {expected}; expected "
    "the same structure, shapes and dtypes (each stage's output is the next stage's input). Fix: make the block "
    "keep its input's shape (a residual block), with what changes it before or after the pipeline.")


def _stages(weights, repeats: int, location: str) -> int:
  """``p``, the stages: every leaf's first dimension (``repeats`` 1), or its second (its first ``repeats``)."""
  leaves = tree.flatten(weights)
  lead = 1 if repeats == 1 else 2
  found = [tuple(w.shape[:lead]) if w.shape.rank is not None and w.shape.rank >= lead else "too few dimensions"
           for w in leaves]
  if (not leaves or len(set(found)) != 1 or not isinstance(found[0], tuple) or None in found[0]
      or (repeats > 1 and found[0][0] != repeats)):
    expected = ("stacked along a first dimension of the same size in every leaf (the number of stages)"
                if repeats == 1 else f"stacked as [repeats = {repeats}, stages, ...] in every leaf (block r * stages "
                "+ s at [r, s])")
    fix = ("tf.stack([block_0_kernel, block_1_kernel, ...])" if repeats == 1 else
           "tf.reshape(tf.stack([block_0_kernel, block_1_kernel, ...]), [repeats, stages, ...])")
    raise _errors.ArgumentError(
        f"replicator.stacked_pipeline(repeats={repeats}) at {location}: expected the blocks' weights {expected}; "
        f"found leading dimensions {found if leaves else 'no weights'}. Fix: stack each weight of the blocks, {fix}.")
  return int(found[0][lead - 1])


def _rows(inputs, microbatches: int, location: str) -> int:
  leaves = tree.flatten(inputs)
  rows = {w.shape[0] if w.shape.rank else None for w in leaves}
  if not leaves or len(rows) != 1 or None in rows:
    raise _errors.ArgumentError(
        f"replicator.stacked_pipeline at {location}: expected inputs with the same static first dimension (the "
        f"batch's rows) in every leaf; found {[w.shape for w in leaves] if leaves else 'no inputs'}.")
  (count,) = rows
  _pipeline.check_microbatches(microbatches, "replicator.stacked_pipeline", location, "the batch")
  if count % microbatches:
    raise _errors.ArgumentError(
        f"replicator.stacked_pipeline(microbatches={microbatches}) at {location}: the batch has {count} rows, "
        f"which {microbatches} microbatches do not divide (this form keeps every microbatch the same shape). "
        f"Fix: a number of microbatches dividing {count}, or a batch of a multiple of {microbatches} rows.")
  return count // microbatches


def _specs(x) -> str:
  try:
    return str(tree.map_structure(lambda t: (t.shape[1:].as_list(), t.dtype.name), x))
  except (TypeError, ValueError, AttributeError):
    return repr(x)


def _vectorized(block, weights, x):
  """Every stage's block on its row of ``x``: ``block`` vectorized over the stages (their weights' first dimension)."""
  return tf.vectorized_map(lambda args: block(*args), (weights, x), fallback_to_while_loop=False)


def _recomputed(block, weights, x):
  """:func:`_vectorized`, its gradient computing the blocks again from their inputs (saved: the inputs only).

  The gradient is each stage's, vectorized too: its own ops (their shapes and constant operands known in the loop's
  gradient body), none of the forward's values accumulated by the loop.
  """
  leaves, weight_leaves = tree.flatten(x), tree.flatten(weights)

  @tf.custom_gradient
  def run(*flat):
    ws, xs = tree.unflatten_as(weights, flat[:len(weight_leaves)]), tree.unflatten_as(x, flat[len(weight_leaves):])
    out = _vectorized(block, ws, xs)

    def grad(*dys):
      def one(args):
        w, h, dy = args
        with tf.GradientTape() as tape:
          tape.watch(tree.flatten((w, h)))
          y = block(w, h)
        return tape.gradient(tree.flatten(y), tree.flatten((w, h)), output_gradients=list(dy),
                             unconnected_gradients=tf.UnconnectedGradients.ZERO)

      return tf.vectorized_map(one, (ws, xs, list(dys)), fallback_to_while_loop=False)

    return tree.flatten(out), grad

  return tree.unflatten_as(x, run(*weight_leaves, *leaves))


def _select(weights, repeat, stages: int):
  """Each stage's block's weights: leaf ``[v, p, ...]`` -> ``[p, ...]``, stage ``s`` taking ``[repeat[s], s]``.

  Elementwise (a select a repeat): the leaf's stage dimension keeps its split, nothing gathered.
  """
  def one(w):
    chosen = w[0]
    for r in range(1, int(w.shape[0])):
      chosen = tf.where(tf.reshape(tf.equal(repeat, r), [stages] + [1] * (w.shape.rank - 2)), w[r], chosen)
    return chosen

  return tree.map_structure(one, weights)


def stacked_pipeline(block, weights, inputs, *, microbatches: int, repeats: int = 1, remat: bool = True):
  """``block`` applied to ``inputs`` once a stacked block, in a row, as a pipeline over the stages' devices.

  Computes ``block(weights[n - 1], ... block(weights[1], block(weights[0], inputs)))``, where each leaf of
  ``weights`` stacks the ``n`` blocks' values along its first dimension (``repeats = 1``: ``n = p``, block ``s`` on
  stage ``s``), or along its first two, ``[repeats, p, ...]`` (``n = repeats * p``: block ``r * p + s`` at
  ``[r, s]``, on stage ``s``). Written at global shapes, it runs on one device as it reads; in the global view, with
  the stacked weights laid out over a stage axis (for example ``LayoutMap({"blocks/.*": ("stage", None, None)})``,
  or ``(None, "stage", None, None)`` with repeats), each device computes its stage's blocks on each of
  ``microbatches`` pieces of the batch, and a piece's activation goes to the next stage's device point to point
  (the graph the same for any number of microbatches). With ``repeats = 1`` the schedule is GPipe's, its bubble
  ``(p - 1) / (m + p - 1)`` of the step; with ``repeats = v`` each microbatch goes round the stages ``v`` times
  (the circular schedule of praxis and MaxText, Megatron-LM's interleaving of ``v`` chunks a device), the bubble
  ``(p - 1) / (v m + p - 1)``, for ``v`` times the sends. See ``docs/concepts/stages.md``.

  Examples:
    >>> w = tf.stack([tf.eye(3), 2 * tf.eye(3)])  # two blocks' weights, stacked
    >>> replicator.stacked_pipeline(lambda w, x: x @ w, w, tf.ones([4, 3]), microbatches=2).numpy()[0]
    array([2., 2., 2.], dtype=float32)
    >>> w = tf.reshape(tf.stack([tf.eye(3), 2 * tf.eye(3), 3 * tf.eye(3), 4 * tf.eye(3)]), [2, 2, 3, 3])
    >>> replicator.stacked_pipeline(lambda w, x: x @ w, w, tf.ones([4, 3]), microbatches=2, repeats=2).numpy()[0]
    array([24., 24., 24.], dtype=float32)

  Args:
    block: ``block(weights, x) -> y``: one stage's computation, given one block's weights (each leaf without its
      stacked dimensions) and a microbatch ``x`` (a tensor or nest, rows first); ``y`` as ``x`` (structure, shapes,
      dtypes). Traced once, vectorized over the stages (``tf.vectorized_map``): plain TensorFlow ops or Keras
      layers' stateless calls, no variable reads or writes of its own.
    weights: a tensor, variable or nest of them, each with the stages first (``[p, ...]``), or with the repeats
      then the stages first (``[repeats, p, ...]``).
    inputs: the batch (a tensor or nest, rows first, the same static rows in every leaf).
    microbatches: how many pieces the batch is split into: ``m`` dividing the rows; microbatch ``j`` holds rows
      ``j, j + m, ...`` (so a batch split over the batch axes splits each microbatch alike). At least ``p`` with
      ``repeats > 1`` (a microbatch's next round on stage 0 takes the last stage's output of its round before).
    repeats: how many rounds of the stages each microbatch makes (``v`` blocks a stage).
    remat: the backward pass computes each block again from its inputs (each stage keeps its blocks' inputs of
      the ``v m`` passes, not their activations; a forward pass more), as GPipe does; False: TensorFlow's
      gradient of the loop, which keeps every value the blocks' gradients read.

  Returns:
    The last block's outputs for ``inputs``, in their order (as ``inputs``: structure and shapes).
  """
  location = _primitives.user_location()
  if not _errors.positive_int(repeats):
    raise _errors.ArgumentError(f"replicator.stacked_pipeline(repeats={repeats!r}) at {location}: expected a "
                                "positive int (how many rounds of the stages a microbatch makes).")
  stages = _stages(weights, repeats, location)
  rows = _rows(inputs, microbatches, location)
  m, v = microbatches, repeats
  if v > 1 and m < stages:
    raise _errors.ArgumentError(
        f"replicator.stacked_pipeline(microbatches={m}, repeats={v}) at {location}: {stages} stages and {v} rounds "
        f"need at least {stages} microbatches (a microbatch's next round on the first stage takes the last stage's "
        f"output of its round before, which is ready {stages} iterations after it left). Fix: microbatches >= "
        f"{stages}, or repeats=1.")

  def microbatched(x):  # [m * rows, ...] -> [m, rows, ...]: microbatch j = rows j, j + m, ...
    shape = x.shape[1:].as_list()
    return tf.transpose(tf.reshape(x, [rows, m] + shape), [1, 0] + list(range(2, len(shape) + 2)))

  def restored(x):  # [m, rows, ...] -> [m * rows, ...] in the inputs' order
    shape = x.shape[2:].as_list()
    return tf.reshape(tf.transpose(x, [1, 0] + list(range(2, len(shape) + 2))), [m * rows] + shape)

  xs = tree.map_structure(microbatched, inputs)
  first = tf.range(stages)

  def on_stage(index, rank):  # [p, 1, 1, ...]: whether each stage is `index`
    return tf.reshape(tf.equal(first, index), [stages] + [1] * (rank - 1))

  # Iteration t: stage s works on pass k = t - s (microbatch k mod m, round k // m) when 0 <= k < v m. The last
  # stage's output of each pass is kept in `kept` (row: its microbatch): the next round's input on stage 0, and after
  # the last round the result.
  def step(t, state, kept):
    j = tf.math.floormod(t, m)
    fresh = tf.less(t, m)

    def source(x, k):
      return tf.where(fresh, tf.gather(x, j), tf.gather(k, j)) if v > 1 else tf.gather(x, tf.minimum(t, m - 1))

    taken = tree.map_structure(lambda s, x, k: tf.where(on_stage(0, s.shape.rank), source(x, k)[None], s),
                               state, xs, kept)
    ws = weights if v == 1 else _select(weights, tf.clip_by_value(tf.math.floordiv(t - first, m), 0, v - 1), stages)
    done = (_recomputed if remat else _vectorized)(block, ws, taken)
    found, expected = _specs(done), _specs(taken)
    if found != expected:
      raise _errors.ArgumentError(NOT_A_BLOCK.format(location=location, found=found, expected=expected))
    out = t - (stages - 1)  # the pass leaving the last stage (outside [0, v m): none, no row written)
    row_of = tf.where(tf.logical_and(out >= 0, out < v * m), tf.math.floormod(out, m), -1)

    def keep(o, d):  # (elementwise, so that the outputs keep the batch's split: no scatter into a replicated buffer)
      last = tf.reduce_sum(tf.where(on_stage(stages - 1, d.shape.rank), d, tf.zeros_like(d)), axis=0)
      row = tf.reshape(tf.equal(tf.range(m), row_of), [m] + [1] * (o.shape.rank - 1))
      return tf.where(row, last[None], o)

    kept = tree.map_structure(keep, kept, done)
    return t + 1, tree.map_structure(lambda d: tf.roll(d, 1, axis=0), done), kept

  def zeros(x, count):
    return tf.zeros([count, rows] + x.shape[1:].as_list(), x.dtype)

  state = tree.map_structure(lambda x: zeros(x, stages), inputs)
  kept = tree.map_structure(lambda x: zeros(x, m), inputs)
  iterations = v * m + stages - 1
  _, _, kept = tf.while_loop(lambda t, *_: t < iterations, step, (tf.constant(0), state, kept),
                             maximum_iterations=iterations)
  return tree.map_structure(restored, kept)
