"""Range checks of the numeric config keys, made before a run does any work: :data:`RULES` for ``trainer.*``,
``data.*`` and the root precisions, a method's ``option_ranges`` for its options (which its constructor checks
too). Methods and datasets still check what only they can (a rank against the model's size)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from bdl_bench.errors import ConfigError
from bdl_bench.ranges import COUNT, NON_NEGATIVE_INT, POSITIVE, Range, out_of_range

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


_ABSENT = object()


def check_config(cfg: DictConfig | Mapping[str, Any]) -> None:
    """Refuse the first numeric key of ``cfg`` (a composed root config) outside its range, a run
    that would train nothing (:func:`check_epochs`), and an experiment that is a benchmark
    (:mod:`bdl_bench.orchestration.benchmark`), which ``reproduce`` runs."""
    cfg = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dict(cfg))
    keys = dict(RULES)
    method = OmegaConf.select(cfg, "method", default=None)
    if isinstance(method, DictConfig):
        from bdl_bench.methods import METHODS, import_all

        import_all()
        ranges = METHODS[method.name].option_ranges if method.get("name") in METHODS else {}
        keys.update({f"method.{option}": ranges[option] for option in method if option in ranges})
    for key, allowed in keys.items():
        value = OmegaConf.select(cfg, key, default=_ABSENT)
        if value is not _ABSENT:
            check_value(key, value, allowed)
    check_split(OmegaConf.select(cfg, "data.split", default=None))
    check_epochs(cfg)
    sample_prefixes(cfg)
    val_samples(cfg)
    if OmegaConf.select(cfg, "benchmark", default=None) is not None:
        name = OmegaConf.select(cfg, "experiment_name", default="<experiment>")
        raise ConfigError(f"{name} is a benchmark of step times, not a training run: use `bdl-bench reproduce {name}`")


def check_value(key: str, value: Any, allowed: Range) -> None:
    """Refuse ``value`` of ``key`` unless ``allowed`` accepts it (an integer-valued float such as ``2.0``
    passes for an integer key)."""
    if not allowed.accepts(value):
        raise ConfigError(out_of_range(key, value, allowed))


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


def sample_prefixes(cfg: DictConfig) -> list[int]:
    """``trainer.test_mc_prefixes`` (absent: none), sorted, each a count below ``trainer.n_test_mc_samples``: the
    run also reports its test metrics from the first k of its test samples (``<metric>_s<k>``)."""
    prefixes = OmegaConf.select(cfg, "trainer.test_mc_prefixes", default=None) or []
    n_test = int(OmegaConf.select(cfg, "trainer.n_test_mc_samples", default=1))
    for k in prefixes:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < n_test:
            raise ConfigError(
                f"trainer.test_mc_prefixes={list(prefixes)}: {k!r} is not a whole number from 1 to "
                f"trainer.n_test_mc_samples - 1 = {n_test - 1}; give smaller counts or raise trainer.n_test_mc_samples"
            )
    return sorted(set(prefixes))


def val_samples(cfg: DictConfig) -> int:
    """``trainer.n_val_mc_samples``: posterior samples for the final validation metrics (``val_*``); absent or null:
    ``trainer.n_test_mc_samples``, 0: none (where the validation set served a search whose scores the run reports)."""
    n_test = int(OmegaConf.select(cfg, "trainer.n_test_mc_samples", default=1))
    n_val = OmegaConf.select(cfg, "trainer.n_val_mc_samples", default=None)
    if n_val is None:
        return n_test
    if isinstance(n_val, bool) or not isinstance(n_val, int) or n_val < 0:
        raise ConfigError(
            f"trainer.n_val_mc_samples={n_val!r} must be a whole number >= 0 (0: no final validation metrics) or null "
            f"(as trainer.n_test_mc_samples = {n_test})"
        )
    return n_val
