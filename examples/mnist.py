"""Mesh TensorFlow's MNIST model, trained data-parallel with repl.run.

The model of the Mesh TensorFlow README: images [batch, rows, cols] -> one
hidden layer of 1024 ReLU units -> 10 classes, written for one device. The
replicator runs it on several devices (4 logical CPUs by default), each replica
on its slice of every global batch, gradients averaged by ``wrap_optimizer``.

Data: scikit-learn's bundled handwritten digits (1,797 real 8x8 images), so
nothing is downloaded. Run:

  python -m examples.mnist --devices 4 --epochs 10
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import replicator  # noqa: E402
from examples._progress import Progress  # noqa: E402


def load_digits(test_fraction: float = 0.2, seed: int = 0):
  """Digits as float32 images in [0, 1] and int32 labels, split into train and test."""
  try:
    from sklearn import datasets
  except ImportError:
    sys.exit("examples.mnist needs scikit-learn for its bundled digits: pip install -e .[examples]")
  digits = datasets.load_digits()
  images = (digits.images / 16.0).astype(np.float32)
  labels = digits.target.astype(np.int32)
  order = np.random.RandomState(seed).permutation(len(images))
  n_test = int(len(images) * test_fraction)
  test, train = order[:n_test], order[n_test:]
  return (images[train], labels[train]), (images[test], labels[test])


def build_model(tf, rows: int, cols: int, hidden: int = 1024, classes: int = 10, seed: int = 0):
  """The Mesh TensorFlow README's MNIST network as a tf.Module."""

  class MnistModel(tf.Module):

    def __init__(self):
      super().__init__(name="mnist")
      init = tf.keras.initializers.GlorotUniform(seed=seed)
      self.w1 = tf.Variable(init([rows, cols, hidden]), name="w1")  # [rows, cols, hidden]
      self.b1 = tf.Variable(tf.zeros([hidden]), name="b1")
      self.w2 = tf.Variable(tf.keras.initializers.GlorotUniform(seed=seed + 1)([hidden, classes]), name="w2")
      self.b2 = tf.Variable(tf.zeros([classes]), name="b2")

    def __call__(self, images):
      hidden_act = tf.nn.relu(tf.einsum("brc,rch->bh", images, self.w1) + self.b1)
      return tf.einsum("bh,hk->bk", hidden_act, self.w2) + self.b2

  return MnistModel()


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=4, help="logical CPU devices (replicas)")
  parser.add_argument("--epochs", type=int, default=10)
  parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
  parser.add_argument("--learning-rate", type=float, default=1e-3)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)

  replicator.virtual_cpus(args.devices)
  import keras
  import tensorflow as tf

  (x_train, y_train), (x_test, y_test) = load_digits(seed=args.seed)
  repl = replicator.Replicator()
  n = repl.num_replicas
  per_replica = args.batch_size // n
  if per_replica * n != args.batch_size:
    sys.exit(f"--batch-size {args.batch_size} must be a multiple of the {n} replicas.")
  steps_per_epoch = len(x_train) // args.batch_size
  print(f"{n} replicas on {', '.join(repl.devices)}; {len(x_train)} train / {len(x_test)} test digits; "
        f"global batch {args.batch_size} ({per_replica} per replica), {steps_per_epoch} steps per epoch")

  with repl.context():
    model = build_model(tf, rows=x_train.shape[1], cols=x_train.shape[2], seed=args.seed)
    optimizer = repl.wrap_optimizer(keras.optimizers.Adam(args.learning_rate))

  def train_input_fn(ctx: replicator.InputContext):
    # Every replica shuffles the same global batches and keeps its own rows.
    b = ctx.get_per_replica_batch_size(args.batch_size)
    ds = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    ds = ds.shuffle(len(x_train), seed=args.seed, reshuffle_each_iteration=True).repeat()
    ds = ds.batch(args.batch_size, drop_remainder=True)
    return ds.map(lambda x, y: (x[ctx.replica_id * b:(ctx.replica_id + 1) * b],
                                y[ctx.replica_id * b:(ctx.replica_id + 1) * b])).prefetch(2)

  def train_step(batch):
    images, labels = batch
    with tf.GradientTape() as tape:
      logits = model(images)
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels), tf.int32))
    return loss, correct

  test_shards = replicator.PerReplica([(x_test[r::n], y_test[r::n]) for r in range(n)])

  def eval_step(batch):
    images, labels = batch
    predictions = tf.argmax(model(images), -1, output_type=tf.int32)
    return tf.reduce_sum(tf.cast(tf.equal(predictions, labels), tf.int32))

  history = []
  for epoch in range(1, args.epochs + 1):
    bar = Progress(steps_per_epoch, prefix=f"epoch {epoch:>2}/{args.epochs}")
    losses, correct = [], 0
    for step in range(1, steps_per_epoch + 1):
      loss, right = repl.run(train_step, train_input_fn)
      losses.append(float(repl.reduce("mean", loss)))
      correct += int(repl.reduce("sum", right))
      bar.update(step, loss=float(np.mean(losses)))
    test_accuracy = int(repl.reduce("sum", repl.run(eval_step, inputs=test_shards))) / len(x_test)
    train_accuracy = correct / (steps_per_epoch * args.batch_size)
    history.append(dict(epoch=epoch, loss=float(np.mean(losses)), train_accuracy=train_accuracy,
                        test_accuracy=test_accuracy))
    print(f"epoch {epoch:>2}: loss {np.mean(losses):.4f}  train accuracy {train_accuracy:.2%}  "
          f"test accuracy {test_accuracy:.2%}")
  print(f"final test accuracy: {history[-1]['test_accuracy']:.2%}")
  return dict(history=history, test_accuracy=history[-1]["test_accuracy"], replicas=n)


if __name__ == "__main__":
  main()
