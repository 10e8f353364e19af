"""rewrite._backward: a step's backward nodes, and the nodes that precede a backward reader."""

import tensorflow as tf

from rewrite import _backward


def _graph_def():
  @tf.function
  def step(x, w):
    with tf.GradientTape() as tape:
      tape.watch(w)
      with tf.name_scope("block"):
        h = tf.nn.relu(tf.matmul(x, w))
      loss = tf.reduce_sum(h * h)
    return tape.gradient(loss, w)

  return step.get_concrete_function(tf.zeros([4, 3]), tf.zeros([3, 2])).graph.as_graph_def()


def test_backward_nodes_are_under_the_tape_or_read_its_tensors():
  flow = _backward.Flow(_graph_def())
  assert "block/Relu" not in flow.backward and "block/MatMul" not in flow.backward
  assert "gradient_tape/block/ReluGrad" in flow.backward
  assert all(n in flow.backward for n in flow.nodes if n.startswith("gradient_tape/"))


def test_triggers_are_the_backward_inputs_of_the_readers_that_do_not_depend_on_them():
  flow = _backward.Flow(_graph_def())
  # ReluGrad reads the gradient arriving at the block and the saved relu: the first precedes it, in the backward
  # pass; the relu is forward.
  (relu_grad,) = [n for n in flow.data_readers("block/Relu") if n in flow.backward and "ReluGrad" in n]
  triggers = flow.triggers([relu_grad])
  assert triggers and all(t in flow.backward for t in triggers)
  assert "block/Relu" not in triggers and relu_grad not in triggers
  assert not set(triggers) & flow.after([relu_grad])
  # The gradient's last op precedes nothing of the backward pass: nothing depends on it, nothing triggers it.
  assert flow.triggers([t for t in triggers]) != triggers or not flow.triggers(triggers)


def test_rewire_keeps_the_readers():
  flow = _backward.Flow(_graph_def())
  node = flow.nodes["block/Relu"]
  (source,) = list(node.input)
  flow.rewire("block/Relu", [source, "^x"])
  assert "block/Relu" in flow.readers["x"] and list(flow.nodes["block/Relu"].input) == [source, "^x"]
