"""Multi-client scenarios: each worker process of ``python -m replicator.launch`` runs this script.

``python -m replicator.launch --workers W --devices-per-worker D tests/multi_client_scenarios.py NAME OUT``
runs scenario NAME in every worker; each writes what it found to ``OUT/worker_<task>.npz`` for
tests/test_multi_client.py to compare with a one-device reference computed there.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import replicator  # noqa: E402  (does not start TensorFlow)

# The multi-client runtime starts before TensorFlow runs anything.
TIMEOUT = float(os.environ.get("SCENARIO_COLLECTIVE_TIMEOUT", "60"))
if os.environ.get("SCENARIO_SLURM_PORT_BASE"):  # started as SLURM starts a job step's tasks (SLURM_* variables)
  import tensorflow as tf  # noqa: E402  (runs nothing yet)
  # TensorFlow 2.21's resolver gives each task of a node one of its GPUs; on CPU nodes, as many "GPUs" as tasks.
  tasks_per_node = int(os.environ["SLURM_STEP_TASKS_PER_NODE"])
  resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
      port_base=int(os.environ["SCENARIO_SLURM_PORT_BASE"]), gpus_per_node=tasks_per_node, gpus_per_task=1,
      auto_set_gpu=False)
  repl = replicator.MultiWorkerReplicator.from_cluster_resolver(resolver, collective_timeout=TIMEOUT)
else:
  repl = replicator.MultiWorkerReplicator.from_tf_config(collective_timeout=TIMEOUT)

import keras  # noqa: E402
import loop_steps  # noqa: E402  (steps with loops and branches that communicate inside)
import residual_block  # noqa: E402
import tensorflow as tf  # noqa: E402
from mse_step import mse_step  # noqa: E402  (one replica's step: mean squared error, the optimizer's update)

import mesh  # noqa: E402

X = np.random.RandomState(0).randn(96, 5).astype(np.float32)
Y = np.random.RandomState(1).randn(96, 2).astype(np.float32)
GLOBAL_BATCH = 16
STEPS = 4


def model_and_optimizer():
  # Each process draws different initial weights: the replicas must start from worker 0's.
  keras.utils.set_random_seed(100 + repl.task)
  with repl.context():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(2)])
    optimizer = repl.wrap_optimizer(keras.optimizers.Adam(0.05))
  return model, optimizer


def input_fn(ctx):
  b = GLOBAL_BATCH // ctx.num_replicas
  ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH)
  return ds.map(lambda x, y: (x[ctx.replica_id * b:(ctx.replica_id + 1) * b],
                              y[ctx.replica_id * b:(ctx.replica_id + 1) * b]))


def components(variables):
  """Every local component of every variable: name -> [this process's replicas' values]."""
  found = {}
  for v in variables:
    inner = getattr(v, "value", v)  # a Keras variable wraps the replicated tf.Variable
    replicated = getattr(inner, "components", None)
    found[v.path if hasattr(v, "path") else v.name] = np.stack([c.numpy() for c in replicated])
  return found


def train(out):
  model, optimizer = model_and_optimizer()
  initial = {f"initial/{k}": v for k, v in components(model.trainable_variables).items()}

  train_step = mse_step(model, optimizer)

  def step(batch):
    return train_step(batch), tf.shape(batch[0])[0]

  if repl.task == 0:  # a step only worker 0 builds: the others' keys must not shift (they are not counted)
    repl.explain(lambda: repl.all_reduce(tf.ones([3])))
  losses = []
  for _ in range(STEPS):
    loss, rows = repl.run(step, input_fn)
    losses.append(float(repl.reduce("mean", loss)))
  gathered = repl.gather(loss).numpy()
  refused = []  # an axis out of range: refused in every process before a step runs (the job's steps still agree)
  for bad in (lambda: repl.gather(loss, axis=1), lambda: repl.reduce("sum", loss, axis=0)):
    try:
      bad()
    except replicator.ArgumentError as e:
      refused.append(str(e))
  summed_rows = int(repl.reduce("sum", rows))
  found = {f"final/{k}": v for k, v in components(model.variables + optimizer.variables).items()}
  np.savez(os.path.join(out, f"worker_{repl.task}.npz"), losses=np.array(losses), gathered=gathered,
           summed_rows=summed_rows, refused=np.array(refused), replicas=np.array(repl.local_replicas),
           intra_op_threads=tf.config.threading.get_intra_op_parallelism_threads(), **initial, **found)


def train_global(out):
  """The global view: the one-device step, partitioned; SCENARIO_LAYOUT "batch" (data parallel over every device)
  or "megatron" (the hidden layer split over each worker's devices, the batch over the workers)."""
  layout = os.environ.get("SCENARIO_LAYOUT", "batch")
  split, batch = {"batch": (None, ("worker", "device")), "megatron": ("device", ("worker",)),
                  "across": ("worker", ("device",))}[layout]
  layouts = {r"dense/kernel$": (None, split), r"dense/bias$": (split,), r"dense_1/kernel$": (split, None)} \
      if split else None
  global_repl = replicator.MultiWorkerReplicator.from_tf_config(view="global", layouts=layouts, batch_axes=batch,
                                                                collective_timeout=60.0)
  keras.utils.set_random_seed(100 + repl.task)
  with global_repl.context():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh", name="dense"),
                              keras.layers.Dense(2, name="dense_1")])
    optimizer = keras.optimizers.Adam(0.05)
    optimizer.build(model.trainable_variables)
  initial = {f"initial/{k}": v for k, v in _whole(model.trainable_variables).items()}
  sharded = [v.path for v in model.trainable_variables if v.value.sharding is not None]

  step = tf.function(mse_step(model, optimizer))  # written for one device

  dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH)
  losses = [float(global_repl.run(step, dataset)) for _ in range(STEPS)]
  found = {f"final/{k}": v for k, v in _whole(model.variables + optimizer.variables).items()}
  pieces = {f"pieces/{k}": v for k, v in components(model.trainable_variables).items()}
  # A checkpoint (worker 0 writes; what is split across processes is read by all first), then restored into
  # variables zeroed: each process's values come back.
  manager = global_repl.checkpoint_manager(tf.train.Checkpoint(model=model, optimizer=optimizer),
                                           os.path.join(out, "checkpoints"))
  manager.save(checkpoint_number=STEPS)
  for v in model.variables + optimizer.variables:
    v.assign(tf.zeros_like(v))
  restored = manager.restore_or_initialize()
  back = {f"restored/{k}": v for k, v in _whole(model.variables + optimizer.variables).items()}
  np.savez(os.path.join(out, f"worker_{repl.task}.npz"), losses=np.array(losses), sharded=np.array(sharded),
           replicas=np.array(global_repl.local_replicas), restored=str(restored), **initial, **found, **pieces,
           **back)


def loops_global(out):
  """Loops and branches whose bodies communicate, in the global view of every process (2 workers x 2 devices).

  The model axis is "device" (SCENARIO_LAYOUT "within": a split weight's pieces on each worker's devices, the batch
  over the workers) or "worker" ("across": its pieces in both processes, the batch over each worker's devices).
  Keras's LSTM ("within") or GRU ("across") with its kernels split, and a decoding loop over a column- and a
  row-parallel weight with a tf.cond reducing over the batch, 3 Adam steps each (strict: nothing may fall back).
  Saves each one's variables and slots (as this process reads them), losses, and repl.explain's rows of the
  collectives inside bodies.
  """
  model_axis, batch, names = loop_steps.PLACEMENTS[os.environ["SCENARIO_LAYOUT"]]
  global_repl = replicator.MultiWorkerReplicator.from_tf_config(
      view="global", layouts=loop_steps.layouts(model_axis, names), batch_axes=batch, strict=True,
      collective_timeout=TIMEOUT)
  with global_repl.context():
    made = loop_steps.made(names)
  found = {}
  for name, (step, data, variables) in made.items():
    found.update({f"{name}/initial/{k}": v for k, v in loop_steps.numbered(variables).items()})
    found[f"{name}/inside"] = np.array(loop_steps.inside_rows(global_repl.explain(step, data)))
    found[f"{name}/losses"] = np.array([float(global_repl.run(step, data)) for _ in range(loop_steps.STEPS)])
    found.update({f"{name}/final/{k}": v for k, v in loop_steps.numbered(variables).items()})
  np.savez(os.path.join(out, f"worker_{repl.task}.npz"), **found)


def loop_mismatch(out):
  """Worker 1's loop runs one iteration more than worker 0's, its body gathering a weight's columns split over the
  workers: its fourth iteration's gather waits for a worker that never comes to it. Worker 1 writes the error its
  step raises; worker 0, its step done, waits for that (or 60 s) before it leaves, or (SCENARIO_ENDS) ends at once
  as a script does."""
  import time
  global_repl = replicator.MultiWorkerReplicator.from_tf_config(
      view="global", layouts={r"^w$": (None, "worker")}, batch_axes=("device",), collective_timeout=TIMEOUT)
  with global_repl.context():
    w = tf.Variable(np.random.RandomState(0).randn(6, 6).astype(np.float32), name="w")
  iterations = 3 + repl.task

  def step(x):
    _, h = tf.while_loop(lambda t, h: t < iterations, lambda t, h: (t + 1, tf.nn.softmax(tf.matmul(h, w)) + x),
                         [tf.constant(0), x])
    return tf.reduce_sum(h)

  start = time.monotonic()
  try:
    x = np.random.RandomState(1).randn(8, 6).astype(np.float32)
    found = f"ran: {float(global_repl.run(step, tf.data.Dataset.from_tensors(x).repeat()))}"
  except replicator.WorkerUnavailableError as e:
    found = f"{type(e).__name__}: {e}"
  path = os.path.join(out, f"worker_{repl.task}.txt")
  with open(path + ".tmp", "w") as f:
    f.write(f"{time.monotonic() - start:.1f}\n{found}")
  os.rename(path + ".tmp", path)
  deadline = time.monotonic() + (0 if os.environ.get("SCENARIO_ENDS") else 60)
  while repl.task == 0 and not os.path.exists(os.path.join(out, "worker_1.txt")) and time.monotonic() < deadline:
    time.sleep(0.2)


def fit(out):
  """Keras's own loop in every process: compile in the context, fit (validation, metrics), evaluate, predict.

  First, before the program sets a seed, Keras's default ``shuffle=True`` and an unseeded ``dataset.shuffle``.
  """
  shuffled = _shuffled()
  keras.utils.set_random_seed(100 + repl.task)
  with repl.context():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh", name="dense"),
                              keras.layers.Dense(2, name="dense_1")])
    model.compile(keras.optimizers.Adam(0.05), "mse", metrics=["mae"], steps_per_execution=2)
  _fit_and_save(model, out, **shuffled)


SHUFFLED_ROWS = np.random.RandomState(2).rand(64, 3).astype(np.float32) + 1.0


def _shuffled():
  """Two epochs of a model whose kernel sums the rows it is given (SGD of -mean(x @ kernel)), shuffled each epoch.

  Each process keeps its replicas' rows of the global batches it reads: unless every process shuffles alike, some
  rows are trained on twice and others never, and the kernel is not 2 x the rows' sum / the batch.
  """
  zeros = np.zeros((len(SHUFFLED_ROWS), 1), np.float32)
  kernels = {}
  for how in ("arrays", "dataset"):
    with repl.context():
      model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros",
                                                                       name="summed")], name=f"shuffled_{how}")
      model.compile(keras.optimizers.SGD(1.0), lambda y, predicted: -tf.reduce_mean(predicted))
    if how == "arrays":  # Keras's default shuffle=True
      model.fit(SHUFFLED_ROWS, zeros, batch_size=GLOBAL_BATCH, epochs=2, verbose=0)
    else:
      dataset = tf.data.Dataset.from_tensor_slices((SHUFFLED_ROWS, zeros)).shuffle(len(zeros)).batch(GLOBAL_BATCH)
      model.fit(dataset, epochs=2, verbose=0)
    kernels[f"shuffled/{how}"] = model.layers[0].kernel.numpy()
  return kernels


def keras_distribution(out):
  """Keras's distribution API, as written for JAX: initialize, a DeviceMesh over every process's devices,
  ModelParallel (the hidden layer split over 'model', within a worker), fit."""
  replicator.enable_keras_distribution()
  keras.distribution.initialize()  # the job from KERAS_DISTRIBUTION_* (the launcher sets them)
  devices = keras.distribution.list_devices()
  device_mesh = keras.distribution.DeviceMesh((repl.num_workers, len(devices) // repl.num_workers),
                                              ["batch", "model"], devices)
  layout_map = keras.distribution.LayoutMap(device_mesh)
  layout_map[".*dense/kernel"] = (None, "model")
  layout_map[".*dense/bias"] = ("model",)
  layout_map[".*dense_1/kernel"] = ("model", None)
  keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                       batch_dim_name="batch"))
  keras.utils.set_random_seed(100 + repl.task)
  model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh", name="dense"),
                            keras.layers.Dense(2, name="dense_1")])
  model.compile(keras.optimizers.Adam(0.05), "mse", metrics=["mae"], steps_per_execution=2)
  sharded = [v.path for v in model.trainable_variables if v.value.sharding is not None]
  _fit_and_save(model, out, sharded=np.array(sharded), devices=np.array(devices))


def _fit_and_save(model, out, **more):
  """fit (2 epochs, a third for validation), evaluate and predict the compiled ``model``; saves what they gave."""
  initial = {f"initial/{k}": v for k, v in _whole(model.trainable_variables).items()}
  history = model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, validation_split=1 / 3, shuffle=False, verbose=0)
  evaluated = model.evaluate(X, Y, batch_size=GLOBAL_BATCH, verbose=0)
  predicted = model.predict(X[:GLOBAL_BATCH], batch_size=GLOBAL_BATCH, verbose=0)
  found = {f"final/{k}": v for k, v in _whole(model.variables + model.optimizer.variables
                                               + model.metrics_variables).items()}
  np.savez(os.path.join(out, f"worker_{repl.task}.npz"), evaluated=np.array(evaluated), predicted=predicted,
           **{f"history/{k}": np.array(v) for k, v in history.history.items()}, **initial, **found, **more)


def _whole(variables):
  """Every variable's value as this process reads it outside a step (a sharded one assembled from its pieces)."""
  return {v.path if hasattr(v, "path") else v.name: np.asarray(v.numpy() if hasattr(v, "numpy") else v)
          for v in variables}


def uneven(out):
  """Each replica's input_fn dataset: 3 batches of 4 rows on worker 0's replicas, 5 on worker 1's. Every process
  must run the same steps (worker 0's replicas on empty batches once theirs end) and end at the same call."""
  model, optimizer = model_and_optimizer()

  def step(batch):
    x, y = batch
    with tf.GradientTape() as tape:  # a sum over the rows: an empty batch adds nothing
      loss = tf.reduce_sum((model(x) - y) ** 2) / 4.0
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return tf.shape(x)[0]

  def input_fn(ctx):
    batches = 3 if ctx.replica_id < repl.num_replicas // 2 else 5
    return tf.data.Dataset.from_tensor_slices((X[:4 * batches], Y[:4 * batches])).batch(4)

  calls, rows, ended = 0, [], ""
  for _ in range(10):
    try:
      found = repl.run(step, input_fn)
    except replicator.EndOfInput as e:
      ended = str(e)
      break
    calls += 1
    rows.append(int(repl.reduce("sum", found)))
  with open(os.path.join(out, f"worker_{repl.task}.txt"), "w") as f:
    f.write(f"{calls}\n{rows}\n{ended}")


SHARD_FILES = (24, 24, 32, 16)  # rows a file: the shards of 2 processes (files 0, 2 and 1, 3) end at different steps


def write_shard_files(directory):
  """The rows of X, Y (with their index) in TFRecord files of SHARD_FILES rows; their names, in order."""
  names, start = [], 0
  for f, rows in enumerate(SHARD_FILES):
    names.append(os.path.join(directory, f"rows_{f}.tfrecord"))
    with tf.io.TFRecordWriter(names[-1]) as writer:
      for i in range(start, start + rows):
        writer.write(tf.io.serialize_tensor(tf.constant(np.concatenate([[i], X[i], Y[i]]), tf.float32)).numpy())
    start += rows
  return names


def with_policy(dataset, policy):
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = policy
  return dataset.with_options(options)


def sharded(out):
  """A dataset of global batches of 16 rows, sharded by file (its auto_shard_policy FILE): each process reads its own
  files, its replicas take its rows, until both shards have ended; then HINT sharding of data in memory; then what
  cannot be sharded says why."""
  keras.utils.set_random_seed(100 + repl.task)
  with repl.context():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])
    optimizer = repl.wrap_optimizer(keras.optimizers.Adam(0.05), reduction="sum")
  initial = {f"initial/{k}": v for k, v in components(model.trainable_variables).items()}

  def step(batch):
    ids, x, y = batch[:, 0], batch[:, 1:6], batch[:, 6:]
    with tf.GradientTape() as tape:  # the global batch's mean: a replica's sum over the global batch's rows
      loss = tf.reduce_sum((model(x) - y) ** 2) / (GLOBAL_BATCH * 2.0)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return tf.cast(ids, tf.int32), tf.shape(batch)[0]  # (a static size would be a constant here)

  directory = os.path.join(out, f"files_{repl.task}")
  os.makedirs(directory)
  files = tf.data.Dataset.from_tensor_slices(write_shard_files(directory))
  dataset = files.interleave(tf.data.TFRecordDataset, cycle_length=1).map(
      lambda s: tf.ensure_shape(tf.io.parse_tensor(s, tf.float32), [8])).batch(GLOBAL_BATCH)
  dataset = with_policy(dataset, tf.data.experimental.AutoShardPolicy.FILE)
  rows, ended = [], ""
  while True:
    try:
      ids, sizes = repl.run(step, dataset)
    except replicator.EndOfInput as e:
      ended = str(e)
      break
    rows.append([np.asarray(v).tolist() for v in ids.values])  # this process's replicas' rows
    assert [int(n) for n in sizes.values] == [len(r) for r in rows[-1]], (sizes, rows[-1])
  found = {f"final/{k}": v for k, v in components(model.variables + optimizer.variables).items()}

  hint = tf.data.Dataset.range(96).shard(tf.data.experimental.SHARD_HINT, tf.data.experimental.SHARD_HINT)
  hint_rows = [np.asarray(v).tolist() for v in next(iter(repl.distribute_dataset(with_policy(
      hint.map(lambda i: i * 10).batch(GLOBAL_BATCH), tf.data.experimental.AutoShardPolicy.HINT)))).values]
  errors = []
  for policy in (tf.data.experimental.AutoShardPolicy.FILE,  # on data in memory
                 tf.data.experimental.AutoShardPolicy.HINT):  # without a hint
    try:
      repl.distribute_dataset(with_policy(tf.data.Dataset.range(96).batch(GLOBAL_BATCH), policy))
    except replicator.InputMismatchError as e:
      errors.append(str(e))
  np.savez(os.path.join(out, f"worker_{repl.task}.npz"), rows=np.array(repr(rows)), ended=ended,
           hint_rows=np.array(repr(hint_rows)), errors=np.array(errors), **initial, **found)


def sharded_global(out):
  """The global view on a dataset sharded by file (FILE, 2 x 2, data parallel): each process reads its own files, 8
  rows of each 16-row global batch; the step sees the whole batch. Three steps in one call, then one a call."""
  global_repl = replicator.MultiWorkerReplicator.from_tf_config(view="global", collective_timeout=60.0)
  keras.utils.set_random_seed(100 + repl.task)
  with global_repl.context():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])
    optimizer = keras.optimizers.Adam(0.05)
    optimizer.build(model.trainable_variables)
  initial = {f"initial/{k}": v for k, v in _whole(model.trainable_variables).items()}
  train_step = mse_step(model, optimizer)

  @tf.function
  def step(batch):
    return train_step((batch[:, 1:6], batch[:, 6:])), tf.cast(batch[:, 0], tf.int32)

  directory = os.path.join(out, f"files_{repl.task}")
  os.makedirs(directory)
  files = tf.data.Dataset.from_tensor_slices(write_shard_files(directory))
  dataset = with_policy(files.interleave(tf.data.TFRecordDataset, cycle_length=1).map(
      lambda s: tf.ensure_shape(tf.io.parse_tensor(s, tf.float32), [8])).batch(GLOBAL_BATCH, drop_remainder=True),
      tf.data.experimental.AutoShardPolicy.FILE)
  # Explained from the spec (a shard hint cannot be read unsharded): the shards' step, built once for both.
  table = np.concatenate([np.arange(96)[:, None], X, Y], axis=1).astype(np.float32)
  hint = tf.data.Dataset.from_tensor_slices(table).shard(tf.data.experimental.SHARD_HINT,
                                                        tf.data.experimental.SHARD_HINT)
  explained = type(global_repl.explain(step, with_policy(hint.batch(GLOBAL_BATCH, drop_remainder=True),
                                                         tf.data.experimental.AutoShardPolicy.HINT))).__name__
  _, ids = global_repl.run(step, dataset, steps=3, all_steps=True)
  rows = np.asarray(ids).tolist()
  ended = ""
  while True:
    try:
      rows.append(np.asarray(global_repl.run(step, dataset)[1]).tolist())
    except replicator.EndOfInput as e:
      ended = str(e)
      break
  found = {f"final/{k}": v for k, v in _whole(model.variables + optimizer.variables).items()}
  np.savez(os.path.join(out, f"worker_{repl.task}.npz"), rows=np.array(rows), ended=ended, explained=explained,
           **initial, **found)


def fit_sharded(out):
  """Keras's fit on a dataset sharded by file (FILE, 2 x 2), repeated, 4 steps an epoch; then fit on the dataset
  not repeated, which Keras's loop cannot end in every process at once: refused, saying so."""
  keras.utils.set_random_seed(100 + repl.task)
  with repl.context():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh", name="dense"),
                              keras.layers.Dense(2, name="dense_1")])
    model.compile(keras.optimizers.Adam(0.05), "mse", steps_per_execution=2)
  initial = {f"initial/{v.path}": np.asarray(v.numpy()) for v in model.trainable_variables}
  directory = os.path.join(out, f"files_{repl.task}")
  os.makedirs(directory)
  files = tf.data.Dataset.from_tensor_slices(write_shard_files(directory))
  rows = files.interleave(tf.data.TFRecordDataset, cycle_length=1).map(
      lambda s: tf.ensure_shape(tf.io.parse_tensor(s, tf.float32), [8]))
  dataset = rows.map(lambda r: (r[1:6], r[6:])).batch(GLOBAL_BATCH, drop_remainder=True)
  model.fit(with_policy(dataset.repeat(), tf.data.experimental.AutoShardPolicy.FILE), epochs=1, steps_per_epoch=4,
            verbose=0)
  found = {f"final/{v.path}": np.asarray(v.numpy()) for v in model.variables + model.optimizer.variables}
  try:
    model.fit(with_policy(dataset, tf.data.experimental.AutoShardPolicy.FILE), epochs=1, verbose=0)
    refused = ""
  except replicator.UnsupportedError as e:
    refused = str(e)
  np.savez(os.path.join(out, f"worker_{repl.task}.npz"), refused=refused, **initial, **found)


def refusals(out):
  """What does not run across processes yet says so, and what instead."""
  found = []
  try:
    repl.wrap_optimizer(keras.optimizers.SGD(0.1), update="sharded")
  except replicator.UnsupportedError as e:
    found.append(str(e))
  import mesh  # pylint: disable=import-outside-toplevel
  try:  # a mesh over worker 0's devices only
    replicator.MultiWorkerReplicator.from_tf_config(mesh=mesh.Mesh({"x": 1}, devices=repl.devices[:1]))
  except replicator.ClusterConfigError as e:
    found.append(str(e))
  with open(os.path.join(out, f"worker_{repl.task}.txt"), "w") as f:
    f.write("\n---\n".join(found))


def dead_peer(out):
  """Worker 1 dies after two steps; worker 0's next step must fail with a named error, never hang."""
  import time
  model, optimizer = model_and_optimizer()

  step = mse_step(model, optimizer)
  at = os.environ.get("SCENARIO_AT")
  if at == "fit":  # Keras's fit in every process once (a step function of Keras's, traced and run)
    with repl.context():
      fitted = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
      fitted.compile(keras.optimizers.Adam(0.05), "mse")
    fitted.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)

  for _ in range(2):
    repl.run(step, input_fn)
  if repl.task == 1:
    if os.environ.get("SCENARIO_HANG"):
      time.sleep(60)  # alive, its port open, but it never joins: a hung worker
    os._exit(0)  # gone without a word: a crashed machine
  time.sleep(1.0)
  start = time.monotonic()
  try:
    if at == "variable":  # an eager agreement: a new variable's initial value
      with repl.context():
        tf.Variable(tf.ones([3]))
    elif at == "fit":
      fitted.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
    else:
      repl.run(step, input_fn)
    found = "no error"
  except Exception as e:  # noqa: BLE001  (the test checks which)
    found = f"{type(e).__name__}: {e}"
  with open(os.path.join(out, "worker_0.txt"), "w") as f:
    f.write(f"{time.monotonic() - start:.1f}\n{found}")
  # Then the process ends as a script does (its collectives aborted by the watchdog: no teardown waits for the peer).


def save_crash(out):
  """Megatron across workers (each process writes its pieces); worker 1 dies in the second save, before writing them:
  worker 0's save fails naming it, and the first checkpoint stays the latest (the second is not committed)."""
  import time
  layouts = {r"dense/kernel$": (None, "worker"), r"dense/bias$": ("worker",), r"dense_1/kernel$": ("worker", None)}
  global_repl = replicator.MultiWorkerReplicator.from_tf_config(view="global", layouts=layouts, batch_axes=("device",),
                                                                collective_timeout=TIMEOUT)
  with global_repl.context():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh", name="dense"),
                              keras.layers.Dense(2, name="dense_1")])
    optimizer = keras.optimizers.Adam(0.05)
    optimizer.build(model.trainable_variables)
  directory = os.path.join(out, "checkpoints")
  manager = global_repl.checkpoint_manager(tf.train.Checkpoint(model=model, optimizer=optimizer), directory)
  manager.save(checkpoint_number=1)
  if repl.task == 1:
    tf.raw_ops.SaveV2 = lambda **kwargs: os._exit(0)  # its pieces never written: a crash in the middle of the save
  start = time.monotonic()
  try:
    manager.save(checkpoint_number=2)
    found = "no error"
  except Exception as e:  # noqa: BLE001  (the test checks which)
    found = f"{type(e).__name__}: {e}"
  with open(os.path.join(out, "worker_0.txt"), "w") as f:
    f.write(f"{time.monotonic() - start:.1f}\n{os.path.basename(tf.train.latest_checkpoint(directory))}\n{found}")


def resume(out):
  """Trains to SCENARIO_STEPS from the latest checkpoint in SCENARIO_CKPT (if any), saving every 2 steps.

  With SCENARIO_KILL_AT=k the last worker kills itself (SIGKILL, a crash) once step k is done.
  """
  import signal
  directory, total = os.environ["SCENARIO_CKPT"], int(os.environ["SCENARIO_STEPS"])
  kill_at = int(os.environ.get("SCENARIO_KILL_AT", "-1"))
  model, optimizer = model_and_optimizer()
  optimizer.build(model.trainable_variables)
  manager = repl.checkpoint_manager(tf.train.Checkpoint(model=model, optimizer=optimizer), directory,
                                    max_to_keep=10)
  restored = manager.restore_or_initialize()
  start = int(optimizer.iterations.numpy())
  # The data order depends on the step only: global batch i is the i-th (of a dataset repeated).
  dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(RESUME_BATCH).repeat().skip(start)

  step = mse_step(model, optimizer)

  for done in range(start + 1, total + 1):
    repl.run(step, dataset)
    if done % 2 == 0:
      manager.save(checkpoint_number=done)
    if done == kill_at and repl.task == repl.num_workers - 1:
      os.kill(os.getpid(), signal.SIGKILL)
  found = {f"final/{k}": v for k, v in components(model.variables + optimizer.variables).items()}
  np.savez(os.path.join(out, f"worker_{repl.task}.npz"), start=start, restored=str(restored),
           workers=repl.num_workers, **found)


RESUME_BATCH = 12  # divides over 2, 3 and 4 replicas


def memory(out):
  """The memory report of one process's device in the global view, and the allocator's peak over its steps."""
  global_repl = replicator.MultiWorkerReplicator.from_tf_config(view="global", collective_timeout=TIMEOUT)
  width, rows = 1024, 1024
  with global_repl.context():
    model = keras.Sequential([keras.Input((width,))] + [keras.layers.Dense(width, activation="relu")
                                                        for _ in range(3)] + [keras.layers.Dense(width)])
    optimizer = keras.optimizers.Adam(1e-3)
  step = mse_step(model, optimizer)
  batch = tuple(np.random.RandomState(i).randn(rows, width).astype(np.float32) for i in range(2))
  data = tf.data.Dataset.from_tensors(batch).repeat()
  report = global_repl.memory(step, data)
  [device] = report.devices  # this process's one device
  global_repl.run(step, data)  # the first step: the optimizer's slots
  ratios = []
  for _ in range(4):
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    global_repl.run(step, data)
    ratios.append((before + device.step_peak_bytes) / tf.config.experimental.get_memory_info("CPU:0")["peak"])
  np.savez(os.path.join(out, f"worker_{repl.task}.npz"), ratios=np.array(ratios), device=device.device,
           saved=device.saved_bytes, variables=device.variable_bytes)


def restore_damaged(out):
  """restore_or_initialize() of SCENARIO_CKPT, whose latest checkpoint a test damaged: what each process raised."""
  model, optimizer = model_and_optimizer()
  optimizer.build(model.trainable_variables)
  manager = repl.checkpoint_manager(tf.train.Checkpoint(model=model, optimizer=optimizer), os.environ["SCENARIO_CKPT"],
                                    max_to_keep=10)
  try:
    manager.restore_or_initialize()
    found = "no error"
  except replicator.CheckpointDamagedError as e:
    found = f"{type(e).__name__}\n{os.path.basename(e.previous or '')}\n{e}"
  with open(os.path.join(out, f"worker_{repl.task}.txt"), "w") as f:
    f.write(found)


def preempt(out):
  """Trains until a SIGTERM to any worker; then every worker saves (worker 0 writes) and exits 0 at one step."""
  import time
  model, optimizer = model_and_optimizer()
  optimizer.build(model.trainable_variables)
  manager = repl.checkpoint_manager(tf.train.Checkpoint(model=model, optimizer=optimizer), os.environ["SCENARIO_CKPT"])
  dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(RESUME_BATCH).repeat()

  step = mse_step(model, optimizer)

  with repl.preemption_handler(manager) as preemption:
    for done in range(1, 100000):
      repl.run(step, dataset)
      if done == 3:
        print("ready", repl.task, os.getpid(), flush=True)
      if preemption.stop_requested(done):
        break
      time.sleep(0.02)
  print("stopped", repl.task, done, preemption.signalled, int(optimizer.iterations.numpy()), flush=True)


def pipeline(out):
  """repl.pipeline with its stages on different workers (the stage axis is "worker", the batch over each worker's
  devices): the model of the other scenarios cut in two, SCENARIO_SCHEDULE's schedule, 2 microbatches a replica."""
  stage_repl = replicator.MultiWorkerReplicator.from_tf_config(batch_axes=("device",), collective_timeout=TIMEOUT)
  keras.utils.set_random_seed(100 + repl.task)
  with stage_repl.context():
    stages = [keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh")]),
              keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])]
    optimizer = stage_repl.wrap_optimizer(keras.optimizers.Adam(0.05))
  variables = replicator.pipeline_variables(stages)
  initial = {f"initial/{k}": components([v])[v.path] for k, v in enumerate(variables)}
  schedule = os.environ.get("SCENARIO_SCHEDULE", "1f1b")

  def step(batch):
    loss, grads = stage_repl.pipeline(stages, batch[0], batch[1], keras.losses.mean_squared_error, axis="worker",
                                      microbatches=2, schedule=schedule)
    optimizer.apply_gradients(zip(grads, variables))
    return stage_repl.all_reduce(loss, "mean", axis="device")

  dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH)
  losses = [float(stage_repl.run(step, dataset)[0]) for _ in range(STEPS)]
  permutes = [c for c in stage_repl.explain(step, dataset).collectives if c.kind == "permute"]
  found = {f"final/{k}": components([v])[v.path] for k, v in enumerate(variables)}
  np.savez(os.path.join(out, f"worker_{repl.task}.npz"), losses=np.array(losses), permutes=len(permutes),
           replicas=np.array(stage_repl.local_replicas), **initial, **found)


def stacked_global(out):
  """replicator.StackedBlocks in the global view with its stages on different workers (the stacked weights split
  over "worker", the batch over each worker's devices): a microbatch's activation goes between the processes
  inside the pipeline's loop. 4 Adam steps of the one-device step."""
  global_repl = replicator.MultiWorkerReplicator.from_tf_config(
      view="global", layouts=mesh.LayoutMap({r"^blocks/": ("worker",)}, pad=True), batch_axes=("device",),
      collective_timeout=TIMEOUT)
  keras.utils.set_random_seed(100 + repl.task)
  with global_repl.context():
    model = residual_block.two_blocks(stacked=True)
    optimizer = keras.optimizers.Adam(0.05)
    optimizer.build(model.trainable_variables)
  initial = {f"initial/{k}": v for k, v in _whole(model.trainable_variables).items()}
  step = tf.function(mse_step(model, optimizer))
  dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH)
  losses = [float(global_repl.run(step, dataset)) for _ in range(STEPS)]
  final = {f"final/{k}": v for k, v in _whole(model.trainable_variables).items()}
  inside = [f"{r.kind} over {'+'.join(r.axes)}" for r in global_repl.explain(step, dataset).inside_rows]
  np.savez(os.path.join(out, f"worker_{repl.task}.npz"), losses=np.array(losses), inside=np.array(inside),
           held=np.array(sum(replicator.bytes_per_device(model.weights + optimizer.variables).values())), **initial,
           **final)


def ring_across(out):
  """repl.ring_attention over the "worker" axis (a sequence split over the processes, causal, zigzag order) with
  exchange="auto" (the all-gather of the keys and values across processes) and exchange="ring" (the ring's
  permutes as sends between the processes); each process's output and gradients."""
  rng = np.random.RandomState(7)
  q, k, v, w = (rng.randn(1, 8, 2, 4).astype(np.float32) for _ in range(4))

  def step(exchange="auto"):
    index = int(tf.get_static_value(repl.axis_index("worker")))
    mine = [replicator.shard_sequence(x, index, 2, order="zigzag") for x in (q, k, v, w)]
    with tf.GradientTape() as tape:
      tape.watch(mine[:3])
      attended = repl.ring_attention(*mine[:3], axis="worker", causal=True, order="zigzag", exchange=exchange)
      loss = tf.reduce_sum(attended * mine[3])
    return [attended, *tape.gradient(loss, mine[:3])]

  def ring_step():
    return step("ring")

  found = [t.values[0].numpy() for t in repl.run(step)]
  ring = [t.values[0].numpy() for t in repl.run(ring_step)]
  said = [c.location for c in repl.explain(step).collectives]
  np.savez(os.path.join(out, f"worker_{repl.task}.npz"), out=found[0], dq=found[1], dk=found[2], dv=found[3],
           ring_out=ring[0], ring_dq=ring[1], ring_dk=ring[2], ring_dv=ring[3],
           kinds=np.array(sorted({c.kind for c in repl.explain(step).collectives})),
           ring_kinds=np.array(sorted({c.kind for c in repl.explain(ring_step).collectives})),
           gathered=np.array(any("all-gathered, as the axis spans worker processes" in s for s in said)))


if __name__ == "__main__":
  name, out = sys.argv[1], sys.argv[2]
  {"train": train, "train_global": train_global, "fit": fit, "keras_distribution": keras_distribution, "uneven": uneven, "sharded": sharded, "sharded_global": sharded_global, "fit_sharded": fit_sharded,
   "refusals": refusals, "dead_peer": dead_peer, "save_crash": save_crash, "resume": resume,
   "restore_damaged": restore_damaged, "memory": memory, "preempt": preempt, "loops_global": loops_global,
   "loop_mismatch": loop_mismatch, "pipeline": pipeline, "stacked_global": stacked_global,
   "ring_across": ring_across}[name](out)
  print("done", repl.task, flush=True)
