"""Multi-worker scenarios, each run in a fresh client process by tests/test_multiworker.py.

Connecting to a cluster changes TensorFlow's process-wide eager context, so
each scenario runs as ``python tests/multiworker_scenarios.py NAME`` and
prints one JSON line of results. Each starts its own local cluster of 2
workers x 2 logical CPUs on loopback ports.
"""

import json
import os
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import replicator  # noqa: E402
from replicator import testing  # noqa: E402

replicator.virtual_cpus(1)
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from mse_step import mse_step  # noqa: E402

X = np.random.RandomState(0).randn(96, 5).astype(np.float32)
Y = np.random.RandomState(1).randn(96, 2).astype(np.float32)
GLOBAL_BATCH = 16
_KEEP = []


def _model():
  keras.utils.set_random_seed(3)
  return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])


def _input_fn(ctx):
  b = GLOBAL_BATCH // ctx.num_replicas
  ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH)
  return ds.map(lambda x, y: (x[ctx.replica_id * b:(ctx.replica_id + 1) * b],
                              y[ctx.replica_id * b:(ctx.replica_id + 1) * b]))


def train_equivalence():
  model = _model()  # one device, this process, before connecting
  reference_step = tf.function(mse_step(model, keras.optimizers.Adam(0.05)))
  for batch in tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH):
    reference_step(batch)
  expected = [v.numpy() for v in model.trainable_variables]
  # Keep the function alive: on TF 2.21, a tf.function traced before connecting
  # and garbage-collected after it fails a later remote op ("Tried to remove
  # non-existent function").
  _KEEP.append(reference_step)
  with testing.local_cluster(2, devices_per_worker=2) as cluster:
    repl = replicator.MultiWorkerReplicator(cluster=cluster.spec)
    with repl.context():
      model = _model()
      optimizer = repl.wrap_optimizer(keras.optimizers.Adam(0.05))
    step = mse_step(model, optimizer)
    while True:
      try:
        repl.run(step, _input_fn)
      except replicator.EndOfInput:
        break
    got = [v.numpy() for v in model.trainable_variables]
    plan = repl.explain(step, _input_fn)
    hosts = [str(d) for d in repl._config.input_hosts]  # pylint: disable=protected-access
    return dict(max_abs_diff=max(float(np.abs(a - b).max()) for a, b in zip(got, expected)),
                implementations=sorted({c.implementation for c in plan.collectives}),
                devices=list(repl.devices), mesh=repl.mesh.shape, input_hosts=hosts,
                components=[c.device for c in model.trainable_variables[0].value.components])


def keras_fit():
  """Keras model.fit of a model made in the context, on 2 workers x 2 CPUs, against fit on one device."""
  x = np.random.RandomState(0).randn(96, 6).astype(np.float32)
  y = (np.random.RandomState(1).rand(96) * 3).astype(np.int64)

  def make():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    model.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model

  reference = make()
  expected = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
  expected_values = [v.numpy() for v in reference.variables + reference.optimizer.variables]
  _KEEP.append(reference)  # its functions must outlive the connection (see train_equivalence)
  with testing.local_cluster(2, devices_per_worker=2) as cluster:
    repl = replicator.MultiWorkerReplicator(cluster=cluster.spec)
    with repl.context():
      model = make()
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    got = [np.asarray(c.numpy()) for v in model.variables + model.optimizer.variables
           for c in getattr(v.value if hasattr(v, "value") else v, "components", [v])]
    per_component = len(got) // len(expected_values)
    diffs = [float(np.abs(got[i] - expected_values[i // per_component]).max()) for i in range(len(got))]
    return dict(max_abs_diff=max(diffs), replicas=repl.num_replicas, components_per_variable=per_component,
                history_diff=max(abs(a - b) for k in expected for a, b in zip(history[k], expected[k])))


def collectives():
  n = 4
  values = [np.arange(8, dtype=np.float32).reshape(4, 2) + 10 * r for r in range(n)]
  results = {}
  with testing.local_cluster(2, devices_per_worker=2) as cluster:
    for implementation in ("auto", "collective_ops"):
      repl = replicator.MultiWorkerReplicator(cluster=cluster.spec, implementation=implementation)
      inputs = replicator.PerReplica([tf.constant(v) for v in values])

      def step(x, repl=repl):
        r = repl.replica_id  # replica r holds r + 1 rows: a ragged gather across workers
        rows = repl.all_reduce(tf.IndexedSlices(x[:r + 1], tf.range(r + 1) + 10 * r, tf.constant([40, 2])))
        return dict(rows=rows.values, row_indices=rows.indices, sum=repl.all_sum(x), mean=repl.all_reduce(x, "mean"), max=repl.all_reduce(x, "max"),
                    worker_sum=repl.all_sum(x, axis="worker"), device_sum=repl.all_sum(x, axis="device"),
                    broadcast=repl.broadcast(x, source=3), gather=repl.all_gather(x, concat_dimension=1),
                    scatter=repl.reduce_scatter(x, scatter_dimension=0),
                    to_all=repl.all_to_all(x, split_dimension=0, concat_dimension=1),
                    permute=repl.permute(x, perm=[(0, 3), (3, 0), (1, 2)]))

      out = repl.run(step, inputs=inputs)
      results[implementation] = {k: [v.numpy().tolist() for v in per.values] for k, per in out.items()}
      results[implementation + "_plan"] = sorted({c.implementation for c in repl.explain(step, inputs=inputs).collectives})
  results["inputs"] = [v.tolist() for v in values]
  return results


def kill_mid_step():
  with testing.local_cluster(2, devices_per_worker=2) as cluster:
    repl = replicator.MultiWorkerReplicator(cluster=cluster.spec, collective_timeout=10.0)
    with repl.context():
      v = tf.Variable(tf.zeros([256, 256]))

    def step():
      v.assign_add(repl.all_reduce(tf.random.normal([256, 256]), "mean") * 1e-3)
      return tf.reduce_sum(v)

    repl.run(step, steps=10)  # built and warm
    killer = threading.Timer(1.0, cluster.kill, args=(1,))
    killer.start()
    start = time.monotonic()
    try:
      for _ in range(100000):
        repl.run(step, steps=50)
      outcome = dict(error=None)
    except replicator.WorkerUnavailableError as e:
      outcome = dict(error=type(e).__name__, task=e.task, message=str(e))
    except Exception as e:  # pylint: disable=broad-except
      outcome = dict(error=type(e).__name__, task=None, message=str(e)[:500])
    outcome["seconds_after_kill"] = time.monotonic() - start - 1.0
    killer.join()
    return outcome


def restarted_worker():
  """A worker restarts (on its address) between two calls: each later call's error, one readable line each."""
  with testing.local_cluster(2, devices_per_worker=2) as cluster:
    repl = replicator.MultiWorkerReplicator(cluster=cluster.spec, collective_timeout=10.0)
    with repl.context():
      v = tf.Variable(tf.ones([4]))

    def step():
      v.assign_add(repl.all_reduce(tf.ones([4]), "mean"))
      return tf.reduce_sum(v)

    repl.run(step)
    cluster.restart(1)
    outcomes = []
    for _ in range(2):
      try:
        repl.run(step)
        outcomes.append(dict(error=None))
      except replicator.WorkerUnavailableError as e:
        outcomes.append(dict(error=type(e).__name__, task=e.task, message=str(e)))
      except Exception as e:  # pylint: disable=broad-except
        outcomes.append(dict(error=type(e).__name__, task=None, message=str(e)[:800]))
    return outcomes


def failing_device():
  """A step across both workers fails on replica 1's device only (a NaN made there): the error names its worker."""
  with testing.local_cluster(2, devices_per_worker=1) as cluster:
    repl = replicator.MultiWorkerReplicator(cluster=cluster.spec)
    with repl.context():
      v = tf.Variable(tf.zeros([2]))

    def step():
      nan_on_replica_1 = tf.math.log(1.0 - tf.cast(repl.replica_id, tf.float32)) * 0.0  # -inf * 0
      x = tf.debugging.check_numerics(tf.ones([2]) + nan_on_replica_1, "made on replica 1")
      v.assign_add(repl.all_reduce(x, "sum"))
      return tf.reduce_sum(v)

    try:
      repl.run(step)
      outcome = dict(error=None)
    except replicator.StepFailedError as e:
      outcome = dict(error="StepFailedError", message=str(e), devices=list(e.devices))
    outcome.update(addresses=list(cluster.addresses), after=v.numpy().tolist())
    return outcome


if __name__ == "__main__":
  result = globals()[sys.argv[1]]()
  print("RESULT " + json.dumps(result), flush=True)
  os._exit(0)  # do not wait for TensorFlow's remote-context teardown
