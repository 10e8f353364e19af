"""Mesh TensorFlow's MNIST model, trained data-parallel with repl.run (with --mesh: split over a mesh, global view).

The model of the Mesh TensorFlow README: images [batch, rows, cols] -> one
hidden layer of 1024 ReLU units -> 10 classes, written for one device. The
replicator runs it on several devices (4 logical CPUs by default), each replica
on its slice of every global batch, gradients averaged by ``wrap_optimizer``.

With ``--mesh`` and ``--layout`` it is the Mesh TensorFlow README's 2x2
example instead: the devices form a named mesh, Mesh-TensorFlow-style layout
rules split the batch over one axis and the hidden layer over another, and
each device keeps only its slice of ``w1``, ``b1`` and ``w2``. The model and
the step are the same code as in the data-parallel run: they run in the
global view (``Replicator(..., view="global")``), where the step sees global
batches and global weights and the layouts alone decide the partitioning
(the second layer's partial products over "hidden" are summed by the
replicator, not by the step).

Data: scikit-learn's bundled handwritten digits (1,797 real 8x8 images), so
nothing is downloaded. Run:

  python -m examples.mnist --devices 4 --epochs 10
  python -m examples.mnist --mesh batch:2,model:2 --layout batch:batch,hidden:model
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import mesh  # noqa: E402
import replicator  # noqa: E402

# The tensor dimensions of the model's variables, named as in Mesh TensorFlow.
DIMENSIONS = {"w1": ("rows", "cols", "hidden"), "b1": ("hidden",), "w2": ("hidden", "classes")}


def parse_pairs(text: str, what: str, value=str) -> list[tuple[str, object]]:
  """'a:1,b:2' -> [('a', '1'), ('b', '2')] (values converted by ``value``)."""
  pairs = []
  for item in filter(None, text.split(",")):
    name, sep, v = item.partition(":")
    if not sep or not name or not v:
      sys.exit(f"--{what} expects name:value pairs separated by commas (e.g. batch:2,model:2), found {item!r}.")
    pairs.append((name, value(v)))
  return pairs


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
  parser.add_argument("--devices", type=int, default=4, help="logical CPU devices (replicas without --mesh)")
  parser.add_argument("--epochs", type=int, default=10)
  parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
  parser.add_argument("--learning-rate", type=float, default=1e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--mesh", default="", help="named mesh axes, e.g. batch:2,model:2 (overrides --devices)")
  parser.add_argument("--layout", default="",
                      help="layout rules tensor-dimension:mesh-axis, e.g. batch:batch,hidden:model")
  args = parser.parse_args(argv)

  axes = dict(parse_pairs(args.mesh, "mesh", int))
  replicator.virtual_cpus(max(args.devices, int(np.prod(list(axes.values())))) if axes else args.devices)
  import keras
  import tensorflow as tf

  keras.utils.set_random_seed(args.seed)  # the shuffle's order depends on TensorFlow's global seed too
  (x_train, y_train), (x_test, y_test) = load_digits(seed=args.seed)
  global_view = bool(axes)
  if global_view:
    rules = mesh.LayoutRules(parse_pairs(args.layout, "layout"))
    repl = replicator.Replicator(mesh=mesh.Mesh(axes), layouts=rules.layout_map(DIMENSIONS),
                                 batch_axes=rules.mesh_axes("batch"), view="global")
  else:
    repl = replicator.Replicator()  # data-parallel, in the local view: each replica sees its rows
  n = repl.num_replicas
  shards = repl.num_input_pipelines  # data-parallel replicas: devices along the batch axes
  per_replica = args.batch_size // shards
  if per_replica * shards != args.batch_size:
    sys.exit(f"--batch-size {args.batch_size} must be a multiple of the {shards} batch shards.")
  steps_per_epoch = len(x_train) // args.batch_size
  print(f"{n} devices ({repl.mesh.shape}) on {', '.join(repl.devices)}; {len(x_train)} train / "
        f"{len(x_test)} test digits; global batch {args.batch_size} ({per_replica} per batch shard), "
        f"{steps_per_epoch} steps per epoch")

  # The same model and step in both views. In the local view the optimizer is
  # wrapped to average the replicas' gradients; in the global view a plain
  # optimizer is enough (the step sees the global batch).
  with repl.context():
    model = build_model(tf, rows=x_train.shape[1], cols=x_train.shape[2], seed=args.seed)
    optimizer = keras.optimizers.Adam(args.learning_rate)
    if not global_view:
      optimizer = repl.wrap_optimizer(optimizer)
  if global_view:
    for v in (model.w1, model.b1, model.w2):
      print(f"  {v.name.split(':')[0]}: global {v.shape.as_list()}, layout {v.layout.spec}, "
            f"{v.components[0].shape.as_list()} per device")

  def train_step(batch):
    images, labels = batch
    with tf.GradientTape() as tape:
      logits = model(images)
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels), tf.int32))
    return loss, correct

  def eval_step(batch):
    images, labels = batch
    predictions = tf.argmax(model(images), -1, output_type=tf.int32)
    return tf.reduce_sum(tf.cast(tf.equal(predictions, labels), tf.int32))

  def global_batches():
    # The same shuffled global batches in both views (and on any mesh).
    ds = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    ds = ds.shuffle(len(x_train), seed=args.seed, reshuffle_each_iteration=True).repeat()
    return ds.batch(args.batch_size, drop_remainder=True)

  if global_view:
    # A dataset of global batches; the step's results are global values.
    train_data = global_batches()
    # The whole test set as one global batch, padded with label -1 (never predicted) to divide evenly.
    pad = -len(x_test) % shards
    test_data = tf.data.Dataset.from_tensors((np.concatenate([x_test, np.zeros((pad, *x_test.shape[1:]), np.float32)]),
                                              np.concatenate([y_test, np.full([pad], -1, np.int32)]))).repeat()

    def train():
      loss, right = repl.run(train_step, train_data)
      return float(loss), int(right)

    def test():
      return int(repl.run(eval_step, test_data))
  else:
    def train_input_fn(ctx: replicator.InputContext):
      # Every replica shuffles the same global batches and keeps its own rows.
      b = ctx.get_per_replica_batch_size(args.batch_size)
      return global_batches().map(lambda x, y: (x[ctx.replica_id * b:(ctx.replica_id + 1) * b],
                                                y[ctx.replica_id * b:(ctx.replica_id + 1) * b])).prefetch(2)

    test_shards = replicator.PerReplica([(x_test[r::n], y_test[r::n]) for r in range(n)])

    def train():  # per-replica results: combine them
      loss, right = repl.run(train_step, train_input_fn)
      return float(repl.reduce("mean", loss)), int(repl.reduce("sum", right))

    def test():
      return int(repl.reduce("sum", repl.run(eval_step, inputs=test_shards)))

  history = []
  for epoch in range(1, args.epochs + 1):
    print(f"epoch {epoch}/{args.epochs}")
    bar = keras.utils.Progbar(steps_per_epoch, stateful_metrics=["loss"], verbose=1 if sys.stdout.isatty() else 2)
    losses, correct = [], 0
    for step in range(1, steps_per_epoch + 1):
      loss, right = train()
      losses.append(loss)
      correct += right
      bar.update(step, values=[("loss", float(np.mean(losses)))])
    test_accuracy = test() / len(x_test)
    train_accuracy = correct / (steps_per_epoch * args.batch_size)
    history.append(dict(epoch=epoch, loss=float(np.mean(losses)), train_accuracy=train_accuracy,
                        test_accuracy=test_accuracy))
    print(f"epoch {epoch:>2}: loss {np.mean(losses):.4f}  train accuracy {train_accuracy:.2%}  "
          f"test accuracy {test_accuracy:.2%}")
  print(f"final test accuracy: {history[-1]['test_accuracy']:.2%}")
  return dict(history=history, test_accuracy=history[-1]["test_accuracy"], replicas=n,
              bytes_per_device=replicator.bytes_per_device([model.w1, model.b1, model.w2, model.b2]))


if __name__ == "__main__":
  main()
