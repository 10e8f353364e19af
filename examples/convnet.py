"""A small convolutional network with cross-replica batch norm, trained data-parallel.

Shows the training-loop features together: a dataset of global batches split
across replicas (``repl.distribute_dataset``), several steps per call
(``steps=``), ``CrossReplicaBatchNorm``, Keras metrics updated inside the step
and reported globally, and checkpoints (``tf.train.CheckpointManager``) saved
every epoch and restored to resume, and a TensorBoard log (global-batch
loss and accuracy and the learning rate every step, test accuracy every
epoch, written by ``tf.summary`` inside the step: once per step, not once per
replica). Data: scikit-learn's bundled digits (8x8 images), so nothing is
downloaded. Run:

  python -m examples.convnet --devices 4 --epochs 8 --logdir runs/convnet
  tensorboard --logdir runs/convnet
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


import replicator  # noqa: E402
from examples.mnist import load_digits  # noqa: E402


def build_model(keras, seed: int):
  keras.utils.set_random_seed(seed)
  return keras.Sequential([
      keras.Input((8, 8, 1)),
      keras.layers.Conv2D(16, 3, padding="same", use_bias=False),
      replicator.CrossReplicaBatchNorm(momentum=0.9),
      keras.layers.ReLU(),
      keras.layers.Conv2D(32, 3, strides=2, padding="same", use_bias=False),
      replicator.CrossReplicaBatchNorm(momentum=0.9),
      keras.layers.ReLU(),
      keras.layers.GlobalAveragePooling2D(),
      keras.layers.Dropout(0.1),
      keras.layers.Dense(10),
  ])


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=4)
  parser.add_argument("--epochs", type=int, default=8)
  parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
  parser.add_argument("--steps-per-call", type=int, default=4)
  parser.add_argument("--learning-rate", type=float, default=3e-3)
  parser.add_argument("--checkpoint-dir", default=None, help="default: a temporary directory")
  parser.add_argument("--logdir", default=None, help="TensorBoard log directory (default: a temporary directory)")
  parser.add_argument("--resume-at", type=int, default=None,
                      help="after this epoch, rebuild everything and restore the last checkpoint (a demo)")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)

  replicator.virtual_cpus(args.devices)
  import keras
  import tensorflow as tf

  (x_train, y_train), (x_test, y_test) = load_digits(seed=args.seed)
  x_train, x_test = x_train[..., None], x_test[..., None]
  checkpoint_dir = args.checkpoint_dir or tempfile.mkdtemp(prefix="convnet_")
  logdir = args.logdir or tempfile.mkdtemp(prefix="convnet_logs_")
  writer = tf.summary.create_file_writer(logdir)
  repl = replicator.Replicator()
  steps_per_epoch = -(-len(x_train) // args.batch_size)  # the last batch is partial
  print(f"{repl.num_replicas} replicas; {len(x_train)} train / {len(x_test)} test digits; global batch "
        f"{args.batch_size}, {steps_per_epoch} steps per epoch ({args.steps_per_call} per call); "
        f"checkpoints in {checkpoint_dir}; TensorBoard log in {logdir}")

  def build():
    with repl.context():
      model = build_model(keras, args.seed)
      optimizer = repl.wrap_optimizer(keras.optimizers.Adam(args.learning_rate), reduction="sum")
      loss_metric = keras.metrics.Mean()
      accuracy = keras.metrics.SparseCategoricalAccuracy()
    epoch = tf.Variable(0, trainable=False)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, epoch=epoch)
    manager = tf.train.CheckpointManager(checkpoint, checkpoint_dir, max_to_keep=2)
    return model, optimizer, loss_metric, accuracy, epoch, checkpoint, manager

  model, optimizer, loss_metric, accuracy, epoch, checkpoint, manager = build()
  train = tf.data.Dataset.from_tensor_slices((x_train, y_train))
  train = train.shuffle(len(x_train), seed=args.seed, reshuffle_each_iteration=True).batch(args.batch_size)
  distributed = repl.distribute_dataset(train)

  def make_step(model, optimizer, loss_metric, accuracy):
    def train_step(batch):
      images, labels = batch
      global_batch = tf.cast(repl.all_sum(tf.shape(images)[0]), tf.float32)
      with tf.GradientTape() as tape:
        logits = model(images, training=True)
        per_example = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        loss = tf.reduce_sum(per_example) / global_batch
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      loss_metric.update_state(per_example)
      accuracy.update_state(labels, logits)
      # Recorded once per step (replica 0 writes), of values reduced over the global batch.
      step = optimizer.iterations
      correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int64), tf.cast(labels, tf.int64)), tf.float32)
      tf.summary.scalar("train/loss", repl.all_sum(loss), step=step)
      tf.summary.scalar("train/accuracy", repl.all_sum(tf.reduce_sum(correct)) / global_batch, step=step)
      tf.summary.scalar("train/learning_rate", optimizer.learning_rate, step=step)
    return train_step

  test_shards = replicator.PerReplica([(x_test[r::repl.num_replicas], y_test[r::repl.num_replicas])
                                       for r in range(repl.num_replicas)])

  def make_eval(model):
    def eval_step(batch):
      images, labels = batch
      predictions = tf.argmax(model(images, training=False), -1, output_type=tf.int32)
      return tf.reduce_sum(tf.cast(tf.equal(predictions, labels), tf.int32))
    return eval_step

  train_step, eval_step = make_step(model, optimizer, loss_metric, accuracy), make_eval(model)
  history = []
  with writer.as_default():
    while int(epoch.numpy()) < args.epochs:
      print(f"epoch {int(epoch.numpy()) + 1}/{args.epochs}")
      bar = keras.utils.Progbar(steps_per_epoch, stateful_metrics=["loss", "accuracy"],
                                verbose=1 if sys.stdout.isatty() else 2)
      loss_metric.reset_state()
      accuracy.reset_state()
      done = 0
      while True:
        try:
          repl.run(train_step, distributed, steps=args.steps_per_call)
        except replicator.EndOfInput:
          break
        done += repl.steps_run
        bar.update(done, values=[("loss", float(loss_metric.result())), ("accuracy", float(accuracy.result()))])
      epoch.assign_add(1)
      path = manager.save()
      test_accuracy = int(repl.reduce("sum", repl.run(eval_step, inputs=test_shards))) / len(x_test)
      tf.summary.scalar("test/accuracy", test_accuracy, step=optimizer.iterations)
      history.append(dict(epoch=int(epoch.numpy()), loss=float(loss_metric.result()),
                          train_accuracy=float(accuracy.result()), test_accuracy=test_accuracy))
      print(f"epoch {int(epoch.numpy()):>2}: loss {loss_metric.result():.4f}  train accuracy "
            f"{float(accuracy.result()):.2%}  test accuracy {test_accuracy:.2%}  saved {os.path.basename(path)}")
      if args.resume_at is not None and int(epoch.numpy()) == args.resume_at:
        # Start over from the checkpoint, as a preempted job would.
        model, optimizer, loss_metric, accuracy, epoch, checkpoint, manager = build()
        checkpoint.restore(manager.latest_checkpoint)
        print(f"restored {os.path.basename(manager.latest_checkpoint)}: resuming after epoch {int(epoch.numpy())}")
        train_step, eval_step = make_step(model, optimizer, loss_metric, accuracy), make_eval(model)
  writer.flush()
  print(f"final test accuracy: {history[-1]['test_accuracy']:.2%}")
  return dict(history=history, test_accuracy=history[-1]["test_accuracy"], replicas=repl.num_replicas,
              logdir=logdir, steps_per_epoch=steps_per_epoch)


if __name__ == "__main__":
  main()
