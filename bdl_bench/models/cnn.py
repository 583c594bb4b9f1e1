"""Small convolutional networks of the DEF and k-tied papers, and the image-input convention.

Convention for every image model: ``in_features`` is what the runner passes (``dataset.n_features``,
i.e. ``x.shape[1]``): the number of channels C for ``(N, C, H, W)`` images, or ``C·H·W`` for
flattened rows, which the model then unflattens itself (so ``data.flatten=true`` also works).

- ``cnn_def`` — DEF Laplace's CIFAR-10 network (Lee et al., 2020, App. E; the TensorFlow CIFAR-10
  tutorial): conv 5×5×64 → ReLU → max-pool 3×3/2 → LRN → conv 5×5×64 → ReLU → LRN → max-pool 3×3/2
  → FC 384 → FC 192 → FC C ("2 conv + 3 FC"). TensorFlow's ``lrn(depth_radius=4, bias=1,
  alpha=0.001/9, beta=0.75)`` is ``nn.LocalResponseNorm(9, alpha=0.001, beta=0.75, k=1)`` (PyTorch
  divides ``alpha`` by the window size).
- ``lenet`` — DEF Laplace's MNIST network (Lee et al., 2020, Sec. 5 and App. E; the TensorFlow MNIST
  tutorial): conv 5×5×32 ("same") → ReLU → max-pool 2×2/2 → conv 5×5×64 → ReLU → max-pool 2×2/2 → FC 1024
  → ReLU → (dropout) → FC C. The first fully connected layer maps the 7·7·64 = 3136 pooled features (3137
  with the bias) to 1024 units: the paper's θ₃ ∈ R^{3137×1024}, whose covariance is too large to store.
- ``cnn_ktied`` — the k-tied paper's "LeNet with 2 convolutional and 2 dense layers" for CIFAR-100
  (Swiatkowski et al., 2020, Sec. 2.3): conv 5×5×32 → ReLU → max-pool 2 → conv 5×5×64 → ReLU →
  max-pool 2 → FC 512 → FC C. The widths are not printed in the paper; these reproduce its Table 3
  parameter counts exactly up to rounding: 2,202,660 weights, so 4,405k mean-field parameters
  (2 per weight) and 2,262k for 1-tied dense layers. The same layers as ``lenet``, without dropout.
"""

from __future__ import annotations

from torch import nn

from bdl_bench.errors import ConfigError
from bdl_bench.models import register_model


def image_input(in_features: int, image_size: int, model: str, max_channels: int = 4) -> tuple[list[nn.Module], int]:
    """Leading modules and the channel count for an image model (see module docstring): ``([nn.Unflatten(...)],
    C)`` for flattened input of ``C·image_size²`` features, ``([], C)`` for ``in_features = C`` channels."""
    pixels = image_size * image_size
    if 1 <= in_features <= max_channels:
        return [], in_features
    if in_features % pixels == 0 and 1 <= in_features // pixels <= max_channels:
        channels = in_features // pixels
        return [nn.Unflatten(1, (channels, image_size, image_size))], channels
    raise ConfigError(
        f"model {model!r} needs images (N, C, {image_size}, {image_size}) or rows of C*{pixels} features; "
        f"got in_features={in_features} (set data.flatten=false, or check model.image_size)"
    )


def _pooled(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


@register_model("cnn_def")
def cnn_def(
    *,
    in_features: int,
    out_features: int,
    image_size: int,
    channels: int,
    hidden: list[int],
    local_response_norm: bool,
    dropout: float = 0.0,
) -> nn.Sequential:
    """DEF's CIFAR-10 CNN (module docstring); ``channels`` = 64 and ``hidden`` = [384, 192] in the paper. ``dropout``
    before the last layer, as ``lenet``'s (the MC-dropout column; the paper does not say where it drops on CIFAR-10)."""
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"dropout must be in [0, 1), got {dropout}")
    head, c_in = image_input(in_features, image_size, "cnn_def")
    size = _pooled(_pooled(image_size, 3, 2, 1), 3, 2, 1)  # 32 → 16 → 8 (TensorFlow "SAME" pooling)

    def lrn() -> list[nn.Module]:
        return [nn.LocalResponseNorm(9, alpha=0.001, beta=0.75, k=1.0)] if local_response_norm else []

    layers: list[nn.Module] = [
        *head,
        nn.Conv2d(c_in, channels, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
        *lrn(),
        nn.Conv2d(channels, channels, 5, padding=2),
        nn.ReLU(),
        *lrn(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Flatten(),
    ]
    widths = [channels * size * size, *map(int, hidden)]
    for w_in, w_out in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(w_in, w_out), nn.ReLU()]
    layers += [*([nn.Dropout(dropout)] if dropout > 0 else []), nn.Linear(widths[-1], out_features)]
    return nn.Sequential(*layers)


def _lenet(
    name: str, in_features: int, out_features: int, image_size: int, channels: list[int], hidden: int, dropout: float
) -> nn.Sequential:
    head, c_in = image_input(in_features, image_size, name)
    if len(channels) != 2:
        raise ConfigError(f"{name} has two convolutional layers; got channels={list(channels)}")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"dropout must be in [0, 1), got {dropout}")
    c1, c2 = map(int, channels)
    size = image_size // 4
    return nn.Sequential(
        *head,
        nn.Conv2d(c_in, c1, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(c2 * size * size, int(hidden)),
        nn.ReLU(),
        *([nn.Dropout(dropout)] if dropout > 0 else []),
        nn.Linear(int(hidden), out_features),
    )


@register_model("lenet")
def lenet(
    *, in_features: int, out_features: int, image_size: int, channels: list[int], hidden: int, dropout: float
) -> nn.Sequential:
    """DEF's LeNet (module docstring): ``channels=[32, 64]``, ``hidden=1024``, ``image_size=28`` in the paper;
    ``dropout`` before the last layer (DEF's MC-dropout baseline: 0.6; 0 = none)."""
    return _lenet("lenet", in_features, out_features, image_size, channels, hidden, dropout)


@register_model("cnn_ktied")
def cnn_ktied(
    *, in_features: int, out_features: int, image_size: int, channels: list[int], hidden: int
) -> nn.Sequential:
    """The k-tied CIFAR-100 LeNet (module docstring); ``channels`` = [32, 64], ``hidden`` = 512."""
    return _lenet("cnn_ktied", in_features, out_features, image_size, channels, hidden, 0.0)
