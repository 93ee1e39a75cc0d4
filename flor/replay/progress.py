"""The progress of a local replay over the main loop's iterations, on stderr.

On a terminal it is a tqdm bar (elapsed time, rate, ETA) when tqdm is
installed, else one line redrawn in place.  When stderr is not a terminal
(a log file, a pipe) nothing is drawn as the replay goes, and one line says
at the end how many iterations were replayed, in how long.
"""
from __future__ import annotations

import sys
import time

__all__ = ["Progress"]


def _tqdm():
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


class Progress:
    def __init__(self, total, workers, stream=None, use_tqdm=True):
        self.stream = stream if stream is not None else sys.stderr
        self.total, self.workers, self.done = total, workers, 0
        self.t0 = time.monotonic()
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self.closed = False
        self.bar = None
        tqdm = _tqdm() if self.tty and use_tqdm else None
        if tqdm is not None:
            self.bar = tqdm(total=total, desc="replay", unit="it", file=self.stream,
                            dynamic_ncols=True, leave=True,
                            postfix=f"{workers} worker{'s' if workers != 1 else ''}")
        else:
            self._draw()

    def step(self, n=1):
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        else:
            self._draw()

    def _line(self) -> str:
        elapsed = time.monotonic() - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        line = (f"replay: {self.done}/{self.total} iterations, {self.workers} "
                f"worker{'s' if self.workers != 1 else ''}, {elapsed:.1f} s")
        if rate > 0:
            line += f" ({rate:.2f} it/s)"
        return line

    def _draw(self):
        if not self.tty:
            return
        width = 30
        fill = int(width * self.done / self.total) if self.total else width
        elapsed = time.monotonic() - self.t0
        eta = ""
        if 0 < self.done < self.total:
            eta = f", ETA {elapsed / self.done * (self.total - self.done):.0f} s"
        self.stream.write(f"\rreplay [{'#' * fill}{'.' * (width - fill)}] "
                          f"{self.done}/{self.total} iterations, {self.workers} workers, "
                          f"{elapsed:.0f} s{eta}  ")
        self.stream.flush()

    def close(self):
        """The last line, once."""
        if self.closed:
            return
        self.closed = True
        if self.bar is not None:
            self.bar.close()
        elif self.tty:
            self.stream.write("\n")
            self.stream.flush()
        else:
            self.stream.write(self._line() + "\n")
            self.stream.flush()
