"""``replicator.calibrate``: the machine's rates for the global view's cost model.

Above the ``Replicator`` (it times the Replicator's own collectives), so it
binds the two: the measuring is ``_calibration``'s, which takes the class.
"""

from __future__ import annotations

from replicator import _replicator
from replicator.views import _calibration
from rewrite import _cost


def calibrate(devices=None, cache: bool = True) -> _cost.Machine:
  """The machine's rates for the global view's cost model, measured on ``devices`` (default: every CPU).

  Args:
    devices: device names (the logical CPUs of ``replicator.virtual_cpus``, say).
    cache: read a previous measurement of the same machine and devices, and keep this one.

  Returns:
    A ``rewrite._cost.Machine``, for ``PartitionReport.estimate``.
  """
  return _calibration.measure(devices, cache, _replicator.Replicator)
