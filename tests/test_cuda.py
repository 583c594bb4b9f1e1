"""On a GPU: the device paths against the host paths, and every method, stacked job and search end to end.

Skipped on a machine without CUDA (CI's). The kernels that take another path on a device (the GMFVI mean-field
terms read no bounds there, ``weighted_gram`` takes U whole, the stacked Gram update, the fused Adam) must give the
host's values in float64; the CLI runs every method and a stacked search with ``trainer.device=cuda`` and must
record ``cuda`` with finite metrics (``auto`` picks it, but the UCI sets' protocol keeps the CPU);
``scripts/bench_step.py --device cuda`` prints its JSON. Stacked fits against single fits on the GPU: test_stacked.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

REPO = Path(__file__).resolve().parents[1]
F64 = torch.float64


def _both(*tensors: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    return tensors, tuple(t.cuda() for t in tensors)


def test_mean_field_terms_on_the_device_equal_the_host_path() -> None:
    """The device path (no bounds read) against the host's bounded one."""
    from bdl_bench.kernels.mean_field import MeanFieldScratch, mean_field_terms

    g = torch.Generator().manual_seed(0)
    mean, rho = torch.randn(10, generator=g, dtype=F64), torch.randn(10, generator=g, dtype=F64) - 3.0
    weights = torch.randn(10, generator=g, dtype=F64)
    shapes = [torch.Size([2, 3]), torch.Size([4])]
    results = []
    for m0, r0, w in _both(mean, rho, weights):
        m, r = m0.clone().requires_grad_(True), r0.clone().requires_grad_(True)
        terms = mean_field_terms(m, r, 2.5, 10 * math.log(2.5), shapes, MeanFieldScratch.like(m))
        var = torch.cat([p.flatten() for p in terms.var_parts])
        mu = torch.cat([p.flatten() for p in terms.mean_parts])
        (0.3 * terms.kl + (w * var).sum() + (w.flip(0) * mu**2).sum()).backward()
        results.append([terms.kl.detach(), var.detach(), m.grad, r.grad])
    for host, device in zip(*results):
        assert device.is_cuda
        assert_close(device.cpu(), host, rtol=1e-10, atol=1e-12)


def test_weighted_gram_takes_u_whole_on_the_device_and_agrees_with_the_blocked_host_pass() -> None:
    import bdl_bench.curvature.low_rank as low_rank

    g = torch.Generator().manual_seed(1)
    u = torch.randn(4, 5000, generator=g, dtype=F64).mT  # column-major, as SLANG stores it
    w, v = torch.rand(5000, generator=g, dtype=F64) + 0.5, torch.randn(5000, generator=g, dtype=F64)
    saved, low_rank._GRAM_BLOCK_WORK = low_rank._GRAM_BLOCK_WORK, 16 * 64  # several blocks on the host
    try:
        host = low_rank.weighted_gram(u, w, v)
    finally:
        low_rank._GRAM_BLOCK_WORK = saved
    device = low_rank.weighted_gram(u.cuda(), w.cuda(), v.cuda())
    for a, b in zip(host, device):
        assert_close(b.cpu(), a, rtol=1e-10, atol=1e-10)


def test_stacked_gram_update_on_the_device_equals_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stacked SLANG update's Gram path (lower blocks, shared first input, subspace iteration) on both."""
    from bdl_bench.curvature import gram
    from bdl_bench.curvature.per_example import linear_layout
    from bdl_bench.curvature.stacked import StackedFactors
    from bdl_bench.models import build_model

    monkeypatch.setattr(gram, "_HALF_GRAM_COLUMNS", 4)
    g = torch.Generator().manual_seed(5)
    model = build_model({"name": "mlp", "hidden": [4], "activation": "relu"}, in_features=3, out_features=1)
    layout = linear_layout(model)
    n_copies, rank, n_samples, n_examples = 3, 2, 2, 9
    u = torch.randn(n_copies, layout.n_params, rank, generator=g, dtype=F64)
    x = torch.randn(n_copies, n_examples, 3, generator=g, dtype=F64)
    hidden = torch.randn(n_copies, n_samples * n_examples, 4, generator=g, dtype=F64)
    deltas = [
        torch.randn(n_copies, n_samples * n_examples, s.out_features, generator=g, dtype=F64) for s in layout.slots
    ]
    outputs = []
    for u_, x_, h_, *d_ in _both(u, x, hidden, *deltas):
        losses = x_.new_zeros(n_copies, n_samples, n_examples)
        factors = StackedFactors([x_, h_], list(d_), losses, losses[..., None], first_input_shared=True)
        kwargs = dict(factor_gram=u_.mT @ u_, factor_sqnorms=u_.square().sum(-1), path="gram", workspace={})
        update = gram.low_rank_update(factors, layout, u_, old_weight=0.9, new_weight=2.5, **kwargs)
        outputs.append((update.prec_factor, update.eigenvalues, update.diag_residual))
    for host, device in zip(*outputs):
        assert device.is_cuda
        assert_close(device.cpu(), host, rtol=1e-9, atol=1e-9)


def test_fused_adam_on_the_device_follows_the_host() -> None:
    from bdl_bench.optim import adam

    start = torch.randn(4, 6, generator=torch.Generator().manual_seed(9), dtype=F64)
    params = [start.clone().requires_grad_(True), start.cuda().requires_grad_(True)]
    optimizers = [adam([p], 0.01) for p in params]
    assert all(o.param_groups[0]["fused"] for o in optimizers)
    for step in range(6):
        grad = torch.randn(4, 6, generator=torch.Generator().manual_seed(step), dtype=F64)
        for p, opt in zip(params, optimizers):
            p.grad = grad.to(p.device)
            opt.step()
    assert_close(params[1].detach().cpu(), params[0].detach(), rtol=1e-12, atol=1e-14)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "BDL_BENCH_OFFLINE": "1"}
    command = [sys.executable, "-m", "bdl_bench.orchestration.cli", *args]
    out = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _finished_on_cuda(folder: Path) -> None:
    record = json.loads((folder / "run.json").read_text())
    assert record["status"] == "finished" and record["device"] == "cuda", (folder, record)
    metrics = json.loads((folder / "metrics.json").read_text())
    assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)), (folder, metrics)


def _registered_methods() -> list[str]:
    from bdl_bench.methods import METHODS, import_all

    import_all()
    return sorted(METHODS)


# every registered method on boston (the registry, not a hand list: a new method is run here too), but exact_vi,
# which fits logistic regression only and runs on australian below
SINGLE = [name for name in _registered_methods() if name != "exact_vi"]


def test_device_auto_picks_the_gpu_and_small_sets_keep_the_cpu(tmp_path: Path) -> None:
    """``trainer.device=auto`` is CUDA here; the UCI sets' protocol asks for the CPU (their 1x50 networks run
    faster there), so a plain run on boston stays on the CPU."""
    from bdl_bench.orchestration.devices import resolve_device

    assert resolve_device("auto").type == "cuda"
    _cli("run", "method=map", "data=uci/boston", "trainer.n_epochs=1", f"results_root={tmp_path}", cwd=tmp_path)
    (record,) = [json.loads(p.read_text()) for p in tmp_path.rglob("run.json")]
    assert record["status"] == "finished" and record["device"] == "cpu"


def test_every_method_runs_on_the_gpu(tmp_path: Path) -> None:
    on_gpu = ["trainer.device=cuda", f"results_root={tmp_path}"]
    _cli("run", "-m", f"method={','.join(SINGLE)}", "data=uci/boston", "trainer.n_epochs=2", *on_gpu, cwd=tmp_path)
    _cli("run", "method=exact_vi", "model=logreg", "data=libsvm/australian", *on_gpu, cwd=tmp_path)
    folders = {p.parent for p in tmp_path.rglob("run.json")}
    for method in [*SINGLE, "exact_vi"]:
        matches = [f for f in folders if f"method={method}," in f.name + ","]
        assert len(matches) == 1, (method, sorted(f.name for f in folders))
        _finished_on_cuda(matches[0])


def test_a_stacked_search_runs_on_the_gpu(tmp_path: Path) -> None:
    """Trials as stacked copies, two splits, four methods: every split's test run and its trials on the GPU."""
    search = ["search.n_random=2", "search.n_guided=2", "search.round_size=2"]
    _cli(
        "run",
        "-m",
        "method=slang,bbb,dropout,ivon",
        "data=uci/yacht",
        "data.split=[0,1]",
        "tune=slang_table2",
        "trainer.n_epochs=2",
        "trainer.device=cuda",
        *search,
        f"results_root={tmp_path}",
        cwd=tmp_path,
    )
    for method in ("slang", "bbb", "dropout", "ivon"):
        for split in (0, 1):
            prefix = f"data.split={split},data=uci/yacht,method={method},"
            (folder,) = [p.parent for p in tmp_path.glob("runs/*/*/run.json") if prefix in p.parent.as_posix()]
            _finished_on_cuda(folder)
            trials = (folder / "search.csv").read_text().strip().splitlines()
            assert len(trials) == 1 + 4 and all(",COMPLETE," in row for row in trials[1:]), trials


def test_bench_step_reports_the_gpu() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "bench_step.py"),
            "--device",
            "cuda",
            "--ranks",
            "4",
            "--steps",
            "20",
            "--methods",
            "slang,gmfvi,ktied:2,elrg:1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["method"] for r in records] == ["slang", "gmfvi", "ktied", "elrg"]
    for r in records:
        assert r["device"] == "cuda" and r["step_ms"] > 0 and r["ratio_to_sgd"] > 0 and r["peak_mem_mib"] > 0, r


def test_the_low_rank_std_study_samples_on_the_device_as_on_the_host(tmp_path: Path, compose_cfg) -> None:
    """A k-tied study of a GMFVI run computed on the GPU (``device=auto`` there) against the host's, in float64:
    the same noise (drawn by the CPU generator), the same networks, the same metrics; the data stay on the host."""
    from bdl_bench.orchestration.runner import run
    from bdl_bench.studies.low_rank_std import MeanFieldNetwork, low_rank_study

    cfg = compose_cfg(
        ["method=gmfvi", "data=uci/boston", "model.hidden=[8]", "trainer.n_epochs=1", "trainer.dtype=float64"]
    )
    run(cfg, tmp_path)
    tables = []
    for device in ("cpu", "cuda"):
        net, dataset, likelihood = MeanFieldNetwork.from_run(tmp_path, device=device)
        assert net.mean.device.type == device and dataset.x_train.device.type == "cpu"
        generator = torch.Generator().manual_seed(0)
        tables.append(low_rank_study(net, dataset, likelihood, ranks=(1,), n_samples=4, generator=generator))
    host, gpu = (t.drop(columns=["approximation"]).to_numpy(dtype=float) for t in tables)
    assert_close(torch.from_numpy(gpu), torch.from_numpy(host), rtol=1e-9, atol=1e-10)
