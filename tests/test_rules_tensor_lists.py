"""The global view's rules for ``TensorList`` ops (``tf.TensorArray``): a list holds pieces of its elements."""

import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus

import mesh
import replicator
from rewrite import _partition
from rewrite.rules import _base
from rewrite.rules import _tensor_lists

BATCH = ("batch",)


def _repl():
  return replicator.Replicator(mesh=mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4)), batch_axes=BATCH,
                               view="global", strict=True)


def _equal_to_one_device(fn, x):
  """``fn(x)``'s value and gradient in the global view (strict: nothing falls back) and on one device: equal."""

  def step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = fn(x)
      loss = tf.reduce_sum(y * y)
    return y, tape.gradient(loss, x)

  expected = tf.function(step)(tf.constant(x))
  repl = _repl()
  dataset = tf.data.Dataset.from_tensors(x)
  got = repl.run(step, dataset)
  for what, a, b in zip(("value", "gradient"), got, expected):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6, err_msg=what)
  return repl.explain(step, dataset)


def _x():
  return np.random.default_rng(0).normal(size=(8, 4, 3)).astype("float32")


def test_a_tensor_array_written_from_split_values_is_stacked_split():
  # TensorListReserve (made with the pieces' shape, as its writes want), SetItem, Stack; the gradient reads the
  # items back (GetItem) from a list made from the stacked gradient (FromTensor).
  def fn(x):
    array = tf.TensorArray(tf.float32, size=4, element_shape=[8, 3])
    for t in range(4):
      array = array.write(t, tf.tanh(x[:, t] * float(t + 1)))
    return tf.transpose(array.stack(), [1, 0, 2])

  plan = _equal_to_one_device(fn, _x())
  assert not plan.fallbacks and not [r for r in plan.relayouts if not r.free and r.op_type != "return"]


def test_a_gather_from_an_unstacked_array_and_its_gradient_keep_the_split():
  # TensorListFromTensor, TensorListGather; the gradient scatters into a list made with the gathered list's
  # TensorListElementShape (global, computed in the step: divided on each device).
  def fn(x):
    array = tf.TensorArray(tf.float32, size=4, element_shape=[8, 3]).unstack(tf.transpose(x, [1, 0, 2]))
    return array.gather([3, 1]) * 2.0

  plan = _equal_to_one_device(fn, _x())
  assert not plan.fallbacks


@pytest.mark.parametrize("made", ["array", "new_list"])
def test_rows_scattered_into_a_list_keep_the_split(made):
  # TensorListScatterIntoExistingList (TensorArray.scatter) or TensorListScatterV2 (a new list): the rows of the
  # time-major sequence in another order; TensorListStack. The gradient gathers them back (TensorListGather).
  def fn(x):
    rows = tf.transpose(x, [1, 0, 2]) * 3.0
    if made == "array":
      return tf.TensorArray(tf.float32, size=4, element_shape=[8, 3]).scatter([2, 0, 3, 1], rows).stack()
    handle = tf.raw_ops.TensorListScatterV2(tensor=rows, indices=[2, 0, 3, 1], element_shape=[8, 3], num_elements=4)
    return tf.raw_ops.TensorListStack(input_handle=handle, element_shape=[8, 3], element_dtype=tf.float32,
                                      num_elements=4)

  plan = _equal_to_one_device(fn, _x())
  assert not plan.fallbacks


def test_a_list_holding_nothing_known_takes_the_pieces_its_consumers_want():
  graph = tf.function(lambda x: tf.raw_ops.TensorListSetItem(
      input_handle=tf.raw_ops.TensorListReserve(element_shape=[8, 3], num_elements=2, element_dtype=tf.float32),
      index=0, item=x), autograph=False).get_concrete_function(tf.TensorSpec([8, 3])).graph
  m = mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(4))
  part = _partition.propagate(graph, m, {graph.inputs[0].name: (BATCH, ())})
  (reserve,) = [op for op in graph.get_operations() if op.type == "TensorListReserve"]
  decision = part.decisions[reserve.name]
  assert decision.outputs == [_tensor_lists.holding((BATCH, ()))]
  assert decision.consts[0].tolist() == [4, 3]  # the pieces' shape


@pytest.mark.parametrize("layout,expected", [(_base.Contents(((BATCH, ()),)), (BATCH, ())),
                                             (_base.Contents(()), None), (None, None), (((),), None)])
def test_a_list_s_element_layout(layout, expected):
  assert _tensor_lists.element(layout) == expected
