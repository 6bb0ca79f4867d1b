"""Image classification over a directory of image files, read by torchvision's `ImageFolder`.

    DATA/train/<class>/*.png   DATA/test/<class>/*.png

Images are resized to `size`×`size` RGB, scaled to [0, 1] and normalised per channel with 0.5/0.5;
the model is a small CNN whose output size is the number of class folders.

    distrain run --task examples/image_folder.py:ImageFolderTask --task-arg root=DATA --epochs 5
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

import distrain


class ImageFolderTask(distrain.Task):
    default_target = "val_accuracy>=0.9"
    carve_validation = True  # --val-fraction of train/ is the validation split

    def __init__(self, root: str, size: int = 16):
        self.root = Path(root).expanduser().resolve()  # workers may run in another directory
        self.size = size
        for split in ("train", "test"):
            if not (self.root / split).is_dir():
                raise distrain.ConfigError(f"{self.root / split} is not a directory of class folders")
        self.classes = sorted(p.name for p in (self.root / "train").iterdir() if p.is_dir())

    def _folder(self, split: str):
        from torchvision import datasets, transforms

        transform = transforms.Compose(
            [
                transforms.Resize((self.size, self.size)),
                transforms.ToTensor(),
                transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
            ]
        )
        return datasets.ImageFolder(str(self.root / split), transform=transform, loader=_rgb)

    def build_model(self) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 4, len(self.classes)),
        )

    def datasets(self):
        return self._folder("train"), self._folder("test")

    def loss(self, model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    def metrics(self, model, batch):
        x, y = batch
        return {"accuracy": (float((model(x).argmax(1) == y).sum()), float(len(y)))}


def _rgb(path: str):
    from PIL import Image

    with open(path, "rb") as f:
        return Image.open(f).convert("RGB")
