"""Canonical URLs and checksums of every downloadable dataset file (see ``../shared/data/SOURCES.md``).

``FILES`` maps a cache key (the file's path under the cache folder) to its :class:`RemoteFile`;
``DATASET_FILES`` maps a dataset name (as typed after ``data=``) to the keys its loader reads.
Loaders look entries up here at call time, so tests can swap an entry for a generated file.
"""

from __future__ import annotations

from pathlib import Path

from bdl_bench.data.download import RemoteFile, fetch

_BASE_URLS = {
    "mnist": ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"),
    "notmnist": ("https://raw.githubusercontent.com/davidflanagan/notMNIST-to-MNIST/master/",),
    "cifar10": ("https://www.cs.toronto.edu/~kriz/",),
    "cifar100": ("https://www.cs.toronto.edu/~kriz/",),
    "svhn": ("http://ufldl.stanford.edu/housenumbers/",),
    "imdb": ("https://ai.stanford.edu/~amaas/data/sentiment/",),
}
"""Cache folder → base URLs, tried in order (a file's URL is the base followed by its name)."""

# Where the checksums come from. MNIST: SHA-256 computed on the byte-exact canonical files in ../shared/data/mnist,
# MD5 torchvision's. notMNIST (the 10k IDX sample of notMNIST_small, davidflanagan/notMNIST-to-MNIST): both ours,
# on ../shared/data/notmnist. CIFAR, SVHN and IMDB publish an MD5 only (the CIFAR page; torchvision's and
# torchtext's for SVHN and IMDB); their SHA-256s are the values that at least three independent loaders pin (e.g.
# Julia's MLDatasets, the Ruby torchvision port, GoMLX's datasets for CIFAR; torchvision's prototype datasets and
# two others for SVHN; MLDatasets, GoMLX and a Rust dataset crate for IMDB), and both digests are enforced.
_TABLE = """
# cache key                         bytes       MD5                               SHA-256
mnist/train-images-idx3-ubyte.gz    9912422     f68b3c2dcbeaaa9fbdd348bbdeb94873  440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609
mnist/train-labels-idx1-ubyte.gz    28881       d53e105ee54ea40749a09fcbcd1e9432  3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c
mnist/t10k-images-idx3-ubyte.gz     1648877     9fb629c4189551a2d022fa330f9573f3  8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6
mnist/t10k-labels-idx1-ubyte.gz     4542        ec29112dd5afa0611ce80d1b7f02629c  f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6
notmnist/t10k-images-idx3-ubyte.gz  3172375     2c87c839a4ef9b238846600eec8c35b7  70ae9e06201f2827e5b0a3781a3169d735dd2efc69996b9eeaee7f10ed4044d7
notmnist/t10k-labels-idx1-ubyte.gz  5118        7ea9118cbafd0f6e3ee2ad771d782a01  1fa03836e01c862542f8eb83463bb951bebec6fcb3efa28dad748c6b38a9021b
cifar10/cifar-10-binary.tar.gz      170052171   c32a1d4ab5d03f1284b67883e8d87530  c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb1ed8d9ddda3db29a59bca1dd
cifar100/cifar-100-binary.tar.gz    -           03b5dce01913d631647c71ecec9e9cb8  58a81ae192c23a4be8b1804d68e518ed807d710a4eb253b1f2a199162a40d8ec
svhn/train_32x32.mat                182040794   e26dedcc434d2e4c54c9b2d4a06d8373  435e94d69a87fde4fd4d7f3dd208dfc32cb6ae8af2240d066de1df7508d083b8
svhn/test_32x32.mat                 64275384    eb5a983be6a315427106f1b164d9cef3  cdce80dfb2a2c4c6160906d0bd7c68ec5a99d7ca4831afa54f09182025b6a75b
svhn/extra_32x32.mat                1329278602  a93ce644f1a588dc4d68dda5feec44a7  a133a4beb38a00fcdda90c9489e0c04f900b660ce8a316a5e854838379a71eb3
imdb/aclImdb_v1.tar.gz              84125825    7c2ac02c03563afcf9b574c7e56c153a  c40f74a18d3b61f90feba1e17730e0d38e8b97c05fde7008942e91923d1658fe
"""
"""One file a line: cache key, size in bytes (``-``: not recorded), MD5, SHA-256."""


def _remote(row: str) -> RemoteFile:
    key, size, md5, sha256 = row.split()
    folder, name = key.split("/")
    urls = tuple(base + name for base in _BASE_URLS[folder])
    return RemoteFile(key, urls, None if sha256 == "-" else sha256, md5, None if size == "-" else int(size))


FILES: dict[str, RemoteFile] = {
    remote.key: remote
    for remote in map(_remote, (row for row in _TABLE.splitlines() if row and not row.startswith("#")))
}
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


def get_file(key: str, *, root: str | Path | None = None, mirror: str | Path | None = None) -> Path:
    """Fetch (or find in the cache) the file ``key`` and return its verified path; see :func:`fetch`."""
    return fetch(FILES[key], root=root, mirror=mirror)
