"""The models ``doctor`` and the ``train`` and ``recipe`` suites train, and their training step.

Image classifiers in plain ``torch.nn`` (torchvision is optional): the ResNets and
MobileNetV2 follow torchvision's architectures layer for layer (so their compute
per image is the real one); ``tiny`` is two convolutions for tests and for
measuring the loader with an almost free model. :func:`training_model` takes
torchvision's where it imports; :func:`train_step` is the one training step every
row runs, :func:`model_stream` the model's own rate on a synthetic batch.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from torch import Tensor, nn

from dali_pipes.bench.model_names import MODELS  # apart, so that the CLI need not import torch


def build_model(name: str, num_classes: int = 1000) -> nn.Module:
    """A freshly initialised classifier by name (one of :data:`MODELS`) for ``num_classes`` classes."""
    if num_classes < 1:
        raise ValueError(f"num_classes must be at least 1, got {num_classes}")
    builders: dict[str, Callable[[int], nn.Module]] = {
        "resnet50": lambda n: ResNet(Bottleneck, (3, 4, 6, 3), n),
        "resnet18": lambda n: ResNet(BasicBlock, (2, 2, 2, 2), n),
        "mobilenet": MobileNetV2,
        "tiny": Tiny,
    }
    if name not in builders:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    return builders[name](num_classes)


#: torchvision's names for the models it has (``tiny`` is this package's alone).
TORCHVISION_NAMES = {"resnet50": "resnet50", "resnet18": "resnet18", "mobilenet": "mobilenet_v2"}


def model_source(name: str) -> str:
    """Where :func:`training_model` takes ``name`` from: torchvision where it has it and imports, else this package."""
    if name not in TORCHVISION_NAMES:
        return "dali_pipes.bench.models"
    try:
        import torchvision.models  # noqa: F401 - whether it imports beside this torch
    except Exception:  # noqa: BLE001 - any import failure: the package's own architecture, layer for layer the same
        return "dali_pipes.bench.models"
    return "torchvision"


def training_model(name: str, num_classes: int, device: str) -> tuple[nn.Module, Any]:
    """A freshly initialised ``name`` in training mode on ``device`` (``channels_last`` on a GPU), and its SGD
    optimizer (momentum 0.9): the model of ``doctor`` and of ``bench --suite train``."""
    import torch

    if model_source(name) == "torchvision":
        import torchvision.models

        net = getattr(torchvision.models, TORCHVISION_NAMES[name])(weights=None, num_classes=num_classes)
    else:
        net = build_model(name, num_classes)
    net = net.to(device)
    if str(device).startswith("cuda"):
        net = net.to(memory_format=torch.channels_last)
    net.train()
    return net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)


def train_step(model: Any, optimizer: Any, images: Any, labels: Any) -> None:
    """One SGD step; on a GPU in bfloat16 mixed precision (as GPU training runs), which needs no loss scaling."""
    import torch
    import torch.nn.functional as F

    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device_type=images.device.type, dtype=torch.bfloat16, enabled=images.is_cuda):
        loss = F.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()


@contextlib.contextmanager
def model_stream(
    model: Any, optimizer: Any, *, batch_size: int, size: int, num_classes: int, device: str
) -> Iterator[Iterator[int]]:
    """Training steps on one synthetic batch already on ``device``: the model's own speed."""
    import torch

    images = torch.randn(batch_size, 3, size, size, device=device)
    labels = torch.randint(0, num_classes, (batch_size,), device=device)

    def steps() -> Iterator[int]:
        while True:
            train_step(model, optimizer, images, labels)
            yield batch_size

    yield steps()


def _conv_bn(
    cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, act: nn.Module | None = None
) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
    ]
    if act is not None:
        layers.append(act)
    return nn.Sequential(*layers)


class BasicBlock(nn.Module):
    """ResNet-18/34 block: two 3x3 convolutions and a shortcut."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(
            _conv_bn(cin, width, 3, stride, act=nn.ReLU(inplace=True)),
            _conv_bn(width, width, 3),
        )
        self.shortcut = _shortcut(cin, width * self.expansion, stride)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


class Bottleneck(nn.Module):
    """ResNet-50 block: 1x1 reduce, 3x3 (strided, as torchvision's v1.5), 1x1 expand, shortcut."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(
            _conv_bn(cin, width, 1, act=nn.ReLU(inplace=True)),
            _conv_bn(width, width, 3, stride, act=nn.ReLU(inplace=True)),
            _conv_bn(width, width * self.expansion, 1),
        )
        self.shortcut = _shortcut(cin, width * self.expansion, stride)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    if stride == 1 and cin == cout:
        return nn.Identity()
    return _conv_bn(cin, cout, 1, stride)


class ResNet(nn.Module):
    """ResNet with the ImageNet stem (7x7/2 convolution, 3x3/2 max-pool) and four stages."""

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], depths: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [_conv_bn(3, 64, 7, 2, act=nn.ReLU(inplace=True)), nn.MaxPool2d(3, 2, 1)]
        cin = 64
        for stage, depth in enumerate(depths):
            width = 64 * 2**stage
            for i in range(depth):
                layers.append(block(cin, width, 2 if i == 0 and stage > 0 else 1))
                cin = width * block.expansion
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand, 3x3 depthwise, 1x1 linear project; residual when shapes allow."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers.append(_conv_bn(cin, hidden, 1, act=nn.ReLU6(inplace=True)))
        layers += [
            _conv_bn(hidden, hidden, 3, stride, groups=hidden, act=nn.ReLU6(inplace=True)),
            _conv_bn(hidden, cout, 1),
        ]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: Tensor) -> Tensor:
        return x + self.body(x) if self.residual else self.body(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 (width 1.0), torchvision's layer settings."""

    SETTINGS = (
        (1, 16, 1, 1),
        (6, 24, 2, 2),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    )

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [_conv_bn(3, 32, 3, 2, act=nn.ReLU6(inplace=True))]
        cin = 32
        for expand, cout, repeats, stride in self.SETTINGS:
            for i in range(repeats):
                layers.append(InvertedResidual(cin, cout, stride if i == 0 else 1, expand))
                cin = cout
        layers.append(_conv_bn(cin, 1280, 1, act=nn.ReLU6(inplace=True)))
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(1280, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


class Tiny(nn.Module):
    """Two strided convolutions and a linear head: almost free, for tests."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            _conv_bn(3, 8, 3, 4, act=nn.ReLU(inplace=True)),
            _conv_bn(8, 16, 3, 4, act=nn.ReLU(inplace=True)),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(16, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)
