"""``bdl-bench reproduce`` of a benchmark: an experiment whose config holds a ``benchmark:`` block (its keys:
:class:`Benchmark`, ``docs/benchmarks.md``) times training steps with ``scripts/bench_step.py``, in this process,
each in alternation with a plain SGD step of the same model, so that the tables compare ratios
(``ktied_table4``: k-tied Normal, Table 4; ``elrg_table1``: ELRG-VI, Table 1).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from types import ModuleType
from typing import Any

import pandas as pd
import torch
from threadpoolctl import threadpool_limits

from bdl_bench.errors import ConfigError
from bdl_bench.report.tables import markdown as markdown_table

BENCH_STEP = Path(__file__).resolve().parents[2] / "scripts" / "bench_step.py"
IN_FEATURES, OUT_FEATURES = 784, 10  # bench_step's MLP: 784-<hidden>-10


@functools.cache
def bench_step() -> ModuleType:
    """``scripts/bench_step.py`` as a module (it lives beside the package, in the checkout, as ``conf/`` does)."""
    spec = importlib.util.spec_from_file_location("bench_step", BENCH_STEP)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot load {BENCH_STEP}: the benchmarks need the project's checkout")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_step", module)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Benchmark:
    """An experiment's ``benchmark:`` block (``docs/benchmarks.md`` lists the keys)."""

    table: str
    methods: list[str]
    hidden: list[list[int]]
    title: str = ""  # the table's heading in reproduce.md
    note: str = ""  # below the table: what it compares with the paper, and how closely
    batch: int = 200
    mc_samples: int = 1
    steps: int = 20
    warmup: int = 3
    threads: int = 1
    device: str = "cpu"
    clock: str = "wall"
    memory: bool = True

    @classmethod
    def from_config(cls, node: Mapping[str, Any], *, quick: bool) -> Benchmark:
        """The block, checked, with its ``quick`` entries in place of the others under ``--quick``."""
        settings = {k: v for k, v in node.items() if k != "quick"}
        if quick:
            settings.update(node.get("quick") or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ConfigError(f"benchmark: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        missing = sorted({"table", "methods", "hidden"} - set(settings))
        if missing:
            raise ConfigError(f"benchmark: {', '.join(missing)} missing")
        settings["methods"] = [str(m) for m in settings["methods"]]
        settings["hidden"] = [[int(h) for h in widths] for widths in settings["hidden"]]
        bench = cls(**settings)
        if bench.table not in TABLES:
            raise ConfigError(f"benchmark.table={bench.table!r}; known: {', '.join(TABLES)}")
        if bench.clock not in ("wall", "thread"):
            raise ConfigError(f"benchmark.clock={bench.clock!r}; use wall or thread")
        for key in ("batch", "mc_samples", "steps", "threads"):
            if int(getattr(bench, key)) < 1:
                raise ConfigError(f"benchmark.{key}={getattr(bench, key)}; must be at least 1")
        return bench


@contextmanager
def _threads(n: int) -> Iterator[None]:
    """Compute with ``n`` torch and BLAS threads inside the block (as ``bdl_bench.orchestration.threads.set_threads``)."""
    before = torch.get_num_threads()
    with threadpool_limits(limits=n, user_api="blas"):
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(before)


def _specs(methods: Sequence[str]) -> tuple[list[str], list[int]]:
    """bench_step's method list and SLANG ranks: ``slang:<L>`` entries become ``slang`` at rank L."""
    ranks = [int(m.partition(":")[2] or 8) for m in methods if m.partition(":")[0] == "slang"]
    others = [m for m in methods if m.partition(":")[0] != "slang"]
    return others + (["slang"] if ranks else []), ranks


def measure(bench: Benchmark, progress: Callable[[str], None] = print) -> pd.DataFrame:
    """Time every method on every model of ``bench`` against SGD (bench_step's records, one row each, with the
    model's ``hidden`` widths as ``784-…-10`` and its first width as ``width``)."""
    from bdl_bench.orchestration.allocator import keep_freed_memory
    from bdl_bench.orchestration.devices import resolve_device

    module = bench_step()
    keep_freed_memory()  # as in every process that runs jobs (hydra_app): time the steps a run takes
    device = resolve_device(bench.device)
    if bench.clock == "thread" and device.type == "cuda":
        raise ConfigError("benchmark.clock=thread measures CPU time; use the wall clock on CUDA")
    clock = time.perf_counter if bench.clock == "wall" else time.thread_time
    methods, ranks = _specs(bench.methods)
    rows = []
    with _threads(bench.threads):
        for hidden in bench.hidden:
            try:
                found = module.entries(methods, ranks, device, bench.batch, bench.mc_samples, hidden)
            except ValueError as error:
                raise ConfigError(f"benchmark.methods: {error}") from None
            records = module.bench(
                found,
                device,
                batch=bench.batch,
                steps=bench.steps,
                warmup=bench.warmup,
                memory=bench.memory,
                clock=clock,
                hidden=hidden,
            )
            for record in records:
                model = "-".join(str(n) for n in (IN_FEATURES, *hidden, OUT_FEATURES))
                progress(f"[bench] {model} {record['method']} rank={record['rank']}: {record['step_ms']:.2f} ms a step")
                rows.append({"model": model, "width": hidden[0], **record})
    return pd.DataFrame(rows)


# ------------------------------------------------------------------ k-tied Normal, Table 4

KTIED_PAPER = "ktied_table4_step_time.csv"


def _ratio_se(a: float, se_a: float, b: float, se_b: float) -> float:
    """Standard error of a / b from independent standard errors (delta method)."""
    return abs(a / b) * math.sqrt((se_a / a) ** 2 + (se_b / b) ** 2)


def ktied_paper_ratios() -> dict[str, tuple[float, float, float, float, float, float]]:
    """Per paper method: its step ms and SEM, its ratio to the point estimate and that ratio's SE, its ratio to
    standard GMFVI and that ratio's SE (a method's ratio to itself has SE 0)."""
    from bdl_bench.report.paper import read_paper_csv

    paper = read_paper_csv(KTIED_PAPER).set_index("method")
    times = {str(m): (float(r["train_step_ms_mean"]), float(r["train_step_ms_sem"])) for m, r in paper.iterrows()}
    point, gmfvi = times["point_estimate"], times["standard_gmfvi"]
    out = {}
    for method, (mean, sem) in times.items():
        point_se = 0.0 if method == "point_estimate" else _ratio_se(mean, sem, *point)
        gmfvi_se = 0.0 if method == "standard_gmfvi" else _ratio_se(mean, sem, *gmfvi)
        out[method] = (mean, sem, mean / point[0], point_se, mean / gmfvi[0], gmfvi_se)
    return out


def _ktied_name(method: str, rank: Any) -> str:
    return "standard_gmfvi" if method == "gmfvi" else f"{int(rank)}_tied_gmfvi" if method == "ktied" else method


def ktied_table4(records: pd.DataFrame) -> pd.DataFrame:
    """Per model: the point estimate (the median of the SGD steps timed beside every method), then each method,
    with our step time, ratio to the point estimate and to GMFVI, and the paper's (empty where it has none)."""
    rows = []
    for model, group in records.groupby("model", sort=False):
        gmfvi = group.loc[group["method"] == "gmfvi", "ratio_to_sgd"]
        gmfvi_ratio = float(gmfvi.iloc[0]) if len(gmfvi) else math.nan
        sgd_ms = statistics.median(group["sgd_step_ms"])
        sgd_mem = group["sgd_peak_mem_mib"].iloc[0]
        rows.append(("point_estimate", model, sgd_ms, 1.0, 1.0 / gmfvi_ratio, 1.0, sgd_mem))  # all its SGD steps
        for _, r in group.iterrows():
            name, ratio = _ktied_name(r["method"], r["rank"]), r["ratio_to_sgd"]
            rows.append((name, model, r["step_ms"], ratio, ratio / gmfvi_ratio, r["flop_ratio"], r["peak_mem_mib"]))
    columns = ["method", "model", "step_ms", "ratio_to_point", "ratio_to_gmfvi", "flop_ratio", "peak_mem_mib"]
    paper_columns = ["paper_step_ms", "paper_step_ms_se", "paper_ratio_to_point", "paper_ratio_to_point_se"]
    paper_columns += ["paper_ratio_to_gmfvi", "paper_ratio_to_gmfvi_se"]
    paper = pd.DataFrame.from_dict(ktied_paper_ratios(), orient="index", columns=paper_columns)
    return pd.DataFrame(rows, columns=columns).join(paper, on="method")


# ------------------------------------------------------------------ ELRG-VI, Table 1


def _layers(hidden: Sequence[int]) -> list[tuple[int, int]]:
    widths = [IN_FEATURES, *hidden, OUT_FEATURES]
    return list(zip(widths[:-1], widths[1:]))


def elrg_predicted_time_ratio(hidden: Sequence[int], rank: int, batch: int) -> float:
    """The paper's Table 1 time of an update of a layer's variational parameters, summed over the MLP's layers,
    efficient low-rank over mean field with the LRT: ``Σ (K³ + (K+2)·N_in·N_out·|B|) / Σ 2·N_in·N_out·|B|``."""
    low_rank = sum(rank**3 + (rank + 2) * n_in * n_out * batch for n_in, n_out in _layers(hidden))
    return low_rank / sum(2 * n_in * n_out * batch for n_in, n_out in _layers(hidden))


def elrg_predicted_memory_ratio(hidden: Sequence[int], rank: int, batch: int) -> float:
    """The paper's Table 1 memory (additional memory to estimate the gradient, not the memory storing the
    variational parameters), summed over the layers: ``Σ (K+2)·N_out·|B| / Σ 2·N_out·|B|`` = (K + 2) / 2."""
    low_rank = sum((rank + 2) * n_out * batch for _, n_out in _layers(hidden))
    return low_rank / sum(2 * n_out * batch for _, n_out in _layers(hidden))


ELRG_NAMES = {"gmfvi": "mean field (LRT)", "elrg": "ELRG-VI", "elrg_d": "ELRG-D-VI"}


def elrg_table1(records: pd.DataFrame) -> pd.DataFrame:
    """Per model and method: step time and peak memory, their ratios to mean field (GMFVI) of the same model, and
    the ratios the paper's stated costs predict. The time ratio is of the two methods' ratios to SGD (each timed
    in alternation with SGD), so a change of machine load between the two cancels."""
    rows = []
    for model, group in records.groupby("model", sort=False):
        mf = group[group["method"] == "gmfvi"]
        if mf.empty:
            raise ConfigError("benchmark elrg_table1: methods must include gmfvi (mean field), the baseline")
        mf = mf.iloc[0]
        hidden = [int(h) for h in model.split("-")[1:-1]]
        for _, r in group.iterrows():
            rank = None if r["method"] == "gmfvi" else int(r["rank"])
            batch = int(r["batch"])
            rows.append(
                {
                    "model": model,
                    "width": int(r["width"]),
                    "method": ELRG_NAMES.get(r["method"], r["method"]),
                    "K": rank,
                    "step_ms": r["step_ms"],
                    "time_ratio_to_mf": r["ratio_to_sgd"] / mf["ratio_to_sgd"],
                    "paper_time_ratio": 1.0 if rank is None else elrg_predicted_time_ratio(hidden, rank, batch),
                    "flop_ratio_to_mf": r["flop_ratio"] / mf["flop_ratio"],
                    "peak_mem_mib": r["peak_mem_mib"],
                    "mem_ratio_to_mf": _ratio(r["peak_mem_mib"], mf["peak_mem_mib"]),
                    "paper_mem_ratio": 1.0 if rank is None else elrg_predicted_memory_ratio(hidden, rank, batch),
                }
            )
    frame = pd.DataFrame(rows)
    frame["K"] = frame["K"].astype("Int64")
    return frame


def _ratio(a: Any, b: Any) -> float:
    return math.nan if a is None or b is None or pd.isna(a) or pd.isna(b) or b == 0 else float(a) / float(b)


TABLES: dict[str, Callable[[pd.DataFrame], pd.DataFrame]] = {"ktied_table4": ktied_table4, "elrg_table1": elrg_table1}


def _cell(value: Any, se: Any = None) -> str:
    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return "–"
    if isinstance(value, float):
        text = f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
        return text if se is None or pd.isna(se) or se == 0 else f"{text} ± {se:.2g}"
    return str(value)


def markdown(frame: pd.DataFrame) -> str:
    """The table, a ``<column>_se`` shown as ``± se`` beside its column."""
    columns = [c for c in frame.columns if not (c.endswith("_se") and c.removesuffix("_se") in frame.columns)]
    rows = [[_cell(row[c], row.get(f"{c}_se")) for c in columns] for _, row in frame.iterrows()]
    return markdown_table(columns, rows)


def run_benchmark(experiment: str, config: Any, args: Sequence[str], *, quick: bool) -> Path:
    """Measure the experiment's benchmark and write ``reproduce.md`` and ``reproduce.csv`` (the CSV's header as
    ``# `` lines) into ``<results_root>/<experiment_name>``; returns that folder."""
    from omegaconf import OmegaConf

    from bdl_bench.orchestration.allocator import malloc_setting
    from bdl_bench.orchestration.reproduce import provenance, write_report

    started_wall, started_cpu = time.perf_counter(), time.process_time()
    node = OmegaConf.to_container(config.benchmark, resolve=True)
    bench = Benchmark.from_config(node, quick=quick)  # type: ignore[arg-type]
    folder = Path(str(config.results_root)) / str(config.experiment_name)
    print(f"{experiment}: benchmark of {', '.join(bench.methods)} on {len(bench.hidden)} model(s)", flush=True)
    records = measure(bench)
    frame = TABLES[bench.table](records)
    header = provenance(args, time.perf_counter() - started_wall)
    header["wall time"] = f"{time.perf_counter() - started_wall:.0f} s"
    header["CPU time"] = f"{time.process_time() - started_cpu:.0f} s (this process)"
    header["benchmark"] = (
        f"device {bench.device}, {bench.threads} thread(s), batch {bench.batch}, {bench.mc_samples} MC sample(s), "
        f"{bench.steps} timed rounds after {bench.warmup} warm-up, {bench.clock} clock, step time = median, "
        f"malloc {malloc_setting()}"
    )
    title = f"# {experiment}" + (" (--quick: not the benchmark's settings)" if quick else "")
    text = f"{bench.title}\n\n{markdown(frame)}\n\n{bench.note}"
    write_report(folder, title, header, text, frame)
    print(f"\n{title}\n\n{text}\n\n(Markdown: {folder / 'reproduce.md'}; CSV: {folder / 'reproduce.csv'})")
    return folder
