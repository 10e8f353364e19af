"""A Keras 3 transformer language model, written for one device, split over a 2-D mesh by layouts alone.

The model is ordinary single-device Keras 3 code: a decoder-only transformer
(``keras.layers.Embedding`` for tokens, a learned position table, pre-
LayerNorm blocks of ``keras.layers.MultiHeadAttention`` with a causal mask
and a ``Dense`` GELU feed-forward network, seeded ``Dropout`` on both
residual branches, a final ``LayerNormalization`` and an output ``Dense``).
It learns to predict the next character of the Python reference
documentation that ships with Python (``pydoc_data.topics``, about 465 KB of
English text, so nothing is downloaded); the last 10% is held out.

The training step is the single-device step, byte for byte (a
``tf.GradientTape`` and a plain ``keras.optimizers.Adam``), run with
``repl.run(train_step, dataset)`` in the *global view*
(``Replicator(..., view="global")``): the step sees global batches and
variables at their global shapes, and the layouts alone decide how it is
partitioned over the mesh. ``--layout`` switches between named layout sets;
the model and the step do not change:

* ``data``: the batch is split over "batch"; every weight is replicated.
* ``megatron``: also, as in Megatron-LM, the attention heads (the query, key
  and value kernels by heads, the attention output kernel by its input
  heads) and the feed-forward units (``ff_in`` by columns, ``ff_out`` by
  rows) are split over "model". The replicator inserts the two all-reduces
  per block that Megatron writes by hand.
* ``2d``: ``megatron`` plus the vocabulary split over "model": the token
  embedding by rows (a masked lookup, then a sum) and the output projection
  by columns (the softmax cross-entropy reduces over the split vocabulary).

Every layout gives the same losses as one device (``--one-device``: the same
code under ``tf.function``, no Replicator). For the same model written by hand
in the *local view* (each device sees its own piece and sums partial results
itself), see ``examples/transformer_local.py``.

Run (a minute or two on a 2-core CPU):

  python -m examples.transformer                      # 2x2 mesh, --layout megatron
  python -m examples.transformer --layout 2d --explain
  python -m examples.transformer --layout data --mesh batch:4
  python -m examples.transformer --one-device
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import mesh  # noqa: E402
import replicator  # noqa: E402
from examples.mnist import parse_pairs  # noqa: E402
from examples.transformer_local import load_text  # noqa: E402
from examples.transformer_local import windows  # noqa: E402

# Layout sets: Keras variable path pattern -> one entry per dimension (a mesh axis or None).
MEGATRON = {
    r"attn/(query|key|value)/kernel$": (None, "model", None),  # [d_model, heads, d_head]: column-parallel
    r"attn/(query|key|value)/bias$": ("model", None),  # [heads, d_head]
    r"attn/attention_output/kernel$": ("model", None, None),  # [heads, d_head, d_model]: row-parallel
    r"ff_in/kernel$": (None, "model"),  # [d_model, ff]: column-parallel
    r"ff_in/bias$": ("model",),
    r"ff_out/kernel$": ("model", None),  # [ff, d_model]: row-parallel
}
VOCABULARY = {
    r"^embed/embeddings$": ("model", None),  # [vocabulary, d_model]: rows
    r"^head/kernel$": (None, "model"),  # [d_model, vocabulary]: columns
    r"^head/bias$": ("model",),
}
LAYOUTS = {"data": {}, "megatron": MEGATRON, "2d": {**MEGATRON, **VOCABULARY}}
VOCABULARY_MULTIPLE = 8  # the vocabulary is padded to a multiple of this, so that it splits evenly
HELD_OUT_FRACTION = 0.1


def build_model(keras, vocab: int, seq_len: int, d_model: int, heads: int, ff: int, layers: int,
                dropout: float, seed: int):
  """The transformer as a functional Keras model: ``model(tokens [batch, seq_len]) -> logits``.

  Plain single-device Keras: nothing here knows about devices or layouts.
  """
  keras.utils.set_random_seed(seed)  # the same initial weights and dropout masks on any mesh

  class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per position to ``[batch, seq_len, d_model]`` inputs."""

    def build(self, input_shape):
      self.table = self.add_weight(shape=tuple(input_shape[1:]), name="table",
                                   initializer=keras.initializers.RandomNormal(stddev=0.01))

    def call(self, x):
      return x + self.table

  tokens = keras.Input((seq_len,), dtype="int32", name="tokens")
  x = keras.layers.Embedding(vocab, d_model, name="embed")(tokens)
  x = PositionEmbedding(name="position")(x)
  for i in range(layers):
    h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"block{i}_ln1")(x)
    h = keras.layers.MultiHeadAttention(heads, d_model // heads, name=f"block{i}_attn")(h, h, use_causal_mask=True)
    x = x + keras.layers.Dropout(dropout, seed=seed + 2 * i + 1, name=f"block{i}_drop1")(h)
    h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"block{i}_ln2")(x)
    h = keras.layers.Dense(ff, activation="gelu", name=f"block{i}_ff_in")(h)
    h = keras.layers.Dense(d_model, name=f"block{i}_ff_out")(h)
    x = x + keras.layers.Dropout(dropout, seed=seed + 2 * i + 2, name=f"block{i}_drop2")(h)
  x = keras.layers.LayerNormalization(epsilon=1e-5, name="final_ln")(x)
  logits = keras.layers.Dense(vocab, name="head")(x)
  return keras.Model(tokens, logits, name="transformer")


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mesh", default="batch:2,model:2", help="named mesh axes, e.g. batch:2,model:2")
  parser.add_argument("--layout", default="megatron", choices=sorted(LAYOUTS),
                      help="which weights the mesh axes split (the batch is always split over 'batch')")
  parser.add_argument("--one-device", action="store_true",
                      help="run the same model and step on one device under tf.function (no Replicator)")
  parser.add_argument("--devices", type=int, default=0, help="logical CPU devices (default: the mesh's size)")
  parser.add_argument("--epochs", type=int, default=5)
  parser.add_argument("--steps-per-epoch", type=int, default=60)
  parser.add_argument("--batch-size", type=int, default=32, help="global batch size (sequences)")
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--d-model", type=int, default=64)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--ff", type=int, default=256)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--dropout", type=float, default=0.1)
  parser.add_argument("--learning-rate", type=float, default=3e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--eval-batches", type=int, default=4, help="held-out batches evaluated after every epoch")
  parser.add_argument("--generate", type=int, default=200, help="characters to sample after training")
  parser.add_argument("--prompt", default="The ")
  parser.add_argument("--temperature", type=float, default=0.8)
  parser.add_argument("--explain", action="store_true", help="print the global view's plan (every collective)")
  args = parser.parse_args(argv)

  axes = dict(parse_pairs(args.mesh, "mesh", int))
  if not args.one_device and "batch" not in axes:
    sys.exit(f"--mesh {args.mesh!r} needs a 'batch' axis (of size 1 for model parallelism only), e.g. batch:2,model:2.")
  if args.d_model % args.heads:
    sys.exit(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}.")
  devices = args.devices if args.one_device else max(args.devices, math.prod(axes.values()))
  if devices:
    replicator.virtual_cpus(devices)  # the mesh takes the first ones (a test session has 8: pass --devices 8)
  import keras
  import tensorflow as tf

  text = load_text()
  chars = sorted(set(text))
  vocab = -(-len(chars) // VOCABULARY_MULTIPLE) * VOCABULARY_MULTIPLE  # ids past the characters are never seen
  char_to_id = {c: i for i, c in enumerate(chars)}
  ids = np.array([char_to_id[c] for c in text], dtype=np.int32)
  split_at = int(len(ids) * (1 - HELD_OUT_FRACTION))
  train_ids, held_ids = ids[:split_at], ids[split_at:]

  # Global batches of (inputs, next characters), drawn on the host with a seeded RNG: the same data
  # whatever the mesh. Each dataset element is one global batch.
  def batches(windows_of_text: np.ndarray):
    pairs = (windows_of_text[:, :-1], windows_of_text[:, 1:])
    return tf.data.Dataset.from_tensor_slices(pairs).batch(args.batch_size, drop_remainder=True)

  rng = np.random.RandomState(args.seed)
  starts = rng.randint(0, len(train_ids) - args.seq_len, size=args.epochs * args.steps_per_epoch * args.batch_size)
  train_data = batches(windows(train_ids, starts, args.seq_len + 1))
  held_starts = np.arange(0, len(held_ids) - args.seq_len, args.seq_len)[:args.eval_batches * args.batch_size]
  held_data = batches(windows(held_ids, held_starts, args.seq_len + 1)).repeat()  # the same batches every epoch

  if args.one_device:
    repl, where = None, "one device (tf.function)"
  else:
    layouts = mesh.LayoutMap(LAYOUTS[args.layout]) if LAYOUTS[args.layout] else None
    repl = replicator.Replicator(mesh=mesh.Mesh(axes), layouts=layouts, batch_axes=("batch",), view="global")
    where = f"{repl.num_replicas} devices, mesh {repl.mesh.shape}, layout {args.layout!r}"
  print(f"{where}; {len(train_ids):,} train / {len(held_ids):,} held-out characters, {len(chars)} distinct "
        f"(vocabulary {vocab}, ln {math.log(len(chars)):.3f}); global batch {args.batch_size} x {args.seq_len}")

  # ---- Single-device code: the model, the optimizer and the steps. ----
  with repl.context() if repl else contextlib.nullcontext():  # under repl.context(), the layouts apply
    model = build_model(keras, vocab=vocab, seq_len=args.seq_len, d_model=args.d_model, heads=args.heads,
                        ff=args.ff, layers=args.layers, dropout=args.dropout, seed=args.seed)
    optimizer = keras.optimizers.Adam(args.learning_rate)
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def train_step(batch):
    inputs, targets = batch
    with tf.GradientTape() as tape:
      loss = loss_fn(targets, model(inputs, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  def eval_step(batch):
    inputs, targets = batch
    return loss_fn(targets, model(inputs, training=False))
  # ---- End of the single-device code. ----

  if repl is None:
    train_iterator, held_iterator = iter(train_data), iter(held_data)
    train_fn, eval_fn = tf.function(train_step), tf.function(eval_step)

    def run_train():
      return train_fn(next(train_iterator))

    def run_eval():
      return eval_fn(next(held_iterator))
  else:
    def run_train():
      return repl.run(train_step, train_data)  # the next global batch; returns the global loss

    def run_eval():
      return repl.run(eval_step, held_data)

    start = time.perf_counter()
    plan = str(repl.explain(train_step, train_data))  # builds the step (run reuses it)
    print(f"built the step in {time.perf_counter() - start:.1f} s; "
          + (plan if args.explain else plan.splitlines()[0] + " (--explain lists them)"))

  history: list[dict] = []
  losses: list[float] = []
  for epoch in range(1, args.epochs + 1):
    start = time.perf_counter()
    epoch_losses = [float(run_train()) for _ in range(args.steps_per_epoch)]
    elapsed = time.perf_counter() - start
    losses.extend(epoch_losses)
    held = float(np.mean([float(run_eval()) for _ in range(args.eval_batches)])) if args.eval_batches else math.nan
    history.append(dict(epoch=epoch, loss=float(np.mean(epoch_losses)), heldout_loss=held,
                        perplexity=math.exp(held) if args.eval_batches else math.nan))
    print(f"epoch {epoch:>2}: loss {history[-1]['loss']:.4f}  held-out loss {held:.4f} "
          f"(perplexity {history[-1]['perplexity']:.2f})  {1000 * elapsed / args.steps_per_epoch:.0f} ms/step")

  sample = ""
  if args.generate:
    # Outside a step the variables read as their global values: the model runs on one device.
    predict = tf.function(lambda tokens: model(tokens, training=False))
    sample_rng = np.random.RandomState(args.seed)
    tokens = [char_to_id[c] for c in args.prompt if c in char_to_id] or [0]
    for _ in range(args.generate):
      context = tokens[-args.seq_len:]
      padded = np.array([context + [0] * (args.seq_len - len(context))], np.int32)  # causal: padding is unseen
      logits = predict(padded)[0, len(context) - 1, :len(chars)].numpy().astype(np.float64)
      p = np.exp((logits - logits.max()) / args.temperature)
      tokens.append(int(sample_rng.choice(len(chars), p=p / p.sum())))
    sample = "".join(chars[t] for t in tokens)
    print(f"sample (temperature {args.temperature}):\n{sample}")

  result = dict(losses=losses, history=history, initial_loss=losses[0], final_loss=losses[-1],
                heldout_loss=history[-1]["heldout_loss"], perplexity=history[-1]["perplexity"],
                characters=len(chars), vocabulary=vocab, sample=sample, replicas=repl.num_replicas if repl else 1,
                weight_bytes=sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.trainable_variables))
  if repl is not None:
    weights = replicator.bytes_per_device(model.trainable_variables)
    with_slots = replicator.bytes_per_device(model.trainable_variables + optimizer.variables)
    print("bytes per device (weights / weights + Adam slots): " + ", ".join(
        f"{d.rsplit('/', 1)[-1]} {weights[d]:,} / {with_slots[d]:,}" for d in repl.devices))
    result.update(bytes_per_device=weights, trace_count=repl.trace_count)
  return result


if __name__ == "__main__":
  main()
