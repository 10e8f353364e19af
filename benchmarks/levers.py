"""One lever at a time: variants of the replicator's step, timed side by side.

Run by hand (not part of ``benchmarks.run``):

  python -m benchmarks.levers --models mlp_deep,mlp_wide --devices 4

Every variant trains the same model from the same weights on the same batch
(``benchmarks.step_time``'s setup), interleaved in rounds, next to the single
device; the table gives medians and each variant's ratio to the single device
and to the library's defaults. Variants (``wrap_optimizer`` arguments):

* ``defaults``: the library's defaults (``update="auto"``, i.e. sharded here;
  1 MB gradient buckets, one owner's gradients each);
* ``update=replicated``: every replica applies every update (the behaviour
  before the sharded update);
* ``no buckets``: one all-reduce per gradient (the default before 256 KB
  buckets);
* ``bucket 256 KB``: the default before 1 MB buckets;
* ``bucket 4 MB``: gradients fused into 4 MB buckets;
* ``no overlap``: the defaults, but every gradient waits for the whole
  backward pass before its all-reduce (what the defaults gain by overlapping
  communication with the backward pass);
* ``handles one by one``: the defaults, but the step's function takes every
  captured variable handle as its own input (before they were stacked per
  device: see ``replicator/views/_captures.py``);
* ``defaults, steps=10``: ten steps per call.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import replicator  # noqa: E402

VARIANTS = {
    "defaults": dict(),
    "update=replicated": dict(update="replicated"),
    "no buckets": dict(bucket_bytes=None),
    "bucket 256 KB": dict(bucket_bytes=256 << 10),
    "bucket 4 MB": dict(bucket_bytes=4 << 20),
    "no overlap (all-reduces after the whole backward)": dict(barrier=True),
    "handles one by one": dict(unstacked=True),
}


@contextlib.contextmanager
def _handles_one_by_one():
  """Steps built inside take every captured handle as its own input (the library before stacking)."""
  from replicator.views import _captures
  stackable = _captures._stackable  # pylint: disable=protected-access
  _captures._stackable = lambda value: False  # pylint: disable=protected-access
  try:
    yield
  finally:
    _captures._stackable = stackable  # pylint: disable=protected-access


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
    kwargs = dict(kwargs)
    with _handles_one_by_one() if kwargs.pop("unstacked", False) else contextlib.nullcontext():
      setups[name] = step_time.ours(spec, weights, x, y, devices, **kwargs)
      setups[name].call()  # the first call builds the step
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
