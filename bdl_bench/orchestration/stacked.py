"""Stacked splits (``data.split=[0,1,2]`` or ``all``): which members a job stacks, and the checks that they may
share one fit, the runner's one training loop (:func:`bdl_bench.orchestration.runner.fit_job`). Each split gets
the run folder, files and config hash its single run would get; a stack of one is that single run bit for bit.
A method that cannot stack raises :class:`~bdl_bench.methods.base.CannotStack`. ``docs/sweeps.md``.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Mapping
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from bdl_bench.config_checks import check_config
from bdl_bench.errors import ConfigError
from bdl_bench.orchestration.runner import RunResult, fit_job


def stacked_splits(cfg: DictConfig) -> list[int] | None:
    """The splits of a stacked job, else ``None``: ``data.split`` given as a list, or as ``all`` (every
    split of the dataset's ``protocol.n_splits``)."""
    split = OmegaConf.select(cfg, "data.split")
    if split == "all":
        n_splits = OmegaConf.select(cfg, "data.protocol.n_splits")
        if n_splits is None:
            raise ConfigError(f"data.split=all: {cfg.data.name} has no protocol.n_splits; give a list of splits")
        return list(range(int(n_splits)))
    if not OmegaConf.is_list(split) and not isinstance(split, list | tuple):
        return None
    splits = [int(k) for k in split]
    if not splits or len(set(splits)) != len(splits):
        raise ConfigError(f"data.split={list(split)}: a stacked job needs a non-empty list of distinct splits")
    return splits


def member_config(cfg: DictConfig, split: int) -> DictConfig:
    """``cfg`` with ``data.split`` set to ``split``: the config of the single run of that split."""
    member = copy.deepcopy(cfg)
    with open_dict(member):
        member.data.split = split
    return member


def run_stack(
    cfg: DictConfig,
    member_dirs: Mapping[Hashable, Path],
    stack_dir: Path,
    member_configs: Mapping[Hashable, DictConfig],
) -> dict[Hashable, RunResult]:
    """Fit ``cfg``'s method on the members ``member_dirs`` names (member → run folder), stacked, with the stack's
    checkpoint in ``stack_dir``. A member's config (``member_configs``: a split's, a search's trial, a tuned test
    run) may differ from ``cfg`` in its precisions and the method's ``per_copy_options``; all else is ``cfg``'s."""
    members = {k: member_configs[k] for k in member_dirs}
    for member in (cfg, *members.values()):
        check_config(member)
    configs = {k: OmegaConf.to_container(m, resolve=True) for k, m in members.items()}
    job = OmegaConf.to_container(cfg, resolve=True)
    for key in ("model", "trainer", "likelihood"):  # what every member of a stack shares (one network, one loop)
        for k, config in configs.items():
            if config.get(key) != job.get(key):  # type: ignore[union-attr]
                raise ValueError(f"stacked member {k}: its {key} differs from the job's; a stack shares {key}")
    return fit_job(cfg, members, member_dirs, Path(stack_dir))
