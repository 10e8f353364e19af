"""Where the time goes: a training step and a first call, timed in pieces.

Run by hand (not part of ``benchmarks.run``):

  python -m benchmarks.breakdown step --model mlp_deep   # step pieces, interleaved medians
  python -m benchmarks.breakdown build --replicas 8,16   # phases of the first call
  python -m benchmarks.breakdown call --devices 4        # what a function call pays per captured handle
  python -m benchmarks.breakdown grad --devices 4        # a weight gradient: one full batch vs quarters

``step`` times cumulative pieces of the same step on 4 logical CPUs: forward
only; forward and backward; plus an all-reduce of the gradients; the Adam
update *without* the all-reduce (an unwrapped optimizer: replicas drift apart,
for timing only); the full step. The single device runs the same pieces.

``build`` splits the replicator's first call into trace (+ plan + rewrite),
making the executable (importing the rewritten GraphDef into a
``tf.function``) and the first run, by wrapping ``replicator.views._local_step``
internals with timers in this process only; and MirroredStrategy's into
creating the distributed iterator, tracing, and the first run.

``call`` times the fixed cost of one call of a function spanning the devices
(one small op per device) with N captured variable handles spread over the
devices, passed one by one (what ``tf.function`` does) and stacked per device
(``replicator.views._captures``, what the replicator's step does), interleaved.

``grad`` times the weight gradient of mlp_wide's first layer (``x^T dy``,
256x4096): one matmul on the full batch of 512 on one device, against one
matmul per device on its quarter of the batch, side by side (the same
arithmetic; each quarter writes a full-size gradient), and one quarter alone.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import replicator  # noqa: E402

PIECES = ("forward", "fwd+bwd", "fwd+bwd+all-reduce", "fwd+bwd+Adam (no all-reduce)", "full step")


def _piece_step(spec, model, optimizer, piece, all_reduce=None):
  import tensorflow as tf

  def step(x, y):
    if piece == "forward":
      return spec.loss(y, model(x, training=True))
    with tf.GradientTape() as tape:
      loss = spec.loss(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    if piece in ("fwd+bwd", "fwd+bwd+all-reduce"):
      if piece == "fwd+bwd+all-reduce":
        grads = all_reduce(grads)
      return loss + 0.0 * tf.add_n([tf.reduce_sum(g) for g in grads])  # keeps the gradients alive
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  return step


def step_pieces(model_name: str, devices, rounds: int) -> None:
  import keras
  import tensorflow as tf

  from benchmarks import _timing
  from benchmarks import models
  from benchmarks import step_time
  spec = models.by_name(model_name)
  x, y = spec.batch()
  calls = {}
  for piece in ("forward", "fwd+bwd", "full step"):
    with tf.device("/device:CPU:0"):
      model = spec.build()
      optimizer = keras.optimizers.Adam(1e-3)
      optimizer.build(model.trainable_variables)
      iterator = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
    body = _piece_step(spec, model, optimizer, piece)
    fn = tf.function(lambda it, body=body: body(*next(it)))
    calls[f"single {piece}"] = functools.partial(lambda fn, it: float(fn(it)), fn, iterator)
  for piece in PIECES:
    repl = replicator.Replicator(devices=devices)
    with repl.context():
      model = spec.build()
      optimizer = keras.optimizers.Adam(1e-3)
      if piece == "full step":
        optimizer = repl.wrap_optimizer(optimizer)
      optimizer.build(model.trainable_variables)
    body = _piece_step(spec, model, optimizer, piece, lambda g, repl=repl: repl.all_reduce(g, "mean"))
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
    step_fn = functools.partial(lambda body, batch: body(*batch), body)
    calls[f"ours {piece}"] = functools.partial(
        lambda repl, step_fn, dataset: step_time._mean(repl.run(step_fn, dataset)), repl, step_fn, dataset)  # pylint: disable=protected-access
  times = _timing.interleaved(calls, rounds, warmup=2)
  print(f"{spec.name} on {len(devices)} logical CPUs, {rounds} interleaved rounds")
  print(_timing.table(["piece", "median", "IQR"], [
      [name, _timing.ms(_timing.summary(t)["median"]), _timing.ms(_timing.summary(t)["iqr"])]
      for name, t in times.items()]))


def build_phases(counts, all_devices) -> None:
  import keras
  import tensorflow as tf

  from benchmarks import _timing
  from benchmarks import build_cost
  from benchmarks import models
  from benchmarks import step_time
  from replicator.views import _local_step  # internals, wrapped with timers below (this process only)
  spent = collections.defaultdict(float)

  def timer(owner, name, label):
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
      start = time.perf_counter()
      try:
        return original(*args, **kwargs)
      finally:
        spent[label] += time.perf_counter() - start

    setattr(owner, name, wrapped)

  timer(_local_step, "build", "trace+plan+rewrite")
  timer(_local_step.CompiledStep, "_build", "executable")
  timer(_local_step.CompiledStep, "__call__", "executable+first run")
  spec = models.by_name("mlp_deep")
  rows = []
  for n in counts:
    devices = list(all_devices[:n])
    spent.clear()
    _, step_fn, repl = build_cost._make_ours(spec, devices)  # pylint: disable=protected-access
    dataset = build_cost._data(spec)  # pylint: disable=protected-access
    start = time.perf_counter()
    step_time._mean(repl.run(step_fn, dataset))  # pylint: disable=protected-access
    total = time.perf_counter() - start
    rows.append([n, "replicator", f"{total:.1f} s", "", f"{spent['trace+plan+rewrite']:.1f} s",
                 f"{spent['executable']:.1f} s", f"{spent['executable+first run'] - spent['executable']:.1f} s"])
    strategy = step_time.mirrored_strategy(devices)
    with strategy.scope():
      model = spec.build()
      optimizer = keras.optimizers.Adam(1e-3)
      optimizer.build(model.trainable_variables)
    body = step_time._sgd_step(spec, model, optimizer, 1.0 / n)  # pylint: disable=protected-access
    train_step = tf.function(lambda it, body=body, strategy=strategy: strategy.run(body, args=next(it)))
    t0 = time.perf_counter()
    iterator = iter(strategy.experimental_distribute_dataset(build_cost._data(spec)))  # pylint: disable=protected-access
    t1 = time.perf_counter()
    train_step.get_concrete_function(iterator)
    t2 = time.perf_counter()
    step_time._mean(strategy.experimental_local_results(train_step(iterator)))  # pylint: disable=protected-access
    t3 = time.perf_counter()
    rows.append([n, "MirroredStrategy", f"{t3 - t0:.1f} s", f"{t1 - t0:.1f} s", f"{t2 - t1:.1f} s", "",
                 f"{t3 - t2:.1f} s"])
    print(rows[-2], rows[-1], flush=True)
  print(_timing.table(["replicas", "framework", "first call", "iterator", "trace (+plan+rewrite)",
                       "executable (GraphDef import)", "first run"], rows, "llrrrrr"))


def call_cost(devices, rounds: int, counts=(0, 50, 200, 400)) -> None:
  import numpy as np
  import tensorflow as tf

  from benchmarks import _timing
  from replicator.views import _captures

  variables = []
  for i in range(max(counts)):
    with tf.device(devices[i % len(devices)]):
      variables.append(tf.Variable(tf.zeros([4])))

  def function(n: int, stacked: bool):
    pairs = [(f"h{i}", v.handle) for i, v in enumerate(variables[:n])]
    captures = _captures.Captures(pairs) if stacked else None

    @tf.function(autograph=False)
    def f():
      handles = captures.input_map() if stacked else {name: _captures.capture(h) for name, h in pairs}
      # Every handle reaches the graph (control edges only: no per-handle op runs).
      with tf.control_dependencies([h.op for h in handles.values()]):
        outs = []
        for device in devices:
          with tf.device(device):
            outs.append(tf.constant(1.0) + 1.0)
      return outs

    return f, captures.num_inputs if stacked else n

  calls, meta = {}, {}
  for n in counts:
    for stacked in ((False, True) if n else (False,)):
      name = f"{n}, " + ("stacked per device" if stacked else "one by one") if n else "none"
      calls[name], num_inputs = function(n, stacked)
      meta[name] = (n, num_inputs)
  times = _timing.interleaved(calls, rounds, warmup=3)
  base = np.median(times["none"])
  rows = []
  for name, t in times.items():
    n, num_inputs = meta[name]
    median = np.median(t)
    rows.append([name, num_inputs, _timing.ms(median), f"{(median - base) / n * 1e6:.2f} us" if n else ""])
  print(f"one call of a function over {len(devices)} logical CPUs, {rounds} interleaved rounds")
  print(_timing.table(["captured handles", "inputs passed", "median call", "extra per handle"], rows, "lrrr"))


def weight_gradient(devices, rounds: int, repeats: int = 4) -> None:
  import numpy as np
  import tensorflow as tf

  from benchmarks import _timing
  rng = np.random.RandomState(0)
  batch, n = 512, len(devices)
  # Distinct inputs per repeat: identical matmuls would be merged into one (grappler's CSE).
  xs = [rng.randn(batch, 256).astype(np.float32) for _ in range(repeats)]
  dys = [rng.randn(batch, 4096).astype(np.float32) for _ in range(repeats)]
  with tf.device(devices[0]):
    full_inputs = [(tf.constant(x), tf.constant(dy)) for x, dy in zip(xs, dys)]
  part_inputs = []  # [repeat][device] -> (x rows, dy rows)
  for x, dy in zip(xs, dys):
    row = []
    for i, device in enumerate(devices):
      with tf.device(device):
        rows = slice(i * batch // n, (i + 1) * batch // n)
        row.append((tf.constant(x[rows]), tf.constant(dy[rows])))
    part_inputs.append(row)

  def gradient(x, dy):
    # A scalar to fetch that needs all of x^T dy (with a slice, grappler shrinks the matmul).
    return tf.reduce_sum(tf.matmul(x, dy, transpose_a=True))

  @tf.function
  def full():
    with tf.device(devices[0]):
      return [gradient(x, dy) for x, dy in full_inputs]

  @tf.function
  def side_by_side():
    out = []
    for row in part_inputs:
      for device, (x, dy) in zip(devices, row):
        with tf.device(device):
          out.append(gradient(x, dy))
    return out

  @tf.function
  def one_part():
    with tf.device(devices[0]):
      return [gradient(*row[0]) for row in part_inputs]

  calls = {f"full batch ({batch}), one device": full,
           f"{n} x {batch // n} rows, side by side": side_by_side,
           f"one part ({batch // n} rows) alone": one_part}
  times = _timing.interleaved({k: (lambda f=f: [t.numpy() for t in f()]) for k, f in calls.items()}, rounds, warmup=3)
  base = np.median(times[f"full batch ({batch}), one device"])
  print(f"weight gradient x^T dy (256x4096 output) on {n} logical CPUs, {rounds} rounds, {repeats} per call")
  print(_timing.table(["computation", "time per gradient", "/ full batch"], [
      [name, _timing.ms(np.median(t) / repeats), f"{np.median(t) / base:.2f}"] for name, t in times.items()], "lrr"))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("what", choices=("step", "build", "call", "grad"))
  parser.add_argument("--model", default="mlp_deep")
  parser.add_argument("--devices", type=int, default=4)
  parser.add_argument("--rounds", type=int, default=30)
  parser.add_argument("--replicas", default="8,16")
  args = parser.parse_args(argv)
  counts = [int(n) for n in args.replicas.split(",")]
  devices = replicator.virtual_cpus(max([64, args.devices] + counts))
  if args.what == "step":
    step_pieces(args.model, devices[:args.devices], args.rounds)
  elif args.what == "call":
    call_cost(devices[:args.devices], max(args.rounds, 200))
  elif args.what == "grad":
    weight_gradient(devices[:args.devices], max(args.rounds, 40))
  else:
    build_phases(counts, devices)


if __name__ == "__main__":
  main()
