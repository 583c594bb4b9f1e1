"""Range checks of the numeric config keys, made before a run does any work.

:data:`RULES` maps each key (``trainer.*``, ``data.*``, the root precisions) to its :class:`Range`;
:data:`METHOD_RULES` maps an option name to the range it has in whichever method has it (``method.lr``,
``method.rank``, …), or ``<method>.<option>`` to the range of one method's option. :func:`check_config` refuses the first value outside its range with a
:class:`~bdl_bench.errors.ConfigError` naming the key, the value and the range. The methods and datasets
still check what only they can (a rank against the model's size, a split against the dataset's number).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from bdl_bench.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """The values a numeric key accepts: finite, at least ``low`` (more than ``low`` when ``low_open``),
    at most ``high`` (less than ``high`` when ``high_open``), an integer when ``integer``, or ``null``
    when ``nullable``."""

    low: float | None = None
    high: float | None = None
    integer: bool = False
    low_open: bool = False
    high_open: bool = False
    nullable: bool = False

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.nullable
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return False
        if self.integer and value != int(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.high_open else value > self.high))

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        if self.low is not None and self.high is not None:
            text = (
                f"{kind} in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
            )
        elif self.low is not None:
            text = f"{kind} {'>' if self.low_open else '>='} {self.low:g}"
        elif self.high is not None:
            text = f"{kind} {'<' if self.high_open else '<='} {self.high:g}"
        else:
            text = f"a finite {kind.split()[1]}"
        return text + (" or null" if self.nullable else "")


COUNT = Range(1, integer=True)  # sizes and sample counts
NON_NEGATIVE_INT = Range(0, integer=True)  # seeds, intervals where 0 means "off"
POSITIVE = Range(0, low_open=True)  # learning rates, precisions, scales
UNIT_OPEN = Range(0, 1, low_open=True, high_open=True)  # rates strictly between 0 and 1

RULES: dict[str, Range] = {
    "trainer.n_epochs": NON_NEGATIVE_INT,  # 0 only where the run trains nothing on purpose (check_epochs)
    "trainer.batch_size": COUNT,
    "trainer.seed": NON_NEGATIVE_INT,
    "trainer.threads": Range(1, integer=True, nullable=True),
    "trainer.n_test_mc_samples": COUNT,
    "trainer.n_eval_mc_samples": COUNT,
    "trainer.n_elbo_mc_samples": COUNT,
    "trainer.eval_every": NON_NEGATIVE_INT,
    "trainer.checkpoint_every": NON_NEGATIVE_INT,
    "prior_precision": POSITIVE,
    "noise_precision": Range(0, low_open=True, nullable=True),
    "bias_prior_precision": Range(0, low_open=True, nullable=True),
    "data.val_fraction": Range(0, 1, high_open=True),
    "data.seed": NON_NEGATIVE_INT,
    "data.n_val": NON_NEGATIVE_INT,
    "data.n_train": Range(2, integer=True),
    "data.n_test": COUNT,
    "data.noise_std": Range(0),
    "data.train_bound": POSITIVE,
    "data.test_bound": POSITIVE,
    "data.crop_padding": NON_NEGATIVE_INT,
    "data.max_len": COUNT,
    "data.vocab_size": Range(3, integer=True),
}

METHOD_RULES: dict[str, Range] = {
    "lr": POSITIVE,
    "n_train_mc_samples": COUNT,
    "init_std": POSITIVE,
    "init_prec_diag": POSITIVE,
    "init_prec": Range(0),
    "rank": COUNT,  # slang, elrg
    "laplace.rank": Range(1, integer=True, nullable=True),  # def: null = all eigenvalues
    "k": COUNT,
    "beta": Range(0, 1, low_open=True),
    "decay": Range(0),
    "momentum": Range(0, 1, high_open=True),
    "dropout_rate": UNIT_OPEN,
    "n_members": COUNT,
    "kl_annealing_steps": NON_NEGATIVE_INT,
    "snr_window": NON_NEGATIVE_INT,  # 1 is refused by the methods (a window needs 2 steps)
    "n_quadrature": Range(2, integer=True),
    "max_iter": COUNT,
    "tolerance": POSITIVE,
    "n_samples": COUNT,
    "n_warmup": NON_NEGATIVE_INT,
    "n_leapfrog": COUNT,
    "step_size": POSITIVE,
    "target_accept": UNIT_OPEN,
    "thin": COUNT,
    "laplace.prior_precision": Range(0, low_open=True, nullable=True),  # null = the run's prior_precision
    "laplace.dataset_scale": Range(0, low_open=True, nullable=True),  # null = the training-set size
    "n_curvature_samples": COUNT,
    "curvature_batch_size": COUNT,
    "curvature_subset": Range(1, integer=True, nullable=True),
    "curvature_cache_mib": NON_NEGATIVE_INT,
}

_ABSENT = object()


def check_config(cfg: DictConfig | Mapping[str, Any]) -> None:
    """Refuse the first numeric key of ``cfg`` (a composed root config) outside its range, a run
    that would train nothing (:func:`check_epochs`), and an experiment that is a benchmark
    (:mod:`bdl_bench.benchmark`), which ``reproduce`` runs.

    Raises:
        ConfigError: ``<key>=<value> is out of range: it must be <range>``.
    """
    cfg = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dict(cfg))
    keys = dict(RULES)
    method = OmegaConf.select(cfg, "method", default=None)
    if isinstance(method, DictConfig):
        name = method.get("name")
        for option in method:
            allowed = METHOD_RULES.get(f"{name}.{option}", METHOD_RULES.get(str(option)))
            if allowed is not None:
                keys[f"method.{option}"] = allowed
    for key, allowed in keys.items():
        value = OmegaConf.select(cfg, key, default=_ABSENT)
        if value is not _ABSENT:
            check_value(key, value, allowed)
    check_split(OmegaConf.select(cfg, "data.split", default=None))
    check_epochs(cfg)
    if OmegaConf.select(cfg, "benchmark", default=None) is not None:
        name = OmegaConf.select(cfg, "experiment_name", default="<experiment>")
        raise ConfigError(f"{name} is a benchmark of step times, not a training run: use `bdl-bench reproduce {name}`")


def check_value(key: str, value: Any, allowed: Range) -> None:
    """Refuse ``value`` of ``key`` unless ``allowed`` accepts it (an integer-valued float such as ``2.0``
    passes for an integer key)."""
    if allowed.accepts(value):
        return
    number = isinstance(value, int | float) and not isinstance(value, bool)
    raise ConfigError(
        f"{key}={value!r} is {'out of range' if number else 'not a number'}: it must be {allowed.describe()}"
    )


def check_split(split: Any) -> None:
    """``data.split``: a split index >= 0, a list of them (a stacked job), ``all``, or ``null`` (a dataset
    with one fixed split); the dataset itself checks the upper end."""
    if split is None or split == "all":
        return
    values = list(split) if isinstance(split, list | tuple) or OmegaConf.is_list(split) else [split]
    for value in values:
        check_value("data.split", value, NON_NEGATIVE_INT)


def check_epochs(cfg: DictConfig) -> None:
    """``trainer.n_epochs=0`` trains nothing: refused, except for a Laplace run on a given MAP
    (``method.map_dir``), whose purpose that is."""
    if OmegaConf.select(cfg, "trainer.n_epochs", default=None) != 0:
        return
    if OmegaConf.select(cfg, "method.map_dir", default=None) is not None:
        return
    raise ConfigError(
        "trainer.n_epochs=0 trains nothing, so its metrics would be those of an untrained model; "
        "set trainer.n_epochs >= 1 (0 is for method=laplace with method.map_dir=<a finished MAP run>)"
    )
