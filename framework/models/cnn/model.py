"""A small convolutional classifier for 8x8 grey images (the digits recipe): the shape of the
FSDP-on-MNIST tutorial's network, scaled to the image size.

    conv 3x3 (1 -> c) + ReLU             8x8
    conv 3x3 (c -> 2c) + ReLU + maxpool  4x4      <- two convolutional blocks, each a sharding unit
    flatten, linear (2c*16 -> h) + ReLU, dropout  <- the classifier block, a sharding unit
    linear (h -> classes)                         <- the root's own parameters

A plain nn.Module with no parallel code; `blocks` lists the sharding units.
"""

from __future__ import annotations

import torch
from torch import nn


class ConvBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, pool: bool):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1)
        self.pool = nn.MaxPool2d(2) if pool else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(torch.relu(self.conv(x)))


class ClassifierBlock(nn.Module):
    def __init__(self, in_features: int, hidden: int, dropout: float):
        super().__init__()
        self.fc = nn.Linear(in_features, hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(torch.relu(self.fc(x.flatten(1))))


class DigitsCNN(nn.Module):
    def __init__(
        self, channels: int = 32, hidden: int = 128, num_classes: int = 10, image_size: int = 8, dropout: float = 0.1
    ):
        super().__init__()
        pooled = image_size // 2
        self.layers = nn.ModuleList(
            [
                ConvBlock(1, channels, pool=False),
                ConvBlock(channels, 2 * channels, pool=True),
                ClassifierBlock(2 * channels * pooled * pooled, hidden, dropout),
            ]
        )
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = images
        for block in self.layers:
            h = block(h)
        return self.head(h)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Kaiming-uniform weights (ReLU gain) and zero biases, drawn from `seed` when given."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                fan_in = module.weight[0].numel()
                bound = (6.0 / fan_in) ** 0.5
                if gen is not None and module.weight.device.type == "cpu":
                    module.weight.copy_(torch.rand(module.weight.shape, generator=gen) * 2 * bound - bound)
                else:
                    nn.init.uniform_(module.weight, -bound, bound)
                nn.init.zeros_(module.bias)

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int = 0) -> float:
        """Training FLOPs per sample (one image is this model's "token"): 6 x multiply-adds."""
        macs = 0
        size = 8
        for block in self.layers:
            if isinstance(block, ConvBlock):
                macs += block.conv.weight.numel() * size * size
                if isinstance(block.pool, nn.MaxPool2d):
                    size //= 2
            else:
                macs += block.fc.weight.numel()
        macs += self.head.weight.numel()
        return 6.0 * macs
