"""build_dataset, the registry and the conf/data YAML files."""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path

import pytest

from bdl_bench.data import build_dataset, get_loader

CONF_DATA = Path(__file__).resolve().parents[2] / "conf" / "data"
EXPECTED = {
    "uci/boston", "uci/concrete", "uci/energy", "uci/kin8nm", "uci/naval", "uci/power", "uci/protein",
    "uci/wine", "uci/yacht", "libsvm/a1a", "libsvm/australian", "libsvm/breast_cancer", "libsvm/usps_3vs5",
    "toy/cubic", "vision/mnist", "vision/notmnist", "vision/cifar10", "vision/cifar100", "vision/svhn",
    "text/imdb",
}  # fmt: skip


def test_all_registered() -> None:
    for name in EXPECTED:
        assert callable(get_loader(name))


def test_unknown_dataset_lists_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown dataset 'uci/no_such_set'; available: ") as err:
        build_dataset({"name": "uci/no_such_set"})
    for name in EXPECTED:
        assert name in str(err.value)


def test_missing_name_and_unknown_option() -> None:
    with pytest.raises(ValueError, match="needs a 'name'"):
        build_dataset({"split": 0})
    with pytest.raises(ValueError, match=r"does not accept option\(s\) 'splt'; accepted: split"):
        build_dataset({"name": "uci/boston", "splt": 0})


def _yaml_files() -> list[Path]:
    return sorted(CONF_DATA.rglob("*.yaml"))


def test_one_yaml_per_dataset() -> None:
    names = {p.relative_to(CONF_DATA).with_suffix("").as_posix() for p in _yaml_files()}
    assert names == EXPECTED


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: p.relative_to(CONF_DATA).as_posix())
def test_yaml_matches_loader(path: Path) -> None:
    omegaconf = pytest.importorskip("omegaconf")
    assert path.read_text().splitlines()[0] == "# @package data"
    cfg = omegaconf.OmegaConf.load(path)
    assert cfg.name == path.relative_to(CONF_DATA).with_suffix("").as_posix()
    params = set(inspect.signature(get_loader(cfg.name)).parameters)
    assert set(cfg) - {"name", "protocol"} == params
    protocol = cfg.protocol
    assert protocol.n_splits >= 1 and protocol.batch_size >= 1 and protocol.prior_precision > 0
    if cfg.name.startswith("uci/") or cfg.name.startswith("toy/"):
        assert protocol.noise_precision > 0 and protocol.n_train_mc_samples >= 1


def test_uci_protocol_values() -> None:
    omegaconf = pytest.importorskip("omegaconf")
    load = omegaconf.OmegaConf.load
    boston = load(CONF_DATA / "uci" / "boston.yaml").protocol
    assert boston.noise_precision == pytest.approx(0.0907) and boston.batch_size == 10
    assert load(CONF_DATA / "uci" / "protein.yaml").protocol.n_splits == 5
    assert load(CONF_DATA / "uci" / "kin8nm.yaml").protocol.n_train_mc_samples == 2
    assert load(CONF_DATA / "libsvm" / "a1a.yaml").protocol.prior_precision == pytest.approx(2.8072)


def test_hydra_selects_nested_group(tmp_path: Path) -> None:
    """`data=uci/boston` puts the YAML at cfg.data (not cfg.data.uci) thanks to `# @package data`."""
    hydra = pytest.importorskip("hydra")
    shutil.copytree(CONF_DATA, tmp_path / "data")
    (tmp_path / "config.yaml").write_text("defaults:\n  - data: uci/boston\n  - _self_\n")
    with hydra.initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        cfg = hydra.compose(config_name="config", overrides=["data=libsvm/a1a", "data.add_bias=true"])
    assert cfg.data.name == "libsvm/a1a" and cfg.data.add_bias is True
    ds = build_dataset(cfg.data)
    assert ds.x_train.shape == (1605, 124)
