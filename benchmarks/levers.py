"""One lever at a time: variants of the replicator's step, timed side by side.

Run by hand (not part of ``benchmarks.run``):

  python -m benchmarks.levers --models mlp_deep,mlp_wide --devices 4

Every variant trains the same model from the same weights on the same batch
(``benchmarks.step_time``'s setup), interleaved in rounds, next to the single
device; the table gives medians and each variant's ratio to the single device
and to the library's defaults. Variants (``wrap_optimizer`` arguments):

* ``defaults``: the library's defaults (``update="auto"``, i.e. sharded here;
  256 KB gradient buckets);
* ``update=replicated``: every replica applies every update (the behaviour
  before the sharded update);
* ``no buckets``: one all-reduce per gradient (the default before 256 KB
  buckets);
* ``bucket 4 MB``: gradients fused into 4 MB buckets;
* ``no overlap``: the defaults, but every gradient waits for the whole
  backward pass before its all-reduce (what the defaults gain by overlapping
  communication with the backward pass);
* ``defaults, steps=10``: ten steps per call.
"""

from __future__ import annotations

import argparse
import gc
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import replicator  # noqa: E402

VARIANTS = {
    "defaults": dict(),
    "update=replicated": dict(update="replicated"),
    "no buckets": dict(bucket_bytes=None),
    "bucket 4 MB": dict(bucket_bytes=4 << 20),
    "no overlap (all-reduces after the whole backward)": dict(barrier=True),
}


def measure(model_name: str, devices, rounds: int) -> list[list[str]]:
  import keras
  import tensorflow as tf

  from benchmarks import _timing
  from benchmarks import models
  from benchmarks import step_time

  spec = models.by_name(model_name)
  keras.utils.set_random_seed(0)
  with tf.device("/device:CPU:0"):
    weights = spec.build().get_weights()
  x, y = spec.batch()
  setups = {"single device": step_time.single_device(spec, weights, x, y)}
  for name, kwargs in VARIANTS.items():
    setups[name] = step_time.ours(spec, weights, x, y, devices, **kwargs)
  setups["defaults, steps=10"] = step_time.ours(spec, weights, x, y, devices, steps=10, shared=setups["defaults"])
  for setup in setups.values():  # build and warm up
    for _ in range(3):
      setup.call()
  times = _timing.interleaved({name: s.call for name, s in setups.items()}, rounds=rounds, warmup=1,
                              per_call={name: s.steps_per_call for name, s in setups.items()})
  medians = {name: _timing.summary(t)["median"] for name, t in times.items()}
  rows = []
  for name, median in medians.items():
    rows.append([model_name, name, _timing.ms(median), f"{median / medians['single device']:.2f}",
                 f"{median / medians['defaults']:.2f}",
                 "" if name == "defaults, steps=10"  # the defaults' own step, called 10 steps at a time
                 else _timing.interval(_timing.paired_ratio(times[name], times["defaults"]))])
  del setups
  gc.collect()
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="mlp_deep,mlp_wide")
  parser.add_argument("--devices", type=int, default=4)
  parser.add_argument("--rounds", type=int, default=20)
  args = parser.parse_args(argv)
  devices = replicator.virtual_cpus(args.devices)
  from benchmarks import _timing

  rows = []
  for name in args.models.split(","):
    rows += measure(name, devices, args.rounds)
    print(rows[-1], flush=True)
  print(_timing.table(["model", "variant", "median step", "/ single", "/ defaults",
                       "/ defaults per round [95% CI]"], rows, "llrrrr"))


if __name__ == "__main__":
  main()
