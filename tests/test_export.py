"""Export for serving: tf.saved_model.save and Keras model.export write one global variable per replicated
variable, and the loaded SavedModel (in this process or a fresh one without replicator) serves global values."""

import gc
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus

import mesh
import replicator

ON_READ = tf.VariableSynchronization.ON_READ
RNG = np.random.RandomState(0)
X = RNG.randn(6, 3).astype(np.float32)  # served
# Four replicas' batches, drawn from different distributions: the BatchNormalization statistics differ per replica.
BATCHES = [(RNG.randn(8, 3) * (1 + r) + r).astype(np.float32) for r in range(4)]


def _serve(path: str, x: np.ndarray) -> np.ndarray:
  loaded = tf.saved_model.load(path)
  (out,) = loaded.signatures["serving_default"](tf.constant(x)).values()
  return out.numpy()


def _serve_graph(path: str, x: np.ndarray) -> np.ndarray:
  """As TF Serving serves it: the SavedModel's graph, restored by its saver, run through its signature."""
  with tf.Graph().as_default(), tf.compat.v1.Session() as session:
    signature = tf.compat.v1.saved_model.load(session, ["serve"], path).signature_def["serving_default"]
    (given,), (wanted,) = signature.inputs.values(), signature.outputs.values()
    return session.run(wanted.name, {given.name: x})


def _loaded_variables(path: str) -> dict:
  """Every variable of the loaded SavedModel by name (a name may occur several times)."""
  loaded = tf.saved_model.load(path)
  found = {}
  for obj in tf.train.TrackableView(loaded).descendants():
    if isinstance(obj, tf.Variable):
      found.setdefault(obj.name.split(":")[0], []).append(obj.numpy())
  return found


def _assert_holds(path: str, model_variables) -> None:
  """The loaded SavedModel's variable of each name holds the model's global value (every copy of it)."""
  found = _loaded_variables(path)
  for v in model_variables:
    copies = found[v.path]
    for copy in copies:
      np.testing.assert_array_equal(copy, v.numpy(), err_msg=v.path)


def _numpy_forward(model, x):
  """Dense -> BatchNormalization (inference) -> Dense in numpy, from the model's global values."""
  dense1, norm, dense2 = model.layers
  h = x @ dense1.kernel.numpy() + dense1.bias.numpy()
  h = (h - norm.moving_mean.numpy()) / np.sqrt(norm.moving_variance.numpy() + norm.epsilon)
  h = h * norm.gamma.numpy() + norm.beta.numpy()
  return h @ dense2.kernel.numpy() + dense2.bias.numpy()


def _trained_keras_model():
  repl = replicator.Replicator(cpus(4))
  keras.utils.set_random_seed(3)
  with repl.context():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(5), keras.layers.BatchNormalization(),
                              keras.layers.Dense(2)])
    opt = repl.wrap_optimizer(keras.optimizers.Adam(0.05))
  initial = [v.numpy() for v in model.variables]

  def step_fn(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(model(x, training=True) - 1.0))
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return loss

  for _ in range(3):
    repl.run(step_fn, inputs=replicator.PerReplica(BATCHES))
  for v, before in zip(model.variables, initial):  # trained: an export of stale values would be seen
    assert not np.allclose(v.numpy(), before), v.path
  return repl, model


def test_keras_model_exports_global_values(tmp_path):
  _, model = _trained_keras_model()
  want = model(X, training=False).numpy()
  np.testing.assert_allclose(want, _numpy_forward(model, X), atol=1e-5)
  tf.saved_model.save(model, str(tmp_path / "saved"))
  model.export(str(tmp_path / "exported"), verbose=False)

  for name in ("saved", "exported"):
    np.testing.assert_allclose(_serve(str(tmp_path / name), X), want, atol=1e-6, err_msg=name)
    _assert_holds(str(tmp_path / name), model.variables)
  loaded = tf.saved_model.load(str(tmp_path / "exported"))  # model.export: `variables` in the model's order
  assert [v.shape for v in loaded.variables] == [v.shape for v in model.variables]
  for got, v in zip(loaded.variables, model.variables):
    assert not isinstance(got, replicator.ReplicatedVariable)
    np.testing.assert_array_equal(got.numpy(), v.numpy())
  np.testing.assert_allclose(loaded.serve(tf.constant(X)).numpy(), want, atol=1e-6)


FRESH_PROCESS = """
import json, sys
import numpy as np
import tensorflow as tf
x = np.load(sys.argv[1])
result = {}
for path, graph_too in json.loads(sys.argv[2]).items():
  loaded = tf.saved_model.load(path)
  (out,) = loaded.signatures["serving_default"](tf.constant(x)).values()
  result[path] = out.numpy().tolist()
  if not graph_too:
    continue
  with tf.Graph().as_default(), tf.compat.v1.Session() as session:  # as TF Serving loads it: saver, signature
    signature = tf.compat.v1.saved_model.load(session, ["serve"], path).signature_def["serving_default"]
    (given,), (wanted,) = signature.inputs.values(), signature.outputs.values()
    result[path + " (graph)"] = session.run(wanted.name, {given.name: x}).tolist()
assert "replicator" not in sys.modules and "mesh" not in sys.modules, sorted(sys.modules)
print("RESULT " + json.dumps(result))
"""


def _serve_in_fresh_process(x: np.ndarray, paths: dict, tmp_path) -> dict:
  """Each SavedModel's serving outputs in a new Python process (which never imports replicator).

  Loaded with tf.saved_model.load and, for paths mapped to True, also as TF
  Serving loads one: into a graph restored by its saver (key "<path> (graph)").
  Keras's own tf.saved_model.save(model) output fails that even without
  replicator (its functions read copies the saver does not restore).
  """
  np.save(str(tmp_path / "x.npy"), x)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  paths = json.dumps({str(path): graph_too for path, graph_too in paths.items()})
  process = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(tmp_path / "x.npy"), paths],
                           cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
  lines = [line for line in process.stdout.splitlines() if line.startswith("RESULT ")]
  assert lines, f"serving failed (exit {process.returncode}):\n{process.stderr[-4000:]}"
  return {path: np.array(out, np.float32) for path, out in json.loads(lines[-1][len("RESULT "):]).items()}


def test_served_in_a_fresh_process_without_replicator(tmp_path):
  _, model = _trained_keras_model()
  want = model(X, training=False).numpy()
  saved, exported = tmp_path / "saved", tmp_path / "exported"
  tf.saved_model.save(model, str(saved))
  model.export(str(exported), verbose=False)
  served = _serve_in_fresh_process(X, {saved: False, exported: True}, tmp_path)
  assert len(served) == 3
  for path, out in served.items():
    np.testing.assert_allclose(out, want, atol=1e-6, err_msg=path)


def _sharded_model():
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4)))
  keras.utils.set_random_seed(5)
  with repl.context(layouts={"dense_1/kernel": (None, "model"), "dense_1/bias": ("model",)}):
    dense = keras.layers.Dense(8, name="dense_1")
    model = keras.Sequential([keras.Input((3,)), dense])
    opt = repl.wrap_optimizer(keras.optimizers.Adam(0.1))

  def step_fn(x):  # inside the step the layer computes this device's 4 columns
    with tf.GradientTape() as tape:
      loss = repl.all_sum(tf.reduce_sum(tf.square(model(x) - 1.0)), axis="model")
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

  repl.run(step_fn, inputs=replicator.PerReplica(BATCHES))
  return repl, model, dense


def test_sharded_model_exports_and_serves_the_global_computation(tmp_path):
  _, model, dense = _sharded_model()
  kernel = dense.kernel.value
  assert kernel.sharding is not None and [c.shape.as_list() for c in kernel.components] == [[3, 4]] * 4
  assert not np.allclose(kernel.components[0].numpy(), kernel.components[1].numpy())
  want = X @ dense.kernel.numpy() + dense.bias.numpy()  # the global computation
  np.testing.assert_allclose(model(X).numpy(), want, atol=1e-6)
  tf.saved_model.save(model, str(tmp_path / "saved"))
  model.export(str(tmp_path / "exported"), verbose=False)
  for name in ("saved", "exported"):
    np.testing.assert_allclose(_serve(str(tmp_path / name), X), want, atol=1e-6, err_msg=name)
    _assert_holds(str(tmp_path / name), model.variables)
  loaded = tf.saved_model.load(str(tmp_path / "exported"))
  assert [v.shape.as_list() for v in loaded.variables] == [[3, 8], [8]]
  served = _serve_in_fresh_process(X, {tmp_path / "saved": False, tmp_path / "exported": True}, tmp_path)
  assert len(served) == 3
  for path, out in served.items():
    np.testing.assert_allclose(out, want, atol=1e-6, err_msg=path)


class Affine(tf.Module):

  def __init__(self):
    super().__init__()
    self.w = tf.Variable(tf.reshape(tf.range(12.0), [3, 4]) / 10.0, name="w")
    self.b = tf.Variable(tf.ones([4]), name="b")

  @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
  def __call__(self, x):
    return x @ self.w + self.b


@pytest.mark.parametrize("layouts", [None, {"w": (None, "model")}], ids=["replicated", "sharded"])
def test_module_with_signatures(tmp_path, layouts):
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4)))
  with repl.context(layouts=layouts):
    module = Affine()
  assert (module.w.sharding is not None) == (layouts is not None)
  module(X)  # traced now, before the values change: the function reads the variables when it runs

  def step_fn():  # inside the step a sharded w is this device's [3, 2] piece
    module.w.assign_add(tf.ones([3, 4 if layouts is None else 2]))
    module.b.assign(module.b * 3.0)

  repl.run(step_fn)
  w = np.reshape(np.arange(12.0, dtype=np.float32), [3, 4]) / 10.0 + 1.0
  want = X @ w + 3.0
  np.testing.assert_allclose(module(X).numpy(), want, atol=1e-6)  # in this process: the components
  tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": module.__call__})
  loaded = tf.saved_model.load(str(tmp_path / "m"))
  np.testing.assert_allclose(_serve(str(tmp_path / "m"), X), want, atol=1e-6)
  np.testing.assert_allclose(_serve_graph(str(tmp_path / "m"), X), want, atol=1e-6)
  np.testing.assert_allclose(loaded(tf.constant(X)).numpy(), want, atol=1e-6)
  np.testing.assert_array_equal(loaded.w.numpy(), w)
  np.testing.assert_array_equal(loaded.b.numpy(), np.full([4], 3.0, np.float32))
  module.w.assign(tf.zeros([3, 4]))  # the training process's function still reads its own variables
  np.testing.assert_allclose(module(X).numpy(), np.full([6, 4], 3.0), atol=1e-6)


class Counter(tf.Module):

  def __init__(self, aggregation):
    super().__init__()
    self.total = tf.Variable(tf.zeros([2]), synchronization=ON_READ, aggregation=aggregation, trainable=False)

  @tf.function(input_signature=[])
  def read(self):
    return tf.identity(self.total)


@pytest.mark.parametrize("aggregation, factor", [(tf.VariableAggregation.SUM, 1.0), (tf.VariableAggregation.MEAN, 0.25)],
                         ids=["sum", "mean"])
def test_on_read_variable_exports_its_aggregate(tmp_path, aggregation, factor):
  repl = replicator.Replicator(cpus(4))
  with repl.context():
    counter = Counter(aggregation)
  counter.read()  # traced before the replicas write

  def step_fn(x):
    counter.total.assign_add(x)  # each replica its own value

  repl.run(step_fn, inputs=replicator.PerReplica([tf.constant([r + 1.0, 10.0 * r]) for r in range(4)]))
  want = np.array([1 + 2 + 3 + 4, 0 + 10 + 20 + 30], np.float32) * factor
  per_replica = [c.numpy() for c in counter.total.components]
  assert not all(np.array_equal(p, per_replica[0]) for p in per_replica)
  np.testing.assert_allclose(counter.read().numpy(), want)
  tf.saved_model.save(counter, str(tmp_path / "c"))
  loaded = tf.saved_model.load(str(tmp_path / "c"))
  np.testing.assert_allclose(loaded.total.numpy(), want)
  np.testing.assert_allclose(loaded.read().numpy(), want)


def _replicated_variables() -> int:
  gc.collect()  # live ones only: earlier tests' garbage, collected in between, would change the count
  return sum(isinstance(o, replicator.ReplicatedVariable) for o in gc.get_objects())


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "sharded"])
def test_saving_inside_the_context_creates_no_replicated_variables(tmp_path, sharded):
  repl, model = _sharded_model()[:2] if sharded else _trained_keras_model()
  want = model(X, training=False).numpy()
  made = []

  def spy(next_creator, **kwargs):
    made.append(next_creator(**kwargs))
    return made[-1]

  before = _replicated_variables()
  with repl.context(), tf.variable_creator_scope(spy):  # the model's replicator's creator is active
    tf.saved_model.save(model, str(tmp_path / "saved"))  # traces its default signature here
    model.export(str(tmp_path / "exported"), verbose=False)
    assert made == [] and _replicated_variables() == before
    inside = tf.Variable(1.0)  # the context still replicates what the program creates
  assert made == [inside] and isinstance(inside, replicator.ReplicatedVariable)
  for name in ("saved", "exported"):
    np.testing.assert_allclose(_serve(str(tmp_path / name), X), want, atol=1e-6, err_msg=name)
    _assert_holds(str(tmp_path / name), model.variables)
