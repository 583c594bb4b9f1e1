"""Checks shared by the layer-wise Gaussian VI methods gmfvi, ktied and elrg (and ELRG-D)."""

from __future__ import annotations

import dataclasses
import io
import math

import pytest
import torch
from _toy import NOISE_PRECISION, check_beats_training_mean, fit, regression_data
from _vi_helpers import CONFIGS, make_method, make_problem
from torch import Tensor, nn
from torch.testing import assert_close

from bdl_bench.likelihoods import Categorical, Gaussian
from bdl_bench.methods._layerwise_vi import kl_annealing_weight
from bdl_bench.methods.base import Method

KINDS = list(CONFIGS)


@pytest.mark.parametrize("kind", KINDS)
def test_beats_training_mean_on_regression(kind: str) -> None:
    check_beats_training_mean(make_method(kind), problem=make_problem)


def _local_and_explicit(method: Method, x: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Outputs of the method's local reparameterisation and of explicit weight samples: ``(n, N, out)``."""
    with torch.no_grad():
        terms = method._step_terms(with_kl=False)
        local = method._outputs_local(terms, x, n)
        explicit = method.forward_params(method._sample_params(terms, n), x)
    return local, explicit


@pytest.mark.parametrize("kind", KINDS)
def test_local_reparameterisation_has_moments_of_weight_sampling(kind: str) -> None:
    """One linear layer with three outputs: the locally reparameterised outputs have the mean and the full
    per-example covariance (across outputs) of outputs computed with explicitly sampled weights."""
    model_cfg = {"name": "logreg", "bias": True}
    problem = make_problem(4, Categorical(), seed=0, out_features=3, model_cfg=model_cfg, dtype=torch.float64)
    method = make_method(kind, init_std=0.3)
    method.setup(problem)
    with torch.no_grad():  # make the low-rank factors (elrg) as large as the diagonal part
        for name, t in method.variational.items():
            if name.startswith("v") and kind.startswith("elrg"):
                t.mul_(10.0)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    n = 100_000
    local, explicit = _local_and_explicit(method, x, n)
    assert local.shape == explicit.shape == (n, 5, 3)
    scale = explicit.var(0).max().sqrt()
    assert_close(local.mean(0), explicit.mean(0), rtol=0, atol=float(8 * scale / math.sqrt(n)))
    cov_local = torch.einsum("sno,snp->nop", local - local.mean(0), local - local.mean(0)) / n
    cov_explicit = torch.einsum("sno,snp->nop", explicit - explicit.mean(0), explicit - explicit.mean(0)) / n
    assert_close(cov_local, cov_explicit, rtol=0, atol=float(0.03 * scale**2))


@pytest.mark.parametrize("kind", KINDS)
def test_moments_through_a_hidden_layer(kind: str) -> None:
    """Two layers: for one example, sampling each layer's pre-activations given its input is the same law as
    sampling the weights (only correlations *across* examples differ), so the output moments agree."""
    model_cfg = {"name": "mlp", "hidden": [6], "activation": "tanh"}
    problem = make_problem(3, Gaussian(noise_precision=1.0), seed=2, model_cfg=model_cfg, dtype=torch.float64)
    method = make_method(kind, init_std=0.2)
    method.setup(problem)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    n = 100_000
    local, explicit = _local_and_explicit(method, x, n)
    scale = explicit.var(0).max().sqrt()
    assert_close(local.mean(0), explicit.mean(0), rtol=0, atol=float(8 * scale / math.sqrt(n)))
    assert_close(local.var(0), explicit.var(0), rtol=0.05, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_randomness_comes_from_the_generator(kind: str) -> None:
    x, y, x_test, _ = regression_data(0)

    def run(seed: int) -> Tensor:
        problem = make_problem(1, Gaussian(noise_precision=NOISE_PRECISION), seed=3)
        problem.generator.manual_seed(seed)
        method = make_method(kind)
        global_state = torch.get_rng_state()
        fit(method, problem, x, y, n_epochs=2)
        f = method.predict(x_test, 8)
        assert torch.equal(torch.get_rng_state(), global_state)
        return f

    first = run(10)
    assert_close(run(10), first, rtol=0, atol=0)
    assert not torch.allclose(run(11), first)
    assert not torch.allclose(first[0], first[1])


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_round_trip_gives_identical_next_step(kind: str) -> None:
    x, y, _, _ = regression_data(0)
    likelihood = Gaussian(noise_precision=NOISE_PRECISION)
    a, b = make_method(kind, kl_annealing_steps=10), make_method(kind, kl_annealing_steps=10)
    problem_a, problem_b = make_problem(1, likelihood, seed=1), make_problem(1, likelihood, seed=2)
    fit(a, problem_a, x, y, n_epochs=2)
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    b.setup(problem_b)
    b.load_state_dict(torch.load(buffer, weights_only=True))
    assert b.n_steps == a.n_steps == 4
    for method, problem in ((a, problem_a), (b, problem_b)):
        problem.generator.manual_seed(5)
        out = method.train_step(x[:25], y[:25])
        assert out["kl_weight"] == pytest.approx(0.5)
    sa, sb = a.state_dict(), b.state_dict()
    assert_close(sb["mean"], sa["mean"], rtol=0, atol=0)
    for key in sa["variational"]:
        assert_close(sb["variational"][key], sa["variational"][key], rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_kl_annealing_and_step_record(kind: str) -> None:
    x, y, _, _ = regression_data(0)
    method = make_method(kind, kl_annealing_steps=4)
    method.setup(make_problem(1, Gaussian(noise_precision=NOISE_PRECISION), seed=1))
    weights = []
    for _ in range(6):
        out = method.train_step(x[:20], y[:20])
        assert set(out) >= {"loss", "nll", "kl", "kl_weight"}
        loss, nll, kl = (float(out[k]) for k in ("loss", "nll", "kl"))
        assert loss == pytest.approx(nll + out["kl_weight"] * kl, rel=1e-5)
        weights.append(out["kl_weight"])
    assert weights == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert [kl_annealing_weight(t, 0) for t in (1, 100)] == [1.0, 1.0]
    kl = method.kl_to_prior()
    assert kl.ndim == 0 and float(kl) > 0


@pytest.mark.parametrize("kind", KINDS)
def test_snr_columns_reach_the_epoch_callback(kind: str) -> None:
    x, y, _, _ = regression_data(0)
    method = make_method(kind, snr_window=3)
    rows: list[dict[str, float]] = []
    fit(
        method,
        make_problem(1, Gaussian(noise_precision=NOISE_PRECISION), seed=1),
        x,
        y,
        n_epochs=4,
        on_epoch_end=lambda epoch, stats: rows.append(dict(stats)),
    )
    # 2 steps per epoch, windows of 3 steps complete at steps 3 and 6 (epochs 2 and 3)
    assert ["train/grad_snr" in r for r in rows] == [False, True, True, False]
    assert {"train/grad_snr_l1", "train/grad_snr_l2", "train/grad_snr_l3"} <= set(rows[1])
    assert all(r["train/grad_snr"] >= 1.0 for r in rows if "train/grad_snr" in r)  # E[g^2]/Var[g] >= 1
    assert [step for step, _ in method.snr.records] == [3, 6]


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("lr", 0.0, "lr"),
        ("init_std", -1.0, "init_std"),
        ("n_train_mc_samples", 0, "n_train_mc_samples"),
        ("n_train_mc_samples", 1.5, "n_train_mc_samples"),
        ("kl_annealing_steps", -1, "kl_annealing_steps"),
        ("snr_window", 1, "snr_window"),
    ],
)
@pytest.mark.parametrize("kind", KINDS)
def test_bad_options_raise(kind: str, option: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_method(kind, **{option: value})


@pytest.mark.parametrize("kind", KINDS)
def test_refuses_unsupported_models(kind: str) -> None:
    likelihood = Gaussian(noise_precision=NOISE_PRECISION)
    with_dropout = {"name": "mlp", "hidden": [8], "activation": "relu", "dropout": 0.1}
    with pytest.raises(ValueError, match="dropout"):
        make_method(kind).setup(make_problem(1, likelihood, seed=0, model_cfg=with_dropout))
    problem = make_problem(1, likelihood, seed=0)
    wrapped = dataclasses.replace(problem, model=nn.ModuleDict({"net": problem.model}))
    with pytest.raises(ValueError, match="nn.Sequential"):
        make_method(kind).setup(wrapped)
    normed = dataclasses.replace(problem, model=nn.Sequential(nn.Linear(1, 4), nn.LayerNorm(4), nn.Linear(4, 1)))
    with pytest.raises(ValueError, match="LayerNorm"):
        make_method(kind).setup(normed)


@pytest.mark.parametrize("kind", ["gmfvi", "ktied"])
def test_record_every_writes_validation_elbo_and_snr_without_moving_training(kind: str, tmp_path) -> None:
    """``record_every``: a steps.csv row after every R-th step (k-tied Fig. 6 right), drawn from its own generator,
    so the fit is the one without recording; the rows travel in the checkpoint state."""
    import pandas as pd

    from bdl_bench.errors import ConfigError

    x, y, x_val, y_val = regression_data(0)
    likelihood = Gaussian(noise_precision=NOISE_PRECISION)
    plain = make_method(kind, snr_window=2)
    fit(plain, make_problem(1, likelihood, seed=1), x, y, n_epochs=3)
    method = make_method(kind, snr_window=2, record_every=2)
    method.use_validation(x_val, y_val, tmp_path)
    fit(method, make_problem(1, likelihood, seed=1), x, y, n_epochs=3)
    assert torch.equal(method.mean, plain.mean)  # recording drew nothing from the training stream
    rows = pd.read_csv(tmp_path / "steps.csv")
    assert list(rows["step"]) == [2, 4, 6] and list(rows["snr_step"]) == [2, 4, 6]
    assert rows["val_neg_elbo"].to_numpy() == pytest.approx((rows["val_nll"] + rows["kl"]).to_numpy())
    assert (rows["grad_snr_l2"] >= 1.0).all() and {"grad_snr_median_l1", "grad_snr"} <= set(rows.columns)
    kl = float(method.kl_to_prior()) / 100
    assert rows["kl"].iloc[-1] == pytest.approx(kl, rel=1e-5)
    state = method.state_dict()
    fresh = make_method(kind, snr_window=2, record_every=2)
    fresh.setup(make_problem(1, likelihood, seed=1))
    fresh.load_state_dict(state)
    assert fresh.steps.rows == method.steps.rows
    unseen = make_method(kind, record_every=2)
    with pytest.raises(ConfigError, match="record_every needs a validation set"):
        fit(unseen, make_problem(1, likelihood, seed=1), x, y, n_epochs=1)
