"""Dataset loaders (partitioner/data.py) and the example trainer (examples/train_vit.py).

No real dataset is needed. Fashion-MNIST is tested on IDX files written here in the layout the
Debian package ``dataset-fashion-mnist`` ships (``{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz``,
big-endian IDX headers, gzip'd), CIFAR-10 on files in both official layouts (binary records,
pickled batches); each loader must read back exactly the pixels and labels written. The written
Fashion-MNIST images are learnable (each class a bright bar at its own row, plus noise), so the
trainer runs a few steps on them: one process (the plain model) against 2 gloo ranks
(auto-parallelized) and a 2-stage pipeline, the same losses step for step; a run resumed from a
checkpoint continues with the losses of the uninterrupted run. The convergence benchmark
(benchmarks/convergence.py) is the one that reads the real dataset.
"""

import gzip
import pickle
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from partitioner import data
from runtime.launch import run_on_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train_vit  # noqa: E402

# ------------------------------------------------------------------------------- Fashion-MNIST


def _write_idx(path, array: np.ndarray, *, gz: bool):
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    if gz:
        with gzip.open(path, "wb") as f:
            f.write(payload)
    else:
        Path(path).write_bytes(payload)


def _fashion_split(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` 28x28 uint8 images and their labels: class ``c`` is a bright bar on rows 2c..2c+2
    over uniform noise, so a small model can learn it."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n, dtype=np.uint8) % 10
    rng.shuffle(labels)
    pixels = rng.integers(0, 128, (n, 28, 28), dtype=np.uint8)
    for i, label in enumerate(labels):
        pixels[i, 2 * label + 2 : 2 * label + 5, 3:25] = 255
    return pixels, labels


@pytest.fixture(scope="module")
def fashion_dir(tmp_path_factory) -> tuple[Path, dict]:
    """A folder laid out as the Debian package's /usr/share/datasets/fashion-mnist (the four
    gzip'd IDX files), 768 train and 128 test images; returns it and {split: (pixels, labels)}."""
    folder = tmp_path_factory.mktemp("fashion-mnist")
    written = {}
    for split, prefix, seed, n in (("train", "train", 0, 768), ("test", "t10k", 1, 128)):
        pixels, labels = _fashion_split(seed, n)
        _write_idx(folder / f"{prefix}-images-idx3-ubyte.gz", pixels, gz=True)
        _write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", labels, gz=True)
        written[split] = (pixels, labels)
    return folder, written


def test_fashion_mnist_reads_back_the_package_layout(fashion_dir):
    folder, written = fashion_dir
    for split in ("train", "test"):
        pixels, expected_labels = written[split]
        images, labels = data.fashion_mnist(split, root=folder)
        assert images.shape == (len(pixels), 1, 28, 28) and images.dtype == torch.float32
        assert labels.dtype == torch.int64 and labels.tolist() == expected_labels.tolist()
        # exactly the bytes written, scaled to [0, 1]
        assert torch.equal((images[:, 0] * 255).round().to(torch.uint8), torch.from_numpy(pixels))
        assert float(images.max()) == 1.0
    same, same_labels = data.load_dataset("fashion-mnist", "test", root=folder)
    assert torch.equal(same, data.fashion_mnist("test", root=folder)[0])
    assert same_labels.bincount().tolist() == np.bincount(written["test"][1]).tolist()
    assert len(data.FASHION_MNIST_CLASSES) == 10


def test_fashion_mnist_reads_idx_files_gzipped_or_not(tmp_path):
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (5, 28, 28))
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", pixels, gz=False)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.array([3, 1, 4, 1, 5]), gz=True)
    images, labels = data.fashion_mnist("test", root=tmp_path)
    torch.testing.assert_close(images[:, 0], torch.from_numpy(pixels).float() / 255)
    assert labels.tolist() == [3, 1, 4, 1, 5]


def test_fashion_mnist_missing_or_broken_files_say_what_to_do(tmp_path):
    with pytest.raises(data.DatasetNotFoundError, match="apt-get install dataset-fashion-mnist"):
        data.fashion_mnist("train", root=tmp_path)
    with pytest.raises(ValueError, match="split must be one of"):
        data.fashion_mnist("validation")
    (tmp_path / "bad").write_bytes(bytes([0, 0, 0x08, 1]) + struct.pack(">I", 10) + b"abc")
    with pytest.raises(ValueError, match="header announces dims"):
        data.read_idx(tmp_path / "bad")
    (tmp_path / "float").write_bytes(bytes([0, 0, 0x0D, 1]) + struct.pack(">I", 0))
    with pytest.raises(ValueError, match="type code 0x0d"):
        data.read_idx(tmp_path / "float")


# ------------------------------------------------------------------------------------ CIFAR-10


def _cifar_split(seed: int, n: int):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 3072), dtype=np.uint8), rng.integers(0, 10, n, dtype=np.uint8)


def _write_cifar(folder: Path, kind: str, per_file: int = 3) -> dict:
    """The 6 files of CIFAR-10's binary or Python version, ``per_file`` images each; returns
    {split: (pixels, labels)} as written."""
    folder.mkdir(parents=True)
    written = {"train": ([], []), "test": ([], [])}
    stems = [(f"data_batch_{i}", "train") for i in range(1, 6)] + [("test_batch", "test")]
    for seed, (stem, split) in enumerate(stems):
        pixels, labels = _cifar_split(seed, per_file)
        written[split][0].append(pixels)
        written[split][1].append(labels)
        if kind == "bin":
            records = np.concatenate([labels[:, None], pixels], axis=1)
            (folder / f"{stem}.bin").write_bytes(records.tobytes())
        else:
            with open(folder / stem, "wb") as f:
                pickle.dump({b"data": pixels, b"labels": labels.tolist(), b"batch_label": stem.encode()}, f)
    return {split: (np.concatenate(p), np.concatenate(y)) for split, (p, y) in written.items()}


@pytest.mark.parametrize("kind,subfolder", [("bin", "cifar-10-batches-bin"), ("py", "cifar-10-batches-py")])
def test_cifar10_reads_both_official_layouts(tmp_path, kind, subfolder):
    written = _write_cifar(tmp_path / subfolder, kind)
    for split, count in (("train", 15), ("test", 3)):
        images, labels = data.cifar10(tmp_path, split)  # found in the subfolder the archive unpacks to
        pixels, expected_labels = written[split]
        assert images.shape == (count, 3, 32, 32) and images.dtype == torch.float32
        assert labels.tolist() == expected_labels.tolist() and labels.dtype == torch.int64
        # record layout: the red, green and blue 32x32 planes, each row-major
        n, c, h, w = 1, 2, 5, 7
        assert images[n, c, h, w].item() == pytest.approx(pixels[n, c * 1024 + h * 32 + w] / 255)
    same, _ = data.load_dataset("cifar10", "test", root=tmp_path / subfolder)
    torch.testing.assert_close(same, data.cifar10(tmp_path, "test")[0])


def test_trainer_runs_on_cifar10_files(tmp_path):
    _write_cifar(tmp_path / "cifar-10-batches-bin", "bin", per_file=16)
    run = "--dataset cifar10 --batch 16 --steps 3 --hidden 32 --layers 1 --heads 2 --cluster h100".split()
    history = train_vit.main(run + ["--data-dir", str(tmp_path)])
    assert len(history["losses"]) == 3 and all(0 < loss < 10 for loss in history["losses"])
    assert history["evals"][-1]["step"] == 3 and 0 <= history["test_accuracy"] <= 1


def test_cifar10_missing_or_broken_files_say_what_to_do(tmp_path):
    with pytest.raises(data.DatasetNotFoundError, match="cifar-10-binary.tar.gz"):
        data.cifar10(tmp_path, "train")
    with pytest.raises(ValueError, match="needs root"):
        data.load_dataset("cifar10", "train")
    with pytest.raises(ValueError, match="unknown dataset 'mnist'"):
        data.load_dataset("mnist")
    _write_cifar(tmp_path / "c", "bin")
    (tmp_path / "c" / "data_batch_3.bin").unlink()
    with pytest.raises(data.DatasetNotFoundError, match="data_batch_3.bin is missing"):
        data.cifar10(tmp_path / "c", "train")
    (tmp_path / "c" / "test_batch.bin").write_bytes(b"\x01" * 3000)
    with pytest.raises(ValueError, match="not a whole number of CIFAR-10 records"):
        data.cifar10(tmp_path / "c", "test")


# ------------------------------------------------------------------------------------ trainer

# A tiny ViT on the 768 generated images (12 steps of 64); clipping on, so the global gradient norm is compared too.
TINY = (
    "--subset 768 --test-subset 64 --batch 64 --hidden 32 --layers 2 --heads 2 --log-every 4 --cluster h100 "
    "--lr 3e-3 --clip-grad 1.0"
).split()
# Step 1 is compared at fp32 defaults; later steps at 1e-4: the parallel run sums the loss and
# gradients in another order (each rank half the batch, then an all-reduce), and AdamW's division
# by sqrt(v) magnifies those last-bit differences in small gradients a little more every step.
CURVE = dict(rtol=1e-4, atol=1e-4)


def _tiny(fashion_dir) -> list[str]:
    """TINY on the generated Fashion-MNIST files."""
    return TINY + ["--data-dir", str(fashion_dir[0])]


def _train_on_ranks(rank, world, argv):
    return train_vit.main(argv)


def test_trainer_arguments_are_checked():
    assert train_vit.parse_mesh("2x2", 4) == (2, 2)
    assert train_vit.parse_mesh(None, 4) == (4,)
    with pytest.raises(SystemExit, match="4 ranks, but this job has 2"):
        train_vit.parse_mesh("2x2", 2)
    with pytest.raises(SystemExit, match="sizes joined by x"):
        train_vit.parse_mesh("2*2", 4)
    assert train_vit.parse_pins(["pixel_values=S(0),R", "labels=S(0)"]) == {
        "pixel_values": ["S(0)", "R"],
        "labels": ["S(0)"],
    }
    with pytest.raises(SystemExit, match="write NAME=PLACEMENTS"):
        train_vit.parse_pins(["pixel_values"])
    with pytest.raises(SystemExit):
        train_vit.parse_args(["--resume"])  # --resume needs --checkpoint-dir


def test_trainer_one_process_learns_and_resumes_where_it_stopped(tmp_path, fashion_dir):
    run = _tiny(fashion_dir) + ["--steps", "12", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "6"]
    whole = train_vit.main(run)
    losses = whole["losses"]
    assert whole["kind"] == "plain" and len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, f"the loss does not decrease: {losses}"
    shutil.rmtree(tmp_path / "step-0000012")  # as if the job had died after step 6's checkpoint
    resumed = train_vit.main(run + ["--resume"])
    assert resumed["resumed_from"] == 6
    torch.testing.assert_close(resumed["losses"], losses)
    torch.testing.assert_close(resumed["grad_norms"][6:], whole["grad_norms"][6:])
    assert resumed["test_accuracy"] == whole["test_accuracy"]


def test_trainer_two_ranks_match_one_process_and_resume_under_a_pipeline(tmp_path, fashion_dir):
    single = train_vit.main(_tiny(fashion_dir) + ["--steps", "12"])
    ckpt = tmp_path / "ckpt"
    run = _tiny(fashion_dir) + ["--steps", "12", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "6"]
    run += ["--pin", "pixel_values=S(0)", "--pin", "labels=S(0)"]  # data parallel: each rank half the batch
    ranks = run_on_ranks(_train_on_ranks, 2, run, timeout_s=600)
    for history in ranks:
        assert history["kind"] == "parallel" and history["world"] == 2
        torch.testing.assert_close(history["losses"][0], single["losses"][0])
        torch.testing.assert_close(history["losses"], single["losses"], **CURVE)
        torch.testing.assert_close(history["grad_norms"], single["grad_norms"], **CURVE)
        assert history["test_accuracy"] == single["test_accuracy"]

    # the data-parallel job's checkpoint after step 6 resumes as a 2-stage pipeline, which
    # continues with the uninterrupted run's losses
    shutil.rmtree(ckpt / "step-0000012")
    resumed = run_on_ranks(_train_on_ranks, 2, run + ["--resume", "--pipeline", "1f1b"], timeout_s=600)
    for history in resumed:
        assert history["kind"] == "pipeline" and history["resumed_from"] == 6
        torch.testing.assert_close(history["losses"], ranks[0]["losses"], **CURVE)
        assert history["test_accuracy"] == ranks[0]["test_accuracy"]
    with pytest.raises(SystemExit, match="written by a parallel job"):
        train_vit.main(run + ["--resume"])
