"""Every ``bdl-bench reproduce`` job's config hash against ``tests/config_hashes.json``.

A finished run is reused (and a stopped one resumed) only while the hash of its config is unchanged, so an option
added with a non-null default, or a changed default, orphans every earlier run of the jobs it touches: reproduce then
refuses them as another config version. A new option whose null default changes nothing belongs in
``bdl_bench.results.OMITTED_WHEN_NULL``; a deliberate change regenerates the file:
``BDL_UPDATE_CONFIG_HASHES=1 python -m pytest tests/test_config_hashes.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict

from bdl_bench.orchestration.hydra_app import group_choices, load_config
from bdl_bench.orchestration.reproduce import make_plan
from bdl_bench.results import config_hash

GOLDEN = Path(__file__).with_name("config_hashes.json")
PER_SPLIT = ("data.split=", "trainer.seed=")  # one job per experiment and setting: the splits and seeds hash alike


def job_hashes() -> dict[str, str]:
    """``"<experiment>: <swept overrides>"`` → the hash of the config that job's run stores."""
    hashes = {}
    for experiment in group_choices("experiment"):
        plan = make_plan(experiment, [], quick=False, tune=False)
        for job in plan.jobs:
            name = f"{experiment}: {' '.join(o for o in job if not o.startswith(PER_SPLIT))}".rstrip(": ")
            if name in hashes:
                continue
            config = load_config([*plan.fixed, *job], multirun=False)
            with open_dict(config):
                del config["hydra"]  # a run's config.yaml is the resolved config without its Hydra node
            hashes[name] = config_hash(OmegaConf.to_container(config, resolve=True))  # type: ignore[arg-type]
    return hashes


@pytest.mark.slow
def test_reproduce_jobs_keep_their_config_hashes() -> None:
    hashes = job_hashes()
    if os.environ.get("BDL_UPDATE_CONFIG_HASHES"):
        GOLDEN.write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"wrote {len(hashes)} hashes to {GOLDEN.name}")
    golden = json.loads(GOLDEN.read_text())
    changed = sorted(k for k in golden.keys() & hashes.keys() if golden[k] != hashes[k])
    assert not changed, (
        f"{len(changed)} reproduce jobs would no longer reuse their finished runs (config hash changed), e.g. "
        f"{changed[:3]}: give a new option a null default and add it to OMITTED_WHEN_NULL, or, if the change is "
        "meant, regenerate tests/config_hashes.json (see this file's docstring)"
    )
    assert hashes.keys() == golden.keys(), "jobs added or removed: regenerate tests/config_hashes.json"
