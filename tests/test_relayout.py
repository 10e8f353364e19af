"""The steps of a relayout (rewrite/_relayout.py): all_to_all where axes move between dimensions, else gathers."""

from rewrite import _relayout


def _size(axes):
  return {"batch": 4, "model": 2}[axes[0]] if len(axes) == 1 else 8


def test_axes_moving_to_a_whole_dimension_are_one_all_to_all():
  steps = _relayout.steps((("batch",), (), ()), ((), ("batch",), ()), [8, 4, 3], _size)
  assert steps.moved == ((0, 1, ("batch",)),) and steps.gathered == ()


def test_a_dimension_the_axes_do_not_divide_is_gathered_instead():
  steps = _relayout.steps((("batch",), ()), ((), ("batch",)), [8, 6], _size)  # 6 rows over 4 devices
  assert steps.moved == () and steps.gathered == ((0, ("batch",)),)


def test_a_split_changing_axes_is_gathered_and_a_whole_one_only_sliced():
  assert _relayout.steps((("batch",), ()), (("model",), ()), [8, 4], _size).gathered == ((0, ("batch",)),)
  assert _relayout.steps(((), ()), (("model",), ()), [8, 4], _size) == _relayout.Steps()
  # a move and a gather in one relayout: "batch" moves from 0 to 2, "model" (dim 1) is gathered
  steps = _relayout.steps((("batch",), ("model",), ()), ((), (), ("batch",)), [8, 4, 4], _size)
  assert steps.moved == ((0, 2, ("batch",)),) and steps.gathered == ((1, ("model",)),)


def test_a_split_refined_by_further_axes_is_a_local_slice():
  # ("batch",) to ("batch", "model"): each device's block holds the parts the devices along "model" take
  assert _relayout.steps((("batch",), ()), (("batch", "model"), ()), [16, 4], _size) == _relayout.Steps()
  assert _relayout.refined(("batch",), ("batch", "model")) and not _relayout.refined(("model",), ("batch", "model"))
  # the other way round is not: ("model",) to ("batch", "model") gathers "model" first
  assert _relayout.steps((("model",), ()), (("batch", "model"), ()), [16, 4], _size).gathered == ((0, ("model",)),)


def test_a_dimension_keeping_its_leading_axes_is_gathered_over_the_others_only():
  # ("batch", "model") -> ("batch",): the devices along "model" hold consecutive blocks of their "batch" block.
  steps = _relayout.steps((("batch", "model"), ()), (("batch",), ()), [16, 4], _size)
  assert steps.gathered == ((0, ("model",)),)
  # ("model", "batch") -> ("batch",): not a leading part; gathered whole, then sliced.
  assert _relayout.steps((("model", "batch"), ()), (("batch",), ()), [16, 4], _size).gathered == (
      (0, ("model", "batch")),)


def test_a_merged_dimension_is_gathered_whole_never_moved():
  from rewrite.rules import _base  # pylint: disable=import-outside-toplevel
  merged = _base.Merged([(4, ("batch",)), (6, ("model",))])
  steps = _relayout.steps((merged, ()), ((), ("batch", "model")), [24, 8], _size)
  assert steps.moved == () and steps.gathered == ((0, ("batch", "model")),)
