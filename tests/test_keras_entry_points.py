"""Every public Keras training entry point, every way in, against one device: equal, or refused naming the fix.

The grid: ``fit``, ``evaluate``, ``predict``, ``train_on_batch``,
``test_on_batch``, ``predict_on_batch``, a custom ``train_step`` under
``fit`` and a plain ``tf.function`` loop; made in a local-view Replicator's
context, a global-view Replicator's, or under a Keras distribution after
``replicator.enable_keras_distribution()``; data-parallel (4 devices) or
model-parallel (2x2, the hidden layer split Megatron-style); batches of a
known size (a dataset batched with ``drop_remainder``, 16 rows a call) or
not (arrays whose rows the batch size does not divide, 10 rows a call). Each
cell runs the entry point on a small model with Dropout (random draws must be
one device's too) and compares what it returns and every device's copy of
every variable (weights, metrics' state, the seed generator's, Adam's slots
and iterations) with the same calls on one device from the same initial
weights. CI runs ``REPRESENTATIVE``; ``--full-grid`` every cell.

Tolerance: the 96 cells measured 2.4e-7 at most (``python tests/test_keras_entry_points.py``
prints the grid), two float32 ulps of values near 2 (the losses): the partitioned step sums the batch
in another order than one device. 2e-6 leaves room for other kernels' orders, while each wrong result
this grid was made for was off by more than 1e-2 (a loss divided by 4 or 8, one replica's metric, a
Dropout mask drawn per replica).
"""

import itertools
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import copies_distance
from conftest import cpus

import mesh
import replicator

ENTRIES = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch", "custom_train_step",
           "tf_function")
WAYS = ("local", "global", "keras")
PARALLELISM = ("data", "model")
BATCHES = ("known", "unknown")
TRAINING = ("fit", "train_on_batch", "custom_train_step")
ATOL = 2e-6
# The cells CI runs: each entry point once in each way in, both parallelisms and both batchings among them.
REPRESENTATIVE = {
    ("fit", "local", "data", "unknown"), ("fit", "keras", "model", "known"), ("evaluate", "keras", "data", "unknown"),
    ("predict", "local", "model", "unknown"), ("train_on_batch", "keras", "data", "known"),
    ("test_on_batch", "keras", "data", "known"), ("test_on_batch", "global", "model", "known"),
    ("predict_on_batch", "keras", "model", "unknown"), ("custom_train_step", "local", "data", "unknown"),
    ("tf_function", "keras", "data", "known"), ("tf_function", "keras", "model", "known"),
    ("fit", "global", "data", "unknown"), ("train_on_batch", "local", "data", "unknown"),
    ("custom_train_step", "keras", "model", "unknown"), ("tf_function", "local", "data", "unknown"),
}

X = np.random.RandomState(0).normal(size=(42, 12)).astype(np.float32)
Y = np.random.RandomState(1).randint(0, 4, size=(42,)).astype(np.int32)
LAYOUTS = {r".*d1/kernel": (None, "model"), r".*d1/bias": ("model",), r".*d2/kernel": ("model", None)}

INDIVISIBLE = "is not divided by the batch axes"  # the global program takes such a batch whole (warned, equal)
ONE_DEVICE = "outside any Replicator step updated"  # a plain tf.function trains as one device (warned, equal)
# A short last batch, of unknown size in the trace, is whole on every device; next to the split hidden layer the
# gradient of Dropout reduces over runtime axes (Sum of BroadcastGradientArgs), which the partitioner gathers for
# (warned: the result is right).
FALLBACK = "The global view has no layout rule for Sum"
SHARDED = (r"The handle of the sharded variable '.*d1/kernel' .* outside any Replicator step .* Fix: run the "
           r"training step as the Replicator's, `repl.run\(step_fn, dataset\)`")


class CustomStep(keras.Sequential):
  """Keras's guide's custom ``train_step`` ("Customizing what happens in fit"), with a loss summed over the batch."""

  def train_step(self, data):
    x, y = data
    with tf.GradientTape() as tape:
      y_pred = self(x, training=True)
      # Summed, not averaged (scaled by a constant): the gradient of one device's sum over the global batch.
      loss = tf.reduce_sum(keras.losses.sparse_categorical_crossentropy(y, y_pred, from_logits=True)) / 16.0
    gradients = tape.gradient(loss, self.trainable_variables)
    self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
    for metric in self.metrics:
      if metric.name == "loss":
        metric.update_state(loss)  # no sample weight: one value per step, as on one device
      else:
        metric.update_state(y, y_pred)
    return {m.name: m.result() for m in self.metrics}


def _model(entry):
  keras.utils.set_random_seed(1)
  layers = [keras.Input((12,)), keras.layers.Dense(16, activation="relu", name="d1"), keras.layers.Dropout(0.25),
            keras.layers.Dense(4, name="d2")]
  model = CustomStep(layers) if entry == "custom_train_step" else keras.Sequential(layers)
  model.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=[keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="xent")])
  return model


def _rows(batch):
  return 16 if batch == "known" else 10


def _data(batch):
  """fit/evaluate's data: a dataset of 2 batches of 16 (static), or 42 rows of arrays in batches of 16."""
  if batch == "known":
    return dict(x=tf.data.Dataset.from_tensor_slices((X[:32], Y[:32])).batch(16, drop_remainder=True))
  return dict(x=X, y=Y, batch_size=16)


def _tf_function_loop(model, batch):
  """The Keras distribution guide's custom loop: a plain tf.function step over the batches."""
  optimizer = keras.optimizers.Adam(1e-2)
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  @tf.function
  def train_step(x, y):
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True))
    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return loss

  rows = 32 if batch == "known" else 42
  losses = [train_step(x, y) for x, y in tf.data.Dataset.from_tensor_slices((X[:rows], Y[:rows])).batch(16)]
  return [float(loss) for loss in losses], optimizer


def _run(entry, model, batch):
  """Calls ``entry`` as a user does; returns (what it returned, as arrays; the optimizer it trained with)."""
  n = _rows(batch)
  if entry in ("fit", "custom_train_step"):
    history = model.fit(**_data(batch), epochs=2, verbose=0, **({} if batch == "known" else {"shuffle": False})).history
    return [history[key] for key in sorted(history)], model.optimizer
  if entry == "evaluate":
    return model.evaluate(**_data(batch), verbose=0), None
  if entry == "predict":
    if batch == "known":
      return model.predict(tf.data.Dataset.from_tensor_slices(X[:32]).batch(16, drop_remainder=True), verbose=0), None
    return model.predict(X, batch_size=16, verbose=0), None
  if entry == "train_on_batch":
    return [model.train_on_batch(X[i * n:(i + 1) * n], Y[i * n:(i + 1) * n]) for i in range(2)], model.optimizer
  if entry == "test_on_batch":
    return model.test_on_batch(X[:n], Y[:n]), None
  if entry == "predict_on_batch":
    return model.predict_on_batch(X[:n]), None
  return _tf_function_loop(model, batch)


_REFERENCES = {}


def _reference(entry, batch):
  """One device's run of the cell (made once per entry point and batching)."""
  key = (entry, batch)
  if key not in _REFERENCES:
    model = _model(entry)
    outputs, optimizer = _run(entry, model, batch)
    _REFERENCES[key] = model, outputs, optimizer
  return _REFERENCES[key]


def _distributed(way, parallelism):
  """Enters the way in (a context manager); returns it."""
  if way == "keras":
    replicator.enable_keras_distribution()
    if parallelism == "data":
      distribution = keras.distribution.DataParallel(devices=cpus(4))
    else:
      device_mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices=cpus(4))
      layout_map = keras.distribution.LayoutMap(device_mesh)
      for key, axes in LAYOUTS.items():
        layout_map[key] = axes
      distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    return distribution.scope()
  if parallelism == "data":
    m = mesh.Mesh({"batch": 4}, devices=cpus(4))
    layouts = None
  else:
    m = mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4))
    layouts = mesh.LayoutMap(LAYOUTS, match="fullmatch")
  return replicator.Replicator(mesh=m, layouts=layouts, view=way).context()


def distance(entry, way, parallelism, batch):
  """Runs one cell: the largest distance to one device over what it returned and every copy of every variable,
  and the warnings it gave (this project's). Raises what the cell raises."""
  ref_model, ref_outputs, ref_optimizer = _reference(entry, batch)
  keras.backend.clear_session()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with _distributed(way, parallelism):
      model = _model(entry)
      outputs, optimizer = _run(entry, model, batch)
  ours = [v for v in model.variables] + ([] if optimizer is None else list(optimizer.variables))
  theirs = [v for v in ref_model.variables] + ([] if ref_optimizer is None else list(ref_optimizer.variables))
  gap = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
            for a, b in zip(tree_leaves(outputs), tree_leaves(ref_outputs), strict=True))
  gap = max(gap, copies_distance(ours, theirs))
  ours_warned = sorted({str(w.message) for w in caught if issubclass(w.category, UserWarning)
                        and "site-packages/keras/" not in (w.filename or "").replace("\\", "/")})
  return gap, ours_warned


def tree_leaves(value):
  if isinstance(value, (list, tuple)):
    return [leaf for item in value for leaf in tree_leaves(item)]
  return [np.asarray(value)]


def _expected_warnings(entry, parallelism, batch):
  expected = []
  if entry in ("train_on_batch", "test_on_batch", "predict_on_batch") and batch == "unknown" and \
      parallelism == "data":
    expected.append(INDIVISIBLE)  # 10 rows over 4 batch shards: taken whole by every device
  if entry == "tf_function":
    expected.append(ONE_DEVICE)
  return expected


def _allowed_warnings(entry, parallelism, batch):
  return [FALLBACK] if parallelism == "model" and batch == "unknown" and entry in TRAINING else []


def _cells():
  for cell in itertools.product(ENTRIES, WAYS, PARALLELISM, BATCHES):
    marks = () if cell in REPRESENTATIVE else (pytest.mark.full_grid,)
    yield pytest.param(*cell, marks=marks, id="-".join(cell))


@pytest.fixture(autouse=True)
def _no_distribution_after():
  yield
  if keras.distribution.distribution() is not None:
    keras.distribution.set_distribution(None)


@pytest.mark.parametrize("entry,way,parallelism,batch", list(_cells()))
def test_each_entry_point_equals_one_device_or_is_refused(entry, way, parallelism, batch):
  if entry == "tf_function" and parallelism == "model":
    with pytest.raises(replicator.UnsupportedError, match=SHARDED):
      distance(entry, way, parallelism, batch)
    return
  gap, warned = distance(entry, way, parallelism, batch)
  assert gap <= ATOL, gap
  expected = _expected_warnings(entry, parallelism, batch)
  allowed = _allowed_warnings(entry, parallelism, batch)
  assert all(any(e in w for w in warned) for e in expected), warned
  assert all(any(e in w for e in expected + allowed) for w in warned), warned


if __name__ == "__main__":  # the grid as a table: python tests/test_keras_entry_points.py (from the checkout)
  import sys  # pylint: disable=import-outside-toplevel
  replicator.virtual_cpus(8)
  print("| entry | way in | parallel | batches | distance to one device |")
  print("|---|---|---|---|---|")
  for cell in itertools.product(ENTRIES, WAYS, PARALLELISM, BATCHES):
    try:
      gap, warned = distance(*cell)
      result = f"{gap:.1e}" + (f" (warned: {'; '.join(w[:50] for w in warned)})" if warned else "")
    except replicator.ReplicatorError as error:
      result = f"refused: {type(error).__name__}: {str(error)[:90]}..."
    finally:
      if keras.distribution.distribution() is not None:
        keras.distribution.set_distribution(None)
    print("| " + " | ".join(cell) + f" | {result} |", flush=True)
  sys.exit(0)
