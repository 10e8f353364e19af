"""Every worker runs this script: an embedding table split by rows across worker processes (what a parameter server
does for a table larger than a worker), trained synchronously.

Start it with one process per worker (on one machine, for a first try):

  python -m replicator.launch --workers 2 --devices-per-worker 1 -m examples.sharded_embedding

The model is a recommender's shape: ``Embedding(rows, 32)`` over each example's
item ids (mean-pooled) and a ``Dense`` head, trained with Adam on clicks. The
layout ``{"items/embeddings": ("worker", None)}`` splits the table's rows over
the workers: worker ``i`` holds rows ``i * rows / W`` to ``(i + 1) * rows / W``
and their Adam slots, never the whole table. In the global view each step
gathers the batch's item ids (4 bytes an id), each worker looks up the ids
that fall in its rows, and the rows looked up are reduce-scattered back onto
the batch; the table's gradient is sparse (the looked-up rows), and each
worker applies the rows it holds. Every worker also trains a one-device copy
on the whole global batches and prints how far the split table is from it.

Data: synthetic clicks (item ids drawn from a Zipf law, as item popularity
is; a click when the items' hidden scores are high). Nothing to download.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import replicator  # noqa: E402  (does not start TensorFlow)


def main(argv=None) -> float:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=100_000, help="rows of the embedding table")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--global-batch", type=int, default=256)
  args = parser.parse_args(argv)

  layouts = {"items/embeddings": ("worker", None)}  # the table's rows over the workers
  repl = replicator.MultiWorkerReplicator.from_tf_config(view="global", layouts=layouts)
  import keras
  import numpy as np
  import tensorflow as tf

  rng = np.random.default_rng(0)  # every worker draws the same data: global batches
  ids = (rng.zipf(1.2, size=(args.steps * args.global_batch, 8)) % args.rows).astype(np.int32)
  hidden = rng.normal(size=args.rows).astype(np.float32)
  clicks = (hidden[ids].mean(axis=1) > 0).astype(np.int32)
  dataset = tf.data.Dataset.from_tensor_slices((ids, clicks)).batch(args.global_batch, drop_remainder=True)

  def make_model():
    keras.utils.set_random_seed(0)
    items = keras.Input((8,), dtype="int32")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(args.rows, 32, name="items")(items))
    return keras.Model(items, keras.layers.Dense(2)(keras.layers.Dense(32, activation="relu")(h)))

  with repl.context():
    model, optimizer = make_model(), keras.optimizers.Adam(1e-2)

  def step_fn(batch):  # the one-device step, on the whole global batch
    x, y = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True))
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss

  reference, reference_optimizer = make_model(), keras.optimizers.Adam(1e-2)  # one device, the same weights
  for mine, theirs in zip(reference.trainable_variables, model.trainable_variables):
    mine.assign(theirs.numpy())

  @tf.function
  def reference_step(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, reference(x), from_logits=True))
    reference_optimizer.apply_gradients(zip(tape.gradient(loss, reference.trainable_variables),
                                            reference.trainable_variables))

  table = model.get_layer("items").embeddings
  if repl.task == 0:
    report = repl.explain(step_fn, dataset)
    gathered_table = [c for c in report.collective_rows if c.kind == "all_gather" and "items" in c.why
                      and "ReadVariableOp" in c.why]
    held = max(replicator.bytes_per_device([table]).values())
    print(f"table {args.rows} x 32: {held:,} bytes a device of "
          f"{args.rows * 32 * 4:,}; collectives a step {report.bytes_per_step:,} bytes; the table gathered: "
          f"{'yes' if gathered_table else 'never'}", flush=True)
  batches = iter(dataset)
  for step in range(1, args.steps + 1):
    loss = repl.run(step_fn, dataset)
    reference_step(next(batches))
    if step % 10 == 0 and repl.task == 0:
      print(f"step {step}: loss {float(loss):.4f}", flush=True)
  difference = max(float(np.abs(ours.numpy() - theirs.numpy()).max())
                   for ours, theirs in zip(model.trainable_variables, reference.trainable_variables))
  print(f"worker {repl.task} of {repl.num_workers}: largest difference from one device {difference:.2e}", flush=True)
  return difference


if __name__ == "__main__":
  main()
