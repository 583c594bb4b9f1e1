"""Range checks of the numeric config keys (bdl_bench/config_checks.py), on composed configs."""

from __future__ import annotations

import pytest

from bdl_bench.config_checks import RULES, check_config
from bdl_bench.errors import ConfigError, UserError
from bdl_bench.ranges import Range

BAD = [
    (["trainer.n_epochs=-1"], "trainer.n_epochs=-1 is out of range: it must be an integer >= 0"),
    (["trainer.n_epochs=0"], "trainer.n_epochs=0 trains nothing"),
    (["trainer.batch_size=0"], "trainer.batch_size=0 is out of range: it must be an integer >= 1"),
    (["trainer.batch_size=2.5"], "trainer.batch_size=2.5 is out of range"),
    (["trainer.eval_every=-1"], "trainer.eval_every=-1"),
    (["trainer.checkpoint_every=-5"], "trainer.checkpoint_every=-5"),
    (["trainer.n_test_mc_samples=0"], "trainer.n_test_mc_samples=0"),
    (["trainer.n_eval_mc_samples=0"], "trainer.n_eval_mc_samples=0"),
    (["trainer.n_elbo_mc_samples=0"], "trainer.n_elbo_mc_samples=0"),
    (["trainer.threads=0"], "trainer.threads=0 is out of range: it must be an integer >= 1 or null"),
    (["prior_precision=0"], "prior_precision=0 is out of range: it must be a number > 0"),
    (["prior_precision=abc"], "prior_precision='abc' is not a number: it must be a number > 0"),
    (["noise_precision=-1"], "noise_precision=-1 is out of range: it must be a number > 0 or null"),
    (["prior_precision=inf"], "prior_precision=inf is out of range"),
    (["data.val_fraction=1.0"], "data.val_fraction=1.0 is out of range: it must be a number in [0, 1)"),
    (["data.split=-1"], "data.split=-1 is out of range: it must be an integer >= 0"),
    (["data.split=[0,-2]"], "data.split=-2"),
    (["method.lr=nan"], "method.lr=nan is out of range: it must be a number > 0"),
    (["method.lr=-0.1"], "method.lr=-0.1"),
    (["method.rank=0"], "method.rank=0 is out of range: it must be an integer >= 1"),
    (["method.n_train_mc_samples=0"], "method.n_train_mc_samples=0"),
    (["method.beta=1.5"], "method.beta=1.5 is out of range: it must be a number in (0, 1]"),
    (["method.momentum=1"], "method.momentum=1 is out of range: it must be a number in [0, 1)"),
    (["method=ktied", "method.k=0"], "method.k=0"),
    (["method=elrg", "method.rank=-1"], "method.rank=-1"),
    (
        ["method=dropout", "method.dropout_rate=1"],
        "method.dropout_rate=1 is out of range: it must be a number in (0, 1)",
    ),
    (["method=ensemble", "method.n_members=0"], "method.n_members=0"),
    (
        ["method=laplace", "method.prior_precision=-1"],
        "method.prior_precision=-1 is out of range: it must be a number >= 0 or null",
    ),
    (["method=laplace", "method.curvature_cache_mib=-1"], "method.curvature_cache_mib=-1"),
    (["method=hmc", "method.target_accept=1"], "method.target_accept=1"),
    (["method=bbb", "method.init_std=0"], "method.init_std=0"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD, ids=[" ".join(o) for o, _ in BAD])
def test_out_of_range_values_are_refused_naming_the_key(compose_cfg, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_config(compose_cfg(overrides))
    assert message in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, UserError)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["method=laplace", "method.rank=null", "method.prior_precision=null"],
        ["method=laplace", "trainer.n_epochs=0", "method.map_dir=/some/map/run"],  # Laplace on a given MAP
        ["data.split=[0,1,2]"],
        ["trainer.threads=null", "noise_precision=null", "trainer.batch_size=32.0"],
        ["experiment=slang_table1"],
        ["experiment=def_table1"],
        ["experiment=ktied_fig6"],
        ["experiment=ktied_table2"],
    ],
)
def test_shipped_and_purposeful_configs_pass(compose_cfg, overrides: list[str]) -> None:
    check_config(compose_cfg(overrides))


def test_every_method_declares_the_ranges_of_its_numeric_options_and_no_others() -> None:
    """One source per option: each method's ``option_ranges`` covers exactly the numeric options of its
    ``conf/method`` YAML (a range for an option the method lacks would check nothing, e.g. after a rename)."""
    from pathlib import Path

    import yaml

    from bdl_bench.methods import METHODS, import_all

    import_all()
    for path in sorted((Path(__file__).resolve().parents[1] / "conf" / "method").glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        cls = METHODS[cfg["name"]]
        numeric = {k for k, v in cfg.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        numeric |= {k for k, v in cfg.items() if isinstance(v, str) and v.startswith("${")}  # interpolated counts
        assert set(cls.option_ranges) <= set(cfg), (cfg["name"], set(cls.option_ranges) - set(cfg))
        assert numeric <= set(cls.option_ranges), (cfg["name"], numeric - set(cls.option_ranges))
    assert all(key.split(".")[0] in ("trainer", "data") or "." not in key for key in RULES)


def test_a_method_checks_its_options_against_the_same_ranges_as_the_config_check(compose_cfg) -> None:
    """The constructor and the composed-config check refuse the same value with the same range."""
    from bdl_bench.errors import ConfigError
    from bdl_bench.methods import build_method

    with pytest.raises(ConfigError, match=r"method.beta=1.5 is out of range: it must be a number in \(0, 1\]"):
        check_config(compose_cfg(["method=slang", "method.beta=1.5"]))
    cfg = dict(yaml_method("slang"), beta=1.5)
    with pytest.raises(ConfigError, match=r"slang: method.beta=1.5 is out of range: it must be a number in \(0, 1\]"):
        build_method(cfg)


def yaml_method(name: str) -> dict:
    from pathlib import Path

    import yaml

    return yaml.safe_load((Path(__file__).resolve().parents[1] / "conf" / "method" / f"{name}.yaml").read_text())


def test_range_descriptions() -> None:
    assert Range(0, 1, low_open=True).describe() == "a number in (0, 1]"
    assert Range(1, integer=True, nullable=True).describe() == "an integer >= 1 or null"
    assert Range(0).accepts(0.0) and not Range(0).accepts(True) and not Range(0).accepts(float("inf"))
