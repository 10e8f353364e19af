"""The builds the benchmark guard compares: our first call of a fresh step against a peer's first call of the same step.

Each function here runs in a fresh process (a child of ``benchmarks.guard``,
or one worker of a job started by ``replicator.launch``), builds one side of
one pair, times its first call and returns what the guard records: the first
call's wall seconds (``seconds``), the process's CPU seconds in it
(``cpu_seconds``) and the first loss (both sides start from the same weights
on the same data, so their losses agree: the peer builds the same step).

* ``mobilenet_v2``: ``keras.applications.MobileNetV2`` 96x96x3, 10 classes,
  global batch 32, Adam, ``SparseCategoricalCrossentropy``, on 4 logical CPUs.
  Ours: the local view, ``wrap_optimizer(Adam)``, the first ``repl.run``
  (as ``global_view.child_build``, which also splits it into phases). The peer:
  ``tf.distribute.MirroredStrategy`` on the same 4 devices (its default
  cross-device ops; Keras's loss scales each replica's by 1/4 there, as
  Keras 3 sums gradients under a strategy), its first call the distributed
  dataset's iterator and ``strategy.run`` inside a ``tf.function`` to its
  losses.
* ``transformer``: the one-block Keras transformer of ``global_view``
  (Megatron layouts over "model" on 2x4, Adam). Ours: the global view, which
  traces the one-device step once at global shapes and partitions it into one
  program for the 8 devices. The peer: the same one-device step in a
  ``tf.function`` on one device, its first call (one program: what the global
  view starts from).
* ``multiclient``: the guard's deep MLP (16 Dense(128), batch 64, Adam) on W
  worker processes x 1 CPU started by ``replicator.launch``. Ours: every worker
  runs ``MultiWorkerReplicator.from_tf_config()`` (the local view, wrapped
  Adam) and its first ``repl.run``; the peer: every worker runs
  ``MultiWorkerMirroredStrategy``, its first call the distributed dataset's
  iterator and its ``tf.function`` step. The workers wait for each other
  before the first call (``_barrier``), and worker 0's figures are the job's.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

RESULT = "RESULT "
OURS, PEER = "ours", "peer"
MULTICLIENT_MODEL = "mlp_deep"


def _cpu_seconds() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def _first_call(call) -> dict:
  cpu0, t0 = _cpu_seconds(), time.perf_counter()
  loss = call()
  return dict(seconds=time.perf_counter() - t0, cpu_seconds=_cpu_seconds() - cpu0, loss=loss)


def _mean(values) -> float:
  import numpy as np
  return float(np.mean([float(v) for v in values]))


# -- MobileNetV2: the local view against MirroredStrategy ---------------------------------------------------------


def mobilenet_v2(side: str) -> dict:
  """One build of MobileNetV2's data-parallel step on 4 devices: ours (``side="ours"``) or MirroredStrategy's."""
  import keras
  import numpy as np
  import tensorflow as tf

  from benchmarks import global_view
  rng = np.random.default_rng(0)  # global_view.child_build's data
  x = rng.uniform(size=(global_view.NET_BATCH, global_view.IMAGE, global_view.IMAGE, 3)).astype("float32")
  y = rng.integers(0, global_view.NET_CLASSES, size=(global_view.NET_BATCH,)).astype("int32")
  dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
  devices = global_view.cpus(global_view.DEVICES)
  t0 = time.perf_counter()
  if side == OURS:
    import replicator
    repl = replicator.Replicator(devices=devices)
    scope, wrap = repl.context(), repl.wrap_optimizer
  else:
    strategy = tf.distribute.MirroredStrategy(devices)  # its default cross-device ops
    scope, wrap = strategy.scope(), (lambda o: o)
  keras.utils.set_random_seed(0)  # the same initial weights on both sides
  with scope:
    model = keras.applications.MobileNetV2(input_shape=(global_view.IMAGE, global_view.IMAGE, 3),
                                           classes=global_view.NET_CLASSES, weights=None)
    optimizer = wrap(keras.optimizers.Adam(1e-3))
    optimizer.build(model.trainable_variables)
  loss_fn = keras.losses.SparseCategoricalCrossentropy()

  def body(x, y):  # under a strategy Keras's loss scales itself by 1/replicas (Keras 3 sums the gradients there)
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True))
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss

  if side == OURS:
    def step_fn(batch):
      return body(*batch)

    def call():
      return _mean(repl.run(step_fn, dataset))
  else:
    @tf.function
    def train_step(iterator):
      return strategy.run(body, args=next(iterator))

    def call():
      iterator = iter(strategy.experimental_distribute_dataset(dataset))
      return float(sum(strategy.experimental_local_results(train_step(iterator))))  # the scaled losses' sum
  setup = time.perf_counter() - t0
  return dict(_first_call(call), setup_s=setup)


# -- the transformer: the global view on 2x4 against one device ---------------------------------------------------


def _transformer_data():
  import numpy as np
  import tensorflow as tf

  from benchmarks import global_view
  rng = np.random.default_rng(0)
  x = rng.integers(0, global_view.VOCAB, size=(global_view.TF_BATCH, global_view.TIME)).astype("int32")
  y = rng.integers(0, global_view.VOCAB, size=(global_view.TF_BATCH, global_view.TIME)).astype("int32")
  return tf.data.Dataset.from_tensors((x, y)).repeat()


def transformer(side: str) -> dict:
  """One build of the one-block transformer's step: ours (the global view, Megatron on 2x4) or one device's."""
  import keras
  import tensorflow as tf

  from benchmarks import global_view
  dataset = _transformer_data()
  if side == OURS:
    import mesh
    import replicator
    repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "model": 4}, devices=global_view.cpus(8)),
                                 layouts=mesh.LayoutMap(global_view.MEGATRON), batch_axes=("batch",), view="global")
    with repl.context():
      model, optimizer = global_view._transformer(), keras.optimizers.Adam(global_view.ADAM_LR)  # pylint: disable=protected-access
      optimizer.build(model.trainable_variables)
    step_fn = global_view._transformer_step(model, optimizer)  # pylint: disable=protected-access
    return _first_call(lambda: float(repl.run(step_fn, dataset)))
  with tf.device("/device:CPU:0"):
    model, optimizer = global_view._transformer(), keras.optimizers.Adam(global_view.ADAM_LR)  # pylint: disable=protected-access
    optimizer.build(model.trainable_variables)
  step_fn = global_view._transformer_step(model, optimizer)  # pylint: disable=protected-access
  fn = tf.function(lambda iterator: step_fn(next(iterator)))

  def call():
    with tf.device("/device:CPU:0"):
      return float(fn(iter(dataset)))

  return _first_call(call)


# -- multi-client: our job against MultiWorkerMirroredStrategy's -----------------------------------------------------


def _barrier(task: int) -> None:
  """Waits until every worker of the job is here (a file each in ``$BUILD_PEERS_BARRIER``; no TensorFlow in it).

  Without it worker 0's first call would also wait for the slowest worker's
  setup (the workers start together on 2 cores): at 4 workers 2.5-11.5 s of wall time for 1.3-1.8
  s of CPU, round to round.
  """
  directory = os.environ["BUILD_PEERS_BARRIER"]
  workers = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
  with open(os.path.join(directory, str(task)), "w", encoding="utf-8"):
    pass
  while len(os.listdir(directory)) < workers:
    time.sleep(0.005)


def _multiclient_child(side: str, model: str) -> None:
  """One worker of a job (started by ``replicator.launch``): builds ``side``'s step; worker 0 prints its JSON."""
  if side == OURS:
    import replicator
    repl = replicator.MultiWorkerReplicator.from_tf_config()  # before any other TensorFlow op
    scope, wrap, replicas, task = repl.context(), repl.wrap_optimizer, repl.num_replicas, repl.task
  else:
    import tensorflow as tf
    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # before any other TensorFlow op
    scope, wrap = strategy.scope(), (lambda o: o)
    replicas, task = strategy.num_replicas_in_sync, strategy.cluster_resolver.task_id
  import tensorflow as tf

  from benchmarks import multiworker
  from benchmarks import step_time
  t0 = time.perf_counter()
  spec, net, optimizer, (x, y) = multiworker._model(model, scope, wrap)  # pylint: disable=protected-access
  dataset = step_time._dataset(x, y)  # pylint: disable=protected-access
  if side == OURS:
    body = step_time._sgd_step(spec, net, optimizer)  # pylint: disable=protected-access

    def step_fn(batch):
      return body(*batch)

    def call():
      return _mean(repl.run(step_fn, dataset))
  else:
    # Keras 3 all-reduces gradients with SUM under a strategy: each replica's mean loss scaled by 1/replicas.
    body = step_time._sgd_step(spec, net, optimizer, loss_scale=1.0 / replicas)  # pylint: disable=protected-access

    @tf.function
    def train_step(iterator):
      return strategy.run(body, args=next(iterator))

    def call():
      iterator = iter(strategy.experimental_distribute_dataset(dataset))
      return _mean(strategy.experimental_local_results(train_step(iterator)))
  setup = time.perf_counter() - t0
  _barrier(task)
  record = dict(_first_call(call), setup_s=setup, replicas=replicas)
  if task == 0:
    print(RESULT + json.dumps(record), flush=True)
  os._exit(0)  # skip TensorFlow's teardown of remote contexts


def multiclient(side: str, workers: int, root: str | None = None) -> dict:
  """One job of ``workers`` fresh worker processes x 1 CPU building ``side``'s step; worker 0's first call."""
  import io
  import tempfile

  from replicator import launch
  root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = io.TextIOWrapper(io.BytesIO(), write_through=True)
  command = ["-m", "benchmarks.build_peers", "--multiclient-child", side, MULTICLIENT_MODEL]
  with tempfile.TemporaryDirectory(prefix="build-peers-") as barrier:
    env = dict(os.environ, BUILD_PEERS_BARRIER=barrier,
               PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    code = launch.launch(command, workers, 1, timeout=900, env=env, out=out, err=out)
  text = out.buffer.getvalue().decode()
  lines = [line.split(RESULT, 1)[1] for line in text.splitlines() if RESULT in line]
  if code != 0 or not lines:
    raise RuntimeError(f"the {side} job of {workers} workers exited with {code}:\n{text[-3000:]}")
  return json.loads(lines[0])


BUILDERS = {"mobilenet_v2": mobilenet_v2, "transformer": transformer}


if __name__ == "__main__":
  if sys.argv[1:2] == ["--multiclient-child"]:
    _multiclient_child(sys.argv[2], sys.argv[3])
