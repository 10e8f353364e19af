"""Replicator API: run, caching, inputs, reduce/gather, explain, current()."""

import gc
import re
import warnings
import weakref

import numpy as np
import pytest
import tensorflow as tf
from conftest import REPLICA_COUNTS
from conftest import cpus

import mesh
import replicator


def test_default_uses_all_local_devices():
  repl = replicator.Replicator()
  assert repl.num_replicas == 8
  assert repl.devices == tuple(cpus(8))
  assert repl.mesh == mesh.Mesh({"replica": 8}, cpus(8))


def test_mesh_argument():
  m = mesh.Mesh({"a": 2, "b": 2}, cpus(4))
  assert replicator.Replicator(mesh=m).num_replicas == 4
  with pytest.raises(ValueError, match="not both"):
    replicator.Replicator(cpus(4), mesh=m)


@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_traces_once_for_repeated_calls(n):
  repl = replicator.Replicator(cpus(n))
  with repl.context():
    v = tf.Variable(0.0)
  calls = []

  def step_fn():
    calls.append(repl.replica_id)
    v.assign_add(repl.all_sum(1.0))
    return v.read_value()

  for step in range(5):
    out = repl.run(step_fn)
    assert [float(x) for x in out] == [float(n * (step + 1))] * n
  assert calls == list(range(n))  # step_fn traced once per replica, on the first call only
  assert repl.trace_count == 1


def test_input_fn_iterators_created_once_and_reused():
  repl = replicator.Replicator(cpus(2))
  made = []

  def input_fn(ctx):
    made.append((ctx.replica_id, ctx.num_replicas, ctx.input_pipeline_id, ctx.num_input_pipelines))
    return tf.data.Dataset.range(ctx.replica_id * 100, ctx.replica_id * 100 + 5)

  def step_fn(element):
    return element

  seen = [[int(x) for x in repl.run(step_fn, input_fn)] for _ in range(3)]
  assert made == [(0, 2, 0, 2), (1, 2, 1, 2)]
  assert seen == [[0, 100], [1, 101], [2, 102]]  # the iterators advance: created once
  assert repl.trace_count == 1


def test_end_of_input_ends_an_epoch_loop():
  repl = replicator.Replicator(cpus(2))

  def input_fn(ctx):
    return tf.data.Dataset.range(3)

  def step_fn(element):
    return element

  seen = []
  while True:
    try:
      seen.append([int(v) for v in repl.run(step_fn, input_fn)])
    except replicator.EndOfInput as e:
      assert isinstance(e, StopIteration)
      assert "input is exhausted" in str(e) and "dataset.repeat()" in str(e)
      break
  assert seen == [[0, 0], [1, 1], [2, 2]]


def test_explicit_inputs_nests_and_none_outputs():
  repl = replicator.Replicator(cpus(2))

  def step_fn(inputs):
    return {"double": inputs["x"] * 2, "nothing": None, "pair": (inputs["y"], 1.0)}

  per_replica = replicator.PerReplica([{"x": np.float32(1), "y": np.arange(3)}, {"x": np.float32(2), "y": np.arange(3) + 1}])
  out = repl.run(step_fn, inputs=per_replica)
  assert float(out["double"][1]) == 4.0
  assert out["nothing"] is None
  np.testing.assert_array_equal(out["pair"][0][1].numpy(), [1, 2, 3])
  assert float(out["pair"][1][0]) == 1.0
  # Same structure and shapes again: no new trace; a new shape: a new trace.
  repl.run(step_fn, inputs=per_replica)
  assert repl.trace_count == 1
  repl.run(step_fn, inputs=replicator.PerReplica([{"x": np.float32(1), "y": np.arange(4)}] * 2))
  assert repl.trace_count == 2


def test_step_without_return_still_runs_updates():
  repl = replicator.Replicator(cpus(4))
  with repl.context():
    v = tf.Variable(1.0)

  def step_fn():
    v.assign(repl.all_reduce(v * float(repl.replica_id + 1), op="max"))

  out = repl.run(step_fn)
  assert out is None  # nothing returned
  assert [c.numpy() for c in v.components] == [4.0] * 4


@pytest.mark.parametrize("op, axis, want", [
    ("sum", None, [4.0, 6.0]), ("mean", None, [2.0, 3.0]), ("max", None, [3.0, 4.0]),
    ("min", None, [1.0, 2.0]), ("sum", 0, 10.0), ("mean", 0, 2.5)])
def test_reduce(op, axis, want):
  repl = replicator.Replicator(cpus(2))
  out = repl.run(lambda x: x, inputs=replicator.PerReplica([np.array([1.0, 2.0]), np.array([3.0, 4.0])]))
  np.testing.assert_allclose(repl.reduce(op, out, axis=axis).numpy(), want)


def test_run_returns_the_step_nest_with_per_replica_leaves():
  repl = replicator.Replicator(cpus(2))
  loss, metrics = repl.run(lambda: (tf.constant(1.0), {"acc": tf.constant(repl.replica_id)}))
  assert isinstance(loss, replicator.PerReplica) and len(loss) == 2
  assert [int(v) for v in metrics["acc"]] == [0, 1]
  # Results can be fed back as inputs: a nest of PerReplica is split per replica.
  again = repl.run(lambda x: x["acc"] * 10, inputs=metrics and {"acc": metrics["acc"]})
  assert [int(v) for v in again] == [0, 10]


def test_gather_and_nested_reduce():
  repl = replicator.Replicator(cpus(2))
  out = repl.run(lambda x: {"a": x, "b": (x * 10,)},
                 inputs=replicator.PerReplica([np.array([[1.0]]), np.array([[2.0]])]))
  np.testing.assert_allclose(repl.gather(out)["a"].numpy(), [[1.0], [2.0]])
  np.testing.assert_allclose(repl.gather(out, axis=1)["b"][0].numpy(), [[10.0, 20.0]])
  np.testing.assert_allclose(repl.reduce("sum", out)["b"][0].numpy(), [[30.0]])


def test_gather_and_reduce_take_negative_axes_as_tensorflow_does():
  repl = replicator.Replicator(cpus(2))
  out = repl.run(lambda x: x, inputs=replicator.PerReplica([np.ones([2, 3]), np.ones([2, 3]) * 2]))
  assert repl.gather(out, axis=-1).shape == [2, 6] and repl.gather(out, axis=-2).shape == [4, 3]
  np.testing.assert_allclose(repl.reduce("sum", out, axis=-2).numpy(), [6.0, 6.0, 6.0])
  assert repl.gather(repl.run(lambda: tf.constant(1.0)), axis=-1).shape == [2]  # scalars: stacked


@pytest.mark.parametrize("op, values, axis, message", [
    ("gather", "x", 2, "repl.gather(..., axis=2) is out of range: the values at x/0 have rank 2 (shape (2, 3)), so "
     "axis must be in [-2, 2). Fix: pass an axis in [-2, 2) (a negative one counts from the last dimension)."),
    ("gather", "x", -3, "repl.gather(..., axis=-3) is out of range: the values at x/0 have rank 2"),
    ("gather", "loss", 1, "repl.gather(..., axis=1) is out of range: the values have rank 0 (shape (), scalars: "
     "stacked into a vector), so axis must be in [-1, 1)."),
    ("sum", "x", 2, "repl.reduce(..., axis=2) is out of range: the values at x/0 have rank 2 (shape (2, 3)), so axis "
     "must be in [-2, 2). Fix: pass an axis in [-2, 2) (a negative one counts from the last dimension), or axis=None "
     "to combine the replicas elementwise only."),
    ("mean", "both", 0, "repl.reduce(..., axis=0): the values at loss are scalars (rank 0), which have no dimension to "
     "reduce along; an int axis needs values of rank >= 1. Fix: pass axis=None (the default: the replicas' scalars "
     "combined), or return values of rank >= 1 from the step."),
])
def test_an_axis_out_of_range_is_refused_before_anything_runs(op, values, axis, message):
  # Was TensorFlow's "ConcatOp : Expected concatenating dimensions in the range [-2, 2), but got 2".
  repl = replicator.Replicator(cpus(2))
  out = repl.run(lambda x: {"x": (x,), "loss": tf.reduce_sum(x)},
                 inputs=replicator.PerReplica([np.ones([2, 3]), np.ones([2, 3])]))
  values = {"x": {"x": out["x"]}, "loss": out["loss"], "both": out}[values]
  with pytest.raises(replicator.ArgumentError, match=re.escape(message)):
    repl.gather(values, axis=axis) if op == "gather" else repl.reduce(op, values, axis=axis)


def test_an_axis_that_is_no_int_is_refused():
  repl = replicator.Replicator(cpus(2))
  out = repl.run(lambda: tf.ones([2]))
  with pytest.raises(replicator.ArgumentTypeError, match=re.escape(
      "repl.gather(..., axis=None): axis must be an int, found NoneType. Fix: pass a dimension of the values as an "
      "int (axis=0: the first; axis=-1: the last).")):
    repl.gather(out, axis=None)
  with pytest.raises(replicator.ArgumentTypeError, match=r"repl.reduce\(..., axis='0'\): axis must be None or an int"):
    repl.reduce("sum", out, axis="0")


def test_explain_lists_collectives_without_running():
  repl = replicator.Replicator(cpus(4))
  with repl.context():
    v = tf.Variable(tf.zeros([256]))

  def step_fn():
    grad = repl.all_reduce(tf.ones([256]), op="mean")
    v.assign_add(grad)
    return repl.all_gather(tf.ones([2, 3]), concat_dimension=1)

  plan = repl.explain(step_fn)
  assert [c.kind for c in plan.collectives] == ["all_reduce", "all_gather"]
  assert plan.collectives[0].nbytes == 1024
  assert plan.bytes_per_step == 4 * (1024 + 24)
  text = str(plan)
  assert "all_reduce(op='mean')" in text and "all_gather(concat_dimension=1)" in text and "float32" in text
  assert "1,024" in text and "one_device" in text and "test_replicator.py" in text
  assert float(v.numpy()[0]) == 0.0  # explain does not run the step
  repl.run(step_fn)
  assert repl.trace_count == 1  # run reuses the step explain built
  assert float(v.numpy()[0]) == 1.0


def test_explain_names_chosen_implementation():
  repl = replicator.Replicator(cpus(2), implementation="collective_ops")
  assert repl.explain(lambda: repl.all_sum(tf.ones([3]))).collectives[0].implementation == "collective_ops"


def test_current():
  repl = replicator.Replicator(cpus(2))
  assert replicator.current() is None
  seen = []

  def step_fn():
    seen.append(replicator.current())
    return tf.constant(0)

  repl.run(step_fn)
  assert seen == [repl, repl]
  with repl.context():
    assert replicator.current() is None  # context() is not a step


def test_library_code_communicates_through_current():
  def global_mean(x):  # e.g. inside a layer: works with or without a replicator
    repl = replicator.current()
    return tf.reduce_mean(x) if repl is None else repl.all_reduce(tf.reduce_mean(x), op="mean")

  repl = replicator.Replicator(cpus(4))
  out = repl.run(lambda x: global_mean(x), inputs=replicator.PerReplica([np.full([3], float(i)) for i in range(4)]))
  assert [float(v) for v in out] == [1.5] * 4
  assert float(global_mean(tf.ones([3]))) == 1.0


def test_python_control_flow_not_on_replica_is_fine():
  repl = replicator.Replicator(cpus(2))

  def step_fn(x):
    if x.shape[0] > 1:  # static: same on every replica
      x = repl.all_sum(x)
    return x

  out = repl.run(step_fn, inputs=replicator.PerReplica([np.ones(2), np.ones(2)]))
  np.testing.assert_allclose(out[0].numpy(), [2.0, 2.0])


def test_autograph_tensor_control_flow_without_collectives():
  repl = replicator.Replicator(cpus(2))

  def step_fn(x):
    if tf.reduce_sum(x) > 2.5:  # a tensor condition: AutoGraph makes a tf.cond
      x = x * 10.0
    return repl.all_sum(x)

  out = repl.run(step_fn, inputs=replicator.PerReplica([np.ones(2), np.full(2, 2.0)]))
  np.testing.assert_allclose(out[0].numpy(), [21.0, 21.0])


@pytest.mark.parametrize("prefetch", [0, 2])
def test_input_fn_with_and_without_device_prefetch(prefetch):
  repl = replicator.Replicator(cpus(4), prefetch_to_device=prefetch)

  def input_fn(ctx):
    return tf.data.Dataset.range(ctx.replica_id * 10, ctx.replica_id * 10 + 3)

  def step_fn(element):
    return element + repl.all_sum(tf.constant(0, tf.int64))

  seen = [[int(v) for v in repl.run(step_fn, input_fn)] for _ in range(3)]
  assert seen == [[0, 10, 20, 30], [1, 11, 21, 31], [2, 12, 22, 32]]
  with pytest.raises(replicator.EndOfInput):
    repl.run(step_fn, input_fn)


def test_run_inside_a_tf_function_runs_the_step_and_nested_steps_are_refused():
  # Was: a loop over distribute_dataset inside a tf.function grew to 6.5 GB without end (then: refused);
  # repl.run inside step_fn failed with "int() argument must be ... not 'SymbolicTensor'".
  repl = replicator.Replicator(cpus(2))
  dataset = repl.distribute_dataset(tf.data.Dataset.range(8).batch(4))

  @tf.function
  def train_epoch():
    total = tf.constant(0, tf.int64)
    for batch in dataset:
      total += repl.reduce("sum", repl.run(tf.reduce_sum, inputs=batch))
    return total

  assert int(train_epoch()) == sum(range(8))  # tests/test_in_function.py has the rest
  with pytest.raises(replicator.ReplicaContextError, match=r"called inside a step being built \(replica 0.*steps do not "
                                                           r"nest"):
    repl.run(lambda: repl.run(lambda: tf.constant(1.0)))
  # The supported forms: a Python loop, or the loop in the replicator's graph.
  seen = [repl.gather(repl.run(lambda x: x, inputs=batch)).numpy().tolist() for batch in dataset]
  assert seen == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_gather_of_scalars_stacks_them():
  # Was: "ConcatOp : Can't concatenate scalars (use tf.stack instead)".
  repl = replicator.Replicator(cpus(3))
  assert repl.gather(repl.run(lambda: tf.cast(repl.replica_id, tf.float32))).numpy().tolist() == [0.0, 1.0, 2.0]


def _counting_step(v, k):
  def step():
    v.assign_add(float(k))
    return v.read_value()
  return step


def test_a_dropped_step_fn_frees_its_step():
  repl = replicator.Replicator(cpus(2))
  with repl.context():
    v = tf.Variable(0.0)
  step = _counting_step(v, 1)
  repl.run(step)
  ref = weakref.ref(step)
  assert len(repl._views["local"].steps.values()) == 1  # pylint: disable=protected-access
  del step
  gc.collect()
  assert ref() is None  # the Replicator does not keep the step function alive...
  assert not repl._views["local"].steps.values()  # ...nor its compiled step  # pylint: disable=protected-access


def test_a_dropped_step_fn_frees_its_global_view_step_and_its_kept_values():
  import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  repl = replicator.Replicator(mesh=mesh_lib.Mesh({"batch": 2}, devices=cpus(2)), view="global")
  with repl.context():
    v = tf.Variable(0.0)
  step = lambda x: v.assign_add(tf.reduce_sum(x))  # noqa: E731
  repl.run(step, tf.data.Dataset.from_tensors(tf.ones([4])))
  (built,) = [s for by_spec in repl._views["global"].steps.values() for variants in by_spec.values()  # pylint: disable=protected-access
              for s in variants.values()]
  shadows = [weakref.ref(g.shadow) for g in built.snapshot.whole._groups]  # pylint: disable=protected-access
  assert shadows and float(v.numpy()) == 4.0
  ref = weakref.ref(step)
  del step, built
  gc.collect()
  assert ref() is None and not repl._views["global"].steps.values()  # pylint: disable=protected-access
  assert all(s() is None for s in shadows)  # the values a call keeps go with its step


def test_new_objects_of_one_step_function_warn_once():
  repl = replicator.Replicator(cpus(2))
  with repl.context():
    v = tf.Variable(0.0)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for k in range(4):
      repl.run(_counting_step(v, k))  # four new objects of one function: no warning yet
    assert not caught
    for k in range(4, 7):
      repl.run(_counting_step(v, k))
  assert len(caught) == 1  # once, at the fifth
  assert re.search(r"repl.run has built a step for 5 different objects of the same step function step "
                   r"\(.*test_replicator.py:\d+\): each new object .* is a new step, traced on every replica.*"
                   r"Fix: create the step function once, outside the loop", str(caught[0].message))
  assert caught[0].filename == __file__  # points at the caller's repl.run
  assert float(v.numpy()) == sum(range(7))  # and every step ran


def test_reused_and_distinct_step_functions_do_not_warn():
  repl = replicator.Replicator(cpus(2))
  with repl.context():
    v = tf.Variable(0.0)
  steps = [(lambda k=k: v.assign_add(float(k))) for k in range(3)]  # one code object: kept alive, reused
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(5):
      for step in steps:
        repl.run(step)
  assert not caught


def test_calls_from_two_threads_run_one_at_a_time_and_never_mix_replicas():
  # Was: a call's outputs mixing two calls' elements ([384, 388, 384, 388]): their replicas read in turns.
  import threading  # pylint: disable=import-outside-toplevel
  repl = replicator.Replicator(cpus(4))

  def batches(ctx):  # every replica's dataset: element i is [i, i]
    del ctx
    return tf.data.Dataset.range(400).map(lambda i: tf.fill([2], tf.cast(i, tf.float32)))

  def step(x):
    return tf.reduce_mean(x)

  repl.run(step, batches)
  calls = []

  def worker():
    for _ in range(60):
      calls.append([float(v) for v in repl.run(step, batches).values])

  threads = [threading.Thread(target=worker) for _ in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert all(len(set(call)) == 1 for call in calls), [c for c in calls if len(set(c)) > 1][:3]
  assert sorted(call[0] for call in calls) == [float(i) for i in range(1, 121)]  # every batch once
