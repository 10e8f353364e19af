"""A traced function's random draws and state reads, recorded once and replayed in a second trace of it.

Why this module uses a TensorFlow private API: rematerialization (``_remat``)
traces a function twice, the second time in its backward pass, and the second
trace must draw the random numbers of the first. A stateful random op
(``tf.random.uniform``, ``tf.random.Generator``'s draws) draws anew each time
it runs, and a variable the function writes (Keras's ``SeedGenerator`` state,
batch statistics) holds another value by the time the backward pass runs. No
public API substitutes an op's outputs while a graph is built; TensorFlow's
op callbacks (``tensorflow/python/framework/op_callbacks.py``, the hook of
tfdbg v2) do: a callback sees every op created in a graph (through
``op_def_library._apply_op_helper``, which every generated op wrapper calls)
and may return other tensors in place of its outputs. Checked on TensorFlow
2.21.0 (the callback's signature ``(op_type, inputs, attrs, outputs, op_name,
graph)`` dates from 2.2); if the module moves, :func:`available` is False and
``replicator.remat`` refuses what it cannot replay, with the fix.

What is recorded, in the graph the function is called in (ops created inside
its control flow or nested ``tf.function`` s are not replayed: a random op or
a variable write there is refused, see :meth:`Record.check`):

* the outputs of every stateful random op (:data:`RANDOM_OPS`), in order;
* the outputs of every ``ReadVariableOp``, in order, and which variables the
  function writes (:data:`WRITES`, and the generator ops' state).

The replay substitutes, op for op in the same order, the first trace's
outputs of the random ops and of every variable read (a read's output holds
the variable's buffer, so keeping it costs no copy unless the variable is
written before the replay consumes it); everything else is computed again.
Every read, not only those of variables the function writes: a read made
again in the backward pass is ordered before the step's later writes, yet
with nested ``RematScope`` blocks and an optimizer in the step such a read
gave another value than the first pass's about once in 200 fresh Keras
models on TensorFlow 2.21 (none with Grappler off or one inter-op thread;
the cause inside TensorFlow not pinned down), and a gradient was off.
"""

from __future__ import annotations

import contextlib
import dataclasses

import tensorflow as tf

from replicator.core import _errors

try:  # private: see the module docstring
  from tensorflow.python.framework import op_callbacks as _op_callbacks
except ImportError:  # pragma: no cover
  _op_callbacks = None

# Stateful ops drawing random numbers: their outputs are replayed. tf.random.Generator's ops (GENERATOR_OPS) also
# advance their state variable.
GENERATOR_OPS = frozenset({
    "StatefulUniform", "StatefulUniformInt", "StatefulUniformFullInt", "StatefulStandardNormal",
    "StatefulStandardNormalV2", "StatefulTruncatedNormal", "StatefulRandomBinomial", "RngReadAndSkip", "RngSkip",
    "NonDeterministicInts"})
RANDOM_OPS = GENERATOR_OPS | frozenset({
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal", "ParameterizedTruncatedNormal",
    "RandomShuffle", "Multinomial", "RandomGamma", "RandomPoisson", "RandomPoissonV2", "RandomCrop",
    "SampleDistortedBoundingBox", "SampleDistortedBoundingBoxV2", "UniformCandidateSampler",
    "LogUniformCandidateSampler", "LearnedUnigramCandidateSampler", "FixedUnigramCandidateSampler",
    "AllCandidateSampler", "ThreadUnsafeUnigramCandidateSampler"})
# Ops writing the resource variable of their first input (its dtype in attribute "dtype" or "T").
WRITES = frozenset({
    "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp", "ResourceStridedSliceAssign",
    "ResourceScatterUpdate", "ResourceScatterAdd", "ResourceScatterSub", "ResourceScatterMul", "ResourceScatterDiv",
    "ResourceScatterMin", "ResourceScatterMax", "ResourceScatterNdUpdate", "ResourceScatterNdAdd",
    "ResourceScatterNdSub", "ResourceScatterNdMin", "ResourceScatterNdMax"})
READ = "ReadVariableOp"

NESTED = (
    "replicator.remat({name}): {what} ({op_type} {op_name!r}) is inside a tf.cond, tf.while_loop or nested "
    "tf.function of the rematerialized function, where what it draws or writes cannot be replayed when the backward "
    "pass computes the function again (a second draw would differ, and so would the gradients). Fix: move it out of the "
    "control flow (draw or update before and pass the values in), or rematerialize a smaller function around it."
)
RETRACED = (
    "replicator.remat({name}): computing the function again in the backward pass created {found}, where its first "
    "call created {expected}: the function must build the same ops each time it is called with the same arguments "
    "(it reads Python state that changed between the calls, or creates variables or layers on its first call). "
    "Fix: build the layers and variables before the rematerialized call (layer.build), and keep Python state "
    "out of the function."
)
UNAVAILABLE = (
    "replicator.remat({name}): {what} ({op_type}) must be replayed in the backward pass, which needs TensorFlow's "
    "op callbacks (tensorflow.python.framework.op_callbacks, checked on TensorFlow 2.21), missing from "
    "TensorFlow {version}. Fix: use a stateless op with a seed tensor (tf.random.stateless_uniform, "
    "Keras's SeedGenerator), or do not rematerialize this function."
)


def available() -> bool:
  """Whether op callbacks exist in this TensorFlow (replay is possible)."""
  return _op_callbacks is not None


@dataclasses.dataclass
class Record:
  """What one trace of a function drew and read, in the order its ops were created."""

  name: str
  graph: object
  reads: list = dataclasses.field(default_factory=list)  # (handle, output) of every ReadVariableOp
  randoms: list = dataclasses.field(default_factory=list)  # (op type, outputs) of every random op
  written: dict = dataclasses.field(default_factory=dict)  # handle.ref() -> (handle, dtype): variables written
  nested: list = dataclasses.field(default_factory=list)  # (op type, name): random ops, writes in nested graphs

  def check(self) -> None:
    """Raises if the trace drew or wrote inside its control flow or nested functions (see :data:`NESTED`)."""
    if self.nested:
      op_type, op_name = self.nested[0]
      what = "a random op" if op_type in RANDOM_OPS else "a variable write"
      raise _errors.UnsupportedError(NESTED.format(name=self.name, what=what, op_type=op_type, op_name=op_name))

  def written_variables(self) -> list:
    """(handle, dtype) of every variable the trace writes, in the order first written."""
    return list(self.written.values())


def _dtype(attrs, op_type: str):
  """The dtype of the variable a write op writes, from the op's attributes (alternating names and values)."""
  if op_type in GENERATOR_OPS:
    return tf.int64  # tf.random.Generator's state (philox or threefry), an int64 vector
  found = dict(zip(attrs[::2], attrs[1::2]))
  for name in ("dtype", "T"):
    if name in found:
      value = found[name]
      return tf.as_dtype(value.type if hasattr(value, "type") else value)  # an AttrValue proto while tracing
  raise ValueError(f"{op_type} has no dtype attribute")  # pragma: no cover  (every op of WRITES has one)


@contextlib.contextmanager
def recording(name: str, graph):
  """Records, while active, the random ops, reads and writes created in ``graph`` (see the module docstring)."""
  record = Record(name, graph)
  if _op_callbacks is None:
    yield record
    return

  def callback(op_type, inputs, attrs, outputs, op_name=None, graph=None):
    writes_state = op_type in WRITES or (op_type in GENERATOR_OPS and inputs and inputs[0].dtype == tf.resource)
    if graph is not record.graph:
      if graph is None:  # run eagerly while tracing (a variable's initializer lifted out): not the function's
        return outputs
      if op_type in RANDOM_OPS or writes_state:
        record.nested.append((op_type, op_name))
      return outputs
    if op_type == READ:
      record.reads.append((inputs[0], outputs[0]))
    if op_type in RANDOM_OPS:
      record.randoms.append((op_type, tuple(outputs)))
    if writes_state and inputs[0].ref() not in record.written:
      record.written[inputs[0].ref()] = (inputs[0], _dtype(attrs, op_type))
    return outputs

  _op_callbacks.add_op_callback(callback)
  try:
    yield record
  finally:
    _op_callbacks.remove_op_callback(callback)


@contextlib.contextmanager
def replaying(record: Record, graph):
  """While active, ops created in ``graph`` take the recorded outputs: random ops, and variable reads.

  Raises:
    UnsupportedError: the trace creates other reads or random ops than the recorded one (on exit, or at the first
      that differs).
  """
  if _op_callbacks is None:
    if record.randoms:  # recording found none without callbacks; kept for a TensorFlow without them
      raise _errors.UnsupportedError(UNAVAILABLE.format(name=record.name, what="a random op",
                                                        op_type=record.randoms[0][0], version=tf.__version__))
    yield
    return
  reads = record.reads  # every read's (handle, output), replayed in order (see the module docstring)
  count = {"reads": 0, "randoms": 0}

  def differs(found: str, expected: str):
    return _errors.UnsupportedError(RETRACED.format(name=record.name, found=found, expected=expected))

  def callback(op_type, inputs, attrs, outputs, op_name=None, graph=None):
    del attrs, op_name
    if graph is not top:
      return outputs
    if op_type == READ:
      i = count["reads"]
      count["reads"] += 1
      if i >= len(reads):
        raise differs(f"more than {len(reads)} variable reads", f"{len(reads)}")
      handle, output = reads[i]
      if handle is not inputs[0]:  # (another variable's value would be read: silently wrong)
        raise differs(f"read {i} of the variable {inputs[0].name!r}", f"a read of {handle.name!r}")
      return [output]
    elif op_type in RANDOM_OPS:
      i = count["randoms"]
      count["randoms"] += 1
      if i >= len(record.randoms) or record.randoms[i][0] != op_type:
        expected = record.randoms[i][0] if i < len(record.randoms) else "no more"
        raise differs(f"random op {i} of type {op_type}", f"{expected}")
      return list(record.randoms[i][1])
    return outputs

  top = graph
  _op_callbacks.add_op_callback(callback)
  try:
    yield
  finally:
    _op_callbacks.remove_op_callback(callback)
  if count["randoms"] != len(record.randoms):
    raise differs(f"{count['randoms']} random ops", f"{len(record.randoms)}")
