"""Named-axis device meshes.

A :class:`Mesh` names the axes of an n-dimensional array of devices. A
:class:`replicator.Replicator` runs one replica per mesh device; collectives
communicate within the device groups of named axes. A :class:`Layout` says how
a tensor is split over the axes; :class:`LayoutMap` and :class:`LayoutRules`
choose layouts for a model's variables; :func:`shard`, :func:`pack`,
:func:`unpack` and :func:`relayout` convert between global values and
per-device pieces.
"""

from mesh import _requirements  # noqa: F401  (first: checks the Python, TensorFlow and Keras versions)
from mesh._devices import canonical_name
from mesh._devices import local_devices
from mesh._devices import virtual_cpus
from mesh._errors import DeviceError
from mesh._errors import LayoutError
from mesh._errors import MeshError
from mesh._layout import Layout
from mesh._layout import LayoutMap
from mesh._layout import LayoutRules
from mesh._mesh import Mesh
from mesh._sharded import ShardedTensor
from mesh._sharded import assemble
from mesh._sharded import global_shape
from mesh._sharded import pack
from mesh._sharded import relayout
from mesh._sharded import shard
from mesh._sharded import split
from mesh._sharded import unpack

for _error in (DeviceError, LayoutError, MeshError):  # printed as mesh.MeshError, not mesh._errors.MeshError
  _error.__module__ = __name__
del _error

__all__ = (
    "DeviceError",
    "Layout",
    "LayoutError",
    "LayoutMap",
    "LayoutRules",
    "Mesh",
    "MeshError",
    "ShardedTensor",
    "assemble",
    "canonical_name",
    "global_shape",
    "local_devices",
    "pack",
    "relayout",
    "shard",
    "split",
    "unpack",
    "virtual_cpus",
)
