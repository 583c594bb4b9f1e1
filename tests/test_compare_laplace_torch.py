"""``scripts/compare_laplace_torch.py`` hands laplace-torch an ``nn.Sequential`` twin of our MLP: the same θ must
give the same outputs (laplace-torch itself is not a dependency, so only the twin is tested here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from bdl_bench.models import build_model
from bdl_bench.models.params import forward_with

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compare_laplace_torch.py"


def load_script():
    spec = importlib.util.spec_from_file_location("compare_laplace_torch", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("hidden, activation", [([50], "relu"), ([7, 5], "tanh")])
def test_the_twin_computes_our_mlp_at_the_same_theta(hidden: list[int], activation: str) -> None:
    script = load_script()
    torch.manual_seed(0)
    ours = build_model({"name": "mlp", "hidden": hidden, "activation": activation}, in_features=13, out_features=1)
    theta = torch.randn(sum(p.numel() for p in ours.parameters()))
    twin = script.mlp_twin(13, hidden, activation)
    nn.utils.vector_to_parameters(theta, twin.parameters())
    x = torch.randn(9, 13)
    torch.testing.assert_close(twin(x), forward_with(ours, theta, x))
