"""Rules for reductions: reducing a split dimension leaves per-device partials (all-reduce)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from rewrite.rules import _base

_COMBINE = {"Sum": "sum", "Mean": "mean", "Max": "max", "Min": "min", "All": "min", "Any": "max"}


@_base.register("Sum", "Mean", "Max", "Min", "Prod", "All", "Any", position_blind=True)
def reduce(view, layouts):
  layout = layouts[0]
  axes = view.const(1)
  if axes is None or layout is None:  # (an input of unknown rank: whole, as its maker gave it)
    return _base.fallback(view, layouts)
  rank = len(layout)
  dims = {int(d) % rank for d in np.atleast_1d(axes)} if rank else set()
  split = tuple(a for d in sorted(dims) for a in layout[d])
  if split and view.op.type == "Prod":
    return _base.fallback(view, layouts)
  keep = view.attr("keep_dims")
  out = tuple(() if d in dims else layout[d] for d in range(rank) if keep or d not in dims)
  scatter = ()
  if view.op.type == "Sum":  # a gradient summed over the batch, for a weight split over the batch axis
    out, scatter = _base.scatter_partials(view, out, split)
  return _base.Decision(inputs=[layout, None], outputs=[out],
                        reduce=[(_COMBINE[view.op.type], split) if split else None],
                        scatter={0: scatter})


@_base.register("BiasAddGrad", position_blind=True)
def bias_add_grad(view, layouts):
  if view.attr("data_format") not in (b"NHWC", "NHWC"):
    return _base.fallback(view, layouts)
  layout = layouts[0]
  split = tuple(a for dim in layout[:-1] for a in dim)
  return _base.Decision(inputs=[layout], outputs=[(layout[-1],)],
                        reduce=[("sum", split) if split else None])


@_base.register("SparseSoftmaxCrossEntropyWithLogits", position_blind=True)
def sparse_softmax_cross_entropy(view, layouts):
  """Per row of ``[batch, classes]`` logits; classes split (a vocabulary-parallel output layer) stay split.

  With the classes split, each device has its columns of every row: the
  loss is ``log(sum exp) + max - logit[label]``, with the row's max, its sum
  of exponentials and the label's logit (on the device holding that column,
  zero elsewhere) all-reduced over the classes' axes: three ``[rows]``
  all-reduces instead of gathering the ``[rows, classes]`` logits, and the
  backprop (``softmax - one_hot``) comes out split like the logits.
  """
  logits, labels = layouts
  want = view.want(0) or view.want(1) or ((),)
  batch = logits[0] or labels[0] or want[0]
  classes = logits[1] if len(logits) == 2 else ()
  if not classes or set(classes) & set(batch):
    return _base.Decision(inputs=[(batch, ()), (batch,)], outputs=[(batch,), (batch, ())])
  num_classes = view.in_shape(0)[1]
  local_classes = num_classes // view.shards(classes)

  def lower(r, inputs, comm):
    logits, labels = inputs
    row_max = comm.all_reduce(tf.reduce_max(logits, axis=1), "max", classes)
    exp = tf.exp(logits - row_max[:, None])
    total = comm.all_reduce(tf.reduce_sum(exp, axis=1), "sum", classes)
    local = labels - tf.cast(view.offset(r, classes, num_classes), labels.dtype)
    inside = tf.logical_and(local >= 0, local < local_classes)
    picked = tf.gather(logits, tf.where(inside, local, tf.zeros_like(local)), axis=1, batch_dims=1)
    label_logit = comm.all_reduce(tf.where(inside, picked, tf.zeros_like(picked)), "sum", classes)
    loss = tf.math.log(total) + row_max - label_logit
    backprop = exp / total[:, None] - tf.one_hot(local, local_classes, dtype=logits.dtype)  # off range: zeros
    return [loss, backprop]

  split = "vocabulary-parallel cross-entropy: "
  return _base.Decision(inputs=[(batch, classes), (batch,)], outputs=[(batch,), (batch, classes)], lower=lower,
                        communicates=(("all_reduce", classes, split + "row max"),
                                      ("all_reduce", classes, split + "row sum of exp"),
                                      ("all_reduce", classes, split + "label logit")))


@_base.register("SoftmaxCrossEntropyWithLogits", position_blind=True)
def softmax_cross_entropy(view, layouts):
  """Per row of ``[batch, classes]`` logits and labels; classes split (in the logits) stay split.

  As the sparse one (above), with the labels split like the logits: the
  loss is ``sum(labels) * (log(sum exp) + max) - sum(labels * logits)``, the
  two label sums all-reduced together; the backprop is ``softmax - labels``.
  """
  logits, labels = layouts
  want = view.want(0) or view.want(1) or ((),)
  batch = logits[0] or labels[0] or want[0]
  if len(logits) != 2 or len(labels) != 2:
    return _base.fallback(view, layouts)
  classes = logits[1]
  if not classes or set(classes) & set(batch):
    return _base.Decision(inputs=[(batch, ()), (batch, ())], outputs=[(batch,), (batch, ())])

  def lower(r, inputs, comm):
    logits, labels = inputs
    row_max = comm.all_reduce(tf.reduce_max(logits, axis=1), "max", classes)
    exp = tf.exp(logits - row_max[:, None])
    total = comm.all_reduce(tf.reduce_sum(exp, axis=1), "sum", classes)
    sums = comm.all_reduce(tf.stack([tf.reduce_sum(labels * logits, 1), tf.reduce_sum(labels, 1)], 1), "sum",
                           classes)
    loss = sums[:, 1] * (tf.math.log(total) + row_max) - sums[:, 0]
    return [loss, exp / total[:, None] - labels]

  split = "vocabulary-parallel cross-entropy: "
  return _base.Decision(inputs=[(batch, classes), (batch, classes)], outputs=[(batch,), (batch, classes)],
                        lower=lower, communicates=(("all_reduce", classes, split + "row max"),
                                                   ("all_reduce", classes, split + "row sum of exp"),
                                                   ("all_reduce", classes, split + "label sums")))


@_base.register("Softmax", "LogSoftmax", position_blind=True)
def softmax(view, layouts):
  """Normalises the last dimension: that one whole (gathered if split), the others keep their splits."""
  layout = _base.with_wanted(layouts[0][:-1] + ((),), view.want())
  layout = layout[:-1] + ((),)
  return _base.Decision(inputs=[layout], outputs=[layout])


@_base.register("ArgMax", "ArgMin")
def arg_max(view, layouts):
  """The index of the largest (smallest) entry along a dimension; the other dimensions keep their splits.

  Along a split dimension (an accuracy metric on vocabulary-parallel logits)
  each device finds its piece's best entry and index, the best value is
  all-reduced, and the smallest index holding it (the first, as on one
  device) too: two all-reduces of the output's size instead of gathering
  the input.
  """
  axis = view.const(1)
  if axis is None:
    return _base.fallback(view, layouts)
  layout = layouts[0]
  axis = int(axis) % len(layout)
  split = layout[axis]
  out = layout[:axis] + layout[axis + 1:]
  if not split or view.in_shape(0)[axis] <= 0 or not view.op.inputs[0].dtype.is_floating:
    return _base.Decision(inputs=[layout[:axis] + ((),) + layout[axis + 1:], None], outputs=[out])
  size = view.in_shape(0)[axis]
  largest = view.op.type == "ArgMax"
  out_type = view.attr("output_type")

  def lower(r, inputs, comm):
    x = inputs[0]
    best = tf.reduce_max(x, axis=axis) if largest else tf.reduce_min(x, axis=axis)
    index = tf.math.argmax(x, axis=axis, output_type=tf.int32) if largest else tf.math.argmin(
        x, axis=axis, output_type=tf.int32)
    index += view.offset(r, split, size)
    best_everywhere = comm.all_reduce(best, "max" if largest else "min", split)
    first = comm.all_reduce(tf.where(tf.equal(best, best_everywhere), index, tf.fill(tf.shape(index), size)), "min",
                            split)
    return [tf.cast(first, out_type)]

  why = "arg max over a split dimension: " if largest else "arg min over a split dimension: "
  return _base.Decision(inputs=[layout, None], outputs=[out], lower=lower,
                        communicates=(("all_reduce", split, why + "best value"),
                                      ("all_reduce", split, why + "first index holding it")))


@_base.register("TopKV2", "TopK")
def top_k(view, layouts):
  """The ``k`` largest entries of each row (a router's choice of experts): the last dimension whole.

  The other dimensions keep their splits (rows split over the batch stay
  split), or take the split the consumers want of either output; a split
  last dimension is gathered first.
  """
  layout = layouts[0]
  if layout is None or not layout:
    return _base.fallback(view, layouts)
  want = view.want(0) or view.want(1)
  need = _base.with_wanted(layout[:-1] + ((),), want)[:-1] + ((),)
  return _base.Decision(inputs=[need] + [None] * (len(view.op.inputs) - 1), outputs=[need, need])


_SCANS = {  # op -> (its reduction, the identity of its combine, combine(running, before))
    "Cumsum": (tf.reduce_sum, 0.0, lambda running, before: running + before),
    "Cumprod": (tf.reduce_prod, 1.0, lambda running, before: running * before),
    "CumulativeLogsumexp": (tf.reduce_logsumexp, -np.inf,
                            lambda running, before: tf.reduce_logsumexp(tf.stack([running, before + tf.zeros_like(
                                running)]), axis=0)),
}


@_base.register("Cumsum", "Cumprod", "CumulativeLogsumexp")
def cumulative(view, layouts):
  """A running sum (product, log-sum-exp) along one dimension; the other dimensions keep their splits.

  Along a split dimension (a capacity counted over a batch split over
  devices) it is a scan across devices: each device runs it on its piece,
  the pieces' totals are all-gathered (one entry a device along that
  dimension), and each device combines its running values with the total
  of the pieces before its own (after it, with ``reverse``).
  """
  axis = view.const(1)
  layout = layouts[0]
  if axis is None or layout is None:
    return _base.fallback(view, layouts)
  axis = int(axis) % len(layout)
  split = layout[axis]
  want = view.want()
  if not split:
    if want is not None and len(want) == len(layout) and not want[axis]:
      layout = _base.with_wanted(layout, want)
    return _base.Decision(inputs=[layout, None], outputs=[layout])
  reduce_fn, identity, combine = _SCANS[view.op.type]
  reverse = bool(view.attr("reverse"))
  k = view.shards(split)

  def lower(r, inputs, comm):
    x, dim = inputs
    running = getattr(tf.raw_ops, view.op.type)(x=x, axis=dim, exclusive=view.attr("exclusive"), reverse=reverse)
    totals = comm.all_gather(reduce_fn(x, axis=axis, keepdims=True), axis, split)  # [..., k, ...]
    me = view.mesh.axis_index(r, split)
    shape = [1] * len(layout)
    shape[axis] = k
    before = tf.reshape(tf.range(k) > me if reverse else tf.range(k) < me, shape)
    before = tf.broadcast_to(before, tf.shape(totals))
    prior = reduce_fn(tf.where(before, totals, tf.cast(identity, totals.dtype)), axis=axis, keepdims=True)
    return [combine(running, prior)]

  return _base.Decision(inputs=[layout, None], outputs=[layout], lower=lower,
                        communicates=(("all_gather", split, f"{view.op.type} along a split dimension: the pieces' "
                                       "totals"),))
