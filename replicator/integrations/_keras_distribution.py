"""Keras's distribution objects, accepted where replicator takes its own.

Code written for Keras 3's distribution API (``keras.distribution.DeviceMesh``
and ``keras.distribution.LayoutMap``, whose TensorFlow backend is unfinished)
carries over: a ``DeviceMesh`` is the :class:`mesh.Mesh` of the same axis
names, shape and devices, a Keras ``LayoutMap`` the :class:`mesh.LayoutMap`
of the same patterns, matched as Keras 3.15 matches them (an exact key, else
the one key whose pattern matches the whole path, ``re.fullmatch``; a layout
shorter than the variable's rank padded with ``None``), and specs (each
``TensorLayout``'s ``axes``). Keys for layer outputs (``".../output"``) are
kept: :class:`mesh.LayoutMap` tells them from variables' keys, and a
global-view step lays out those layers' outputs (``_keras_outputs``).
Recognised by their attributes, so this module does not import Keras.
"""

from __future__ import annotations

import numpy as np

import mesh as mesh_lib


def is_device_mesh(obj) -> bool:
  return type(obj).__name__ == "DeviceMesh" and hasattr(obj, "axis_names") and hasattr(obj, "devices")


def is_layout_map(obj) -> bool:
  return type(obj).__name__ == "LayoutMap" and type(obj).__module__.startswith("keras")


def as_mesh(device_mesh) -> mesh_lib.Mesh:
  """The :class:`mesh.Mesh` of a ``keras.distribution.DeviceMesh`` (its devices in row-major order)."""
  devices = [str(d) for d in np.asarray(device_mesh.devices).reshape(-1)]
  return mesh_lib.Mesh(dict(zip(device_mesh.axis_names, device_mesh.shape)), devices=devices)


def as_layout_map(layout_map) -> mesh_lib.LayoutMap:
  """The :class:`mesh.LayoutMap` of a ``keras.distribution.LayoutMap``, with Keras's matching."""
  return mesh_lib.LayoutMap({key: tuple(getattr(layout, "axes", layout)) for key, layout in layout_map.items()},
                            match="fullmatch", pad=True)
