"""
How long and how often a fetch may try one file.
Limits holds the numbers (attempts, backoff, silence, a rate floor, a deadline); Pace holds an
attempt to them as its bytes arrive.

May import: nanochat.data.base.checks, nanochat.data.fetch.errors.
"""

import time
from dataclasses import dataclass

from nanochat.data.base.checks import check_int
from nanochat.data.fetch.errors import DownloadError, GiveUp, Stopped

MAX_ATTEMPTS = 5  # attempts in a row without progress; waits between: base, 2, 4, 8 * base
BACKOFF_BASE = 2.0  # seconds (2, 4, 8, 16 s by default)
REQUEST_TIMEOUT = 30.0  # seconds of silence (connect or read) before an attempt counts as failed
# bytes/s: an attempt slower than this over RATE_WINDOW fails (a ~100MB shard takes ~35 min)
MIN_RATE = 50_000.0
RATE_WINDOW = 30.0  # seconds over which the rate is averaged
DEADLINE = 3600.0  # seconds for one file, all attempts together; past it the file fails this run


@dataclass(frozen=True)
class Limits:
    """How often and for how long to try one file."""
    max_attempts: int = MAX_ATTEMPTS
    backoff_base: float = BACKOFF_BASE
    timeout: float = REQUEST_TIMEOUT
    min_rate: float = MIN_RATE
    rate_window: float = RATE_WINDOW
    deadline: float = DEADLINE

    def __post_init__(self):
        check_int("max_attempts", self.max_attempts, 1)
        for name in ("backoff_base", "min_rate"):  # 0: retry at once, no rate floor
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("timeout", "rate_window", "deadline"):  # 0 would fail every attempt at once
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")


# -----------------------------------------------------------------------------
# The checks as a file's bytes arrive


class Pace:
    """The checks after each piece of a body arrives: the run's stop, the deadline, and the rate
    over disjoint windows of limits.rate_window (a body shorter than one window is never judged by
    its rate)."""

    def __init__(self, limits: Limits, deadline: float, stop):
        self.limits, self.deadline, self.stop = limits, deadline, stop
        self.window_start, self.window_bytes = time.monotonic(), 0

    def check(self, nbytes: int) -> None:
        """Raise when the attempt must end, nbytes having just arrived."""
        if self.stop.is_set():
            raise Stopped()
        now = time.monotonic()
        if now > self.deadline:
            raise GiveUp("past the deadline",
                         f"past the deadline of {self.limits.deadline:g}s for one file")
        self.window_bytes += nbytes
        if now - self.window_start >= self.limits.rate_window:
            rate = self.window_bytes / (now - self.window_start)
            if rate < self.limits.min_rate:
                raise DownloadError("too slow", f"{rate / 1e3:.3g} KB/s over "
                                                f"{now - self.window_start:.1f}s, below the "
                                                f"minimum of {self.limits.min_rate / 1e3:g} KB/s")
            # disjoint windows: a fast start hides no stall
            self.window_start, self.window_bytes = now, 0
