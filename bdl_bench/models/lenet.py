"""LeNet as in the DEF Laplace paper's MNIST experiments (Lee et al., 2020, Sec. 5 and App. E).

The TensorFlow MNIST tutorial network: conv 5×5×32 ("same") → ReLU → max-pool 2×2/2 → conv 5×5×64
→ ReLU → max-pool 2×2/2 → FC 1024 → ReLU → (dropout) → FC C. The first fully connected layer maps the
7·7·64 = 3136 pooled features (3137 with the bias) to 1024 units: the paper's θ₃ ∈ R^{3137×1024},
whose covariance is too large to store. Inputs are ``(N, 1, 28, 28)`` images or flattened rows (see
:func:`bdl_bench.models.cnn.image_input`).
"""

from __future__ import annotations

from torch import nn

from bdl_bench.errors import ConfigError
from bdl_bench.models import register_model
from bdl_bench.models.cnn import image_input


@register_model("lenet")
def lenet(
    *,
    in_features: int,
    out_features: int,
    image_size: int,
    channels: list[int],
    hidden: int,
    dropout: float,
) -> nn.Sequential:
    """DEF's LeNet; the paper's sizes are ``channels=[32, 64]``, ``hidden=1024``, ``image_size=28``.

    Args:
        in_features: Channels of the input images (1), or ``image_size²`` for flattened rows.
        out_features: Number of classes.
        image_size: Height = width of the input images.
        channels: Filters of the two convolutional layers.
        hidden: Units of the first fully connected layer.
        dropout: Rate of a dropout layer before the last layer (DEF's MC-dropout baseline: 0.6; 0 = none).
    """
    head, c_in = image_input(in_features, image_size, "lenet")
    if len(channels) != 2:
        raise ConfigError(f"lenet has two convolutional layers; got channels={list(channels)}")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"dropout must be in [0, 1), got {dropout}")
    c1, c2 = map(int, channels)
    size = image_size // 4
    layers: list[nn.Module] = [
        *head,
        nn.Conv2d(c_in, c1, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2, stride=2),
        nn.Conv2d(c1, c2, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2, stride=2),
        nn.Flatten(),
        nn.Linear(c2 * size * size, int(hidden)),
        nn.ReLU(),
    ]
    if dropout > 0:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(int(hidden), out_features))
    return nn.Sequential(*layers)
