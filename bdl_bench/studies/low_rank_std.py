r"""Post-training low-rank study of mean-field standard deviations (Swiatkowski et al. 2020, Sec. 2).

Take a network trained with GMFVI (``method=gmfvi``): each linear layer's weights have a matrix
:math:`A` of posterior standard deviations. The paper finds that :math:`A` has strong low-rank
structure:

- **Spectrum** (Fig. 3, Fig. 5 top): the fraction of variance explained by each singular value,
  :math:`\gamma_k^2 / \sum_i \gamma_i^2`, for :math:`A` and, for contrast, for the matrix of means
  (:func:`explained_variance`, :func:`spectra`).
- **Replacement** (Tables 2 and 3, Fig. 5 bottom): replace every :math:`A` by its rank-k truncated SVD
  :math:`A_k` and evaluate the resulting mean-field posterior over 100 weight samples: the negative ELBO
  (per training example: :math:`-(\log p(\mathcal D \mid \theta_s) - \mathrm{KL}(q_k \| p)) / N`),
  the test NLL, accuracy and Brier score of each sampled network (mean and standard error over the
  samples, as the paper reports them), plus the metrics of the predictive mixture (ECE among them,
  which the paper gives without an error bar).

:math:`A_k` can have negative (or zero) entries where :math:`A` is small; a standard deviation must be
positive (and the KL has :math:`-\log\sigma`), so :func:`low_rank_nonnegative` clamps :math:`A_k` from
below at the smallest entry of :math:`A` (the paper keeps the approximation non-negative without
saying how; the rank-1 truncation of a positive matrix is already positive). Biases keep their
standard deviations.

**Which matrices** (:func:`std_matrices`): the paper studies "only the dense layers" of its MLP, CNN and LSTM
and, for ResNet-18, "the convolutional layers as well" (Sec. 2.3). Here a dense layer is an ``nn.Linear``
weight ``(out, in)`` and each of an ``nn.LSTM``'s kernels ``weight_ih_l<k>`` ``(4H, in)`` and ``weight_hh_l<k>``
``(4H, H)`` (Keras' LSTM cell kernel and recurrent kernel, which are dense matrices and which the k-tied
method ties); with ``conv`` an ``nn.Conv2d`` kernel counts as its reshaped ``(C_out, C_in/groups·kh·kw)``
matrix (the paper reshapes TensorFlow's ``(kh, kw, C_in, C_out)`` kernel to a matrix: the transpose of ours up
to a permutation of rows, so the same singular values). Embeddings and other weights keep their stds.

A study starts from a fitted method or from a finished run folder (``bdl-bench reproduce ktied_table2``
does the latter, through :mod:`bdl_bench.report.ktied`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import Tensor, nn

from bdl_bench.data.base import Dataset
from bdl_bench.likelihoods import Bernoulli, Categorical, Gaussian, Likelihood
from bdl_bench.methods._diag_vi import kl_diag_to_prior, standard_normal
from bdl_bench.methods._layerwise_vi import VARIATIONAL_LAYERS, Layer, forward_networks, is_dense, model_layers
from bdl_bench.metrics import brier_score, predictive_metrics

_SAMPLE_CHUNK = 20  # weight samples per batched forward pass
_DATA_CHUNK = 1000  # examples per forward pass of a network that is not dense (a CNN's activations are large)
_STUDY = "low-rank std study"  # names the study in model_layers' errors


@dataclass(frozen=True)
class StdMatrix:
    """One weight of the model seen as a matrix whose standard deviations the study approximates."""

    label: str  # "dense 2", "conv 5", "lstm weight_hh_l0": the kind's 1-based count, or the LSTM kernel's name
    layer: int  # the layer's 1-based index among the model's parametrised modules
    entries: slice  # the weight's entries in the flat parameter vector (row-major, so the matrix is a view)
    shape: tuple[int, int]  # (rows, columns): (out, in), (C_out, C_in/groups·kh·kw), (4H, in) or (4H, H)

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    def tied_size(self, rank: int) -> int:
        """Numbers that define a rank-``rank`` factorisation ``U Vᵀ`` of the ``m x n`` matrix: ``k(m + n)``,
        ``k = min(rank, m, n)``."""
        m, n = self.shape
        return min(rank, m, n) * (m + n)


def std_matrices(layers: Sequence[Layer], *, conv: bool) -> list[StdMatrix]:
    """The weight matrices the study approximates (the module docstring): every ``nn.Linear`` weight and
    ``nn.LSTM`` kernel, and with ``conv`` every ``nn.Conv2d`` kernel, in the flat order."""
    counts: Counter[str] = Counter()
    found = []
    for layer in layers:
        module = layer.module
        if isinstance(module, nn.LSTM):
            for name, _ in layer.weight_matrices:
                weight = getattr(module, name)
                found.append(StdMatrix(f"lstm {name}", layer.index, layer.slices[name], tuple(weight.shape)))
        elif isinstance(module, nn.Linear) or (conv and isinstance(module, nn.Conv2d)):
            kind = "dense" if isinstance(module, nn.Linear) else "conv"
            counts[kind] += 1
            shape = (layer.out_features, layer.in_features)
            found.append(StdMatrix(f"{kind} {counts[kind]}", layer.index, layer.slices["weight"], shape))
    if not found:
        what = "nn.Linear, nn.LSTM or nn.Conv2d" if conv else "nn.Linear or nn.LSTM (conv=true adds nn.Conv2d)"
        raise ValueError(f"{_STUDY}: the model has no {what} weight to study")
    return found


@dataclass(frozen=True)
class MeanFieldNetwork:
    """A fitted mean-field Gaussian posterior over the parameters of a network of
    :data:`~bdl_bench.methods._layerwise_vi.VARIATIONAL_LAYERS`, and the std matrices the study looks at."""

    model: nn.Module  # the network (its own parameters are not used)
    matrices: list[StdMatrix]  # the studied weights (std_matrices)
    mean: Tensor  # (D,) posterior mean of every parameter
    std: Tensor  # (D,) posterior standard deviation
    prior_precision: Tensor  # (D,) of the zero-mean Gaussian prior
    dense: bool  # an nn.Sequential of nn.Linear layers: all samples in one batched pass per layer

    @classmethod
    def from_method(cls, method: Any, *, conv: bool = False) -> MeanFieldNetwork:
        """From a fitted ``gmfvi`` or ``ktied`` method (anything whose ``posterior()`` is diagonal)."""
        q = method.posterior()
        if q is None or not hasattr(q, "prec_diag"):
            raise ValueError(f"{_STUDY}: method {method.name!r} has no diagonal posterior")
        model, prior = method.problem.model, method.problem.prior_precision.detach().to(q.mean)
        return cls._of(model, q.mean.detach(), q.prec_diag.detach().rsqrt(), prior, conv)

    @classmethod
    def from_run(
        cls, run_dir: Path, *, conv: bool = False, device: str = "auto"
    ) -> tuple[MeanFieldNetwork, Dataset, Likelihood]:
        """From a finished run folder: rebuild data, model and likelihood from ``config.yaml`` and read
        the posterior from ``posterior.pt`` (written with ``trainer.save_posterior=true``), which must be diagonal.
        The network computes on ``device`` (``auto``: a GPU where there is one); the data stay on the CPU.
        """
        from bdl_bench.data import build_dataset
        from bdl_bench.gaussians.io import load_gaussian
        from bdl_bench.likelihoods import build_likelihood
        from bdl_bench.models import build_model
        from bdl_bench.models.params import prior_precision_vector
        from bdl_bench.orchestration.devices import resolve_device
        from bdl_bench.results import CONFIG_FILE, read_config

        run_dir = Path(run_dir)
        cfg = read_config(run_dir / CONFIG_FILE)
        q = load_gaussian(run_dir / "posterior.pt")
        if not hasattr(q, "prec_diag"):
            raise ValueError(f"{run_dir}: the posterior is a {type(q).__name__}, not a diagonal Gaussian")
        dataset = build_dataset(cfg["data"]).with_dtype(q.mean.dtype)
        model = build_model(cfg["model"], in_features=dataset.n_features, out_features=dataset.n_outputs)
        where = resolve_device(device)
        model = model.to(device=where, dtype=q.mean.dtype).eval()
        prior = prior_precision_vector(model, float(cfg["prior_precision"]), cfg.get("bias_prior_precision"))
        mean, std = q.mean.to(where), q.prec_diag.rsqrt().to(where)
        net = cls._of(model, mean, std, prior, conv)
        return net, dataset, build_likelihood(dataset, cfg.get("noise_precision"))

    @classmethod
    def _of(cls, model: nn.Module, mean: Tensor, std: Tensor, prior: Tensor, conv: bool) -> MeanFieldNetwork:
        layers = model_layers(model, _STUDY, VARIATIONAL_LAYERS)
        return cls(model, std_matrices(layers, conv=conv), mean, std, prior, is_dense(model, layers))

    def split(self, flat: Tensor) -> list[Tensor]:
        """``flat (D,)`` → one tensor per model parameter (views)."""
        shapes = [p.shape for p in self.model.parameters()]
        parts = torch.split(flat, [math.prod(s) for s in shapes])
        return [p.view(s) for p, s in zip(parts, shapes)]

    def weight_stds(self) -> list[Tensor]:
        """Each studied matrix :math:`A` of weight standard deviations (views into ``std``)."""
        return [self.std[m.entries].view(m.shape) for m in self.matrices]

    def weight_means(self) -> list[Tensor]:
        return [self.mean[m.entries].view(m.shape) for m in self.matrices]

    def outputs(self, thetas: Tensor, x: Tensor) -> Tensor:
        """Outputs ``(S, N, out)`` on the CPU of the networks with flat parameters ``thetas (S, D)`` at ``x``
        (moved to the network's device; a network that is not dense in chunks of examples)."""
        chunk = max(1, x.shape[0]) if self.dense else _DATA_CHUNK
        starts = range(0, x.shape[0], chunk) or [0]  # an empty x: one pass, for the output's shape
        parts = [
            forward_networks(self.model, thetas, x[i : i + chunk].to(thetas.device), self.dense).cpu() for i in starts
        ]
        return torch.cat(parts, dim=1)


def explained_variance(matrix: Tensor) -> Tensor:
    """Fraction of variance explained by each singular value, :math:`\\gamma_k^2 / \\sum_i \\gamma_i^2`,
    in decreasing order: ``(min(m, n),)``."""
    singular = torch.linalg.svdvals(matrix.double())
    return (singular**2 / (singular**2).sum()).to(matrix.dtype)


def low_rank_nonnegative(matrix: Tensor, rank: int) -> Tensor:
    """The rank-``rank`` truncated SVD of a positive ``matrix``, clamped from below at its smallest entry (a rank at
    or above ``min(m, n)`` returns ``matrix`` itself)."""
    if int(rank) != rank or rank < 1:
        raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
    if rank >= min(matrix.shape):
        return matrix.clone()
    u, s, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    approx = (u[:, :rank] * s[:rank]) @ vh[:rank]
    return approx.clamp_min(float(matrix.min())).to(matrix.dtype)


def with_low_rank_std(net: MeanFieldNetwork, rank: int) -> MeanFieldNetwork:
    """``net`` with every weight matrix of standard deviations replaced by :func:`low_rank_nonnegative`."""
    std = net.std.clone()
    for matrix in net.matrices:
        block = std[matrix.entries].view(matrix.shape)
        block.copy_(low_rank_nonnegative(block, rank))
    return dataclasses.replace(net, std=std)


def spectra(net: MeanFieldNetwork) -> pd.DataFrame:
    """Explained variance per singular value of each studied std and mean matrix (Fig. 3 / Fig. 5): rows
    ``matrix`` (its label, ``dense 1``), ``layer`` (1-based), ``shape`` (``"rows x columns"``), ``parameter``
    (``std`` or ``mean``), ``k`` (1-based singular value index), ``fraction``, ``cumulative``."""
    rows = []
    for info, std, mean in zip(net.matrices, net.weight_stds(), net.weight_means()):
        shape = f"{info.shape[0]} x {info.shape[1]}"
        for parameter, matrix in (("std", std), ("mean", mean)):
            fractions = explained_variance(matrix).cpu()
            cumulative = torch.cumsum(fractions, 0)
            for k, (f, c) in enumerate(zip(fractions.tolist(), cumulative.tolist()), start=1):
                row = dict(matrix=info.label, layer=info.layer, shape=shape, parameter=parameter, k=k)
                rows.append({**row, "fraction": f, "cumulative": c})
    return pd.DataFrame(rows)


@torch.no_grad()
def weight_sample_metrics(
    net: MeanFieldNetwork, dataset: Dataset, likelihood: Likelihood, *, n_samples: int, generator: torch.Generator
) -> dict[str, float]:
    """Metrics of ``n_samples`` networks drawn from ``net``: mean and standard error over the samples.

    Per sample s: ``neg_elbo`` (per training example, targets as fitted), ``test_neg_elbo`` (the test NLL per
    example plus KL / N, N the training examples: the ELBO per example estimated on the test set), ``nll`` (test,
    per example; regression in original target units), and ``accuracy`` and ``brier`` (classification) or ``rmse``
    (regression). Keys ``<metric>_mean`` and ``<metric>_sem``, plus ``ensemble_<metric>`` for the
    predictive mixture of all samples (``bdl_bench.metrics.predictive_metrics``: ``nll``, ``accuracy``,
    ``ece``, ``brier``, or ``rmse``, ``test_ll``).
    """
    kl = float(kl_diag_to_prior(net.mean, net.std, net.prior_precision))
    jacobian = math.log(dataset.y_std) if isinstance(likelihood, Gaussian) else 0.0
    per_sample: dict[str, list[float]] = {"neg_elbo": [], "test_neg_elbo": [], "nll": []}
    test_outputs = []
    for start in range(0, n_samples, _SAMPLE_CHUNK):
        n = min(_SAMPLE_CHUNK, n_samples - start)
        thetas = net.mean + net.std * standard_normal((n, net.mean.numel()), generator, net.mean)
        f_train, f_test = net.outputs(thetas, dataset.x_train), net.outputs(thetas, dataset.x_test)
        test_outputs.append(f_test)
        for s in range(n):
            per_sample["neg_elbo"].append(
                (float(likelihood.nll(f_train[s], dataset.y_train).sum()) + kl) / dataset.n_train
            )
            test_nll = float(likelihood.nll(f_test[s], dataset.y_test).mean())
            per_sample["test_neg_elbo"].append(test_nll + kl / dataset.n_train)
            per_sample["nll"].append(test_nll + jacobian)
            if isinstance(likelihood, Bernoulli | Categorical):
                probs = likelihood.probs(f_test[s : s + 1])
                per_sample.setdefault("accuracy", []).append(
                    float((probs.argmax(-1) == dataset.y_test.long()).float().mean())
                )
                per_sample.setdefault("brier", []).append(brier_score(probs, dataset.y_test))
            else:
                err = (f_test[s].squeeze(-1) - dataset.y_test) * dataset.y_std
                per_sample.setdefault("rmse", []).append(float(err.pow(2).mean().sqrt()))
    out: dict[str, float] = {}
    for name, values in per_sample.items():
        t = torch.tensor(values, dtype=torch.float64)
        sem = float(t.std(correction=1) / math.sqrt(len(t))) if len(t) > 1 else float("nan")
        out[f"{name}_mean"], out[f"{name}_sem"] = float(t.mean()), sem
    ensemble = predictive_metrics(
        likelihood, torch.cat(test_outputs), dataset.y_test, y_mean=dataset.y_mean, y_std=dataset.y_std
    )
    out.update({f"ensemble_{k}": v for k, v in ensemble.items()})
    out["kl"] = kl
    return out


def low_rank_study(
    net: MeanFieldNetwork,
    dataset: Dataset,
    likelihood: Likelihood,
    *,
    ranks: Sequence[int] = (1, 2, 3),
    n_samples: int = 100,
    generator: torch.Generator,
) -> pd.DataFrame:
    """Table 2 / Table 3 of the paper: one row per posterior, the mean-field one and its rank-k approximations:
    ``approximation`` (``mean_field``, ``rank_1``, ...), ``rank`` (0 for none), ``n_std_params`` (numbers that
    define the weight stds: ``mn`` or ``k(m + n)`` per layer), and the keys of :func:`weight_sample_metrics`. Every
    row uses the same noise draws (the generator's state is restored before each), so differences between rows
    are not sampling noise."""
    state = generator.get_state()
    rows = []
    for rank in (0, *ranks):
        approx = net if rank == 0 else with_low_rank_std(net, rank)
        generator.set_state(state)
        metrics = weight_sample_metrics(approx, dataset, likelihood, n_samples=n_samples, generator=generator)
        n_std = sum(m.size if rank == 0 else m.tied_size(rank) for m in net.matrices)
        name = "mean_field" if rank == 0 else f"rank_{rank}"
        rows.append({"approximation": name, "rank": rank, "n_std_params": n_std, **metrics})
    return pd.DataFrame(rows)
