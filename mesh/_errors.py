"""Errors raised by the mesh package, and the library's base classes.

Every error a user of the library can cause (in ``mesh``, ``rewrite`` or
``replicator``) is a :class:`ReplicatorError`, so one ``except`` catches them
all; each also subclasses the built-in error it is (``ValueError``,
``TypeError``, ...). The base classes live here, in the package the others
import, and ``replicator`` re-exports them.
"""


class ReplicatorError(Exception):
  """Base class of the errors this library raises for user mistakes."""

  # Exception's own constructor (not ValueError's, ...): AutoGraph re-raises an error from code it converted (a
  # tf.function's) as the same class only if that class is built by Exception.__init__, else as its StagingError.
  __init__ = Exception.__init__


class ArgumentError(ReplicatorError, ValueError):
  """An argument has a value the library cannot use."""


class ArgumentTypeError(ReplicatorError, TypeError):
  """An argument has a type the library cannot use."""


class UnsupportedError(ReplicatorError, NotImplementedError):
  """A combination the library does not support (the message says what to do instead)."""


class MeshError(ReplicatorError, ValueError):
  """A mesh, its axes or its devices are inconsistent."""


class DeviceError(MeshError):
  """A device string is unknown, duplicated, or devices cannot be configured."""


class LayoutError(MeshError):
  """A layout cannot be used: unknown or reused mesh axes, or dimensions that do not divide."""


# replicator re-exports these four, and they print as its errors do (replicator.ArgumentError, not
# mesh._errors.ArgumentError) in every program, whether or not it has imported replicator; mesh's own print as
# mesh.MeshError (mesh/__init__.py).
for _error in (ReplicatorError, ArgumentError, ArgumentTypeError, UnsupportedError):
  _error.__module__ = "replicator"
del _error
