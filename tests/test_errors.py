"""Every error a user can cause: raised at build time, with its message pinned."""

import re
import signal

import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus

import mesh
import replicator

THIS_FILE = __file__.rsplit("/", 1)[-1]
SECONDS = 60  # every error here is raised while building (or in a first step), in a few seconds


@pytest.fixture(autouse=True)
def _no_hang():
  """Fails a test that has not raised within SECONDS instead of hanging CI."""
  def timeout(signum, frame):
    raise TimeoutError(f"no error after {SECONDS}s: the error path hangs")

  previous = signal.signal(signal.SIGALRM, timeout)
  signal.alarm(SECONDS)
  yield
  signal.alarm(0)
  signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def repl():
  return replicator.Replicator(cpus(2))


def test_collective_on_one_replica_only(repl):
  def step_fn():
    x = tf.ones([3])
    if repl.replica_id == 0:
      x = repl.all_reduce(x)
    return x

  with pytest.raises(replicator.CollectiveMismatchError) as e:
    repl.run(step_fn)
  message = str(e.value)
  assert "Replica 0 made 1 collective call(s) but replica 1 made 0" in message
  assert "collective #0" in message
  assert "all_reduce(op='sum', axis='replica') of float32[3]" in message
  assert f"{THIS_FILE}:" in message and "in step_fn" in message  # the user's source line
  assert "if repl.replica_id == 0" in message  # the usual cause
  assert e.value.replicas == (0, 1)


def test_different_op_per_replica(repl):
  def step_fn():
    return repl.all_reduce(tf.ones([2]), op="sum" if repl.replica_id == 0 else "max")

  with pytest.raises(replicator.CollectiveMismatchError,
                     match=r"(?s)Replicas 0 and 1 disagree on collective #0 \(its kind or parameters differs\).*"
                           r"replica 0: all_reduce\(op='sum'.*replica 1: all_reduce\(op='max'"):
    repl.run(step_fn)


def test_different_order_per_replica(repl):
  def step_fn():
    a, b = tf.ones([2]), tf.ones([2])
    if repl.replica_id == 0:
      return repl.all_sum(a), repl.broadcast(b)
    return repl.broadcast(b), repl.all_sum(a)

  with pytest.raises(replicator.CollectiveMismatchError, match="disagree on collective #0"):
    repl.run(step_fn)


def test_different_shape_and_dtype_per_replica(repl):
  with pytest.raises(replicator.CollectiveMismatchError, match=r"its shape differs\).*\n.*float32\[2\].*\n.*float32\[3\]"):
    repl.run(lambda: repl.all_sum(tf.ones([2 + repl.replica_id])))
  with pytest.raises(replicator.CollectiveMismatchError, match=r"its dtype differs"):
    repl.run(lambda: repl.all_sum(tf.ones([2], tf.float32 if repl.replica_id == 0 else tf.float64)))


def test_primitives_outside_a_step(repl):
  for call in (lambda: repl.all_reduce(tf.ones([1])), lambda: repl.all_sum(1.0),
               lambda: repl.broadcast(1.0), lambda: repl.all_gather(tf.ones([1])),
               lambda: repl.reduce_scatter(tf.ones([2])), lambda: repl.all_to_all(tf.ones([2])),
               lambda: repl.permute(tf.ones([2]), perm=[(0, 1)]), lambda: repl.axis_index(),
               lambda: repl.replica_id):
    with pytest.raises(replicator.ReplicaContextError,
                       match=r"was called outside a replica context\. .*Fix: call it from inside step_fn"):
      call()


def test_primitive_of_another_replicator(repl):
  other = replicator.Replicator(cpus(2))
  with pytest.raises(replicator.ReplicaContextError, match="belongs to another Replicator"):
    repl.run(lambda: other.all_sum(tf.ones([1])))


def test_collective_inside_tf_cond(repl):
  def step_fn():
    x = tf.ones([2])
    return tf.cond(tf.reduce_sum(x) > 0, lambda: repl.all_sum(x), lambda: x)

  with pytest.raises(replicator.CollectiveInControlFlowError,
                     match=r"repl\.all_reduce\(\) was called inside a tf\.cond / tf\.while_loop .*Fix: move the collective"):
    repl.run(step_fn)


def test_collective_inside_while_loop(repl):
  def step_fn():
    return tf.while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, repl.all_sum(x)), (0, tf.ones([2])))

  with pytest.raises(replicator.CollectiveInControlFlowError, match="inside a tf.cond / tf.while_loop"):
    repl.run(step_fn)


def test_collective_inside_autograph_loop(repl):
  def step_fn(x):
    total = tf.zeros([2])
    for _ in tf.range(tf.cast(x[0], tf.int32)):  # a tensor loop: AutoGraph makes a tf.while_loop
      total += repl.all_sum(x)
    return total

  with pytest.raises(replicator.CollectiveInControlFlowError):
    repl.run(step_fn, inputs=replicator.PerReplica([tf.ones([2]), tf.ones([2])]))


def test_unknown_devices_list_the_available_ones():
  with pytest.raises(replicator.DeviceError, match=r"Unknown device '/gpu:0' at position 0\. Expected one of the logical devices TensorFlow knows about: /device:CPU:0, "):
    replicator.Replicator(["/gpu:0"])
  with pytest.raises(replicator.DeviceError, match=r"Unknown device 'cpu:8'"):
    replicator.Replicator(cpus(2) + ["cpu:8"])
  with pytest.raises(replicator.DeviceError, match=r"single string"):
    replicator.Replicator("cpu:0")


def test_input_fn_structure_differs(repl):
  def input_fn(ctx):
    x = np.ones([4, 2], np.float32)
    if ctx.replica_id == 0:
      return tf.data.Dataset.from_tensor_slices((x, x)).batch(2)
    return tf.data.Dataset.from_tensor_slices(x).batch(2)

  with pytest.raises(replicator.InputMismatchError,
                     match=r"(?s)input_fn's datasets gives per-replica elements that differ between replicas 0 and 1 \(structure\).*replica 0: \(TensorSpec.*replica 1: TensorSpec"):
    repl.run(lambda batch: batch, input_fn)


def test_input_fn_dtype_differs(repl):
  def input_fn(ctx):
    dtype = np.float32 if ctx.replica_id == 0 else np.float64
    return tf.data.Dataset.from_tensor_slices(np.ones([4, 2], dtype)).batch(2)

  with pytest.raises(replicator.InputMismatchError, match=r"\(dtype float32 vs float64\)"):
    repl.run(lambda batch: batch, input_fn)


def test_input_fn_returns_a_non_dataset(repl):
  with pytest.raises(replicator.InputMismatchError, match=r"input_fn must return a tf\.data\.Dataset, but for replica 0 it returned a builtins\.list"):
    repl.run(lambda batch: batch, lambda ctx: [1, 2, 3])


def test_wrong_number_of_inputs(repl):
  with pytest.raises(replicator.InputMismatchError, match=r"inputs= needs one value per replica \(2 replicas\), but found 3 values"):
    repl.run(lambda x: x, inputs=replicator.PerReplica([1.0, 2.0, 3.0]))


def test_step_fn_returns_different_structures(repl):
  def step_fn():
    if repl.replica_id == 0:
      return {"loss": tf.ones([])}
    return {"loss": tf.ones([]), "extra": tf.ones([])}

  with pytest.raises(replicator.OutputMismatchError,
                     match=r"(?s)step_fn returned different structures on replicas 0 and 1:.*replica 0: \{'loss': 'float32\(\)'\}"):
    repl.run(step_fn)


def test_step_fn_returns_different_dtypes(repl):
  with pytest.raises(replicator.OutputMismatchError, match="different dtypes"):
    repl.run(lambda: tf.ones([]) if repl.replica_id == 0 else tf.ones([], tf.int32))


def test_bad_arguments():
  repl = replicator.Replicator(cpus(2))
  with pytest.raises(ValueError, match=r"op must be one of \('sum', 'mean', 'max', 'min'\)"):
    repl.run(lambda: repl.all_reduce(tf.ones([1]), op="prod"))
  with pytest.raises(ValueError, match=r"source must be a replica index in \[0, 2\)"):
    repl.run(lambda: repl.broadcast(tf.ones([1]), source=2))
  with pytest.raises(ValueError, match=r"all_gather\(\) needs tensors of known rank >= 1"):
    repl.run(lambda: repl.all_gather(tf.ones([])))
  with pytest.raises(TypeError, match="needs numeric tensors, found bool"):
    repl.run(lambda: repl.all_sum(tf.constant([True])))
  with pytest.raises(ValueError, match="either input_fn or inputs="):
    repl.run(lambda x: x, lambda ctx: None, inputs=[1, 2])
  with pytest.raises(ValueError, match="Unknown collective implementation 'fast'"):
    replicator.Replicator(cpus(2), implementation="fast")
  with pytest.raises(TypeError, match=r"takes the PerReplica values returned by repl.run \(or a nest of them\), found EagerTensor"):
    repl.reduce("sum", tf.ones([2]))
  with pytest.raises(ValueError, match="reduction must be one of"):
    repl.wrap_optimizer(object(), reduction="max")


def test_all_gather_with_an_int_axis():
  repl = replicator.Replicator(cpus(2))
  with pytest.raises(TypeError, match=re.escape(
      "repl.all_gather(x, axis=1): `axis` names mesh axes, as for every collective (an axis name of "
      "('replica',), a tuple of them, or None for all), but found the int 1. The tensor dimension to "
      "concatenate along is `concat_dimension`. Fix: repl.all_gather(x, concat_dimension=1).")):
    repl.run(lambda: repl.all_gather(tf.ones([2, 3]), 1))


def test_axis_collective_bad_arguments():
  m = mesh.Mesh({"batch": 2, "model": 2}, cpus(4))
  repl = replicator.Replicator(mesh=m)
  with pytest.raises(ValueError, match=re.escape(
      "repl.reduce_scatter(scatter_dimension=0) splits dimension 0 (of size 3) of a float32 tensor of "
      "shape (3, 2) among the 4 replica(s) of each group along mesh axes ('batch', 'model'), but 4 does "
      "not evenly divide 3 at ") + rf".*{THIS_FILE}:\d+ in .*\. Fix: pad dimension 0 to a multiple of 4 \(e\.g\. 4\), or split another dimension\."):
    repl.run(lambda: repl.reduce_scatter(tf.ones([3, 2])))
  with pytest.raises(ValueError, match=re.escape(
      "repl.all_to_all(split_dimension=1) splits dimension 1 (of size 3) of a float32 tensor of shape "
      "(2, 3) among the 2 replica(s) of each group along mesh axis 'model', but 2 does not evenly divide 3") +
      r".*Fix: pad dimension 1 to a multiple of 2 \(e\.g\. 4\)"):
    repl.run(lambda: repl.all_to_all(tf.ones([2, 3]), axis="model", split_dimension=1))
  with pytest.raises(ValueError, match=r"repl\.reduce_scatter\(scatter_dimension=0\) splits dimension 0 of a "
                                       r"float32 tensor of shape \(None,\) among .* but that dimension has no "
                                       r"static size at .*Fix: give it a static size \(e\.g\. tf\.ensure_shape\)"):
    repl.run(lambda: repl.reduce_scatter(tf.unique(tf.ones([4]))[0], axis="batch"))
  with pytest.raises(ValueError, match=r"reduce_scatter\(scatter_dimension=2\) is out of range for a tensor of rank 2 .*Fix: pass a dimension in \[-2, 2\)"):
    repl.run(lambda: repl.reduce_scatter(tf.ones([4, 4]), scatter_dimension=2))
  with pytest.raises(ValueError, match=r"reduce_scatter\(op='prod'\): op must be one of \('sum', 'mean', 'max', 'min'\)"):
    repl.run(lambda: repl.reduce_scatter(tf.ones([4]), "prod"))
  with pytest.raises(ValueError, match=r"all_to_all\(\) needs tensors of known rank >= 1"):
    repl.run(lambda: repl.all_to_all(tf.ones([])))


def test_permute_bad_perm():
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "model": 2}, cpus(4)))
  with pytest.raises(ValueError, match=re.escape(
      "repl.permute(perm=[(0, 2)]): the pair (0, 2) names a position outside [0, 2) (the 2 replica(s) of "
      "each group along mesh axis 'model'). Fix: use group positions 0..1 (see repl.axis_index).")):
    repl.run(lambda: repl.permute(tf.ones([2]), axis="model", perm=[(0, 2)]))
  with pytest.raises(ValueError, match=re.escape(
      "repl.permute(perm=[(0, 1), (0, 2)]): source position(s) [0] appear more than once. Each member "
      "sends to at most one destination and receives from at most one source. Fix: list each source once "
      "(use several permute calls or repl.all_gather to send one value to several members).")):
    repl.run(lambda: repl.permute(tf.ones([2]), perm=[(0, 1), (0, 2)]))
  with pytest.raises(ValueError, match=r"destination position\(s\) \[3\] appear more than once.*Fix: list each destination once"):
    repl.run(lambda: repl.permute(tf.ones([2]), perm=[(0, 3), (1, 3)]))
  with pytest.raises(TypeError, match=re.escape(
      "repl.permute(perm=[0, 1]): perm must be a list of (source, destination) pairs of group positions "
      "(ints), e.g. [(0, 1), (1, 0)].")):
    repl.run(lambda: repl.permute(tf.ones([2]), perm=[0, 1]))


def test_per_replica_batch_size_must_divide():
  ctx = replicator.InputContext(replica_id=0, num_replicas=3)
  with pytest.raises(ValueError, match=r"global batch size 32 is not divisible by the number of replicas 3.*e\.g\. 33"):
    ctx.get_per_replica_batch_size(32)


def test_errors_print_under_their_public_module_and_share_one_base():
  import mesh  # pylint: disable=import-outside-toplevel
  import rewrite  # pylint: disable=import-outside-toplevel
  public = [(replicator, name) for name in replicator.__all__ if name.endswith("Error") or name == "EndOfInput"]
  public += [(mesh, "MeshError"), (mesh, "DeviceError"), (mesh, "LayoutError"),
             (rewrite, "RewriteError"), (rewrite, "CollectiveMismatchError")]
  for module, name in public:
    error = getattr(module, name)
    assert issubclass(error, replicator.ReplicatorError), name
    assert f"{error.__module__}.{error.__qualname__}" in (f"replicator.{name}", f"mesh.{name}", f"rewrite.{name}"), name
  # Was: "mesh._errors.MeshError", "rewrite._errors.CollectiveMismatchError".
  assert f"{mesh.MeshError.__module__}.MeshError" == "mesh.MeshError"
  assert replicator.CollectiveMismatchError.__module__ == "rewrite"
  # Argument checks are ReplicatorErrors and still ValueError / TypeError.
  repl = replicator.Replicator(cpus(2))
  with pytest.raises(replicator.ArgumentError) as raised:
    repl.run(lambda: tf.constant(1.0), steps=0)
  assert isinstance(raised.value, ValueError)
  with pytest.raises(replicator.ArgumentTypeError) as raised:
    repl.run("not a function")
  assert isinstance(raised.value, TypeError)
  with pytest.raises(replicator.ReplicatorError):
    mesh.Mesh({"x": 3}, devices=cpus(2))


# Arguments of the wrong type: named errors with the fix, not Python's bare TypeError (issue 26).

def test_devices_given_as_a_count():
  with pytest.raises(replicator.ArgumentTypeError, match=re.escape(
      "`devices` must be a list of device strings, but found 4 (int). Fix: list the devices, e.g. "
      "devices=mesh.local_devices()[:4] for the first four; to split the CPU into n logical devices, call "
      "replicator.virtual_cpus(n) at program start.")):
    replicator.Replicator(devices=4)


def test_axis_given_as_a_number(repl):
  with pytest.raises(replicator.ArgumentTypeError, match=re.escape(
      "Mesh axes are named: expected an axis name (str), a tuple of names, or None for every axis, but found "
      "0 (int). The mesh has axes ('replica',) (shape {'replica': 2}). Fix: name the axis, e.g. "
      "axis='replica'.")):
    repl.run(lambda: repl.all_reduce(tf.ones([2]), axis=0))
  with pytest.raises(replicator.ArgumentTypeError, match="but found \\('replica', 1\\) \\(tuple\\)"):
    repl.run(lambda: repl.all_sum(tf.ones([2]), axis=("replica", 1)))


def test_prefetch_and_all_steps_of_the_wrong_type(repl):
  with pytest.raises(replicator.ArgumentTypeError, match=re.escape(
      "Replicator(prefetch_to_device='x'): expected None (the default: 2 on accelerators, 0 on CPUs) or how "
      "many elements to prefetch onto each device, an int >= 0.")):
    replicator.Replicator(cpus(2), prefetch_to_device="x")
  with pytest.raises(replicator.ArgumentTypeError, match="prefetch_to_device=-1"):
    replicator.Replicator(cpus(2), prefetch_to_device=-1)
  with pytest.raises(replicator.ArgumentTypeError, match=re.escape(
      "repl.run(all_steps='yes'): expected True (every step's results, stacked) or False (the last step's), "
      "a bool. Fix: all_steps=True.")):
    repl.run(lambda: tf.ones([]), all_steps="yes")


@pytest.mark.parametrize("spec,problem", [(("modl", None), "names mesh axis 'modl'"),
                                          (("model", "model"), "uses mesh axis 'model' for tensor dimensions 0 and 1")])
def test_a_layout_with_an_unknown_or_repeated_axis_names_the_variable(spec, problem):
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4)))
  with pytest.raises(mesh.LayoutError, match=re.escape(
      f"The layout of variable 'w' (shape [4, 8]): Layout {spec!r} ") + re.escape(problem)):
    with repl.context(layouts=mesh.LayoutMap({"w": spec})):
      tf.Variable(tf.zeros([4, 8]), name="w")


@pytest.mark.parametrize("view", ["local", "global"])
def test_the_end_of_a_dataset_of_global_batches_speaks_of_the_dataset(view):
  repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2}, devices=cpus(2)), view=view)
  data = tf.data.Dataset.from_tensors(tf.ones([4, 2]))
  def total():
    return float(repl.reduce("sum", repl.run(tf.reduce_sum, data)) if view == "local"
                          else repl.run(tf.reduce_sum, data))
  assert total() == 8.0
  with pytest.raises(replicator.EndOfInput, match=re.escape(
      "The input is exhausted: the dataset passed to repl.run has no more global batches.")):
    total()
  assert total() == 8.0  # the next call starts a new epoch


def test_the_end_of_an_input_fn_speaks_of_the_input_fn(repl):
  def input_fn(ctx):
    return tf.data.Dataset.from_tensors(tf.ones([2]))
  repl.run(tf.reduce_sum, input_fn)
  with pytest.raises(replicator.EndOfInput, match=re.escape(
      "The input is exhausted: an input_fn dataset has no more elements.")):
    repl.run(tf.reduce_sum, input_fn)


def test_a_step_returning_an_object_that_is_not_a_tensor_is_refused_naming_it(repl):
  # Was TensorFlow's TypeError "Failed to convert elements of <object object ...> to Tensor".
  with pytest.raises(replicator.ArgumentTypeError, match=r"step_fn returned a value of type object at loss: a "
                     r"step's results are tensors.*Fix: return tensors \(tf.constant\(value\) for a Python value\)"):
    repl.run(lambda: {"loss": object()})
  global_repl = replicator.Replicator(mesh=mesh.Mesh({"batch": 2}, devices=cpus(2)), view="global")
  with pytest.raises(replicator.ArgumentTypeError, match=r"step_fn returned a value of type object at 1"):
    global_repl.run(lambda batch: (tf.reduce_sum(batch), object()), tf.data.Dataset.range(4).batch(2))


def test_inputs_that_are_not_tensors_are_refused_naming_the_replica(repl):
  # Was TensorFlow's ValueError "Attempt to convert a value (None) with an unsupported type".
  with pytest.raises(replicator.ArgumentTypeError, match=r"inputs=...\): replica 0's input at its top level is "
                     r"None, which is not a tensor.*Fix: give every replica a tensor there"):
    repl.run(lambda x: x, inputs=replicator.PerReplica([None, None]))
  with pytest.raises(replicator.ArgumentTypeError, match=r"replica 1's input at x is a value of type object"):
    repl.run(lambda d: d["x"], inputs=replicator.PerReplica([{"x": tf.ones([2])}, {"x": object()}]))


@pytest.mark.parametrize("op", ["max", "min"])
def test_max_of_complex_values_is_refused_with_the_fix(repl, op):
  # Was TensorFlow's TypeError "Value passed to parameter 'input' has DataType complex64 not in list of allowed".
  with pytest.raises(replicator.ArgumentTypeError, match=rf"repl.all_reduce\(op='{op}'\) of a complex64 tensor at .*"
                     rf"{THIS_FILE}:\d+ in <lambda>: {op} is defined on real numbers.*Fix: reduce the parts"):
    repl.run(lambda: repl.all_reduce(tf.complex(tf.ones([2]), tf.ones([2])), op=op))
  summed = repl.run(lambda: repl.all_reduce(tf.complex(tf.ones([2]), tf.ones([2])), op="sum"))
  np.testing.assert_allclose(summed.values[0].numpy(), [2 + 2j, 2 + 2j])  # sum and mean take complex values


def test_replicas_reaching_a_collective_with_other_batch_sizes_at_run_time_name_the_line_and_the_fix(repl):
  # Was: "The step failed (node 'cond/step/replicator_rewrite/0_all_reduce/AddN'): Inputs to operation ... AddN
  # must have the same size and shape", no user line and no fix. Replica 1's dataset is longer: its third batch
  # is full (4 rows) where replica 0's is its last (2 rows).
  def input_fn(ctx):
    return tf.data.Dataset.from_tensor_slices(np.ones((10 + 2 * ctx.replica_id, 3), np.float32)).batch(4)

  def step(x):
    return repl.all_reduce(x)  # a value of the batch's size

  repl.run(step, input_fn)
  repl.run(step, input_fn)
  with pytest.raises(replicator.StepFailedError, match=(
      rf"The step failed at .*{THIS_FILE}:\d+ in step \(op 'all_reduce #0'\): the replicas reached this all_reduce "
      r"with values of different shapes \(shapes \[2,3\] and \[4,3\]\); the collective combines one value a "
      r"replica, of one shape.*Fix: reduce a value of a fixed shape.*drop_remainder=True. No variable was written")):
    repl.run(step, input_fn)
