"""replicator: run a single-device TensorFlow 2 training step on many devices.

Examples:
  >>> import replicator
  >>> repl = replicator.Replicator(devices=["cpu:0", "cpu:1"])
  >>> repl.num_replicas
  2
"""

from mesh import virtual_cpus
from replicator import testing
from replicator._context import current
from replicator._errors import ArgumentError
from replicator._errors import ArgumentTypeError
from replicator._errors import ClusterConfigError
from replicator._errors import CollectiveInControlFlowError
from replicator._errors import CollectiveMismatchError
from replicator._errors import DeviceError
from replicator._errors import EndOfInput
from replicator._errors import InputMismatchError
from replicator._errors import OutputMismatchError
from replicator._errors import ReplicaContextError
from replicator._errors import ReplicaInvarianceError
from replicator._errors import ReplicasDivergedError
from replicator._errors import ReplicatorError
from replicator._errors import StepFailedError
from replicator._errors import UnreplicatedStateError
from replicator._errors import UnsupportedError
from replicator._errors import VariableCreationError
from replicator._errors import WorkerUnavailableError
from replicator._machine import calibrate
from replicator._replicator import Replicator
from replicator._values import PerReplica
from replicator._version import __version__ as __version__  # re-exported
from replicator.input._inputs import InputContext
from replicator.integrations._batch_norm import CrossReplicaBatchNorm
from replicator.integrations._keras_hooks import distribution_replicator
from replicator.integrations._keras_hooks import enable_keras_distribution
from replicator.integrations._multiworker import MultiWorkerReplicator
from replicator.state._optimizer import ReplicatedOptimizer
from replicator.state._variables import ReplicatedVariable
from replicator.state._variables import bytes_per_device

# Errors print as replicator.VariableCreationError, not replicator._errors.VariableCreationError.
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
