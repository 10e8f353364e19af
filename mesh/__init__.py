"""Named-axis device meshes.

A :class:`Mesh` names the axes of an n-dimensional array of devices. A
:class:`replicator.Replicator` runs one replica per mesh device; collectives
communicate within the device groups of named axes.
"""

from mesh._devices import canonical_name
from mesh._devices import local_devices
from mesh._devices import virtual_cpus
from mesh._errors import DeviceError
from mesh._errors import MeshError
from mesh._mesh import Mesh

__all__ = (
    "DeviceError",
    "Mesh",
    "MeshError",
    "canonical_name",
    "local_devices",
    "virtual_cpus",
)
