"""Image datasets read from their distribution files into tensors: Fashion-MNIST and CIFAR-10.

Each loader returns ``(images, labels)``: images ``float32`` in ``[0, 1]`` shaped ``(N, C, H, W)``,
labels ``int64`` shaped ``(N,)``. Whole splits fit in memory (Fashion-MNIST's training split is
188 MB as float32), so a trainer indexes them directly; no DataLoader is needed.

* **Fashion-MNIST** is read from the IDX files the Debian package ``dataset-fashion-mnist``
  installs under ``/usr/share/datasets/fashion-mnist/`` (the upstream files, gzip'd or not).
  IDX: a 4-byte magic ``0 0 <type code> <number of dims>``, one big-endian ``uint32`` per dim,
  then the values in C order; ``0x08`` is ``uint8``, the only type these files use.
* **CIFAR-10** is read from either official distribution: the binary version
  (``data_batch_1.bin`` ... ``data_batch_5.bin``, ``test_batch.bin``; each record one label byte
  and 3072 pixel bytes, the red, green and blue 32x32 planes in row-major order) or the Python
  version (pickled dicts whose ``data`` is an ``(N, 3072)`` ``uint8`` array in the same layout
  and ``labels`` a list), in the folder given or its ``cifar-10-batches-bin`` /
  ``cifar-10-batches-py`` subfolder.

A missing file raises :class:`DatasetNotFoundError` naming the path looked at and what to
install or where to put the files.
"""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "DatasetNotFoundError",
    "FASHION_MNIST_DIR",
    "FASHION_MNIST_CLASSES",
    "CIFAR10_CLASSES",
    "DATASETS",
    "read_idx",
    "fashion_mnist",
    "cifar10",
    "load_dataset",
]

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")

_SPLITS = ("train", "test")
_IDX_UINT8 = 0x08
_CIFAR_SIDE = 32
_CIFAR_RECORD = 1 + 3 * _CIFAR_SIDE * _CIFAR_SIDE
_CIFAR_FILES = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}


class DatasetNotFoundError(FileNotFoundError):
    """A dataset's files are not where the loader looked; the message says how to get them."""


def _check_split(split: str) -> None:
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")


def read_idx(path) -> torch.Tensor:
    """The ``uint8`` tensor stored in an IDX file (gzip'd when the name ends in ``.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path} is not an IDX file (its first two bytes must be zero)")
    type_code, ndim = raw[2], raw[3]
    if type_code != _IDX_UINT8:
        raise ValueError(f"{path}: IDX type code {type_code:#04x} is not supported (only 0x08, uint8)")
    header = 4 + 4 * ndim
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    expected = header + int(np.prod(dims, dtype=np.int64))
    if len(raw) != expected:
        raise ValueError(f"{path}: the header announces dims {dims} ({expected} bytes) but the file has {len(raw)}")
    return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims).copy())


def _find_idx(root: Path, stem: str) -> Path:
    for name in (f"{stem}.gz", stem):
        if (root / name).is_file():
            return root / name
    raise DatasetNotFoundError(
        f"Fashion-MNIST: {root / (stem + '.gz')} not found. Install the dataset with "
        f"`apt-get install dataset-fashion-mnist` (it puts the files in {FASHION_MNIST_DIR}), "
        f"or pass the folder holding {stem}[.gz] as root"
    )


def fashion_mnist(split: str = "train", root=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fashion-MNIST's ``split`` (``"train"``: 60000 images, ``"test"``: 10000): images
    ``(N, 1, 28, 28)`` float in ``[0, 1]``, labels ``(N,)`` int64 (:data:`FASHION_MNIST_CLASSES`)."""
    _check_split(split)
    root = Path(root) if root is not None else FASHION_MNIST_DIR
    prefix = "t10k" if split == "test" else "train"
    images = read_idx(_find_idx(root, f"{prefix}-images-idx3-ubyte"))
    labels = read_idx(_find_idx(root, f"{prefix}-labels-idx1-ubyte"))
    if images.dim() != 3 or labels.dim() != 1 or images.shape[0] != labels.shape[0]:
        raise ValueError(
            f"Fashion-MNIST in {root}: images {tuple(images.shape)} and labels {tuple(labels.shape)} do not "
            "pair up (expected (N, 28, 28) and (N,))"
        )
    return images.unsqueeze(1).float().div_(255.0), labels.long()


def _cifar_folder(root: Path) -> tuple[Path, str]:
    """(folder, "bin" or "py") of the CIFAR-10 files under ``root``."""
    for folder in (root, root / "cifar-10-batches-bin", root / "cifar-10-batches-py"):
        if (folder / "test_batch.bin").is_file() or (folder / "data_batch_1.bin").is_file():
            return folder, "bin"
        if (folder / "test_batch").is_file() or (folder / "data_batch_1").is_file():
            return folder, "py"
    raise DatasetNotFoundError(
        f"CIFAR-10: no data_batch_1.bin / test_batch.bin (binary version) nor data_batch_1 / test_batch "
        f"(Python version) in {root} or its cifar-10-batches-bin / cifar-10-batches-py subfolder. Download "
        "cifar-10-binary.tar.gz (or cifar-10-python.tar.gz) from https://www.cs.toronto.edu/~kriz/cifar.html, "
        "unpack it and pass the folder as root"
    )


def _cifar_records_bin(path: Path) -> tuple[np.ndarray, np.ndarray]:
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size == 0 or raw.size % _CIFAR_RECORD:
        raise ValueError(
            f"{path}: {raw.size} bytes is not a whole number of CIFAR-10 records ({_CIFAR_RECORD} bytes each: "
            "1 label byte + 3072 pixel bytes)"
        )
    records = raw.reshape(-1, _CIFAR_RECORD)
    return records[:, 1:], records[:, 0]


def _cifar_records_py(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as f:
        # the official Python version is pickled; its dict's keys are bytes under Python 3
        batch = pickle.load(f, encoding="bytes")
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if data is None or labels is None:
        raise ValueError(f"{path}: a CIFAR-10 Python batch must be a dict with 'data' and 'labels'")
    data = np.asarray(data, dtype=np.uint8)
    if data.ndim != 2 or data.shape[1] != _CIFAR_RECORD - 1 or data.shape[0] != len(labels):
        raise ValueError(f"{path}: data {data.shape} and {len(labels)} labels do not form (N, 3072) images")
    return data, np.asarray(labels, dtype=np.uint8)


def cifar10(root, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """CIFAR-10's ``split`` from the binary or Python distribution in ``root``: images
    ``(N, 3, 32, 32)`` float in ``[0, 1]``, labels ``(N,)`` int64 (:data:`CIFAR10_CLASSES`)."""
    _check_split(split)
    folder, kind = _cifar_folder(Path(root))
    pixels, labels = [], []
    for stem in _CIFAR_FILES[split]:
        path = folder / (stem + ".bin" if kind == "bin" else stem)
        if not path.is_file():
            raise DatasetNotFoundError(
                f"CIFAR-10: {path} is missing (the {split} split reads {[s for s in _CIFAR_FILES[split]]}); "
                "unpack the whole archive into that folder"
            )
        data, y = _cifar_records_bin(path) if kind == "bin" else _cifar_records_py(path)
        pixels.append(data)
        labels.append(y)
    y = np.concatenate(labels)
    if int(y.max()) >= len(CIFAR10_CLASSES):
        raise ValueError(f"CIFAR-10 in {folder}: label {int(y.max())} is out of range (10 classes)")
    images = torch.from_numpy(np.concatenate(pixels)).reshape(-1, 3, _CIFAR_SIDE, _CIFAR_SIDE)
    return images.float().div_(255.0), torch.from_numpy(y).long()


DATASETS = {"fashion-mnist": FASHION_MNIST_CLASSES, "cifar10": CIFAR10_CLASSES}


def load_dataset(name: str, split: str = "train", root=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``fashion-mnist`` (``root`` defaults to the Debian package's folder) or ``cifar10``
    (``root`` required) by name."""
    if name == "fashion-mnist":
        return fashion_mnist(split, root)
    if name == "cifar10":
        if root is None:
            raise ValueError("cifar10 needs root: the folder holding the CIFAR-10 batch files")
        return cifar10(root, split)
    raise ValueError(f"unknown dataset {name!r}: choose one of {sorted(DATASETS)}")
