"""Logistic regression and fully connected networks built only from ``nn.Linear`` layers.

Both are ``nn.Sequential`` of ``nn.Linear`` and activation modules, so per-example gradient code
(``bdl_bench.curvature``) can find every weight layer with ``isinstance(m, nn.Linear)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from bdl_bench.errors import ConfigError
from bdl_bench.models import register_model
from bdl_bench.registry import lookup

ACTIVATIONS: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "elu": nn.ELU}


@register_model("logreg")
def logistic_regression(*, in_features: int, out_features: int, bias: bool) -> nn.Sequential:
    """A single linear layer: logits of a Bernoulli/categorical likelihood."""
    return nn.Sequential(nn.Linear(in_features, out_features, bias=bias))


@register_model("mlp")
def mlp(
    *, in_features: int, out_features: int, hidden: Sequence[int], activation: str, dropout: float = 0.0
) -> nn.Sequential:
    """``in → hidden[0] → … → out`` with ``activation`` between layers; ``dropout > 0`` inserts ``nn.Dropout``
    before every linear layer but the first (MC dropout methods set the rate; others leave it at 0)."""
    nonlinearity = lookup(ACTIVATIONS, activation, "activation")
    if any(int(h) < 1 for h in hidden):
        raise ConfigError(f"hidden widths must be positive, got {list(hidden)}")
    widths = [in_features, *map(int, hidden), out_features]
    layers: list[nn.Module] = []
    for i, (w_in, w_out) in enumerate(zip(widths[:-1], widths[1:])):
        if i > 0:
            layers.append(nonlinearity())
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(w_in, w_out))
    return nn.Sequential(*layers)
