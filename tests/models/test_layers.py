"""The one walk over a model's layers (``params.param_layers``) and what reads it agree with the flat vector.

For every model of ``conf/model`` (shrunk): each layer's slices are where ``unflatten`` (the order
``forward_with`` evaluates) puts its parameters; the layouts of the per-example factors (SLANG, VOGN), of the
Kronecker curvature (Laplace) and the layer table of the layer-wise VI methods locate the same entries, or
refuse the model, as before.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from bdl_bench.curvature.per_example import linear_layout
from bdl_bench.curvature.pseudo_grads import kron_layout
from bdl_bench.methods._layerwise_vi import forward_flat_params, model_layers
from bdl_bench.models import build_model
from bdl_bench.models.params import forward_with, n_params, param_layers, unflatten

CONF_MODELS = sorted((Path(__file__).parents[2] / "conf" / "model").glob("*.yaml"))
SMALL = {"image_size": 8, "vocab_size": 30, "embedding_dim": 4, "hidden_size": 5, "base_width": 2}
LINEAR_LAYOUT = {"logreg", "mlp"}  # the nn.Sequential models of nn.Linear layers only
KRON_LAYOUT = {"cnn_def", "cnn_ktied", "lenet", "logreg", "mlp"}  # ... of nn.Linear and nn.Conv2d layers


def _model(path: Path) -> tuple[str, nn.Module]:
    cfg = yaml.safe_load(path.read_text())
    cfg.update({k: v for k, v in SMALL.items() if k in cfg})
    if "hidden" in cfg:
        cfg["hidden"] = [6] * len(cfg["hidden"]) if isinstance(cfg["hidden"], list) else 6
    if isinstance(cfg.get("channels"), list):
        cfg["channels"] = [3] * len(cfg["channels"])
    elif "channels" in cfg:
        cfg["channels"] = 3
    torch.manual_seed(0)
    return cfg["name"], build_model(cfg, in_features=1 if "image_size" in cfg else 4, out_features=3).double()


@pytest.fixture(params=CONF_MODELS, ids=[p.stem for p in CONF_MODELS])
def named_model(request: pytest.FixtureRequest) -> tuple[str, nn.Module, torch.Tensor]:
    name, model = _model(request.param)
    return name, model, torch.arange(n_params(model), dtype=torch.float64)  # entry i holds i


def test_param_layers_are_where_unflatten_puts_the_parameters(named_model: tuple) -> None:
    """Every parameter once, in the flat order, at the entries (and position) ``unflatten`` gives it."""
    _, model, theta = named_model
    views = unflatten(model, theta)
    params = list(model.parameters())
    seen = []
    for layer in param_layers(model):
        for pname, part in layer.slices.items():
            qualified = f"{layer.name}.{pname}" if layer.name else pname
            assert torch.equal(theta[part].view_as(views[qualified]), views[qualified]), qualified
            assert params[layer.positions[pname]] is getattr(layer.module, pname)
            seen.append(part)
    assert [(s.start, s.stop) for s in seen] == [
        (v.storage_offset(), v.storage_offset() + v.numel()) for v in views.values()
    ]


def test_the_layouts_read_the_same_entries(named_model: tuple) -> None:
    """The per-example and Kronecker layouts find each weight layer's weight and bias where ``unflatten`` does
    (a child of the nn.Sequential at ``module_index``), or refuse a model they do not handle."""
    name, model, theta = named_model
    views = unflatten(model, theta)
    for build, accepted in ((linear_layout, LINEAR_LAYOUT), (kron_layout, KRON_LAYOUT)):
        if name not in accepted:
            with pytest.raises(ValueError):
                build(model)
            continue
        layout = build(model)
        assert layout.n_params == theta.numel()
        weighted = [str(i) for i, m in enumerate(model) if any(True for _ in m.parameters())]
        assert [str(slot.module_index) for slot in layout.slots] == weighted
        for slot in layout.slots:
            weight = views[f"{slot.module_index}.weight"]
            assert torch.equal(theta[slot.weight_slice], weight.reshape(-1))
            bias = views.get(f"{slot.module_index}.bias")
            assert (slot.bias_slice is None) == (bias is None)
            if bias is not None:
                assert torch.equal(theta[slot.bias_slice], bias)


def test_the_layerwise_vi_layer_table_reads_the_same_entries(named_model: tuple) -> None:
    """``model_layers`` (gmfvi, ktied, elrg) lists the modules with parameters, their positions and slices."""
    _, model, theta = named_model
    kinds = tuple({type(layer.module) for layer in param_layers(model)})
    try:
        layers = model_layers(model, "test", kinds)
    except ValueError as err:  # a model with dropout (which the VI methods refuse) or without a forward
        pytest.skip(str(err))
    views = unflatten(model, theta)
    assert [layer.index for layer in layers] == list(range(1, len(layers) + 1))
    for layer in layers:
        for pname, part in layer.slices.items():
            assert torch.equal(theta[part], views[f"{layer.name}.{pname}"].reshape(-1))
            assert list(model.parameters())[layer.params[pname]] is getattr(layer.module, pname)


def test_forward_flat_params_is_forward_with(named_model: tuple) -> None:
    """The batched forward of the dense networks at S parameter vectors equals ``forward_with`` at each."""
    name, model, theta = named_model
    if name not in LINEAR_LAYOUT:
        pytest.skip("forward_flat_params: nn.Sequential of nn.Linear layers")
    thetas = torch.randn(3, theta.numel(), generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got = forward_flat_params(model, thetas, x)
    torch.testing.assert_close(got, torch.stack([forward_with(model, t, x) for t in thetas]))
