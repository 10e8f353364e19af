"""A dependency-free progress bar for the examples."""

from __future__ import annotations

import sys
import time


class Progress:
  """Prints ``epoch 3/10 [=========>     ] 14/22 loss 0.1234`` on one line.

  Args:
    total: steps in the epoch.
    prefix: text before the bar.
    width: bar width in characters.
    stream: where to print (stdout by default).
  """

  def __init__(self, total: int, prefix: str = "", width: int = 30, stream=None):
    self.total, self.prefix, self.width = total, prefix, width
    self.stream = stream or sys.stdout
    self.start = time.perf_counter()
    self.interactive = self.stream.isatty()

  def update(self, step: int, **metrics: float) -> None:
    """Redraws the bar after ``step`` steps (1-based); a new line when done."""
    done = step >= self.total
    if not (self.interactive or done):
      return
    filled = int(self.width * step / max(self.total, 1))
    bar = "=" * max(filled - 1, 0) + (">" if 0 < filled < self.width else "=" if filled else "")
    text = " ".join(f"{k} {v:.4f}" for k, v in metrics.items())
    elapsed = time.perf_counter() - self.start
    self.stream.write(f"\r{self.prefix} [{bar:<{self.width}}] {step}/{self.total} {text} ({elapsed:.1f}s)")
    if done:
      self.stream.write("\n")
    self.stream.flush()
