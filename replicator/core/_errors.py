"""Errors a user of the replicator can cause, each saying what to change."""

import re

from mesh import DeviceError  # noqa: F401  (re-exported)
from mesh._errors import ArgumentError  # noqa: F401  (the library's base classes: mesh/_errors.py)
from mesh._errors import ArgumentTypeError  # noqa: F401
from mesh._errors import ReplicatorError
from mesh._errors import UnsupportedError  # noqa: F401
from rewrite import CollectiveMismatchError  # noqa: F401  (re-exported)


def positive_int(value) -> bool:
  """Whether ``value`` is an ``int`` of at least 1, not a ``bool``: the check of a count a user gives."""
  return isinstance(value, int) and not isinstance(value, bool) and value >= 1


NO_REPLICA_CONTEXT = (
    "repl.{name}() was called outside a replica context. Collectives and "
    "repl.replica_id only exist while a step is being built, i.e. inside the "
    "step_fn passed to repl.run(step_fn, ...). Fix: call it from inside step_fn{extra}."
)
IN_CONTROL_FLOW = (
    "repl.{name}() was called inside a tf.cond / tf.while_loop / tf.function body "
    "(graph {graph!r}) at {location}. A collective there may run a different number "
    "of times on each replica, so the rewrite cannot match it across replicas. Fix: "
    "move the collective out of the control-flow body (compute both branches and "
    "select with tf.where, or collect the values of a loop and reduce them once after it)."
)
OTHER_REPLICATOR = (
    "repl.{name}() was called on a Replicator whose step is not being built (the "
    "step being built belongs to another Replicator over {devices}). Fix: call the "
    "primitives of the Replicator that runs the step (see replicator.current())."
)


ACCUMULATING_STEPS = (
    "repl.run(steps={steps}) with an optimizer wrapped with accumulation_steps > 1 is not "
    "supported: each step needs its own phase (accumulate or apply). Fix: run one step per call."
)

END_OF_DATASET = (
    "The input is exhausted: the dataset passed to repl.run has no more global batches. End the loop "
    "here (catch replicator.EndOfInput, or StopIteration), or repeat the dataset (dataset.repeat()) for "
    "more epochs; the next call with this dataset starts a new epoch."
)
END_OF_INPUT = (
    "The input is exhausted: an input_fn dataset has no more elements. End the "
    "loop here (catch replicator.EndOfInput, or StopIteration), or repeat the "
    "dataset (dataset.repeat()) for more epochs."
)


class ReplicaContextError(ReplicatorError, RuntimeError):
  """A replica-only API was used outside a step being built."""


class CollectiveInControlFlowError(ReplicatorError, ValueError):
  """A collective was called inside a control-flow body, where it cannot be matched."""


class InputMismatchError(ReplicatorError, ValueError):
  """Per-replica inputs disagree in structure or dtype, or are malformed."""


class OutputMismatchError(ReplicatorError, ValueError):
  """Replicas returned values of different structure or dtype from step_fn."""


class VariableCreationError(ReplicatorError, ValueError):
  """A variable cannot be replicated as requested."""


class ReplicaInvarianceError(ReplicatorError, ValueError):
  """A step writes a replicated variable with values that differ between replicas, and no rule combines them."""


class UnreplicatedStateError(ReplicatorError, ValueError):
  """A step writes a variable that was created outside every Replicator context."""


class ReplicasDivergedError(ReplicatorError, RuntimeError):
  """A step failed at run time after some replicas had written their state: their copies differ.

  Attributes:
    variables: ``(name, replica a, replica b)`` for each variable whose copies differ.
  """

  def __init__(self, message: str, variables=()):
    super().__init__(message)
    self.variables = list(variables)


class StepFailedError(ReplicatorError, RuntimeError):
  """A step failed at run time (an assertion, a ``check_numerics``, a bad index).

  The error raised is also an instance of the TensorFlow error's class
  (``tf.errors.InvalidArgumentError``, ...), which is its ``__cause__``.

  Attributes:
    op: the name of the op that failed, as traced (None if unknown).
    location: the user's source line that made it ("file.py:12 in step_fn").
    devices: the devices TensorFlow reported a failing op on (the first to
      fail: the others are cancelled, and may not get to theirs); empty if the
      failing op's name does not tell (an op inside a ``tf.cond`` branch).
    restored: whether every variable the step writes was restored (``atomic``).
  """

  op: str | None = None
  location: str | None = None
  devices: tuple = ()
  restored: bool = False


class EndOfInput(ReplicatorError, StopIteration):
  """``repl.run`` found no more input: the epoch is over."""


class CheckpointDamagedError(ReplicatorError, RuntimeError):
  """The latest committed checkpoint cannot be restored: a file of it is missing, truncated or corrupted.

  Raised by the checkpoint manager's ``restore_or_initialize()``
  (:meth:`replicator.MultiWorkerReplicator.checkpoint_manager`); its
  ``__cause__`` is TensorFlow's error. The message names the file, what is
  wrong with it, and the earlier committed checkpoint to restore instead.

  Attributes:
    files: the damaged file (or the data files, one of which is, when TensorFlow does not tell which).
    checkpoint: the damaged checkpoint's path prefix (``.../ckpt-7``).
    previous: the newest earlier checkpoint the state file lists that reads whole (its path prefix), or None.
  """

  def __init__(self, message: str, files=(), checkpoint: str | None = None, previous: str | None = None):
    super().__init__(message)
    self.files = tuple(files)
    self.checkpoint = checkpoint
    self.previous = previous


class ClusterConfigError(ReplicatorError, ValueError):
  """A cluster specification or TF_CONFIG is malformed or inconsistent."""


class WorkerUnavailableError(ReplicatorError, RuntimeError):
  """A worker process is dead or unreachable.

  Attributes:
    task: the worker's task index (None if unknown).
    address: its ``host:port`` (None if unknown).
  """

  def __init__(self, message: str, task: int | None = None, address: str | None = None):
    super().__init__(message)
    self.task = task
    self.address = address


# Printed as replicator.VariableCreationError (their public name), not replicator.core._errors.VariableCreationError;
# set here, not in replicator/__init__.py, which imports this module only when one of its names is first used.
for _error in (CheckpointDamagedError, ClusterConfigError, CollectiveInControlFlowError, EndOfInput, InputMismatchError,
               OutputMismatchError, ReplicaContextError, ReplicaInvarianceError, ReplicasDivergedError, StepFailedError,
               UnreplicatedStateError, VariableCreationError, WorkerUnavailableError):
  _error.__module__ = "replicator"
del _error


def root_cause(message: str) -> str:
  """One readable line of a TensorFlow error: the first root error, without numbering and node lists.

  Examples:
    >>> root_cause("2 root error(s) found.\\n  (0) UNAVAILABLE: failed to connect\\n\\t [[{{node x}}]]")
    'UNAVAILABLE: failed to connect'
  """
  for line in message.splitlines():
    line = re.sub(r"^\(\d+\)\s*", "", line.strip())
    if line and not _NOISE.match(line):
      return _shortened(line)
  return _shortened(message.strip().splitlines()[0]) if message.strip() else ""


def _shortened(line: str, limit: int = 300) -> str:
  return line if len(line) <= limit else line[:limit - 3].rstrip() + "..."


_NOISE = re.compile(r"^(Graph execution error|Detected at node|File |<stack traces|\d+ root error\(s\) found|"
                    r"\[\[|0 successful operations|\d+ derived errors ignored|Additional GRPC error)")
