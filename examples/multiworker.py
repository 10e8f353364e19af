"""Training on two worker processes, surviving the loss of one.

A supervisor (this script) starts a local cluster of 2 worker processes x 2
logical CPUs (TensorFlow gRPC servers on loopback ports) and a training
client process. The client builds one replicated graph over the 4 remote
devices with ``replicator.MultiWorkerReplicator``: each worker reads its own
shard of every global batch on its own CPU; gradients are reduced within each
worker, then across workers. It checkpoints every ``--checkpoint-every``
steps with ``tf.train.CheckpointManager``.

With ``--kill-at S`` the supervisor kills worker 1 (SIGKILL, like a crash)
once the client reports step S. The client reports
``WorkerUnavailableError`` naming the worker and exits; the supervisor
re-forms the cluster (restarts the workers) and the client, which restores
the last checkpoint and finishes. The data order depends only on the step
number, so the final parameters equal an uninterrupted run's, which the
supervisor also trains and compares.

Why restart more than the dead worker: on TensorFlow 2.21 a surviving
worker's collective state remembers the dead worker's device incarnation and
aborts every later collective with its replacement ("exists in cache with a
different incarnation ... Restart your program to reset"), and a client
cannot re-form its remote context in-process. So recovery is a restart of
the workers and the client from the last checkpoint, as a cluster scheduler
would do it.

Data: scikit-learn's bundled digits. Run:

  python -m examples.multiworker --steps 60 --checkpoint-every 10 --kill-at 25
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

EXIT_WORKER_LOST = 3


# -- the training client (a separate process) ------------------------------------


def client(args) -> None:
  import replicator
  from examples.mnist import load_digits
  replicator.virtual_cpus(1)
  import keras
  import tensorflow as tf

  (x_train, y_train), _ = load_digits(seed=0)
  x_train = x_train.reshape(len(x_train), -1)
  try:
    repl = replicator.MultiWorkerReplicator(cluster=json.loads(args.cluster))
  except replicator.WorkerUnavailableError as e:
    print(f"client: cannot start: {e}", flush=True)
    os._exit(EXIT_WORKER_LOST)
  with repl.context():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    optimizer = repl.wrap_optimizer(keras.optimizers.Adam(1e-3))
    step = tf.Variable(0, dtype=tf.int64, name="step")
  checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, step=step)
  manager = tf.train.CheckpointManager(checkpoint, args.checkpoint_dir, max_to_keep=2)
  if manager.latest_checkpoint:
    checkpoint.restore(manager.latest_checkpoint)
    print(f"client: restored {os.path.basename(manager.latest_checkpoint)} at step {int(step.numpy())}", flush=True)
  start = int(step.numpy())

  def input_fn(ctx: replicator.InputContext):  # runs on the worker that hosts this replica
    b = ctx.get_per_replica_batch_size(args.batch_size)
    ds = tf.data.Dataset.from_tensor_slices((x_train, y_train)).repeat()
    ds = ds.shuffle(len(x_train), seed=0, reshuffle_each_iteration=True).batch(args.batch_size)
    ds = ds.skip(start)  # global batch i is the same whatever the restarts
    return ds.map(lambda x, y: (x[ctx.replica_id * b:(ctx.replica_id + 1) * b],
                                y[ctx.replica_id * b:(ctx.replica_id + 1) * b]))

  def train_step(batch):
    images, labels = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=model(images)))
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    step.assign_add(1)
    return loss

  if start == 0:
    print(repl.explain(train_step, input_fn), flush=True)
  try:
    while int(step.numpy()) < args.steps:
      loss = repl.run(train_step, input_fn)
      now = int(step.numpy())
      print(f"client: step {now} loss {float(repl.reduce('mean', loss)):.4f}", flush=True)
      if now % args.checkpoint_every == 0:
        manager.save(checkpoint_number=now)
        print(f"client: checkpoint at step {now}", flush=True)
  except replicator.WorkerUnavailableError as e:
    print(f"client: worker {e.task} lost: {e}", flush=True)
    os._exit(EXIT_WORKER_LOST)  # skip TensorFlow's teardown of the broken remote context
  np.savez(args.out, *[v.numpy() for v in model.trainable_variables])
  print(f"client: done at step {int(step.numpy())}", flush=True)
  os._exit(0)


# -- the supervisor ---------------------------------------------------------------------


def _train(cluster, args, checkpoint_dir: str, out: str, kill_at: int | None) -> dict:
  """Runs clients until one finishes; kills worker 1 once if asked. Returns what happened."""
  events = dict(restarts=0, killed_at=None, lost_reports=[], restored=[])
  while True:
    command = [sys.executable, "-m", "examples.multiworker", "--client", "--cluster", json.dumps(cluster.spec),
               "--steps", str(args.steps), "--checkpoint-every", str(args.checkpoint_every),
               "--batch-size", str(args.batch_size), "--checkpoint-dir", checkpoint_dir, "--out", out]
    with tempfile.TemporaryFile("w+") as log, subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=log, text=True) as process:
      for line in process.stdout:
        print(line, end="", flush=True)
        if line.startswith("client: step ") and kill_at is not None and events["killed_at"] is None:
          if int(line.split()[2]) >= kill_at:
            cluster.kill(1)
            events["killed_at"] = int(line.split()[2])
            print(f"supervisor: killed worker 1 after step {events['killed_at']}", flush=True)
        if " lost: " in line:
          events["lost_reports"].append(line.strip())
        if line.startswith("client: restored"):
          events["restored"].append(int(line.split()[-1]))
      code = process.wait()
      if code == 0:
        return events
      if code != EXIT_WORKER_LOST or events["restarts"] >= 3:
        log.seek(0)
        raise RuntimeError(f"the training client failed with exit code {code}:\n{log.read()[-3000:]}")
    events["restarts"] += 1
    # Re-form the whole cluster: the surviving workers' collective state
    # remembers the dead worker's incarnation and refuses its replacement.
    dead = [t for t in range(cluster.num_workers) if not cluster.alive(t)]
    print(f"supervisor: worker(s) {dead} dead; re-forming the cluster (restarting all workers)", flush=True)
    for task in range(cluster.num_workers):
      cluster.restart(task)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--checkpoint-every", type=int, default=10)
  parser.add_argument("--kill-at", type=int, default=25, help="kill worker 1 after this step (0: never)")
  parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
  parser.add_argument("--devices-per-worker", type=int, default=2)
  parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--cluster", help=argparse.SUPPRESS)
  parser.add_argument("--checkpoint-dir", help=argparse.SUPPRESS)
  parser.add_argument("--out", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.client:
    client(args)
    return {}

  from replicator import testing
  work = tempfile.mkdtemp(prefix="multiworker_")
  with testing.local_cluster(2, devices_per_worker=args.devices_per_worker) as cluster:
    print(f"supervisor: cluster {cluster.spec}", flush=True)
    start = time.monotonic()
    events = _train(cluster, args, os.path.join(work, "ckpt"), os.path.join(work, "final.npz"),
                    args.kill_at or None)
    seconds = time.monotonic() - start
    print("supervisor: uninterrupted reference run", flush=True)
    _train(cluster, args, os.path.join(work, "ckpt_reference"), os.path.join(work, "reference.npz"), None)
  final = np.load(os.path.join(work, "final.npz"))
  reference = np.load(os.path.join(work, "reference.npz"))
  diff = max(float(np.abs(final[k] - reference[k]).max()) for k in final.files)
  print(f"supervisor: {events['restarts']} restart(s); resumed from step(s) {events['restored']}; "
        f"max abs difference from the uninterrupted run: {diff:.3g} ({seconds:.1f} s with the failure)")
  return dict(events, max_abs_diff=diff, seconds=seconds)


if __name__ == "__main__":
  main()
