"""The CPU-side device check (tests/_device_check.py) and the device defects it finds: metrics,
curvature and the runner's evaluation run with ``meta`` standing in for a GPU."""

from __future__ import annotations

import pytest
import torch
from _device_check import DEVICE, DeviceMixError, DeviceTensor, fake_device, to_device
from _runs import without_cost
from omegaconf import OmegaConf
from torch.testing import assert_close

from bdl_bench import optim
from bdl_bench.checkpoint import load_checkpoint
from bdl_bench.curvature import conv_gram
from bdl_bench.curvature.kron import efb_eigenvalues, eigenbasis, kron_factors
from bdl_bench.curvature.pseudo_grads import iter_pseudo_grads
from bdl_bench.likelihoods import Categorical
from bdl_bench.methods import build_method
from bdl_bench.methods.base import Method, NonFiniteLossError, Problem
from bdl_bench.metrics import expected_calibration_error, predictive_metrics
from bdl_bench.models import build_model
from bdl_bench.models.params import prior_precision_vector
from bdl_bench.orchestration.resume import CheckpointDeviceError
from bdl_bench.orchestration.runner import run
from bdl_bench.results import read_run_record

# --- the check itself ---------------------------------------------------------------------------------------


def test_device_tensors_compute_the_cpu_numbers() -> None:
    x = torch.arange(6.0).view(2, 3)
    with fake_device():
        d = x.to(DEVICE)
        assert isinstance(d, DeviceTensor) and d.device == DEVICE
        out = (d * 2 + torch.ones(3, device=DEVICE)).sum(0)
        assert out.device == DEVICE
        assert_close(out.cpu(), (x * 2 + 1).sum(0))
        assert torch.tensor([1.0, 2.0], device=DEVICE).tolist() == [1.0, 2.0]  # data made below the dispatcher
        assert d[1].data_ptr() == d.data_ptr() + 3 * 4 and d.untyped_storage().nbytes() == 6 * 4


def test_mixing_a_cpu_tensor_raises() -> None:
    with fake_device():
        d = torch.ones(3, device=DEVICE)
        with pytest.raises(DeviceMixError, match=r"CPU tensor of shape \(3,\)"):
            d + torch.ones(3)
        with pytest.raises(DeviceMixError):
            torch.where(torch.tensor([True, False, True]), d, d)


def test_cpu_scalars_are_inputs_only() -> None:
    """PyTorch lets a 0-dim CPU tensor into a CUDA op, but not receive a CUDA result in place."""
    with fake_device():
        d = torch.ones(3, device=DEVICE)
        assert (d * torch.tensor(2.0)).device == DEVICE
        total = torch.zeros(())
        with pytest.raises(DeviceMixError, match="0-dim CPU tensor"):
            total += d.sum()


def test_cpu_indices_may_index_a_device_tensor() -> None:
    with fake_device():
        d = torch.arange(5.0, device=DEVICE)
        assert_close(d[torch.tensor([0, 4])].cpu(), torch.tensor([0.0, 4.0]))
        d[torch.tensor([1])] = 7.0
        assert float(d[1]) == 7.0


def test_autograd_and_modules_move_to_the_device() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    expected = torch.autograd.grad(model(x).square().sum(), model.weight)[0]
    with fake_device():
        model.to(DEVICE)
        assert model.weight.device == DEVICE
        (grad,) = torch.autograd.grad(model(x.to(DEVICE)).square().sum(), model.weight)
        assert grad.device == DEVICE
        assert_close(grad.cpu(), expected)
        with pytest.raises(DeviceMixError):
            model(x)  # CPU input into a device model


def test_generators_must_match_the_device() -> None:
    with fake_device():
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        assert gen.device == DEVICE
        assert torch.randn(3, generator=gen, device=DEVICE).device == DEVICE
        with pytest.raises(DeviceMixError, match="fills CPU tensors"):
            torch.randperm(3, generator=gen)
        with pytest.raises(DeviceMixError, match="fills device tensors"):
            torch.randn(3, generator=torch.Generator().manual_seed(0), device=DEVICE)
    assert torch.Generator().device.type == "cpu"  # restored


def test_syncs_are_counted() -> None:
    with fake_device() as check:
        d = torch.ones(3, device=DEVICE)
        d = d * 2
        assert check.syncs == 0
        float(d.sum())
        bool(d.sum() > 0)
        d.cpu()
        d.sum().item()
        assert check.syncs == 4


# --- defect 1: the ECE accumulator --------------------------------------------------------------------------


def _classification_outputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(4, 50, 5, generator=gen, dtype=torch.float64), torch.randint(0, 5, (50,), generator=gen)


def test_ece_runs_on_the_device() -> None:
    f, y = _classification_outputs()
    probs = torch.softmax(f, -1).mean(0)
    expected = expected_calibration_error(probs, y)
    with fake_device():
        assert expected_calibration_error(to_device(probs), to_device(y)) == pytest.approx(expected, abs=1e-12)


def test_classification_metrics_run_on_the_device() -> None:
    f, y = _classification_outputs()
    expected = predictive_metrics(Categorical(), f, y)
    with fake_device():
        assert predictive_metrics(Categorical(), to_device(f), to_device(y)) == pytest.approx(expected)


# --- defect 2: KFAC on a stride-1 conv with >= 8 input channels (DEF's LeNet second conv) ---------------------


def _lenet_problem() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    """DEF's LeNet shape (5x5 padded convs, pooling, two linear layers) shrunk to 12x12 images and 8 channels,
    so that the second conv takes the shifted-product path."""
    model = build_model(
        {"name": "lenet", "image_size": 12, "channels": [8, 8], "hidden": 16, "dropout": 0.0},
        in_features=1,
        out_features=3,
    ).double()
    gen = torch.Generator().manual_seed(1)
    n_params = sum(p.numel() for p in model.parameters())
    theta = 0.3 * torch.randn(n_params, generator=gen, dtype=torch.float64)
    x = torch.rand(10, 1, 12, 12, generator=gen, dtype=torch.float64)
    return model, theta, x, torch.randint(0, 3, (10,), generator=gen)


def test_kron_factors_of_lenets_second_conv_run_on_the_device() -> None:
    model, theta, x, y = _lenet_problem()

    def batches(model: torch.nn.Module, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor):  # noqa: ANN202
        return iter_pseudo_grads(model, theta, x, y, Categorical(), batch_size=4)

    first = next(batches(model, theta, x, y))
    assert conv_gram.uses_shifted_gram(first.layers[1].slot, first.layers[1].layer_input.shape)
    factors = kron_factors(batches(model, theta, x, y))
    eigs, diag = efb_eigenvalues(batches(model, theta, x, y), eigenbasis(factors))
    with fake_device():
        model.to(DEVICE)
        dev = [to_device(t) for t in (theta, x, y)]
        factors_d = kron_factors(batches(model, *dev))
        eigs_d, diag_d = efb_eigenvalues(batches(model, *dev), eigenbasis(factors_d))
        assert factors_d[1].a_factor.device == DEVICE
        for a, b in zip(factors, factors_d):
            assert_close(b.a_factor.cpu(), a.a_factor)
            assert_close(b.g_factor.cpu(), a.g_factor)
        for a, b in zip(eigs, eigs_d):
            assert_close(b.cpu(), a)
        assert_close(diag_d.cpu(), diag)


# --- the runner and every method's training step, on the device ----------------------------------------------

METHODS = [
    "map",
    "bbb",
    "dropout",
    "ivon",
    "slang",
    "vogn",
    "vogn method.covariance=diag",
    "gmfvi",
    "ktied",
    "elrg",
    "ensemble",
    "laplace",  # kfac
    "laplace method.structure=def method.rank=4 method.curvature=fisher",
    "laplace method.structure=efb",  # (predictive=linearised: torch.func.jvp under vmap does not take the check's tensors)
    "laplace method.structure=diag",
]


NOT_IN_THE_RUN_CHECK = {  # registered methods the check above leaves out, and where their device path is tested
    "exact_vi": "logistic regression only (model=logreg): tests/test_cuda.py runs it on australian/logreg",
    "hmc": "a full-batch chain: tests/methods/test_hmc.py, and tests/test_cuda.py on a GPU",
}


def test_every_registered_method_is_run_on_the_device_or_says_why_not() -> None:
    """A new method is in METHODS above (or in NOT_IN_THE_RUN_CHECK with a reason): the registry, not a list
    kept by hand, decides which methods this check must cover."""
    from bdl_bench.methods import METHODS as REGISTERED
    from bdl_bench.methods import import_all

    import_all()

    checked = {method.split()[0] for method in METHODS}
    assert set(REGISTERED) - checked == set(NOT_IN_THE_RUN_CHECK)
    assert checked <= set(REGISTERED)


@pytest.mark.parametrize("method", METHODS)
def test_a_run_trains_and_evaluates_on_the_device(method: str, tmp_path, compose_cfg, monkeypatch) -> None:
    """The whole run — data and model moved to the device, every training step, per-epoch and final
    evaluation (ECE included), the ELBO, a Laplace fit — on australian (binary classification, 345 training
    rows), with the same metrics as on the CPU."""
    # the stand-in has no fused Adam kernel (bdl_bench.optim): the CPU run takes the plain one too, so that the two
    # runs differ only by where they ran
    monkeypatch.setattr(optim, "FUSED_DEVICE_TYPES", ())
    name, *options = method.split()
    overrides = [f"method={name}", *options, "data=libsvm/australian", "model=mlp", "trainer.checkpoint_every=0"]
    on_cpu = run(compose_cfg([*overrides, "trainer.device=cpu"]), tmp_path / "cpu").metrics
    with fake_device():
        on_device = run(compose_cfg([*overrides, f"trainer.device={DEVICE.type}"]), tmp_path / "device").metrics
    assert read_run_record(tmp_path / "device")["device"] == DEVICE.type
    on_cpu, on_device = without_cost(on_cpu), without_cost(on_device)
    # SLANG's top-L eigenpairs come from LAPACK's ?syevr on the host and torch.linalg.eigh on a device: the same
    # update up to the solvers' rounding (float32), which the training steps carry into the metrics
    rel = 1e-5 if name == "slang" else 1e-6
    assert on_device == pytest.approx(on_cpu, rel=rel, abs=1e-9)


# --- no host syncs in a training step -----------------------------------------------------------------------

STEP_METHODS = {  # each method's conf/method/<name>.yaml with these changes
    "map": {},
    "dropout": {},
    "bbb": {},
    "ivon": {},
    "ensemble": {"n_members": 3},
    "vogn": {"covariance": "diag"},
    "gmfvi": {},
    "ktied": {},
    "elrg": {},
}


def _method_config(name: str, compose_cfg) -> dict:
    config = OmegaConf.to_container(compose_cfg([f"method={name}"]).method, resolve=True)
    return {**config, **STEP_METHODS[name]}


def _device_problem(method: dict) -> tuple[Method, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    model = build_model({"name": "mlp", "hidden": [8], "activation": "relu"}, in_features=3, out_features=2)
    model.to(DEVICE)
    prior = prior_precision_vector(model, 1.0, None)
    problem = Problem(model=model, likelihood=Categorical(), n_data=40, prior_precision=prior, generator=gen)
    built = build_method(method)
    built.setup(problem)
    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 3, generator=data), torch.randint(0, 2, (40,), generator=data)
    return built, x.to(DEVICE), y.to(DEVICE)


@pytest.mark.parametrize("method", STEP_METHODS)
def test_training_steps_do_not_wait_for_the_device(method: str, compose_cfg) -> None:
    """No step reads the device (``.item()``, ``float``, ``bool`` of a tensor); the fit loop reads its
    losses and means twice per epoch."""
    config = _method_config(method, compose_cfg)
    with fake_device() as check:
        built, x, y = _device_problem(config)
        built.train_step(x[:10], y[:10])  # the first step may set things up
        check.syncs = 0
        for start in (10, 20, 30):
            out = built.train_step(x[start : start + 10], y[start : start + 10])
        assert check.syncs == 0
        assert out["loss"].device == DEVICE
        seen = []
        built.fit(
            x,
            y,
            n_epochs=2,
            batch_size=10,
            data_generator=torch.Generator().manual_seed(0),
            on_epoch_end=lambda epoch, stats: seen.append((epoch, check.syncs)),
        )
        assert seen == [(1, 2), (2, 4)]  # two reads per epoch: its losses' check and its means


def test_a_diverging_loss_is_still_caught_at_its_step(compose_cfg) -> None:
    with fake_device():
        built, x, y = _device_problem(_method_config("map", compose_cfg))
        x = x.clone()
        x[25] = float("nan")  # the third step of the epoch's second permutation slice is poisoned
        with pytest.raises(NonFiniteLossError, match=r"method 'map': non-finite loss nan at epoch 1, step \d"):
            built.fit(x, y, n_epochs=2, batch_size=10, data_generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("method", ["bbb", "dropout", "ivon", "vogn"])
def test_stacked_training_steps_do_not_wait_for_the_device(method: str, compose_cfg) -> None:
    config = _method_config(method, compose_cfg)
    with fake_device() as check:
        single, x, y = _device_problem(config)
        stacked = build_method(config)
        stacked.setup_stack([single.problem, single.problem])
        xs, ys = torch.stack([x, x.flip(0)]), torch.stack([y, y.flip(0)])
        stacked.stack_step(xs[:, :10], ys[:, :10])
        check.syncs = 0
        out = stacked.stack_step(xs[:, 10:20], ys[:, 10:20])
        assert check.syncs == 0 and out["loss"].shape == (2,) and out["loss"].device == DEVICE


def test_a_diverging_stacked_copy_is_named(compose_cfg) -> None:
    """Diagonal VOGN reports a copy's divergence as a NaN loss (its state kept) and the loop names the copy."""
    with fake_device():
        single, x, y = _device_problem(_method_config("vogn", compose_cfg))
        stacked = build_method(_method_config("vogn", compose_cfg))
        stacked.setup_stack([single.problem, single.problem])
        poisoned = x.clone()
        poisoned[:, 0] = float("nan")
        with pytest.raises(NonFiniteLossError, match=r"non-finite loss nan in stacked copy 1 at epoch 1, step 1"):
            stacked.fit_stack(
                torch.stack([x, poisoned]),
                torch.stack([y, y]),
                n_epochs=1,
                batch_size=10,
                data_generator=torch.Generator().manual_seed(0),
            )
        assert torch.isfinite(stacked.state.mean).all() and torch.isfinite(stacked.state.precision).all()


# --- defect 3: a checkpoint resumed on another device type ----------------------------------------------------


def test_a_device_runs_checkpoint_is_refused_by_a_cpu_rerun(tmp_path, compose_cfg, at_epoch_end) -> None:
    """trainer.device is not in the config hash, so a CPU re-run finds the GPU run's checkpoint; it must refuse
    it in one line rather than resume (on CUDA the generator states do not even fit: "RNG state is wrong size")."""
    overrides = ["method=map", "data=libsvm/australian", "trainer.n_epochs=3", "trainer.checkpoint_every=1"]

    def crash(epoch: int) -> None:
        if epoch == 2:
            raise KeyboardInterrupt

    with fake_device(), at_epoch_end(crash), pytest.raises(KeyboardInterrupt):
        run(compose_cfg([*overrides, f"trainer.device={DEVICE.type}"]), tmp_path)
    assert load_checkpoint(tmp_path / "checkpoint.pt").epoch == 2
    with pytest.raises(CheckpointDeviceError, match=f"written on {DEVICE.type} and this run is on cpu"):
        run(compose_cfg([*overrides, "trainer.device=cpu"]), tmp_path)


def test_a_slang_step_reads_the_device_only_before_its_eigendecomposition(compose_cfg) -> None:
    """SLANG's step returns its losses as device tensors; its two reads are the finite checks of the gradient
    and of the Gram matrix, which keep a diverged step from overwriting the state (the eigendecomposition they
    guard waits for the device anyway)."""
    config = OmegaConf.to_container(compose_cfg(["method=slang"]).method, resolve=True)
    with fake_device() as check:
        built, x, y = _device_problem(config)
        built.train_step(x[:10], y[:10])
        check.syncs = 0
        out = built.train_step(x[10:20], y[10:20])
        assert check.syncs == 2
        assert out["loss"].device == DEVICE
