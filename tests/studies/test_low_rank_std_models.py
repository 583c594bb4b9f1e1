"""The low-rank std study beyond the MLP (k-tied paper, Sec. 2.3): the CIFAR-100 LeNet, the IMDB LSTM and
ResNet-18 — which matrices it studies, that the networks it samples are the model evaluated at the sampled
parameters, and the variational-parameter count against the k-tied method's own."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.testing import assert_close

from bdl_bench.likelihoods import Bernoulli, Categorical
from bdl_bench.methods._layerwise_vi import forward_flat_params, forward_networks
from bdl_bench.methods.base import Problem
from bdl_bench.models import build_model
from bdl_bench.models.params import prior_precision_vector, unflatten
from bdl_bench.report.ktied import n_variational_params
from bdl_bench.studies.low_rank_std import MeanFieldNetwork, spectra, with_low_rank_std

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "methods"))
from _vi_helpers import make_method  # noqa: E402

TINY_CNN = {"name": "cnn_ktied", "image_size": 8, "channels": [2, 3], "hidden": 5}
TINY_LSTM = {"name": "lstm", "vocab_size": 7, "embedding_dim": 3, "hidden_size": 2}
TINY_RESNET = {"name": "resnet18", "image_size": 8, "base_width": 2, "batch_norm": False}


def _method(kind: str, model_cfg: dict, in_features: int, out_features: int, likelihood, **options: object):
    """A ``kind`` method set up on ``model_cfg`` with its stds made random (as after training)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = build_model(model_cfg, in_features=in_features, out_features=out_features)
    prior = prior_precision_vector(model, 1.0, None)
    problem = Problem(model, likelihood, n_data=50, prior_precision=prior, generator=torch.Generator().manual_seed(0))
    method = make_method(kind, **options)
    method.setup(problem)
    with torch.no_grad():
        for tensor in method.variational.values():
            tensor.add_(0.3 * torch.rand(tensor.shape, generator=torch.Generator().manual_seed(1)))
    return method


def _cnn(kind: str = "gmfvi", **options: object):
    return _method(kind, TINY_CNN, 3 * 8 * 8, 4, Categorical(), **options)


def _lstm(kind: str = "gmfvi", **options: object):
    return _method(kind, TINY_LSTM, 5, 1, Bernoulli(), **options)


def test_the_cnn_study_takes_its_dense_layers_and_with_conv_its_reshaped_kernels() -> None:
    method = _cnn()
    dense = MeanFieldNetwork.from_method(method)
    assert [(m.label, m.layer, m.shape) for m in dense.matrices] == [("dense 1", 3, (5, 12)), ("dense 2", 4, (4, 5))]
    assert not dense.dense
    both = MeanFieldNetwork.from_method(method, conv=True)
    assert [(m.label, m.shape) for m in both.matrices[:2]] == [("conv 1", (2, 3 * 5 * 5)), ("conv 2", (3, 2 * 5 * 5))]
    kernel = [m for m in method.problem.model.modules() if isinstance(m, nn.Conv2d)][0].weight
    assert_close(both.weight_means()[0], kernel.detach().flatten(1))  # C_out x C_in·kh·kw
    # the dense study leaves the convolutions' stds (all entries before dense 1's) alone; with conv they change
    params = dense.matrices[0].entries.start
    assert_close(with_low_rank_std(dense, 1).std[:params], dense.std[:params], rtol=0, atol=0)
    assert not torch.equal(with_low_rank_std(both, 1).std[:params], both.std[:params])
    assert set(spectra(both)["matrix"]) == {"conv 1", "conv 2", "dense 1", "dense 2"}


def test_the_lstm_study_takes_its_kernels_and_dense_layer_not_its_embedding() -> None:
    method = _lstm()
    net = MeanFieldNetwork.from_method(method)
    labels = [(m.label, m.shape) for m in net.matrices]
    assert labels == [("lstm weight_ih_l0", (8, 3)), ("lstm weight_hh_l0", (8, 2)), ("dense 1", (1, 2))]
    embedding = 7 * 3
    approx = with_low_rank_std(net, 1)
    assert_close(approx.std[:embedding], net.std[:embedding], rtol=0, atol=0)
    assert torch.linalg.matrix_rank(approx.weight_stds()[0].double(), rtol=1e-5) == 1


@pytest.mark.parametrize("build", [_cnn, _lstm], ids=["cnn", "lstm"])
def test_sampled_networks_are_the_model_at_the_sampled_parameters(build) -> None:
    method = build()
    net = MeanFieldNetwork.from_method(method)
    g = torch.Generator().manual_seed(2)
    thetas = net.mean + net.std * torch.randn(3, net.mean.numel(), generator=g)
    if any(isinstance(m, nn.LSTM) for m in method.problem.model.modules()):
        x = torch.randint(1, 7, (5, 4), generator=g)  # token ids
    else:
        x = torch.randn(5, 3 * 8 * 8, generator=g)
    model = net.model
    explicit = torch.stack([functional_call(model, unflatten(model, theta), (x,)) for theta in thetas])
    assert_close(net.outputs(thetas, x), explicit)


def test_the_dense_path_and_the_generic_one_agree_on_an_mlp() -> None:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 2))
    thetas = torch.randn(4, sum(p.numel() for p in model.parameters()), generator=torch.Generator().manual_seed(0))
    x = torch.randn(7, 3, generator=torch.Generator().manual_seed(1))
    assert_close(forward_networks(model, thetas, x, dense=False), forward_flat_params(model, thetas, x))


@pytest.mark.parametrize(
    ("build", "tie_conv"), [(_cnn, False), (_cnn, True), (_lstm, False)], ids=["cnn", "cnn_tied_conv", "lstm"]
)
@pytest.mark.parametrize("k", [1, 2])
def test_the_variational_parameter_count_is_the_ktied_methods_own(build, tie_conv: bool, k: int) -> None:
    """Table 1's count from the study's matrices equals what the k-tied method optimises; mean field is 2D."""
    options = {"tie_conv": tie_conv} if build is _cnn else {}
    tied = build("ktied", k=k, **options)
    net = MeanFieldNetwork.from_method(tied, conv=tie_conv)
    assert n_variational_params(net, k) == tied.n_variational_params()
    mean_field = build("gmfvi")
    assert n_variational_params(MeanFieldNetwork.from_method(mean_field), None) == mean_field.n_variational_params()


def test_resnet18_without_batch_norm_is_studied_with_its_convolutions() -> None:
    method = _method("gmfvi", TINY_RESNET, 3 * 8 * 8, 10, Categorical())
    net = MeanFieldNetwork.from_method(method, conv=True)
    labels = [m.label for m in net.matrices]
    assert labels[-1] == "dense 1" and sum(label.startswith("conv") for label in labels) == 20
    x = torch.randn(3, 3 * 8 * 8, generator=torch.Generator().manual_seed(0))
    thetas = net.mean.unsqueeze(0)
    assert_close(net.outputs(thetas, x)[0], functional_call(net.model, unflatten(net.model, net.mean), (x,)))
