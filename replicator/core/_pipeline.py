"""Pipelines in the local view: a model's stages on the devices along a mesh axis, microbatches streamed through.

``repl.pipeline(stages, inputs, targets, loss_fn, axis="stage", microbatches=m, schedule=...)`` in a step:
the replica at position ``s`` along ``axis`` runs ``stages[s]`` (any callable: a Keras model, a layer, a
function) on each microbatch of its batch, and returns the loss and the gradients of every stage's
variables, as one device running the stages in a row on the whole batch would have them (the loss is
``loss_fn(targets, outputs)``, a mean over the rows: each microbatch's weighted by its rows, so microbatches of
rows that do not divide evenly, split as ``np.array_split`` splits them, count as their rows do).

How a step runs them. The replica builds, in its schedule's order, the forward pass ``F j`` of each
microbatch ``j`` (under a ``tf.GradientTape``: its activations kept until its backward pass) and the backward
pass ``B j`` (``tape.gradient`` of the stage's output, given the next stage's gradient of it; of the weighted
loss on the last stage), each one waiting for the one before it on the device (control dependencies):

- ``"gpipe"``: every forward pass, then every backward pass (GPipe; the stage keeps ``m`` microbatches'
  activations);
- ``"1f1b"``: ``p - s - 1`` forward passes, then one forward and one backward pass in turn, then the
  backward passes left (PipeDream-Flush, Megatron-LM's 1F1B: the same gradients, at most ``p - s``
  microbatches' activations kept on stage ``s``);
- ``"interleaved"``: ``v`` stages a device (device ``d`` runs stages ``d, d + p, ...``), Megatron-LM's
  interleaved 1F1B: the passes in groups of ``p`` microbatches a stage, then one forward and one backward
  in turn (``m`` a multiple of ``p``).

The bubble is GPipe's for the first two, ``(p - 1) / (m + p - 1)`` of the step; the interleaved schedule's
is ``(p - 1) / (v m + p - 1)``, for ``v`` times the sends.

Between stages an activation (forward) or its gradient (backward) goes from one device to its neighbour:
a ``permute`` of one pair, which in one process is a plain cross-device edge (``rewrite/_one_device.py``),
no collective. Every replica calls the same permutes in the same order, the order of one run of the whole
schedule (:func:`global_order`), giving zeros where it is not the sender; so the step is one program,
matched as any local-view step, and cannot wait on a send that never comes.

Each stage's variables live on its devices only (``place``: the Replicator places them where the stages that
read them run, learnt when the stages are traced for their shapes, their optimizer slots alike), so their
gradients stay there: no collective over ``axis`` (a replica gets zeros for the variables it does not hold, and
``wrap_optimizer`` reduces each gradient over the other axes, on its stage's devices). A weight several stages
read (an embedding tied to the output layer) lives on each of their devices, its gradient summed between them
(a permute a round among its holders). A variable every device's stages read, or none, stays on every replica,
its gradient summed over ``axis`` (an all-reduce, zeros from the stages that do not use it); so is the loss,
summed from the last stage.

A forward pass alone (:func:`forward`, ``repl.pipeline_forward``: evaluation, prediction) runs each stage's
forward pass on each microbatch in GPipe's order, without a tape, and sends the activations on; the last stage's
outputs for the replica's rows reach every replica along ``axes`` (an all-reduce, zeros from the other stages), as
they do in the all-reduce of the loss with ``outputs=True``.

State a stage writes that every replica holds alike (BatchNormalization's moving statistics) is not written by
the stage (only its devices run it, each microbatch in turn): the variables hand their assigns to the pipeline
(``ReplicaContext.stage_writes``), which sums each microbatch's value weighted by its rows and writes the result
once, after the passes, on every replica (in the same all-reduce, zeros from the other stages). Which variables
each stage writes is learnt when the stages are traced for their shapes (``_context.recording_writes``), so every
replica's all-reduce is the same. The moving mean is then the batch's, the moving variance the microbatches'
variances' mean (Keras 2's ``virtual_batch_size`` update); each microbatch is normalized by its own statistics.

Losses the stages add themselves (``stage_losses=True``: one device's ``loss + sum(model.losses)``): a loss a layer
adds in its call (``add_loss``, an activity penalty) is read from the stage after each microbatch's forward pass,
weighted by the microbatch's rows as the loss is, and differentiated with the stage's outputs in its backward pass
(its gradient flows back through the earlier stages); each regularized weight's penalty is added once a step, on
the devices of the first stage that has the weight, its gradient there. ``loss_scale``: each backward pass seeded
with it (a LossScaleOptimizer's scale), the loss returned unscaled.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf
import tree

from replicator.core import _context
from replicator.core import _errors
from replicator.core import _primitives

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def device_order(schedule: str, device: int, devices: int, chunks: int, microbatches: int) -> list[tuple[str, int, int]]:
  """The passes of ``device`` in the order it runs them: ``(kind, stage, microbatch)``, ``kind`` ``"F"`` or ``"B"``.

  The device holds stages ``device, device + devices, ...`` (``chunks`` of them). ``"gpipe"``: every forward pass,
  its stages in turn, then every backward pass, the stages in reverse. ``"1f1b"`` (one stage a device):
  ``devices - device - 1`` forward passes, then a forward and a backward in turn, then the backward passes left.
  ``"interleaved"`` (Megatron-LM's interleaved 1F1B; ``microbatches`` a multiple of ``devices``): the passes in
  groups of ``devices`` microbatches a stage, stage after stage, ``2 (devices - device - 1) + (chunks - 1) devices``
  forward passes first, then a forward and a backward in turn.
  """
  p, v, m = devices, chunks, microbatches
  mine = [device + c * p for c in range(v)]
  if schedule == "gpipe":
    return [("F", g, j) for g in mine for j in range(m)] + [("B", g, j) for g in reversed(mine) for j in range(m)]
  if schedule == "1f1b":
    (g,) = mine
    warmup = min(p - device - 1, m)
    order = [("F", g, j) for j in range(warmup)]
    for i in range(m - warmup):
      order += [("F", g, warmup + i), ("B", g, i)]
    return order + [("B", g, j) for j in range(m - warmup, m)]

  def unit(k: int, forward: bool) -> tuple[str, int, int]:
    group, within = divmod(k, p * v)
    chunk = within // p if forward else v - 1 - within // p
    return ("F" if forward else "B", mine[chunk], group * p + within % p)

  total = m * v
  warmup = total if m == p else min(2 * (p - device - 1) + (v - 1) * p, total)
  order = [unit(k, True) for k in range(warmup)]
  for i in range(total - warmup):
    order += [unit(warmup + i, True), unit(i, False)]
  return order + [unit(k, False) for k in range(total - warmup, total)]


def global_order(schedule: str, devices: int, chunks: int, microbatches: int) -> list[tuple[str, int, int]]:
  """Every device's passes ``(kind, stage, microbatch)`` in one order that runs them all.

  Each device's in its own order; a forward pass after the previous stage's of its microbatch, a backward pass
  after the next stage's. Every replica builds its passes and calls the permutes between them in this order.
  """
  stages = devices * chunks
  queues = [device_order(schedule, d, devices, chunks, microbatches) for d in range(devices)]
  done, out = set(), []
  while any(queues):
    moved = False
    for queue in queues:
      if not queue:
        continue
      kind, g, j = queue[0]
      before = (("F", g - 1, j) if g > 0 else None) if kind == "F" else (("B", g + 1, j) if g < stages - 1 else None)
      if before is None or before in done:
        queue.pop(0)
        done.add((kind, g, j))
        out.append((kind, g, j))
        moved = True
    if not moved:
      raise RuntimeError(f"The {schedule} schedule of {devices} devices, {chunks} stages each and {microbatches} "
                         "microbatches waits on itself (a bug in the schedule).")
  return out


def check_microbatches(microbatches, call: str, location: str, batch: str) -> None:
  """Raises ``ArgumentError`` unless ``microbatches`` is a positive int (``call``'s argument; ``batch``: what it
  splits, as the message says it)."""
  if not _errors.positive_int(microbatches):
    raise _errors.ArgumentError(f"{call}(microbatches={microbatches!r}) at {location}: expected a positive int, how "
                                f"many pieces {batch} is split into.")


def _rows(x, location: str):
  """The rows of ``x``'s leaves: an int where static, else a scalar tensor (a batch of any size)."""
  leaves = [t for t in tree.flatten(x) if t.shape.rank]
  static = {int(t.shape[0]) for t in leaves if t.shape[0] is not None}
  if not leaves or len(static) > 1:
    raise _errors.ArgumentError(f"repl.pipeline at {location}: the inputs and targets are split into microbatches "
                                "along their first dimension, which must be the same rows for every tensor; found "
                                f"{sorted(static) if leaves else 'no tensor with a dimension'}.")
  return static.pop() if static and all(t.shape[0] is not None for t in leaves) else tf.shape(leaves[0])[0]


def _split(x, edges):
  return [tree.map_structure(lambda t, a=a, b=b: t[a:b], x) for a, b in edges]


def _specs(ctx, stages, inputs, keys, axes) -> dict:
  """``{(stage, rows): output spec}``: what each stage gives for a microbatch of ``rows`` (None: any) rows, and
  ``{("writes", stage): [variable]}``: the variables held alike along ``axes`` it writes (traced, not run; once a
  trace, for every replica)."""
  key = ("pipeline specs", tuple(id(stage) for stage in stages), str(tree.map_structure(
      lambda t: (t.shape, t.dtype), inputs)), tuple(keys), tuple(axes))
  shared = {} if ctx.shared is None else ctx.shared
  if key not in shared:
    shared[key] = _traced_specs(stages, inputs, keys, axes)
  return shared[key]


def _traced_specs(stages, inputs, keys, axes) -> dict:
  with _context.cross_replica_scope():  # (traced for shapes only: no replica's reads, writes or collectives)
    return _shapes(stages, inputs, keys, axes)


def _shapes(stages, inputs, keys, axes) -> dict:
  out = {}
  for rows in set(keys):
    spec = tree.map_structure(lambda t, n=rows: tf.TensorSpec([n] + t.shape[1:].as_list(), t.dtype), inputs)
    for s, stage in enumerate(stages):
      fn = tf.function(lambda x, stage=stage: stage(x), autograph=False)
      with _context.recording_writes(axes) as written, _context.recording_reads() as read:
        traced = fn.get_concrete_function(spec)
      spec = tree.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), traced.structured_outputs)
      out[s, rows] = spec
      out.setdefault(("writes", s), list({id(v): v for v, _ in written}.values()))
      out.setdefault(("reads", s), {}).update({id(v): v for v in read})
  return out


def _zeros(spec, after, rows):
  """Zeros of ``spec`` (its first dimension ``rows``), made once ``after`` (this device's last pass) is: not held
  from the step's start."""
  def zeros(s):
    shape = s.shape if s.shape.is_fully_defined() else tf.stack([rows] + [int(n) for n in s.shape[1:]])
    return tf.zeros(shape, s.dtype)

  with tf.control_dependencies(tree.flatten(after) if after is not None else []):
    return tree.map_structure(zeros, spec)


def _floating(x) -> list:
  """The float tensors of nest ``x`` (those a gradient flows through)."""
  return [t for t in tree.flatten(x) if t.dtype.is_floating]


def _dense(g, v):
  if g is None:  # (a variable this stage does not use; a split one's zeros are this replica's block's)
    return tf.zeros_like(v)
  return tf.convert_to_tensor(g)


STAGE_STATE = (
    "repl.pipeline at {location}: stage {stage} {how} {what}, which every device along {axes} holds, but only "
    "stage {stage}'s devices run it. A stage's state is written once a step from its microbatches' values (their "
    "mean by rows, as BatchNormalization's moving statistics are), which takes a plain assign of a variable that "
    "is not trained, by one stage. Fix: {fix}")
STATE_FIXES = {
    "method": "write it with assign (the value, not a delta) or keep the write out of the stages.",
    "trainable": "make the variable not trainable (an optimizer writes trainable ones, from the gradients), or keep "
                 "the write out of the stages.",
    "stages": "give each stage its own variables (one layer object a stage).",
}


def _state_error(location, stage, how, variables, axes, fix):
  names = sorted({repr(v.name) for v in variables})
  what = ("the variable " if len(names) == 1 else "the variables ") + ", ".join(names)
  return _errors.UnsupportedError(STAGE_STATE.format(location=location, stage=stage, how=how, what=what, axes=axes,
                                                     fix=STATE_FIXES[fix]))


def _run_stage(ctx, stage, x, index: int, axes, location: str, rows=None):
  """``(stage(x), {id(variable): value})``: the stage's output, and the last value it assigned to each variable
  every replica holds alike (not written: the pipeline writes them once a step). ``rows``: ``(start, stop,
  rows)`` of the microbatch in the replica's batch (``ReplicaContext.microbatch``, for random draws)."""
  if ctx is None:
    return stage(x), {}
  ctx.stage_writes, ctx.stage_axes, ctx.microbatch = [], tuple(axes), rows
  try:
    y = stage(x)
    written = ctx.stage_writes
  finally:
    ctx.stage_writes, ctx.stage_axes, ctx.microbatch = None, (), None
  deltas = [v for v, method, _ in written if method != "assign"]
  if deltas:
    raise _state_error(location, index, "writes (by a delta or rows)", deltas, axes, "method")
  trained = [v for v, _, _ in written if v.trainable]
  if trained:
    raise _state_error(location, index, "assigns the trained", trained, axes, "trainable")
  return y, {id(v): tf.convert_to_tensor(value, v.dtype) for v, _, value in written}


def _state(specs, stages: int, location: str, axes) -> list:
  """The variables every replica holds alike that the stages write, in stage order, each by one stage."""
  out, writer = [], {}
  for g in range(stages):
    for v in specs["writes", g]:
      if id(v) in writer and writer[id(v)] != g:
        raise _state_error(location, g, f"and stage {writer[id(v)]} both write", [v], axes, "stages")
      if id(v) not in writer:
        writer[id(v)] = g
        out.append(v)
  return out


def pipeline(ctx, stages, inputs, targets, loss_fn, axes: tuple[str, ...], microbatches: int, schedule: str,
             location: str, variables, own=frozenset(), place=None, outputs: bool = False,
             stage_losses: bool = False, loss_scale=None):
  """``(loss, grads)``: the stages run over ``axes`` as a pipeline (see the module); ``grads`` of ``variables``.

  ``outputs``: also return the last stage's outputs for the replica's rows (its microbatches' in order), on every
  replica along ``axes`` (summed from the last stage in the all-reduce of the loss): ``(loss, grads, outputs)``.
  ``loss_fn`` None: a forward pass only (no tape, no backward pass, no loss): the outputs alone (:func:`forward`).

  ``own``: the indices of ``variables`` split over ``axes`` (a block a stage): their gradients are each replica's
  own block's, not summed over ``axes``.

  ``place``: ``place(reads)``, given ``{stage: [variable read]}`` (every stage's, learnt when the stages are traced
  for their shapes), places ``variables`` on the devices of the stages that read them and returns, for each, the
  positions along ``axes`` that hold it (None: every replica). A variable held by some positions only has its
  gradient on those (a weight two stages share: summed between them, by permutes), and zeros elsewhere; no
  all-reduce over ``axes``. None: every variable stays on every replica.

  ``stage_losses``: add the losses the stages (Keras layers) add themselves to the loss, and their gradients to the
  gradients (:func:`added_losses`, :func:`weight_penalties`): a forward pass alone then returns ``(outputs, added)``,
  ``added`` the batch's added losses, on every replica along ``axes``.

  ``loss_scale``: a float32 scalar (a LossScaleOptimizer's scale), or a function giving it (called once the
  variables are placed): the gradients are those of the loss times it, each backward pass seeded with it (as one
  device's gradient of the scaled loss is), the loss returned unscaled.
  """
  mesh = ctx.replicator.mesh
  count = mesh.axis_size(axes)
  stages = list(stages)
  if schedule not in SCHEDULES:
    raise _errors.ArgumentError(f"repl.pipeline(schedule={schedule!r}) at {location}: expected one of {SCHEDULES}.")
  chunks = len(stages) // count if count else 0
  if schedule == "gpipe" and len(stages) % count == 0 and chunks >= 1:
    pass  # (several stages a device: each device's in turn, forward then backward)
  elif schedule == "interleaved":
    if len(stages) % count or chunks < 2:
      raise _errors.ArgumentError(
          f"repl.pipeline(schedule='interleaved') at {location}: {len(stages)} stages over {axes} ({count} devices); "
          "expected several stages a device (a multiple of the devices, at least twice as many: device d runs "
          f"stages d, d + {count}, ...). Fix: cut the model into {2 * count} or more stages, or schedule='1f1b'.")
  elif len(stages) != count:
    raise _errors.ArgumentError(f"repl.pipeline at {location}: {len(stages)} stages over {axes} ({count} devices); "
                                "expected one stage a device along the axis. Fix: pass as many stages as the axis "
                                "has devices (join layers into a stage with keras.Sequential), a multiple of them "
                                "with schedule='interleaved' or 'gpipe', or another axis.")
  check_microbatches(microbatches, "repl.pipeline", location, "each replica's batch")
  if schedule == "interleaved" and microbatches % count:
    raise _errors.ArgumentError(f"repl.pipeline(microbatches={microbatches}, schedule='interleaved') at {location}: "
                                f"the interleaved schedule takes the microbatches in groups of the {count} devices; "
                                f"expected a multiple of {count}. Fix: microbatches={-(-microbatches // count) * count}.")
  forward_only = loss_fn is None
  rows = _rows(inputs if forward_only else (inputs, targets), location)
  if isinstance(rows, int) and rows < microbatches:
    raise _errors.ArgumentError(f"repl.pipeline(microbatches={microbatches}) at {location}: the replica's batch has "
                                f"{rows} rows, fewer than the microbatches. Fix: at most {rows} microbatches.")
  m, last_stage = microbatches, len(stages) - 1
  if isinstance(rows, int):  # (as np.array_split: the first ones larger)
    sizes = [rows // m + (1 if j < rows % m else 0) for j in range(m)]
    keys, weights = sizes, [size / rows for size in sizes]
  else:  # a batch of any size: the same split, at run time (a microbatch of a batch too small is empty)
    sizes = [rows // m + tf.cast(j < rows % m, rows.dtype) for j in range(m)]
    keys, weights = [None] * m, [tf.cast(size, tf.float32) / tf.cast(rows, tf.float32) for size in sizes]
  edges = [(sum(sizes[:j]), sum(sizes[:j + 1])) for j in range(m)]
  device = mesh.axis_index(ctx.replica_id, axes)
  specs = _specs(ctx, stages, inputs, keys, axes)
  state = _state(specs, len(stages), location, axes)
  pending = {}  # id(state variable) -> its microbatches' values, weighted by their rows, summed
  xs, ts = _split(inputs, edges), (None if forward_only else _split(targets, edges))
  every = list(variables)
  holders = [None] * len(every) if place is None else list(place(
      {g: list(specs["reads", g].values()) for g in range(len(stages))}))
  here = [k for k, held in enumerate(holders) if held is None or device in held]  # (the variables this device has)
  scale = None if forward_only or loss_scale is None else tf.cast(
      loss_scale() if callable(loss_scale) else loss_scale, tf.float32)
  mine = [every[k] for k in here]
  acts, grads_in, tapes = {}, {}, {}
  summed = [None] * len(mine)
  loss = tf.zeros([], tf.float32)
  outs = {}  # microbatch -> the last stage's output (on its devices)
  last = dx = None  # the outputs of this device's previous pass: the next waits for them
  for kind, g, j in global_order("gpipe" if forward_only else schedule, count, len(stages) // count, m):
    if forward_only and kind == "B":
      continue
    if g % count == device:
      with tf.control_dependencies(tree.flatten(last) if last is not None else []):
        if kind == "F":
          x = xs[j] if g == 0 else acts.pop((g, j))
          with contextlib.nullcontext() if forward_only else tf.GradientTape() as tape:
            if tape is not None:
              tape.watch(_floating(x))
            y, written = _run_stage(ctx, stages[g], x, g, axes, location, (*edges[j], rows))
            added = _weighted(added_losses(stages[g]), weights[j]) if stage_losses else None
            if g == last_stage:
              outs[j] = y
            if g == last_stage and not forward_only:
              y = tf.math.multiply_no_nan(tf.reduce_mean(tf.cast(loss_fn(ts[j], y), tf.float32)), weights[j])
              y = y if added is None else y + added
            elif added is not None and forward_only:  # (else differentiated with the stage's output, later)
              loss, added = loss + added, None
          for k, value in written.items():
            part = value * tf.cast(weights[j], value.dtype)
            pending[k] = part if k not in pending else pending[k] + part
          tapes[g, j] = (tape, x, y, added if g != last_stage else None)
          last = y
        else:
          tape, x, y, added = tapes.pop((g, j))
          if g == last_stage:
            target, given = y, None if scale is None else tf.cast(scale, y.dtype)
          else:  # (the stage's float outputs, and their gradients: an integer value passed on has none)
            given = grads_in.pop((g, j))
            pairs = [(t, d) for t, d in zip(tree.flatten(y), tree.flatten(given)) if t.dtype.is_floating]
            target, given = [t for t, _ in pairs], [d for _, d in pairs]
            if added is not None:  # (the losses the stage added: their gradient is one, or the scale)
              target, given = target + [added], given + [tf.ones([], added.dtype) if scale is None else scale]
              loss = loss + added
          inputs_in = _floating(x) if g > 0 else []
          got = tape.gradient(target, inputs_in + mine, output_gradients=given)
          dx, dw = got[:len(inputs_in)], got[len(inputs_in):]
          summed = [total if d is None else tf.convert_to_tensor(d) if total is None else total + tf.convert_to_tensor(d)
                    for total, d in zip(summed, dw)]
          if g == last_stage:
            loss = loss + y
          last = dx if dx else [d for d in summed if d is not None]
          if g > 0:
            found = iter(dx)
            dx = tree.unflatten_as(x, [_dense(next(found), t) if t.dtype.is_floating else tf.zeros_like(t)
                                       for t in tree.flatten(x)])
    # The send after the pass (every replica calls it; zeros from the others); none between a device's own stages.
    if kind == "F" and g < last_stage:
      source, target = g % count, (g + 1) % count
      if source == target:
        if device == source:
          acts[g + 1, j] = last
        continue
      value = last if device == source else _zeros(specs[g, keys[j]], last, sizes[j])
      got = _primitives.permute(ctx, value, [(source, target)], axes, f"{location} (pipeline: activation of "
                                f"microbatch {j} to stage {g + 1})", differentiable=False)
      if device == target:
        acts[g + 1, j] = got
    elif kind == "B" and g > 0:
      source, target = g % count, (g - 1) % count
      if source == target:
        if device == source:
          grads_in[g - 1, j] = dx
        continue
      value = dx if device == source else _zeros(specs[g - 1, keys[j]], last, sizes[j])
      got = _primitives.permute(ctx, value, [(source, target)], axes, f"{location} (pipeline: gradient of "
                                f"microbatch {j} to stage {g - 1})", differentiable=False)
      if device == target:
        grads_in[g - 1, j] = got
  if stage_losses:  # the stages' weight penalties, once a step, each on its stage's devices
    loss, summed = _penalties(stages, count, device, mine, summed, loss, last, forward_only, scale)
  # The last stage's outputs for the replica's rows (zeros elsewhere, made after the device's last pass).
  out = None
  if outputs or forward_only:
    out = (_joined([outs[j] for j in range(m)]) if device == last_stage % count else
           _zeros(_whole(specs[last_stage, keys[0]], rows), last, rows))
  if forward_only:
    values = [pending.get(id(v), tf.zeros(v.shape, v.dtype)) for v in state]
    out, values, added = _primitives.all_reduce(
        ctx, (out, values, [loss] if stage_losses else []), "sum", axes,
        f"{location} (pipeline: the last stage's outputs, the stages' state{', their losses' if stage_losses else ''})")
    _write_state(ctx, state, values, axes)
    return (out, added[0]) if stage_losses else out
  summed = _held_gradients(ctx, [_dense(total, v) for total, v in zip(summed, mine)], every, here, holders, axes,
                            device, last, location)
  mine = every
  shared = [k for k in range(len(mine)) if k not in own and holders[k] is None]
  # The stages' state (zeros from the devices that do not run its stage): written once, alike on every replica.
  values = [pending.get(id(v), tf.zeros(v.shape, v.dtype)) for v in state]
  loss, sums, values, out = _primitives.all_reduce(
      ctx, (loss, [summed[k] for k in shared], values, [] if out is None else [out]), "sum", axes,
      f"{location} (pipeline: the loss, the stages' gradients and state, from their stages)")
  out = out[0] if out else None
  _write_state(ctx, state, values, axes)
  # A block's gradient counted once a stage (the local view's convention for a loss every replica of an axis holds,
  # as the gradients of collectives give it: wrap_optimizer divides a split variable's by its pieces).
  grads = [g * tf.cast(count, g.dtype) if k in own else g for k, g in enumerate(summed)]
  for k, g in zip(shared, sums):
    grads[k] = g
  return (loss, grads, out) if outputs else (loss, grads)


def _write_state(ctx, state, values, axes) -> None:
  """Writes the stages' state, alike on every replica (``values``: summed over ``axes`` from their stages)."""
  for v, value in zip(state, values):
    if ctx.analysis is not None:  # (its stage's replicas' value may vary along the other axes: combined alike on all)
      ctx.analysis.set(value, ctx.analysis.all_axes - set(axes))
    v.assign(value)


def _joined(parts):
  """The microbatches' outputs (nests of one structure) joined along their rows, in order."""
  return tree.map_structure(lambda *t: tf.concat(t, 0), *parts)


def _whole(spec, rows):
  """``spec`` of a microbatch's output with the replica's ``rows`` (None where not static) as its first dimension."""
  n = rows if isinstance(rows, int) else None
  return tree.map_structure(lambda t: tf.TensorSpec([n] + t.shape[1:].as_list(), t.dtype), spec)


def forward(ctx, stages, inputs, axes: tuple[str, ...], microbatches: int, location: str, variables, own=frozenset(),
            place=None, stage_losses: bool = False):
  """The last stage's outputs for the replica's rows, on every replica along ``axes``: each stage's forward pass on
  each microbatch (no tape), the activations sent on, GPipe's order (a forward pass needs no other). Its variables
  are placed as :func:`pipeline` places them (the same ``place``). ``stage_losses``: ``(outputs, added)``, ``added``
  the losses the stages add themselves (as :func:`pipeline` adds them)."""
  return pipeline(ctx, stages, inputs, None, None, axes, microbatches, "gpipe", location, variables, own, place,
                  stage_losses=stage_losses)


def _held_gradients(ctx, summed, variables, here, holders, axes, device, last, location) -> list:
  """Every variable's gradient on this device, from ``summed`` (those of ``here``, the ones it holds).

  A variable some stages' devices hold (``holders``) gets their gradients summed between them, one permute a
  round among its holders (zeros from the others), and zeros where it is not held (made after the device's
  last pass); the others' gradients are as computed (summed over the axis later).
  """
  out = [None] * len(variables)
  for k, g in zip(here, summed):
    out[k] = g
  shared_by = {}  # holders -> indices of the variables several (not all) positions hold
  for k, held in enumerate(holders):
    if held is not None and len(held) > 1:
      shared_by.setdefault(held, []).append(k)
  for held, indices in shared_by.items():
    n = len(held)
    totals = [out[k] if device in held else _zeros(tf.TensorSpec(variables[k].shape, variables[k].dtype), last, None)
              for k in indices]
    received = list(totals)
    for step in range(1, n):  # each holder's part reaches each other holder, a cyclic shift a round
      pairs = [(held[i], held[(i + step) % n]) for i in range(n)]
      got = _primitives.permute(ctx, totals, pairs, axes, f"{location} (pipeline: the gradients of the weights "
                                f"stages {list(held)} share)", differentiable=False)
      received = [a + b for a, b in zip(received, got)]
    for k, value in zip(indices, received):
      if device in held:
        out[k] = value
  for k in range(len(variables)):
    if out[k] is None:  # (held on other stages)
      out[k] = _zeros(tf.TensorSpec(variables[k].shape, variables[k].dtype), last, None)
  return out


def pipeline_variables(stages) -> list:
  """The trainable variables ``repl.pipeline`` gives gradients for, in its order: each stage's, stage by stage."""
  return [v for stage in stages for v in getattr(stage, "trainable_variables", [])]


def regularized(stage) -> list:
  """The trainable weights of ``stage`` (a Keras layer; a function has none) that have a regularizer."""
  return [w for w in getattr(stage, "trainable_weights", []) if getattr(w, "regularizer", None) is not None]


def added_losses(stage) -> list:
  """The losses ``stage`` (a Keras layer) added in its last call: its layers' ``add_loss`` and activity
  regularizers' (Keras divides an activity penalty by the output's rows: a mean over them), not its weights'
  penalties. Keras's ``Layer.losses`` lists the call's losses first, then one penalty a regularized trainable
  weight (``tests/test_pipeline.py`` pins that order)."""
  losses = list(getattr(stage, "losses", None) or [])
  return losses[:len(losses) - len(regularized(stage))]


def _weighted(losses, weight):
  """The sum of ``losses`` (float32 scalars) times ``weight``, or None for no loss."""
  if not losses:
    return None
  total = tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in losses])
  return tf.math.multiply_no_nan(total, tf.cast(weight, tf.float32))


def weight_penalties(stages) -> list[list]:
  """For each stage, the regularized weights whose penalty it adds: those no earlier stage has (a weight two stages
  share is penalized once)."""
  seen, out = set(), []
  for stage in stages:
    mine = [w for w in regularized(stage) if id(w) not in seen]
    seen.update(id(w) for w in mine)
    out.append(mine)
  return out


def _penalties(stages, count, device, variables, summed, loss, last, forward_only, scale=None):
  """``(loss, summed)`` with the weight penalties of this device's stages added, once a step (after its passes),
  and their gradients (of ``variables``, this device's) added to ``summed``."""
  mine = [w for g, weights in enumerate(weight_penalties(stages)) if g % count == device for w in weights]
  if not mine:
    return loss, summed
  with tf.control_dependencies(tree.flatten(last) if last is not None else []):
    with contextlib.nullcontext() if forward_only else tf.GradientTape() as tape:
      penalty = tf.add_n([tf.reduce_sum(tf.cast(w.regularizer(w), tf.float32)) for w in mine])
    if not forward_only:
      got = tape.gradient(penalty, variables, output_gradients=scale)
      summed = [total if d is None else tf.convert_to_tensor(d) if total is None else total + tf.convert_to_tensor(d)
                for total, d in zip(summed, got)]
  return loss + penalty, summed
