"""Every worker runs this script: data-parallel training in a multi-client job.

Start it with one process per worker (on one machine, for a first try):

  python -m replicator.launch --workers 2 --devices-per-worker 2 -m examples.multi_client --steps 40
  python -m replicator.launch --workers 2 --devices-per-worker 2 -m examples.multi_client --view global

Each process makes ``replicator.MultiWorkerReplicator.from_tf_config()`` first
(``TF_CONFIG``, which the launcher or a cluster manager sets, names its task),
so the mesh spans every worker's devices (``{"worker": 2, "device": 2}``).
Each process traces and builds the step for its own devices only, reads its
own part of every global batch, and meets the others in the gradients'
all-reduce, over TensorFlow's collective runtime. Every process also trains a
one-device copy of the model on the whole global batches, from the same
initial weights, and prints how far the replicas' weights are from it.

``--view global``: the step is the one-device step on the whole global batch
with a plain Keras optimizer; each process partitions it and builds its own
devices' part (the gradients' reduction is the partitioner's, fused into one
all-reduce across processes).

Data: scikit-learn's bundled digits (1,797 8x8 images, 10 classes).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import replicator  # noqa: E402  (does not start TensorFlow)


def main(argv=None) -> float:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--global-batch", type=int, default=64)
  parser.add_argument("--view", choices=("local", "global"), default="local")
  args = parser.parse_args(argv)

  repl = replicator.MultiWorkerReplicator.from_tf_config(view=args.view)  # first: it starts this process's runtime
  import keras
  import numpy as np
  import tensorflow as tf
  from sklearn.datasets import load_digits

  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(args.global_batch)  # global batches

  def make_model():
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])

  with repl.context():
    model = make_model()  # each process draws its own weights; every replica starts from worker 0's
    optimizer = keras.optimizers.Adam(1e-2)
    if args.view == "local":  # each replica's gradients, reduced across replicas by the wrapper
      optimizer = repl.wrap_optimizer(optimizer)

  def loss_of(net, x, y):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, net(x), from_logits=True))

  def step_fn(batch):  # local view: one replica's part of the global batch; global view: all of it
    with tf.GradientTape() as tape:
      loss = loss_of(model, *batch)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss

  reference = make_model()  # one device, the whole global batch, the same initial weights
  for mine, theirs in zip(reference.trainable_variables, model.trainable_variables):
    mine.assign(theirs.numpy())
  reference_optimizer = keras.optimizers.Adam(1e-2)

  @tf.function
  def reference_step(batch):
    with tf.GradientTape() as tape:
      loss = loss_of(reference, *batch)
    reference_optimizer.apply_gradients(zip(tape.gradient(loss, reference.trainable_variables),
                                            reference.trainable_variables))

  batches = iter(dataset)
  for step in range(1, args.steps + 1):
    loss = repl.run(step_fn, dataset)
    if args.view == "local":
      loss = repl.reduce("mean", loss)  # every process gets the global mean (the global view's loss is it)
    reference_step(next(batches))
    if step % 10 == 0 and repl.task == 0:
      print(f"step {step}: loss {float(loss):.4f}", flush=True)
  difference = max(float(np.abs(ours.numpy() - theirs.numpy()).max())
                   for ours, theirs in zip(model.trainable_variables, reference.trainable_variables))
  print(f"worker {repl.task} of {repl.num_workers}, replicas {list(repl.local_replicas)} of {repl.num_replicas}: "
        f"largest difference from one device {difference:.2e}", flush=True)
  return difference


if __name__ == "__main__":
  main()
