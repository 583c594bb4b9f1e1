"""Tuned hyperparameters: where an Optuna study of a job lives, and feeding its best values to a run.

A study (``bdl-bench run -m tune=<name> <job overrides> hydra.sweep.dir=<root>/<job folder>``, see
``conf/tune/``) searches some config keys (the noise and prior precision) on a validation part of the
training data; hydra-optuna-sweeper writes the best values to ``optimization_results.yaml`` in its
sweep folder. A test run with ``tuned_from=<root>`` reads them from ``<root>/<its own folder name>``
(the name Hydra gives its run folder, from its overrides), so a whole test sweep over methods, datasets
and splits stays an ordinary Hydra sweep while each member uses its own split's tuned values.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from bdl_bench.errors import ConfigError, MissingFileError

STUDY_RESULTS_FILE = "optimization_results.yaml"
_ABSENT = object()


def override_dirname(
    overrides: Sequence[str], exclude_keys: Sequence[str], item_sep: str = ",", kv_sep: str = "="
) -> str:
    """The folder name Hydra derives from ``overrides`` (``hydra.job.override_dirname``): the
    overrides, less ``exclude_keys``, sorted and joined."""
    from hydra._internal.config_loader_impl import get_overrides_dirname
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return get_overrides_dirname(parsed, exclude_keys=list(exclude_keys), item_sep=item_sep, kv_sep=kv_sep)


def _hydra_dirname_settings() -> tuple[list[str], str, str]:
    from hydra.core.hydra_config import HydraConfig

    settings = HydraConfig.get().job.config.override_dirname
    return list(settings.exclude_keys), str(settings.item_sep), str(settings.kv_sep)


def read_best_params(study_dir: Path) -> dict[str, Any]:
    """The best parameters of the finished study in ``study_dir``.

    Raises:
        FileNotFoundError: when the study has not finished there, naming the folder and the fix.
    """
    path = Path(study_dir) / STUDY_RESULTS_FILE
    if not path.exists():
        raise MissingFileError(
            f"no tuning results at {path}: run the study first (`bdl-bench reproduce <experiment>` does, or "
            f"`bdl-bench run -m tune=<name> <this run's overrides> hydra.sweep.dir={study_dir}`), or drop tuned_from"
        )
    results = yaml.safe_load(path.read_text()) or {}
    if "best_params" not in results:
        raise ConfigError(
            f"{path} has no best_params (a multi-objective study?); tuned_from needs one best value per key"
        )
    return dict(results["best_params"])


def apply_tuned(
    cfg: DictConfig, overrides: Sequence[str], dirname_settings: tuple[Sequence[str], str, str] | None = None
) -> DictConfig:
    """``cfg`` with the best values of its study when ``tuned_from`` is set, else ``cfg`` itself.

    Args:
        cfg: the job's config.
        overrides: the job's overrides (they name its study's folder).
        dirname_settings: ``(exclude_keys, item_sep, kv_sep)`` of ``hydra.job.config.override_dirname``;
            default: those of the running Hydra job.
    """
    root = OmegaConf.select(cfg, "tuned_from", default=None)
    if root is None:
        return cfg
    exclude_keys, item_sep, kv_sep = dirname_settings or _hydra_dirname_settings()
    study_dir = Path(str(root)) / override_dirname(overrides, exclude_keys, item_sep, kv_sep)
    best = read_best_params(study_dir)
    tuned = copy.deepcopy(cfg)
    for key, value in best.items():
        if OmegaConf.select(tuned, key, default=_ABSENT) is _ABSENT:
            raise ConfigError(f"tuned parameter {key!r} from {study_dir} is not a key of this config")
        OmegaConf.update(tuned, key, value, merge=False)
    return tuned
