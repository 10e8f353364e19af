"""Errors raised while planning and applying the collective rewrite."""

from mesh._errors import ArgumentError  # noqa: F401  (the library's base classes: mesh/_errors.py)
from mesh._errors import ReplicatorError
from mesh._errors import UnsupportedError  # noqa: F401

MISMATCH_FOOTER = (
    "Every replica must make the same collective calls in the same order, with the "
    "same op, dtype and shape. A common cause is Python control flow on the replica "
    "id (e.g. `if repl.replica_id == 0: repl.all_reduce(x)`). Fix: make the same "
    "calls on every replica; to use one replica's value, compute it on all replicas "
    "and pick it with repl.broadcast(x, source=i)."
)


class RewriteError(ReplicatorError, RuntimeError):
  """The rewrite pass cannot turn placeholders into collectives."""


class CollectiveMismatchError(ReplicatorError, ValueError):
  """Replicas disagree on the collectives they call.

  Attributes:
    replicas: the two replica ids that disagree.
    call_index: position, in call order, of the first disagreeing collective.
  """

  def __init__(self, message: str, replicas: tuple[int, int], call_index: int):
    super().__init__(message)
    self.replicas = replicas
    self.call_index = call_index
