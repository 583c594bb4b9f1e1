"""Small generated archives and IDX files for the loader tests (importable from any test module: tests/ is on sys.path)."""

from __future__ import annotations

import gzip
import io
import struct
import tarfile
from pathlib import Path

import numpy as np

from bdl_bench.data.idx import IDX_TYPES


def write_tar_gz(path: Path, members: dict[str, bytes]) -> Path:
    """A ``.tar.gz`` at ``path`` holding regular files ``name → bytes``; returns ``path``."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def encode_idx(array: np.ndarray) -> bytes:
    """IDX bytes of ``array`` (dtype one of :data:`~bdl_bench.data.idx.IDX_TYPES`' kinds)."""
    array = np.asarray(array)
    for code, dtype in IDX_TYPES.items():
        if array.dtype.kind == dtype.kind and array.dtype.itemsize == dtype.itemsize:
            header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
            return header + np.ascontiguousarray(array, dtype=dtype).tobytes()
    raise ValueError(f"no IDX type for dtype {array.dtype}")


def write_idx(array: np.ndarray, path: Path) -> Path:
    """Write ``array`` as IDX to ``path``, gzipped when its name ends in ``.gz``."""
    data = encode_idx(array)
    path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)
    return path


def cifar_records(n: int, label_bytes: int, seed: int, n_labels: int = 10) -> bytes:
    """``n`` random records of the CIFAR binary format: ``label_bytes`` label bytes below ``n_labels``, then the
    image's red, green and blue 32 x 32 planes."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, n_labels, size=(n, label_bytes), dtype=np.uint8)
    images = rng.integers(0, 256, size=(n, 3 * 32 * 32), dtype=np.uint8)
    return b"".join(labels[i].tobytes() + images[i].tobytes() for i in range(n))


def write_cifar_archive(path: Path, layout, n_per_member: int, seed: int = 0) -> Path:  # noqa: ANN001
    """A tarball at ``path`` in the layout of ``bdl_bench.data.cifar.CIFAR10`` or ``CIFAR100`` (two label bytes,
    100 fine labels), each member holding ``n_per_member`` random records."""
    label_bytes, n_labels = (2, 100) if "100" in layout.key else (1, 10)
    members = (*layout.train_members, *layout.test_members)
    records = {m: cifar_records(n_per_member, label_bytes, seed + i, n_labels) for i, m in enumerate(members)}
    return write_tar_gz(path, records)


IMDB_REVIEWS = {  # aclImdb/<split>/<label>/<id>_<stars>.txt
    "train/pos/0_9.txt": "a great great movie",
    "train/pos/1_8.txt": "great fun",
    "train/pos/2_7.txt": "fun and great",
    "train/neg/0_2.txt": "a bad movie<br />bad",
    "train/neg/1_1.txt": "awful",
    "train/neg/2_3.txt": "bad and awful",
    "test/pos/0_10.txt": "great",
    "test/neg/0_3.txt": "bad unknownword",
}


def write_imdb_archive(path: Path, reviews: dict[str, str] = IMDB_REVIEWS) -> Path:
    """``aclImdb_v1.tar.gz`` at ``path`` holding ``reviews`` (paths below ``aclImdb/``)."""
    return write_tar_gz(path, {f"aclImdb/{name}": text.encode() for name, text in reviews.items()})


def register_archive(monkeypatch, key: str, archive: Path, md5: bool = False) -> None:  # noqa: ANN001
    """Make ``archive``'s digest (SHA-256, or MD5 as the registry has it for some files) the one ``key`` must have."""
    import hashlib

    from bdl_bench.data import registry_files
    from bdl_bench.data.download import RemoteFile

    digest = (hashlib.md5 if md5 else hashlib.sha256)(archive.read_bytes()).hexdigest()
    remote = RemoteFile(key, urls=(), md5=digest) if md5 else RemoteFile(key, urls=(), sha256=digest)
    monkeypatch.setitem(registry_files.FILES, key, remote)


def write_svhn_mat(path: Path, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """An SVHN format-2 ``.mat`` file of ``n`` random digits: ``X (32, 32, 3, n)`` uint8, ``y (n, 1)`` in 1..10 (10 is
    the digit 0; the first label is 10); returns ``(X, y)``."""
    import scipy.io

    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(32, 32, 3, n), dtype=np.uint8)
    y = rng.integers(1, 11, size=(n, 1)).astype(np.uint8)
    y[0, 0] = 10
    scipy.io.savemat(path, {"X": x, "y": y})
    return x, y
