"""``replicator.split_stages``: a Keras model's layers in a row, cut into stages for ``repl.pipeline``.

A ``keras.Sequential`` (or a functional model whose layers form a chain:
each layer's one input the previous layer's output) is cut between layers
into ``keras.Sequential`` stages that share the model's layers and weights.
Where the cuts go:

* at ``split_points``: the names of the layers that start a new stage
  (torch.distributed.pipelining's ``SplitPoint.BEGINNING``); or
* balanced by the cost model: each layer's forward and backward pass traced
  at its input's shape and priced as the global view's layout search prices a
  step (``rewrite._cost``: a contraction's flops, any other op's bytes, a fixed
  cost an op, on a ``Machine``: ``replicator.calibrate()``'s, or nominal
  rates), then the layers cut into ``stages`` runs whose largest cost is the
  least possible (a linear partition): an embedding-heavy first stage or a
  head-heavy last one gets fewer layers, where cutting by layer count gives
  every stage as many.

Models that are not a chain (residual connections between layers: KerasHub's
backbones) are refused with the reason; cut those by hand into callables.
"""

from __future__ import annotations

import types

import tensorflow as tf

from replicator.core import _errors
from rewrite import _cost
from rewrite.rules import _base

# Rates for ranking layers when no machine is given (a CPU core's order of magnitude; only their ratios matter).
NOMINAL = _cost.Machine(flops_per_second=2e10, bytes_per_second=5e9, op_seconds=5e-6, parallel_devices=1,
                        collective_seconds=5e-5, collective_bytes_per_second=1e9)


def chain_of(model) -> list:
  """The layers of ``model`` in the order they run, each the next one's only input (else an ``ArgumentError``)."""
  import keras  # pylint: disable=import-outside-toplevel  (Keras is imported by whoever has a model)
  layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
  if isinstance(model, keras.Sequential):
    return layers
  previous = None
  for layer in layers:
    nodes = getattr(layer, "_inbound_nodes", None) or []
    inputs = [t for node in nodes for t in node.input_tensors] if nodes else []
    made_by = {getattr(t, "_keras_history", (None,))[0] for t in inputs}
    expected = {previous} if previous is not None else None
    if len(nodes) != 1 or (expected is not None and made_by != expected):
      raise _errors.ArgumentError(
          f"replicator.split_stages: {model.name!r} is not a chain of layers (layer {layer.name!r} takes "
          f"{sorted(getattr(x, 'name', '?') for x in made_by if x is not None) or 'several inputs'}, not only the "
          f"output of {getattr(previous, 'name', 'the input')!r}). Fix: cut it by hand into stages (callables of "
          "one value each, say keras.Sequential blocks or functions) for repl.pipeline.")
    previous = layer
  return layers


def layer_costs(layers, input_shape, dtype=tf.float32, machine: _cost.Machine | None = None) -> list[float]:
  """Each layer's estimated seconds for its forward and backward pass on inputs of ``input_shape`` (the first
  layer's; each next layer's is the previous one's output)."""
  machine = NOMINAL if machine is None else machine
  spec, costs = tf.TensorSpec(input_shape, dtype), []
  for layer in layers:
    def both(x, layer=layer):
      with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True)
      return y, tape.gradient(y, [x] + list(layer.trainable_variables))

    traced = tf.function(both, autograph=False).get_concrete_function(spec)
    graph = traced.graph
    whole = types.SimpleNamespace(layouts={}, decisions={
        op.name: _base.Decision(inputs=[None] * len(op.inputs), outputs=[None] * len(op.outputs))
        for op in graph.get_operations()})
    costs.append(_cost.work(graph, whole, {}).estimate(machine).seconds)
    out = traced.structured_outputs[0]
    spec = tf.TensorSpec(out.shape, out.dtype)
  return costs


def balanced_cuts(costs, stages: int) -> list[int]:
  """Where ``stages`` consecutive runs of ``costs`` start (the first at 0) so that the largest run's sum is least."""
  n = len(costs)
  prefix = [0.0]
  for c in costs:
    prefix.append(prefix[-1] + c)
  inf = float("inf")
  # best[k][i]: the least largest run cutting the first i costs into k runs; start[k][i]: where the last run starts
  best = [[inf] * (n + 1) for _ in range(stages + 1)]
  start = [[0] * (n + 1) for _ in range(stages + 1)]
  best[0][0] = 0.0
  for k in range(1, stages + 1):
    for i in range(k, n + 1):
      for j in range(k - 1, i):
        cost = max(best[k - 1][j], prefix[i] - prefix[j])
        if cost < best[k][i]:
          best[k][i], start[k][i] = cost, j
  cuts, i = [], n
  for k in range(stages, 0, -1):
    i = start[k][i]
    cuts.append(i)
  return cuts[::-1]


def split_stages(model, stages: int | None = None, *, split_points=None, input_shape=None,
                 machine: _cost.Machine | None = None) -> list:
  """``model``'s layers cut into ``keras.Sequential`` stages for ``repl.pipeline`` (see the module).

  Args:
    model: a ``keras.Sequential``, or a functional model whose layers form a chain.
    stages: how many stages, balanced by the cost model (``input_shape`` needed), unless ``split_points``.
    split_points: names of the layers that begin a stage (the first stage begins with the first layer).
    input_shape: the shape of a microbatch of the model's inputs, batch dimension included, for the cost model.
    machine: the rates to price the layers with (``replicator.calibrate()``); default: nominal rates.

  Returns:
    The stages, in order: each a ``keras.Sequential`` of the model's own layers (the same weights), built.
  """
  import keras  # pylint: disable=import-outside-toplevel
  layers = chain_of(model)
  if split_points is not None:
    names = [layer.name for layer in layers]
    unknown = [p for p in split_points if p not in names]
    if unknown:
      raise _errors.ArgumentError(f"replicator.split_stages(split_points={list(split_points)!r}): no layer of "
                                  f"{model.name!r} is named {unknown}; its layers: {names}.")
    cuts = sorted({0} | {names.index(p) for p in split_points})
  else:
    if not isinstance(stages, int) or stages < 1 or stages > len(layers):
      raise _errors.ArgumentError(f"replicator.split_stages(stages={stages!r}): expected an int from 1 to the "
                                  f"model's {len(layers)} layers, or split_points=[layer names].")
    if input_shape is None:
      raise _errors.ArgumentError("replicator.split_stages(stages=...) balances the stages by each layer's cost at "
                                  "its input's shape: pass input_shape=(microbatch rows, ...) (or split_points=).")
    cuts = balanced_cuts(layer_costs(layers, input_shape, machine=machine), stages)
  pieces = []
  shape = None if input_shape is None else tf.TensorShape(input_shape)
  for a, b in zip(cuts, cuts[1:] + [len(layers)]):
    stage = keras.Sequential(layers[a:b], name=f"stage_{len(pieces)}")
    if shape is not None:
      stage.build(shape)
      shape = stage.compute_output_shape(shape)
    pieces.append(stage)
  return pieces
