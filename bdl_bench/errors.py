"""The errors a user can fix, as opposed to bugs.

The CLI prints a :class:`UserError` as one line, ``bdl-bench: <message>``, and exits with status 1; any
other exception is a bug and keeps its traceback. A message names the bad key, value or file and the fix.
``BDL_BENCH_DEBUG=1`` (or ``HYDRA_FULL_ERROR=1``) shows the traceback of a user error too.

Each subclass also derives from the built-in exception its callers already catch (``ValueError``,
``FileNotFoundError``, ``FloatingPointError``), so ``except ValueError`` keeps working."""

from __future__ import annotations


class UserError(Exception):
    """An error the user can fix; the CLI prints its message as one line (no traceback)."""


class ConfigError(UserError, ValueError):
    """A config value out of its range or of the wrong type (the message names the key and the range)."""


class DataError(UserError, ValueError):
    """A data source that cannot be used as given (a bad split, a malformed file)."""


class MissingFileError(UserError, FileNotFoundError):
    """A file or folder the config names (a MAP run, a search grid file) is missing."""


class DataFileError(MissingFileError):
    """A data file is missing or does not match its recorded SHA-256."""


class DivergenceError(UserError, FloatingPointError):
    """Training produced a NaN or infinite value (the message suggests a smaller learning rate)."""


class ResultsError(UserError, ValueError):
    """A results folder that cannot be tabled or plotted as asked (no finished runs, an unknown metric)."""


class OutputPathError(UserError, OSError):
    """An output path cannot be written (e.g. the run folder is a file)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run; the message says at which epoch, where its checkpoint stands and how to resume.
    A ``KeyboardInterrupt``, so that nothing on the way records it as a failure; the CLI exits with 130."""


class Terminated(Interrupted):
    """SIGTERM during a run (a scheduler's time limit or preemption, ``scancel``, ``kill``): the run stopped at
    an epoch's end with a checkpoint there (:mod:`bdl_bench.orchestration.sigterm`); the CLI exits with 143."""
