"""The local view: a hand-written Megatron-style transformer language model on a 2-D mesh.

This is the example of the *local view* (``Replicator(view="local")``, the
default): the step sees each device's piece of a sharded variable and sums
partial products over the mesh axes itself (``heads_sum``/``ff_sum``), as in
JAX's ``shard_map``. For the same language model written as an ordinary Keras
3 model and trained with an unmodified single-device step in the *global
view*, where the layouts alone decide the partitioning, see
``examples/transformer.py``.

A small decoder-only transformer (token and learned position embeddings, N
pre-LayerNorm blocks of causal multi-head attention and a GELU feed-forward
network, a final LayerNorm and an output projection tied to the embedding)
learns to predict the next character of the Python reference documentation
that ships with Python (``pydoc_data.topics``, about 465 KB of English text,
so nothing is downloaded). The last 10% of the text is held out.

The devices form a named mesh (``--mesh batch:2,model:2``: 4 logical CPUs)
and Mesh-TensorFlow-style layout rules (``--layout``) name which mesh axis
splits which tensor dimension. By default the batch is split over "batch"
and, as in Megatron-LM, the attention heads and the feed-forward hidden units
over "model":

* ``wq``, ``wk``, ``wv`` ``[d_model, heads, d_head]`` are split by heads
  (column-parallel): each device computes the queries, keys and values of its
  own heads and attends with them, with no communication.
* ``wo`` ``[heads, d_head, d_model]`` is split by heads too (row-parallel):
  each device multiplies its heads' outputs by its rows of ``wo``, giving a
  partial sum of the attention output; one all-reduce over "model" adds the
  partial sums before the (replicated) output bias is added.
* ``w_in`` ``[d_model, ff]`` and ``b_in`` ``[ff]`` are split by ff units
  (column-parallel) and ``w_out`` ``[ff, d_model]`` by ff units
  (row-parallel, then an all-reduce over "model").
* Embeddings, LayerNorm parameters and output biases are replicated.

So each block costs two all-reduces in the forward pass and two in the
backward pass, and every device stores 1/k of the attention and
feed-forward weights (and of their Adam slots) for a "model" axis of size k.
The step is written in the *local view*: inside ``repl.run`` a sharded
variable reads as this device's piece, so the code sees only its local heads
and ff units (their number follows from the piece's shape, never from the
variable's global ``shape``). Without a rule for "heads" or "ff" (e.g.
``--layout batch:batch``) the same code runs with whole weights and no
all-reduce.

Run (about a minute on a 2-core CPU):

  python -m examples.transformer_local
  python -m examples.transformer_local --mesh batch:4,model:1 --layout batch:batch
  python -m examples.transformer_local --mesh batch:1,model:4 --explain
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import mesh  # noqa: E402
import replicator  # noqa: E402
from examples.mnist import parse_pairs  # noqa: E402

# Named tensor dimensions of the variables that may be split (the others are
# replicated). Keys are patterns over the variable path, e.g.
# "transformer/layer0/wq"; anchored so that each variable matches one.
DIMENSIONS = {
    r"/wq$": ("embed", "heads", "head_dim"),
    r"/wk$": ("embed", "heads", "head_dim"),
    r"/wv$": ("embed", "heads", "head_dim"),
    r"/wo$": ("heads", "head_dim", "embed"),
    r"/w_in$": ("embed", "ff"),
    r"/b_in$": ("ff",),
    r"/w_out$": ("ff", "embed"),
}
# Every kind of variable, in the order the model uses them.
KINDS = ("embedding", "position", "ln1_scale", "ln1_bias", "wq", "wk", "wv", "wo", "bo", "ln2_scale",
         "ln2_bias", "w_in", "b_in", "w_out", "b_out", "lnf_scale", "lnf_bias")
HELD_OUT_FRACTION = 0.1


def load_text() -> str:
  """The Python reference documentation's topics (``pydoc_data``), as one string."""
  from pydoc_data.topics import topics
  return "".join(topics[key] for key in sorted(topics))


def build_model(tf, vocab: int, seq_len: int, d_model: int, heads: int, ff: int, layers: int, seed: int = 0):
  """The transformer as a tf.Module: ``model(tokens, heads_sum, ff_sum) -> logits``.

  ``heads_sum`` and ``ff_sum`` sum partial products over the devices that
  split the heads and the ff units (identity when they are not split).
  """
  d_head = d_model // heads
  counter = iter(range(1, 1_000_000))

  def normal(shape, stddev=0.02):
    # Stateless: the same global initial values on any mesh (they are computed once, then split).
    return tf.random.stateless_normal(shape, seed=[seed, next(counter)], stddev=stddev)

  def layer_norm(x, scale, bias, eps=1e-5):
    mean = tf.reduce_mean(x, axis=-1, keepdims=True)
    variance = tf.reduce_mean(tf.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * tf.math.rsqrt(variance + eps) * scale + bias

  def identity(x):
    return x

  class Block(tf.Module):
    """Pre-LayerNorm block: x + attention(ln1(x)), then x + ffn(ln2(x))."""

    def __init__(self, name: str):
      super().__init__(name=name)
      residual_std = 0.02 / math.sqrt(2 * layers)  # GPT-2: scale the layers that write the residual stream
      with self.name_scope:
        self.ln1_scale = tf.Variable(tf.ones([d_model]), name="ln1_scale")
        self.ln1_bias = tf.Variable(tf.zeros([d_model]), name="ln1_bias")
        self.wq = tf.Variable(normal([d_model, heads, d_head]), name="wq")
        self.wk = tf.Variable(normal([d_model, heads, d_head]), name="wk")
        self.wv = tf.Variable(normal([d_model, heads, d_head]), name="wv")
        self.wo = tf.Variable(normal([heads, d_head, d_model], residual_std), name="wo")
        self.bo = tf.Variable(tf.zeros([d_model]), name="bo")
        self.ln2_scale = tf.Variable(tf.ones([d_model]), name="ln2_scale")
        self.ln2_bias = tf.Variable(tf.zeros([d_model]), name="ln2_bias")
        self.w_in = tf.Variable(normal([d_model, ff]), name="w_in")
        self.b_in = tf.Variable(tf.zeros([ff]), name="b_in")
        self.w_out = tf.Variable(normal([ff, d_model], residual_std), name="w_out")
        self.b_out = tf.Variable(tf.zeros([d_model]), name="b_out")

    def __call__(self, x, heads_sum, ff_sum):
      # Attention over this device's heads: wq/wk/wv read as [d_model, local heads, d_head].
      h = layer_norm(x, self.ln1_scale, self.ln1_bias)
      q = tf.einsum("btd,dhk->bthk", h, self.wq)
      k = tf.einsum("btd,dhk->bthk", h, self.wk)
      v = tf.einsum("btd,dhk->bthk", h, self.wv)
      length = tf.shape(x)[1]
      causal = tf.cast(tf.linalg.band_part(tf.ones([length, length]), -1, 0), tf.bool)
      scores = tf.einsum("bqhk,bshk->bhqs", q, k) / math.sqrt(d_head)
      weights = tf.nn.softmax(tf.where(causal, scores, -1e9), axis=-1)
      heads_out = tf.einsum("bhqs,bshk->bqhk", weights, v)
      partial = tf.einsum("bqhk,hkd->bqd", heads_out, self.wo)  # this device's heads' share
      x = x + heads_sum(partial) + self.bo
      # Feed-forward over this device's ff units: w_in reads as [d_model, local ff].
      h = layer_norm(x, self.ln2_scale, self.ln2_bias)
      u = tf.nn.gelu(tf.einsum("btd,df->btf", h, self.w_in) + self.b_in)
      partial = tf.einsum("btf,fd->btd", u, self.w_out)
      return x + ff_sum(partial) + self.b_out

  class Transformer(tf.Module):
    """Decoder-only transformer; the output projection is the transposed token embedding."""

    def __init__(self):
      super().__init__(name="transformer")
      with self.name_scope:
        self.embedding = tf.Variable(normal([vocab, d_model]), name="embedding")
        self.position = tf.Variable(normal([seq_len, d_model], 0.01), name="position")
        self.blocks = [Block(f"layer{i}") for i in range(layers)]
        self.lnf_scale = tf.Variable(tf.ones([d_model]), name="lnf_scale")
        self.lnf_bias = tf.Variable(tf.zeros([d_model]), name="lnf_bias")

    def __call__(self, tokens, heads_sum=identity, ff_sum=identity):
      embedding = tf.convert_to_tensor(self.embedding)
      x = tf.gather(embedding, tokens) + tf.convert_to_tensor(self.position)[:tf.shape(tokens)[1]]
      for block in self.blocks:
        x = block(x, heads_sum, ff_sum)
      x = layer_norm(x, self.lnf_scale, self.lnf_bias)
      return tf.einsum("btd,vd->btv", x, embedding)

  return Transformer()


def windows(ids: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
  """``ids[s:s + length]`` for every start ``s`` (any shape of ``starts``)."""
  return ids[starts[..., None] + np.arange(length)]


def kind_of(variable) -> str:
  """``"transformer/layer0/wq:0"`` -> ``"wq"``."""
  return variable.name.split(":")[0].rsplit("/", 1)[-1]


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mesh", default="batch:2,model:2", help="named mesh axes, e.g. batch:2,model:2")
  parser.add_argument("--devices", type=int, default=0, help="logical CPU devices (default: the mesh's size)")
  parser.add_argument("--layout", default="batch:batch,heads:model,ff:model",
                      help="layout rules tensor-dimension:mesh-axis (dimensions: batch, heads, ff)")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--steps-per-call", type=int, default=25, help="training steps per repl.run call")
  parser.add_argument("--batch-size", type=int, default=32, help="global batch size (sequences)")
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--d-model", type=int, default=64)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--ff", type=int, default=256)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--learning-rate", type=float, default=3e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--eval-batches", type=int, default=0,
                      help="held-out batches to evaluate (0: all of the held-out text)")
  parser.add_argument("--generate", type=int, default=300, help="characters to sample after training")
  parser.add_argument("--prompt", default="The ")
  parser.add_argument("--temperature", type=float, default=0.8)
  parser.add_argument("--explain", action="store_true", help="print the rewrite plan (every collective)")
  args = parser.parse_args(argv)

  axes = dict(parse_pairs(args.mesh, "mesh", int))
  if not axes:
    sys.exit("--mesh needs at least one axis, e.g. --mesh batch:2,model:2.")
  rules = dict(parse_pairs(args.layout, "layout"))
  if args.d_model % args.heads:
    sys.exit(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}.")
  # The mesh takes the first of the logical CPUs (a test session already has 8: pass --devices 8).
  replicator.virtual_cpus(max(args.devices, math.prod(axes.values())))
  import keras
  import tensorflow as tf

  text = load_text()
  chars = sorted(set(text))
  char_to_id = {c: i for i, c in enumerate(chars)}
  ids = np.array([char_to_id[c] for c in text], dtype=np.int32)
  split_at = int(len(ids) * (1 - HELD_OUT_FRACTION))
  train_ids, held_ids = ids[:split_at], ids[split_at:]

  layout_rules = mesh.LayoutRules(list(rules.items()))
  repl = replicator.Replicator(mesh=mesh.Mesh(axes), batch_axes=layout_rules.mesh_axes("batch"))
  heads_axes, ff_axes = layout_rules.mesh_axes("heads"), layout_rules.mesh_axes("ff")
  shards = repl.num_input_pipelines
  if args.batch_size % shards:
    sys.exit(f"--batch-size {args.batch_size} must be a multiple of the {shards} batch shards.")
  print(f"{repl.num_replicas} devices, mesh {repl.mesh.shape}, layout rules {rules}; "
        f"{len(train_ids):,} train / {len(held_ids):,} held-out characters, vocabulary {len(chars)} "
        f"(ln {math.log(len(chars)):.3f}); global batch {args.batch_size} x {args.seq_len} "
        f"({args.batch_size // shards} sequences per batch shard)")

  with repl.context(layouts=layout_rules.layout_map(DIMENSIONS)):
    model = build_model(tf, vocab=len(chars), seq_len=args.seq_len, d_model=args.d_model, heads=args.heads,
                        ff=args.ff, layers=args.layers, seed=args.seed)
    optimizer = repl.wrap_optimizer(keras.optimizers.Adam(args.learning_rate))
  variables = list(model.trainable_variables)
  by_kind: dict[str, list] = {kind: [] for kind in KINDS}
  for v in variables:
    by_kind[kind_of(v)].append(v)
  bytes_by_kind = {kind: replicator.bytes_per_device(vs) for kind, vs in by_kind.items()}
  print(f"{'variable':<10} {'count':>5}  {'global shape':<14} {'layout':<26} {'per device':<14} bytes/device")
  for kind, vs in by_kind.items():
    v = vs[0]
    print(f"{kind:<10} {len(vs):>5}  {str(v.shape.as_list()):<14} {str(v.layout.spec):<26} "
          f"{str(v.components[0].shape.as_list()):<14} {bytes_by_kind[kind][repl.devices[0]]:,}")

  # Only call all_reduce for dimensions that some mesh axis splits.
  def heads_sum(x):
    return repl.all_reduce(x, axis=heads_axes) if heads_axes else x

  def ff_sum(x):
    return repl.all_reduce(x, axis=ff_axes) if ff_axes else x

  def loss_of(batch):
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(inputs, heads_sum, ff_sum)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=logits))

  def train_step(batch):
    with tf.GradientTape() as tape:
      loss = loss_of(batch)
    grads = tape.gradient(loss, variables)
    optimizer.apply_gradients(zip(grads, variables))
    return loss

  # Global batches, drawn on the host with a seeded RNG: the same data order
  # on every mesh. repl.run splits each one into the batch shards' rows.
  rng = np.random.RandomState(args.seed)
  starts = np.stack([rng.randint(0, len(train_ids) - args.seq_len, size=args.batch_size)
                     for _ in range(args.steps)])
  train_data = tf.data.Dataset.from_tensor_slices(windows(train_ids, starts, args.seq_len + 1))
  # Held-out: consecutive non-overlapping windows, in global batches.
  held_windows = windows(held_ids, np.arange(0, len(held_ids) - args.seq_len, args.seq_len), args.seq_len + 1)
  eval_batches = len(held_windows) // args.batch_size
  if args.eval_batches:
    eval_batches = min(eval_batches, args.eval_batches)
  held_windows = held_windows[:eval_batches * args.batch_size]
  held_data = tf.data.Dataset.from_tensor_slices(held_windows).batch(args.batch_size)

  start = time.perf_counter()
  plan = repl.explain(train_step, train_data)  # builds the step (cached: repl.run reuses it)
  print(f"built the step in {time.perf_counter() - start:.1f} s; " +
        (str(plan) if args.explain else str(plan).splitlines()[0] + " (--explain lists them)"))

  history: list[float] = []
  seconds: list[float] = []  # per step, of each call
  done = 0
  while done < args.steps:
    k = min(args.steps_per_call, args.steps - done)
    start = time.perf_counter()
    losses = repl.reduce("mean", repl.run(train_step, train_data, steps=k, all_steps=True)).numpy()
    elapsed = time.perf_counter() - start
    seconds.append(elapsed / k)
    done += k
    history.extend(float(x) for x in losses)
    print(f"step {done:>5}: loss {losses[-1]:.4f} (mean of the last {k}: {losses.mean():.4f}); "
          f"{1000 * elapsed / k:.0f} ms/step" + (" (first call: builds the loop)" if len(seconds) == 1 else ""))

  held_losses = repl.run(loss_of, held_data, steps=eval_batches, all_steps=True)
  heldout_loss = float(np.mean(repl.reduce("mean", held_losses).numpy()))
  ms_per_step = 1000 * float(np.mean(seconds[1:] or seconds))  # the first call also builds its loop
  print(f"initial loss {history[0]:.4f} (ln vocabulary {math.log(len(chars)):.4f}), final train loss "
        f"{history[-1]:.4f}, held-out loss {heldout_loss:.4f} ({eval_batches * args.batch_size} windows); "
        f"{ms_per_step:.0f} ms/step")

  # Outside a step the sharded variables read as their global values, so the
  # same model runs on one device with whole weights and no all-reduce.
  @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int32)])
  def host_logits(tokens):
    return model(tokens)

  held_targets = held_windows[:, 1:]
  host_losses = [tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=held_targets[i:i + args.batch_size], logits=host_logits(held_windows[i:i + args.batch_size, :-1])))
      for i in range(0, len(held_windows), args.batch_size)]
  heldout_loss_host = float(np.mean(host_losses))
  print(f"held-out loss recomputed on one device from the global weights: {heldout_loss_host:.4f}")

  sample = ""
  if args.generate:
    sample_rng = np.random.RandomState(args.seed)
    tokens = [char_to_id[c] for c in args.prompt if c in char_to_id] or [0]
    for _ in range(args.generate):
      logits = host_logits(np.array([tokens[-args.seq_len:]], np.int32))[0, -1].numpy().astype(np.float64)
      p = np.exp((logits - logits.max()) / args.temperature)
      tokens.append(int(sample_rng.choice(len(chars), p=p / p.sum())))
    sample = "".join(chars[t] for t in tokens)
    print(f"sample (temperature {args.temperature}):\n{sample}")

  bytes_per_device = replicator.bytes_per_device(variables)
  # The wrapped optimizer's own list: ReplicatedOptimizer.variables (tf.Module's) is empty.
  with_slots = replicator.bytes_per_device(variables + list(optimizer.optimizer.variables))
  print("bytes per device (weights / weights + Adam slots): " + ", ".join(
      f"{d.rsplit('/', 1)[-1]} {bytes_per_device[d]:,} / {with_slots[d]:,}" for d in repl.devices))
  return dict(history=history, initial_loss=history[0], final_loss=history[-1], heldout_loss=heldout_loss,
              heldout_loss_host=heldout_loss_host, vocabulary=len(chars), ms_per_step=ms_per_step,
              bytes_per_device=bytes_per_device, bytes_by_kind=bytes_by_kind, sample=sample,
              replicas=repl.num_replicas, collectives=plan.summary())


if __name__ == "__main__":
  main()
