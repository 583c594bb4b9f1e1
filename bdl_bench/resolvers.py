"""OmegaConf resolvers the configs in ``conf/`` use (registered when ``bdl_bench`` is imported).

- ``${run_name:${hydra.job.override_dirname}}``: a run folder's name, its overrides or ``default``.
- ``${epochs_to_steps:<epochs>,<n_train>,<batch_size>}``: optimiser steps in that many epochs of
  minibatches (the last one may be partial), e.g. a KL-annealing schedule over the whole run that follows
  ``trainer.n_epochs`` instead of a step count fixed for one run length.
- ``${by_dataset:${data.name},${<mapping>}}``: the mapping's value for the dataset's short name (``usps_3vs5``
  for ``libsvm/usps_3vs5``): a setting an experiment chooses per dataset where a sweep runs several (SLANG
  Fig. 4 right's prior precision)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf

from bdl_bench.errors import ConfigError

MAX_NAME_BYTES = 255  # the longest file or folder name Linux and macOS file systems take
KEPT_NAME_BYTES = 200  # what a too-long name keeps of its overrides, before its digest


def run_name(override_dirname: str) -> str:
    """A run folder's name: its overrides, or ``default`` when it has none. A path component (a ``/`` in a value
    such as ``variant=def_table1/nn`` nests) longer than :data:`MAX_NAME_BYTES` keeps its first
    :data:`KEPT_NAME_BYTES` bytes and a digest of the whole, so it is still a function of the overrides."""
    return "/".join(_fit(part) for part in (override_dirname or "default").split("/"))


def _fit(part: str) -> str:
    raw = part.encode()
    if len(raw) <= MAX_NAME_BYTES:
        return part
    return f"{raw[:KEPT_NAME_BYTES].decode(errors='ignore')}+sha256-{hashlib.sha256(raw).hexdigest()[:16]}"


def epochs_to_steps(n_epochs: int, n_train: int, batch_size: int) -> int:
    """``n_epochs * ceil(n_train / batch_size)``."""
    if int(n_epochs) != n_epochs or n_epochs < 0:
        raise ConfigError(f"epochs_to_steps: n_epochs must be a non-negative integer, got {n_epochs!r}")
    for name, value in (("n_train", n_train), ("batch_size", batch_size)):
        if int(value) != value or value < 1:
            raise ConfigError(f"epochs_to_steps: {name} must be a positive integer, got {value!r}")
    return int(n_epochs) * math.ceil(int(n_train) / int(batch_size))


def by_dataset(data_name: str, values: Mapping[str, Any]) -> Any:
    """``values[<short name of data_name>]``; an error naming the datasets it has otherwise."""
    short = str(data_name).rsplit("/", 1)[-1]
    if short not in values:
        raise ConfigError(
            f"by_dataset: no value for dataset {short!r} (data={data_name}); this experiment sets one for "
            f"{', '.join(map(str, values))}: add {short} to its mapping or choose one of those"
        )
    return values[short]


OmegaConf.register_new_resolver("by_dataset", by_dataset, replace=True)
OmegaConf.register_new_resolver("run_name", run_name, replace=True)
OmegaConf.register_new_resolver("epochs_to_steps", epochs_to_steps, replace=True)
