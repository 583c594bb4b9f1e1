"""Time the KFAC and DEF Laplace fits of DEF's MNIST LeNet against one MAP training epoch.

Everything runs in this one process, on the same model and data: DEF's LeNet (conv 5x5x32, conv 5x5x64,
FC 1024, FC 10; ``--channels``/``--hidden``/``--image-size`` shrink it) and ``--n-data`` random images
``(1, 28, 28)`` with random labels of 10 classes, float32, ``--threads`` torch threads (1 by default).

- **epoch**: one epoch of ``method=map`` (Adam, lr 0.001, minibatches of ``--batch-size`` = 50, the
  prior precision 0.001 of ``experiment=def_table1``), through ``Method.fit``, after a two-step warm-up;
- **fit**: ``Laplace.fit_posterior`` at the trained MAP, with the options of ``variant=def_table1/kfac``
  and ``def_table1/def`` (Fisher with one sampled label per example, curvature chunks of 256 and 64 examples,
  DEF rank K = ``--rank``, ``method.curvature_dtype`` = ``--curvature-dtype``, by default the model's
  float32): the curvature passes over all the data, the eigendecompositions, and for DEF the EFB
  eigenvalues, Alg. 1 and the diagonal correction. This is the code ``method=laplace`` runs after its
  MAP epochs. With ``--curvature-subset S`` each structure is also timed with ``method.curvature_subset``
  (S of the 50,000 images, i.e. S·n/50,000 of the n measured ones; records say ``curvature_subset``).

MNIST's training set has 50,000 images. With a smaller ``--n-data`` both times are scaled up to 50,000,
and each record says so (``scaling``): the epoch linearly (``epoch_s = measured_epoch_s * 50000 / n``);
the fit, which also has a part that does not grow with the data (eigendecompositions, Alg. 1), as
``a + b * 50000`` from a second fit on the first n/2 images (``fit_fixed_s`` = a, ``fit_per_example_ms``
= 1000 b; when the two fits give a ≤ 0, plain linear scaling). ``ratio_at_n_data`` (both times as
measured on the same n images) is an upper bound on the ratio at 50,000 when the fixed part is
non-negative. The issue's target: ``ratio_to_epoch <= 2``. ``flop_ratio`` is the same ratio in multiply-adds (the
convolutions and matrix products, :func:`multiply_adds`, of the part of the fit that grows with the data, from fits
on 512 and 256 images, against a MAP training step's per image): what ``ratio_to_epoch`` would be if those ran at the
training step's speed and the fixed part (eigendecompositions, Alg. 1) took no time. The same ratio from this process's CPU time
(``time.process_time``, same extrapolation) is ``cpu_ratio_to_epoch``: on a machine shared with other
jobs it varies less than the wall-clock one. EFB/DEF keep pass 1's tensors for their second pass
(``method.curvature_cache_mib``, ``--curvature-cache-mib``; 0 recomputes it): ``curvature_cache_mib`` is
what they kept here, ``curvature_cache_mib_scaled`` that scaled to 50,000 images (it must fit the budget
for the extrapolation to hold). ``--device`` ``auto`` (default: CUDA when present), ``cpu`` or ``cuda``; every fit is
preceded by an untimed warm-up fit on 128 images, and on CUDA every timed region is synchronised before and after,
with its peak allocated memory in ``cuda_peak_mib`` (fit) and ``epoch_cuda_peak_mib``. One JSON line per structure:

    {"structure": "kfac", "curvature_subset": null, "fit_s": ..., "epoch_s": ..., "ratio_to_epoch": ...,
     "n_data": 5000, "threads": 1, "scaled_to": 50000, "scaling": "...", "measured_fit_s": ..., ...}

    python scripts/bench_laplace_fit.py --n-data 5000            # about a minute per structure on 1 thread
    python scripts/bench_laplace_fit.py --n-data 5000 --curvature-subset 10000   # also with 10k curvature examples
    python scripts/bench_laplace_fit.py --n-data 100 --channels 2,3 --hidden 8 --image-size 8   # smoke
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

from bdl_bench.errors import ConfigError
from bdl_bench.likelihoods import Categorical
from bdl_bench.methods import build_method
from bdl_bench.methods.base import Problem
from bdl_bench.methods.laplace import Laplace
from bdl_bench.models import build_model
from bdl_bench.models.params import prior_precision_vector
from bdl_bench.orchestration.devices import resolve_device
from bdl_bench.orchestration.threads import set_threads

FULL_N = 50_000  # MNIST training images (DEF Table 1)
PRIOR_PRECISION = 0.001  # experiment=def_table1: TensorFlow's L2 coefficient 1e-8 as lambda = 2cN
LR = 0.001
WARMUP_ROWS = 64  # a fit on 128 images (and 2 MAP steps) before anything is timed
FLOP_COUNT_ROWS = 512  # flop_ratio: the multiply-adds of fits on this many images and half as many
STRUCTURE_OPTIONS = {  # conf/variant/def_table1/{kfac,def}.yaml
    "kfac": {"structure": "kfac", "curvature": "fisher", "curvature_batch_size": 256},
    "def": {"structure": "def", "curvature": "fisher", "curvature_batch_size": 64},
}


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, float, float | None]:
    """``(wall s, CPU s, CUDA peak MiB or None)`` of ``fn()``: on CUDA synchronised before and after (kernels run
    asynchronously) and the peak of ``torch.cuda.max_memory_allocated`` during the call."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return wall, cpu, torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def _addmm_like(self_shape: Any, a: Any, b: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return 2 * math.prod(a) * b[-1]  # (b x) m x k times (b x) k x n


def _mv_like(a: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return 2 * math.prod(a)


_FLOPS = {  # torch.utils.flop_counter's formulas, and the in-place and matrix-vector products it leaves out
    **flop_counter.flop_registry,
    torch.ops.aten.addmm_: flop_counter.shape_wrapper(_addmm_like),
    torch.ops.aten.baddbmm_: flop_counter.shape_wrapper(_addmm_like),
    torch.ops.aten.addmv: flop_counter.shape_wrapper(lambda self_shape, a, *rest, **kw: _mv_like(a)),
    torch.ops.aten.addmv_: flop_counter.shape_wrapper(lambda self_shape, a, *rest, **kw: _mv_like(a)),
    torch.ops.aten.mv: flop_counter.shape_wrapper(_mv_like),
}


class _CountFlops(TorchDispatchMode):
    """FLOPs of the operators that reach the dispatcher (``FlopCounterMode`` without its module tracking, whose
    backward hooks ``torch.autograd.grad`` on the curvature passes' inputs refuses)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = _FLOPS.get(func.overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        return out


def multiply_adds(fn: Callable[[], Any]) -> int:
    """Multiply-adds of the convolutions and matrix products ``fn`` runs (in-place and matrix-vector products
    included): ``torch.utils.flop_counter``'s formulas, 2 FLOPs per multiply-add."""
    with _CountFlops() as counter:
        fn()
    return counter.flops // 2


def step_macs_per_example(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Multiply-adds per image of one ``method=map`` training step (Adam, lr 0.001) on the minibatch ``x``, ``y``,
    on a copy of ``model``: the MAP epoch's cost in the benchmarks' ``flop_ratio``."""
    step_method = build_method({"name": "map", "lr": LR})
    step_method.setup(problem(copy.deepcopy(model), x.device, 0))
    return multiply_adds(lambda: step_method.train_step(x, y)) / x.shape[0]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-data", type=int, default=FULL_N, help=f"training images (default {FULL_N})")
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--structures", default="kfac,def", help="comma-separated: kfac, def")
    parser.add_argument("--rank", type=int, default=200, help="DEF's K (variant=def_table1/def: 200)")
    parser.add_argument(
        "--curvature-batch-size",
        type=int,
        default=None,
        help="curvature chunk (default: the variant's, kfac 256, def 64)",
    )
    parser.add_argument("--channels", default="32,64", help="LeNet's two conv widths (default DEF's 32,64)")
    parser.add_argument("--hidden", type=int, default=1024, help="LeNet's FC width (default DEF's 1024)")
    parser.add_argument("--image-size", type=int, default=28)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument(
        "--curvature-dtype", default="model", help="method.curvature_dtype: model (float32 here), float32 or float64"
    )
    parser.add_argument(
        "--curvature-cache-mib",
        type=int,
        default=None,
        help="method.curvature_cache_mib: MiB of pass-1 tensors EFB/DEF keep for their second pass (default: the method's)",
    )
    parser.add_argument(
        "--curvature-subset",
        type=int,
        default=None,
        help="also time method.curvature_subset=S (S of the 50,000 images; S·n-data/50,000 of the measured ones)",
    )
    parser.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA when present (default)"
    )
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args(argv)
    if ns.n_data < 2 or ns.batch_size < 1:
        parser.error("--n-data must be >= 2 and --batch-size >= 1")
    if ns.curvature_subset is not None and not 2 <= ns.curvature_subset * ns.n_data // FULL_N:
        parser.error("--curvature-subset must leave at least 2 of the measured images (S·n-data/50,000 >= 2)")
    unknown = set(ns.structures.split(",")) - set(STRUCTURE_OPTIONS)
    if unknown:
        parser.error(f"unknown structure(s) {sorted(unknown)}; choose from {', '.join(STRUCTURE_OPTIONS)}")
    return ns


def problem(model: torch.nn.Module, device: torch.device, seed: int) -> Problem:
    return Problem(
        model=model,
        likelihood=Categorical(),
        n_data=FULL_N,  # only scales the prior term and the posterior precision, not the work
        prior_precision=prior_precision_vector(model, PRIOR_PRECISION, None),
        generator=torch.Generator(device=device).manual_seed(seed),
    )


def _time_fit(
    laplace: Laplace, x: torch.Tensor, y: torch.Tensor, device: torch.device
) -> tuple[float, float, float | None]:
    """Wall-clock and CPU seconds (and the CUDA peak MiB) of one ``fit_posterior``."""
    return timed(lambda: laplace.fit_posterior(x, y), device)


def _extrapolate(full: float, half: float, n_curv: int, half_curv: int, target: int) -> tuple[float, float, float]:
    """``(fit_s, fixed, per_example)``: ``fixed + per_example * target`` from fits on ``n_curv`` and ``half_curv``
    curvature examples taking ``full`` and ``half`` seconds (module docstring)."""
    per_example = max(full - half, 0.0) / max(n_curv - half_curv, 1)
    fixed = full - per_example * n_curv
    if fixed < 0:  # the half fit took more than half the time (noise): scale the fit linearly
        fixed, per_example = 0.0, full / n_curv
    return fixed + per_example * target, fixed, per_example


def _laplace(ns: argparse.Namespace, structure: str, subset: int | None) -> Laplace:
    laplace = build_method(
        {
            "name": "laplace",
            **STRUCTURE_OPTIONS[structure],
            "n_curvature_samples": 1,
            "prior_precision": None,
            "dataset_scale": None,
            "rank": ns.rank,
            "predictive": "sample",
            "lr": LR,
            "map_dir": None,
            **({} if ns.curvature_batch_size is None else {"curvature_batch_size": ns.curvature_batch_size}),
            "curvature_dtype": ns.curvature_dtype,
            "curvature_subset": subset,
            **({} if ns.curvature_cache_mib is None else {"curvature_cache_mib": ns.curvature_cache_mib}),
        }
    )
    assert isinstance(laplace, Laplace)
    return laplace


def _time_structure(
    ns: argparse.Namespace,
    model: torch.nn.Module,
    theta: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    device: torch.device,
    structure: str,
    subset: int | None,
    epoch_times: tuple[float, float, float | None],
    epoch_macs_per_example: float,
) -> dict[str, Any]:
    """Time one structure's fit on all n images and on the first n/2 and scale it to 50,000 (module docstring).

    With ``subset`` S (of 50,000) the fits use S·n/50,000 and S·n/100,000 curvature examples and the
    per-example time is scaled to S curvature examples.
    """
    half = ns.n_data // 2
    n_curv = ns.n_data if subset is None else subset * ns.n_data // FULL_N
    half_curv = half if subset is None else subset * half // FULL_N
    target = FULL_N if subset is None else subset

    def fit(n_rows: int, n_curvature: int) -> tuple[tuple[float, float, float | None], dict[str, float]]:
        laplace = _laplace(ns, structure, None if subset is None else n_curvature)
        laplace.setup(problem(model, device, ns.seed + 3))
        with torch.no_grad():
            laplace.theta.copy_(theta)
        seconds = _time_fit(laplace, x[:n_rows], y[:n_rows], device)
        return seconds, dict(laplace.fit_info)

    fit(min(ns.n_data, 2 * WARMUP_ROWS), min(n_curv, 2 * WARMUP_ROWS))  # warm-up: kernels, allocator, caches
    (measured_fit, measured_cpu, fit_peak), info = fit(ns.n_data, n_curv)
    scale = FULL_N / ns.n_data
    measured_epoch, measured_epoch_cpu, epoch_peak = epoch_times
    if ns.n_data >= FULL_N:
        fit_s, epoch_s, fixed, per_example, half_fit = measured_fit, measured_epoch, None, None, None
        cpu_fit_s, half_cpu = measured_cpu, None
        scaling = "none: measured on the full-size data"
    else:
        (half_fit, half_cpu, _), _ = fit(half, half_curv)
        fit_s, fixed, per_example = _extrapolate(measured_fit, half_fit, n_curv, half_curv, target)
        cpu_fit_s = _extrapolate(measured_cpu, half_cpu, n_curv, half_curv, target)[0]
        epoch_s = measured_epoch * scale
        scaling = (
            f"extrapolated from n_data={ns.n_data} to {FULL_N} images: epoch_s = measured_epoch_s x {scale:g} "
            f"(linear); fit_s = fit_fixed_s + {target} x per-example time, from fits on {n_curv} and "
            f"{half_curv} curvature examples"
        )
    cpu_epoch_s = measured_epoch_cpu * scale
    cache_mib = info.get("curvature_cache_mib")
    # the data-proportional multiply-adds of the fit (two counted fits), per example, against the epoch's
    counted = min(ns.n_data, FLOP_COUNT_ROWS)
    macs = []
    for rows in (counted, counted // 2):
        laplace = _laplace(ns, structure, None)
        laplace.setup(problem(model, device, ns.seed + 3))
        with torch.no_grad():
            laplace.theta.copy_(theta)
        macs.append(multiply_adds(lambda laplace=laplace, rows=rows: laplace.fit_posterior(x[:rows], y[:rows])))
    fit_macs_per_example = (macs[0] - macs[1]) / (counted - counted // 2)
    flop_ratio = fit_macs_per_example * target / (epoch_macs_per_example * FULL_N)
    return {
        "structure": structure,
        "curvature_subset": subset,
        "fit_s": round(fit_s, 3),
        "epoch_s": round(epoch_s, 3),
        "ratio_to_epoch": round(fit_s / epoch_s, 3),
        "flop_ratio": round(flop_ratio, 3),
        "fit_macs_per_example": round(fit_macs_per_example),
        "n_data": ns.n_data,
        "threads": ns.threads,
        "scaled_to": FULL_N,
        "scaling": scaling,
        "measured_fit_s": round(measured_fit, 6),
        "measured_epoch_s": round(measured_epoch, 6),
        "ratio_at_n_data": round(measured_fit / measured_epoch, 3),
        "measured_half_fit_s": None if half_fit is None else round(half_fit, 6),
        "fit_fixed_s": None if fixed is None else round(fixed, 6),
        "fit_per_example_ms": None if per_example is None else round(1000 * per_example, 4),
        "fit_info": {k: int(v) for k, v in info.items()} if structure == "def" else {},
        "curvature_dtype": ns.curvature_dtype,
        # the same ratio from this process's CPU time (less sensitive to other processes on a busy machine)
        "cpu_fit_s": round(cpu_fit_s, 3),
        "cpu_epoch_s": round(cpu_epoch_s, 3),
        "cpu_ratio_to_epoch": round(cpu_fit_s / cpu_epoch_s, 3),
        "measured_cpu_fit_s": round(measured_cpu, 6),
        "measured_cpu_half_fit_s": None if half_cpu is None else round(half_cpu, 6),
        "measured_cpu_epoch_s": round(measured_epoch_cpu, 6),
        # MiB of pass-1 tensors kept for the EFB pass (method.curvature_cache_mib), here and scaled to the target
        "curvature_cache_mib": None if cache_mib is None else round(cache_mib, 1),
        "curvature_cache_mib_scaled": None if cache_mib is None else round(cache_mib * target / n_curv, 1),
        # CUDA only: peak memory allocated during the timed fit on n_data images, and during the MAP epoch
        "cuda_peak_mib": None if fit_peak is None else round(fit_peak, 1),
        "epoch_cuda_peak_mib": None if epoch_peak is None else round(epoch_peak, 1),
    }


@dataclass
class LeNetBench:
    """What both Laplace benchmarks start from: the device, the LeNet of the flags (seeded), random images ``x`` and
    labels ``y`` (``n_data``), the generator that drew them, the timed MAP epoch and its parameters."""

    device: torch.device
    model_cfg: dict[str, Any]
    model: torch.nn.Module
    generator: torch.Generator
    x: torch.Tensor
    y: torch.Tensor
    epoch_times: tuple[float, float, float | None]
    theta: torch.Tensor


def lenet_bench(ns: argparse.Namespace, script: str) -> LeNetBench:
    """Set threads and device from the flags (``script`` names the script in an error), build the model and data,
    then time one MAP epoch on them (after two warm-up steps)."""
    set_threads(ns.threads)
    try:
        device = resolve_device(ns.device)
    except ConfigError as error:  # --device cuda without a GPU
        raise SystemExit(f"{script}: --device {ns.device}: {error}") from None
    torch.manual_seed(ns.seed)
    model_cfg = {
        "name": "lenet",
        "image_size": ns.image_size,
        "channels": [int(c) for c in ns.channels.split(",")],
        "hidden": ns.hidden,
        "dropout": 0.0,
    }
    model = build_model(model_cfg, in_features=1, out_features=10).to(device)
    g = torch.Generator().manual_seed(ns.seed + 1)
    x = torch.rand(ns.n_data, 1, ns.image_size, ns.image_size, generator=g).to(device)
    y = torch.randint(0, 10, (ns.n_data,), generator=g).to(device)

    warm = build_method({"name": "map", "lr": LR})
    warm.setup(problem(model, device, ns.seed))
    for _ in range(2):
        warm.train_step(x[: ns.batch_size], y[: ns.batch_size])
    map_method = build_method({"name": "map", "lr": LR})
    map_method.setup(problem(model, device, ns.seed))
    epoch_times = timed(
        lambda: map_method.fit(
            x, y, n_epochs=1, batch_size=ns.batch_size, data_generator=torch.Generator().manual_seed(2)
        ),
        device,
    )
    return LeNetBench(device, model_cfg, model, g, x, y, epoch_times, map_method.point_estimate())


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ns = _parse(argv)
    bench = lenet_bench(ns, "bench_laplace_fit.py")
    device, model_cfg, model, x, y = bench.device, bench.model_cfg, bench.model, bench.x, bench.y
    epoch_times, theta = bench.epoch_times, bench.theta
    epoch_macs = step_macs_per_example(model, x[: ns.batch_size], y[: ns.batch_size])

    records = []
    runs = [(structure, None) for structure in ns.structures.split(",")]
    if ns.curvature_subset is not None and ns.curvature_subset < FULL_N:
        runs += [(structure, ns.curvature_subset) for structure in ns.structures.split(",")]
    for structure, subset in runs:
        record = _time_structure(ns, model, theta, x, y, device, structure, subset, epoch_times, epoch_macs)
        record.update(
            {
                "model": {k: v for k, v in model_cfg.items() if k != "name"},
                "batch_size": ns.batch_size,
                "rank": ns.rank if structure == "def" else None,
                "device": str(device),
                "torch": torch.__version__,
            }
        )
        print(json.dumps(record), flush=True)
        records.append(record)
    return records


if __name__ == "__main__":
    main(sys.argv[1:])
