"""TensorFlow's non-public base classes the library derives from, in one place.

``CompositeTensor``: :class:`replicator.PerReplica` is one (as
``tf.distribute``'s ``PerReplica`` is), so that a ``tf.function`` takes it as
its values' tensors without retracing while ``tf.nest`` keeps it one leaf.
TensorFlow exports it only as ``tf.__internal__.CompositeTensor`` (checked on
TF 2.21.0); its public ``tf.TypeSpec`` describes it.

``Iterable`` and ``Iterator``, the base classes by which AutoGraph stages a
``for`` loop over distributed input:

Inside a ``tf.function``, AutoGraph turns ``for x in it:`` into a
``tf.while_loop`` only for objects it knows: tensors, ``tf.data`` datasets and
iterators, and ``tf.distribute``'s distributed datasets and iterators, which it
recognises by the base classes ``Iterable`` (it calls ``reduce``) and
``Iterator`` (it calls ``get_next_as_optional``). Any other Python iterable is
iterated by Python while the function is traced, which for an iterator over a
dataset never ends: its ``next`` gives symbolic batches and never stops.
``repl.distribute_dataset`` and its iterators derive from these two classes so
that loops over them are staged as tf.distribute's are.

They have no public alias (``tf.types.experimental.distributed`` exports
``PerReplica`` and ``Mirrored`` only), so this module is the one place that
imports them: ``tensorflow.python.types.distribute``, checked on TF 2.21.0
(``autograph/operators/control_flow.py``'s ``for_stmt``). Were they to move,
the fallback keeps the library importable; a loop over a distributed dataset in
a function is then unrolled, which ``tf.data`` refuses after a few dozen reads
of one iterator.
"""

from __future__ import annotations

import tensorflow as tf

CompositeTensor = tf.__internal__.CompositeTensor  # private: see the module docstring

try:
  from tensorflow.python.types import distribute as _distribute  # private: see the module docstring

  Iterable = _distribute.Iterable
  Iterator = _distribute.Iterator
except ImportError:  # pragma: no cover  (a TensorFlow that moved them)
  Iterable = Iterator = object
