"""SIGTERM handled like Ctrl-C, at an epoch's end: what a cluster sends at a time limit or on preemption.

Within :func:`stop_at_epoch_end` (the fit of a run or a stack, :mod:`bdl_bench.orchestration.runner`) a SIGTERM that arrives
while epochs run only asks the loop to stop: at the end of the epoch under way the run writes a checkpoint
(whatever ``trainer.checkpoint_every`` says), records itself as interrupted in ``run.json``, prints one line
and exits with status 143 (128 + SIGTERM), so that the same command, or the requeued job, resumes exactly
there. A SIGTERM during a fit's own work after its last epoch (a Laplace fit's curvature) stops it when that
work ends; one before the first epoch or while the fitted run is evaluated stops it at once, as Ctrl-C
does. Those resume from the last checkpoint.

Schedulers give a grace period between SIGTERM and SIGKILL (Slurm's ``KillWait``, 30 s by default): an
epoch longer than that is killed before its end, and the run resumes from the checkpoint before.
Submitit's own signal (USR2 before a time limit: checkpoint the Hydra job and requeue it) is left to
submitit; its requeued job resumes from the last checkpoint.
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
