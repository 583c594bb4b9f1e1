"""Every option of every config group composes, and builds (data, model, method) at tiny size."""

from __future__ import annotations

import copy
import inspect
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from bdl_bench.data import build_dataset
from bdl_bench.data.download import DownloadError
from bdl_bench.methods import METHODS, build_method
from bdl_bench.methods import import_all as import_all_methods
from bdl_bench.models import build_model
from bdl_bench.results import config_hash

CONF = Path(__file__).resolve().parents[1] / "conf"
SHARED_DATA = CONF.parents[1] / "shared" / "data"  # the offline test mirror beside the checkout
IMAGE_CHANNELS = {"lenet": 1, "cnn_def": 3, "cnn_ktied": 3, "resnet18": 3}
GROUPS = ("data", "model", "method", "trainer", "experiment", "variant")
CHOICES = [
    f"{group}={p.relative_to(CONF / group).with_suffix('').as_posix()}"
    for group in GROUPS
    for p in sorted((CONF / group).rglob("*.yaml"))
]


def _compose(overrides: list[str]):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides)


@pytest.mark.parametrize("choice", CHOICES)
def test_config_composes_and_builds(choice: str) -> None:
    cfg = _compose([choice])
    container = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(container, dict)
    build_method(container["method"])
    if choice.startswith(("data=", "model=")):
        data_cfg = container["data"]
        if "mirror" in data_cfg:
            data_cfg = {**data_cfg, "mirror": str(SHARED_DATA)}
        try:
            dataset = build_dataset(data_cfg)
        except DownloadError:
            pytest.skip(f"{choice}: data files not available offline (no cache, no mirror)")
        in_features = IMAGE_CHANNELS.get(container["model"]["name"], dataset.n_features)
        build_model(container["model"], in_features=in_features, out_features=dataset.n_outputs)


def test_method_registry_matches_yaml_files() -> None:
    import_all_methods()
    stems = {p.stem for p in (CONF / "method").glob("*.yaml")}
    assert set(METHODS) == stems


@pytest.mark.parametrize("path", sorted((CONF / "method").glob("*.yaml")), ids=lambda p: p.stem)
def test_method_yaml_keys_match_constructor(path: Path) -> None:
    import_all_methods()
    cfg = OmegaConf.load(path)
    params = inspect.signature(METHODS[cfg.name].__init__).parameters
    expected = {n for n, p in params.items() if n != "self" and p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(cfg.keys()) - {"name"} == expected


def test_default_config_is_slang_on_boston() -> None:
    cfg = _compose([])
    assert cfg.method.name == "slang"
    assert cfg.data.name == "uci/boston"


@pytest.mark.parametrize("path", sorted((CONF / "experiment").glob("*.yaml")), ids=lambda p: p.stem)
def test_experiment_sweep_lists_existing_variants(path: Path) -> None:
    """Hydra's glob() does not look into nested option folders (it would launch 0 jobs), so every
    experiment spells its variants out; each must exist."""
    params = OmegaConf.select(OmegaConf.load(path), "hydra.sweeper.params", default={}) or {}
    variants = params.get("variant")
    if variants is None:
        return
    assert "glob(" not in variants
    for variant in str(variants).split(","):
        assert (CONF / "variant" / f"{variant}.yaml").exists(), variant


@pytest.mark.parametrize("variant", ["mean_field", "1_tied", "2_tied", "3_tied"])
def test_ktied_fig6_anneals_the_kl_over_the_whole_run(variant: str) -> None:
    """The paper's 300 epochs of 391 minibatches (50k images, batch 128) by default; a shorter run anneals over
    its own length instead of never reaching the full KL."""
    base = ["experiment=ktied_fig6", f"variant=ktied_fig6/{variant}"]
    assert _compose(base).method.kl_annealing_steps == 300 * 391
    assert _compose(base).method.record_every == 1000  # Fig. 6 right's steps 1000, 5000, 9000 (steps.csv)
    assert _compose([*base, "trainer.n_epochs=60"]).method.kl_annealing_steps == 60 * 391
    assert _compose([*base, "trainer.batch_size=100"]).method.kl_annealing_steps == 300 * 500


def test_ktied_table2_trains_standard_gmfvi_without_annealing() -> None:
    """Table 2's model is not KL-annealed (the paper anneals in its Sec. 3 only)."""
    cfg = _compose(["experiment=ktied_table2"])
    assert cfg.method.name == "gmfvi" and cfg.method.kl_annealing_steps == 0
    assert cfg.trainer.n_epochs == 300 and cfg.trainer.batch_size == 128 and cfg.trainer.save_posterior


@pytest.mark.parametrize(("variant", "samples"), [("ensemble", 15), ("diag", 1000), ("mc_dropout", 1000)])
def test_def_table1_tests_with_the_papers_samples_and_the_ensembles_members(variant: str, samples: int) -> None:
    """App. E.3's 1,000 test samples; the ensemble's predictive is its 15 members, each once; the Laplace search
    scores all 10,000 validation images."""
    cfg = _compose(["experiment=def_table1", f"variant=def_table1/{variant}"])
    assert cfg.trainer.n_test_mc_samples == samples
    assert cfg.laplace_search.max_val_examples == cfg.data.n_val == 10000


def test_a_run_folder_name_too_long_for_the_file_system_keeps_its_start_and_a_digest() -> None:
    """Many overrides once made a folder name over 255 bytes (OSError: File name too long); each too-long part
    of the name is cut to its first 200 bytes plus a digest of the whole: still one folder per set of overrides."""
    from bdl_bench.resolvers import MAX_NAME_BYTES, run_name

    assert run_name("") == "default" and run_name("data=uci/boston") == "data=uci/boston"
    head = ",".join(f"laplace_search.key{i}={i}" for i in range(20))
    long_a, long_b = f"{head},variant=def_table1/nn", f"{head},seed=1,variant=def_table1/nn"
    name_a, name_b = run_name(long_a), run_name(long_b)
    first, last = name_a.split("/")
    assert len(first.encode()) <= MAX_NAME_BYTES and first.startswith(head[:150]) and last == "nn"
    assert name_a == run_name(long_a) and name_a != name_b


def test_epochs_to_steps_refuses_bad_values() -> None:
    from bdl_bench.resolvers import epochs_to_steps

    assert epochs_to_steps(2, 10, 3) == 8
    for args, name in (((-1, 10, 3), "n_epochs"), ((2, 0, 3), "n_train"), ((2, 10, 0), "batch_size")):
        with pytest.raises(ValueError, match=name):
            epochs_to_steps(*args)


def test_slang_fig4_bnn_takes_the_authors_prior_precision_per_dataset(compose_cfg) -> None:
    """SLANG Fig. 4 right: prior precision 32 on USPS, 8 on breast cancer (the authors' slang_convergence_final.py)."""
    for data, precision in (("libsvm/usps_3vs5", 32.0), ("libsvm/breast_cancer", 8.0)):
        cfg = compose_cfg(["experiment=slang_fig4_bnn", f"data={data}"], smoke=False)
        assert cfg.prior_precision == precision and cfg.bias_prior_precision == 1e-6
    with pytest.raises(Exception, match=r"no value for dataset 'australian'.*usps_3vs5, breast_cancer"):
        _ = compose_cfg(["experiment=slang_fig4_bnn", "data=libsvm/australian"]).prior_precision


def test_small_data_sets_default_to_the_cpu_and_large_ones_to_auto(compose_cfg) -> None:
    for data in ("uci/boston", "libsvm/australian", "toy/cubic"):
        assert compose_cfg([f"data={data}"]).trainer.device == "cpu"
    assert compose_cfg(["data=vision/mnist"]).trainer.device == "auto"
    assert compose_cfg(["data=uci/boston", "trainer.device=auto"]).trainer.device == "auto"
    with_key = OmegaConf.to_container(compose_cfg(["data=uci/boston"]), resolve=True)
    without = copy.deepcopy(with_key)
    del without["data"]["protocol"]["device"]
    without["trainer"]["device"] = "auto"
    assert config_hash(with_key) == config_hash(without)  # where a run goes is not what it computes


def test_the_dropout_protocol_inputs_leave_other_runs_hashes_alone(compose_cfg) -> None:
    """``data.protocol.gal_dropout`` feeds tune=slang_table2's dropout settings (which land in the run's config
    themselves): adding or changing it does not make a finished SLANG or BBB run look like another config."""
    cfg = OmegaConf.to_container(compose_cfg(["data=uci/yacht", "method=slang"]), resolve=True)
    assert cfg["data"]["protocol"]["gal_dropout"]["rate"] == 0.01
    without = copy.deepcopy(cfg)
    del without["data"]["protocol"]["gal_dropout"]
    assert config_hash(cfg) == config_hash(without)
    changed = copy.deepcopy(cfg)
    changed["method"]["lr"] = 0.5
    assert config_hash(changed) != config_hash(cfg)


def test_runs_stored_with_the_removed_tuned_from_key_keep_their_hash(compose_cfg) -> None:
    """Configs written before the per-trial Optuna sweeper was removed hold ``tuned_from: null``; today's
    config has no such key, and a finished run of the same settings must still count as finished."""
    today = OmegaConf.to_container(compose_cfg(["data=uci/yacht", "method=bbb"]), resolve=True)
    assert "tuned_from" not in today
    stored = {**copy.deepcopy(today), "tuned_from": None}
    assert config_hash(stored) == config_hash(today)


def test_where_the_data_files_live_names_no_run_folder_and_no_hash(compose_cfg) -> None:
    """``data.mirror`` and ``data.root`` are paths to SHA-256-checked files: a sweep with a mirror must not nest
    its run folders under the path, and a run resumed with the files elsewhere is the same run."""
    here = OmegaConf.to_container(compose_cfg(["data=vision/mnist", "data.mirror=/a/mnist"]), resolve=True)
    there = OmegaConf.to_container(compose_cfg(["data=vision/mnist", "data.mirror=/b/m", "data.root=/c"]), resolve=True)
    assert config_hash(here) == config_hash(there)
    assert config_hash(here) != config_hash({**here, "data": {**here["data"], "n_val": 5000}})
    # hashed as null, not dropped: a run made before (data.mirror: null in its config) keeps its hash
    unset = {**here, "data": {**here["data"], "mirror": None, "root": None}}
    assert config_hash(unset) == config_hash(here)
    dropped = {**here, "data": {k: v for k, v in here["data"].items() if k not in ("mirror", "root")}}
    assert config_hash(dropped) != config_hash(here)
    excluded = OmegaConf.load(Path(__file__).parents[1] / "conf" / "config.yaml").hydra.job.config.override_dirname
    assert {"data.mirror", "data.root"} <= set(excluded.exclude_keys)
