"""replicator: run a single-device TensorFlow 2 training step on many devices.

Examples:
  >>> import replicator
  >>> repl = replicator.Replicator(devices=["cpu:0", "cpu:1"])
  >>> repl.num_replicas
  2
"""

from mesh import virtual_cpus
from replicator import testing
from replicator._keras_hooks import distribution_replicator
from replicator._keras_hooks import enable_keras_distribution
from replicator._machine import calibrate
from replicator._multiworker import MultiWorkerReplicator
from replicator._replicator import Replicator
from replicator._version import __version__ as __version__  # re-exported
from replicator.core._context import current
from replicator.core._errors import ArgumentError
from replicator.core._errors import ArgumentTypeError
from replicator.core._errors import ClusterConfigError
from replicator.core._errors import CollectiveInControlFlowError
from replicator.core._errors import CollectiveMismatchError
from replicator.core._errors import DeviceError
from replicator.core._errors import EndOfInput
from replicator.core._errors import InputMismatchError
from replicator.core._errors import OutputMismatchError
from replicator.core._errors import ReplicaContextError
from replicator.core._errors import ReplicaInvarianceError
from replicator.core._errors import ReplicasDivergedError
from replicator.core._errors import ReplicatorError
from replicator.core._errors import StepFailedError
from replicator.core._errors import UnreplicatedStateError
from replicator.core._errors import UnsupportedError
from replicator.core._errors import VariableCreationError
from replicator.core._errors import WorkerUnavailableError
from replicator.core._values import PerReplica
from replicator.input._inputs import InputContext
from replicator.integrations._batch_norm import CrossReplicaBatchNorm
from replicator.state._optimizer import ReplicatedOptimizer
from replicator.state._variables import ReplicatedVariable
from replicator.state._variables import bytes_per_device

# Errors print as replicator.VariableCreationError, not replicator.core._errors.VariableCreationError.
for _error in (ArgumentError, ArgumentTypeError, ClusterConfigError, CollectiveInControlFlowError, EndOfInput,
               InputMismatchError, OutputMismatchError, ReplicaContextError, ReplicaInvarianceError,
               ReplicasDivergedError, ReplicatorError, StepFailedError,
               UnreplicatedStateError, UnsupportedError, VariableCreationError, WorkerUnavailableError):
  _error.__module__ = __name__
del _error

__all__ = (
    "ArgumentError",
    "ArgumentTypeError",
    "ClusterConfigError",
    "CollectiveInControlFlowError",
    "CollectiveMismatchError",
    "CrossReplicaBatchNorm",
    "DeviceError",
    "EndOfInput",
    "InputContext",
    "InputMismatchError",
    "MultiWorkerReplicator",
    "OutputMismatchError",
    "PerReplica",
    "ReplicaContextError",
    "ReplicasDivergedError",
    "ReplicaInvarianceError",
    "ReplicatedOptimizer",
    "ReplicatedVariable",
    "Replicator",
    "ReplicatorError",
    "StepFailedError",
    "UnreplicatedStateError",
    "UnsupportedError",
    "VariableCreationError",
    "WorkerUnavailableError",
    "bytes_per_device",
    "calibrate",
    "current",
    "distribution_replicator",
    "enable_keras_distribution",
    "testing",
    "virtual_cpus",
)
