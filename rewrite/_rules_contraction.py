"""Rules for contractions: a split contracted dimension leaves partial sums (all-reduce "sum")."""

from __future__ import annotations

from rewrite import _rules


@_rules.register("MatMul")
def matmul(view, layouts):
  a, b = layouts
  ta, tb = view.attr("transpose_a"), view.attr("transpose_b")
  a_m, a_k = (a[1], a[0]) if ta else (a[0], a[1])
  b_k, b_n = (b[1], b[0]) if tb else (b[0], b[1])
  # The contracted dimension keeps a split that either operand has (the other is sliced to match).
  k = a_k if a_k or not b_k else b_k
  if a_k and b_k and a_k != b_k:
    k = a_k  # b is relayouted to a's split
  m = a_m if set(a_m).isdisjoint(k) else ()
  n = b_n if set(b_n).isdisjoint(k) and set(b_n).isdisjoint(m) else ()
  want = view.want()
  if want is not None:  # a whole output dimension the consumers want split: slice the operand instead
    if not m and want[0] and set(want[0]).isdisjoint(k + n):
      m = want[0]
    if not n and want[1] and set(want[1]).isdisjoint(k + m):
      n = want[1]
  need_a = (k, m) if ta else (m, k)
  need_b = (n, k) if tb else (k, n)
  return _rules.Decision(inputs=[need_a, need_b], outputs=[(m, n)],
                         reduce=[("sum", k) if k else None])
