"""MC dropout: fits tiny problems, masks come from the generator, options are validated."""

from __future__ import annotations

import dataclasses
import io
import math
from pathlib import Path

import pytest
import torch
from _toy import (
    MLP,
    NOISE_PRECISION,
    check_beats_training_mean,
    classification_data,
    fit,
    make_problem,
    regression_data,
)
from torch import Tensor, nn
from torch.testing import assert_close

from bdl_bench.likelihoods import Bernoulli, Categorical, Gaussian
from bdl_bench.methods import build_method
from bdl_bench.methods.base import CannotStack, Method, Problem
from bdl_bench.models import build_model
from bdl_bench.models.params import flat_params, prior_precision_vector, unflatten


def make_dropout(**overrides: object) -> Method:
    cfg = {"name": "dropout", "lr": 0.02, "dropout_rate": 0.05, "n_train_mc_samples": 1, "dropout_inputs": True}
    return build_method({**cfg, **overrides})


def reference_outputs(
    model: nn.Module, theta: Tensor, x: Tensor, n_samples: int, rate: float, generator: torch.Generator, inputs: bool
) -> Tensor:
    """The slow twin of MC dropout's forward pass on an MLP: its layers one by one at the flat parameters ``theta``,
    the ``(S, N, in)`` masks of every ``nn.Linear`` but the first (and of the first with ``inputs``) drawn from
    ``generator`` layer by layer: ``(S, N, out)``."""
    params = unflatten(model, theta)
    h, first = x.expand(n_samples, *x.shape), True
    for name, module in model.named_children():
        if isinstance(module, nn.Linear):
            if inputs or not first:
                keep = torch.rand(h.shape, generator=generator, dtype=h.dtype) >= rate
                h = h * keep / (1 - rate)
            first = False
            h = h @ params[f"{name}.weight"].T + params[f"{name}.bias"]
        elif isinstance(module, nn.ReLU):
            h = torch.relu(h)
        else:
            assert isinstance(module, nn.Dropout), module
    return h


@pytest.mark.parametrize("dropout_inputs", [True, False])
def test_beats_training_mean_on_regression(dropout_inputs: bool) -> None:
    check_beats_training_mean(make_dropout(dropout_inputs=dropout_inputs))


def test_beats_chance_on_two_classes() -> None:
    x, y, x_test, y_test = classification_data(0)
    method = make_dropout(n_train_mc_samples=2)
    fit(method, make_problem(2, Bernoulli(), seed=1), x, y)
    nll = -Bernoulli().log_predictive(method.predict(x_test, 32), y_test).mean()
    assert nll < 0.8 * math.log(2)


def test_masks_follow_the_generator() -> None:
    x, y, x_test, _ = regression_data(0)

    def run(seed: int) -> Tensor:
        problem = make_problem(1, Gaussian(noise_precision=NOISE_PRECISION), seed=3)
        problem.generator.manual_seed(seed)
        method = make_dropout(dropout_rate=0.2)
        global_state = torch.get_rng_state()  # building the model above used it (nn.init)
        fit(method, problem, x, y, n_epochs=2)
        f = method.predict(x_test, 8)
        assert torch.equal(torch.get_rng_state(), global_state)
        return f

    first = run(10)
    assert_close(run(10), first, rtol=0, atol=0)
    assert not torch.allclose(run(11), first)
    assert not torch.allclose(first[0], first[1])  # each forward pass has its own masks


def test_mask_rate_and_inverted_scaling() -> None:
    problem = make_problem(1, Gaussian(noise_precision=NOISE_PRECISION), seed=0)
    method = make_dropout(dropout_rate=0.3)
    method.setup(problem)
    dropped = method._masks((200_000,), torch.ones(()))
    assert_close((dropped == 0).double().mean().item(), 0.3, rtol=0, atol=0.005)
    assert_close(dropped[dropped != 0], torch.full_like(dropped[dropped != 0], 1 / 0.7))


@pytest.mark.parametrize(("dropout_inputs", "stochastic"), [(True, True), (False, False)])
def test_dropout_inputs_drops_the_first_layer_inputs(dropout_inputs: bool, stochastic: bool) -> None:
    """A single linear layer has no hidden layer: only input dropout makes its output random."""
    problem = make_problem(3, Bernoulli(), seed=0, model_cfg={"name": "logreg", "bias": True})
    method = make_dropout(dropout_rate=0.5, dropout_inputs=dropout_inputs)
    method.setup(problem)
    f = method.predict(torch.randn(6, 3, generator=torch.Generator().manual_seed(1)), 4)
    assert (not torch.allclose(f[0], f[1])) is stochastic


def test_ignores_the_models_own_dropout_modules() -> None:
    """A model built with nn.Dropout gives the same predictions as one without (same weights, same seed)."""
    x_test = regression_data(0)[2]
    predictions = []
    for extra in ({}, {"dropout": 0.5}):
        problem = make_problem(1, Gaussian(noise_precision=NOISE_PRECISION), seed=4, model_cfg={**MLP, **extra})
        problem.model.train()
        method = make_dropout(dropout_rate=0.1)
        method.setup(problem)
        predictions.append(method.predict(x_test, 4))
    assert_close(predictions[1], predictions[0], rtol=0, atol=0)


@pytest.mark.parametrize("rate", [0.0, 1.0, -0.1, 1.5])
def test_bad_dropout_rate_raises(rate: float) -> None:
    with pytest.raises(
        ValueError, match=rf"dropout: method\.dropout_rate={rate} is out of range: it must be a number in \(0, 1\)"
    ):
        make_dropout(dropout_rate=rate)


@pytest.mark.parametrize(("option", "value"), [("lr", 0.0), ("n_train_mc_samples", 0), ("dropout_inputs", "yes")])
def test_bad_options_raise(option: str, value: object) -> None:
    with pytest.raises(ValueError, match=option):
        make_dropout(**{option: value})


def test_refuses_models_it_cannot_run_layer_by_layer() -> None:
    problem = make_problem(1, Gaussian(noise_precision=NOISE_PRECISION), seed=0)
    wrapped = dataclasses.replace(problem, model=nn.ModuleDict({"net": problem.model}))
    with pytest.raises(ValueError, match="nn.Sequential"):
        make_dropout().setup(wrapped)


def test_state_dict_round_trip_gives_identical_next_step() -> None:
    x, y, _, _ = regression_data(0)
    likelihood = Gaussian(noise_precision=NOISE_PRECISION)
    a, b, c = make_dropout(), make_dropout(), make_dropout()
    problem_a = make_problem(1, likelihood, seed=1)
    fit(a, problem_a, x, y, n_epochs=2)
    snapshot = a.state_dict()
    buffer = io.BytesIO()
    torch.save(snapshot, buffer)
    buffer.seek(0)
    b.setup(make_problem(1, likelihood, seed=2))
    b.load_state_dict(torch.load(buffer, weights_only=True))
    c.setup(make_problem(1, likelihood, seed=3))
    c.load_state_dict(snapshot)  # taken before ``a`` steps again: must be a copy, not a view
    for method in (a, b, c):
        method.problem.generator.manual_seed(5)
        method.train_step(x[:25], y[:25])
    assert_close(b.state_dict()["theta"], a.state_dict()["theta"], rtol=0, atol=0)
    assert_close(c.state_dict()["theta"], a.state_dict()["theta"], rtol=0, atol=0)


# ---------------------------------------------------------------- models with convolutions (DEF's LeNet)
TINY_LENET = {"name": "lenet", "image_size": 8, "channels": [2, 3], "hidden": 8}


def lenet_problem(rate: float, seed: int = 0, prior: float = 1e-3) -> tuple[Problem, Tensor, Tensor]:
    """A tiny LeNet (8x8 images, 2 and 3 filters, 8 hidden units, 3 classes) with nn.Dropout(rate) before
    its last layer, and 12 random images of 3 classes (to memorise: a weak prior)."""
    torch.manual_seed(seed)  # nn.init of the conv layers
    model = build_model({**TINY_LENET, "dropout": rate}, in_features=1, out_features=3)
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(12, 1, 8, 8, generator=g)
    y = torch.arange(12) % 3
    precision = prior_precision_vector(model, prior, None)
    return Problem(model, Categorical(), 12, precision, torch.Generator().manual_seed(seed + 1)), x, y


def test_lenet_outputs_vary_with_the_variance_of_dropout_before_the_last_layer() -> None:
    """Dropout at the model's nn.Dropout (before the linear last layer): the MC mean of the logits is the
    network without dropout, and their variance is Σ_j W_kj² h_j² p / (1 − p) (h: the dropped units)."""
    rate = 0.5
    problem, x, _ = lenet_problem(rate)
    method = make_dropout(dropout_rate=rate, dropout_inputs=False)
    method.setup(problem)
    f = method.predict(x, 4000)
    assert f.shape == (4000, 12, 3)
    assert not torch.allclose(f[0], f[1])
    model = problem.model.eval()  # nn.Dropout off: the deterministic network
    with torch.no_grad():
        hidden = model[:-2](x)  # the units the dropout module multiplies (after the hidden ReLU)
        expected_mean = model(x)
    weight = model[-1].weight
    expected_var = (hidden**2) @ (weight**2).T * rate / (1 - rate)
    assert expected_var.min() > 1e-4
    assert_close(f.mean(0), expected_mean, rtol=0, atol=4 * (expected_var.max() / 4000).sqrt().item())
    assert_close(f.var(0), expected_var, rtol=0.15, atol=1e-5)


def test_lenet_masks_follow_the_generator_only() -> None:
    problem, x, _ = lenet_problem(0.5)
    method = make_dropout(dropout_rate=0.5, dropout_inputs=False)
    method.setup(problem)
    global_state = torch.get_rng_state()
    problem.generator.manual_seed(3)
    first = method.predict(x, 5)
    problem.generator.manual_seed(3)
    assert_close(method.predict(x, 5), first, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), global_state)


def test_lenet_predict_in_slices_equals_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slicing the test set (memory bound for a full LeNet) changes nothing but the order of mask draws."""
    import bdl_bench.methods.dropout as dropout_module

    problem, x, _ = lenet_problem(0.5)
    method = make_dropout(dropout_rate=0.5, dropout_inputs=True)
    method.setup(problem)
    problem.generator.manual_seed(0)
    whole = method.predict(x, 3)
    monkeypatch.setattr(dropout_module, "_PREDICT_BUDGET", 9)  # 3 samples x 3 rows per pass
    monkeypatch.setattr(dropout_module, "_PREFIX_ROWS", 5)
    problem.generator.manual_seed(0)
    sliced = method.predict(x, 3)
    assert sliced.shape == whole.shape and torch.isfinite(sliced).all()
    assert not torch.allclose(sliced, whole)  # other masks, same distribution
    params = method._module_params(method.point_estimate())
    problem.generator.manual_seed(0)
    assert_close(method._stochastic_part(params, x[:3], 3), sliced[:, :3], rtol=0, atol=0)


def test_lenet_train_steps_decrease_the_loss() -> None:
    problem, x, y = lenet_problem(0.2)
    method = make_dropout(lr=0.02, dropout_rate=0.2, dropout_inputs=False, n_train_mc_samples=4)
    method.setup(problem)

    def predictive_nll() -> float:
        problem.generator.manual_seed(9)
        return float(-Categorical().log_predictive(method.predict(x, 200), y).mean())

    before = predictive_nll()
    losses = [method.train_step(x, y)["loss"] for _ in range(30)]
    assert sum(losses[-5:]) / 5 < 0.6 * losses[0]
    assert predictive_nll() < 0.6 * before


def test_conv_model_runs_alone_but_does_not_stack() -> None:
    """The stacked step is written for nn.Linear layers: a LeNet is a single run (a stack of one) only."""
    problem, x, y = lenet_problem(0.5)
    with pytest.raises(CannotStack, match="nn.Linear"):
        make_dropout(dropout_rate=0.5).setup_stack([problem, problem])
    single = make_dropout(dropout_rate=0.5)
    single.setup_stack([problem])
    assert torch.isfinite(single.stack_step(x[None], y[None])["loss"]).all()


def test_conv_model_without_dropout_modules_or_with_another_rate_is_refused() -> None:
    problem, _, _ = lenet_problem(0.0)
    with pytest.raises(ValueError, match=r"layer 0 is Conv2d.*has none \(set model.dropout=<rate>\)"):
        make_dropout(dropout_rate=0.5).setup(problem)
    problem, _, _ = lenet_problem(0.6)
    with pytest.raises(ValueError, match=r"rate 0.6 but method.dropout_rate=0.5.*\$\{model.dropout\}"):
        make_dropout(dropout_rate=0.5).setup(problem)


def test_def_table1_mc_dropout_variant_builds_a_lenet_with_matching_rates() -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(str(conf), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=def_table1", "variant=def_table1/mc_dropout"])
    container = OmegaConf.to_container(cfg, resolve=True)
    assert container["model"]["dropout"] == container["method"]["dropout_rate"] == 0.6
    assert container["method"]["dropout_inputs"] is False
    small = {**container["model"], "image_size": 8, "channels": [2, 3], "hidden": 8}
    model = build_model(small, in_features=1, out_features=10)
    method = build_method(container["method"])
    method.setup(Problem(model, Categorical(), 10, prior_precision_vector(model, 1.0, None), torch.Generator()))
    assert method.predict(torch.rand(2, 1, 8, 8), 3).shape == (3, 2, 10)


@pytest.mark.parametrize("dropout_inputs", [True, False])
def test_predict_stack_equals_each_single_copy_predict(dropout_inputs: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stacked copies with their own rates (a grid's trials), predicted together with shared masks: each
    copy's outputs are bit for bit its single copy's ``predict`` from the same generator state, in slices
    of a chunk too, and the generator ends where that ``predict`` leaves it; and they are the slow twin's
    forward passes, chunk by chunk of ``_PREDICT_CHUNK`` mask draws, with the copy's weights and rate."""
    import bdl_bench.methods.dropout as dropout_module

    monkeypatch.setattr(dropout_module, "_SLICE_ELEMENTS", 2 * 40 * 32)  # two samples per slice
    model_cfg = {"name": "mlp", "hidden": [32, 16], "activation": "relu"}
    problems = [
        make_problem(3, Gaussian(noise_precision=NOISE_PRECISION), seed=0, model_cfg=model_cfg) for _ in range(3)
    ]
    rates = (0.1, 0.3, 0.1)
    method = make_dropout(dropout_inputs=dropout_inputs)
    method.configure_stack([{"dropout_rate": r} for r in rates])
    method.setup_stack(problems)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(3, 40, 3, generator=g), torch.randn(3, 40, generator=g)
    for _ in range(3):
        method.stack_step(x, y)  # the copies' weights now differ
    n_samples = 70  # more than one chunk of mask draws, and a partial last one

    shared = torch.Generator().manual_seed(9)
    method.problem = dataclasses.replace(method.problem, generator=shared)
    outputs = method.predict_stack(x[[2, 0, 1]], n_samples, [2, 0, 1])
    assert outputs.shape == (3, n_samples, 40, 1)
    for position, r in enumerate((2, 0, 1)):
        single = method.copy_at(r)
        own = torch.Generator().manual_seed(9)
        single.problem = dataclasses.replace(single.problem, generator=own)
        assert single.dropout_rate == rates[r]
        assert torch.equal(outputs[position], single.predict(x[r], n_samples)), r
        assert torch.equal(own.get_state(), shared.get_state())
        twin = torch.Generator().manual_seed(9)
        chunk = dropout_module._PREDICT_CHUNK
        chunks = [min(chunk, n_samples - start) for start in range(0, n_samples, chunk)]
        expected = torch.cat(
            [
                reference_outputs(
                    method.problem.model, single.point_estimate(), x[r], n, rates[r], twin, dropout_inputs
                )
                for n in chunks
            ]
        )
        assert_close(outputs[position], expected)
        assert torch.equal(twin.get_state(), shared.get_state())
    assert not torch.equal(outputs[0], outputs[2])  # copies 0 and 2 share a rate, not their weights


def test_step_equals_autograd_of_the_objective_with_plain_adam() -> None:
    """The prior's gradient added in place (add_prior_term) and the fused Adam give the steps of autograd
    through the whole objective of the slow twin's forward pass + the plain Adam, with the same masks (float64,
    several steps, a per-parameter prior with its own bias precision)."""
    x, y, _, _ = regression_data(0)
    x, y = x.double(), y.double()
    base = make_problem(1, Gaussian(noise_precision=NOISE_PRECISION), seed=1)
    base.model.double()
    problem = dataclasses.replace(base, prior_precision=prior_precision_vector(base.model, 3.0, 0.5).double())
    method = make_dropout(dropout_rate=0.2, n_train_mc_samples=2)
    method.setup(problem)
    assert method.optimizer.param_groups[0]["fused"]
    twin = flat_params(problem.model).requires_grad_(True)
    plain = torch.optim.Adam([twin], lr=method.lr)
    for i in range(5):
        batch = slice(10 * i, 10 * i + 25)
        state = problem.generator.get_state()
        out = method.train_step(x[batch], y[batch])
        problem.generator.set_state(state)  # the twin draws the same masks
        plain.zero_grad()
        f = reference_outputs(problem.model, twin, x[batch], 2, 0.2, problem.generator, inputs=True)
        nll = torch.stack([problem.likelihood.nll(f_s, y[batch]) for f_s in f]).mean()
        loss = nll + 0.5 * (problem.prior_precision * twin**2).sum() / problem.n_data
        loss.backward()
        plain.step()
        assert_close(out["loss"], loss.detach(), rtol=1e-12, atol=0)
    assert_close(method.point_estimate(), twin.detach(), rtol=1e-10, atol=1e-12)
    assert not torch.equal(twin.detach(), flat_params(problem.model))
