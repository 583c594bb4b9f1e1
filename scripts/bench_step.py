"""Time one SLANG step against one plain SGD step on the MNIST-sized MLP of SLANG Table 3.

Both run in this one process, on a 784-400-400-10 ReLU MLP with a minibatch of 200 random examples
(cross-entropy), float32. SLANG uses 1 MC sample and the ranks of ``--ranks``. For each rank the
SLANG and SGD steps are timed in alternation (one SLANG step, then ``SGD_PER_ROUND`` SGD steps, for
``--steps`` rounds after a warm-up), so that a change in machine load hits both; each time is the
median. One JSON line per rank:

    {"method": "slang", "rank": 8, "step_ms": ..., "sgd_step_ms": ..., "ratio_to_sgd": ...,
     "peak_mem_mib": ..., "sgd_peak_mem_mib": ..., "flop_ratio": ..., ...}

The process's ``malloc`` keeps freed memory as in every run (:mod:`bdl_bench.orchestration.allocator`;
``BDL_BENCH_MALLOC=system`` times glibc's defaults instead, recorded as ``"malloc"``).

``flop_ratio`` is the ratio of the two steps' GEMM multiply-adds (:func:`flop_ratio`): what
``ratio_to_sgd`` would be if every GEMM of both steps ran at the same speed.

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` over setup plus two steps. On CPU, the
peak of the bytes held by live tensors, from ``torch.profiler``'s memory timeline over the same
window (every allocation and free of PyTorch's CPU allocator, by time; it counts the model, the
data, the method's state and every temporary, not the interpreter or BLAS workspaces).

    python scripts/bench_step.py                      # CPU, 1 thread, ranks 8 and 32
    python scripts/bench_step.py --device cuda --ranks 1,8,32,64

The layer-wise VI methods of the k-tied and ELRG papers are timed the same way with ``--methods``
(comma-separated; ``slang`` stands for SLANG at every rank of ``--ranks``): ``gmfvi``, ``ktied:<k>``,
``elrg:<K>`` (constant diagonal, ELRG-VI) and ``elrg_d:<K>`` (learned diagonal, ELRG-D-VI), built from
their ``conf/method`` defaults with one MC sample (``--mc-samples``), no KL annealing and no SNR
tracking; ``rank`` in the record is k or K (``null`` for gmfvi). Their ``flop_ratio``
(:func:`vi_flop_ratio`) is 2 for GMFVI (mean and variance paths), about 1 for k-tied (its variance path
is a rank-k² product) and 1 + K for ELRG (K + 2 with the learned diagonal). ``ivon`` is IVON (Shen et al. 2024)
with beta2 = 0.99999, h_0 = 1 and lr 1e-3; its ``flop_ratio`` is 1 per MC sample (one forward and backward at
a sampled weight vector), the rest of its step being passes over the ``(D,)`` state and the weight noise.

    python scripts/bench_step.py --methods gmfvi,ktied:2,elrg:1,elrg:5 --no-memory
    python scripts/bench_step.py --methods ivon --no-memory --clock thread
    python scripts/bench_step.py --methods gmfvi,elrg:5 --hidden 800,800   # a 784-800-800-10 MLP

``--hidden`` sets the MLP's hidden widths (default 400,400). :func:`entries` and :func:`bench` are the
measurement without the command line; ``bdl-bench reproduce ktied_table4`` / ``elrg_table1``
(:mod:`bdl_bench.orchestration.benchmark`) call them in-process.

``--clock thread`` times with ``time.thread_time`` (this thread's CPU time) instead of the wall clock,
for machines shared with other jobs, where a long step is preempted more often than a short one; the
record then carries ``"clock": "thread"``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from bdl_bench.errors import ConfigError
from bdl_bench.likelihoods import Categorical
from bdl_bench.methods import build_method
from bdl_bench.methods.base import Problem
from bdl_bench.methods.slang import Slang
from bdl_bench.models.mlp import mlp
from bdl_bench.orchestration.allocator import keep_freed_memory, malloc_setting
from bdl_bench.orchestration.devices import resolve_device
from bdl_bench.orchestration.threads import set_threads

SGD_PER_ROUND = 3
N_DATA = 50_000  # SLANG's N (Table 3: 50k training images); it only scales the curvature
HIDDEN = (400, 400)  # SLANG Table 3's hidden layers (--hidden)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build(
    device: torch.device, batch: int, seed: int, hidden: Sequence[int] = HIDDEN
) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = mlp(in_features=784, out_features=10, hidden=list(hidden), activation="relu").to(device)
    x = torch.randn(batch, 784, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    return model, x, y


def _sgd_stepper(device: torch.device, batch: int, hidden: Sequence[int] = HIDDEN) -> Callable[[], None]:
    model, x, y = _build(device, batch, seed=0, hidden=hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    return step


def _slang_stepper(
    device: torch.device, batch: int, rank: int, n_samples: int, hidden: Sequence[int] = HIDDEN
) -> Callable[[], None]:
    model, x, y = _build(device, batch, seed=0, hidden=hidden)
    n_params = sum(p.numel() for p in model.parameters())
    method = Slang(
        rank=rank, lr=0.01, beta=0.01, decay=0.0, momentum=0.9, n_train_mc_samples=n_samples, init_prec_diag=1.0
    )
    generator = torch.Generator(device=device).manual_seed(1)
    method.setup(
        Problem(
            model=model,
            likelihood=Categorical(),
            n_data=N_DATA,
            prior_precision=torch.ones(n_params, device=device),
            generator=generator,
        )
    )

    def step() -> None:
        method.train_step(x, y)

    return step


def flop_ratio(model: torch.nn.Module, batch: int, rank: int, n_samples: int) -> float:
    """Multiply-add count of a SLANG step over that of an SGD step (GEMMs only; the floor of the ratio).

    SGD: forward, weight gradients, and input gradients of every layer but the first (autograd skips
    the input's). SLANG, with P = batch · n_samples gradient columns: the same forward/backward without
    weight gradients; the summed gradient and diag(G Gᵀ) (one P·D GEMM each, biases by column sums);
    U^T G and G W (L of them each, biases included); the Gram matrix GᵀG = Σ_l (A Aᵀ)∘(ΔΔᵀ) (P² (in +
    out) per layer); the rotation U W_U and U^T D^{-1} U (D·L² each); and the products of U with
    vectors (D·L each): two per sample drawn (Uᵀ D⁻¹ z and U c, with an L x L product), U^T D^{-1} v and
    U c in the Woodbury solve of the mean step. The first layer's input is the same for the S samples: its
    terms of the four P·D products are taken once per example (batch instead of P rows), and its A Aᵀ once
    (batch² in). ``tests/test_bench_step.py`` checks the count against the matrix products of a real step.
    """
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    weights = [m.in_features * m.out_features for m in linears]
    total = sum(weights)
    n_params = sum(p.numel() for p in model.parameters())
    backprop = batch * (2 * total + total - weights[0])
    cols = batch * n_samples
    biases = sum(m.out_features for m in linears if m.bias is not None)
    gram = (
        cols**2 * sum(m.in_features + m.out_features for m in linears) - (cols**2 - batch**2) * linears[0].in_features
    )
    slang = (
        n_samples * batch * (2 * total - weights[0])
        + (2 + 2 * rank) * (cols * total - (cols - batch) * weights[0])
        + 2 * cols * rank * biases
        + gram
        + 2 * n_params * rank**2
        + (2 * n_samples + 2) * n_params * rank
        + n_samples * rank**2
    )
    return slang / backprop


def vi_config(spec: str, n_samples: int) -> dict:
    """``gmfvi`` | ``ktied:<k>`` | ``elrg:<K>`` | ``elrg_d:<K>`` → a ``build_method`` config.

    Raises:
        ValueError: on another spec.
    """
    name, _, rank = spec.partition(":")
    if name == "ivon":
        ivon = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.99999, "hess_init": 1.0, "clip_radius": None, "decay": 0.0}
        return {"name": "ivon", "n_train_mc_samples": n_samples, **ivon}
    common = {"lr": 1e-3, "n_train_mc_samples": n_samples, "init_std": 0.01, "kl_annealing_steps": 0, "snr_window": 0}
    if name == "gmfvi":
        return {"name": "gmfvi", "conv_estimator": "local", **common}
    if name == "ktied":
        return {"name": "ktied", "k": int(rank or 2), "tie_conv": False, "conv_estimator": "local", **common}
    if name in ("elrg", "elrg_d"):
        return {"name": "elrg", "rank": int(rank or 1), "learn_diag": name == "elrg_d", **common}
    raise ValueError(f"unknown method {spec!r}; use slang, gmfvi, ktied:<k>, elrg:<K>, elrg_d:<K> or ivon")


def _vi_stepper(device: torch.device, batch: int, cfg: dict, hidden: Sequence[int] = HIDDEN) -> Callable[[], None]:
    model, x, y = _build(device, batch, seed=0, hidden=hidden)
    n_params = sum(p.numel() for p in model.parameters())
    method = build_method(cfg)
    method.setup(
        Problem(
            model=model,
            likelihood=Categorical(),
            n_data=N_DATA,
            prior_precision=torch.ones(n_params, device=device),
            generator=torch.Generator(device=device).manual_seed(1),
        )
    )

    def step() -> None:
        method.train_step(x, y)

    return step


def vi_flop_ratio(model: torch.nn.Module, batch: int, cfg: dict, n_samples: int) -> float:
    """GEMM multiply-adds of a GMFVI / k-tied / ELRG step over those of an SGD step (as :func:`flop_ratio`).

    A layer-sized path costs what SGD's forward and backward cost. GMFVI runs two (mean and variance).
    k-tied runs one plus its Khatri–Rao variance path (``k_l² (in + out)`` per example and product) and
    forms ``U Vᵀ`` with its two gradients (``3 k_l · in · out``). ELRG runs 1 + K paths (+1 for the
    learned diagonal) plus the K×K Gram matrix of Lemma 2 and its gradient (``2 K² D``).
    """
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    weights = [m.in_features * m.out_features for m in linears]
    one_path = batch * (3 * sum(weights) - weights[0])  # forward, weight grads, input grads but the first
    paths = n_samples * one_path
    if cfg["name"] == "ivon":  # one path per sample: the gradient at the sample is all it needs
        step = paths
    elif cfg["name"] == "gmfvi":
        step = 2 * paths
    elif cfg["name"] == "ktied":
        ranks = [min(cfg["k"], m.in_features, m.out_features) for m in linears]
        side = sum(k**2 * (m.in_features + m.out_features) for k, m in zip(ranks, linears))
        step = paths + 3 * n_samples * batch * side + 3 * sum(k * w for k, w in zip(ranks, weights))
    else:
        n_params = sum(p.numel() for p in model.parameters())
        step = (1 + cfg["rank"] + int(cfg["learn_diag"])) * paths + 2 * cfg["rank"] ** 2 * n_params
    return step / one_path


def _timed(step: Callable[[], None], device: torch.device, clock: Callable[[], float] = time.perf_counter) -> float:
    _sync(device)
    start = clock()
    step()
    _sync(device)
    return (clock() - start) * 1e3


def peak_memory_mib(make: Callable[[], Callable[[], None]], device: torch.device) -> float:
    """Peak bytes of live tensors while building the stepper and taking two steps, in MiB."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step = make()
        step()
        step()
        _sync(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step = make()
        step()
        step()
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated in favour of a CUDA-only API
        path = Path(folder) / "memory.json"
        prof.export_memory_timeline(str(path), device="cpu")
        _, sizes = json.loads(path.read_text())
    return max((sum(categories) for categories in sizes), default=0) / 2**20


Entry = tuple[str, int | None, Callable[[], Callable[[], None]], float]
"""(method, rank, stepper factory, flop ratio) of one JSON line."""


def entries(
    methods: Sequence[str],
    ranks: Sequence[int],
    device: torch.device,
    batch: int,
    n_samples: int,
    hidden: Sequence[int] = HIDDEN,
) -> list[Entry]:
    """The steps to time: ``slang`` at every rank of ``ranks``, the others as :func:`vi_config` reads them.

    Raises:
        ValueError: on an unknown method.
    """
    model, _, _ = _build(torch.device("cpu"), batch, seed=0, hidden=hidden)
    found: list[Entry] = []
    for spec in methods:
        if spec == "slang":
            for rank in ranks:
                found.append(
                    (
                        "slang",
                        rank,
                        lambda rank=rank: _slang_stepper(device, batch, rank, n_samples, hidden),
                        flop_ratio(model, batch, rank, n_samples),
                    )
                )
        else:
            cfg = vi_config(spec, n_samples)
            found.append(
                (
                    spec.partition(":")[0],
                    cfg.get("k", cfg.get("rank")),
                    lambda cfg=cfg: _vi_stepper(device, batch, cfg, hidden),
                    vi_flop_ratio(model, batch, cfg, n_samples),
                )
            )
    return found


def bench(
    found: Sequence[Entry],
    device: torch.device,
    *,
    batch: int,
    steps: int,
    warmup: int,
    memory: bool = True,
    clock: Callable[[], float] = time.perf_counter,
    hidden: Sequence[int] = HIDDEN,
) -> Iterator[dict]:
    """Time each entry against SGD on the same model (alternating, medians) and measure peak memory; one record
    each, as the module's docstring shows, unrounded (``threads``, ``mc_samples`` and ``clock`` are the caller's
    to add; :data:`ROUNDING` is what the command line prints)."""
    sgd_mem = peak_memory_mib(lambda: _sgd_stepper(device, batch, hidden), device) if memory else None
    for name, rank, make, flops in found:
        sgd = _sgd_stepper(device, batch, hidden)
        method = make()
        for _ in range(warmup):
            method()
            sgd()
        method_ms, sgd_ms = [], []
        for _ in range(steps):
            method_ms.append(_timed(method, device, clock))
            sgd_ms.extend(_timed(sgd, device, clock) for _ in range(SGD_PER_ROUND))
        del method, sgd
        method_mem = peak_memory_mib(make, device) if memory else None
        step_ms, sgd_step_ms = statistics.median(method_ms), statistics.median(sgd_ms)
        yield {
            "method": name,
            "rank": rank,
            "hidden": list(hidden),
            "step_ms": step_ms,
            "sgd_step_ms": sgd_step_ms,
            "ratio_to_sgd": step_ms / sgd_step_ms,
            "flop_ratio": flops,
            "peak_mem_mib": method_mem,
            "sgd_peak_mem_mib": sgd_mem,
            "device": device.type,
            "batch": batch,
            "n_rounds": steps,
        }


ROUNDING = {
    "step_ms": 2,
    "sgd_step_ms": 3,
    "ratio_to_sgd": 2,
    "flop_ratio": 2,
    "peak_mem_mib": 1,
    "sgd_peak_mem_mib": 1,
}
"""Decimals of the printed record's numbers."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch and BLAS threads (bdl_bench.orchestration.threads.set_threads; default 1)",
    )
    parser.add_argument("--ranks", default="8,32", help="comma-separated SLANG ranks L (default 8,32)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument(
        "--hidden", default="400,400", help="comma-separated hidden widths of the 784-...-10 MLP (default 400,400)"
    )
    parser.add_argument("--mc-samples", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20, help="timed rounds (>= 20)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true", help="skip the (slow, profiled) memory measurement")
    parser.add_argument(
        "--methods", default="slang", help="comma-separated: slang, gmfvi, ktied:<k>, elrg:<K>, elrg_d:<K>, ivon"
    )
    parser.add_argument("--clock", default="wall", choices=["wall", "thread"], help="wall clock or thread CPU time")
    args = parser.parse_args()
    if args.steps < 20:
        parser.error("--steps must be >= 20")
    set_threads(args.threads)
    keep_freed_memory()  # as in every process that runs jobs (hydra_app): time the steps a run takes
    try:
        device = resolve_device(args.device)
    except ConfigError as error:  # --device cuda without a GPU
        parser.error(f"--device {args.device}: {error}")
    if args.clock == "thread" and device.type == "cuda":
        parser.error("--clock thread measures CPU time; use the wall clock on CUDA")
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    hidden = [int(h) for h in args.hidden.split(",") if h.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    found = entries(methods, ranks, device, args.batch, args.mc_samples, hidden)
    for record in bench(
        found,
        device,
        batch=args.batch,
        steps=args.steps,
        warmup=args.warmup,
        memory=not args.no_memory,
        clock=clock,
        hidden=hidden,
    ):
        record.update({k: round(v, ROUNDING[k]) for k, v in record.items() if k in ROUNDING and v is not None})
        record.update(threads=args.threads, mc_samples=args.mc_samples, malloc=malloc_setting())
        if args.clock != "wall":
            record["clock"] = args.clock
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
