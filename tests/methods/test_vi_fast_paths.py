"""The layer-wise VI steps' fast paths against slow twins over several steps (float64): GMFVI's fused step
against plain autograd and a plain Adam, and the device paths (no host reads) against the host paths,
checked on the CPU by patching ``on_host``."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from _device_check import DEVICE, fake_device
from _vi_helpers import make_method, make_problem, plain_local_outputs
from torch.testing import assert_close

from bdl_bench.likelihoods import Gaussian
from bdl_bench.methods import _diag_vi, gmfvi, import_all, ktied
from bdl_bench.methods._diag_vi import kl_diag_to_prior
from bdl_bench.methods.base import Problem

F64 = torch.float64
N_STEPS = 5


def _off_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """``on_host`` answers False wherever the steps read it: ``_diag_vi``'s and every module's imported name."""
    import_all()  # every method module loaded, so that none binds the original later
    original = _diag_vi.on_host
    for module in [m for name, m in sys.modules.items() if name.startswith("bdl_bench.")]:
        if getattr(module, "on_host", None) is original:
            monkeypatch.setattr(module, "on_host", lambda t: False)


def _data(dtype: torch.dtype = F64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return torch.randn(7, 3, generator=g, dtype=dtype), torch.randn(7, generator=g, dtype=dtype)


def _reference_gmfvi_run(method: gmfvi.GaussianMeanFieldVI, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """The slow twin of ``N_STEPS`` GMFVI steps from the method's initial state: ``F.softplus``, the
    closed-form KL with ``log sigma``, ``_diag_vi.local_reparam_linear`` (the same noise, in the same order)
    and a plain (unfused, per-tensor) ``torch.optim.Adam``. Returns mean and rho after each step."""
    problem = method.problem
    mean = method.mean.detach().clone().requires_grad_(True)
    rho = method.rho.detach().clone().requires_grad_(True)
    adam = torch.optim.Adam([mean, rho], lr=method.lr, foreach=False, fused=False)
    lam = problem.prior_precision
    states = []
    for step in range(1, N_STEPS + 1):
        adam.zero_grad()
        std = F.softplus(rho)
        h = plain_local_outputs(method, mean, std**2, x, method.n_train_mc_samples)
        nll = torch.stack([problem.likelihood.nll(f, y) for f in h]).mean()
        kl = 0.5 * (lam * (std**2 + mean**2) - 1 - torch.log(lam)).sum() - torch.log(std).sum()
        (nll + method.kl_weight(step) * kl / problem.n_data).backward()
        adam.step()
        states.append(torch.cat([mean.detach(), rho.detach()]))
    return states


def _run(method: object, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    states = []
    for _ in range(N_STEPS):
        method.train_step(x, y)
        states.append(torch.cat([method.mean.detach(), *(v.detach().flatten() for v in method.variational.values())]))
    return states


def _assert_follows_the_twin(method: object, reference_run: object) -> None:
    """``N_STEPS`` of ``method`` and of its slow twin ``reference_run`` from the same state and noise agree."""
    x, y = _data()
    method.problem.generator.manual_seed(11)
    reference = reference_run(method, x, y)
    method.problem.generator.manual_seed(11)
    for got, expected in zip(_run(method, x, y), reference, strict=True):
        assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert not torch.equal(reference[0], reference[-1])  # the steps moved


@pytest.mark.parametrize("n_samples", [1, 2])
@pytest.mark.parametrize("device_path", [False, True])
def test_gmfvi_steps_match_the_plain_autograd_twin(
    monkeypatch: pytest.MonkeyPatch, n_samples: int, device_path: bool
) -> None:
    """Five fused GMFVI steps (sigmoid-based softplus, hand-written backwards, fused Adam) follow the plain
    twin in float64; so does the device path (no bounds read, the KL weight kept as a tensor)."""
    if device_path:
        _off_the_host(monkeypatch)
    problem = make_problem(3, Gaussian(noise_precision=10.0), seed=0, dtype=F64, n_data=40)
    method = make_method("gmfvi", init_std=0.05, n_train_mc_samples=n_samples, kl_annealing_steps=3, lr=0.05)
    method.setup(problem)
    _assert_follows_the_twin(method, _reference_gmfvi_run)


def _reference_ktied_run(method: ktied.KTiedNormalVI, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """The slow twin of ``N_STEPS`` k-tied steps: softplus factors, every weight's sigma = V U^T formed,
    ``_diag_vi.local_reparam_linear`` on sigma^2, the closed-form KL of the whole flat Gaussian
    (``_diag_vi.kl_diag_to_prior``) and a plain Adam. Returns mean and the variational tensors after each step."""
    problem = method.problem
    mean = method.mean.detach().clone().requires_grad_(True)
    variational = {k: v.detach().clone().requires_grad_(True) for k, v in method.variational.items()}
    adam = torch.optim.Adam([mean, *variational.values()], lr=method.lr, foreach=False, fused=False)
    states = []
    for step in range(1, N_STEPS + 1):
        adam.zero_grad()
        stds = []
        for pos in range(len(method.param_shapes)):
            if pos in method.factor_keys:
                u, v = (F.softplus(variational[k]) for k in method.factor_keys[pos])
                stds.append((v.T @ u).reshape(-1))
            else:
                stds.append(F.softplus(variational[method.rho_keys[pos]]).reshape(-1))
        std = torch.cat(stds)
        h = plain_local_outputs(method, mean, std**2, x, method.n_train_mc_samples)
        nll = torch.stack([problem.likelihood.nll(f, y) for f in h]).mean()
        kl = kl_diag_to_prior(mean, std, problem.prior_precision)
        (nll + method.kl_weight(step) * kl / problem.n_data).backward()
        adam.step()
        states.append(torch.cat([mean.detach(), *(v.detach().flatten() for v in variational.values())]))
    return states


@pytest.mark.parametrize("prior_precision", [1.0, None])
def test_ktied_steps_match_the_plain_autograd_twin(prior_precision: float | None) -> None:
    """Five k-tied steps (the KL's mean term on the flat mean, the rest per part with a hand-written
    backward, Khatri-Rao variances) follow the plain twin in float64; with one shared prior precision
    and with one per coordinate."""
    problem = make_problem(3, Gaussian(noise_precision=10.0), seed=0, dtype=F64, n_data=40)
    if prior_precision is None:
        lam = torch.linspace(0.5, 2.0, problem.prior_precision.numel(), dtype=F64)
        problem = Problem(problem.model, problem.likelihood, problem.n_data, lam, problem.generator)
    method = make_method("ktied", n_train_mc_samples=2, kl_annealing_steps=3, lr=0.05)
    problem.generator.manual_seed(5)
    method.setup(problem)
    assert isinstance(method._prior, float) == (prior_precision is not None)
    _assert_follows_the_twin(method, _reference_ktied_run)


@pytest.mark.parametrize("kind", ["ktied", "elrg", "elrg_d"])
def test_device_paths_of_ktied_and_elrg_match_their_host_paths(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """k-tied and ELRG(-D) with every host read replaced by tensor arithmetic (as on a GPU) take the
    same five steps as on the host, in float64."""
    x, y = _data()

    def run(device_path: bool) -> list[torch.Tensor]:
        if device_path:
            _off_the_host(monkeypatch)
        problem = make_problem(3, Gaussian(noise_precision=10.0), seed=0, dtype=F64, n_data=40)
        method = make_method(kind, kl_annealing_steps=3, lr=0.05)
        method.setup(problem)
        problem.generator.manual_seed(11)
        states = _run(method, x, y)
        monkeypatch.undo()
        return states

    host, device = run(False), run(True)
    for got, expected in zip(device, host, strict=True):
        assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert not torch.equal(host[0], host[-1])


@pytest.mark.parametrize("kind", ["gmfvi", "ktied", "elrg", "elrg_d"])
def test_forward_and_backward_make_no_host_syncs_on_a_device(kind: str) -> None:
    """With ``meta`` standing in for a GPU (tests/_device_check.py), the step's terms, the
    network's forward and the backward (the methods' own code: KL, layers, hand-written backwards) read
    nothing back to the host, and their gradients are those of the CPU run."""
    x, y = _data(torch.float32)

    def grads(on_device: bool) -> list[torch.Tensor]:
        problem = make_problem(3, Gaussian(noise_precision=10.0), seed=0, n_data=40)
        method = make_method(kind, n_train_mc_samples=1)
        xs, ys = x, y
        if on_device:
            problem.model.to(DEVICE)
            gen = torch.Generator(device=DEVICE).manual_seed(0)
            prior = problem.prior_precision.to(DEVICE)
            problem = Problem(problem.model, problem.likelihood, problem.n_data, prior, gen)
            xs, ys = x.to(DEVICE), y.to(DEVICE)
        problem.generator.manual_seed(5)  # the same initial factors (k-tied, ELRG draw them)
        method.setup(problem)
        problem.generator.manual_seed(11)
        syncs = check.syncs if on_device else 0
        terms = method._step_terms(with_kl=True)
        nll = problem.likelihood.nll(method._local_forward(terms, xs, 1), ys).mean()
        torch.add(nll, terms.kl, alpha=0.5 / problem.n_data).backward()
        if on_device:
            assert check.syncs == syncs, f"{kind}: {check.syncs - syncs} host syncs in a step's forward/backward"
        return [leaf.grad.cpu() for leaf in (method.mean, *method.variational.values())]

    host = grads(False)
    with fake_device() as check:
        device = grads(True)
    if kind == "ktied":  # its mean's gradient is gathered by _layerwise_vi.gather_part_grads, which skips a
        # part whose data_ptr is the segment's: the stand-in's tensors all report data_ptr 0 (+ offset)
        device, host = device[1:], host[1:]
    for got, expected in zip(device, host, strict=True):
        assert_close(got, expected)
