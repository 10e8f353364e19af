"""The collectives a step calls, as methods of the Replicator (``repl.all_reduce(...)`` and the others).

Each method checks that a step of this Replicator is being built and leaves a
placeholder (``_primitives``) that the rewrite matches across replicas and
lowers to real communication. ``Replicator`` inherits them; its own module
keeps the API's face (construction, variables, ``run``, results).
"""

from __future__ import annotations

import tensorflow as tf

from replicator.core import _context
from replicator.core import _errors
from replicator.core import _halo
from replicator.core import _layout_constraint
from replicator.core import _primitives
from replicator.core import _ring_attention
from replicator.core import _ulysses_attention


@_context.no_autograph
class CollectiveMethods:
  """``all_reduce``, ``all_sum``, ``broadcast``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``permute``, ``axis_index``.

  Mixed into :class:`replicator.Replicator`; ``self._mesh`` is its mesh.
  """

  def _axes(self, axis) -> tuple[str, ...]:
    return self._mesh.normalize_axes(axis)

  def all_reduce(self, x, op: str = "sum", *, axis=None):
    """Reduces ``x`` (any nest of tensors) elementwise across replicas; all get the result.

    A ``tf.IndexedSlices`` leaf with op "sum" or "mean" stays sparse: the
    result is ``tf.IndexedSlices`` holding every replica's rows and indices,
    in replica order (for "mean" the rows divided by the number of
    replicas), whose dense value is the sum (mean). "max" and "min" of
    ``tf.IndexedSlices`` are an error.

    Examples:
      >>> repl = Replicator(devices=["cpu:0", "cpu:1"])
      >>> def step_fn():
      ...   rows = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([repl.replica_id]), tf.constant([4, 2]))
      ...   return repl.all_reduce(rows).indices
      >>> [t.numpy().tolist() for t in repl.run(step_fn)]
      [[0, 1], [0, 1]]

    Args:
      x: a tensor or nest of tensors.
      op: "sum", "mean", "max" or "min".
      axis: mesh axis name or tuple of names to reduce over (default: all).
    """
    ctx = _primitives.require_context(self, "all_reduce")
    return _primitives.all_reduce(ctx, x, op, self._axes(axis), _primitives.user_location())

  def all_sum(self, x, *, axis=None):
    """``all_reduce(x, "sum")``."""
    ctx = _primitives.require_context(self, "all_sum")
    return _primitives.all_reduce(ctx, x, "sum", self._axes(axis), _primitives.user_location())

  def broadcast(self, x, source: int = 0, *, axis=None):
    """Every replica gets replica ``source``'s value of ``x`` (any nest)."""
    ctx = _primitives.require_context(self, "broadcast")
    return _primitives.broadcast(ctx, x, source, self._axes(axis), _primitives.user_location())

  def all_gather(self, x, axis=None, *, concat_dimension: int = 0):
    """Concatenates the group's ``x`` (any nest) along tensor dimension ``concat_dimension``.

    Every member of a group gets the members' values in group order (see
    :meth:`axis_index`). If the dimension has no static size (a batch
    dimension, say), members may hold different sizes along it.

    Examples:
      >>> repl = Replicator(devices=["cpu:0", "cpu:1"])
      >>> out = repl.run(lambda: repl.all_gather(tf.fill([1, 2], repl.replica_id)))
      >>> out[1].numpy().tolist()
      [[0, 0], [1, 1]]

    Args:
      x: a tensor or nest of tensors of rank >= 1.
      axis: mesh axis name or tuple of names to gather over (default: all).
      concat_dimension: the tensor dimension to concatenate along.

    Raises:
      TypeError: ``axis`` is an int. ``axis`` names mesh axes, as for every
        collective; the tensor dimension is ``concat_dimension``.
    """
    ctx = _primitives.require_context(self, "all_gather")
    if isinstance(axis, int):
      raise _errors.ArgumentTypeError(_primitives.ALL_GATHER_INT_AXIS.format(axis=axis, names=self._mesh.axis_names))
    return _primitives.all_gather(ctx, x, concat_dimension, self._axes(axis), _primitives.user_location())

  def reduce_scatter(self, x, op: str = "sum", *, axis=None, scatter_dimension: int = 0):
    """Reduces ``x`` (any nest) over the group; member i gets chunk i of the result.

    The result is split into as many equal chunks along ``scatter_dimension``
    as the group has members; the member at group position i (see
    :meth:`axis_index`) gets chunk i. Equal to slicing :meth:`all_reduce`'s
    result, with less communication.

    Examples:
      >>> repl = Replicator(devices=["cpu:0", "cpu:1"])
      >>> out = repl.run(lambda: repl.reduce_scatter(tf.range(4) * (repl.replica_id + 1)))
      >>> [t.numpy().tolist() for t in out]  # [0, 1, 2, 3] + [0, 2, 4, 6], split in two
      [[0, 3], [6, 9]]

    The gradient is the members' upstream gradients gathered (for ``"mean"``
    divided by the group size); for ``"max"``/``"min"`` it flows to the members
    holding the extreme value, split equally between ties, as for
    :meth:`all_reduce`.

    Args:
      x: a tensor or nest of numeric tensors of rank >= 1.
      op: "sum", "mean", "max" or "min".
      axis: mesh axis name or tuple of names to reduce over (default: all).
      scatter_dimension: the tensor dimension to split; its static size must
        be a multiple of the group size.
    """
    ctx = _primitives.require_context(self, "reduce_scatter")
    return _primitives.reduce_scatter(ctx, x, op, scatter_dimension, self._axes(axis), _primitives.user_location())

  def all_to_all(self, x, *, axis=None, split_dimension: int = 0, concat_dimension: int = 0):
    """Exchanges chunks of ``x`` (any nest) between all members of the group.

    Member i splits its ``x`` into as many equal chunks along
    ``split_dimension`` as the group has members and sends chunk j to member
    j; every member concatenates the chunks it receives, in the order of their
    sources' group positions, along ``concat_dimension``.

    Examples:
      >>> repl = Replicator(devices=["cpu:0", "cpu:1"])
      >>> out = repl.run(lambda: repl.all_to_all(tf.constant([10, 20]) + repl.replica_id))
      >>> [t.numpy().tolist() for t in out]  # [10, 20] and [11, 21] exchange halves
      [[10, 11], [20, 21]]

    Args:
      x: a tensor or nest of tensors of rank >= 1.
      axis: mesh axis name or tuple of names to exchange over (default: all).
      split_dimension: the tensor dimension to split; its static size must be
        a multiple of the group size.
      concat_dimension: the tensor dimension to concatenate the received
        chunks along.
    """
    ctx = _primitives.require_context(self, "all_to_all")
    return _primitives.all_to_all(ctx, x, split_dimension, concat_dimension, self._axes(axis),
                                  _primitives.user_location())

  def permute(self, x, *, axis=None, perm):
    """Sends ``x`` (any nest) from group members to others, as listed in ``perm``.

    For every pair ``(source, destination)`` of group positions (see
    :meth:`axis_index`) in ``perm``, the member at ``destination`` gets the
    value of the member at ``source``. Members that are no destination get
    zeros. Each position may be a source once and a destination once.

    Examples:
      >>> repl = Replicator(devices=["cpu:0", "cpu:1"])
      >>> out = repl.run(lambda: repl.permute(tf.fill([2], repl.replica_id + 1), perm=[(0, 1)]))
      >>> [t.numpy().tolist() for t in out]  # replica 1 gets replica 0's value
      [[0, 0], [1, 1]]

    Args:
      x: a tensor or nest of tensors.
      axis: mesh axis name or tuple of names whose groups the positions refer
        to (default: all).
      perm: a list of ``(source, destination)`` pairs, e.g. a ring shift
        ``[(i, (i + 1) % n) for i in range(n)]``.
    """
    ctx = _primitives.require_context(self, "permute")
    return _primitives.permute(ctx, x, perm, self._axes(axis), _primitives.user_location())

  def halo_exchange(self, x, *, axis=None, dim: int, width, periodic: bool = False):
    """``x``, a tile of a dimension split over ``axis``, extended by its neighbours' boundary rows along ``dim``.

    Each member gets ``before`` rows of its predecessor's tile (group position minus one) before its own and
    ``after`` rows of its successor's after it (``width``: an int for both, or ``(before, after)``); the first
    and last members get zeros there (a ``"SAME"`` convolution's padding), or, with ``periodic``, the other
    end's rows. Two point-to-point ``permute``s of the boundary rows; their gradients flow back the same way.
    A ``"VALID"`` convolution of the extended tile is then the tile of the whole image's ``"SAME"``
    convolution (an odd kernel ``k`` at stride 1: ``width=(k - 1) // 2``). Split over two axes, exchange the
    rows, then the columns of the result (the corners come with it).

    Examples:
      >>> repl = Replicator(devices=["cpu:0", "cpu:1"])
      >>> def step_fn():
      ...   tile = tf.fill([2], repl.replica_id + 1)     # rows [1, 1] on device 0, [2, 2] on device 1
      ...   return repl.halo_exchange(tile, dim=0, width=1)
      >>> [t.numpy().tolist() for t in repl.run(step_fn)]
      [[0, 1, 1, 2], [1, 2, 2, 0]]

    Args:
      x: a tensor, this member's tile.
      axis: mesh axis name or tuple of names that split the dimension (default: all).
      dim: the tensor dimension split over ``axis``.
      width: rows wanted from each neighbour: an int, or ``(before, after)``.
      periodic: whether the first and last members are neighbours.
    """
    ctx = _primitives.require_context(self, "halo_exchange")
    return _halo.halo_exchange(ctx, x, dim, width, self._axes(axis), periodic, _primitives.user_location())

  def ring_attention(self, q, k, v, *, axis=None, causal: bool = False, order: str = "contiguous",
                     key_mask=None, scale=None, exchange: str = "auto", window: int | None = None,
                     segment_ids=None):
    """Attention over a sequence split over ``axis``: this member's queries against every member's keys.

    ``q``, ``k``, ``v``: this member's tokens, ``[batch, tokens, heads, head size]``; the result is this
    member's rows of ``softmax(q k^T * scale + mask) v`` over the whole sequence. The key and value blocks
    travel around the ring of members (``permute``, point to point), each member folding each block into an
    online softmax: no member holds or gathers the scores of the whole sequence (a member's scores are
    ``1 / P`` of one device's), and the gradients ride the ring back. Masks are built from global positions
    (``order``: which tokens each member holds, see :func:`replicator.sequence_positions`), so a causal mask
    means what it means on one device in either order. Pieces of blocks no query may see by ``causal`` and
    ``window`` are skipped: with a causal mask, ``order="zigzag"`` gives every member the same work (about half
    of the scores), the contiguous order member ``i`` ``i + 1`` blocks of ``P``.

    Examples:
      >>> import numpy as np
      >>> repl = Replicator(devices=["cpu:0", "cpu:1"])
      >>> x = np.random.default_rng(0).normal(size=(1, 4, 1, 2)).astype("float32")   # 4 tokens, 1 head
      >>> def step_fn():
      ...   mine = replicator.shard_sequence(x, repl.replica_id, 2)   # 2 tokens each
      ...   return repl.ring_attention(mine, mine, mine, causal=True)
      >>> out = replicator.unshard_sequence(list(repl.run(step_fn)))
      >>> scores = np.einsum("bqhd,bkhd->bhqk", x, x) / np.sqrt(2) + np.triu(np.full((4, 4), -1e9), 1)
      >>> weights = np.exp(scores - scores.max(-1, keepdims=True))
      >>> expected = np.einsum("bhqk,bkhd->bqhd", weights / weights.sum(-1, keepdims=True), x)
      >>> bool(np.allclose(out, expected, atol=1e-6))
      True

    Args:
      q: this member's queries, ``[batch, tokens, heads, head size]``.
      k: its keys, ``[batch, tokens, heads, head size]`` (the same tokens; fewer heads for grouped-query
        attention, the query heads a multiple of them: each key head serves that many query heads in a row, as
        ``tf.repeat(k, groups, axis=2)`` gives them, and travels unrepeated).
      v: its values, ``[batch, tokens, heads, value size]``.
      axis: mesh axis name or tuple of names the sequence is split over (default: all).
      causal: whether a query attends only to keys at its position or before (global positions).
      order: ``"contiguous"`` or ``"zigzag"``: which tokens each member holds.
      key_mask: optional ``[batch, tokens]`` booleans, True where this member's keys may be attended.
      window: optional sliding window: a query sees keys fewer than ``window`` positions from it (with
        ``causal``, the ``window`` positions up to its own), by global positions.
      segment_ids: optional ``[batch, tokens]`` ints, this member's tokens' segments (packed sequences): a
        query sees only keys of its segment.
      scale: the scores' factor (default ``head size ** -0.5``).
      exchange: how the blocks travel: ``"ring"`` (``P - 1`` point-to-point steps), ``"all_gather"`` (one
        all-gather of the keys and values; their gradients reduce-scattered home), or ``"auto"``: the ring in
        one process, the all-gather where the axis spans worker processes (one collective there, not ``P - 1``
        rounds of sends between the processes).
    """
    ctx = _primitives.require_context(self, "ring_attention")
    return _ring_attention.ring_attention(ctx, q, k, v, self._axes(axis), causal, order, key_mask, scale,
                                          _primitives.user_location(), exchange, window, segment_ids)

  def ulysses_attention(self, q, k, v, *, axis=None, causal: bool = False, order: str = "contiguous",
                        key_mask=None, scale=None, window: int | None = None, segment_ids=None):
    """:meth:`ring_attention`'s result by DeepSpeed-Ulysses's exchange: the sequence split traded for the heads'.

    An all-to-all over ``axis`` gives each member every token of ``heads / P`` of the heads; it computes their
    attention whole, and a second all-to-all returns its tokens of every head. Two all-to-alls a call, whatever
    the sequence's length (the ring passes ``P - 1`` blocks); each member holds its heads' scores, ``1 / P``
    of one device's. The heads must divide over the axis (a named error otherwise). Arguments as
    :meth:`ring_attention`'s.
    """
    ctx = _primitives.require_context(self, "ulysses_attention")
    return _ulysses_attention.ulysses_attention(ctx, q, k, v, self._axes(axis), causal, order, key_mask, scale,
                                                _primitives.user_location(), window, segment_ids)

  def axis_index(self, axis=None) -> tf.Tensor:
    """This replica's position in its group along ``axis``: an int32 scalar tensor.

    Positions are row-major over a tuple of axes (the last varies fastest) and
    match the group order of the collectives. No communication: the value is
    a constant known while the step is built.

    Examples:
      >>> import mesh
      >>> m = mesh.Mesh({"batch": 2, "model": 2}, devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
      >>> repl = Replicator(mesh=m)
      >>> [int(i) for i in repl.run(lambda: repl.axis_index("model"))]
      [0, 1, 0, 1]

    Args:
      axis: mesh axis name or tuple of names (default: all, which gives the
        replica id).
    """
    ctx = _primitives.require_context(self, "axis_index")
    return _primitives.axis_index(ctx, self._axes(axis))

  def with_layout(self, x, spec):
    """``x``, laid out as ``spec`` from here on, in a global-view step (a layout constraint).

    The global view lays out what a step computes by its rules; this states a
    layout for one value (a nest: each tensor), as JAX's
    ``with_sharding_constraint`` and DTensor's ``relayout`` do. The value is
    relayouted to ``spec`` where it is computed (``explain`` lists the
    collectives, their reason "the layout the step states for it"), the ops
    before it are asked for the layout and produce it directly where their
    rules can, and its gradient is stated the same layout. Keras's
    ``LayoutMap`` keys for layer outputs (``"<layer path>/output"``) call it
    on the layer's output. Values are unchanged; only where their pieces live.

    Examples:
      >>> import mesh
      >>> m = mesh.Mesh({"batch": 2, "model": 2}, devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
      >>> repl = Replicator(mesh=m, view="global")
      >>> def step_fn(x):
      ...   h = repl.with_layout(tf.matmul(x, tf.ones([4, 8])), ("batch", "model"))
      ...   return tf.reduce_sum(h)
      >>> float(repl.run(step_fn, inputs=tf.ones([4, 4])))
      128.0

    Args:
      x: a tensor or nest of tensors of the step.
      spec: one entry per dimension: a mesh axis name, a tuple of names, or None (whole); or a
        ``mesh.Layout`` or ``keras.distribution.TensorLayout`` (their axes).

    Raises:
      ReplicaContextError: outside a global-view step of this Replicator (the local view's replicas hold their
        own values: ``all_gather``, ``all_to_all`` and ``reduce_scatter`` move pieces there).
      mesh.LayoutError: an axis the mesh lacks, or a dimension its axes do not divide (when the step is built).
    """
    return _layout_constraint.with_layout(self, x, spec, location=_primitives.user_location())
