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


def test_the_gradient_arriving_is_found_past_readers_that_read_only_forward_values_and_constants():
  # A backward op slicing a forward value with constants (a blockwise attention's backward pass takes a block of
  # its keys so) has no backward input: the gradient arriving is found where its slice meets the gradient, taken
  # from before the slice in the graph's order (a reshape of it made after is followed up to it).
  graph = tf.Graph()
  with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [4, 4], name="x")
    begin, size = tf.constant([0, 0], name="begin"), tf.constant([4, 2], name="size")
    y = tf.nn.relu(x, name="block/y")
    dy = tf.identity(tf.reduce_sum(y) * tf.ones([8]), name="gradient_tape/dy")
    piece = tf.slice(y, begin, size, name="gradient_tape/piece")
    shaped = tf.reshape(dy, [4, 2], name="gradient_tape/shaped")
    tf.multiply(piece, shaped, name="gradient_tape/product")
  flow = _backward.Flow(graph.as_graph_def())
  assert piece.op.name in flow.backward and "begin" not in flow.backward
  assert flow.triggers([piece.op.name]) == ["gradient_tape/dy"]
  assert not set(flow.triggers([piece.op.name])) & flow.after([piece.op.name])
