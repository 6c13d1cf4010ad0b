"""How data preparation shows progress: live bars on a terminal, plain lines in a log.

tqdm redraws nested bars with cursor-movement escapes, which a redirected log keeps
as garbage. So bars are drawn only when stderr is a terminal; otherwise each
finished stage prints one line. Results (reports, summaries) are not progress and
are printed by their callers whatever the setting.
"""

from __future__ import annotations

import sys
import time


def bars(progress: bool, stream=None) -> bool:
    """True when live progress bars should be drawn: progress wanted and a terminal to draw on."""
    stream = stream or sys.stderr
    return progress and bool(getattr(stream, "isatty", lambda: False)())


def lines(progress: bool, stream=None) -> bool:
    """True when progress should be one plain line per finished stage (a log, not a terminal)."""
    return progress and not bars(progress, stream)


class StageLines:
    """Prints '<what>: <stage> done in S s (i/n)' to stderr as each stage finishes, when `enabled`."""

    def __init__(self, what: str, total: int, enabled: bool):
        self.what, self.total, self.enabled = what, total, enabled
        self.done, self.start = 0, time.perf_counter()

    def finished(self, stage: str) -> None:
        self.done += 1
        now = time.perf_counter()
        if self.enabled:
            print(
                f"{self.what}: {stage} done in {now - self.start:.1f} s ({self.done}/{self.total})",
                file=sys.stderr,
                flush=True,
            )
        self.start = now
