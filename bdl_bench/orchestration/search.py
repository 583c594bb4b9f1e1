"""Hyperparameter search as stacked copies: the trials of every split of a stacked job train as one stack.

As in SLANG Table 2 (Mishkin et al. 2018, App. F.3), one Optuna study per split (multivariate TPE on a log scale,
with the constant liar) searches ``search.params`` on a validation part of the split's training rows; all trials
of a round, over all splits, train as one stack; each split's test run then trains with its best values
(:func:`tuned_members`). Seeding, the journal a search resumes from, grids and files: ``docs/search.md``.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import DictConfig, OmegaConf, open_dict

from bdl_bench.errors import ConfigError, DataFileError
from bdl_bench.methods.base import CannotStack, NonFiniteLossError
from bdl_bench.orchestration.stacked import member_config, run_stack
from bdl_bench.results import METRICS_FILE, append_whole, atomic_write_text, read_config, read_csv_exact

SEARCH_DIR = ".search"
JOURNAL_FILE = "journal.jsonl"
TRIALS_FILE = "trials.csv"
SPLIT_TRIALS_FILE = "search.csv"


@dataclass(frozen=True)
class Param:
    """A searched config key, on a log scale between ``low`` and ``high``."""

    key: str
    low: float
    high: float


@dataclass(frozen=True)
class SearchSpec:
    params: tuple[Param, ...]
    grid: Mapping[str, tuple[float, ...]] | None  # key → values: a grid search instead of BO
    n_random: int
    n_guided: int
    round_size: int
    val_fraction: float
    objective: str
    seed: int

    @property
    def budget(self) -> int:
        return math.prod(len(v) for v in self.grid.values()) if self.grid else self.n_random + self.n_guided

    def round_end(self, n_done: int) -> int:
        """How many trials a split has once the round after ``n_done`` trials is over."""
        if self.grid or n_done < self.n_random:
            return self.budget if self.grid else self.n_random
        return min(self.budget, n_done + self.round_size)


def _int_at_least(search: DictConfig, key: str, low: int) -> int:
    value = search.get(key)
    if not isinstance(value, int) or value < low:
        raise ConfigError(f"search.{key}={value!r}: give an integer >= {low}")
    return value


def read_grid_file(path: Path, key: str) -> tuple[float, ...]:
    """The values of a grid file (numbers separated by white space)."""
    if not path.is_file():
        raise DataFileError(f"search grid for {key}: {path} does not exist; give an existing file in search.grids")
    try:
        values = tuple(float(v) for v in path.read_text().split())
    except ValueError:
        raise DataFileError(f"search grid for {key}: {path} holds something other than numbers") from None
    if not values:
        raise DataFileError(f"search grid for {key}: {path} is empty; list the values to try, one per line")
    return values


def _data_folder(cfg: DictConfig) -> Path:
    """The dataset's folder (``data/uci/<set>``), where its grid files lie."""
    from bdl_bench.data.base import default_data_root
    from bdl_bench.data.uci import UCI_FOLDERS

    root = OmegaConf.select(cfg, "data.root")
    name = str(cfg.data.name).removeprefix("uci/")
    return (default_data_root() if root is None else Path(str(root))) / "uci" / UCI_FOLDERS.get(name, name)


def read_spec(cfg: DictConfig) -> SearchSpec:
    """The search of ``cfg`` (its ``search`` node), checked."""
    search = cfg.search
    method = str(cfg.method.name)
    grid_files = (search.get("grids") or {}).get(method)
    grid = None
    if grid_files:
        folder = _data_folder(cfg)
        grid = {str(k): read_grid_file(folder / str(f), str(k)) for k, f in grid_files.items()}
    params = []
    for key, bounds in ({} if grid else search.get("params") or {}).items():  # a grid replaces the search
        if bounds is None:  # taken out of the search (e.g. by a method's settings)
            continue
        if not OmegaConf.is_list(bounds) or len(bounds) != 2:
            raise ConfigError(f"search.params.{key}={bounds}: give [low, high]")
        low, high = float(bounds[0]), float(bounds[1])
        if not 0 < low < high:
            raise ConfigError(
                f"search.params.{key}=[{low}, {high}]: bounds must satisfy 0 < low < high (searched on a log scale)"
            )
        params.append(Param(str(key), low, high))
    if not grid and not params:
        raise ConfigError("search.params is empty: name at least one key to search, e.g. noise_precision: [0.5, 2]")
    n_random, n_guided = _int_at_least(search, "n_random", 0), _int_at_least(search, "n_guided", 0)
    if grid is None and n_random + n_guided < 1:
        raise ConfigError(f"search.n_random + search.n_guided = {n_random + n_guided}: the budget must be >= 1")
    val_fraction = float(search.val_fraction)
    if not 0 < val_fraction < 1:
        raise ConfigError(f"search.val_fraction={val_fraction}: give a fraction in (0, 1)")
    return SearchSpec(
        params=tuple(params),
        grid=grid,
        n_random=n_random,
        n_guided=n_guided,
        round_size=_int_at_least(search, "round_size", 1),
        val_fraction=val_fraction,
        objective=str(search.objective),
        seed=int(search.seed),
    )


def _trial_config(cfg: DictConfig, split: int, values: Mapping[str, Any], val_fraction: float) -> DictConfig:
    """The config of the run of ``split`` with ``values`` set (and ``val_fraction`` of its rows held out)."""
    member = member_config(cfg, split)
    with open_dict(member):
        member.data.val_fraction = val_fraction
        for key, value in values.items():
            OmegaConf.update(member, key, value, merge=False)
    return member


def _copy_index(error: BaseException) -> int | None:
    """The stacked copy a divergence names (``... in stacked copy 3 ...``), if any."""
    match = re.search(r"copy (\d+)", str(error))
    return int(match.group(1)) if match else None


class Search:
    """The studies of one stacked job (module docstring)."""

    def __init__(self, cfg: DictConfig, job_dir: Path, splits: Sequence[int]) -> None:
        import optuna

        self.cfg, self.spec, self.splits = cfg, read_spec(cfg), list(splits)
        # the trials' job config: search.trial_settings (nested, as method_settings) applied, e.g. a shorter
        # training for the trials than for the test runs
        self.trial_cfg = copy.deepcopy(cfg)
        _apply_settings(self.trial_cfg, OmegaConf.select(cfg, "search.trial_settings") or {})
        self.root = Path(job_dir) / SEARCH_DIR
        self.root.mkdir(parents=True, exist_ok=True)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.studies = {k: optuna.create_study(study_name=f"split={k}", direction="maximize") for k in self.splits}
        self._running: dict[tuple[int, int], Any] = {}  # (split, number) → the asked optuna Trial, until told
        self.journal = self.root / JOURNAL_FILE
        self._replay()

    def _distributions(self) -> dict[str, Any]:
        from optuna.distributions import CategoricalDistribution, FloatDistribution

        grid = {k: CategoricalDistribution(list(v)) for k, v in (self.spec.grid or {}).items()}
        return {**grid, **{p.key: FloatDistribution(p.low, p.high, log=True) for p in self.spec.params}}

    def _ask_one(self, split: int) -> Any:
        """A new trial of ``split`` with its values suggested (an enqueued trial takes the enqueued values)."""
        trial = self.studies[split].ask()
        for key, values in (self.spec.grid or {}).items():
            trial.suggest_categorical(key, list(values))
        for p in self.spec.params:
            trial.suggest_float(p.key, p.low, p.high, log=True)
        self._running[(split, trial.number)] = trial
        return trial

    def _log(self, record: dict[str, Any]) -> None:
        append_whole(self.journal, json.dumps(record) + "\n", sync=True)  # a full disk leaves no half line

    def _replay(self) -> None:
        """Rebuild the studies from the journal: told trials as they ended, asked ones asked again."""
        import optuna
        from optuna.trial import TrialState

        if not self.journal.exists():
            return
        asked: dict[tuple[int, int], dict[str, Any]] = {}
        told: dict[tuple[int, int], dict[str, Any]] = {}
        for line in self.journal.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a blank line, or one cut by a kill
                continue
            if record["event"] == "ask":  # one line per round: its trials are asked all or none
                asked.update({(t["split"], t["trial"]): t for t in record["trials"]})
            else:
                told[(record["split"], record["trial"])] = record
        distributions = self._distributions()
        for (k, number), record in sorted(asked.items()):
            study = self.studies.get(k)
            if study is None:
                continue
            if number != len(study.trials):
                raise RuntimeError(f"{self.journal}: trial {number} of split {k} out of order; move the folder away")
            end = told.get((k, number))
            if end is None:
                study.enqueue_trial(record["params"])
                self._ask_one(k)
                continue
            state = TrialState[end["state"]]
            study.add_trial(
                optuna.trial.create_trial(
                    params=record["params"],
                    distributions={key: distributions[key] for key in record["params"]},
                    value=end["value"] if state is TrialState.COMPLETE else None,
                    state=state,
                    user_attrs={"error": end["error"]} if end.get("error") else None,
                )
            )

    def _sampler(self, split: int, n_done: int) -> Any:
        import optuna

        seed = (self.spec.seed * 1_000_003 + split * 1009 + n_done) % 2**31
        with warnings.catch_warnings():  # both arguments are experimental before optuna 5 (its defaults from 5)
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(
                seed=seed, n_startup_trials=self.spec.n_random, multivariate=True, constant_liar=True
            )

    def _ask(self, split: int) -> list[Any]:
        """New trials of ``split`` up to the end of its next round."""
        study = self.studies[split]
        n_done = len(study.trials)
        n_new = self.spec.round_end(n_done) - n_done if n_done < self.spec.budget else 0
        if self.spec.grid:
            combos = list(itertools.product(*self.spec.grid.values()))
            for combo in combos[n_done : n_done + n_new]:
                study.enqueue_trial(dict(zip(self.spec.grid, combo)))
        study.sampler = self._sampler(split, n_done)
        return [self._ask_one(split) for _ in range(n_new)]

    def trial_dir(self, split: int, number: int) -> Path:
        return self.root / f"split={split}" / f"trial={number:03d}"

    def _tell(self, split: int, number: int, value: float | None, error: str | None = None) -> None:
        from optuna.trial import TrialState

        study = self.studies[split]
        trial = self._running.pop((split, number))
        failed = value is None or not math.isfinite(value)
        if failed and error is None:
            error = f"{self.spec.objective} = {value}"
        if error is not None:
            trial.set_user_attr("error", error)
        state, value = ("FAIL", None) if failed else ("COMPLETE", value)
        study.tell(trial, value, state=TrialState[state])
        self._log({"event": "tell", "split": split, "trial": number, "state": state, "value": value, "error": error})

    def _pending(self) -> dict[tuple[int, int], dict[str, Any]]:
        """Asked but not told trials (a killed round): told now if their run finished, else to train."""
        from optuna.trial import TrialState

        pending = {}
        for k, study in self.studies.items():
            for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                if (self.trial_dir(k, t.number) / METRICS_FILE).exists():
                    self._tell(k, t.number, self._score(k, t.number))
                else:
                    pending[(k, t.number)] = dict(t.params)
        return pending

    def _score(self, split: int, number: int) -> float:
        metrics = json.loads((self.trial_dir(split, number) / METRICS_FILE).read_text())  # floats exactly as written
        if self.spec.objective not in metrics:
            raise KeyError(f"search.objective={self.spec.objective!r} is not among the trial's metrics")
        value = metrics[self.spec.objective]
        return math.nan if value is None else float(value)  # a non-finite metric is written as null

    def run(self) -> dict[int, dict[str, Any]]:
        """Every round until each split's budget is spent; the best values per split."""
        while True:
            members = self._pending()
            if not members:
                for k in self.splits:
                    members.update({(k, t.number): dict(t.params) for t in self._ask(k)})
                if not members:
                    break
                self._log(
                    {"event": "ask", "trials": [{"split": k, "trial": n, "params": v} for (k, n), v in members.items()]}
                )
            self._train(members)
            atomic_write_text(self.root / TRIALS_FILE, self.trials().to_csv(index=False))
        return self.best()

    def _train(self, members: dict[tuple[int, int], dict[str, Any]]) -> None:
        """Train the trials ``members`` as one stack (one by one for a method that cannot stack) and tell
        each its validation score; a diverging copy fails alone and the others train again without it."""
        todo = dict(members)
        while todo:
            configs = {
                key: _trial_config(self.trial_cfg, key[0], values, self.spec.val_fraction)
                for key, values in todo.items()
            }
            dirs = {key: self.trial_dir(*key) for key in todo}
            try:
                run_stack(self.trial_cfg, dirs, self.root, configs)
            except CannotStack as reason:
                self._train_one_by_one(configs, dirs, str(reason))
                return
            except NonFiniteLossError as error:
                index = 0 if len(todo) == 1 else _copy_index(error)  # a stack of one runs as a single run
                if index is None:
                    raise
                key = list(todo)[index]
                self._tell(*key, None, error=f"{type(error).__name__}: {error}")
                del todo[key]
                continue
            for key in todo:
                self._tell(*key, self._score(*key))
            return

    def _train_one_by_one(self, configs: Mapping[tuple[int, int], DictConfig], dirs: Mapping, reason: str) -> None:
        from bdl_bench.orchestration.runner import run

        print(f"{reason}: the {len(configs)} trials run one after another", flush=True)
        for key, member in configs.items():
            try:
                run(member, dirs[key])
            except NonFiniteLossError as error:
                self._tell(*key, None, error=f"{type(error).__name__}: {error}")
                continue
            self._tell(*key, self._score(*key))

    def trials(self) -> pd.DataFrame:
        """Every trial of every split: split, number, state, the searched values, the score, any error."""
        best = {k: _best_number(study) for k, study in self.studies.items()}
        return pd.DataFrame(
            [
                {
                    "split": k,
                    "trial": t.number,
                    "state": t.state.name,
                    **t.params,
                    self.spec.objective: t.value,
                    "best": t.number == best[k],
                    "error": t.user_attrs.get("error", ""),
                }
                for k, study in self.studies.items()
                for t in study.get_trials(deepcopy=False)
            ]
        )

    def best(self) -> dict[int, dict[str, Any]]:
        best = {}
        for k, study in self.studies.items():
            if _best_number(study) is None:
                raise RuntimeError(
                    f"search of {self.cfg.method.name} on {self.cfg.data.name} split {k}: every trial failed "
                    f"(see {self.root / TRIALS_FILE}); narrow search.params"
                )
            best[k] = dict(study.best_trial.params)
        return best


def _best_number(study: Any) -> int | None:
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return max(complete, key=lambda t: t.value).number if complete else None


def tuned_members(cfg: DictConfig, job_dir: Path, splits: Sequence[int]) -> dict[int, DictConfig]:
    """Run (or resume) the search of the stacked job ``cfg`` and return each split's test-run config: its
    single run's config with the split's best values (on the whole training part)."""
    best = Search(cfg, job_dir, splits).run()
    return {k: _trial_config(cfg, k, best[k], float(cfg.data.val_fraction)) for k in splits}


def write_split_trials(job_dir: Path, member_dirs: Mapping[int, Path]) -> None:
    """Each split's trials (``search.csv``) into its test run's folder."""
    path = Path(job_dir) / SEARCH_DIR / TRIALS_FILE
    if not path.exists():
        return
    trials = read_csv_exact(path)
    for k, d in member_dirs.items():
        Path(d).mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(d) / SPLIT_TRIALS_FILE, trials[trials["split"] == k].to_csv(index=False))


def search_summary(folder: Path) -> pd.DataFrame:
    """One row per tuned run below ``folder`` (a ``search.csv`` beside its ``metrics.json``): dataset, method,
    split, the values its search chose, their validation score, and how many trials ran and failed."""

    from bdl_bench.results import find_run_dirs

    rows = []
    for run_dir in find_run_dirs(Path(folder)):
        path = run_dir / SPLIT_TRIALS_FILE
        if not path.exists():
            continue
        config = read_config(run_dir / "config.yaml")
        trials = read_csv_exact(path)
        chosen = _chosen(trials) or {}
        rows.append(
            {
                "dataset": str(config["data"]["name"]).rsplit("/", 1)[-1],
                "method": config["method"]["name"],
                "split": config["data"]["split"],
                **chosen,
                "trials": len(trials),
                "failed": int((trials["state"] == "FAIL").sum()),
            }
        )
    return pd.DataFrame(rows).sort_values(["dataset", "method", "split"]) if rows else pd.DataFrame()


def has_search(cfg: DictConfig) -> bool:
    return OmegaConf.select(cfg, "search") is not None


def _leaves(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of every leaf of a nested mapping (an empty mapping is a leaf)."""
    if not isinstance(node, Mapping) or not node:
        return [(prefix, node)]
    return [leaf for key, value in node.items() for leaf in _leaves(value, f"{prefix}.{key}" if prefix else str(key))]


def _apply_settings(cfg: DictConfig, settings: Any) -> None:
    """Set every leaf of the nested ``settings`` in ``cfg`` (in place; keys it lacks are added)."""
    values = OmegaConf.to_container(settings, resolve=True) if isinstance(settings, DictConfig) else settings
    with open_dict(cfg):
        for key, value in _leaves(values):
            OmegaConf.update(cfg, key, value, merge=False, force_add=True)


def with_method_settings(cfg: DictConfig) -> DictConfig:
    """``cfg`` with ``search.method_settings.<method>`` applied: a nested mapping whose every leaf is set in the
    config (the protocol a method's search and test runs follow, e.g. Gal's epochs, batch size and learning rate
    for dropout; ``search.params.<key>: null`` takes a key out of the search)."""
    settings = (OmegaConf.select(cfg, "search.method_settings") or {}).get(str(cfg.method.name))
    if not settings:
        return cfg
    tuned = copy.deepcopy(cfg)
    _apply_settings(tuned, settings)
    return tuned


def apply_searched(cfg: DictConfig, run_dir: Path) -> DictConfig:
    """``cfg`` (a test run's config as its overrides compose it) with the values its search chose, read
    from the run folder's ``search.csv``; ``cfg`` itself when it has no search."""
    path = Path(run_dir) / SPLIT_TRIALS_FILE
    if not has_search(cfg) or not path.exists():
        return cfg
    chosen = _chosen(read_csv_exact(path))
    if chosen is None:
        return cfg
    tuned = cfg.copy()
    for key, value in chosen.items():
        if key != str(cfg.search.objective):
            OmegaConf.update(tuned, key, value.item() if hasattr(value, "item") else value, merge=False)
    return tuned


def _chosen(trials: pd.DataFrame) -> dict[str, Any] | None:
    """The searched values and score of the trial marked ``best`` in a ``search.csv``, if any."""
    best = trials[trials["best"].astype(bool)]
    return best.drop(columns=["split", "trial", "state", "best", "error"]).iloc[0].to_dict() if len(best) else None
