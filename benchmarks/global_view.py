"""The global view (issue 16, "Performance"): step time against the local view and DTensor, and build cost.

Run by hand (never in CI):

  python -m benchmarks.global_view                       # ~6 min on 2 cores
  python -m benchmarks.global_view --diagnose --json benchmarks/results/global_view.json   # ~8.5 min
  python -m benchmarks.global_view --quick               # ~3.5 min: 20 rounds, one build each
  python -m benchmarks.global_view --parts mlp,transformer   # step times only, ~1.5 min

The process configures 4 logical CPUs (``replicator.virtual_cpus(4)``) before
TensorFlow runs an op; every in-process part uses them.

``mlp``: a wide MLP, 784-4096-10, global batch 256, on the 2x2 mesh
``{"batch": 2, "model": 2}``: the hidden units split over "model" (``w1``
by columns, ``b1``, ``w2`` by rows), the batch over "batch". Plain-TF model
(``tf.Variable`` ``w1 [784,4096]``, ``b1``, ``w2 [4096,10]``, ``b2``; relu;
sparse softmax cross-entropy, mean) and plain SGD (``v.assign_sub(lr * g)``)
wherever the step writes the update itself, from the same initial weights on
the same global batch:

* ``one device``: the step in a ``tf.function`` on CPU:0, reading the batch
  from a ``tf.data`` iterator inside the function;
* ``global view``: ``Replicator(mesh=m, layouts=LayoutMap({w1: (None,
  "model"), b1: ("model",), w2: ("model", None)}), batch_axes=("batch",),
  view="global")``, the variables made in ``repl.context()``, the one-device
  step unchanged, ``repl.run(step_fn, dataset)`` on a dataset of the global
  batch (the global view takes each global batch from the dataset in Python);
* ``local view, hand-written SGD``: the README's local-view step: each device
  sees its piece, ``repl.all_reduce(h @ w2, axis="model")``, and the same
  ``assign_sub`` update after ``repl.all_reduce(g, "mean", axis="batch")``
  (the pieces of ``w1``, ``b1``, ``w2`` also divided by the "model" size: their
  gradient through the all-reduce is the sum of the two "model" devices'
  equal losses);
* ``local view, wrap_optimizer(SGD)``: the README's spelling, the same step
  with ``repl.wrap_optimizer(keras.optimizers.SGD(lr))`` (the library's
  defaults: gradients bucketed, the sharded update on CPUs);
* ``DTensor``: ``tf.experimental.dtensor`` on the same 4 logical CPUs
  (``create_mesh([("batch", 2), ("model", 2)])``), ``DVariable``\\ s with the
  same layouts, the one-device step in a ``tf.function`` on the batch packed
  once with the batch layout (no input pipeline per step).
  ``dtensor.initialize_accelerator_system`` is not called: for CPUs the logical
  devices are all DTensor needs, and it refuses to run once TensorFlow is
  initialised.

Before timing, every configuration runs 3 steps and its losses and parameters
are compared with the one-device step (must agree within 1e-4). Then
interleaved rounds (``_timing.interleaved``, shuffled order), medians, IQRs
and the round-by-round ratios global/local and global/DTensor (targets: <= 1.10
and <= 0.8).

``transformer``: the one-block Keras 3 transformer of
``tests/test_global_transformer.py`` (Embedding, causal MultiHeadAttention,
LayerNormalization, GELU feed-forward, seeded Dropout) at benchmark sizes,
Adam, the one-device step unchanged: on one device, in the global view on 2x2
with heads and feed-forward over "model" (Megatron), in the global view
data-parallel on ``{"batch": 4}``, and in the local view data-parallel on 4
devices (``wrap_optimizer(Adam)``; its dropout masks are drawn per replica, so
its losses are not compared). Issue 16's transformer target pairs two more
configurations, both of the model **without dropout** (``_transformer(0)``:
the Dropout layer is the identity; same seed, same initial weights, checked):

* ``global view 2x2 megatron, no dropout``: as the Megatron one above, with
  ``Replicator(update="replicated")`` (Adam on every device, as the twin; the
  other global-view configurations take the default, on CPUs the sharded
  update: each variable's Adam on one device of its "batch" group);
* ``local view 2x2 megatron, hand-written`` (``_megatron_local``): the same
  model written by hand in the local view on the same mesh and layouts, the
  variables (``tf.Variable``) named by the Keras paths (``MEGATRON`` splits them)
  and initialised from the Keras model's weights: per device, plain TF ops on
  its pieces (the embedding lookup, its two heads' causal attention as Keras
  computes it, ``repl.all_reduce(..., axis="model")`` after the attention
  output projection and after ``ff_out``, LayerNormalization with epsilon
  1e-3, exact GELU as Keras's ``activation="gelu"``, the head, sparse softmax
  cross-entropy mean), then the gradients reduced by hand (pieces: mean over
  "batch" divided by the "model" size; the replicated variables upstream of
  an all-reduce, ``ln1`` and the attention output bias: mean over both axes,
  the rest over "batch"; the embedding's rows meaned over "model", then
  summed densely with their squares over "batch", as Keras's Adam treats
  them) and Keras 3's Adam written out on every device's pieces (as its
  global-view pair does). It draws no dropout: the
  global view draws exactly each device's piece of the global mask, which
  plain TF ops on the pieces cannot do without the library's counter
  arithmetic, so the pair compares the model without it.

Both are checked against ``one device, no dropout`` (losses over 3 steps and
every parameter within 1e-4; that configuration is not timed) and ``repl.explain``
counts their collectives and the step graph's nodes. The ratio
"megatron global / megatron local (hand-written)" (target <= 1.10) is of
these two; "megatron no dropout / megatron" shows what dropout costs.

``build``: the first ``repl.run`` of a data-parallel step of
``keras.applications.MobileNetV2(input_shape=(96, 96, 3), classes=10,
weights=None)`` (Adam, ``SparseCategoricalCrossentropy``, global batch 32) at 4
devices: global view (``mesh.Mesh({"batch": 4})``, plain Adam) against local
view (``wrap_optimizer(Adam)``) against one device (a ``tf.function``'s first
call). Each build runs in a fresh subprocess (``--child``), the configurations
alternating; the model and the optimizer's slots are made first (``setup``).
The first call is split into phases by wrapping library internals with timers
in the subprocess only (a measurement, nothing changes): global view: trace,
``rewrite._partition.propagate``, ``rewrite._expansion.expand`` (and the
``tf.function`` it runs in), ``rewrite.plan``, ``rewrite.apply``, the report,
the import of the rewritten ``GraphDef`` into a ``tf.function``, and its first
execution; local view: trace of every replica, plan, rewrite (``rewrite.apply``
and the graph clean-ups before it), import, first execution. "First execution"
is the eager call of the concrete function (``ConcreteFunction._call_flat``):
TensorFlow's graph optimisation (Grappler) and the kernels' creation happen
there, before the step's arithmetic. ``--diagnose`` adds one build each of the
local view with ``wrap_optimizer(update="replicated")`` (every replica runs
Adam, as the global view does) and of both views with Grappler off
(``tf.config.optimizer.set_experimental_options({"disable_meta_optimizer":
True})``), to attribute the difference. Each record also counts the step
graph's nodes by op type.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import replicator  # noqa: E402

DEVICES = 4
PARTS = ("mlp", "transformer", "build")
CHECK_STEPS = 3
TOLERANCE = 1e-4

# The wide MLP.
INPUTS, HIDDEN, CLASSES, MLP_BATCH, LR = 784, 4096, 10, 256, 0.1
ONE, GLOBAL, LOCAL, LOCAL_WRAPPED, DTENSOR = ("one device", "global view", "local view, hand-written SGD",
                                              "local view, wrap_optimizer(SGD)", "DTensor")
MLP_CONFIGS = (ONE, GLOBAL, LOCAL, LOCAL_WRAPPED, DTENSOR)
MLP_LAYOUTS = {r"w1$": (None, "model"), r"b1$": ("model",), r"w2$": ("model", None)}
DTENSOR_LAYOUTS = {"w1": ("unsharded", "model"), "b1": ("model",), "w2": ("model", "unsharded"),
                   "b2": ("unsharded",)}

# The transformer (tests/test_global_transformer.py's architecture, benchmark sizes).
VOCAB, DIM, HEADS, TIME, TF_BATCH = 256, 128, 4, 64, 32
MEGATRON = {r"attn/(query|key|value)/kernel$": (None, "model", None), r"attn/(query|key|value)/bias$": ("model", None),
            r"attn/attention_output/kernel$": ("model", None, None), r"ff_in/kernel$": (None, "model"),
            r"ff_in/bias$": ("model",), r"ff_out/kernel$": ("model", None)}
TF_ONE, TF_MEGATRON, TF_DATA, TF_LOCAL = ("one device", "global view 2x2 megatron", "global view 4x1 data",
                                          "local view 4 data, wrap_optimizer(Adam)")
# The pair of issue 16's target: the model without dropout (the twin draws none), global view and hand-written.
TF_ONE_NODROP, TF_MEGATRON_NODROP, TF_TWIN = ("one device, no dropout", "global view 2x2 megatron, no dropout",
                                              "local view 2x2 megatron, hand-written")
DROPOUT, ADAM_LR = 0.2, 1e-3
# Replicated dense variables whose local-view gradient differs between the two "model" devices (see
# _megatron_local; the embedding's, also such, is reduced as rows there).
ACROSS_MODEL = (r"^ln1/", r"^attn/attention_output/bias$")

# The build of MobileNetV2.
LOCAL_BUILD, GRAPPLER_OFF, REPLICATED = "local view", "Grappler off", "update=replicated"
BUILDS = (GLOBAL, LOCAL_BUILD, ONE)
LOCAL_REPLICATED = f"{LOCAL_BUILD}, {REPLICATED}"
DIAGNOSTIC_BUILDS = (LOCAL_REPLICATED, f"{GLOBAL}, {GRAPPLER_OFF}", f"{LOCAL_BUILD}, {GRAPPLER_OFF}")
IMAGE, NET_CLASSES, NET_BATCH = 96, 10, 32
RESULT = "RESULT "


def log(message: str) -> None:
  print(message, flush=True)


def cpus(n: int) -> list[str]:
  """The names of the first ``n`` logical CPU devices (the benchmarks' configurations place their steps on them)."""
  return [f"/device:CPU:{i}" for i in range(n)]


# -- the wide MLP -------------------------------------------------------------------------------------------------


def _mlp_data():
  import numpy as np
  rng = np.random.default_rng(0)
  limit1, limit2 = np.sqrt(6 / (INPUTS + HIDDEN)), np.sqrt(6 / (HIDDEN + CLASSES))
  weights = dict(w1=rng.uniform(-limit1, limit1, [INPUTS, HIDDEN]).astype("float32"),
                 b1=rng.uniform(-0.1, 0.1, [HIDDEN]).astype("float32"),
                 w2=rng.uniform(-limit2, limit2, [HIDDEN, CLASSES]).astype("float32"),
                 b2=rng.uniform(-0.1, 0.1, [CLASSES]).astype("float32"))
  x = rng.normal(size=[MLP_BATCH, INPUTS]).astype("float32")
  y = rng.integers(0, CLASSES, size=[MLP_BATCH]).astype("int32")
  return weights, x, y


def _mlp_loss(tf, logits, y):
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))


def _variables(tf, weights):
  return [tf.Variable(weights[name], name=name) for name in ("w1", "b1", "w2", "b2")]


def _one_device_step(tf, variables):
  w1, b1, w2, b2 = variables

  def step_fn(batch):  # the single-device step: also the global view's and DTensor's
    x, y = batch
    with tf.GradientTape() as tape:
      loss = _mlp_loss(tf, tf.nn.relu(x @ w1 + b1) @ w2 + b2, y)
    grads = tape.gradient(loss, variables)
    for v, g in zip(variables, grads):
      v.assign_sub(LR * g)
    return loss

  return step_fn


class _Mlp:
  """One configuration of the wide MLP: ``step()`` runs one step and returns its loss; ``params()`` global values."""

  def __init__(self, name, step, params, note="", explain=None):
    self.name, self.step, self.params, self.note, self.explain = name, step, params, note, explain


def _mlp_one(weights, x, y) -> _Mlp:
  import tensorflow as tf
  with tf.device("/device:CPU:0"):
    variables = _variables(tf, weights)
    iterator = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
  body = _one_device_step(tf, variables)
  fn = tf.function(lambda it: body(next(it)))
  return _Mlp(ONE, lambda: float(fn(iterator)), lambda: [v.numpy() for v in variables])


def _mlp_global(weights, x, y) -> _Mlp:
  import tensorflow as tf

  import mesh
  m = mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(DEVICES))
  repl = replicator.Replicator(mesh=m, layouts=mesh.LayoutMap(MLP_LAYOUTS), batch_axes=("batch",), view="global")
  with repl.context():
    variables = _variables(tf, weights)
  step_fn = _one_device_step(tf, variables)
  dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
  return _Mlp(GLOBAL, lambda: float(repl.run(step_fn, dataset)), lambda: [v.numpy() for v in variables],
              note="each call takes the global batch from the dataset in Python",
              explain=lambda: repl.explain(step_fn, dataset))


def _mlp_local(weights, x, y, wrapped: bool) -> _Mlp:
  import keras
  import numpy as np
  import tensorflow as tf

  import mesh
  m = mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(DEVICES))
  repl = replicator.Replicator(mesh=m, batch_axes=("batch",))
  with repl.context(layouts=mesh.LayoutMap(MLP_LAYOUTS)):
    variables = _variables(tf, weights)
    optimizer = repl.wrap_optimizer(keras.optimizers.SGD(LR)) if wrapped else None
  w1, b1, w2, b2 = variables
  model_size = m.shape["model"]

  def step_fn(batch):  # device (b, k): batch shard b, hidden slice k
    x, y = batch
    with tf.GradientTape() as tape:
      h = tf.nn.relu(x @ w1 + b1)
      logits = repl.all_reduce(h @ w2, axis="model") + b2  # partial products summed over "model"
      loss = _mlp_loss(tf, logits, y)
    grads = tape.gradient(loss, variables)
    if wrapped:
      optimizer.apply_gradients(zip(grads, variables))
      return loss
    grads = repl.all_reduce(grads, "mean", axis="batch")
    # Through the all-reduce over "model", a piece's gradient is that of the sum of the "model" group's
    # (equal) losses: the mean's is 1/model_size of it.
    grads = [g / model_size for g in grads[:3]] + grads[3:]
    for v, g in zip(variables, grads):
      v.assign_sub(LR * g)
    return loss

  dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
  return _Mlp(LOCAL_WRAPPED if wrapped else LOCAL,
              lambda: float(np.mean([t.numpy() for t in repl.run(step_fn, dataset)])),
              lambda: [v.numpy() for v in variables],
              note=f"wrap_optimizer(update={optimizer.update!r})" if wrapped else "all_reduce(g, 'mean', axis='batch')",
              explain=lambda: repl.explain(step_fn, dataset))


def _mlp_dtensor(weights, x, y) -> _Mlp:
  import numpy as np
  import tensorflow as tf
  from tensorflow.experimental import dtensor

  dmesh = dtensor.create_mesh([("batch", 2), ("model", 2)], devices=[f"CPU:{i}" for i in range(DEVICES)])

  def put(value, spec):
    whole = dtensor.copy_to_mesh(tf.constant(value), dtensor.Layout.replicated(dmesh, np.ndim(value)))
    return dtensor.relayout(whole, dtensor.Layout(list(spec), dmesh))

  variables = [dtensor.DVariable(put(weights[name], DTENSOR_LAYOUTS[name]), name=name)
               for name in ("w1", "b1", "w2", "b2")]
  batch = (put(x, ("batch", "unsharded")), put(y, ("batch",)))
  fn = tf.function(_one_device_step(tf, variables))

  def whole(v):
    value = dtensor.relayout(v.read_value(), dtensor.Layout.replicated(dmesh, v.shape.rank))
    return dtensor.unpack(value)[0].numpy()

  return _Mlp(DTENSOR, lambda: float(dtensor.unpack(fn(batch))[0]), lambda: [whole(v) for v in variables],
              note="the global batch packed once, batch layout")


def _communication(plan) -> dict:
  """A plan's (or a ``PartitionReport``'s) collectives by kind and axes, and its bytes per step."""
  counts = collections.Counter(f"{c.kind} over {'+'.join(c.axes)}" for c in plan.collectives)
  return dict(collectives=", ".join(f"{n} {what}" for what, n in sorted(counts.items())),
              bytes_per_step=int(plan.bytes_per_step))


def mlp(rounds: int, budget_seconds: float) -> dict:
  """The wide MLP on the 2x2 mesh: losses and parameters checked, then interleaved step times."""
  import numpy as np

  from benchmarks import _timing
  weights, x, y = _mlp_data()
  makers = {ONE: _mlp_one, GLOBAL: _mlp_global, LOCAL: functools.partial(_mlp_local, wrapped=False),
            LOCAL_WRAPPED: functools.partial(_mlp_local, wrapped=True), DTENSOR: _mlp_dtensor}
  configs, losses, params, build_s = {}, {}, {}, {}
  for name in MLP_CONFIGS:
    configs[name] = makers[name](weights, x, y)
    t0 = time.perf_counter()
    losses[name] = [configs[name].step()]
    build_s[name] = time.perf_counter() - t0
    losses[name] += [configs[name].step() for _ in range(CHECK_STEPS - 1)]
    params[name] = configs[name].params()
  loss_diff = {name: float(np.max(np.abs(np.subtract(losses[name], losses[ONE])))) for name in MLP_CONFIGS}
  param_diff = {name: float(max(np.max(np.abs(a - b)) for a, b in zip(params[name], params[ONE])))
                for name in MLP_CONFIGS}
  for name in MLP_CONFIGS:
    log(f"  {name:<34} losses {['%.6f' % v for v in losses[name]]}  max|loss - one device| {loss_diff[name]:.1e}  "
        f"max|param - one device| {param_diff[name]:.1e}  first call {build_s[name]:.2f} s  {configs[name].note}")
  communication = {name: _communication(c.explain()) for name, c in configs.items() if c.explain}
  for name, comm in communication.items():
    log(f"  {name:<34} {comm['collectives']}; {comm['bytes_per_step']:,} bytes/step (explain)")
  bad = {name: d for name, d in {**loss_diff, **param_diff}.items() if d > TOLERANCE}
  if bad:
    raise AssertionError(f"wide MLP: configurations differ from one device by more than {TOLERANCE}: {bad}")
  times = _timing.interleaved({name: c.step for name, c in configs.items()}, rounds, warmup=2,
                              budget_seconds=budget_seconds)
  stats = {name: _timing.summary(t) for name, t in times.items()}
  pairs = {"global / local (hand-written)": (GLOBAL, LOCAL), "global / local (wrap_optimizer)": (GLOBAL, LOCAL_WRAPPED),
           "global / DTensor": (GLOBAL, DTENSOR), "local (hand-written) / DTensor": (LOCAL, DTENSOR),
           "global / one device": (GLOBAL, ONE), "DTensor / one device": (DTENSOR, ONE)}
  ratios = {label: dict(of_medians=stats[a]["median"] / stats[b]["median"],
                        per_round=_timing.paired_ratio(times[a], times[b])) for label, (a, b) in pairs.items()}
  return dict(model=f"MLP {INPUTS}-{HIDDEN}-{CLASSES}, batch {MLP_BATCH}, SGD lr {LR}", mesh={"batch": 2, "model": 2},
              notes={name: c.note for name, c in configs.items()}, losses=losses,
              max_abs_loss_diff_vs_one_device=loss_diff, max_abs_param_diff_vs_one_device=param_diff,
              first_call_s=build_s, communication=communication, stats=stats, ratios=ratios, times_s=times,
              targets={"global / local (hand-written)": 1.10, "global / DTensor": 0.8})


# -- the transformer ----------------------------------------------------------------------------------------------


def _transformer(dropout: float = DROPOUT):
  """tests/test_global_transformer.py's one-block Keras 3 transformer, at benchmark sizes.

  ``dropout=0`` makes the Dropout layer the identity; the weights are those of the default (same seed).
  """
  import keras
  keras.utils.set_random_seed(1)
  tokens = keras.Input((TIME,), dtype="int32")
  x = keras.layers.Embedding(VOCAB, DIM, name="embed")(tokens)
  a = keras.layers.MultiHeadAttention(HEADS, DIM // HEADS, name="attn")(x, x, use_causal_mask=True)
  x = keras.layers.LayerNormalization(name="ln1")(x + keras.layers.Dropout(dropout, seed=5)(a))
  f = keras.layers.Dense(4 * DIM, activation="gelu", name="ff_in")(x)
  f = keras.layers.Dense(DIM, name="ff_out")(f)
  x = keras.layers.LayerNormalization(name="ln2")(x + f)
  return keras.Model(tokens, keras.layers.Dense(VOCAB, name="head")(x))


def _transformer_step(model, optimizer):
  import keras
  import tensorflow as tf
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def step_fn(batch):  # the single-device step, unchanged in every configuration
    x, y = batch
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  return step_fn


def _megatron_local(weights: dict, dataset):
  """The hand-written local-view Megatron step of ``_transformer(dropout=0)``; returns ``(call, params, repl, step)``.

  ``weights``: path (``"attn/query/kernel"``) -> initial value. Mesh ``{"batch": 2, "model": 2}``, the MEGATRON
  layouts: each device holds its two heads' query/key/value kernels and biases and attention-output rows, its
  half of the feed-forward units (``ff_in`` columns and bias, ``ff_out`` rows); the rest is replicated.
  """
  import math
  import re

  import numpy as np
  import tensorflow as tf

  import mesh
  m = mesh.Mesh({"batch": 2, "model": 2}, devices=cpus(DEVICES))
  repl = replicator.Replicator(mesh=m, batch_axes=("batch",))
  batches, model_size = m.shape["batch"], m.shape["model"]
  paths = list(weights)
  with repl.context(layouts=mesh.LayoutMap(MEGATRON)):
    p = {path: tf.Variable(weights[path], name=path) for path in paths}
    # Adam's slots, named so that MEGATRON's patterns give them their variable's layout.
    slot_m = {path: tf.Variable(tf.zeros_like(weights[path]), name=f"adam_m/{path}") for path in paths}
    slot_v = {path: tf.Variable(tf.zeros_like(weights[path]), name=f"adam_v/{path}") for path in paths}
    iterations = tf.Variable(0, dtype=tf.int64, name="adam/iterations")
  sharded = [path for path in paths if any(re.search(k, path) for k in MEGATRON)]
  across_model = [path for path in paths if any(re.search(k, path) for k in ACROSS_MODEL)]
  within_batch = [path for path in paths if path not in sharded + across_model + ["embed/embeddings"]]
  scale = 1 / math.sqrt(DIM // HEADS)
  large_negative = -0.7 * 3.38953e38  # Keras's masked logit (keras.src.backend.tensorflow.nn)

  def layer_norm(x, name):  # keras.ops.layer_normalization, epsilon 1e-3
    mean, variance = tf.nn.moments(x, [-1], keepdims=True)
    inv = tf.math.rsqrt(variance + 1e-3) * p[f"{name}/gamma"]
    return x * inv + (p[f"{name}/beta"] - mean * inv)

  def heads(x, name):  # EinsumDense "abc,cde->abde" on this device's heads
    return tf.einsum("abc,cde->abde", x, p[f"attn/{name}/kernel"]) + p[f"attn/{name}/bias"]

  def forward(tokens):
    x = tf.gather(tf.convert_to_tensor(p["embed/embeddings"]), tokens)
    q, k, v = heads(x, "query"), heads(x, "key"), heads(x, "value")
    logits = tf.einsum("BTNH,BSNH->BNTS", q, k) * scale
    causal = tf.linalg.band_part(tf.ones((TIME, TIME), tf.bool), -1, 0)
    probs = tf.nn.softmax(tf.where(causal, logits, large_negative), axis=-1)
    partial = tf.einsum("abcd,cde->abe", tf.einsum("BNTS,BSNH->BTNH", probs, v), p["attn/attention_output/kernel"])
    x = layer_norm(x + repl.all_reduce(partial, axis="model") + p["attn/attention_output/bias"], "ln1")
    u = tf.nn.gelu(tf.einsum("btd,df->btf", x, p["ff_in/kernel"]) + p["ff_in/bias"], approximate=False)
    partial = tf.einsum("btf,fd->btd", u, p["ff_out/kernel"])
    x = layer_norm(x + repl.all_reduce(partial, axis="model") + p["ff_out/bias"], "ln2")
    return tf.einsum("btd,dv->btv", x, p["head/kernel"]) + p["head/bias"]

  def step_fn(batch):  # device (b, k): batch shard b, heads and feed-forward units k
    x, y = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, forward(x)))
    grads = dict(zip(paths, tape.gradient(loss, [p[path] for path in paths])))
    # Reduced below to one device's gradient of the global batch's mean loss. Through an
    # all-reduce over "model" a tensor's gradient is that of the sum of the group's two (equal) losses
    # (README, "Semantics worth knowing"): a piece's gradient is twice its share, and a replicated tensor
    # upstream of an all-reduce gets its own units' part twice and the other device's not at all, which the
    # mean over "model" of the replicated variables upstream (ACROSS_MODEL) puts right. Downstream of both
    # all-reduces the replicated gradients are equal over "model": reduced over "batch" only.
    reduced = dict(zip(sharded, repl.all_reduce([grads[k] for k in sharded], "mean", axis="batch")))
    reduced = {k: g / model_size for k, g in reduced.items()}
    reduced.update(zip(across_model, repl.all_reduce([grads[k] for k in across_model], "mean",
                                                     axis=("batch", "model"))))
    reduced.update(zip(within_batch, repl.all_reduce([grads[k] for k in within_batch], "mean", axis="batch")))
    squares = {k: tf.square(g) for k, g in reduced.items()}
    # The embedding's gradient is rows (tf.IndexedSlices); Keras's Adam adds the rows to the first moment and
    # their squares, row by row, to the second (a repeated token's squares, not the square of its sum).
    embedding = grads["embed/embeddings"]
    rows = repl.all_reduce(embedding.values, "mean", axis="model") / batches  # one device's rows, this shard's tokens
    dense = tf.math.unsorted_segment_sum(rows, embedding.indices, VOCAB)
    dense_squares = tf.math.unsorted_segment_sum(tf.square(rows), embedding.indices, VOCAB)
    reduced["embed/embeddings"], squares["embed/embeddings"] = repl.all_reduce([dense, dense_squares], axis="batch")
    # Keras 3's Adam (beta_1 0.9, beta_2 0.999, epsilon 1e-7), on every device's pieces.
    t = tf.cast(iterations + 1, tf.float32)
    alpha = ADAM_LR * tf.sqrt(1 - tf.pow(0.999, t)) / (1 - tf.pow(0.9, t))
    for k in paths:
      slot_m[k].assign_add((reduced[k] - slot_m[k]) * (1 - 0.9))
      slot_v[k].assign_add((squares[k] - slot_v[k]) * (1 - 0.999))
      p[k].assign_sub(slot_m[k] * alpha / (tf.sqrt(slot_v[k]) + 1e-7))
    iterations.assign_add(1)
    return loss

  def call():
    return float(np.mean([t.numpy() for t in repl.run(step_fn, dataset)]))

  return call, lambda: {k: v.numpy() for k, v in p.items()}, repl, step_fn


def _step_graph_nodes(repl) -> int:
  """Nodes of the step graph ``repl`` built (its one step); private, as in ``child_build`` (no public accessor)."""
  steps = repl._views["global"].steps if repl._views["global"].steps.values() else repl._views["local"].steps  # pylint: disable=protected-access
  graphs = []
  for by_key in steps.values():
    for step in by_key.values():
      graphs += [s.graph_def for s in step.values()] if isinstance(step, dict) else [step.graph_def]
  (graph_def,) = graphs
  return _graph_nodes(graph_def)


def transformer(rounds: int, budget_seconds: float) -> dict:
  """The Keras 3 transformer: one device, global view (megatron 2x2, data 4x1), local view (data; megatron by hand)."""
  import keras
  import numpy as np
  import tensorflow as tf

  import mesh
  from benchmarks import _timing
  rng = np.random.default_rng(0)
  x = rng.integers(0, VOCAB, size=(TF_BATCH, TIME)).astype("int32")
  y = rng.integers(0, VOCAB, size=(TF_BATCH, TIME)).astype("int32")
  dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
  calls, models, repls, steps = {}, {}, {}, {}
  for name, dropout in ((TF_ONE, DROPOUT), (TF_ONE_NODROP, 0.0)):
    with tf.device("/device:CPU:0"):
      model, optimizer = _transformer(dropout), keras.optimizers.Adam(ADAM_LR)
      optimizer.build(model.trainable_variables)
      iterator = iter(dataset)
    one = tf.function(functools.partial(lambda body, it: body(next(it)), _transformer_step(model, optimizer)))
    calls[name], models[name] = functools.partial(lambda one, it: float(one(it)), one, iterator), model
  initial = {w.path: w.numpy() for w in models[TF_ONE_NODROP].trainable_weights}
  if any(np.any(w.numpy() != initial[w.path]) for w in models[TF_ONE].trainable_weights):
    raise AssertionError("_transformer(dropout=0) does not start from the weights of _transformer()")
  # The global view's default update on CPUs is sharded (each Adam update on one device of its "batch" group,
  # like the local view's wrap_optimizer default); the twin runs Adam on every device, so its pair does too.
  for name, shape, layouts, dropout, update in (
      (TF_MEGATRON, {"batch": 2, "model": 2}, MEGATRON, DROPOUT, "auto"),
      (TF_DATA, {"batch": 4}, None, DROPOUT, "auto"),
      (TF_MEGATRON_NODROP, {"batch": 2, "model": 2}, MEGATRON, 0.0, "replicated")):
    repl = replicator.Replicator(mesh=mesh.Mesh(shape, devices=cpus(DEVICES)),
                                 layouts=mesh.LayoutMap(layouts) if layouts else None, batch_axes=("batch",),
                                 view="global", update=update)
    with repl.context():
      model, optimizer = _transformer(dropout), keras.optimizers.Adam(ADAM_LR)
      optimizer.build(model.trainable_variables)
    step_fn = _transformer_step(model, optimizer)
    calls[name] = functools.partial(lambda repl, step_fn: float(repl.run(step_fn, dataset)), repl, step_fn)
    models[name], repls[name], steps[name] = model, repl, step_fn
  repl = replicator.Replicator(devices=cpus(DEVICES))
  with repl.context():
    model, optimizer = _transformer(), repl.wrap_optimizer(keras.optimizers.Adam(ADAM_LR))
    optimizer.build(model.trainable_variables)
  local_step = _transformer_step(model, optimizer)
  calls[TF_LOCAL] = lambda: float(np.mean([t.numpy() for t in repl.run(local_step, dataset)]))
  calls[TF_TWIN], twin_params, repls[TF_TWIN], steps[TF_TWIN] = _megatron_local(initial, dataset)
  losses, first_call = {}, {}
  for name, call in calls.items():
    t0 = time.perf_counter()
    losses[name] = [call()]
    first_call[name] = time.perf_counter() - t0
    losses[name] += [call() for _ in range(CHECK_STEPS - 1)]
  reference = {name: TF_ONE_NODROP if name in (TF_MEGATRON_NODROP, TF_TWIN) else TF_ONE for name in calls}
  loss_diff = {name: float(np.max(np.abs(np.subtract(losses[name], losses[reference[name]])))) for name in calls}
  params = {name: {w.path: w.numpy() for w in models[name].trainable_weights} for name in models}
  params[TF_TWIN] = twin_params()
  param_diff = {name: float(max(np.max(np.abs(v - params[reference[name]][k])) for k, v in params[name].items()))
                for name in params}
  for name in calls:
    log(f"  {name:<40} losses {['%.5f' % v for v in losses[name]]}  max|loss - {reference[name]}| "
        f"{loss_diff[name]:.1e}" + (f"  max|param - {reference[name]}| {param_diff[name]:.1e}"
                                    if name in param_diff else "") + f"  first call {first_call[name]:.1f} s")
  checked = (TF_MEGATRON, TF_DATA, TF_MEGATRON_NODROP, TF_TWIN)
  bad = {f"{name} ({what})": d[name] for name in checked for what, d in (("losses", loss_diff), ("params", param_diff))
         if d[name] > TOLERANCE}
  if bad:
    raise AssertionError(f"transformer: configurations differ from one device by more than {TOLERANCE}: {bad}")
  communication = {}
  for name in (TF_MEGATRON_NODROP, TF_TWIN):
    communication[name] = _communication(repls[name].explain(steps[name], dataset))
    communication[name]["step_graph_nodes"] = _step_graph_nodes(repls[name])
    log(f"  {name:<40} {communication[name]['collectives']}; {communication[name]['bytes_per_step']:,} bytes/step; "
        f"step graph {communication[name]['step_graph_nodes']:,} nodes")
  timed = {name: call for name, call in calls.items() if name != TF_ONE_NODROP}
  times = _timing.interleaved(timed, rounds, warmup=2, budget_seconds=budget_seconds)
  stats = {name: _timing.summary(t) for name, t in times.items()}
  pairs = {"megatron / one device": (TF_MEGATRON, TF_ONE), "data / one device": (TF_DATA, TF_ONE),
           "local data / one device": (TF_LOCAL, TF_ONE), "global data / local data": (TF_DATA, TF_LOCAL),
           "megatron / local data": (TF_MEGATRON, TF_LOCAL),
           "megatron global / megatron local (hand-written)": (TF_MEGATRON_NODROP, TF_TWIN),
           "megatron no dropout / megatron": (TF_MEGATRON_NODROP, TF_MEGATRON)}
  ratios = {label: dict(of_medians=stats[a]["median"] / stats[b]["median"],
                        per_round=_timing.paired_ratio(times[a], times[b])) for label, (a, b) in pairs.items()}
  return dict(model=f"transformer: vocab {VOCAB}, d_model {DIM}, {HEADS} heads, ff {4 * DIM}, seq {TIME}, "
                    f"batch {TF_BATCH}, Adam", losses=losses, reference=reference,
              max_abs_loss_diff_vs_one_device=loss_diff, max_abs_param_diff_vs_one_device=param_diff,
              first_call_s=first_call, communication=communication, stats=stats, ratios=ratios, times_s=times,
              targets={"megatron global / megatron local (hand-written)": 1.10})


# -- the build of MobileNetV2 (one subprocess per build) -------------------------------------------------------------


class _Timeline:
  """Wraps functions with timers that record ``(label, start, end)``: a measurement, the functions are unchanged."""

  def __init__(self):
    self.events: list[tuple[str, float, float]] = []

  def wrap(self, owner, name: str, label: str, only_eager: bool = False) -> None:
    import tensorflow as tf
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
      if only_eager and not tf.executing_eagerly():
        return original(*args, **kwargs)
      start = time.perf_counter()
      try:
        return original(*args, **kwargs)
      finally:
        self.events.append((label, start, time.perf_counter()))

    setattr(owner, name, wrapped)

  def within(self, label: str, start: float, end: float) -> list[tuple[float, float]]:
    return [(s, e) for name, s, e in self.events if name == label and s >= start and e <= end]

  def one(self, label: str) -> tuple[float, float]:
    found = [(s, e) for name, s, e in self.events if name == label]
    if len(found) != 1:
      raise RuntimeError(f"expected one {label!r}, timed {len(found)}")
    return found[0]


def _graph_nodes(graph_def) -> int:
  return len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)


def _net_step(model, optimizer):
  import keras
  import tensorflow as tf
  loss_fn = keras.losses.SparseCategoricalCrossentropy()

  def step_fn(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  return step_fn


def child_build(config: str) -> dict:
  """One build of MobileNetV2's step (in a fresh process): setup, first call, its phases, second call."""
  import keras
  import numpy as np
  import tensorflow as tf

  # Private, for measurement only (wraps ConcreteFunction._call_flat to time the first execution apart from
  # tracing and importing; no public hook exists). Checked on TensorFlow 2.21; the library never imports it.
  from tensorflow.python.eager.polymorphic_function import concrete_function  # pylint: disable=g-direct-tensorflow-import

  import mesh
  import rewrite
  from replicator.views import _global_step
  from replicator.views import _local_step
  from rewrite import _expansion
  from rewrite import _partition
  view = config.split(",")[0]
  if GRAPPLER_OFF in config:
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
  timeline = _Timeline()
  timeline.wrap(concrete_function.ConcreteFunction, "_call_flat", "execute", only_eager=True)
  timeline.wrap(tf.graph_util, "import_graph_def", "import_graph_def")
  timeline.wrap(rewrite, "plan", "plan")
  timeline.wrap(rewrite, "apply", "apply")
  timeline.wrap(_partition, "propagate", "propagate")
  timeline.wrap(_expansion, "expand", "expand")
  timeline.wrap(_global_step, "build", "build")
  timeline.wrap(_global_step, "_report", "report")
  timeline.wrap(_global_step.GlobalStep, "__call__", "call")
  timeline.wrap(_local_step, "build", "build")
  timeline.wrap(_local_step.CompiledStep, "__call__", "call")

  rng = np.random.default_rng(0)
  x = rng.uniform(size=(NET_BATCH, IMAGE, IMAGE, 3)).astype("float32")
  y = rng.integers(0, NET_CLASSES, size=(NET_BATCH,)).astype("int32")
  dataset = tf.data.Dataset.from_tensors((x, y)).repeat()

  def make():
    return keras.applications.MobileNetV2(input_shape=(IMAGE, IMAGE, 3), classes=NET_CLASSES, weights=None)

  t0 = time.perf_counter()
  if view == ONE:
    with tf.device("/device:CPU:0"):
      model, optimizer = make(), keras.optimizers.Adam(1e-3)
      optimizer.build(model.trainable_variables)
      iterator = iter(dataset)
    body = _net_step(model, optimizer)
    fn = tf.function(lambda it: body(next(it)))

    def call():
      return float(fn(iterator))
  else:
    if view == GLOBAL:
      repl = replicator.Replicator(mesh=mesh.Mesh({"batch": DEVICES}, devices=cpus(DEVICES)), batch_axes=("batch",),
                                   view="global")
    else:
      repl = replicator.Replicator(devices=cpus(DEVICES))
    with repl.context():
      model = make()
      optimizer = keras.optimizers.Adam(1e-3)
      if view == LOCAL_BUILD:
        optimizer = repl.wrap_optimizer(optimizer, update="replicated" if REPLICATED in config else "auto")
      optimizer.build(model.trainable_variables)
    step_fn = _net_step(model, optimizer)

    def call():
      out = repl.run(step_fn, dataset)
      return float(out) if view == GLOBAL else float(np.mean([t.numpy() for t in out]))
  setup = time.perf_counter() - t0
  timeline.events.clear()
  start = time.perf_counter()
  loss = call()
  end = time.perf_counter()
  phases = _phases(view, timeline, start, end)
  second, _ = time.perf_counter(), call()
  second = time.perf_counter() - second
  if view == ONE:
    graph_def = fn.get_concrete_function(iterator).graph.as_graph_def()
  elif view == GLOBAL:
    (by_spec,) = repl._views["global"].steps.values()  # pylint: disable=protected-access  (no public accessor)
    ((step,),) = [variants.values() for variants in by_spec.values()]
    graph_def = step.graph_def
  else:
    (by_source,) = repl._views["local"].steps.values()  # pylint: disable=protected-access
    (variants,) = by_source.values()
    (step,) = variants.values()
    graph_def = step.graph_def
  op_types = collections.Counter(n.op for n in graph_def.node)
  return dict(config=config, setup_s=setup, first_call_s=end - start, second_call_s=second, phases_s=phases,
              graph_nodes=_graph_nodes(graph_def), op_types=dict(op_types.most_common()), loss=loss)


# The first call's phases, in the order of the tables; each configuration has some of them.
PHASES = ("trace", "propagate", "expand", "checks, owners, inputs", "plan", "apply (GraphDef, rewrite)",
          "report", "build: rest", "import (import_graph_def)", "import: its tf.function", "first execution",
          "rest")


def _phases(view: str, timeline: _Timeline, start: float, end: float) -> dict:
  """The first call's phases, in seconds, from the timeline of the wrapped internals."""
  execute = timeline.within("execute", start, end)
  exec_start, exec_end = max(execute, key=lambda se: se[1] - se[0])
  if view == ONE:
    return {"trace": exec_start - start, "first execution": exec_end - exec_start, "rest": end - exec_end}
  b0, b1 = timeline.one("build")
  c0, c1 = timeline.one("call")
  p0, p1 = timeline.one("plan")
  a0, a1 = timeline.one("apply")
  imports = sum(e - s for s, e in timeline.within("import_graph_def", c0, c1))
  phases = {}
  if view == GLOBAL:
    g0, g1 = timeline.one("propagate")
    e0, e1 = timeline.one("expand")
    r0, r1 = timeline.one("report")
    phases["trace"] = g0 - b0
    phases["propagate"] = g1 - g0
    phases["expand"] = e1 - e0
    phases["checks, owners, inputs"] = (p0 - g1) - (e1 - e0)
    phases["plan"] = p1 - p0
    phases["apply (GraphDef, rewrite)"] = a1 - p1  # rewrite.apply on the expansion's GraphDef
    phases["report"] = r1 - r0
    phases["build: rest"] = (b1 - a1) - (r1 - r0)
  else:
    phases["trace"] = p0 - b0  # every replica, and the checks of the traced graph
    phases["plan"] = p1 - p0
    phases["apply (GraphDef, rewrite)"] = a1 - p1  # the GraphDef, its clean-ups, then rewrite.apply
    phases["build: rest"] = b1 - a1
  phases["import (import_graph_def)"] = imports
  phases["import: its tf.function"] = (exec_start - c0) - imports
  phases["first execution"] = exec_end - exec_start
  phases["rest"] = (c1 - exec_end) + (end - start) - (b1 - b0) - (c1 - c0)  # the input, the checks of run
  return phases


def build(repeats: int, diagnose: bool) -> dict:
  """MobileNetV2's build in fresh subprocesses, the configurations alternating."""
  import numpy as np
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  order = np.random.default_rng(0)
  records = []

  def one(config, r):
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "benchmarks.global_view", "--child", config], cwd=root,
                          capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode or not lines:
      raise RuntimeError(f"the build of {config!r} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    record = json.loads(lines[-1][len(RESULT):])
    record.update(repeat=r, process_s=time.perf_counter() - t0)
    records.append(record)
    log(f"  {config:<34} repeat {r}: setup {record['setup_s']:.1f} s, first call {record['first_call_s']:.1f} s, "
        f"second call {record['second_call_s'] * 1e3:.0f} ms, {record['graph_nodes']:,} nodes, "
        f"process {record['process_s']:.0f} s; " + ", ".join(f"{k} {v:.1f}" for k, v in record["phases_s"].items()))

  for r in range(repeats):
    for i in order.permutation(len(BUILDS)):
      one(BUILDS[i], r)
  if diagnose:
    for config in DIAGNOSTIC_BUILDS:
      one(config, 0)
  medians = {}
  for config in BUILDS + (DIAGNOSTIC_BUILDS if diagnose else ()):
    mine = [rec for rec in records if rec["config"] == config]
    phases = {k: float(np.median([rec["phases_s"][k] for rec in mine])) for k in mine[0]["phases_s"]}
    medians[config] = dict(first_call_s=float(np.median([rec["first_call_s"] for rec in mine])),
                           setup_s=float(np.median([rec["setup_s"] for rec in mine])),
                           second_call_s=float(np.median([rec["second_call_s"] for rec in mine])),
                           graph_nodes=mine[0]["graph_nodes"], phases_s=phases, repeats=len(mine))
  first = {config: m["first_call_s"] for config, m in medians.items()}
  ratios = {"global / local": first[GLOBAL] / first[LOCAL_BUILD], "global / one device": first[GLOBAL] / first[ONE],
            "local / one device": first[LOCAL_BUILD] / first[ONE]}
  if diagnose:
    ratios["global / local update=replicated"] = first[GLOBAL] / first[LOCAL_REPLICATED]
  return dict(model=f"MobileNetV2 {IMAGE}x{IMAGE}x3, {NET_CLASSES} classes, batch {NET_BATCH}, Adam, "
                    f"data-parallel on {DEVICES} devices", records=records, medians=medians, ratios=ratios,
              targets={"global / local": 0.7})


# -- tables -------------------------------------------------------------------------------------------------------


def markdown(results: dict) -> str:
  from benchmarks import _timing
  out = []
  for part, title in (("mlp", "Wide MLP 784-4096-10, batch 256, 2x2 mesh"),
                      ("transformer", "Keras 3 transformer, Adam")):
    if part not in results:
      continue
    rec = results[part]
    rows = [[name, _timing.ms(s["median"]), _timing.ms(s["iqr"]), s["n"], f"{rec['first_call_s'][name]:.1f} s",
             f"{rec['max_abs_loss_diff_vs_one_device'][name]:.1e}"] for name, s in rec["stats"].items()]
    out.append(f"### {title}\n\n" + _timing.table(
        ["configuration", "median step", "IQR", "n", "first call", "max abs loss diff vs one device"], rows))
    rows = [[label, f"{r['of_medians']:.2f}", _timing.interval(r["per_round"]),
             rec.get("targets", {}).get(label, "")] for label, r in rec["ratios"].items()]
    out.append(_timing.table(["ratio", "of medians", "per round [95% CI]", "target"], rows))
    rows = [[name, c["collectives"], f"{c['bytes_per_step']:,}", f"{c['step_graph_nodes']:,}"]
            for name, c in rec.get("communication", {}).items() if "step_graph_nodes" in c]
    if rows:
      out.append(_timing.table(["configuration", "collectives (repl.explain)", "bytes/step", "step graph nodes"],
                               rows))
  if "build" in results:
    rec = results["build"]
    rows = [[c, f"{m['first_call_s']:.1f} s", f"{m['setup_s']:.1f} s", _timing.ms(m["second_call_s"]),
             f"{m['graph_nodes']:,}", m["repeats"]] for c, m in rec["medians"].items()]
    out.append("### Build: MobileNetV2 data-parallel, 4 devices (medians)\n\n" + _timing.table(
        ["configuration", "first call", "setup", "second call", "step graph nodes", "builds"], rows))
    out.append(_timing.table(["ratio", "first calls", "target"], [
        [label, f"{v:.2f}", rec["targets"].get(label, "")] for label, v in rec["ratios"].items()]))
    configs = list(rec["medians"])
    rows = [[phase] + [f"{rec['medians'][c]['phases_s'][phase]:.1f}" if phase in rec["medians"][c]["phases_s"]
                       else "" for c in configs] for phase in PHASES]
    rows.append(["first call"] + [f"{rec['medians'][c]['first_call_s']:.1f}" for c in configs])
    out.append("First call by phase (seconds, medians):\n\n" + _timing.table(["phase"] + configs, rows))
  return "\n\n".join(out)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
  parser.add_argument("--quick", action="store_true", help="20 rounds, one build per configuration")
  parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 60, --quick 20)")
  parser.add_argument("--repeats", type=int, default=None, help="builds per configuration (default 2, --quick 1)")
  parser.add_argument("--json", default=None, help="write every timing and summary here")
  parser.add_argument("--diagnose", action="store_true",
                      help="build also the local view with update='replicated' and both views with Grappler off "
                           "(once each, ~2.5 min more)")
  # One build, in a fresh process (what build() runs).
  parser.add_argument("--child", choices=BUILDS + DIAGNOSTIC_BUILDS, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  replicator.virtual_cpus(DEVICES)  # before TensorFlow runs an op
  if args.child:
    print(RESULT + json.dumps(child_build(args.child)), flush=True)
    return {}
  parts = [p for p in args.parts.split(",") if p]
  unknown = set(parts) - set(PARTS)
  if unknown:
    parser.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
  rounds = args.rounds or (20 if args.quick else 60)
  repeats = args.repeats or (1 if args.quick else 2)
  from benchmarks import run
  info = run.machine_info()
  log(f"{info['cpu_model']}, {info['logical_cores']} cores, TensorFlow {info['tensorflow']}, Keras {info['keras']}, "
      f"{info['logical_cpu_devices']} logical CPU devices, {info['date']}, load {info['load_average_at_start']}")
  results = dict(machine=info, args=vars(args), run_time_s={})
  start = time.perf_counter()
  for part in PARTS:
    if part not in parts:
      continue
    log(f"{part}:")
    t0 = time.perf_counter()
    if part == "mlp":
      results[part] = mlp(rounds, budget_seconds=30 if args.quick else 90)
    elif part == "transformer":
      results[part] = transformer(rounds, budget_seconds=20 if args.quick else 60)
    else:
      results[part] = build(repeats, args.diagnose)
    results["run_time_s"][part] = time.perf_counter() - t0
  results["run_time_s"]["total"] = time.perf_counter() - start
  info["load_average_at_end"] = os.getloadavg()
  log("\n" + markdown(results))
  log("\nrun time: " + ", ".join(f"{k} {v:.0f} s" for k, v in results["run_time_s"].items()))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1, default=float)
    log(f"wrote {args.json}")
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
