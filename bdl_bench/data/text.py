"""IMDB movie-review sentiment (``text/imdb``) from Maas et al.'s ``aclImdb_v1.tar.gz``.

Reviews ``aclImdb/{train,test}/{pos,neg}/<id>_<rating>.txt`` (25k + 25k, balanced; ``unsup`` is
skipped) are read straight from the verified tarball, lower-cased, ``<br />`` removed, and split into
tokens ``[a-z0-9]+('[a-z]+)?``. The vocabulary is the ``vocab_size - 2`` most frequent training tokens
(ties broken alphabetically); id 0 is padding, id 1 an out-of-vocabulary token, words get ids 2, 3, …
in order of frequency. Each review becomes ``max_len`` ids: longer reviews keep their *last*
``max_len`` tokens and shorter ones are padded at the *front* (Keras' ``pad_sequences`` defaults), so
an LSTM's final state has read the end of every review. Labels: 1 positive, 0 negative (binary task).
The training reviews are shuffled with ``seed`` and the last ``n_val`` become validation (k-tied: 5000).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from bdl_bench.data.archives import iter_tar_files
from bdl_bench.data.base import Dataset, Task, register_dataset
from bdl_bench.data.registry_files import get_file
from bdl_bench.errors import ConfigError, DataError

PAD_ID = 0
OOV_ID = 1
_TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
_MEMBER = re.compile(r"^(?:\./)?aclImdb/(train|test)/(pos|neg)/(\d+)_(\d+)\.txt$")


def tokenise(text: str) -> list[str]:
    """Lower-cased word tokens of a review, HTML line breaks removed."""
    return _TOKEN.findall(text.lower().replace("<br />", " ").replace("<br/>", " "))


def build_vocabulary(documents: Iterable[Sequence[str]], vocab_size: int) -> dict[str, int]:
    """Word → id for the ``vocab_size - 2`` most frequent tokens (ids from 2; 0 = padding, 1 = unknown)."""
    if vocab_size < 3:
        raise ConfigError(f"vocab_size must be at least 3 (padding, unknown, one word), got {vocab_size}")
    counts = Counter(token for doc in documents for token in doc)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[: vocab_size - 2]
    return {word: i + 2 for i, (word, _) in enumerate(ranked)}


def encode(tokens: Sequence[str], vocabulary: dict[str, int], max_len: int) -> np.ndarray:
    """``max_len`` ids: the last ``max_len`` tokens, front-padded with :data:`PAD_ID`."""
    ids = [vocabulary.get(t, OOV_ID) for t in tokens][-max_len:]
    out = np.full(max_len, PAD_ID, dtype=np.int64)
    if ids:
        out[max_len - len(ids) :] = ids
    return out


def read_imdb_archive(archive: Path) -> dict[str, tuple[list[str], np.ndarray]]:
    """``{"train": (texts, labels), "test": ...}`` from ``aclImdb_v1.tar.gz`` (or a tarball with the same layout):
    ``(N,)`` int64 labels, 1 positive and 0 negative, the reviews in (label, id) order."""
    found: dict[str, list[tuple[int, int, str]]] = {"train": [], "test": []}
    for name, data in iter_tar_files(archive, lambda n: _MEMBER.match(n) is not None):
        match = _MEMBER.match(name)
        assert match is not None
        split, sentiment, review_id = match.group(1), match.group(2), int(match.group(3))
        found[split].append((1 if sentiment == "pos" else 0, review_id, data.decode("utf-8", errors="replace")))
    out = {}
    for split, rows in found.items():
        if not rows:
            raise DataError(f"{archive}: no reviews under aclImdb/{split}/{{pos,neg}}/")
        rows.sort(key=lambda r: (-r[0], r[1]))
        out[split] = [r[2] for r in rows], np.array([r[0] for r in rows], dtype=np.int64)
    return out


@register_dataset("text/imdb")
def load_imdb(
    *,
    vocab_size: int = 20000,
    max_len: int = 200,
    n_val: int = 5000,
    seed: int = 0,
    root: str | Path | None = None,
    mirror: str | Path | None = None,
) -> Dataset:
    """IMDB sentiment as token-id sequences ``(N, max_len)`` (long) with binary labels (float), as the module
    docstring says; ``root``, ``mirror`` as :func:`bdl_bench.data.cifar.load_cifar10`."""
    splits = read_imdb_archive(get_file("imdb/aclImdb_v1.tar.gz", root=root, mirror=mirror))
    (train_texts, labels), (test_texts, test_labels) = splits["train"], splits["test"]
    train_tokens = [tokenise(t) for t in train_texts]
    order = np.random.default_rng(seed).permutation(len(train_tokens))
    n_train = len(order)
    if not 0 <= n_val < n_train:
        raise ConfigError(f"text/imdb: n_val must be in [0, {n_train}), got {n_val}")
    fit_rows, val_rows = order[: n_train - n_val], order[n_train - n_val :]
    vocabulary = build_vocabulary((train_tokens[i] for i in fit_rows), vocab_size)

    def ids(token_lists: Iterable[Sequence[str]]) -> torch.Tensor:
        rows = [encode(t, vocabulary, max_len) for t in token_lists]
        return torch.from_numpy(np.stack(rows)) if rows else torch.zeros(0, max_len, dtype=torch.long)

    train_labels = torch.from_numpy(labels).float()
    return Dataset(
        name="text/imdb",
        task=Task.BINARY,
        x_train=ids(train_tokens[i] for i in fit_rows),
        y_train=train_labels[torch.from_numpy(fit_rows)],
        x_val=ids(train_tokens[i] for i in val_rows),
        y_val=train_labels[torch.from_numpy(val_rows)],
        x_test=ids(tokenise(t) for t in test_texts),
        y_test=torch.from_numpy(test_labels).float(),
    )
