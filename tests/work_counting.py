"""Count the library's own Python work: lines executed in ``hf_hybrid_ep``'s files.

:class:`LineCounter` traces (``sys.settrace``) only frames whose code lives in the package and counts their
line events per file. A count does not depend on the machine's load, so a test can assert how work grows —
with the number of parameters, per gradient hook — where a timing could not.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import hf_hybrid_ep

ROOT = str(Path(hf_hybrid_ep.__file__).resolve().parent)


class LineCounter:
    """``counts[path relative to the package]`` of the lines executed in the package inside :meth:`active`
    (this thread; on the CPU, backward and its hooks run on the thread that calls ``backward()``)."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()

    def _call(self, frame, event, arg):
        path = frame.f_code.co_filename
        return self._line if path.startswith(ROOT) else None

    def _line(self, frame, event, arg):
        if event == "line":
            self.counts[frame.f_code.co_filename[len(ROOT) + 1 :]] += 1
        return self._line

    def total(self, prefix: str = "") -> int:
        """Lines executed in the files whose relative path starts with ``prefix``."""
        return sum(n for path, n in self.counts.items() if path.startswith(prefix))

    @contextlib.contextmanager
    def active(self) -> Iterator[LineCounter]:
        previous = sys.gettrace()
        sys.settrace(self._call)
        try:
            yield self
        finally:
            sys.settrace(previous)
