"""LeNet, the DEF and k-tied CNNs, the IMDB LSTM and ResNet-18: shapes forward and backward, sizes, configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from bdl_bench.models import MODELS, build_model
from bdl_bench.models.params import n_params

CONF_MODEL = Path(__file__).resolve().parents[2] / "conf" / "model"


def _check_forward_backward(model: torch.nn.Module, x: torch.Tensor, out_features: int) -> None:
    out = model(x)
    assert out.shape == (x.shape[0], out_features) and out.dtype == torch.float32
    out.square().sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name
        assert torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("flat", [False, True], ids=["images", "flattened"])
def test_lenet_shapes_and_the_3137_by_1024_layer(generator: torch.Generator, flat: bool) -> None:
    cfg = {"name": "lenet", "image_size": 28, "channels": [32, 64], "hidden": 1024, "dropout": 0.0}
    model = build_model(cfg, in_features=784 if flat else 1, out_features=10)
    x = torch.rand(3, 784 if flat else 1, *(() if flat else (28, 28)), generator=generator)
    _check_forward_backward(model, x, 10)
    fc = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][0]
    assert (fc.in_features + 1, fc.out_features) == (3137, 1024)  # DEF's theta_3, bias included


def test_cnn_def_shapes(generator: torch.Generator) -> None:
    cfg = {"name": "cnn_def", "image_size": 32, "channels": 64, "hidden": [384, 192], "local_response_norm": True}
    model = build_model(cfg, in_features=3, out_features=10)
    _check_forward_backward(model, torch.randn(2, 3, 32, 32, generator=generator), 10)
    widths = [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert widths == [(4096, 384), (384, 192), (192, 10)]  # 2 conv + 3 FC
    assert sum(isinstance(m, torch.nn.Conv2d) for m in model.modules()) == 2


def test_cnn_ktied_matches_the_paper_parameter_count(generator: torch.Generator) -> None:
    cfg = {"name": "cnn_ktied", "image_size": 32, "channels": [32, 64], "hidden": 512}
    model = build_model(cfg, in_features=3, out_features=100)
    _check_forward_backward(model, torch.randn(2, 3, 32, 32, generator=generator), 100)
    assert round(2 * n_params(model) / 1000) == 4405  # k-tied Table 3: 4,405k mean-field parameters


def test_lstm_shapes_and_paper_parameter_count(generator: torch.Generator) -> None:
    cfg = {"name": "lstm", "vocab_size": 50, "embedding_dim": 8, "hidden_size": 6}
    model = build_model(cfg, in_features=12, out_features=1)
    tokens = torch.randint(0, 50, (4, 12), generator=generator)
    tokens[0, :5] = 0  # front padding
    _check_forward_backward(model, tokens, 1)
    paper = build_model(
        {**cfg, "vocab_size": 10000, "embedding_dim": 128, "hidden_size": 128}, in_features=200, out_features=1
    )
    # k-tied Table 3: 2,823k mean-field parameters; PyTorch's LSTM has two bias vectors (Keras one): +2 x 512.
    assert 2 * n_params(paper) - 2 * 512 == pytest.approx(2_823_000, abs=500)


@pytest.mark.parametrize("batch_norm", [True, False])
def test_resnet18_shapes(generator: torch.Generator, batch_norm: bool) -> None:
    cfg = {"name": "resnet18", "image_size": 32, "base_width": 4, "batch_norm": batch_norm}
    model = build_model(cfg, in_features=3, out_features=10)
    _check_forward_backward(model, torch.randn(2, 3, 32, 32, generator=generator), 10)
    model.eval()
    assert model(torch.randn(1, 3, 32, 32, generator=generator)).shape == (1, 10)
    n_conv = sum(isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3) for m in model.modules())
    assert n_conv == 17  # stem + 8 blocks x 2: with the linear layer, the 18 of ResNet-18


def test_resnet18_full_size() -> None:
    model = build_model(
        {"name": "resnet18", "image_size": 32, "base_width": 64, "batch_norm": True}, in_features=3, out_features=10
    )
    assert 11.1e6 < n_params(model) < 11.2e6


def test_image_models_refuse_non_image_input() -> None:
    with pytest.raises(ValueError, match=r"needs images \(N, C, 28, 28\).*in_features=13"):
        build_model(
            {"name": "lenet", "image_size": 28, "channels": [32, 64], "hidden": 8, "dropout": 0.0},
            in_features=13,
            out_features=2,
        )


@pytest.mark.parametrize("name", ["lenet", "cnn_def", "cnn_ktied", "lstm", "resnet18"])
def test_yaml_keys_match_the_builder(name: str) -> None:
    import inspect

    build_model({"name": "mlp", "hidden": [2], "activation": "relu"}, in_features=1, out_features=1)  # registers all
    cfg = OmegaConf.load(CONF_MODEL / f"{name}.yaml")
    assert cfg.name == name
    params = set(inspect.signature(MODELS[name]).parameters) - {"in_features", "out_features"}
    assert set(cfg) - {"name"} == params
