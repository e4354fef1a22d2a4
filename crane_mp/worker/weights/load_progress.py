"""Progress of a weight load: a bar on a terminal, a few plain log lines anywhere else. A bar redraws
itself with carriage returns, which a log file or the journal keeps as one ever-growing line."""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

log = logging.getLogger(__name__)

_LOGGED_STEPS = 4  # lines per load off a terminal: at 25, 50, 75 and 100 %


class LoadProgress:
    def __init__(self, total: int, what: str, enabled: bool = True) -> None:
        self.total, self.what, self.done = total, what, 0
        self.enabled = enabled and total > 0
        on_terminal = self.enabled and sys.stderr.isatty()
        self.bar = tqdm(total=total, desc=f"Loading {what}", unit="tensor") if on_terminal else None
        self.logged_step = 0

    def update(self, count: int = 1) -> None:
        self.done += count
        if self.bar is not None:
            self.bar.update(count)
        elif self.enabled:
            step = self.done * _LOGGED_STEPS // self.total
            if step > self.logged_step:
                self.logged_step = step
                log.info("loading %s: %d of %d tensors (%d%%)", self.what, self.done, self.total,
                         100 * self.done // self.total)

    def __enter__(self) -> LoadProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
