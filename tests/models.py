"""Models written as users have them, for the tests that check memfit against them: a
torchvision-style ResNet (its BasicBlock and Bottleneck as torchvision writes them:
BatchNorm, ``out += identity``, ``ReLU(inplace=True)``; torchvision itself does not install
beside the CPU torch here), its Hugging Face twin from a config, and a LayerDrop-style net that
leaves its loop early, and torchvision's MobileNetV3-Small (hardswish, squeeze-excitation with
hardsigmoid, in-place activations) as torchvision writes it; a loop that adds each block's output
itself (``x = x + block(x)``) and a DDPM-style U-Net with skip concatenations, as users write
them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class ResNet(nn.Module):
    """torchvision's ResNet layout, narrow: stem, four stages, pooled head."""

    def __init__(self, block: type[BasicBlock | Bottleneck], layers: list[int], width: int = 8,
                 classes: int = 10) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(block, width, layers[0])
        self.layer2 = self._make_layer(block, 2 * width, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 4 * width, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 8 * width, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * width * block.expansion, classes)

    def _make_layer(self, block: type[BasicBlock | Bottleneck], planes: int, blocks: int,
                    stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes * block.expansion, 1, stride, bias=False),
                                       nn.BatchNorm2d(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def perturb_batch_norms(model: nn.Module, seed: int = 1) -> None:
    """BatchNorm scales and shifts away from their 1 and 0 (timm starts the last scale of a block
    at 0, which hides a wrong recomputation of the residual sum until it has trained)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.copy_(0.5 + torch.rand(m.weight.shape, generator=g))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=g))


def resnet18ish(seed: int = 0, batch: int = 4, image: int = 32) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    model = ResNet(BasicBlock, [2, 2, 2, 2])
    perturb_batch_norms(model, seed + 1)
    return model, torch.randn(batch, 3, image, image)


def resnet50ish(seed: int = 0, batch: int = 2, image: int = 32) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    model = ResNet(Bottleneck, [1, 2, 1, 1], width=4)
    perturb_batch_norms(model, seed + 1)
    return model, torch.randn(batch, 3, image, image)


def hf_resnet(seed: int = 0, batch: int = 4, image: int = 32) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Hugging Face's ResNet from a config (its layers also end in ``hidden_state += residual``)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 32, 64], depths=[2, 2, 2, 2],
                                       layer_type="basic", num_labels=10)
    model = transformers.ResNetForImageClassification(config)
    perturb_batch_norms(model, seed + 1)
    return model, {"pixel_values": torch.randn(batch, 3, image, image), "labels": torch.randint(0, 10, (batch,))}


class DropBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.relu(self.fc1(self.ln(x)))))


class LayerDropNet(nn.Module):
    """Blocks in a loop that a forward may leave early (``depth``) or skip (``skip``), as
    LayerDrop and early-exit models do; ops between blocks (``scale``) feed the next block
    something other than the previous block's output."""

    def __init__(self, d: int = 32, n: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(DropBlock(d) for _ in range(n))
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor, depth: int | None = None, skip: tuple[int, ...] = (),
                scale: tuple[int, ...] = ()) -> torch.Tensor:
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            if depth is not None and i == depth:
                break
            if i in skip:
                continue
            h = block(h)
            if i in scale:
                h = h * 0.5 + 1.0
        return self.head(h)


def _conv_bn(i: int, o: int, k: int, stride: int, groups: int = 1, act: type[nn.Module] | None = nn.Hardswish,
             ) -> nn.Sequential:
    """torchvision's Conv2dNormActivation: conv, BatchNorm (eps 1e-3, momentum 0.01), an in-place activation."""
    layers: list[nn.Module] = [nn.Conv2d(i, o, k, stride, (k - 1) // 2, groups=groups, bias=False),
                               nn.BatchNorm2d(o, eps=0.001, momentum=0.01)]
    return nn.Sequential(*layers, act(inplace=True)) if act is not None else nn.Sequential(*layers)


def _divisible(v: float) -> int:
    n = max(8, int(v + 4) // 8 * 8)
    return n + 8 if n < 0.9 * v else n


class SqueezeExcitation(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        squeezed = _divisible(c // 4)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1, self.fc2 = nn.Conv2d(c, squeezed, 1), nn.Conv2d(squeezed, c, 1)
        self.activation, self.scale_activation = nn.ReLU(), nn.Hardsigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x))))) * x


class InvertedResidual(nn.Module):
    def __init__(self, i: int, k: int, expanded: int, o: int, se: bool, hardswish: bool, stride: int) -> None:
        super().__init__()
        act = nn.Hardswish if hardswish else nn.ReLU
        layers: list[nn.Module] = [] if expanded == i else [_conv_bn(i, expanded, 1, 1, act=act)]
        layers.append(_conv_bn(expanded, expanded, k, stride, groups=expanded, act=act))
        if se:
            layers.append(SqueezeExcitation(expanded))
        layers.append(_conv_bn(expanded, o, 1, 1, act=None))
        self.block = nn.Sequential(*layers)
        self.use_res_connect = stride == 1 and i == o

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.block(x)
        if self.use_res_connect:
            result += x
        return result


# torchvision's mobilenet_v3_small: (in, kernel, expanded, out, SE, hardswish, stride)
MOBILENET_V3_SMALL = [(16, 3, 16, 16, True, False, 2), (16, 3, 72, 24, False, False, 2),
                      (24, 3, 88, 24, False, False, 1), (24, 5, 96, 40, True, True, 2),
                      (40, 5, 240, 40, True, True, 1), (40, 5, 240, 40, True, True, 1),
                      (40, 5, 120, 48, True, True, 1), (48, 5, 144, 48, True, True, 1),
                      (48, 5, 288, 96, True, True, 2), (96, 5, 576, 96, True, True, 1),
                      (96, 5, 576, 96, True, True, 1)]


class MobileNetV3Small(nn.Module):
    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.features = nn.Sequential(_conv_bn(3, 16, 3, 2), *[InvertedResidual(*c) for c in MOBILENET_V3_SMALL],
                                      _conv_bn(96, 576, 1, 1))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(576, 1024), nn.Hardswish(inplace=True),
                                        nn.Dropout(0.2, inplace=True), nn.Linear(1024, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def mobilenet_v3_small(seed: int = 0, batch: int = 4, image: int = 64) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    model = MobileNetV3Small()
    perturb_batch_norms(model, seed + 1)
    return model, torch.randn(batch, 3, image, image)


class ResidualOutside(nn.Module):
    """Blocks whose residual add the model's own loop does (``x = x + block(x)``), each block
    ending in a ReLU that saves its output; with ``shared``, every block also takes a tensor the
    model makes before the loop and no block saves (a bias, as attention masks are passed)."""

    def __init__(self, width: int = 16, depth: int = 4, shared: bool = False) -> None:
        super().__init__()
        self.shared = shared
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.ModuleList(ConvReLU(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.stem(pixel_values)
        bias = torch.full_like(x, 0.5) if self.shared else None
        for block in self.blocks:
            x = x + block(x, bias)
        return self.head(x.mean((2, 3)))


class ConvReLU(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.conv(x)
        return torch.relu(y if bias is None else y + bias)


def residual_outside(shared: bool = False, seed: int = 0, batch: int = 4,
                     image: int = 32) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    return ResidualOutside(shared=shared), {"pixel_values": torch.randn(batch, 3, image, image)}


class TimeResBlock(nn.Module):
    """A DDPM U-Net's residual block: GroupNorm, SiLU, the time embedding added, a 1x1 skip."""

    def __init__(self, cin: int, cout: int, tdim: int) -> None:
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(4, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.t = nn.Linear(tdim, cout)
        self.n2, self.c2 = nn.GroupNorm(4, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.c1(F.silu(self.n1(x)))
        h = h + self.t(F.silu(temb))[:, :, None, None]
        h = self.c2(F.silu(self.n2(h)))
        return self.skip(x) + h

class DDPMUNet(nn.Module):
    """A small DDPM-style U-Net as diffusion users write it: sinusoidal time embedding made in
    forward, skip tensors kept in a list and concatenated on the way up."""

    def __init__(self, ch: int = 16, tdim: int = 32) -> None:
        super().__init__()
        self.tdim = tdim
        self.temb = nn.Sequential(nn.Linear(tdim, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.inc = nn.Conv2d(3, ch, 3, padding=1)
        self.down = nn.ModuleList([TimeResBlock(ch, ch, tdim), TimeResBlock(ch, 2 * ch, tdim)])
        self.mid = TimeResBlock(2 * ch, 2 * ch, tdim)
        self.up = nn.ModuleList([TimeResBlock(4 * ch, ch, tdim), TimeResBlock(2 * ch, ch, tdim)])
        self.out = nn.Conv2d(ch, 3, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        half = self.tdim // 2
        freqs = torch.exp(-torch.arange(half, dtype=torch.float32) / half)
        e = torch.cat([torch.sin(t[:, None] * freqs), torch.cos(t[:, None] * freqs)], 1)
        temb = self.temb(e)
        h = self.inc(x)
        hs: list[torch.Tensor] = []
        for i, b in enumerate(self.down):
            h = b(h, temb)
            hs.append(h)
            if i == 0:
                h = F.avg_pool2d(h, 2)
        h = self.mid(h, temb)
        for i, b in enumerate(self.up):
            h = b(torch.cat([h, hs.pop()], 1), temb)
            if i == 0:
                h = F.interpolate(h, scale_factor=2)
        return self.out(h)


def ddpm_unet(seed: int = 0, batch: int = 4, image: int = 32) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    return DDPMUNet(), {"x": torch.randn(batch, 3, image, image), "t": torch.rand(batch) * 1000}
