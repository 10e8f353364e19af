"""The GPU check (issue 58, item 4): every GPU lowering, equal to one device, timed against MirroredStrategy.

One call on a machine with one GPU gives the figures (about 1-2 minutes)::

  python -m benchmarks.gpu_check --json benchmarks/results/gpu_check.json
  python -m benchmarks.gpu_check --virtual 2 --rounds 20      # 2 virtual GPUs, fewer rounds
  python -m benchmarks.gpu_check --device CPU --virtual 2     # the same checks on logical CPUs (runs anywhere)

With ``--device GPU`` (the default) and no GPU visible to TensorFlow it prints
one line saying so (what it would measure, how to run it on a GPU machine),
writes ``{"skipped": reason}`` to ``--json`` if given, and exits 0.

With a GPU: the first physical GPU is split into ``--virtual`` logical GPUs of
``--memory-mb`` each (``tf.config.set_logical_device_configuration``, before
TensorFlow initialises), TensorFloat-32 is turned off (see ``TOLERANCE``), and
for each lowering the library registers (``rewrite.lowering_names()``) that runs
within one process on that device type, a child process runs:

* ``one device``: the step in a ``tf.function`` on the first device, on the
  full global batch (``step_time.single_device``);
* ``data-parallel/<lowering>``: the local view,
  ``Replicator(devices, implementation=<lowering>)``, the optimizer through
  ``repl.wrap_optimizer``, ``repl.run(step_fn, dataset)`` on a dataset of
  global batches (``step_time.ours``);
* ``global/<lowering>``: the global view on the mesh ``{"batch": n // 2,
  "model": 2}`` (2x2 on 4 devices, 1x2 on 2), the hidden layer split over
  "model" Megatron-style (``hidden/kernel`` by columns, ``hidden/bias``,
  ``logits/kernel`` by rows), the one-device step unchanged;
* ``MirroredStrategy`` (its default cross-device ops: on virtual GPUs, as on
  CPUs, TensorFlow's ``CollectiveAllReduce`` with RING) and ``MirroredStrategy
  R2OD`` (``ReductionToOneDevice``) on the same devices (``step_time.mirrored``).

The model is an MLP 256-1024-10 (ReLU, softmax cross-entropy), global batch
64, SGD with momentum (linear in the gradients: a wrong reduction, such as a
sum for a mean, moves the weights, where Adam's normalisation would hide it).
Every configuration starts from the same weights and runs ``CHECK_STEPS``
steps; every variable (each replica's copy in the local view, the global value
in the global view) must equal one device's within ``TOLERANCE``. Then the
configurations are timed interleaved (``_timing.interleaved``: every round
calls each once, in a shuffled order), and each of ours is given as the median
of its round-by-round ratios, with a 95% bootstrap interval, to MirroredStrategy,
to MirroredStrategy R2OD and to one device.

Each lowering runs in a child process of its own (a failing TensorFlow
collective can abort the process's collective executor, and a hung one would
hold the run): a case that fails is recorded with its error and the run goes
on; a child that does not finish within ``--timeout`` seconds is killed and
recorded. The library registers no NCCL lowering (``rewrite.lowering_names()``
gives ``collective_ops``, ``hierarchical``, ``one_device``): the JSON says so
under ``lowerings["nccl"]``, and a lowering whose name contains "nccl" is run
on GPUs as soon as one is registered. ``hierarchical`` is for groups across
worker processes and is not run here (with one process it is ``one_device``
with a collective of one member).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK_STEPS = 3
# Every variable after CHECK_STEPS steps, |ours - one device| at most this (absolute; the weights are below 0.2).
TOLERANCE = 1e-5
TOLERANCE_WHY = (
    f"absolute, on every variable after {CHECK_STEPS} SGD steps: the configurations sum the same float32 products "
    "in other orders (per-replica partial sums, split matmuls, cuBLAS/oneDNN choosing kernels by shape), which "
    "moves a gradient by about 1e-7 of itself and a weight by lr times that (measured here on CPUs: at most a few "
    "1e-8); a wrong reduction moves a weight by the size of an update (wrap_optimizer(reduction='sum'), a sum "
    "for the mean, moved one by 2.6e-2 here). "
    "TensorFloat-32 is off on GPUs, where it would round matmul inputs to 10 mantissa bits (1e-3 relative).")
INPUTS, HIDDEN, CLASSES, BATCH = 256, 1024, 10, 64
LR, MOMENTUM = 0.1, 0.9
LAYOUTS = {r"hidden/kernel$": (None, "model"), r"hidden/bias$": ("model",), r"logits/kernel$": ("model", None)}
MEMORY_MB = 1024
TIMEOUT_S = 130.0
TOTAL_S = 290.0  # the whole run's bound: a lowering is not started with less than MIN_CHILD_S of it left
MIN_CHILD_S = 30.0
BUDGET_S = 40.0  # the timed rounds of one child stop after this (at least 5 rounds)
ONE, MS, MS_R2OD = "one device", "MirroredStrategy", "MirroredStrategy R2OD"
DATA, GLOBAL = "data-parallel", "global"
RESULT = "RESULT "
NO_GPU = "no GPU visible to TensorFlow (tf.config.list_physical_devices('GPU') is empty)"
NOT_IN_ONE_PROCESS = {
    "hierarchical": ("for groups across worker processes: it reduces within each worker process and runs one "
                     "collective op across processes; with the devices of one process it is one_device plus a "
                     "collective of one member (python -m benchmarks.multiworker times it across processes)"),
}


def log(message: str) -> None:
  print(message, flush=True)


# -- what runs where -------------------------------------------------------------------------------------------------


def lowering_plan(device: str, names: list[str] | None = None) -> dict[str, str | None]:
  """Each lowering of the library: None if this check runs it on ``device`` ("GPU" or "CPU"), else why not.

  A reason reads "short: detail"; the summary table shows the short part.
  """
  if names is None:
    import rewrite
    names = rewrite.lowering_names()
  plan: dict[str, str | None] = {}
  for name in names:
    if name in NOT_IN_ONE_PROCESS:
      plan[name] = NOT_IN_ONE_PROCESS[name]
    elif "nccl" in name.lower() and device != "GPU":
      plan[name] = "no CPU kernel: NCCL runs on GPUs only (run with --device GPU on a GPU machine)"
    else:
      plan[name] = None
  if not any("nccl" in name.lower() for name in names):
    plan["nccl"] = (
        f"the library registers no NCCL lowering: rewrite.lowering_names() = {sorted(names)} "
        "(Replicator(implementation=...) takes these names). On GPUs collective_ops runs TensorFlow's collective "
        "ops, which use their RING implementation unless asked for NCCL; on virtual GPUs of one physical GPU "
        "NCCL cannot run at all (it refuses two ranks on one GPU; TensorFlow: 'NCCL is not supported when using "
        "virtual GPUs'), and MirroredStrategy uses RING collectives there too")
  return plan


def no_gpu_message(virtual: int) -> str:
  """The one line printed when ``--device GPU`` finds no GPU."""
  mesh_shape = f"{virtual // 2}x2"
  return (f"gpu_check: skipped, {NO_GPU}. "
          f"On a machine with a GPU it splits the GPU into {virtual} virtual GPUs and, for each lowering the "
          f"library runs on GPUs, checks a data-parallel step and a {mesh_shape} global-view step of an MLP equal "
          f"to one device and times them against MirroredStrategy on the same devices (~2 minutes). Run it "
          f"there: pip install -e \".[gpu,benchmarks]\" -c constraints.txt && python -m benchmarks.gpu_check "
          f"--json gpu_check.json (here: --device CPU runs the same checks on logical CPUs).")


# -- one lowering, in a child process ------------------------------------------------------------------------------


class DeviceSetupError(RuntimeError):
  """The devices this check needs are not there (its message says what was expected, found, and the fix)."""


def _configure(device: str, virtual: int, memory_mb: int) -> list[str]:
  """Splits the first GPU (or the CPU) into ``virtual`` logical devices; returns their names. Before TF starts."""
  import tensorflow as tf
  if device == "CPU":
    import replicator
    return replicator.virtual_cpus(virtual)
  gpus = tf.config.list_physical_devices("GPU")
  if not gpus:
    raise DeviceSetupError("gpu_check --device GPU: expected a GPU, found none in this process. Fix: run on a GPU "
                           "machine, or pass --device CPU.")
  tf.config.set_visible_devices(gpus[0], "GPU")  # one physical GPU, split: the machine the check is written for
  tf.config.set_logical_device_configuration(
      gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=memory_mb)] * virtual)
  logical = tf.config.list_logical_devices("GPU")  # initialises TensorFlow's devices
  if len(logical) != virtual:
    raise DeviceSetupError(f"gpu_check: expected {virtual} virtual GPUs, found {len(logical)} ({logical}). Fix: "
                           "run in a fresh process (devices are set before TensorFlow initialises).")
  tf.config.experimental.enable_tensor_float_32_execution(False)  # see TOLERANCE_WHY
  return [f"/device:GPU:{i}" for i in range(virtual)]


def model_spec():
  """The checked model: ``benchmarks.models.Model`` of an MLP 256-1024-10 with layers named for ``LAYOUTS``."""
  import keras

  from benchmarks import models

  def build() -> keras.Model:
    model = keras.Sequential([keras.layers.Dense(HIDDEN, activation="relu", name="hidden"),
                              keras.layers.Dense(CLASSES, name="logits")])
    model.build((None, INPUTS))
    return model

  return models.Model("mlp_gpu_check", f"MLP {INPUTS}-{HIDDEN}-{CLASSES}, ReLU", BATCH, (INPUTS,), (), build, CLASSES)


def optimizer():
  """SGD with momentum: linear in the gradients, so a wrongly scaled reduction shows in the weights."""
  import keras
  return keras.optimizers.SGD(LR, momentum=MOMENTUM)


def global_mesh_shape(devices: int) -> dict[str, int]:
  return {"batch": devices // 2, "model": 2}


def _global_setup(spec, weights, x, y, devices, implementation):
  """The global view's step of ``spec`` on ``global_mesh_shape``, hidden units split over "model"."""
  import tensorflow as tf

  import mesh
  import replicator
  from benchmarks import step_time
  m = mesh.Mesh(global_mesh_shape(len(devices)), devices=devices)
  repl = replicator.Replicator(mesh=m, layouts=mesh.LayoutMap(LAYOUTS), view="global", implementation=implementation)
  with repl.context():
    model = spec.build()
    opt = optimizer()
    opt.build(model.trainable_variables)
  model.set_weights(weights)

  def step_fn(batch):  # the one-device step, unchanged
    bx, by = batch
    with tf.GradientTape() as tape:
      loss = spec.loss(by, model(bx, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
  return step_time.Setup(lambda: float(repl.run(step_fn, dataset)), model,
                         info=dict(repl=repl, step_fn=step_fn, dataset=dataset))


def _difference(setup, reference) -> float:
  """Max |value - one device's| over every device's copy of every trainable variable of ``setup``'s model.

  ``reference``: one device's values. A variable split by a layout (the global view) holds its piece of the
  one-device value on each device (``mesh.split`` by its layout); a replicated one the whole value on each.
  """
  import numpy as np

  import mesh
  worst = 0.0
  for v, expected in zip(setup.model.trainable_variables, reference):
    tv = getattr(v, "value", v)
    layout = getattr(tv, "layout", None)
    if hasattr(tv, "components"):  # replicator's variables, both views
      values = [c.numpy() for c in tv.components]
      parts = mesh.split(expected, layout) if layout is not None else [expected] * len(values)
    elif hasattr(tv, "values"):  # a MirroredStrategy's MirroredVariable
      values = [c.numpy() for c in tv.values]
      parts = [expected] * len(values)
    else:
      values, parts = [np.asarray(tv)], [expected]
    worst = max([worst] + [float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(values, parts)])
  return worst


def _error(e: BaseException) -> str:
  text = f"{type(e).__name__}: {e}".strip()
  return text if len(text) <= 1500 else text[:1500] + " ..."


def _collectives(setup) -> dict[str, int]:
  """The step's collectives by kind and the lowering that implements them (from ``repl.explain``)."""
  info = setup.info
  plan = info["repl"].explain(info["step_fn"], info["dataset"])
  return dict(collections.Counter(f"{c.kind} ({c.implementation})" for c in plan.collectives))


def measure_lowering(device: str, devices: list[str], lowering: str, rounds: int, budget_seconds: float) -> dict:
  """Builds the baselines and both of ``lowering``'s steps, checks them, times them; a failing case is recorded."""
  import keras
  import tensorflow as tf

  from benchmarks import _timing
  from benchmarks import step_time
  spec = model_spec()
  keras.utils.set_random_seed(0)
  with tf.device(devices[0]):
    weights = spec.build().get_weights()
  x, y = spec.batch()
  makers = {
      ONE: lambda: step_time.single_device(spec, weights, x, y, make_optimizer=optimizer, device=devices[0]),
      MS: lambda: step_time.mirrored(spec, weights, x, y, devices, make_optimizer=optimizer),
      MS_R2OD: lambda: step_time.mirrored(spec, weights, x, y, devices, tf.distribute.ReductionToOneDevice(),
                                          make_optimizer=optimizer),
      f"{DATA}/{lowering}": lambda: step_time.ours(spec, weights, x, y, devices, make_optimizer=optimizer,
                                                   implementation=lowering),
      f"{GLOBAL}/{lowering}": lambda: _global_setup(spec, weights, x, y, devices, lowering),
  }
  records: dict[str, dict] = {name: {} for name in makers}
  setups = {}
  for name, make in makers.items():
    record = records[name]
    try:
      t0 = time.perf_counter()
      setup = make()
      losses = [setup.call()]
      record["first_call_s"] = time.perf_counter() - t0
      losses += [setup.call() for _ in range(CHECK_STEPS - 1)]
      record["losses"] = losses
      setups[name] = setup
      if name == MS:
        record["cross_device_ops"] = step_time.cross_device_ops_name(setup.info["strategy"])
      if name.startswith((DATA, GLOBAL)):
        record["collectives"] = _collectives(setup)
    except Exception as e:  # pylint: disable=broad-except  # recorded; the other cases go on
      record["error"] = _error(e)
      log(f"  {name}: FAILED {record['error'][:300]}")
  if ONE in setups:
    reference = [v.numpy() for v in setups[ONE].model.trainable_variables]
    for name in setups:
      if name != ONE:
        diff = _difference(setups[name], reference)
        records[name].update(max_abs_param_diff_vs_one_device=diff, equal_to_one_device=diff <= TOLERANCE)
        if not name.startswith("Mirrored") and diff > TOLERANCE:
          records[name]["error"] = (f"not equal to one device: max |variable - one device's| = {diff:.2e} after "
                                    f"{CHECK_STEPS} steps, expected at most {TOLERANCE:.0e}")
  for name, record in records.items():
    if "losses" in record:
      diff = record.get("max_abs_param_diff_vs_one_device")
      log(f"  check {name:<28} losses {', '.join(f'{v:.6f}' for v in record['losses'])}"
          + ("" if diff is None else f"  max|param - one device| {diff:.1e}")
          + f"  first call {record['first_call_s']:.1f} s")
  # Timing: every configuration that built; one that fails while timed is recorded and dropped, the rest retimed.
  calls = {name: s.call for name, s in setups.items()}
  times, failed = {}, {}
  while calls:
    failed.clear()

    def guarded(name, call, failed=failed):
      def run():
        try:
          return call()
        except Exception as e:  # pylint: disable=broad-except
          failed[name] = e
          raise
      return run

    try:
      times = _timing.interleaved({n: guarded(n, c) for n, c in calls.items()}, rounds, warmup=2,
                                  budget_seconds=budget_seconds)
      break
    except Exception as e:  # pylint: disable=broad-except
      name = next(iter(failed), None)
      if name is None:
        raise
      records[name]["error"] = "while timed: " + _error(e)
      del calls[name]
  for name, samples in times.items():
    records[name]["step"] = _timing.summary(samples)
  best = min((n for n in (MS, MS_R2OD) if n in times), key=lambda n: records[n]["step"]["median"], default=None)
  for name in times:
    if name.startswith((DATA, GLOBAL)):
      ratios = {f"/ {base}": _timing.paired_ratio(times[name], times[base]) for base in (MS, MS_R2OD, ONE)
                if base in times}
      if best is not None:
        ratios["/ MirroredStrategy best"] = dict(ratios[f"/ {best}"], of=best)
      records[name]["ratios"] = ratios
  return dict(lowering=lowering, devices=devices, cases=records)


def child(args) -> None:
  """``--child LOWERING``: configure the devices, measure, print one ``RESULT`` line of JSON."""
  try:
    devices = _configure(args.device, args.virtual, args.memory_mb)
  except Exception as e:  # pylint: disable=broad-except  # the parent records it and goes on
    hint = (f" Fix: fewer or smaller virtual GPUs (--virtual 2, --memory-mb {args.memory_mb // 2}) if the GPU's "
            "memory is short." if args.device == "GPU" and not isinstance(e, DeviceSetupError) else "")
    record = dict(lowering=args.child, error=f"making {args.virtual} virtual {args.device}s failed: {_error(e)}"
                                             + hint)
    print(RESULT + json.dumps(record), flush=True)
    return
  record = measure_lowering(args.device, devices, args.child, args.rounds, args.budget)
  print(RESULT + json.dumps(record), flush=True)


# -- the parent ----------------------------------------------------------------------------------------------------


def run_child(lowering: str, args, timeout: float) -> dict:
  """Runs one lowering's child process; its record, or one that says why there is none."""
  command = [sys.executable, "-m", "benchmarks.gpu_check", "--child", lowering, "--device", args.device,
             "--virtual", str(args.virtual), "--rounds", str(args.rounds), "--memory-mb", str(args.memory_mb),
             "--budget", str(args.budget)]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
  t0 = time.perf_counter()
  try:
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    out, err, code = done.stdout, done.stderr, done.returncode
  except subprocess.TimeoutExpired as e:
    out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
    code = None
  seconds = time.perf_counter() - t0
  result = None
  for line in out.splitlines():
    if line.startswith(RESULT):
      result = json.loads(line[len(RESULT):])
    else:
      log(line)
  if result is not None:
    return dict(result, status="failed" if "error" in result else "ran", seconds=seconds)
  if code is None:
    why = (f"the child process did not finish within {timeout:.0f} s (--timeout {args.timeout:.0f}, and the run's "
           f"{TOTAL_S:.0f} s bound) and was killed: a collective that never completed, or a slow machine (raise "
           "--timeout)")
  else:
    why = f"the child process exited with code {code} before its result"
  tail = "\n".join(err.strip().splitlines()[-15:])
  log(f"  {lowering}: FAILED: {why}\n{tail}")
  return dict(lowering=lowering, status="failed", error=f"{why}; its last output: {tail}", seconds=seconds)


def summary(result: dict) -> str:
  """The results as a markdown table: one row per configuration of every lowering run."""
  from benchmarks import _timing
  rows = []
  for lowering, entry in result["lowerings"].items():
    if entry.get("status") != "ran":
      why = entry.get("skipped") or entry.get("error", "")
      rows.append([lowering, f"{entry.get('status', '')}: {why.split(': ')[0][:100]} (the JSON says more)", "", "",
                   "", "", "", ""])
      continue
    for name, case in entry["cases"].items():
      ratios = case.get("ratios", {})
      diff = case.get("max_abs_param_diff_vs_one_device")
      equal = "error" if "error" in case else ("" if diff is None else ("yes" if case["equal_to_one_device"]
                                                                          else "NO"))
      rows.append([lowering, name, equal, "" if diff is None else f"{diff:.1e}",
                   _timing.ms(case["step"]["median"]) if "step" in case else "",
                   *(_timing.interval(ratios[k]) if k in ratios else "" for k in (f"/ {MS}", f"/ {MS_R2OD}",
                                                                                   f"/ {ONE}"))])
  return _timing.table(["lowering", "configuration", "equal to one device", "max abs diff", "median step",
                        "/ MirroredStrategy [95% CI]", "/ MS R2OD [95% CI]", "/ one device [95% CI]"], rows,
                       "lllrrrrr")


def _commit() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return ""


def _write(path: str | None, result: dict) -> None:
  if path:
    with open(path, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)
    log(f"gpu_check: wrote {path}")


def parse(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks.gpu_check",
      description="Every lowering the library runs on GPUs: a data-parallel and a global-view step checked equal to "
                  "one device and timed against MirroredStrategy on virtual GPUs (skips, exit 0, without a GPU).")
  parser.add_argument("--json", metavar="F", help="write the results (or {\"skipped\": reason}) to this file")
  parser.add_argument("--virtual", type=int, choices=(2, 4), default=4,
                      help="logical devices to split the GPU (or the CPU) into (default 4: a 2x2 global mesh; "
                           "2: 1x2)")
  parser.add_argument("--rounds", type=int, default=40, help="timed rounds (default 40; at most --budget seconds)")
  parser.add_argument("--device", choices=("GPU", "CPU"), default="GPU",
                      help="GPU (default; skips without one) or CPU: the same checks on logical CPUs, NCCL skipped")
  parser.add_argument("--memory-mb", type=int, default=MEMORY_MB,
                      help=f"memory limit of each virtual GPU in MB (default {MEMORY_MB})")
  parser.add_argument("--timeout", type=float, default=TIMEOUT_S,
                      help=f"seconds one lowering's child process may take before it is killed (default {TIMEOUT_S:.0f})")
  parser.add_argument("--budget", type=float, default=BUDGET_S,
                      help=f"seconds of timed rounds per lowering (default {BUDGET_S:.0f}; at least 5 rounds)")
  parser.add_argument("--child", metavar="LOWERING", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.rounds < 1:
    parser.error(f"--rounds {args.rounds}: expected a positive number of timed rounds. Fix: --rounds 30.")
  if args.memory_mb < 64:
    parser.error(f"--memory-mb {args.memory_mb}: expected at least 64 MB for each virtual GPU. Fix: --memory-mb 1024.")
  return args


def main(argv=None) -> dict:
  args = parse(argv)
  if args.child:
    child(args)
    return {}
  start = time.perf_counter()
  import tensorflow as tf
  gpus = tf.config.list_physical_devices("GPU")  # lists, without initialising the devices
  if args.device == "GPU" and not gpus:
    message = no_gpu_message(args.virtual)
    log(message)
    _write(args.json, dict(skipped=NO_GPU, message=message, tensorflow=tf.__version__, commit=_commit()))
    return dict(skipped=NO_GPU, message=message)
  plan = lowering_plan(args.device)
  details = {}
  if args.device == "GPU":
    details = tf.config.experimental.get_device_details(gpus[0])
  result = dict(
      device=args.device, virtual=args.virtual, rounds=args.rounds, budget_s=args.budget,
      mesh_global=global_mesh_shape(args.virtual), check_steps=CHECK_STEPS, tolerance=TOLERANCE,
      tolerance_why=TOLERANCE_WHY,
      model=f"MLP {INPUTS}-{HIDDEN}-{CLASSES} (ReLU), global batch {BATCH}, SGD lr {LR} momentum {MOMENTUM}",
      layouts_global={k: list(v) for k, v in LAYOUTS.items()},
      machine=dict(platform=platform.platform(), python=platform.python_version(), tensorflow=tf.__version__,
                   cpus=os.cpu_count(), gpus=len(gpus), gpu=details, memory_mb_per_virtual_gpu=args.memory_mb
                   if args.device == "GPU" else None),
      commit=_commit(), started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      lowerings={})
  log(f"gpu_check: {args.virtual} virtual {args.device}s; lowerings: "
      + ", ".join(f"{n} ({'run' if why is None else 'skipped'})" for n, why in plan.items()))
  for name, why in plan.items():
    if why is not None:
      log(f"  {name}: skipped: {why}")
      result["lowerings"][name] = dict(status="skipped", skipped=why)
      continue
    left = TOTAL_S - (time.perf_counter() - start)
    if left < MIN_CHILD_S:
      why = (f"not started, the run's {TOTAL_S:.0f} s bound: {left:.0f} s were left, under {MIN_CHILD_S:.0f} s "
             "(fewer --rounds or a smaller --budget leave time for every lowering)")
      log(f"  {name}: skipped: {why}")
      result["lowerings"][name] = dict(status="skipped", skipped=why)
      continue
    log(f"gpu_check: {name} (child process)")
    result["lowerings"][name] = run_child(name, args, min(args.timeout, left))
  result["elapsed_s"] = time.perf_counter() - start
  ran = [e for e in result["lowerings"].values() if e.get("status") == "ran"]
  cases = [c for e in ran for n, c in e["cases"].items() if n.startswith((DATA, GLOBAL))]
  result["all_equal_to_one_device"] = bool(cases) and all(c.get("equal_to_one_device") and "error" not in c
                                                          for c in cases)
  log("")
  log(summary(result))
  log(f"\ngpu_check: {len(cases)} cases of {len(ran)} lowerings, all equal to one device: "
      f"{result['all_equal_to_one_device']}; {result['elapsed_s']:.0f} s")
  _write(args.json, result)
  return result


if __name__ == "__main__":
  main()
