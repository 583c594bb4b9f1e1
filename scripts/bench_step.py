"""Time one SLANG step against one plain SGD step on the MNIST-sized MLP of SLANG Table 3.

Both run in this one process, on a 784-400-400-10 ReLU MLP with a minibatch of 200 random examples
(cross-entropy), float32. SLANG uses 1 MC sample and the ranks of ``--ranks``. For each rank the
SLANG and SGD steps are timed in alternation (one SLANG step, then ``SGD_PER_ROUND`` SGD steps, for
``--steps`` rounds after a warm-up), so that a change in machine load hits both; each time is the
median. One JSON line per rank:

    {"method": "slang", "rank": 8, "step_ms": ..., "sgd_step_ms": ..., "ratio_to_sgd": ...,
     "peak_mem_mib": ..., "sgd_peak_mem_mib": ..., "flop_ratio": ..., ...}

``flop_ratio`` is the ratio of the two steps' GEMM multiply-adds (:func:`flop_ratio`): what
``ratio_to_sgd`` would be if every GEMM of both steps ran at the same speed.

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` over setup plus two steps. On CPU, the
peak of the bytes held by live tensors, from ``torch.profiler``'s memory timeline over the same
window (every allocation and free of PyTorch's CPU allocator, by time; it counts the model, the
data, the method's state and every temporary, not the interpreter or BLAS workspaces).

    python scripts/bench_step.py                      # CPU, 1 thread, ranks 8 and 32
    python scripts/bench_step.py --device cuda --ranks 1,8,32,64
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bdl_bench.likelihoods import Categorical
from bdl_bench.methods.base import Problem
from bdl_bench.methods.slang import Slang
from bdl_bench.models.mlp import mlp

SGD_PER_ROUND = 3
N_DATA = 50_000  # SLANG's N (Table 3: 50k training images); it only scales the curvature


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build(device: torch.device, batch: int, seed: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = mlp(in_features=784, out_features=10, hidden=[400, 400], activation="relu").to(device)
    x = torch.randn(batch, 784, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    return model, x, y


def _sgd_stepper(device: torch.device, batch: int) -> Callable[[], None]:
    model, x, y = _build(device, batch, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    return step


def _slang_stepper(device: torch.device, batch: int, rank: int, n_samples: int) -> Callable[[], None]:
    model, x, y = _build(device, batch, seed=0)
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
    the input's). SLANG: the same forward/backward without weight gradients, plus per MC sample the
    summed gradient and diag(G Gᵀ) (one P·D GEMM each), U^T G and G W (L of them each), and per step
    the rotation U W_U and U^T D^{-1} U (D·L² each).
    """
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    weights = [m.in_features * m.out_features for m in linears]
    total = sum(weights)
    n_params = sum(p.numel() for p in model.parameters())
    backprop = batch * (2 * total + total - weights[0])
    cols = batch * n_samples
    slang = n_samples * batch * (2 * total - weights[0]) + cols * (2 + 2 * rank) * total + 2 * n_params * rank**2
    return slang / backprop


def _timed(step: Callable[[], None], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    step()
    _sync(device)
    return (time.perf_counter() - start) * 1e3


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--ranks", default="8,32", help="comma-separated SLANG ranks L (default 8,32)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--mc-samples", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20, help="timed rounds (>= 20)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true", help="skip the (slow, profiled) memory measurement")
    args = parser.parse_args()
    if args.steps < 20:
        parser.error("--steps must be >= 20")
    torch.set_num_threads(args.threads)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    ranks = [int(r) for r in args.ranks.split(",") if r.strip()]

    sgd_mem = None if args.no_memory else peak_memory_mib(lambda: _sgd_stepper(device, args.batch), device)
    for rank in ranks:
        sgd = _sgd_stepper(device, args.batch)
        slang = _slang_stepper(device, args.batch, rank, args.mc_samples)
        for _ in range(args.warmup):
            slang()
            sgd()
        slang_ms, sgd_ms = [], []
        for _ in range(args.steps):
            slang_ms.append(_timed(slang, device))
            sgd_ms.extend(_timed(sgd, device) for _ in range(SGD_PER_ROUND))
        del slang, sgd
        slang_mem = (
            None
            if args.no_memory
            else peak_memory_mib(lambda rank=rank: _slang_stepper(device, args.batch, rank, args.mc_samples), device)
        )
        step_ms, sgd_step_ms = statistics.median(slang_ms), statistics.median(sgd_ms)
        model, _, _ = _build(torch.device("cpu"), args.batch, seed=0)
        record = {
            "method": "slang",
            "rank": rank,
            "step_ms": round(step_ms, 2),
            "sgd_step_ms": round(sgd_step_ms, 3),
            "ratio_to_sgd": round(step_ms / sgd_step_ms, 2),
            "flop_ratio": round(flop_ratio(model, args.batch, rank, args.mc_samples), 2),
            "peak_mem_mib": None if slang_mem is None else round(slang_mem, 1),
            "sgd_peak_mem_mib": None if sgd_mem is None else round(sgd_mem, 1),
            "device": device.type,
            "threads": args.threads,
            "batch": args.batch,
            "mc_samples": args.mc_samples,
            "n_rounds": args.steps,
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
