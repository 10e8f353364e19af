"""Memory per device, with and without rematerialization, and remat's cost in step time (issue 55).

Run by hand (not part of ``benchmarks.run``):

  python -m benchmarks.memory [--quick] [--rounds 15] [--json benchmarks/results/memory.json]

For an MLP, a transformer and a conv net, each a stack of residual blocks,
trained by a custom loop (``tf.GradientTape``, Keras 3 Adam through
``repl.wrap_optimizer``) on one device (a Replicator on ``/device:CPU:0``),
and for the transformer also on a 2x2 mesh ``{"batch": 2, "model": 2}`` in
the global view with a Megatron layout (heads and feed-forward units over
``"model"``), it prints per device:

* from ``repl.memory(step, inputs=...)``: the variables and optimizer slots,
  the bytes saved for backward, the peak (variables included) and the step's
  own peak (``step_peak_bytes``);
* plain (``remat: no``) and with every block wrapped in ``replicator.remat``
  (``remat: yes``);
* the median step time of each, plain and remat timed alternately in one
  process (``_timing.interleaved``: every round calls each once, in a
  shuffled order), and remat's round-by-round ratio to plain with its 95%
  bootstrap interval (``_timing.paired_ratio``). Expected: about 1.3, one
  more forward pass of the blocks (a backward pass costs about two forward
  passes);
* on one device, the CPU allocator's measured peak over a step
  (``reset_memory_stats("CPU:0")``, then ``get_memory_info("CPU:0")["peak"]``
  minus ``"current"`` before the step; the median over 5 steps) next to the
  report's step peak less the input batch (which the allocator counts in
  ``"current"`` before the step: the inputs are tensors made beforehand).
  Logical CPUs share one allocator, so on the 2x2 mesh the measured peak is
  set against the sum of the four devices' step peaks.

Each configuration's variants are measured in fresh processes, run by the
parent, which reads one JSON line from each (``python -m benchmarks.memory
--one KEY --part plain|remat|timing``, KEY one of :data:`CONFIGS`; ``--one
KEY`` alone runs :func:`measure` in its process): the report and the
allocator's peaks of each variant in a process of its own, its first and
only model; plain and remat's step times, which must share their rounds,
in a third. TensorFlow's BFC allocator counts a tensor's whole chunk, and
splits a free chunk only when it is at least twice the request: in a
process where other models ran, a 4 MiB tensor can land in a free chunk of
up to 8 MiB left by them and count as that (the conv net read 1.03-1.23 of
the report after the MLP and the transformer, 1.00 alone).
:func:`measure` runs both variants in the calling process (the test's).

Each process configures 4 logical CPUs (``replicator.virtual_cpus(4)``).
``--quick`` (about 2 minutes, most of it 12 processes starting): tiny models, 3 timed rounds (too small for the
allocator: it sees only allocations of 256 KiB or more under oneDNN, and its figures move by 0.25 MiB).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import replicator  # noqa: E402

DEVICES = 4
MEGATRON = {r"attn/(query|key|value)/kernel$": (None, "model", None), r"attn/(query|key|value)/bias$": ("model", None),
            r"attn/attention_output/kernel$": ("model", None, None), r"ff_in/kernel$": (None, "model"),
            r"ff_in/bias$": ("model",), r"ff_out/kernel$": ("model", None)}
# name -> sizes (full, quick)
SIZES = {
    "mlp": (dict(blocks=8, width=512, batch=256), dict(blocks=2, width=64, batch=16)),
    "transformer": (dict(blocks=4, dim=128, heads=4, time=64, batch=32, vocab=256),
                    dict(blocks=1, dim=32, heads=4, time=8, batch=8, vocab=32)),
    "conv": (dict(blocks=4, channels=32, size=32, batch=32), dict(blocks=1, channels=8, size=8, batch=8)),
}


def _blocks_model(name: str, sizes: dict, remat: bool):
  """``(model, loss_fn, x, y)``: a Keras model of residual blocks, each wrapped in ``replicator.remat`` if ``remat``."""
  import keras
  import numpy as np
  import tensorflow as tf

  keras.utils.set_random_seed(0)
  wrap = replicator.remat if remat else (lambda layer: layer)
  rng = np.random.default_rng(0)
  b = sizes["batch"]
  if name == "mlp":  # residual blocks of two Dense + ReLU (docs/concepts/memory.md's)
    w = sizes["width"]
    inputs = keras.Input((w,))
    h = inputs
    for i in range(sizes["blocks"]):
      block = keras.Sequential([keras.layers.Dense(w, activation="relu"), keras.layers.Dense(w, activation="relu")],
                               name=f"block{i}")
      h = h + wrap(block)(h)
    model = keras.Model(inputs, keras.layers.Dense(w)(h))
    x, y = rng.standard_normal((b, w)), rng.standard_normal((b, w))
    return model, lambda y, out: tf.reduce_mean(tf.square(out - y)), x.astype("float32"), y.astype("float32")
  if name == "transformer":  # pre-LayerNorm blocks: self-attention + a 4x GELU feed-forward; a token head
    d, t, v = sizes["dim"], sizes["time"], sizes["vocab"]
    tokens = keras.Input((t,), dtype="int32")
    h = keras.layers.Embedding(v, d, name="embed")(tokens)
    for i in range(sizes["blocks"]):
      h = wrap(TransformerBlock(d, sizes["heads"], name=f"block{i}"))(h)
    model = keras.Model(tokens, keras.layers.Dense(v, name="head")(keras.layers.LayerNormalization(name="ln")(h)))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return (model, loss, rng.integers(0, v, (b, t)).astype("int32"), rng.integers(0, v, (b, t)).astype("int32"))
  if name == "conv":  # residual blocks of two 3x3 convs (no BatchNorm) at one resolution; pooled to 10 logits
    c, s = sizes["channels"], sizes["size"]
    inputs = keras.Input((s, s, 3))
    h = keras.layers.Conv2D(c, 3, padding="same", activation="relu", name="stem")(inputs)
    for i in range(sizes["blocks"]):
      block = keras.Sequential([keras.layers.Conv2D(c, 3, padding="same", activation="relu"),
                                keras.layers.Conv2D(c, 3, padding="same")], name=f"block{i}")
      h = keras.layers.Activation("relu")(h + wrap(block)(h))
    model = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h)))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, loss, rng.standard_normal((b, s, s, 3)).astype("float32"), rng.integers(0, 10, (b,)).astype("int32")
  raise ValueError(f"Unknown model {name!r}; expected one of {sorted(SIZES)}.")


def _transformer_block_class():
  import keras

  class Block(keras.layers.Layer):
    """``x + attn(ln1(x))``, then ``+ ff_out(gelu(ff_in(ln2(.))))``; sublayers named as MEGATRON's patterns expect."""

    def __init__(self, dim, heads, **kwargs):
      super().__init__(**kwargs)
      self.ln1 = keras.layers.LayerNormalization(name="ln1")
      self.attn = keras.layers.MultiHeadAttention(heads, dim // heads, name="attn")
      self.ln2 = keras.layers.LayerNormalization(name="ln2")
      self.ff_in = keras.layers.Dense(4 * dim, activation="gelu", name="ff_in")
      self.ff_out = keras.layers.Dense(dim, name="ff_out")

    def build(self, shape):
      self.ln1.build(shape)
      self.attn.build(shape, shape)
      self.ln2.build(shape)
      self.ff_in.build(shape)
      self.ff_out.build(tuple(shape[:-1]) + (4 * shape[-1],))

    def call(self, x):
      a = self.ln1(x)
      x = x + self.attn(a, a, use_causal_mask=True)
      return x + self.ff_out(self.ff_in(self.ln2(x)))

  return Block


def TransformerBlock(dim, heads, name):  # noqa: N802 (a layer, made by a class defined after Keras is imported)
  return _transformer_block_class()(dim, heads, name=name)


class Setup:
  """One configuration: its Replicator, model, step, inputs (placed before the step) and report."""

  def __init__(self, repl, name, sizes, remat, layouts=None, global_view=False):
    import keras
    import tensorflow as tf

    import mesh
    with repl.context(layouts=mesh.LayoutMap(layouts) if layouts else None):
      self.model, loss_fn, x, y = _blocks_model(name, sizes, remat)
      optimizer = repl.wrap_optimizer(keras.optimizers.Adam(1e-3))
    model = self.model

    def step(batch):
      xb, yb = batch
      with tf.GradientTape() as tape:
        loss = loss_fn(yb, model(xb, training=True))
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      return loss

    if global_view:  # the global view reads a dataset of global batches
      self.dataset, self.inputs = tf.data.Dataset.from_tensors((x, y)).repeat(), None
    else:  # inputs made before the step: the allocator counts them in "current" before it
      with tf.device("/device:CPU:0"):
        self.dataset, self.inputs = None, (tf.constant(x), tf.constant(y))
    self.input_bytes = x.nbytes + y.nbytes
    self.repl, self.step = repl, step
    t0 = time.perf_counter()
    self.report = repl.memory(step, self.dataset, inputs=self.inputs)
    self.call()  # the first step builds (the report's build is reused) and makes the optimizer's slots
    self.build_seconds = time.perf_counter() - t0

  def call(self):
    loss = self.repl.run(self.step, self.dataset, inputs=self.inputs)  # a PerReplica in the local view
    return float(getattr(loss, "values", (loss,))[0])  # waits for the step

  def measured_peaks(self, steps: int = 5) -> list[int]:
    """The allocator's peak over each of ``steps`` steps, less its current bytes before the step.

    ``[]`` where the CPU allocator keeps no statistics (TensorFlow 2.21 with ``TF_ENABLE_ONEDNN_OPTS=0``:
    ``reset_memory_stats`` raises ``ValueError: Cannot reset memory stats for device 'CPU:0'``).
    """
    import tensorflow as tf
    peaks = []
    for _ in range(steps):
      try:
        tf.config.experimental.reset_memory_stats("CPU:0")
      except ValueError:
        return []
      before = tf.config.experimental.get_memory_info("CPU:0")["current"]
      self.call()
      peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before)
    return peaks


def measure_variant(name: str, sizes: dict, make_repl, remat: bool, layouts=None,
                    global_view=False) -> tuple[dict, Setup]:
  """One variant: its report per device, the loss of its first step, and the allocator's peaks right after it.

  The allocator's peaks depend on what the process ran before (see the module's docstring): run in a fresh
  process (``--part``) for figures of this model alone.
  """
  import numpy as np

  s = Setup(make_repl(), name, sizes, remat, layouts, global_view)
  loss = s.call()
  measured = s.measured_peaks()
  step_peaks = [d.step_peak_bytes for d in s.report.devices]
  return dict(
      devices=[dict(device=d.device, variable_bytes=d.variable_bytes, saved_bytes=d.saved_bytes,
                    peak_bytes=d.peak_bytes, step_peak_bytes=d.step_peak_bytes, peak_op=d.peak_op)
               for d in s.report.devices],
      input_bytes=s.input_bytes,
      # what the allocator should see above "current": every device's step peak, the inputs already held
      expected_measured_bytes=sum(step_peaks) - s.input_bytes,
      measured_peak_bytes=measured, measured_peak_median=float(np.median(measured)) if measured else None,
      loss_after_build=loss, build_seconds=s.build_seconds), s


def time_variants(setups: dict, rounds: int) -> dict:
  """Plain and remat (``setups``: remat -> Setup, each built and called once) timed in the same rounds."""
  from benchmarks import _timing
  times = _timing.interleaved({remat: s.call for remat, s in setups.items()}, rounds=rounds, warmup=1,
                              budget_seconds=60)
  return dict(step_seconds={"remat" if remat else "plain": t for remat, t in times.items()},
              remat_over_plain=_timing.paired_ratio(times[True], times[False]))


def _assemble(label: str, name: str, sizes: dict, variants: dict, timing: dict) -> dict:
  from benchmarks import _timing
  result = dict(label=label, model=name, sizes=sizes, variants={})
  for variant in ("plain", "remat"):
    seconds = timing["step_seconds"][variant]
    result["variants"][variant] = dict(variants[variant], step_seconds=seconds, step=_timing.summary(seconds))
  result["remat_over_plain"] = timing["remat_over_plain"]
  return result


def measure(label: str, name: str, sizes: dict, make_repl, rounds: int, layouts=None, global_view=False) -> dict:
  """Both variants of one model (plain, remat) in this process: reports per device, measured peaks, step times.

  The remat variant's allocator peaks come after the plain one's build and steps in the same allocator
  (:func:`measure_fresh` gives each variant a process of its own).
  """
  variants, setups = {}, {}
  for remat in (False, True):
    variants["remat" if remat else "plain"], setups[remat] = measure_variant(name, sizes, make_repl, remat, layouts,
                                                                             global_view)
  return _assemble(label, name, sizes, variants, time_variants(setups, rounds))


# -- fresh processes ------------------------------------------------------------------------------------------------

# --one KEY -> (label, model, on the 2x2 Megatron mesh in the global view)
CONFIGS = {"mlp": ("mlp, 1 device", "mlp", False), "transformer": ("transformer, 1 device", "transformer", False),
           "conv": ("conv, 1 device", "conv", False),
           "transformer-2x2": ("transformer, 2x2 Megatron (global view)", "transformer", True)}
PARTS = ("plain", "remat", "timing")
RESULT = "MEMORY-RESULT "  # the child's line of JSON on stdout


def _child(key: str, part: str | None, quick: bool, rounds: int) -> dict:
  """Configuration ``key`` in this (fresh) process: a variant's figures, both variants' times, or (no part) all."""
  devices = replicator.virtual_cpus(DEVICES)  # before TensorFlow runs an op
  import mesh

  label, name, on_mesh = CONFIGS[key]
  sizes = SIZES[name][1 if quick else 0]
  if on_mesh:
    m = mesh.Mesh({"batch": 2, "model": 2}, devices=devices[:4])
    make_repl, layouts = lambda: replicator.Replicator(mesh=m, view="global", batch_axes=("batch",)), MEGATRON
  else:
    make_repl, layouts = lambda: replicator.Replicator(devices=["/device:CPU:0"]), None
  if part is None:
    return measure(label, name, sizes, make_repl, rounds, layouts, on_mesh)
  if part in ("plain", "remat"):
    return measure_variant(name, sizes, make_repl, part == "remat", layouts, on_mesh)[0]
  setups = {remat: Setup(make_repl(), name, sizes, remat, layouts, on_mesh) for remat in (False, True)}
  losses = {"remat" if remat else "plain": s.call() for remat, s in setups.items()}
  return dict(time_variants(setups, rounds), loss_after_build=losses)


def _in_child(key: str, part: str, quick: bool, rounds: int) -> dict:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  command = [sys.executable, "-m", "benchmarks.memory", "--one", key, "--part", part, "--rounds", str(rounds)]
  done = subprocess.run(command + (["--quick"] if quick else []), cwd=root, capture_output=True, text=True,
                        check=False)
  lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
  if done.returncode or not lines:
    raise RuntimeError(f"{' '.join(command[1:])} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n"
                       f"{done.stderr[-3000:]}")
  return json.loads(lines[-1][len(RESULT):])


def measure_fresh(key: str, quick: bool, rounds: int) -> dict:
  """:func:`measure`'s result for configuration ``key``, each variant and the timing in a fresh process."""
  label, name, _ = CONFIGS[key]
  variants = {part: _in_child(key, part, quick, rounds) for part in ("plain", "remat")}
  timing = _in_child(key, "timing", quick, rounds)
  return _assemble(label, name, SIZES[name][1 if quick else 0], variants, timing)


def rows(results: list[dict]) -> list[list[str]]:
  from benchmarks import _timing
  out = []
  for r in results:
    for variant in ("plain", "remat"):
      v = r["variants"][variant]
      measured = v["measured_peak_median"]
      for i, d in enumerate(v["devices"]):
        first = i == 0
        out.append([r["label"] if first and variant == "plain" else "", "yes" if variant == "remat" else "no",
                    d["device"].replace("/device:", ""), f"{d['variable_bytes'] / 2**20:.2f}",
                    f"{d['saved_bytes'] / 2**20:.2f}", f"{d['peak_bytes'] / 2**20:.2f}",
                    f"{d['step_peak_bytes'] / 2**20:.2f}",
                    "" if not first else "n/a" if measured is None else f"{measured / 2**20:.2f}",
                    "" if not first or measured is None else f"{measured / v['expected_measured_bytes']:.2f}",
                    _timing.ms(v["step"]["median"]) if first else "",
                    _timing.interval(r["remat_over_plain"]) if first and variant == "remat" else ""])
  return out


HEADER = ["model", "remat", "device", "variables+slots MiB", "saved for backward MiB", "peak MiB", "step peak MiB",
          "allocator's step peak MiB", "allocator / report", "median step", "remat / plain [95% CI]"]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small models, 3 timed rounds (a smoke test)")
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--models", default="mlp,transformer,conv")
  parser.add_argument("--no-mesh", action="store_true", help="skip the 2x2 Megatron transformer")
  parser.add_argument("--json", default=None, help="write every sample and summary here")
  parser.add_argument("--one", choices=sorted(CONFIGS),
                      help="(a child process) measure this configuration alone, print its result as JSON")
  parser.add_argument("--part", choices=PARTS, help="(with --one) only this variant, or the timing of both")
  args = parser.parse_args(argv)
  rounds = 3 if args.quick else args.rounds
  if args.one:
    print(RESULT + json.dumps(_child(args.one, args.part, args.quick, rounds)), flush=True)
    return
  from benchmarks import _timing

  names = args.models.split(",")
  unknown = [n for n in names if n not in SIZES]
  if unknown:
    parser.error(f"unknown models {unknown}; expected some of {sorted(SIZES)}")
  keys = names + (["transformer-2x2"] if not args.no_mesh and "transformer" in names else [])
  start, load = time.perf_counter(), os.getloadavg()
  results = []
  for key in keys:
    results.append(measure_fresh(key, args.quick, rounds))
    print(_timing.table(HEADER, rows(results[-1:])), flush=True)
  seconds = time.perf_counter() - start
  print(f"\n{_timing.table(HEADER, rows(results), 'lllrrrrrrrr')}\n\n{seconds:.0f} s")
  if args.json:
    try:
      commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=False).stdout.strip()
    except OSError:
      commit = ""
    with open(args.json, "w") as f:
      json.dump(dict(results=results, quick=args.quick, rounds=rounds, seconds=seconds,
                     processes="fresh: each variant's report and allocator peaks, and each configuration's timing",
                     date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                     machine=dict(cpus=os.cpu_count(), platform=platform.platform()), commit=commit,
                     load_average=dict(start=load, end=os.getloadavg())), f, indent=1)


if __name__ == "__main__":
  main()
