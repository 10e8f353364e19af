"""Rules for effects that happen once per step: summaries written, lines printed.

On one device a step writes each ``tf.summary`` once and prints each
``tf.print`` once. Copied to every device they would happen once per device
(a series with every point written N times). These ops run on the first
device only, on whole inputs (a summary of a split activation is gathered
first: the histogram one device would write).
"""

from __future__ import annotations

from rewrite import _op_kinds
from rewrite.rules import _base


@_base.register(*_op_kinds.EFFECTS)
def once(view, layouts):
  return _base.Decision(inputs=[_base.replicated(_base.rank_of(t)) for t in view.op.inputs], outputs=[],
                        once=True)
