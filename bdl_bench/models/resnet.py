"""ResNet-18, CIFAR variant (He et al., 2016; the k-tied paper's CIFAR-10 model, Swiatkowski et al., 2020).

For 32×32 inputs the ImageNet stem (7×7 stride-2 convolution and max-pool) is replaced by one 3×3
stride-1 convolution; then four stages of two basic blocks (3×3 conv → BN → ReLU → 3×3 conv → BN,
plus the identity or a 1×1 stride-2 projection) with 64, 128, 256, 512 channels, strides 1, 2, 2, 2;
global average pooling and a linear layer. 11.2M parameters at ``base_width = 64``.
``batch_norm=false`` drops the normalisation layers (the default of ``conf/model/resnet18.yaml``: runs refuse batch
normalisation, whose batch statistics no method here replaces by running ones at prediction).
"""

from __future__ import annotations

from torch import Tensor, nn

from bdl_bench.errors import ConfigError
from bdl_bench.models import register_model
from bdl_bench.models.cnn import image_input


def _norm(channels: int, batch_norm: bool) -> nn.Module:
    return nn.BatchNorm2d(channels) if batch_norm else nn.Identity()


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with a residual connection (He et al., 2016, Fig. 2)."""

    def __init__(self, c_in: int, c_out: int, stride: int, batch_norm: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=not batch_norm)
        self.bn1 = _norm(c_out, batch_norm)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=not batch_norm)
        self.bn2 = _norm(c_out, batch_norm)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=not batch_norm), _norm(c_out, batch_norm)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for small images (module docstring)."""

    def __init__(self, *, in_channels: int, out_features: int, base_width: int, batch_norm: bool) -> None:
        super().__init__()
        widths = [base_width, 2 * base_width, 4 * base_width, 8 * base_width]
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, base_width, 3, padding=1, bias=not batch_norm),
            _norm(base_width, batch_norm),
            nn.ReLU(),
        )
        blocks: list[nn.Module] = []
        c_in = base_width
        for i, width in enumerate(widths):
            stride = 1 if i == 0 else 2
            blocks += [BasicBlock(c_in, width, stride, batch_norm), BasicBlock(width, width, 1, batch_norm)]
            c_in = width
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, out_features)

    def forward(self, x: Tensor) -> Tensor:
        out = self.blocks(self.stem(x))
        return self.fc(self.pool(out).flatten(1))


@register_model("resnet18")
def resnet18(*, in_features: int, out_features: int, image_size: int, base_width: int, batch_norm: bool) -> nn.Module:
    """ResNet-18 (CIFAR variant) for ``(N, C, image_size, image_size)`` images or flattened rows; ``base_width``:
    channels of the first stage (64 in ResNet-18; smaller for tests)."""
    head, channels = image_input(in_features, image_size, "resnet18")
    if int(base_width) < 1:
        raise ConfigError(f"resnet18: base_width must be positive, got {base_width}")
    net = ResNet18(in_channels=channels, out_features=out_features, base_width=int(base_width), batch_norm=batch_norm)
    return nn.Sequential(*head, net) if head else net
