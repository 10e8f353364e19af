"""Rules for effects that happen once per step: summaries written, lines printed.

On one device a step writes each ``tf.summary`` once and prints each
``tf.print`` once. Copied to every device they would happen once per device
(a series with every point written N times). These ops run on the first
device only, on whole inputs (a summary of a split activation is gathered
first: the histogram one device would write).
"""

from __future__ import annotations

from rewrite import _op_kinds
from rewrite import _rules


@_rules.register(*_op_kinds.EFFECTS)
def once(view, layouts):
  return _rules.Decision(inputs=[_rules.replicated(_rules.rank_of(t)) for t in view.op.inputs], outputs=[],
                         once=True)
