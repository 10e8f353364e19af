"""Images split into tiles: ``rewrite.rules._spatial``'s windows and halo exchange, and the ops that use them.

The first tests check the machinery alone: the windows' geometry, and the
exchange (:func:`_spatial.extend`) and its transpose (:func:`_spatial.retract`)
run for every device of a simulated group, against numpy. The others run one
op at a time in the global view on tiles (``input_layouts`` splitting height
and width: 2x2 tiles, and 4x1 strips), forward and gradients, against
TensorFlow on one device; no case may fall back or gather an activation
(warnings are errors in the tests).
"""

import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus
from conftest import loss_and_grads

import mesh
import replicator
from rewrite.rules import _spatial

# -- the windows -------------------------------------------------------------------


def _window(size, pieces, kernel, stride=1, dilation=1, padding="SAME"):
  window, why = _spatial.sliding(1, ("rows",) if pieces > 1 else (), pieces, size, kernel, stride, dilation, padding)
  assert window is not None, why
  return window


def _reference_rows(window, p):
  """The rows of device p's window, by the definition: output rows [p*o, (p+1)*o) of the op, what they read."""
  return list(range(window.begin(p), window.begin(p) + window.length))


@pytest.mark.parametrize("size,pieces,kernel,stride,dilation,padding,before,after", [
    (16, 2, 3, 1, 1, "SAME", 1, 1),
    (16, 4, 3, 1, 1, "SAME", 1, 1),
    (16, 2, 5, 1, 1, "SAME", 2, 2),
    (16, 2, 1, 1, 1, "SAME", 0, 0),
    (16, 2, 3, 2, 1, "SAME", 0, 1),  # TensorFlow pads 1 row after, none before: the halo is one-sided
    (16, 2, 3, 1, 2, "SAME", 2, 2),
    (16, 2, 5, 1, 1, "VALID", 2, 2),  # 12 output rows, 6 a device: the windows drift by 2 rows a device
    (16, 4, 5, 1, 1, "VALID", 3, 3),
    (16, 2, 2, 2, 1, "VALID", 0, 0),  # a 2x2 pooling: within the tile
])
def test_a_sliding_window_reads_its_rows_from_the_neighbours(size, pieces, kernel, stride, dilation, padding, before,
                                                               after):
  window = _window(size, pieces, kernel, stride, dilation, padding)
  assert (window.before, window.after) == (before, after)
  effective = (kernel - 1) * dilation + 1
  out = -(-size // stride) if padding == "SAME" else (size - effective) // stride + 1
  pad = max((out - 1) * stride + effective - size, 0) // 2 if padding == "SAME" else 0
  o = out // pieces
  for p in range(pieces):  # device p's outputs [p*o, (p+1)*o) read rows [p*o*s - pad, ... + (o-1)*s + k_eff)
    assert _reference_rows(window, p) == list(range(p * o * stride - pad, p * o * stride - pad + (o - 1) * stride
                                                    + effective))
    tile = window.tile
    inside = [r for r in _reference_rows(window, p) if 0 <= r < size]
    assert min(inside) >= p * tile - (before if p else 0) and max(inside) < (p + 1) * tile + after


@pytest.mark.parametrize("size,pieces,kernel,stride,padding,why", [
    (16, 4, 3, 1, "VALID", "its 14 output rows do not split into 4 equal pieces"),
    (8, 4, 7, 1, "SAME", "a window needs 3 rows of a neighbour's tile, more than the 2 a tile has"),
    (8, 4, 3, 2, "VALID", "its 3 output rows do not split into 4 equal pieces"),
])
def test_a_window_that_cannot_be_made_from_the_neighbours_says_why(size, pieces, kernel, stride, padding, why):
  window, problem = _spatial.sliding(1, ("rows",), pieces, size, kernel, stride, 1, padding)
  assert window is None and why in problem


# -- the exchange, simulated -------------------------------------------------------


class _Group:
  """Every device's ``permute``s, simulated: run each device's calls again until what they receive settles.

  Device ``d`` receives, from the call ``k`` of device ``s`` (a pair ``(s, d)``
  along the call's axes), what ``s`` sent in the previous round; rows are
  exchanged before columns, so the rounds settle after as many as there
  are calls.
  """

  def __init__(self, positions):
    self.positions = positions  # device -> {axes: position}
    self.sent = {}  # (device, call index) -> the value sent, in the previous round

  def comm(self, r, sent_now):
    group, calls = self, [0]

    class Comm:
      def permute(self, x, pairs, axes):
        k = calls[0]
        calls[0] += 1
        sent_now[(r, k)] = x
        me = group.positions[r][tuple(axes)]
        sources = [s for s, d in pairs if d == me]
        if not sources:
          return tf.zeros_like(x)
        (source,) = [q for q in group.positions if group.positions[q][tuple(axes)] == sources[0]
                     and all(v == group.positions[r][a] for a, v in group.positions[q].items() if a != tuple(axes))]
        return group.sent.get((source, k), tf.zeros_like(x))

    return Comm()

  def run(self, fn, rounds):
    for _ in range(rounds):
      sent_now = {}
      out = [fn(r, self.comm(r, sent_now)) for r in sorted(self.positions)]
      self.sent = sent_now
    return out


def _tiles_of(x, rows, cols):
  """Device r = i * cols + j's tile of x [n, h, w, c]: rows i, columns j."""
  h, w = x.shape[1] // rows, x.shape[2] // cols
  return {i * cols + j: x[:, i * h:(i + 1) * h, j * w:(j + 1) * w] for i in range(rows) for j in range(cols)}


@pytest.mark.parametrize("rows,cols,kernel,stride,padding,fill", [
    (2, 2, 3, 1, "SAME", 0.0), (4, 1, 5, 1, "SAME", 0.0), (2, 2, 3, 2, "SAME", -9.0), (2, 2, 5, 1, "VALID", 0.0),
    (1, 4, 3, 1, "SAME", -9.0)])
def test_extend_gives_each_device_its_window_and_retract_is_its_transpose(rows, cols, kernel, stride, padding, fill):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 16, 16, 3)).astype("float32")
  windows = [_spatial.sliding(1, ("rows",), rows, 16, kernel, stride, 1, padding)[0],
             _spatial.sliding(2, ("cols",), cols, 16, kernel, stride, 1, padding)[0]]
  if rows == 1:
    windows[0] = _spatial.sliding(1, (), 1, 16, kernel, stride, 1, padding)[0]
  if cols == 1:
    windows[1] = _spatial.sliding(2, (), 1, 16, kernel, stride, 1, padding)[0]
  group = _Group({i * cols + j: {("rows",): i, ("cols",): j} for i in range(rows) for j in range(cols)})
  tiles = _tiles_of(x, rows, cols)
  pos = lambda r: [r // cols, r % cols]  # noqa: E731
  got = group.run(lambda r, comm: _spatial.extend(tf.constant(tiles[r]), windows, pos(r), comm, fill), rounds=5)
  padded = np.pad(x, [(0, 0), (16, 16), (16, 16), (0, 0)], constant_values=fill)
  for r, window in enumerate(got):
    lo = [w.begin(p) + 16 for w, p in zip(windows, pos(r))]
    want = padded[:, lo[0]:lo[0] + windows[0].length, lo[1]:lo[1] + windows[1].length]
    np.testing.assert_array_equal(window.numpy(), want, err_msg=f"device {r}")
  # The transpose: <extend(x), g> summed over the devices equals <x, retract(g)> (fill 0: extend is then linear).
  if fill:
    return
  grads = [rng.normal(size=w.shape).astype("float32") for w in got]
  back = _Group(group.positions).run(
      lambda r, comm: _spatial.retract(tf.constant(grads[r]), windows, pos(r), comm), rounds=5)
  lhs = sum(float(np.sum(w.numpy() * g)) for w, g in zip(got, grads))
  rhs = sum(float(np.sum(tiles[r] * b.numpy())) for r, b in enumerate(back))
  np.testing.assert_allclose(lhs, rhs, rtol=1e-5)


def test_exchanges_count_the_bytes_each_permute_sends():
  windows = [_window(16, 2, 3), _spatial.sliding(2, ("cols",), 2, 16, 3, 1, 1, "SAME")[0]]
  sent = _spatial.exchanges(windows, [2, 8, 8, 3], 4, "Conv2D on tiles")
  # rows: 1 row of 8 columns, 3 channels, 2 images, each side; columns: of the row-extended tile, 10 rows.
  assert [(kind, axes, nbytes) for kind, axes, _, nbytes in sent] == [
      ("permute", ("rows",), 1 * 8 * 3 * 2 * 4), ("permute", ("rows",), 1 * 8 * 3 * 2 * 4),
      ("permute", ("cols",), 10 * 1 * 3 * 2 * 4), ("permute", ("cols",), 10 * 1 * 3 * 2 * 4)]
  back = _spatial.returns(windows, [2, 10, 10, 3], 4, "Conv2DBackpropInput on tiles")
  assert [(axes, nbytes) for _, axes, _, nbytes in back] == [
      (("cols",), 10 * 1 * 3 * 2 * 4), (("cols",), 10 * 1 * 3 * 2 * 4),
      (("rows",), 1 * 8 * 3 * 2 * 4), (("rows",), 1 * 8 * 3 * 2 * 4)]


def test_counts_are_the_rows_inside_each_pooling_window():
  window = _window(8, 2, 3)  # 3x3 SAME stride 1 on 8 rows in 2 tiles
  counts = _spatial.counts([window], [0], [3], [1], 4).reshape(-1)
  np.testing.assert_array_equal(counts, [2, 3, 3, 3])  # the first row's window has one row of padding
  counts = _spatial.counts([window], [1], [3], [1], 4).reshape(-1)
  np.testing.assert_array_equal(counts, [3, 3, 3, 2])


# -- ops on tiles, in the global view ----------------------------------------------

MESHES = {"2x2": {"rows": 2, "cols": 2}, "4x1": {"rows": 4}}


def _dilated(x, w):
  return tf.nn.convolution(x, w, padding="SAME", dilations=2)  # on CPU: SpaceToBatchND, Conv2D, BatchToSpaceND


CASES = {  # name -> (the op(s) of x [2, 16, 16, 3] and a kernel w [3, 3, 3, 4])
    "conv3x3_same": lambda x, w: tf.nn.conv2d(x, w, 1, "SAME"),
    "conv5x5_same": lambda x, w: tf.nn.conv2d(x, tf.tile(w, [2, 2, 1, 1])[:5, :5], 1, "SAME"),
    "conv5x5_valid": lambda x, w: tf.nn.conv2d(x, tf.tile(w, [2, 2, 1, 1])[:5, :5], 1, "VALID"),
    "conv1x1": lambda x, w: tf.nn.conv2d(x, w[:1, :1], 1, "SAME"),
    "conv3x3_stride2": lambda x, w: tf.nn.conv2d(x, w, 2, "SAME"),
    "conv3x3_dilation2_attr": lambda x, w: tf.nn.conv2d(x, w, 1, "SAME", dilations=2),
    "conv3x3_dilation2_space_to_batch": _dilated,
    "conv1d3_flat": lambda x, w: tf.nn.conv1d(tf.reshape(x, [2, 256, 3]), w[1], 1, "SAME"),
    "separable3x3": lambda x, w: tf.nn.separable_conv2d(x, w[..., :2], tf.reshape(w[:2, 0], [1, 1, 6, 4]), [1] * 4,
                                                        "SAME"),
    "depthwise3x3": lambda x, w: tf.nn.depthwise_conv2d(x, w[..., :2], [1, 1, 1, 1], "SAME"),
    "depthwise3x3_stride2": lambda x, w: tf.nn.depthwise_conv2d(x, w[..., :1], [1, 2, 2, 1], "SAME"),
    "max_pool3x3_stride2_same": lambda x, w: tf.nn.max_pool2d(tf.nn.conv2d(x, w, 1, "SAME") - 4.0, 3, 2, "SAME"),
    "max_pool2x2_valid": lambda x, w: tf.nn.max_pool2d(tf.nn.conv2d(x, w, 1, "SAME"), 2, 2, "VALID"),
    "avg_pool3x3_stride2_same": lambda x, w: tf.nn.avg_pool2d(tf.nn.conv2d(x, w, 1, "SAME"), 3, 2, "SAME"),
    "avg_pool3x3_same": lambda x, w: tf.nn.avg_pool2d(tf.nn.conv2d(x, w, 1, "SAME"), 3, 1, "SAME"),
    "avg_pool2x2_valid": lambda x, w: tf.nn.avg_pool2d(tf.nn.conv2d(x, w, 1, "SAME"), 2, 2, "VALID"),
    "conv_transpose_stride2": lambda x, w: tf.nn.conv2d_transpose(x, tf.transpose(w, [0, 1, 3, 2]), [2, 32, 32, 4], 2,
                                                                  "SAME"),
    "resize_nearest_x2": lambda x, w: tf.image.resize(tf.nn.conv2d(x, w, 1, "SAME"), [32, 32], method="nearest"),
}

# On 4 strips, the dilated convolution's phases (16 rows padded to 20, 10 a phase) do not split into 4: gathered.
GATHERED = {("conv3x3_dilation2_space_to_batch", "4x1"): "its 10 output rows do not split into 4 equal pieces",
            # The image flattened to a sequence of 256: on 4 strips 4 pieces of 64 (a halo each side); on 2x2 tiles
            # each device's tokens are 8 rows of 8, not one piece of the sequence: gathered for the Conv1D.
            ("conv1d3_flat", "2x2"): "gather Reshape:0 dim 1"}


def _on_tiles(fn, shape, x, w0):
  """``loss_and_grads(fn)`` in the global view with x's height and width split as ``shape`` says."""
  m = mesh.Mesh(shape, devices=cpus(int(np.prod(list(shape.values())))))
  spec = (None,) + tuple(shape) + (None,) * (3 - len(shape))
  repl = replicator.Replicator(mesh=m, view="global", batch_axes=(), input_layouts=spec)
  with repl.context():
    w = tf.Variable(w0, name="w")
  ds = tf.data.Dataset.from_tensors(x)

  def step(batch):
    return loss_and_grads(fn, batch, w)

  return repl, step, ds, repl.run(step, ds)


@pytest.mark.parametrize("tiles", sorted(MESHES))
@pytest.mark.parametrize("name", sorted(CASES))
def test_an_op_on_tiles_equals_one_device(name, tiles):
  fn = CASES[name]
  rng = np.random.default_rng(7)
  x = rng.normal(size=(2, 16, 16, 3)).astype("float32")
  w0 = rng.normal(size=(3, 3, 3, 4)).astype("float32")
  expected = tf.function(lambda x, w: loss_and_grads(fn, x, w))(tf.constant(x), tf.Variable(w0))
  repl, step, ds, got = _on_tiles(fn, MESHES[tiles], x, w0)
  # Measured: at most 7.4e-7 of the largest value (avg_pool2x2_valid's d/dw; Conv1D's 6.4e-7, the separable one's
  # 1.2e-7: sums in another order); the loss of a max pooling exactly.
  for what, a, b in zip(("output", "loss", "d/dw", "d/dx"), got, expected):
    b = np.asarray(b)
    np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=2e-6 * max(1.0, float(np.max(np.abs(b)))),
                               err_msg=what)
  report = repl.explain(step, ds)
  # The tiles stay tiles: the only gathers are of the step's outputs, returned whole.
  gathers = [r.why for r in report.collective_rows if r.kind == "all_gather" and "to return it" not in r.why]
  if (name, tiles) in GATHERED:
    assert gathers and all(GATHERED[name, tiles] in why for why in gathers), gathers
  else:
    assert not gathers
  if name not in ("conv1x1", "max_pool2x2_valid", "avg_pool2x2_valid", "resize_nearest_x2") and not gathers:
    assert any(r.kind == "permute" for r in report.collective_rows)


def test_a_3d_convolution_and_pooling_on_tiles_equal_one_device():
  def fn(x, w):
    y = tf.nn.conv3d(x, w, [1, 1, 1, 1, 1], "SAME")
    return tf.nn.avg_pool3d(tf.nn.max_pool3d(y, 2, 2, "VALID"), 3, 1, "SAME")

  rng = np.random.default_rng(3)
  x = rng.normal(size=(2, 8, 8, 8, 2)).astype("float32")
  w0 = rng.normal(size=(3, 3, 3, 2, 4)).astype("float32")
  expected = tf.function(lambda x, w: loss_and_grads(fn, x, w))(tf.constant(x), tf.Variable(w0))
  m = mesh.Mesh({"rows": 2, "cols": 2}, devices=cpus(4))
  repl = replicator.Replicator(mesh=m, view="global", batch_axes=(), input_layouts=(None, "rows", "cols", None, None))
  with repl.context():
    w = tf.Variable(w0, name="w")
  got = repl.run(lambda batch: loss_and_grads(fn, batch, w), tf.data.Dataset.from_tensors(x))
  for what, a, b in zip(("output", "loss", "d/dw", "d/dx"), got, expected):
    b = np.asarray(b)
    np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=2e-6 * max(1.0, float(np.max(np.abs(b)))),
                               err_msg=what)
