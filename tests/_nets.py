"""Tiny float64 networks shared by the curvature tests (importable from any test module: tests/ is on sys.path)."""

from __future__ import annotations

from torch import nn


def small_net(arch: str, n_out: int) -> nn.Module:
    """``mlp`` (3 -> 4 -> n_out), ``cnn-t1`` (a 5x5 convolution with one output position, then a linear layer) or
    any other name: 1 x 5 x 5 images through a padded 3x3 conv, a strided 2x2 conv without bias, a linear layer."""
    if arch == "mlp":
        return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, n_out)).double()
    if arch == "cnn-t1":  # a convolution with one output position (T = 1), then a linear layer
        return nn.Sequential(
            nn.Unflatten(1, (1, 5, 5)), nn.Conv2d(1, 3, 5), nn.Tanh(), nn.Flatten(), nn.Linear(3, n_out)
        ).double()
    # 1 x 5 x 5 images: a padded 3x3 conv, a strided 2x2 conv without bias, then a linear layer.
    return nn.Sequential(
        nn.Unflatten(1, (1, 5, 5)),
        nn.Conv2d(1, 2, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(2, 3, 2, stride=2, bias=False),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(12, n_out),
    ).double()
