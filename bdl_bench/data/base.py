"""The one record every data loader returns, and the dataset registry.

A loader is a function registered under the name a user types after ``data=`` (``uci/boston``,
``libsvm/a1a``); it receives the keyword arguments of ``conf/data/<name>.yaml`` (except ``name``) and
returns a :class:`Dataset` whose tensors are already standardised/encoded and ready to train on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch
from torch import Tensor

from bdl_bench.registry import registrar


class Task(str, Enum):
    """What the targets are; picks the likelihood."""

    REGRESSION = "regression"  # real targets (standardised with training statistics), Gaussian likelihood
    BINARY = "binary"  # targets in {0, 1} (float), Bernoulli likelihood on one logit
    MULTICLASS = "multiclass"  # integer class labels (long), categorical likelihood on n_classes logits


@dataclass(frozen=True)
class Dataset:
    """A train / validation / test split held in memory as float tensors.

    Inputs are ``(N, D)`` float tensors; targets are ``(N,)``: float for regression and binary tasks,
    long for multiclass. For regression, targets are standardised with training statistics and
    ``y_mean``/``y_std`` map predictions back to original units (RMSE and log-likelihood are reported
    in original units, as in Gal & Ghahramani's protocol). ``x_val``/``y_val`` are empty when no
    validation part was asked for.

    Vision sets hold images as ``(N, C, H, W)`` floats (or ``(N, C·H·W)`` when flattened), text sets
    token ids as ``(N, T)`` longs. ``augmentation(x, generator) -> x`` is a random transform the training
    loop may apply to each training minibatch (CIFAR crop and flip).
    """

    name: str
    task: Task
    x_train: Tensor  # (N_train, D)
    y_train: Tensor  # (N_train,)
    x_val: Tensor  # (N_val, D)
    y_val: Tensor  # (N_val,)
    x_test: Tensor  # (N_test, D)
    y_test: Tensor  # (N_test,)
    y_mean: float = 0.0
    y_std: float = 1.0
    n_classes: int | None = None
    x_ood: Tensor | None = None  # (N_ood, ...) out-of-distribution inputs, preprocessed like x_test
    y_ood: Tensor | None = None  # (N_ood,) their own labels (not classes of this task), or None
    ood_name: str | None = None  # dataset the OOD inputs come from, e.g. "vision/notmnist"
    augmentation: Callable[[Tensor, torch.Generator], Tensor] | None = None  # training-batch transform

    def __post_init__(self) -> None:
        if self.y_ood is not None and (self.x_ood is None or self.x_ood.shape[0] != self.y_ood.shape[0]):
            raise ValueError(f"dataset {self.name!r}: y_ood needs an x_ood with as many rows")
        for part in ("train", "val", "test"):
            x, y = getattr(self, f"x_{part}"), getattr(self, f"y_{part}")
            if x.shape[0] != y.shape[0]:
                raise ValueError(f"dataset {self.name!r}: x_{part} has {x.shape[0]} rows but y_{part} has {y.shape[0]}")
        if self.x_train.shape[0] == 0:
            raise ValueError(f"dataset {self.name!r} has an empty training set")
        if self.x_test.shape[0] == 0:
            raise ValueError(f"dataset {self.name!r} has an empty test set")

    @property
    def n_features(self) -> int:
        """Width of an input row; for images ``(N, C, H, W)`` the number of channels C."""
        return self.x_train.shape[1]

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one input: ``(D,)``, ``(C, H, W)`` for images, ``(T,)`` for token sequences."""
        return tuple(self.x_train.shape[1:])

    @property
    def n_train(self) -> int:
        return self.x_train.shape[0]

    def with_dtype(self, dtype: torch.dtype) -> Dataset:
        """A copy whose floating tensors have ``dtype`` (labels keep theirs)."""
        return dataclasses.replace(
            self,
            **{
                f.name: value.to(dtype)
                for f in dataclasses.fields(self)
                if isinstance(value := getattr(self, f.name), Tensor) and value.is_floating_point()
            },
        )

    @property
    def n_outputs(self) -> int:
        """Width of the model's output layer for this task."""
        if self.task is Task.MULTICLASS:
            assert self.n_classes is not None
            return self.n_classes
        return 1


DatasetLoader = Callable[..., Dataset]
DATASETS: dict[str, DatasetLoader] = {}
register_dataset = registrar(DATASETS, "dataset")


def default_data_root() -> Path:
    """The shipped ``data/`` folder at the repository root (the package is installed editable)."""
    return Path(__file__).resolve().parents[2] / "data"


def as_float(x: object) -> Tensor:
    return torch.as_tensor(x, dtype=torch.float32)
