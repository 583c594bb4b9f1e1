"""IMDB: tokenising, vocabulary, padding, and the loader on a tiny aclImdb-style tarball."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from _archives import write_tar_gz

from bdl_bench.data import build_dataset, registry_files
from bdl_bench.data.base import Task
from bdl_bench.data.download import RemoteFile
from bdl_bench.data.text import OOV_ID, PAD_ID, build_vocabulary, encode, tokenise


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Never contact the canonical URLs: files come from generated mirrors or ../shared only."""
    monkeypatch.setenv("BDL_BENCH_OFFLINE", "1")


def test_tokenise_lowercases_and_drops_line_breaks() -> None:
    assert tokenise("Great film!<br /><br />It's 10/10, NOT bad.") == [
        "great",
        "film",
        "it's",
        "10",
        "10",
        "not",
        "bad",
    ]


def test_vocabulary_by_frequency_then_alphabetically() -> None:
    docs = [["b", "a", "c", "a"], ["c", "d", "b"]]
    assert build_vocabulary(docs, vocab_size=5) == {"a": 2, "b": 3, "c": 4}
    with pytest.raises(ValueError, match="at least 3"):
        build_vocabulary(docs, vocab_size=2)


def test_encode_keeps_the_end_and_pads_the_front() -> None:
    vocab = {"a": 2, "b": 3}
    np.testing.assert_array_equal(encode(["a", "x", "b"], vocab, 5), [PAD_ID, PAD_ID, 2, OOV_ID, 3])
    np.testing.assert_array_equal(encode(["a", "x", "b", "b"], vocab, 2), [3, 3])
    np.testing.assert_array_equal(encode([], vocab, 2), [PAD_ID, PAD_ID])


def _acl_tarball(path: Path) -> Path:
    reviews = {
        "train/pos/0_9.txt": "a great great movie",
        "train/pos/1_8.txt": "great fun",
        "train/neg/0_2.txt": "a bad movie<br />bad",
        "train/neg/1_1.txt": "awful",
        "train/unsup/0_0.txt": "ignored",
        "test/pos/0_10.txt": "great",
        "test/neg/0_3.txt": "bad unknownword",
    }
    return write_tar_gz(path, {f"aclImdb/{name}": text.encode() for name, text in reviews.items()})


def test_imdb_loader_on_a_tiny_archive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    archive = _acl_tarball(mirror / "aclImdb_v1.tar.gz")
    key = "imdb/aclImdb_v1.tar.gz"
    md5 = hashlib.md5(archive.read_bytes()).hexdigest()
    monkeypatch.setitem(registry_files.FILES, key, RemoteFile(key, urls=(), md5=md5))
    data = build_dataset(
        {"name": "text/imdb", "vocab_size": 6, "max_len": 4, "n_val": 1, "seed": 0,
         "root": str(tmp_path / "cache"), "mirror": str(mirror)}
    )  # fmt: skip
    assert data.task is Task.BINARY and data.n_outputs == 1
    assert data.x_train.shape == (3, 4) and data.x_val.shape == (1, 4) and data.x_test.shape == (2, 4)
    assert data.x_train.dtype == torch.long and data.y_train.dtype == torch.float32
    assert sorted(data.y_test.tolist()) == [0.0, 1.0]
    assert int(data.x_train.max()) < 6 and int(data.x_test.min()) == PAD_ID
    assert OOV_ID in data.x_test.tolist()[1]  # "unknownword" is not in the vocabulary (test set: neg second)
    assert (tmp_path / "cache" / "imdb" / "aclImdb_v1.tar.gz.sha256").is_file()  # MD5-only: SHA-256 recorded
