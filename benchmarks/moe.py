"""A top-k mixture-of-experts layer: experts split over the batch axis (expert parallel) against data-parallel.

One process, 4 logical CPUs. The layer is the one of ``tests/test_expert_parallel.py`` at a larger size: every
group (a row of the batch) routes its tokens to their top 2 experts with a capacity per expert (twice the even
share), the experts' stacked kernels ``[experts, hidden, ffn]`` and ``[experts, ffn, hidden]``. Three
configurations of the same Adam training step, interleaved round by round:

* ``one device``: a ``tf.function`` on one CPU;
* ``data-parallel``: the global view on ``{"batch": 4}``, every kernel replicated (each device updates every
  expert);
* ``expert-parallel``: the same mesh, the experts' kernels split over "batch": the dispatched tokens go to the
  devices holding their experts by ``all_to_all`` and come back by another.

For each number of experts and tokens per group it prints the step times, the bytes per device of the experts'
kernels and Adam's slots, and the bytes the all-to-alls move a step (``repl.explain``); then the time of one
all-to-all of the dispatch buffer alone: how the all-to-all grows with the experts and the tokens.

Run by hand: ``python -m benchmarks.moe [--experts 4,8] [--tokens 32,128] [--rounds 15] [--json F]``.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import replicator  # noqa: E402
from benchmarks import _timing  # noqa: E402

GROUPS, HIDDEN, FFN, TOP_K = 8, 64, 256, 2


def _layer(keras, tf, experts: int, tokens: int):
  capacity = max(1, 2 * tokens * TOP_K // experts)

  class TopKMoE(keras.layers.Layer):

    def build(self, input_shape):
      self.router = self.add_weight(name="router", shape=(HIDDEN, experts))
      self.w_in = self.add_weight(name="experts_in", shape=(experts, HIDDEN, FFN))
      self.w_out = self.add_weight(name="experts_out", shape=(experts, FFN, HIDDEN))

    def call(self, x):
      probs = tf.nn.softmax(tf.einsum("gsh,he->gse", x, self.router))
      top_p, top_i = tf.math.top_k(probs, k=TOP_K)
      mask = tf.reshape(tf.one_hot(top_i, experts), [GROUPS, tokens * TOP_K, experts])
      position = tf.cumsum(mask, axis=1) * mask - mask
      kept = mask * tf.cast(position < capacity, mask.dtype)
      dispatch = tf.one_hot(tf.cast(position, tf.int32), capacity) * kept[..., None]
      dispatch = tf.reshape(dispatch, [GROUPS, tokens, TOP_K, experts, capacity])
      combine = tf.reduce_sum(dispatch * top_p[..., None, None], axis=2)
      dispatch = tf.reduce_sum(dispatch, axis=2)
      expert_in = tf.einsum("gsec,gsh->gech", dispatch, x)
      hidden = tf.nn.relu(tf.einsum("gech,ehf->gecf", expert_in, self.w_in))
      return tf.einsum("gsec,gech->gsh", combine, tf.einsum("gecf,efh->gech", hidden, self.w_out))

  keras.utils.set_random_seed(0)
  inputs = keras.Input((tokens, HIDDEN), batch_size=GROUPS)
  return keras.Model(inputs, TopKMoE(name="moe")(inputs))


def _step(tf, model, optimizer):
  def step(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(model(x) - y))
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss
  return step


def measure(experts: int, tokens: int, rounds: int) -> dict:
  import keras  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  import mesh  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(0)
  batch = (rng.normal(size=(GROUPS, tokens, HIDDEN)).astype(np.float32),
           rng.normal(size=(GROUPS, tokens, HIDDEN)).astype(np.float32))
  data = tf.data.Dataset.from_tensors(batch).repeat()
  devices = [d.name for d in tf.config.list_logical_devices("CPU")[:4]]
  with tf.device(devices[0]):
    one, one_opt = _layer(keras, tf, experts, tokens), keras.optimizers.Adam(1e-3)
    one_step = tf.function(_step(tf, one, one_opt))
  calls, record = {"one device": lambda: one_step(batch).numpy()}, {"experts": experts, "tokens": tokens}
  for name, layouts in (("data-parallel", None), ("expert-parallel", mesh.LayoutMap({"experts_": ("batch",)},
                                                                                     pad=True))):
    repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 4}, devices=devices), layouts=layouts, view="global",
                                 strict=True)
    with repl.context():
      model, optimizer = _layer(keras, tf, experts, tokens), keras.optimizers.Adam(1e-3)
    step = _step(tf, model, optimizer)
    repl.run(step, data)  # builds the step and Adam's slots
    report = repl.explain(step, data)
    moves = [c for c in report.collective_rows if c.kind == "all_to_all"]
    expert_vars = [v for v in model.weights + optimizer.variables if "experts_" in v.path]
    record[name] = {
        "expert_bytes_per_device": max(replicator.bytes_per_device(expert_vars).values()),
        "collectives": len(report.collective_rows), "bytes_per_step": report.bytes_per_step,
        "all_to_alls": len(moves), "all_to_all_bytes_per_step": sum(c.bytes_per_step for c in moves)}
    calls[name] = (lambda repl=repl, step=step: float(repl.run(step, data)))
  times = _timing.interleaved(calls, rounds=rounds, warmup=2)
  for name, samples in times.items():
    record.setdefault(name, {})["step_ms"] = _timing.summary(samples)["median"] * 1e3
  for name in ("data-parallel", "expert-parallel"):
    record[name]["ratio_to_one_device"] = _timing.paired_ratio(times[name], times["one device"])
  return record


def all_to_all_time(experts: int, tokens: int, rounds: int) -> dict:
  """One all-to-all of the expert-parallel step's dispatch buffer, timed alone (the local view).

  Each of the 4 devices holds ``[groups/4, experts, capacity, hidden]`` (its
  groups' tokens, sorted by expert) and sends each device its experts'
  share; a step doing that and the way back, against a step that only reads
  the buffer, interleaved: the difference over two is one all-to-all.
  """
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  import mesh  # pylint: disable=import-outside-toplevel

  capacity = max(1, 2 * tokens * TOP_K // experts)
  devices = [d.name for d in tf.config.list_logical_devices("CPU")[:4]]
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 4}, devices=devices))
  shape = [GROUPS // 4, experts, capacity, HIDDEN]
  with repl.context():
    buffer = tf.Variable(np.ones(shape, np.float32))

  def there_and_back():
    x = buffer.read_value()
    moved = repl.all_to_all(x, split_dimension=1, concat_dimension=0)  # to the devices holding the experts
    return tf.reduce_sum(repl.all_to_all(moved, split_dimension=0, concat_dimension=1)[:1, :1, :1, :1])

  def read_only():
    return tf.reduce_sum(buffer.read_value()[:1, :1, :1, :1])

  calls = {name: (lambda fn=fn: [t.numpy() for t in repl.run(fn)]) for name, fn in (("moved", there_and_back),
                                                                                    ("read", read_only))}
  times = _timing.interleaved(calls, rounds=rounds, warmup=2)
  moved, read = (_timing.summary(times[k])["median"] for k in ("moved", "read"))
  return {"experts": experts, "tokens": tokens, "bytes_per_device": int(np.prod(shape)) * 4,
          "all_to_all_ms": max(0.0, moved - read) / 2 * 1e3, "read_only_step_ms": read * 1e3}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--experts", default="4,8")
  parser.add_argument("--tokens", default="32,128")
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--json")
  args = parser.parse_args(argv)
  replicator.virtual_cpus(4)
  records = [measure(int(e), int(t), args.rounds) for e in args.experts.split(",") for t in args.tokens.split(",")]
  rows = []
  for r in records:
    for name in ("one device", "data-parallel", "expert-parallel"):
      info = r[name]
      rows.append([r["experts"], r["tokens"], name, _timing.ms(info["step_ms"] / 1e3),
                   _timing.interval(info["ratio_to_one_device"]) if "ratio_to_one_device" in info else "",
                   f"{info['expert_bytes_per_device']:,}" if "expert_bytes_per_device" in info else "",
                   f"{info.get('all_to_alls', '')}", f"{info['all_to_all_bytes_per_step']:,}"
                   if "all_to_all_bytes_per_step" in info else "", f"{info['bytes_per_step']:,}"
                   if "bytes_per_step" in info else ""])
  print(_timing.table(["experts", "tokens/group", "configuration", "step", "over one device",
                       "expert weights+slots/device", "all_to_alls", "all_to_all bytes/step", "bytes/step"], rows))
  alone = [all_to_all_time(int(e), int(t), args.rounds) for e in args.experts.split(",")
           for t in args.tokens.split(",")]
  print()
  print("One all-to-all of the dispatch buffer alone (4 devices, local view; the step there and back less a step"
        " that reads the buffer, over two):")
  print(_timing.table(["experts", "tokens/group", "bytes/device", "all_to_all"],
                      [[a["experts"], a["tokens"], f"{a['bytes_per_device']:,}", f"{a['all_to_all_ms']:.2f} ms"]
                       for a in alone]))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"config": {"groups": GROUPS, "hidden": HIDDEN, "ffn": FFN, "top_k": TOP_K, "rounds": args.rounds},
                 "records": records, "all_to_all_alone": alone}, f, indent=1)


if __name__ == "__main__":
  main()
