"""torchvision's ConvNeXt and EfficientNet blocks as torchvision writes them (layer scale,
stochastic depth drawn per sample with ``bernoulli_``, channels-last LayerNorm between permutes,
depthwise convolutions, squeeze-excitation with in-place SiLU, ``result += input``), in small
widths so that a test runs them in seconds: models memfit was not shaped around."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .models import _divisible, perturb_batch_norms


def stochastic_depth(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """``torchvision.ops.stochastic_depth`` in "row" mode: each sample's branch dropped with
    probability ``p``, the rest scaled by 1 / (1 - p)."""
    if not training or p == 0.0:
        return x
    survival = 1.0 - p
    noise = torch.empty([x.shape[0]] + [1] * (x.ndim - 1), dtype=x.dtype, device=x.device)
    noise = noise.bernoulli_(survival)
    noise.div_(survival)
    return x * noise


class StochasticDepth(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return stochastic_depth(x, self.p, self.training)


class Permute(nn.Module):
    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.permute(x, self.dims)


class LayerNorm2d(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class CNBlock(nn.Module):
    def __init__(self, dim: int, layer_scale: float, p: float) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim, bias=True), Permute([0, 2, 3, 1]),
            nn.LayerNorm(dim, eps=1e-6), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim),
            Permute([0, 3, 1, 2]))
        self.layer_scale = nn.Parameter(torch.ones(dim, 1, 1) * layer_scale)
        self.stochastic_depth = StochasticDepth(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.layer_scale * self.block(x)
        result = self.stochastic_depth(result)
        result += x
        return result


class ConvNeXt(nn.Module):
    """torchvision's ConvNeXt: a 4x4 stem, stages of CNBlocks with downsampling between, stochastic
    depth rising linearly over the blocks; ``widths`` and ``depths`` much smaller than ConvNeXt-T's
    (96..768, 3-3-9-3). Layer scale starts at 0.5 here (torchvision: 1e-6), so that the blocks'
    branches move the output and gradients compare on real numbers."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64), depths: tuple[int, ...] = (2, 2, 2),
                 p: float = 0.2, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, widths[0], 4, 4), LayerNorm2d(widths[0], eps=1e-6))]
        total, k = sum(depths), 0
        for s, (w, d) in enumerate(zip(widths, depths, strict=True)):
            blocks = []
            for _ in range(d):
                blocks.append(CNBlock(w, 0.5, p * k / (total - 1.0)))
                k += 1
            layers.append(nn.Sequential(*blocks))
            if s + 1 < len(widths):
                layers.append(nn.Sequential(LayerNorm2d(w, eps=1e-6), nn.Conv2d(w, widths[s + 1], 2, 2)))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(LayerNorm2d(widths[-1], eps=1e-6), nn.Flatten(1),
                                        nn.Linear(widths[-1], classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.avgpool(self.features(x)))


def convnext(seed: int = 0, batch: int = 2, image: int = 64) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    return ConvNeXt(), torch.randn(batch, 3, image, image)


def _conv_bn_act(i: int, o: int, k: int, stride: int = 1, groups: int = 1, act: bool = True) -> nn.Sequential:
    """torchvision's Conv2dNormActivation as EfficientNet uses it: BatchNorm's defaults, SiLU in place."""
    layers: list[nn.Module] = [nn.Conv2d(i, o, k, stride, (k - 1) // 2, groups=groups, bias=False), nn.BatchNorm2d(o)]
    return nn.Sequential(*layers, nn.SiLU(inplace=True)) if act else nn.Sequential(*layers)


class SqueezeExcitation(nn.Module):
    """``torchvision.ops.SqueezeExcitation`` with EfficientNet's in-place SiLU and a sigmoid gate."""

    def __init__(self, c: int, squeezed: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1, self.fc2 = nn.Conv2d(c, squeezed, 1), nn.Conv2d(squeezed, c, 1)
        self.activation, self.scale_activation = nn.SiLU(inplace=True), nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x))))) * x


class MBConv(nn.Module):
    def __init__(self, expand: int, k: int, stride: int, i: int, o: int, p: float) -> None:
        super().__init__()
        expanded = _divisible(i * expand)
        layers: list[nn.Module] = [] if expanded == i else [_conv_bn_act(i, expanded, 1)]
        layers += [_conv_bn_act(expanded, expanded, k, stride, groups=expanded),
                   SqueezeExcitation(expanded, max(1, i // 4)), _conv_bn_act(expanded, o, 1, act=False)]
        self.block = nn.Sequential(*layers)
        self.stochastic_depth = StochasticDepth(p)
        self.use_res_connect = stride == 1 and i == o

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.block(x)
        if self.use_res_connect:
            result = self.stochastic_depth(result)
            result += x
        return result


# EfficientNet-B0's stages (expand, kernel, stride, in, out, layers) at a quarter of its widths
# and its first five stages
EFFICIENTNET = [(1, 3, 1, 8, 8, 1), (6, 3, 2, 8, 8, 2), (6, 5, 2, 8, 16, 2), (6, 3, 2, 16, 24, 3),
                (6, 5, 1, 24, 32, 3)]


class EfficientNet(nn.Module):
    def __init__(self, p: float = 0.2, classes: int = 10) -> None:
        super().__init__()
        total, k = sum(c[-1] for c in EFFICIENTNET), 0
        layers: list[nn.Module] = [_conv_bn_act(3, 8, 3, 2)]
        for expand, kernel, stride, i, o, n in EFFICIENTNET:
            stage = []
            for j in range(n):
                stage.append(MBConv(expand, kernel, stride if j == 0 else 1, i if j == 0 else o, o, p * k / total))
                k += 1
            layers.append(nn.Sequential(*stage))
        layers.append(_conv_bn_act(32, 128, 1))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.2, inplace=True), nn.Linear(128, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def efficientnet(seed: int = 0, batch: int = 2, image: int = 64) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    model = EfficientNet()
    perturb_batch_norms(model, seed + 1)
    return model, torch.randn(batch, 3, image, image)
