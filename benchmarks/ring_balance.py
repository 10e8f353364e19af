"""The global view's causal ring attention, balanced (zigzag, half the score blocks) against every tile pair.

One process on 4 logical CPUs, ``{"seq": 4}``, ``input_layouts=(None, "seq",
None, None)``: a step of causal attention at global shapes
(``replicator.core._blockwise_ring.attention``, ``is_causal=True``) and the
gradients of ``sum(out * w)`` with respect to q, k and v, once with
``balanced=True`` (``_zigzag_ring``: ``2P + 1`` of ``4P`` quarter-blocks a
pass, the tokens reordered by permutes first) and once with
``balanced=False`` (every tile pair). The two are called alternately in
shuffled order, round by round (``_timing.interleaved``); the ratio is the
median of the rounds' ratios with its bootstrap interval.

Run by hand: ``python -m benchmarks.ring_balance [--lengths 1024,2048] [--heads 4] [--rounds 15] [--json F]``.
"""

from __future__ import annotations

import argparse

from benchmarks import _timing


def _calls(length: int, heads: int, size: int, batch: int):
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  import mesh  # pylint: disable=import-outside-toplevel
  import replicator  # pylint: disable=import-outside-toplevel
  from replicator.core import _blockwise_ring  # pylint: disable=import-outside-toplevel

  repl = replicator.Replicator(mesh=mesh.Mesh({"seq": 4}), view="global", batch_axes=(),
                               input_layouts=(None, "seq", None, None))
  rng = np.random.default_rng(0)
  values = tuple(rng.normal(size=(batch, length, heads, size)).astype(np.float32) for _ in range(4))
  data = tf.data.Dataset.from_tensors(values).repeat()

  def step_of(balanced):
    def step(batch):
      q, k, v, w = batch
      with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        out = _blockwise_ring.attention(q, k, v, is_causal=True, scale=size ** -0.5, tiles=4, balanced=balanced)
        loss = tf.reduce_sum(out * w)
      return [loss] + [tf.reduce_sum(g) for g in tape.gradient(loss, [q, k, v])]
    return step

  steps = {"balanced": step_of(True), "every pair": step_of(False)}
  first = {name: [float(x) for x in repl.run(step, data)] for name, step in steps.items()}
  np.testing.assert_allclose(first["balanced"], first["every pair"], rtol=1e-3, atol=1e-2)
  return {name: (lambda step=step: [float(x) for x in repl.run(step, data)]) for name, step in steps.items()}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser()
  parser.add_argument("--lengths", default="1024,2048")
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--size", type=int, default=64)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  import mesh  # pylint: disable=import-outside-toplevel
  mesh.virtual_cpus(4)
  results, rows = {}, []
  for length in (int(n) for n in args.lengths.split(",")):
    times = _timing.interleaved(_calls(length, args.heads, args.size, args.batch), rounds=args.rounds)
    ratio = _timing.paired_ratio(times["balanced"], times["every pair"])
    results[str(length)] = dict(times={k: _timing.summary(v) for k, v in times.items()}, ratio=ratio)
    rows.append([length, _timing.ms(results[str(length)]["times"]["balanced"]["median"]),
                 _timing.ms(results[str(length)]["times"]["every pair"]["median"]), _timing.interval(ratio)])
  print(_timing.table(["tokens", "balanced", "every pair", "balanced / every pair"], rows))
  _timing.save_json(results, args.json)
  return results


if __name__ == "__main__":
  main()
