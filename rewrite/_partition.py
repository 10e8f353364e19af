"""The global view's partitioner: layout propagation and per-device expansion, wired together.

1. :func:`propagate` gives every tensor of a traced global graph a layout, op
   by op, from its inputs' layouts and the op's rule (``_propagation``).
2. ``_expansion.expand`` makes every device's copy of the partitioned graph,
   as one ``GraphDef`` with collective placeholders (``_expansion``).

Rules of ops that call functions (an ``If``'s branches) partition and expand
the bodies with this module's :data:`BODIES`, which the propagation hands to
them with each op: the rules import neither the propagation nor the
expansion, and the propagation does not import the expansion.
"""

from __future__ import annotations

import tensorflow as tf

from rewrite import _expansion
from rewrite import _propagation
from rewrite.rules import _base
from rewrite.rules import _random


def propagate(graph: tf.Graph, mesh, given: dict, handle_shapes: dict | None = None,
              summed: frozenset = frozenset(), data: frozenset = frozenset(),
              batch_axes: tuple = (), random_salt: int | None = None, pinned: dict | None = None
              ) -> _propagation.Partition:
  """Layouts for every tensor of ``graph``: :func:`_propagation.propagate`, function bodies by :data:`BODIES`.

  ``random_salt``: the seed the graph's unseeded stateful random ops get (``rules._random``); None: one drawn
  at random for the graph. Processes of one job that expand one graph each must pass the same. ``pinned``: op
  name -> the layout of its output, stated by the step (see :func:`_propagation.propagate`).
  """
  if random_salt is not None:
    _random.use_salt(graph, random_salt)
  return _propagation.propagate(graph, mesh, given, handle_shapes, summed, data, batch_axes, bodies=BODIES,
                                pinned=pinned)


def propagator(graph: tf.Graph, mesh, handle_shapes: dict | None = None, summed: frozenset = frozenset(),
               data: frozenset = frozenset(), batch_axes: tuple = (), alike: bool = False,
               pinned: dict | None = None) -> _propagation.Propagator:
  """A :class:`_propagation.Propagator` (:func:`propagate` under many assignments), bodies by :data:`BODIES`."""
  return _propagation.Propagator(graph, mesh, handle_shapes, summed, data, batch_axes, alike, bodies=BODIES,
                                 pinned=pinned)


BODIES = _base.Bodies(propagate=propagate, expand_on_device=_expansion.expand_on_device)  # what the rules for If use
