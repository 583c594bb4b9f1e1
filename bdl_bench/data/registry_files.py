"""Canonical URLs and checksums of every downloadable dataset file (see ``../shared/data/SOURCES.md``).

``FILES`` maps a cache key (the file's path under the cache folder) to its :class:`RemoteFile`;
``DATASET_FILES`` maps a dataset name (as typed after ``data=``) to the keys its loader reads.
Loaders look entries up here at call time, so tests can swap an entry for a generated file.

MNIST and notMNIST have SHA-256s computed on the copies in ``../shared/data/{mnist,notmnist}``. For CIFAR,
SVHN and IMDB only an MD5 is published; a SHA-256 seen in a single third-party loader is quoted in
``source`` but not enforced.
"""

from __future__ import annotations

from pathlib import Path

from bdl_bench.data.download import RemoteFile, fetch

_CIFAR_URL = "https://www.cs.toronto.edu/~kriz/"
_SVHN_URL = "http://ufldl.stanford.edu/housenumbers/"
_IDX_SOURCES = {
    "mnist": (
        ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"),
        "sha256: ours (shared/data/mnist, byte-exact canonical file); md5: torchvision",
    ),
    "notmnist": (
        ("https://raw.githubusercontent.com/davidflanagan/notMNIST-to-MNIST/master/",),
        "10k IDX sample of notMNIST_small (davidflanagan/notMNIST-to-MNIST); sha256/md5: ours",
    ),
}
"""Base URLs and checksum source of the MNIST and notMNIST IDX files."""


def _idx(key: str, sha256: str, md5: str, size: int) -> RemoteFile:
    prefix, name = key.split("/")
    bases, source = _IDX_SOURCES[prefix]
    return RemoteFile(key, tuple(base + name for base in bases), sha256, md5, size, source)


_ALL = (
    _idx(
        "mnist/train-images-idx3-ubyte.gz",
        "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
        "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        9912422,
    ),
    _idx(
        "mnist/train-labels-idx1-ubyte.gz",
        "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
        "d53e105ee54ea40749a09fcbcd1e9432",
        28881,
    ),
    _idx(
        "mnist/t10k-images-idx3-ubyte.gz",
        "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
        "9fb629c4189551a2d022fa330f9573f3",
        1648877,
    ),
    _idx(
        "mnist/t10k-labels-idx1-ubyte.gz",
        "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
        "ec29112dd5afa0611ce80d1b7f02629c",
        4542,
    ),
    _idx(
        "notmnist/t10k-images-idx3-ubyte.gz",
        "70ae9e06201f2827e5b0a3781a3169d735dd2efc69996b9eeaee7f10ed4044d7",
        "2c87c839a4ef9b238846600eec8c35b7",
        3172375,
    ),
    _idx(
        "notmnist/t10k-labels-idx1-ubyte.gz",
        "1fa03836e01c862542f8eb83463bb951bebec6fcb3efa28dad748c6b38a9021b",
        "7ea9118cbafd0f6e3ee2ad771d782a01",
        5118,
    ),
    RemoteFile(
        key="cifar10/cifar-10-binary.tar.gz",
        urls=(_CIFAR_URL + "cifar-10-binary.tar.gz",),
        md5="c32a1d4ab5d03f1284b67883e8d87530",
        size=170052171,
        source="md5: official CIFAR page; third-party sha256 c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb1ed8d9ddda3db29a59bca1dd",
    ),
    RemoteFile(
        key="cifar100/cifar-100-binary.tar.gz",
        urls=(_CIFAR_URL + "cifar-100-binary.tar.gz",),
        md5="03b5dce01913d631647c71ecec9e9cb8",
        source="md5: official CIFAR page (also in several public loaders); size not recorded",
    ),
    RemoteFile(
        key="svhn/train_32x32.mat",
        urls=(_SVHN_URL + "train_32x32.mat",),
        md5="e26dedcc434d2e4c54c9b2d4a06d8373",
        size=182040794,
        source="md5: torchvision; third-party sha256 435e94d69a87fde4fd4d7f3dd208dfc32cb6ae8af2240d066de1df7508d083b8",
    ),
    RemoteFile(
        key="svhn/test_32x32.mat",
        urls=(_SVHN_URL + "test_32x32.mat",),
        md5="eb5a983be6a315427106f1b164d9cef3",
        size=64275384,
        source="md5: torchvision; third-party sha256 cdce80dfb2a2c4c6160906d0bd7c68ec5a99d7ca4831afa54f09182025b6a75b",
    ),
    RemoteFile(
        key="svhn/extra_32x32.mat",
        urls=(_SVHN_URL + "extra_32x32.mat",),
        md5="a93ce644f1a588dc4d68dda5feec44a7",
        size=1329278602,
        source="md5: torchvision",
    ),
    RemoteFile(
        key="imdb/aclImdb_v1.tar.gz",
        urls=("https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz",),
        md5="7c2ac02c03563afcf9b574c7e56c153a",
        size=84125825,
        source="md5: torchtext",
    ),
)

FILES: dict[str, RemoteFile] = {f.key: f for f in _ALL}
"""Cache key → remote file."""

DATASET_FILES: dict[str, tuple[str, ...]] = {
    "vision/mnist": tuple(key for key in FILES if key.startswith("mnist/")),
    "vision/notmnist": tuple(key for key in FILES if key.startswith("notmnist/")),
    "vision/cifar10": ("cifar10/cifar-10-binary.tar.gz",),
    "vision/cifar100": ("cifar100/cifar-100-binary.tar.gz",),
    "vision/svhn": ("svhn/train_32x32.mat", "svhn/test_32x32.mat"),
    "vision/svhn_extra": ("svhn/extra_32x32.mat",),
    "text/imdb": ("imdb/aclImdb_v1.tar.gz",),
}
"""Dataset name → the cache keys it needs (``vision/svhn_extra``: only with ``data.use_extra=true``)."""


def remote(key: str) -> RemoteFile:
    """The registry entry for cache key ``key`` (a :class:`KeyError` lists the known keys)."""
    if key not in FILES:
        raise KeyError(f"no remote file {key!r}; known: {', '.join(sorted(FILES))}")
    return FILES[key]


def get_file(key: str, *, root: str | Path | None = None, mirror: str | Path | None = None) -> Path:
    """Fetch (or find in the cache) the file ``key`` and return its verified path; see :func:`fetch`."""
    return fetch(remote(key), root=root, mirror=mirror)
