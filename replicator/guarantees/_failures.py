"""What a step that fails at run time says: one line, the op, the user's line, the devices.

TensorFlow reports a failed multi-device call as "Graph execution error",
one "Detected at node" line and one root error per failing device, each with
the nodes it was waiting for: a wall of text naming ops of the rewritten graph.
:func:`step_failed` turns it into one line that says what failed (the first
root error's message), where (the op and the user's source line that made it,
found in the step's traced graph) and on which devices, and whether the
variables were kept as before the call. The error raised is a
:class:`replicator.StepFailedError` that is also of the TensorFlow error's
own class (``except tf.errors.InvalidArgumentError`` still catches a failed
``tf.debugging.assert_*``), with the original error as ``__cause__``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Callable

import tensorflow as tf

from replicator.core import _errors
from replicator.core import _primitives
from replicator.state import _consistency

NOTHING_WRITTEN = "No variable was written: every device's copy is as it was before this call"
NOTHING_WRITTEN_INPUT = " (the input it read is consumed)"
MAY_BE_TORN = (
    "Replicator(atomic=False): variables may have been written on some devices and not on others; restore a "
    "checkpoint before the next step"
)

_NODE = re.compile(r"\[\[\{\{node ([^}]+)\}\}\]\]")
_REWRITTEN = re.compile(r"(?:^|/)replicator_rewrite_*/(\d+)_\w+/")  # rewrite._apply's names of a collective's nodes
_SHAPES = re.compile(r"same size and shape|[Ss]hape mismatch|[Ii]ncompatible shapes|must have the same shape")
COLLECTIVE_OP = "{kind} #{index}"  # how a failing collective is named (the rewrite's nodes are not the user's ops)
_INPUT_SHAPES = re.compile(r"[Ii]nput \d+: (\[[\d,]*\]) != input \d+: (\[[\d,]*\])")
COLLECTIVE_SHAPES = (
    "the replicas reached this {kind} with values of different shapes ({found}); the collective combines one value a "
    "replica, of one shape. A value of the batch's size differs when the replicas' batches do (the last batch of "
    "input_fn datasets of different lengths, or of a batch the replicas do not divide evenly). Fix: reduce a "
    "value of a fixed shape (a sum over the batch, then divide by the total count from another all_reduce), "
    "batch with drop_remainder=True, or make the Replicator with drop_remainder=True"
)
_LOCAL_NAME = re.compile(r"(?:^|/)(replica_\d+/.*)$")


_CLASSES: dict[type, type] = {}


def _class_for(tf_class: type) -> type:
  """A subclass of both ``StepFailedError`` and ``tf_class`` (made once per class)."""
  if tf_class not in _CLASSES:

    def __init__(self, *args):  # TensorFlow's (node_def, op, message[, code]), not RuntimeError's, which comes first
      tf_class.__init__(self, *args)

    _CLASSES[tf_class] = type("StepFailedError", (_errors.StepFailedError, tf_class),
                              {"__module__": "replicator", "__doc__": _errors.StepFailedError.__doc__,
                               "__init__": __init__})
  return _CLASSES[tf_class]


_ROOT = re.compile(r"^\s*\((\d+)\)\s*([A-Z_]+):")
# A root error that is another's consequence: a device's op cancelled or a collective aborted because a peer
# failed (across workers, TensorFlow's collective runtime reports the waiting side as a root error of its own).
_DERIVED = re.compile(r"^\s*\(\d+\)\s*(CANCELLED|ABORTED):|_Derived_|[Cc]ollective ops is aborted|"
                      r"could be from a previous operation")


def parse(message: str) -> tuple[str, list[str]]:
  """``(first root error, the distinct failing nodes of every root error)`` of a TensorFlow error message.

  Every device's partition reports the error that stopped it; a device that
  was waiting on a failed one reports that one's node too, so the distinct
  nodes are where the step failed. A root error that is another's
  consequence (a cancelled op, an aborted collective) is left out when
  another is not (its device did not fail: it waited for one that did).
  """
  entries: list[list[str]] = [[]]  # each root error's lines (the first: the lines before any)
  for line in message.splitlines():
    if _ROOT.match(line):
      entries.append([])
    entries[-1].append(line)
  roots = [e for e in entries[1:] if e] or [entries[0]]
  causes = [e for e in roots if not _DERIVED.search("\n".join(e))] or roots
  nodes = []
  for line in (line for entry in causes for line in entry):
    found = _NODE.search(line)
    if found and found.group(1) not in nodes:
      nodes.append(found.group(1))
  return _errors.root_cause("\n".join(causes[0])), nodes


_TOP_LEVEL = re.compile(r"(?:^|/)step/(?:expand/)?replica_(\d+)/")


def failing_replicas(nodes: list[str]) -> list[int] | None:
  """The replicas whose ops failed, from the failing nodes' names; None if a node does not tell.

  A node of the step's own graph is named ``step/replica_<r>/...`` (the
  global view: ``step/expand/replica_<r>/...``), after the scopes of the loop
  or branch that runs the step; a node inside a function the user's step
  calls (a ``tf.cond`` branch: ``tf.debugging.assert_*``) has its function's
  own name, which does not tell.
  """
  replicas = []
  for node in nodes:
    match = _TOP_LEVEL.search(node)
    if match is None:
      return None
    if int(match.group(1)) not in replicas:
      replicas.append(int(match.group(1)))
  return sorted(replicas) or None


def locator(graph: tf.Graph, strip_replica: bool, plan=None) -> Callable[[str], tuple[str, str] | None]:
  """A function from a failing node's name to ``(traced op name, user location)``, found in ``graph``.

  The node may be in the rewritten graph (``step/replica_1/...``, or in the
  global view ``step/expand/replica_1/...``) or inside a function the step
  calls (a ``tf.cond`` branch): the longest prefix of its name that names an
  op of the traced graph is the op (a branch's op: the ``If`` that runs it).
  A node of a collective the rewrite made (``replicator_rewrite/3_all_reduce/
  ...``) is that collective of ``plan``: where the user called it.
  """
  collectives = {c.index: c for c in plan.collectives} if plan is not None else {}

  def locate(node: str) -> tuple[str, str] | None:
    made = _REWRITTEN.search(node)
    if made is not None and int(made.group(1)) in collectives:
      collective = collectives[int(made.group(1))]
      return COLLECTIVE_OP.format(kind=collective.kind, index=collective.index), collective.location
    match = _LOCAL_NAME.search(node)
    name = match.group(1) if match else node
    if strip_replica:
      name = re.sub(r"^replica_\d+/", "", name)
    parts = name.split("/")
    for end in range(len(parts), 0, -1):
      candidate = "/".join(parts[:end])
      try:
        op = graph.get_operation_by_name(candidate)
      except (KeyError, ValueError):
        continue
      return op.name, _primitives.location_of(op)
    return None

  return locate


def device_name(device: str, workers: Sequence[str] = ()) -> str:
  """How a failure names ``device``: ``device:CPU:0`` in this process, a worker's device whole with its worker.

  A worker's: ``/job:worker/replica:0/task:1/device:CPU:0 (worker 1 at host:port)``, the address from
  ``workers`` (the cluster's addresses by task) if it has the task.
  """
  spec = tf.DeviceSpec.from_string(device)
  if spec.job in (None, "localhost") or spec.task is None:
    return spec.to_string().rsplit("/", 1)[-1] or device
  address = f" at {workers[spec.task]}" if 0 <= spec.task < len(workers) else ""
  return f"{spec.to_string()} ({spec.job} {spec.task}{address})"


def step_failed(error: tf.errors.OpError, locate: Callable[[str], tuple[str, str] | None] | None,
                devices: tuple[str, ...], restored: bool, workers: Sequence[str] = ()) -> Exception:
  """The one-line error to raise (``from error``) for ``error``, a failed call of a step on ``devices``.

  ``workers``: the cluster's worker addresses by task (a multi-worker Replicator's), to name a device's worker.
  """
  first, nodes = parse(error.message)
  first = " ".join(first.split())
  node = nodes[0] if nodes else None
  found = locate(node) if (locate is not None and node is not None) else None
  where = ""
  if found is not None:
    op, location = found
    where = f" at {location} (op {op!r})"
  elif node is not None:
    where = f" (node {node!r})"
  replicas = failing_replicas(nodes)
  failed = tuple(devices[r] for r in replicas if r < len(devices)) if replicas is not None else ()
  on = ""
  if failed:
    names = ", ".join(device_name(d, workers) for d in failed)
    on = f" on {names}"
  state = NOTHING_WRITTEN + NOTHING_WRITTEN_INPUT if restored else MAY_BE_TORN
  if found is not None and " #" in found[0] and _SHAPES.search(first):  # a collective of the rewrite: say why
    shapes = _INPUT_SHAPES.search(first)
    first = COLLECTIVE_SHAPES.format(kind=found[0].split()[0], found=(
        f"shapes {shapes.group(1)} and {shapes.group(2)}" if shapes else f"TensorFlow: {first}"))
  message = f"The step failed{on}{where}: {first}. {state}. The TensorFlow error is this error's __cause__."
  cls = _class_for(type(error))
  try:
    if type(error) is tf.errors.OpError:
      result = cls(error.node_def, error.op, message, error.error_code)
    else:
      result = cls(error.node_def, error.op, message)
  except TypeError:  # an OpError subclass with another signature: our class alone
    result = _errors.StepFailedError(message)
  result.op, result.location, result.devices, result.restored = (
      found[0] if found else None, found[1] if found else None, failed, restored)
  return result


def after_failure(error: tf.errors.OpError, snapshot, written, locate, devices: tuple[str, ...],
                  workers: Sequence[str] = ()) -> Exception:
  """After a call of a step failed with ``error``: restores what it wrote (``snapshot``), and the error to raise.

  Returns ``error`` itself for the end of the input (``OutOfRangeError``: the
  caller says it its way), a ``ReplicasDivergedError`` if, without a snapshot,
  the replicated copies the step writes (``written``) now differ, else
  :func:`step_failed`'s one-line error.
  """
  if snapshot is not None:
    snapshot.restore()  # all or nothing: the call wrote nothing
  if isinstance(error, tf.errors.OutOfRangeError):
    return error
  found = written.diverged() if written is not None and snapshot is None else []
  if found:
    return _errors.ReplicasDivergedError(
        _consistency.DIVERGED.format(error=_errors.root_cause(error.message), **_consistency.describe(found)), found)
  return step_failed(error, locate, devices, snapshot is not None, workers)
