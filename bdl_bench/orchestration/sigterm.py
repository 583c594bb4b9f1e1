"""Ctrl-C and SIGTERM during a fit. SIGTERM (a cluster's time limit or preemption) is handled like Ctrl-C, but at
the end of the epoch under way, with a checkpoint there and exit status 143 (``docs/faults.md``); submitit's own
USR2 is left to submitit.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bdl_bench.errors import Interrupted, Terminated

TERMINATED_STATUS = 143  # 128 + SIGTERM, what a shell reports for a process ended by SIGTERM


@dataclass
class EpochProgress:
    """Where a fit stands, for the line Ctrl-C prints: the last finished epoch, the last checkpoint's."""

    done: int
    n_epochs: int
    checkpoint_every: int
    checkpoint_path: Path
    in_epochs: bool = False  # the fit's epochs are running (a SIGTERM waits for the present one's end)
    stop_requested: bool = False  # a SIGTERM arrived while they ran
    evaluating: bool = False  # the fit is done and the run is being evaluated

    def interrupted(self, terminated: bool = False) -> Interrupted:
        """The interrupt's line (for SIGTERM with ``terminated``); the checkpoint's epoch is read from the
        file (Ctrl-C may land between writing it and any note of it)."""
        from bdl_bench.checkpoint import load_checkpoint  # torch: not for the CLI's start

        try:
            checkpoint = load_checkpoint(self.checkpoint_path)
        except (OSError, ValueError, RuntimeError):
            checkpoint = None
        done = max(self.done, checkpoint.epoch if checkpoint is not None else 0)
        phase = " (evaluating)" if self.evaluating else " (fitting)"  # after the epochs: a post-hoc fit, its search
        where = f"at epoch {done + 1}" if done < self.n_epochs else f"after epoch {done}{phase}"
        what, error = "interrupted", Interrupted
        if terminated:
            what, error = "stopped by SIGTERM", Terminated
            where = f"after epoch {done}" + (phase if done >= self.n_epochs else "")
        if checkpoint is not None:
            return error(f"{what} {where}; checkpoint at epoch {checkpoint.epoch}; run the same command to resume")
        every = self.checkpoint_every
        why = f"none yet, one every {every} epochs" if every > 0 else "trainer.checkpoint_every=0 writes none"
        return error(f"{what} {where}; no checkpoint ({why}); run the same command to start it again")


@contextmanager
def stop_at_epoch_end(flags: EpochProgress) -> Iterator[None]:
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


@contextmanager
def stop_on_interrupt(progress: EpochProgress) -> Iterator[None]:
    """Turn Ctrl-C inside the block into :class:`~bdl_bench.errors.Interrupted` saying where the fit stood,
    and SIGTERM into :class:`~bdl_bench.errors.Terminated` (at the end of the epoch under way)."""
    try:
        with stop_at_epoch_end(progress):
            yield
    except Terminated as stop:
        if str(stop):
            raise
        raise progress.interrupted(terminated=True) from None
    except Interrupted:
        raise
    except KeyboardInterrupt:
        raise progress.interrupted() from None


def stop_if_terminated(progress: EpochProgress, epoch: int, save: Callable[[int], None], saved: bool) -> None:
    """At the end of ``epoch``: when a SIGTERM asked to stop, write a checkpoint there (``save``, unless
    ``saved`` already) and raise :class:`~bdl_bench.errors.Terminated`."""
    if progress.stop_requested:
        progress.in_epochs = False
        if not saved:
            save(epoch)
        progress.done = epoch
        raise Terminated()
