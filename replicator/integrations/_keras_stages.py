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
  every stage as many; or
* balanced by measured costs (``costs="measured"``): each layer's forward and
  backward pass timed on one device at its input's shape, less an empty
  pass's (the fixed cost every stage pays once, which moves no cut), then cut
  the same way; or by costs the caller gives (``costs=[seconds a layer]``).

Models that are not a chain (residual connections between layers: KerasHub's
backbones) are refused with the reason; cut those by hand into callables.
"""

from __future__ import annotations

import math
import time
import types

import numpy as np
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


def unsplit_work(graph: tf.Graph) -> _cost.Work:
  """What one device does running ``graph`` with every value whole (no layout), as ``rewrite._cost`` prices it."""
  whole = types.SimpleNamespace(layouts={}, decisions={
      op.name: _base.Decision(inputs=[None] * len(op.inputs), outputs=[None] * len(op.outputs))
      for op in graph.get_operations()})
  return _cost.work(graph, whole, {})


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
    costs.append(unsplit_work(traced.graph).estimate(machine).seconds)
    out = traced.structured_outputs[0]
    spec = tf.TensorSpec(out.shape, out.dtype)
  return costs


_clock = time.perf_counter  # (tests replace it with a fake clock)
EMPTY_CALLS = 3  # the empty pass's calls a round (its median is taken from every layer's)


def _passes(layer, x, repeats: int):
  """A function running ``repeats`` forward and backward passes of ``layer`` (None: none, an empty pass) on ``x``,
  each after the previous one's gradients (one at a time), and waiting for them."""
  floating = x.dtype.is_floating

  @tf.function(autograph=False)
  def passes():
    total = tf.zeros([])
    for _ in range(repeats):
      if floating:  # (a value of the previous pass, not a constant: no gradient of the pass is folded away)
        h = x + tf.cast(0.0 * total, x.dtype)
      else:
        with tf.control_dependencies([total]):
          h = tf.identity(x)
      with tf.GradientTape() as tape:
        if floating:
          tape.watch(h)
        y = h if layer is None else layer(h, training=True)
        y = tf.cast(y, tf.float32) if floating or layer is None else y
      sources = ([h] if floating else []) + ([] if layer is None else list(layer.trainable_variables))
      grads = tape.gradient(y, sources, unconnected_gradients=tf.UnconnectedGradients.ZERO) if sources else []
      # (the output summed too: else a last layer's forward pass is pruned where its gradients do not need it)
      total = tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32)) for g in grads] + [tf.reduce_sum(tf.cast(y, tf.float32))])
    return total

  return lambda: passes().numpy()


def _example(input_shape, dtype):
  """Inputs of ``input_shape``: uniform in [0, 1) if floating (indices 0 once cast, for an embedding), else 0."""
  dtype = tf.as_dtype(dtype)
  if dtype.is_floating:
    return tf.random.stateless_uniform(input_shape, seed=(0, 0), dtype=dtype)
  return tf.zeros(input_shape, dtype)


def measured_layer_costs(layers, input_shape, dtype=tf.float32, rounds: int = 20, warmup: int = 2,
                         repeats: int = 4) -> list[float]:
  """Each layer's measured seconds for its forward and backward pass on inputs of ``input_shape`` (the first
  layer's; each next layer's is the previous one's output), on the current device.

  Each layer, and an empty pass (the input's gradient alone), is a ``tf.function`` of ``repeats`` passes in a
  chain (each pass's input waits for the previous pass's gradients); ``warmup`` untimed rounds, then ``rounds``
  timed ones, each calling every layer's function once and the empty one ``EMPTY_CALLS`` times, in a shuffled
  order (the machine's drift shared by all). A layer's cost is its median call over ``repeats``, less the empty
  pass's (a pass's fixed cost: the call, the tape, the gradients' sums; every stage pays it once, so it moves no
  cut, where counting it a layer would price a stage of many layers high), at least 0. Bounded: ``len(layers) +
  1`` traces and ``(len(layers) + EMPTY_CALLS) * (warmup + rounds)`` calls of ``repeats`` passes (the defaults:
  22 calls of 4 passes a layer; about 1.5 s for 14 Dense layers on 32 rows of a shared 2-core CPU).

  Args:
    layers: the chain's layers, in order (``chain_of``).
    input_shape: the first layer's input's shape, batch dimension included (a microbatch's).
    dtype: the inputs' dtype (floating: uniform in [0, 1); else zeros).
    rounds: timed rounds.
    warmup: untimed rounds first (the first call traces).
    repeats: passes a call.

  Returns:
    Seconds a layer, in order (a pass's fixed cost taken out).
  """
  x = _example(input_shape, dtype)
  calls = [_passes(None, x, repeats)]
  for layer in layers:
    calls.append(_passes(layer, x, repeats))
    x = layer(x, training=True)
  slots = [0] * EMPTY_CALLS + list(range(1, len(calls)))
  times = [[] for _ in calls]
  order = np.random.default_rng(0)
  for r in range(warmup + rounds):
    for k in order.permutation(len(slots)):
      i = slots[k]
      start = _clock()
      calls[i]()
      if r >= warmup:
        times[i].append(_clock() - start)
  medians = [float(np.median(t)) / repeats for t in times]
  return [max(0.0, m - medians[0]) for m in medians[1:]]


def _given_costs(costs, layers, model) -> list[float]:
  """``costs=[...]`` checked: one finite number of seconds at least 0 a layer, not all 0."""
  names = [layer.name for layer in layers]
  fix = (f"Fix: costs=[seconds a layer] in the order of its layers {names}, or costs='estimated' (the cost "
         "model) or costs='measured' (timed here).")
  try:
    values = [float(c) for c in costs]
  except (TypeError, ValueError):
    raise _errors.ArgumentError(f"replicator.split_stages(costs={costs!r}): expected 'estimated', 'measured' or a "
                                f"list of {len(layers)} numbers (seconds, one a layer of {model.name!r}); found "
                                f"{type(costs).__name__}. {fix}") from None
  if len(values) != len(layers):
    raise _errors.ArgumentError(f"replicator.split_stages(costs=...): expected {len(layers)} costs, one a layer of "
                                f"{model.name!r}; found {len(values)}. {fix}")
  bad = [(names[k], c) for k, c in enumerate(values) if not math.isfinite(c) or c < 0]
  if bad or not any(values):
    raise _errors.ArgumentError(f"replicator.split_stages(costs=...): expected finite seconds at least 0, not all "
                                f"0; found {bad or 'all 0'}. {fix}")
  return values


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
                 machine: _cost.Machine | None = None, costs="estimated") -> list:
  """``model``'s layers cut into ``keras.Sequential`` stages for ``repl.pipeline`` (see the module).

  Args:
    model: a ``keras.Sequential``, or a functional model whose layers form a chain.
    stages: how many stages, balanced by the layers' costs, unless ``split_points``.
    split_points: names of the layers that begin a stage (the first stage begins with the first layer).
    input_shape: the shape of a microbatch of the model's inputs, batch dimension included: the layers' costs
      are taken at it (needed for ``costs="estimated"`` and ``"measured"``), and the stages built with it.
    machine: the rates to price the layers with (``replicator.calibrate()``), for ``costs="estimated"``;
      default: nominal rates.
    costs: what ``stages`` are balanced by: ``"estimated"`` (the default: the cost model, ``rewrite._cost``, no
      run); ``"measured"`` (each layer's forward and backward pass timed on the current device,
      ``measured_layer_costs``: ``len(layers) + 1`` traces and 22 calls of 4 passes a layer at its input's shape,
      the empty pass's 66; a pass's fixed cost taken out; taken under the machine's load of the moment); or a
      list of numbers, one a layer in order (seconds, or any unit: their ratios decide).

  Returns:
    The stages, in order: each a ``keras.Sequential`` of the model's own layers (the same weights), built.
  """
  import keras  # pylint: disable=import-outside-toplevel
  layers = chain_of(model)
  measure = isinstance(costs, str) and costs == "measured"
  if not (isinstance(costs, str) and costs in ("estimated", "measured")) and (
      isinstance(costs, (str, bytes)) or not hasattr(costs, "__len__")):
    raise _errors.ArgumentError(f"replicator.split_stages(costs={costs!r}): expected 'estimated' (the cost model), "
                                "'measured' (each layer timed here) or a list of seconds, one a layer. Fix: "
                                "costs='measured', say.")
  if split_points is not None and not (isinstance(costs, str) and costs == "estimated"):
    raise _errors.ArgumentError(f"replicator.split_stages(split_points=..., costs={costs!r}): costs balance "
                                "stages=; split_points= says where the cuts go. Fix: one of the two.")
  if measure and machine is not None:
    raise _errors.ArgumentError("replicator.split_stages(costs='measured', machine=...): a machine's rates price the "
                                "estimates; measured costs are timed. Fix: drop machine= (or costs='estimated').")
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
    if isinstance(costs, str):
      if input_shape is None:
        raise _errors.ArgumentError("replicator.split_stages(stages=...) balances the stages by each layer's cost "
                                    "at its input's shape: pass input_shape=(microbatch rows, ...) (or "
                                    "split_points=, or costs=[seconds a layer]).")
      found = (measured_layer_costs(layers, input_shape) if measure
               else layer_costs(layers, input_shape, machine=machine))
    else:
      found = _given_costs(costs, layers, model)
    cuts = balanced_cuts(found, stages)
  pieces = []
  shape = None if input_shape is None else tf.TensorShape(input_shape)
  for a, b in zip(cuts, cuts[1:] + [len(layers)]):
    stage = keras.Sequential(layers[a:b], name=f"stage_{len(pieces)}")
    if shape is not None:
      stage.build(shape)
      shape = stage.compute_output_shape(shape)
    pieces.append(stage)
  return pieces
