"""SIGTERM (a cluster's time limit or preemption) handled like Ctrl-C, but at the end of the epoch under way, with
a checkpoint there and exit status 143 (``docs/faults.md``); submitit's own USR2 is left to submitit.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from bdl_bench.errors import Terminated

TERMINATED_STATUS = 143  # 128 + SIGTERM, what a shell reports for a process ended by SIGTERM


class StopFlags(Protocol):
    in_epochs: bool  # epochs are running: a SIGTERM waits for the end of the present one
    stop_requested: bool  # set by a SIGTERM that arrived while epochs ran


@contextmanager
def stop_at_epoch_end(flags: StopFlags) -> Iterator[None]:
    """Within: SIGTERM sets ``flags.stop_requested`` while ``flags.in_epochs``, else raises
    :class:`~bdl_bench.errors.Terminated` at once. Outside the main thread (where Python cannot handle
    signals), or where SIGTERM is ignored, nothing changes. The previous handler is restored on exit."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        yield
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        if flags.in_epochs:
            flags.stop_requested = True
            return
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
