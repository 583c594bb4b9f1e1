r"""Laplace approximations after a MAP fit: diagonal, KFAC, EFB, DEF, exact block-diagonal and full.

Lee et al. (2020), "Representing model uncertainty of neural networks in sparse information form".
The posterior is :math:`\mathcal N(\theta_{MAP}, P^{-1})` with

.. math::

    P \approx N\,\mathbf I + \operatorname{diag}(\tau),\qquad
    \mathbf I = \tfrac1n\textstyle\sum_i \mathbb E[\delta\theta_i\,\delta\theta_i^\top],

the mean curvature :math:`\mathbf I` over the n training examples (GGN, or the Fisher with labels
sampled from the model: ``curvature``), the prior precision :math:`\tau` (``prior_precision``; by
default the run's per-parameter prior, which is also MAP's weight decay) and the paper's
dataset-size scaling N (``dataset_scale``; by default n, which makes P the Hessian of the negative
log joint under the GGN). Lee et al. tune N and :math:`\tau` as hyperparameters (App. E.3.1):
``search`` does that on the run's validation set from one curvature pass (N and :math:`\tau` enter
only the cheap assembly of P), writes the grid to ``laplace_search.csv`` and the chosen point to
``metrics.json`` (``chosen_dataset_scale``, ``chosen_prior_precision``).
``structure`` picks the approximation of :math:`\mathbf I` (``bdl_bench.curvature``), each held by
its own ``StructuredGaussian``:

* ``diag``: :math:`\operatorname{diag}(\mathbf I)` → ``DiagGaussian`` (Ritter et al. 2018's Diag);
* ``kfac``: per layer :math:`(\sqrt N G + \sqrt{\tau_l}I)\otimes(\sqrt N A + \sqrt{\tau_l}I)`, eq. 3
  → ``KroneckerGaussian`` (``kfac_prior: damped``, the paper's). Eq. 3 has room for one :math:`\tau_l` per
  layer only; a layer whose prior differs within it (a bias prior, ``bias_prior_precision``) gets the exact
  :math:`NG\otimes A + I\otimes\operatorname{diag}(t)` (t: the prior of each input column, the bias last) in
  the Kronecker eigenbasis of G and of :math:`T^{-1/2}AT^{-1/2}` → ``ScaledEigenKroneckerGaussian``;
  ``kfac_prior: exact`` uses that form, :math:`NG\otimes A + \operatorname{diag}(\tau)`, for every layer
  (as laplace-torch's KronLaplace);
* ``efb``: :math:`(U_G\otimes U_A)(N\Lambda + \tau_l)(U_G\otimes U_A)^\top`, eq. 4 → ``EigenKroneckerGaussian``;
* ``def``: :math:`(U_{G,1:g}\otimes U_{A,1:a})(N\Lambda_{1:L})(\cdot)^\top + \operatorname{diag}(N D + \tau)`,
  eq. 9, with Alg. 1 keeping the top ``rank`` eigenvalues per layer (``null``: all) and D the
  diagonal correction of eq. 5 → ``KroneckerLowRankPlusDiagGaussian``. D may be negative (the exact
  diagonal is below that of the kept low-rank part; Lemma 3's sufficient condition D > 0 fails);
  the precision stays positive definite, with the exact diagonal, as long as :math:`ND + \tau > 0`.
  Where that fails D is clipped at 0 (prec_diag = τ there; the clipping Lee et al. recommend), and
  ``fit_info["n_clipped"]`` counts the entries;
* ``block``: the exact per-layer blocks :math:`N\mathbf I_l + \operatorname{diag}(\tau)` ("FB") →
  ``BlockDiagGaussian``;
* ``full``: the whole :math:`N\mathbf I + \operatorname{diag}(\tau)` → ``FullGaussian`` (small nets).

Curvature is computed from the whole training set (or a random ``curvature_subset`` of it: the mean
:math:`\mathbf I` is then estimated from that many examples, still scaled by N) in chunks of
``curvature_batch_size``. EFB and DEF take a second pass in the Kronecker eigenbasis of the first; it
runs over the first pass's layer inputs and output gradients, kept up to ``curvature_cache_mib`` MiB, and
recomputes only the chunks beyond that, on the first pass's sampled labels: KFAC factors, EFB
eigenvalues and the diagonal all come from the same Fisher sample. The per-chunk work (forward,
backward, the GEMMs of the factors, EFB's rotations) runs in ``curvature_dtype`` (``model``: the
model's dtype, float32 for the image nets); sums across chunks, eigendecompositions and the
posterior's construction are float64, and the posterior is then cast to the model's dtype.
``predict`` either samples networks (``predictive: sample``, Lee et al. eq. 7) or the linearised model
:math:`f(x;\theta_{MAP}) + J(x)(\theta_s - \theta_{MAP})` (``predictive: linearised``).

The MAP: by default ``fit`` runs the MAP loop of ``methods/map.py`` (Adam, learning rate ``lr``,
``trainer.n_epochs`` epochs) and fits the posterior right before the last epoch's callback, so the
last ``history.csv`` row and the final metrics are the Laplace predictive (earlier rows are MAP).
With ``map_dir`` it instead takes :math:`\theta_{MAP}` from a finished run folder (see
:func:`load_map_parameters`) and trains nothing.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import logging
import math
import time
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import Tensor, nn
from torch.func import jacrev, jvp, vmap

from bdl_bench.checkpoint import load_params
from bdl_bench.curvature.def_lowrank import diagonal_correction, sparsify
from bdl_bench.curvature.exact import exact_blocks, exact_matrix
from bdl_bench.curvature.kron import ChunkCache, diagonal, efb_eigenvalues, eigenbasis, flat_to_grid, kron_factors
from bdl_bench.curvature.pseudo_grads import CurvatureKind, KronLayout, block_index, iter_pseudo_grads, kron_layout
from bdl_bench.errors import ConfigError
from bdl_bench.gaussians import DiagGaussian, FullGaussian, StructuredGaussian
from bdl_bench.gaussians.blocks import BlockDiagGaussian, pack
from bdl_bench.gaussians.def_lowrank import KroneckerLowRankPlusDiagGaussian
from bdl_bench.gaussians.io import load_gaussian
from bdl_bench.gaussians.kron import EigenKroneckerGaussian, KroneckerGaussian, ScaledEigenKroneckerGaussian
from bdl_bench.likelihoods import Gaussian
from bdl_bench.methods.base import EpochCallback, Method, Problem, register_method
from bdl_bench.methods.map import map_step
from bdl_bench.methods.vogn import parse_choice
from bdl_bench.metrics import predictive_metrics
from bdl_bench.models import build_model
from bdl_bench.models.params import flat_params, forward_with
from bdl_bench.optim import adam, load_adam_state
from bdl_bench.progress import delayed_bar
from bdl_bench.results import CHECKPOINT_FILE, PARAMS_FILE

logger = logging.getLogger(__name__)

_PREDICT_CHUNK = 64  # most posterior samples drawn at once
_SAMPLE_BUDGET = 2**24  # entries of the parameter samples drawn at once (samples x D): 64 MiB in float32
_PREDICT_BUDGET = 2**21  # activation entries (samples x examples x widest layer) per forward pass
MAX_DEF_RANK = 16384  # largest L per layer for DEF (its L x L core: 2 GiB in float64)
_CURVATURE_DTYPES: dict[str, torch.dtype | None] = {"model": None, "float32": torch.float32, "float64": torch.float64}
SEARCH_FILE = "laplace_search.csv"  # the (N, τ) grid of method.search, one row per point
_SEARCH_COLUMNS = ("accuracy", "ece", "nll", "rmse")  # validation metrics kept per grid point (where defined)


@dataclasses.dataclass(frozen=True)
class SearchSettings:
    """``method.search``: choose N and τ on the validation set (Lee et al. 2020, App. E.3.1: N in
    {1, 50000, 100000}, 100 values of τ, the minimum-ECE point with accuracy like the MAP's).

    Attributes:
        dataset_scale: the grid of N (> 0).
        prior_precision: the grid of τ (> 0).
        n_samples: posterior samples per grid point.
        max_val_examples: use the first this many validation examples (``None``: all).
        criterion: the validation metric to minimise (``ece``, ``nll``, ``brier``; ``nll``/``rmse`` for regression).
        accuracy_tolerance: eligible points keep validation accuracy >= the MAP's minus this
            (``None``: all points; ignored for regression).
        prune_accuracy_drop: per N, skip the smaller τ once accuracy is this far below the MAP's
            (``None``: evaluate every point).
    """

    dataset_scale: tuple[float, ...]
    prior_precision: tuple[float, ...]
    n_samples: int = 5
    max_val_examples: int | None = 2000
    criterion: str = "ece"
    accuracy_tolerance: float | None = 0.005
    prune_accuracy_drop: float | None = 0.05

    @classmethod
    def parse(cls, cfg: Mapping[str, Any]) -> SearchSettings:
        """Settings from the config mapping.

        Raises:
            ValueError: on an unknown key (the keys are listed), an empty or non-positive grid, or a bad count.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ConfigError(f"laplace: unknown method.search keys {unknown}; known: {', '.join(sorted(known))}")
        out = {k: v for k, v in cfg.items()}
        for key in ("dataset_scale", "prior_precision"):
            values = out.get(key)
            if isinstance(values, Mapping):
                values = _logspace(key, values)
            values = [values] if isinstance(values, int | float) else list(values or [])
            if not values or not all(float(v) > 0 for v in values):
                raise ConfigError(
                    f"laplace: method.search.{key} must be a non-empty list of positive numbers, got {values}"
                )
            out[key] = tuple(float(v) for v in values)
        settings = cls(**out)
        for name, value in (("n_samples", settings.n_samples), ("max_val_examples", settings.max_val_examples or 1)):
            if int(value) != value or value < 1:
                raise ConfigError(f"laplace: method.search.{name} must be an integer >= 1, got {value}")
        return settings


@dataclasses.dataclass(frozen=True)
class MarglikSettings:
    """``method.search=marglik``: maximise the Laplace log marginal likelihood (MacKay 1992; Immer et al. 2021)

    .. math::

        \\log p(\\mathcal D\\mid\\tau,\\gamma) \\approx \\log p(\\mathcal D\\mid\\theta_*,\\gamma)
        - \\tfrac12\\textstyle\\sum_d\\tau_d\\theta_{*d}^2 + \\tfrac12\\sum_d\\log\\tau_d - \\tfrac12\\log|P(\\tau,\\gamma)|

    over the prior precision τ (one per layer, weights and bias alike, or one scalar) and, for a Gaussian
    likelihood, the noise precision γ, at the MAP :math:`\\theta_*`, with the posterior's own precision
    :math:`P = N(\\gamma/\\gamma_0)\\mathbf I + \\operatorname{diag}(\\tau)` in the chosen ``structure``: the curvature of a
    Gaussian likelihood is linear in γ (GGN and Fisher alike), so its eigenvalues scale with it and the gradient
    of :math:`\\log|P|` in γ is exact (KFAC's included, through its factors' eigenvalues or Choleskys). Adam on
    :math:`\\log\\tau`, :math:`\\log\\gamma` from the run's values, one curvature pass; no validation data.

    Attributes:
        prior: ``layer`` (one τ per weight layer) or ``scalar``.
        noise: regression only (ignored for classification): ``true`` fits γ jointly with τ; ``false`` keeps the
            run's γ; ``residual`` fixes :math:`\\gamma = n / \\sum_i (f_*(x_i) - y_i)^2`, the inverse mean squared
            training residual of the MAP, and fits τ only (laplace-torch's usual recipe: ``sigma_noise`` from the
            residuals, then ``optimize_prior_precision``). A MAP that fits its training set closely gives a γ above
            the joint optimum: on UCI boston/yacht the residual γ is ≈ 3× the joint one and scores a higher test LL.
        n_steps: Adam steps.
        lr: Adam learning rate (on the logarithms).
    """

    prior: str = "layer"
    noise: bool | str = True
    n_steps: int = 300
    lr: float = 0.1

    @classmethod
    def parse(cls, cfg: Mapping[str, Any] | None) -> MarglikSettings:
        """Settings from ``method.search.marglik`` (``None``: the defaults).

        Raises:
            ValueError: on an unknown key or a bad value (named).
        """
        cfg = dict(cfg or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ConfigError(
                f"laplace: unknown method.search.marglik keys {unknown}; known: {', '.join(sorted(known))}"
            )
        settings = cls(**cfg)
        if settings.noise not in (True, False, "residual"):
            raise ConfigError(
                f"laplace: method.search.marglik.noise must be true, false or residual, got {settings.noise!r}"
            )
        if settings.prior not in ("layer", "scalar"):
            raise ConfigError(f"laplace: method.search.marglik.prior must be layer or scalar, got {settings.prior!r}")
        if int(settings.n_steps) != settings.n_steps or settings.n_steps < 1 or not settings.lr > 0:
            raise ConfigError(
                f"laplace: method.search.marglik needs n_steps >= 1 and lr > 0, got {settings.n_steps}, {settings.lr}"
            )
        return settings


def _parse_search(search: Mapping[str, Any] | str | None) -> SearchSettings | MarglikSettings | None:
    """``method.search``: ``null``, ``marglik``, ``{marglik: {...}}`` or a validation grid (:class:`SearchSettings`)."""
    if search is None:
        return None
    if isinstance(search, str):
        if search != "marglik":
            raise ConfigError(
                f"laplace: method.search must be null, marglik, {{marglik: {{...}}}} or a grid mapping, got {search!r}"
            )
        return MarglikSettings.parse(None)
    if set(search) == {"marglik"}:
        return MarglikSettings.parse(search["marglik"])
    return SearchSettings.parse(search)


def _logspace(key: str, spec: Mapping[str, Any]) -> list[float]:
    """``{logspace: [a, b, n]}``: n values from 10^a to 10^b, evenly spaced in the logarithm.

    Raises:
        ValueError: on another mapping or a bad triple (naming ``method.search.<key>``).
    """
    triple = spec.get("logspace") if set(spec) == {"logspace"} else None
    if not isinstance(triple, list | tuple) or len(triple) != 3 or int(triple[2]) != triple[2] or triple[2] < 1:
        raise ConfigError(
            f"laplace: method.search.{key} must be a list of positive numbers or {{logspace: [a, b, n]}} "
            f"(n >= 1 values from 10^a to 10^b), got {dict(spec)}"
        )
    return torch.logspace(float(triple[0]), float(triple[1]), int(triple[2]), dtype=torch.float64).tolist()


class Structure(str, Enum):
    """The approximation of the curvature (module docstring)."""

    DIAG = "diag"
    """Exact diagonal only (Diag Laplace)."""
    KFAC = "kfac"
    """Per-layer Kronecker factors with eq. 3's damping (KFAC Laplace)."""
    EFB = "efb"
    """Kronecker eigenbasis with refitted eigenvalues (George et al. 2018)."""
    DEF = "def"
    """EFB, low rank by Alg. 1, plus the diagonal correction (Lee et al. 2020)."""
    BLOCK = "block"
    """Exact per-layer blocks (FB)."""
    FULL = "full"
    """The whole D x D curvature."""


class KfacPrior(str, Enum):
    r"""How ``structure=kfac`` adds the prior to :math:`NG\otimes A` (module docstring)."""

    DAMPED = "damped"
    r"""Lee et al. eq. 3: :math:`(\sqrt N G + \sqrt\tau I)\otimes(\sqrt N A + \sqrt\tau I)` (exact where τ varies in a layer)."""
    EXACT = "exact"
    r""":math:`NG\otimes A + \operatorname{diag}(\tau)`, in the Kronecker eigenbasis."""


class Predictive(str, Enum):
    """How ``predict`` turns parameter samples into output samples."""

    SAMPLE = "sample"
    """Evaluate the network at sampled parameters."""
    LINEARISED = "linearised"
    """Evaluate the network's first-order Taylor expansion around the MAP."""


_STRUCTURE_CLASSES: dict[Structure, type[StructuredGaussian]] = {
    Structure.DIAG: DiagGaussian,
    Structure.KFAC: KroneckerGaussian,
    Structure.EFB: EigenKroneckerGaussian,
    Structure.DEF: KroneckerLowRankPlusDiagGaussian,
    Structure.BLOCK: BlockDiagGaussian,
    Structure.FULL: FullGaussian,
}


def _posterior_class(structure: Structure, fields: set[str]) -> type[StructuredGaussian]:
    """The Gaussian class of a saved ``structure`` posterior with these fields (KFAC has two)."""
    if structure is Structure.KFAC and "in_scale" in fields:
        return ScaledEigenKroneckerGaussian
    return _STRUCTURE_CLASSES[structure]


def load_map_parameters(map_dir: str | Path, model: nn.Module) -> Tensor:
    """:math:`\\theta_{MAP}` from a finished run folder, after checking its model matches ``model``.

    The folder must hold the run's ``config.yaml`` and, in order of preference, ``params.pt`` (the
    final flat parameters every finished run of ``map``, ``dropout``, ``laplace`` or a VI method
    keeps: :func:`bdl_bench.checkpoint.save_params`), ``checkpoint.pt`` (a method state dict with
    ``theta``, as ``MAP.state_dict`` writes it, optionally under a ``"method"`` key: an unfinished
    run, or one from before ``params.pt`` existed) or ``posterior.pt`` (a saved Gaussian; its mean is
    used: a Laplace run's posterior is centred at the MAP it trained). The folder's ``model`` config
    is rebuilt with ``model``'s input and output widths and must give the same modules.

    Raises:
        ValueError: if the folder holds none of these files, or its model config differs from
            ``model`` (both are named).
    """
    folder = Path(map_dir)
    cfg_path = folder / "config.yaml"
    if not cfg_path.is_file():
        raise ConfigError(f"laplace: map_dir {folder} is not a run folder (no config.yaml)")
    saved_cfg = yaml.safe_load(cfg_path.read_text()) or {}
    saved_model = saved_cfg.get("model")
    widths = {"in_features": _in_features(model), "out_features": _out_features(model)}
    try:
        rebuilt = repr(build_model(saved_model, **widths)) if isinstance(saved_model, dict) else None
    except (TypeError, ValueError):
        rebuilt = None
    if rebuilt != repr(model):
        raise ConfigError(
            f"laplace: the MAP in {folder} was trained with model config {saved_model} "
            f"(data {saved_cfg.get('data', {}).get('name')!r}), which does not match this run's model "
            f"{_describe(model)}; point method.map_dir at a run with the same model config"
        )
    checkpoint = folder / CHECKPOINT_FILE
    if (folder / PARAMS_FILE).is_file():
        theta = load_params(folder / PARAMS_FILE)["theta"]
    elif checkpoint.is_file():
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        state = state.get("method", state)
        if "theta" not in state:
            raise ConfigError(f"laplace: {checkpoint} has no 'theta' entry (keys: {sorted(state)})")
        theta = state["theta"]
    elif (folder / "posterior.pt").is_file():
        theta = load_gaussian(folder / "posterior.pt").mean
    else:
        raise ConfigError(
            f"laplace: {folder} holds none of {PARAMS_FILE}, {CHECKPOINT_FILE}, posterior.pt to take the MAP from"
        )
    n_params = sum(p.numel() for p in model.parameters())
    if theta.shape != (n_params,):
        raise ConfigError(
            f"laplace: the parameters in {folder} have shape {tuple(theta.shape)}, the model needs ({n_params},)"
        )
    return theta


def _widest_activation(model: nn.Module, theta: Tensor, x: Tensor) -> int:
    """The most entries any module's output (or the input) has per example of ``x`` (one example)."""
    sizes = [x[0].numel()]

    def record(_module: nn.Module, _inputs: Any, output: Any) -> None:
        if isinstance(output, Tensor):
            sizes.append(output[0].numel() if output.ndim else 1)

    hooks = [module.register_forward_hook(record) for module in model.modules()]
    try:
        forward_with(model, theta, x[:1])
    finally:
        for hook in hooks:
            hook.remove()
    return max(sizes)


def _channels_last(x: Tensor) -> Tensor:
    """Image batches ``(N, C, H, W)`` in the channels-last layout (faster convolutions); other inputs as they are."""
    return x.contiguous(memory_format=torch.channels_last) if x.ndim == 4 else x


def _in_features(model: nn.Module) -> int:
    """The ``in_features`` a model builder was given: flattened-row width for an ``nn.Unflatten`` head,
    else the first weight layer's inputs (or channels)."""
    first = next(iter(model.children()), None) if isinstance(model, nn.Sequential) else None
    if isinstance(first, nn.Unflatten):
        return math.prod(first.unflattened_size)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            return module.in_features
        if isinstance(module, nn.Conv2d):
            return module.in_channels
    return 0


def _out_features(model: nn.Module) -> int:
    last = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    return last[-1].out_features if last and isinstance(last[-1], nn.Linear) else 0


def _describe(model: nn.Module) -> str:
    return " → ".join(repr(m) for m in model.children()) if isinstance(model, nn.Sequential) else repr(model)


@register_method("laplace")
class Laplace(Method):
    """Post-hoc Laplace approximation (see the module docstring).

    Args:
        structure: ``diag``, ``kfac``, ``efb``, ``def``, ``block`` or ``full``.
        curvature: ``ggn`` or ``fisher`` (labels sampled from the model).
        n_curvature_samples: label draws per example for ``curvature=fisher``.
        prior_precision: :math:`\\tau` > 0 of the posterior, or ``None`` for the run's prior.
        dataset_scale: the paper's N > 0, or ``None`` for the number of training examples.
        rank: ``def`` only: the number K of top eigenvalues kept per layer, or ``None`` for all.
        predictive: ``sample`` or ``linearised``.
        lr: Adam learning rate of the MAP fit.
        map_dir: a finished run folder to take the MAP from instead of training, or ``None``.
        curvature_batch_size: examples per chunk when accumulating the curvature.
        curvature_dtype: ``model`` (the model's dtype), ``float32`` or ``float64``: the dtype of the
            per-chunk curvature work (sums across chunks are float64 either way).
        curvature_subset: estimate the curvature on this many training examples, drawn without
            replacement (``None``: all of them).
        curvature_cache_mib: ``efb`` and ``def``: MiB of pass 1's per-chunk tensors (layer inputs and output
            gradients) kept for the second pass over the data (EFB eigenvalues and the exact diagonal), which
            then skips the network's forward and backward passes; chunks beyond it are recomputed, on the same
            sampled labels. 0: recompute them all. DEF's MNIST LeNet (Fisher, float32) needs about 4.7 GiB
            for 50,000 images (:class:`~bdl_bench.curvature.kron.ChunkCache`).
        search: a :class:`SearchSettings` mapping: choose N and τ on the validation set given by
            :meth:`use_validation` (overrides ``dataset_scale`` and ``prior_precision``), or ``None``.
        kfac_prior: ``kfac`` only: ``damped`` (eq. 3; exact for a layer with a bias prior of its own) or
            ``exact`` (:math:`NG\\otimes A + \\operatorname{diag}(\tau)` in every layer).

    Raises:
        ValueError: on an unknown structure, curvature or predictive (the choices are listed), a
            non-positive ``prior_precision``, ``dataset_scale`` or ``lr``, or a bad count.
    """

    def __init__(
        self,
        *,
        structure: str,
        curvature: str,
        n_curvature_samples: int,
        prior_precision: float | None,
        dataset_scale: float | None,
        rank: int | None,
        predictive: str,
        lr: float,
        map_dir: str | None,
        curvature_batch_size: int,
        curvature_dtype: str = "model",
        curvature_subset: int | None = None,
        curvature_cache_mib: int = 6144,
        search: Mapping[str, Any] | str | None = None,
        kfac_prior: str = "damped",
    ) -> None:
        self.structure = parse_choice(Structure, structure, "structure", "laplace")
        self.curvature = parse_choice(CurvatureKind, curvature, "curvature", "laplace")
        self.predictive = parse_choice(Predictive, predictive, "predictive", "laplace")
        self.kfac_prior = parse_choice(KfacPrior, kfac_prior, "kfac_prior", "laplace")
        if prior_precision is not None and not prior_precision > 0:
            raise ConfigError(
                f"laplace: prior_precision τ must be positive (or null for the run's prior), got {prior_precision}"
            )
        if dataset_scale is not None and not dataset_scale > 0:
            raise ConfigError(
                f"laplace: dataset_scale N must be positive (or null for the training-set size), got {dataset_scale}"
            )
        if not lr > 0:
            raise ConfigError(f"laplace: lr must be positive, got {lr}")
        for name, value in (
            ("n_curvature_samples", n_curvature_samples),
            ("curvature_batch_size", curvature_batch_size),
        ):
            if int(value) != value or value < 1:
                raise ConfigError(f"laplace: {name} must be an integer >= 1, got {value}")
        if curvature_dtype not in _CURVATURE_DTYPES:
            raise ConfigError(
                f"laplace: unknown curvature_dtype {curvature_dtype!r}; choices: {', '.join(_CURVATURE_DTYPES)}"
            )
        if curvature_subset is not None and (int(curvature_subset) != curvature_subset or curvature_subset < 1):
            raise ConfigError(
                f"laplace: curvature_subset must be an integer >= 1 or null (all), got {curvature_subset}"
            )
        if isinstance(curvature_cache_mib, bool) or not isinstance(curvature_cache_mib, int | float):
            raise ConfigError(
                f"laplace: curvature_cache_mib must be an integer >= 0 (MiB), got {curvature_cache_mib!r}"
            )
        if int(curvature_cache_mib) != curvature_cache_mib or curvature_cache_mib < 0:
            raise ConfigError(
                f"laplace: curvature_cache_mib must be an integer >= 0 (MiB; 0 recomputes the second curvature "
                f"pass), got {curvature_cache_mib}"
            )
        if rank is not None and (int(rank) != rank or rank < 1):
            raise ConfigError(f"laplace: rank must be an integer >= 1 or null (all eigenvalues), got {rank}")
        self.prior_precision = None if prior_precision is None else float(prior_precision)
        self.dataset_scale = None if dataset_scale is None else float(dataset_scale)
        self.rank = None if rank is None else int(rank)
        self.n_curvature_samples = int(n_curvature_samples)
        self.curvature_batch_size = int(curvature_batch_size)
        self.curvature_dtype = _CURVATURE_DTYPES[curvature_dtype]
        self.curvature_subset = None if curvature_subset is None else int(curvature_subset)
        self.curvature_cache_mib = int(curvature_cache_mib)
        self.lr = lr
        self.map_dir = map_dir
        self.search = _parse_search(search)
        self._posterior: StructuredGaussian | None = None
        self.fit_info: dict[str, float] = {}
        self.extra_metrics: dict[str, float] = {}  # metrics.json entries of the search (runner: finish_run)
        self.search_rows: list[dict[str, Any]] = []
        self._val: tuple[Tensor, Tensor] | None = None
        self._run_dir: Path | None = None
        self.fitted_likelihood: Gaussian | None = None  # the noise method.search=marglik chose (runner: final metrics)
        self.last_evidence: LaplaceEvidence | None = None

    # ------------------------------------------------------------------ MAP part
    def setup(self, problem: Problem) -> None:
        """Start the MAP fit from the model's parameters (or load them from ``map_dir``).

        Raises:
            ValueError: if the model is not an ``nn.Sequential`` of ``nn.Linear``, ``nn.Conv2d`` and
                parameter-free modules, or ``map_dir`` does not match it.
        """
        super().setup(problem)
        try:
            self._layout: KronLayout = kron_layout(problem.model)
        except ValueError as err:
            raise ConfigError(f"laplace: {err}") from None
        theta = flat_params(problem.model)
        if self.map_dir is not None:
            theta = load_map_parameters(self.map_dir, problem.model).to(theta)
        self.theta = theta.requires_grad_(True)
        self.optimizer = adam([self.theta], self.lr)
        self._posterior = None

    def train_step(self, x: Tensor, y: Tensor) -> dict[str, float]:
        """One MAP step (as ``methods/map.py``)."""
        return map_step(self.problem, self.theta, self.optimizer, x, y)

    def fit(
        self,
        x: Tensor,
        y: Tensor,
        *,
        n_epochs: int,
        batch_size: int,
        data_generator: torch.Generator,
        on_epoch_end: EpochCallback | None = None,
        start_epoch: int = 0,
    ) -> None:
        """MAP epochs (unless ``map_dir``), then the Laplace posterior on all of ``(x, y)``.

        Raises:
            ValueError: if ``search`` is on and there is no validation set (before any training).
        """
        self._check_validation()
        if self.map_dir is not None:
            self.fit_posterior(x, y)
            if on_epoch_end is not None:
                on_epoch_end(max(n_epochs, 1), {})
            return

        def callback(epoch: int, stats: Any) -> None:
            if epoch == n_epochs:
                self.fit_posterior(x, y)
            if on_epoch_end is not None:
                on_epoch_end(epoch, stats)

        super().fit(
            x,
            y,
            n_epochs=n_epochs,
            batch_size=batch_size,
            data_generator=data_generator,
            on_epoch_end=callback,
            start_epoch=start_epoch,
        )
        if self._posterior is None:
            self.fit_posterior(x, y)

    # ------------------------------------------------------------------ Laplace part
    def fit_posterior(self, x: Tensor, y: Tensor) -> StructuredGaussian:
        """Compute the curvature at the current parameters (one data pass; EFB/DEF: a second one over the kept
        chunks, :meth:`_curvature`) and build the posterior:
        at ``dataset_scale`` and ``prior_precision``, or at the (N, τ) that ``search`` picks."""
        p = self.problem
        self.fit_info, self.extra_metrics = {}, {}
        self._check_validation()
        theta = self.theta.detach().double()
        x_all, y_all = x, y
        x, y = self._curvature_data(x, y)
        theta_c = theta.to(self.curvature_dtype or self.theta.dtype)

        def batches(start: int = 0, labels: list[Tensor | None] | None = None):
            """Pseudo-gradients of the chunks of rows ``start:``, on ``labels`` (one entry per chunk) or new draws."""
            chunks = iter_pseudo_grads(
                p.model,
                theta_c,
                x[start:],
                y[start:],
                p.likelihood,
                batch_size=self.curvature_batch_size,
                kind=self.curvature,
                n_samples=self.n_curvature_samples,
                generator=p.generator,
                labels=None if self.curvature is CurvatureKind.GGN else labels,
            )
            n_chunks = math.ceil((x.shape[0] - start) / self.curvature_batch_size)
            return delayed_bar(chunks, desc="curvature pass", unit="chunk", enabled=self.step_progress, total=n_chunks)

        started = time.perf_counter()
        curvature = self._curvature(theta, batches)
        self.fit_info["n_curvature_examples"] = x.shape[0]
        if isinstance(self.search, MarglikSettings):
            self.extra_metrics["curvature_time_s"] = time.perf_counter() - started
            self._posterior = self._marglik(theta, curvature, x_all, y_all)
        elif self.search is None:
            scale = float(p.n_data) if self.dataset_scale is None else self.dataset_scale
            tau = (
                p.prior_precision.detach().double()
                if self.prior_precision is None
                else torch.full_like(theta, self.prior_precision)
            )
            self._posterior = self._cast(self._assemble(theta, curvature, scale, tau))
        else:
            self.extra_metrics["curvature_time_s"] = time.perf_counter() - started
            self._posterior = self._search(theta, curvature)
        return self._posterior

    def _curvature_data(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """``(x, y)``, or ``curvature_subset`` of its rows drawn without replacement (in their original order)."""
        if self.curvature_subset is None or self.curvature_subset >= x.shape[0]:
            return x, y
        generator = self.problem.generator
        keep = torch.randperm(x.shape[0], generator=generator, device=generator.device)[: self.curvature_subset]
        keep = keep.sort().values.to(x.device)
        return x[keep], y[keep]

    def _layer_index(self, device: torch.device) -> tuple[Tensor, Tensor]:
        index = torch.cat([block_index(slot, device) for slot in self._layout.slots])
        shapes = torch.tensor([list(slot.shape) for slot in self._layout.slots], device=device)
        return index, shapes

    def _layer_tau(self, tau: Tensor) -> list[Tensor]:
        """One prior precision per layer (EFB adds it to its eigenvalues), 0-dim tensors (``tau``'s autograd
        graph kept for :meth:`_marglik`)."""
        out = []
        for slot in self._layout.slots:
            values = tau[block_index(slot, tau.device)]
            if not bool((values == values[0]).all()):
                raise ConfigError(
                    f"laplace: structure={self.structure.value} needs one prior precision per layer, but layer "
                    f"{slot.module_index} has {sorted(set(values.tolist()))}; set method.prior_precision=<τ>, "
                    "bias_prior_precision=null or method.structure=kfac (which handles a bias prior exactly)"
                )
            out.append(values[0])
        return out

    def _assemble_kfac(
        self,
        theta: Tensor,
        curvature: dict[str, Any],
        scale: float | Tensor,
        tau: Tensor,
        index: Tensor,
        shapes: Tensor,
    ) -> StructuredGaussian:
        """KFAC's posterior (module docstring): eq. 3 as a ``KroneckerGaussian`` where that is exact for every layer,
        else a ``ScaledEigenKroneckerGaussian`` with eq. 3's eigenvalues :math:`(\\sqrt Ns_G + \\sqrt\\tau)(\\sqrt Ns_A +
        \\sqrt\\tau)` in the damped layers and :math:`Ns_Gs_{A'} + 1` with scale :math:`t^{1/2}` in the exact ones."""
        factors = curvature["factors"]
        scale = torch.as_tensor(scale, dtype=theta.dtype, device=theta.device)
        grids = [tau[block_index(f.slot, theta.device)].view(f.slot.shape) for f in factors]
        uniform = [bool((grid == grid.reshape(-1)[0]).all()) for grid in grids]
        damped = self.kfac_prior is KfacPrior.DAMPED
        if damped and all(uniform):
            outs, ins = [], []
            for f, grid in zip(factors, grids):
                root = grid.reshape(-1)[0].sqrt()
                outs.append(scale.sqrt() * f.g_factor + root * torch.eye(f.g_factor.shape[0]).to(theta))
                ins.append(scale.sqrt() * f.a_factor + root * torch.eye(f.a_factor.shape[0]).to(theta))
            return KroneckerGaussian(theta, index, shapes, pack(outs), pack(ins))
        if "bases" not in curvature:  # τ-independent: one eigendecomposition per factor, kept for the next call
            curvature["bases"] = eigenbasis(factors)
        vecs_out, vecs_in, values, scales = [], [], [], []
        for f, basis, grid, uni in zip(factors, curvature["bases"], grids, uniform):
            column = grid[0]  # the prior of each input column (the bias last)
            if not bool((grid == column).all()):
                raise ConfigError(
                    f"laplace: structure=kfac adds the prior as I ⊗ diag(t), one precision per input column, but layer "
                    f"{f.slot.module_index}'s prior varies across its outputs; use one prior per weight and per bias"
                )
            s_g, s_a, u_a = basis.eigvals_out, basis.eigvals_in, basis.eigvecs_in
            root = column.sqrt()
            if uni and damped:
                grid_values = (scale.sqrt() * s_g[:, None] + root[0]) * (scale.sqrt() * s_a[None, :] + root[0])
                root = torch.ones_like(root)
            elif uni:  # N G ⊗ A + τI: no rescaling of A needed
                grid_values = scale * s_g[:, None] * s_a[None, :] + column[0]
                root = torch.ones_like(root)
            else:  # N G ⊗ A + I ⊗ T = (I ⊗ T^½)(N G ⊗ A' + I)(I ⊗ T^½), A' = T^-½ A T^-½
                s_a, u_a = torch.linalg.eigh(f.a_factor / (root[:, None] * root[None, :]))
                s_a = s_a.clamp_min(0.0)
                grid_values = scale * s_g[:, None] * s_a[None, :] + 1.0
            vecs_out.append(basis.eigvecs_out)
            vecs_in.append(u_a)
            values.append(grid_values)
            scales.append(root)
        return ScaledEigenKroneckerGaussian(
            theta, index, shapes, pack(vecs_out), pack(vecs_in), pack(values), torch.cat(scales)
        )

    def _curvature(self, theta: Tensor, batches: Any) -> dict[str, Any]:
        """The data pass: what ``structure`` needs of the curvature. Independent of N and τ, so one pass
        serves every grid point of ``search`` (DEF's Alg. 1 and diagonal correction use only the
        unscaled eigenvalues and the exact diagonal, so they are done here once too)."""
        s = self.structure
        if s is Structure.DIAG:
            return {"diag": diagonal(batches())}
        if s is Structure.FULL:
            return {"matrix": exact_matrix(batches())}
        if s is Structure.BLOCK:
            return {"blocks": tuple(exact_blocks(batches()))}
        if s is Structure.KFAC:
            return {"factors": kron_factors(batches())}
        # EFB and DEF: a second pass in the fixed eigenbasis, over pass 1's chunks as far as the cache holds them
        cache = ChunkCache(self.curvature_cache_mib * 2**20)
        factors = kron_factors(cache.record(batches()))
        bases = eigenbasis(factors)
        n_chunks = len(cache.labels)
        rest = () if cache.n_cached == n_chunks else batches(cache.n_cached_rows, cache.labels[cache.n_cached :])
        eigs, exact_diag = efb_eigenvalues(rest, bases, cache=cache, progress=self.step_progress)
        self.fit_info["cached_chunks"] = cache.n_cached
        self.fit_info["curvature_chunks"] = n_chunks
        self.fit_info["curvature_cache_mib"] = cache.nbytes / 2**20
        del cache
        if s is Structure.EFB:
            return {"bases": bases, "eigs": eigs}
        lows, corrections = [], torch.zeros_like(theta)
        for basis, e in zip(bases, eigs):
            low = sparsify(basis.slot, basis.eigvecs_out, basis.eigvecs_in, e, self.rank)
            lows.append(low)
            correction = diagonal_correction(flat_to_grid(exact_diag, basis.slot), low)
            corrections[block_index(basis.slot, theta.device)] = correction.reshape(-1)
        for low in lows:
            if low.rank > MAX_DEF_RANK:
                raise ConfigError(
                    f"laplace: DEF keeps L={low.rank} eigenvalues in layer {low.slot.module_index} (Alg. 1 keeps "
                    f"whole rows and columns of the top K={self.rank}); its L x L sampler core is too large "
                    f"(limit {MAX_DEF_RANK}): lower method.rank"
                )
        self.fit_info["kept_rank"] = sum(low.rank for low in lows)
        return {"lows": lows, "corrections": corrections}

    def _assemble(self, theta: Tensor, curvature: dict[str, Any], scale: float, tau: Tensor) -> StructuredGaussian:
        """The float64 posterior of precision N·I + τ from :meth:`_curvature`'s output (no data pass)."""
        s = self.structure
        if s is Structure.DIAG:
            return DiagGaussian(theta, scale * curvature["diag"] + tau)
        if s is Structure.FULL:
            return FullGaussian(theta, scale * curvature["matrix"] + torch.diag(tau))
        index, shapes = self._layer_index(theta.device)
        if s is Structure.BLOCK:
            blocks = [
                scale * block + torch.diag(tau[block_index(slot, theta.device)])
                for block, slot in zip(curvature["blocks"], self._layout.slots)
            ]
            return BlockDiagGaussian(theta, index, shapes, pack(blocks))
        if s is Structure.KFAC:
            return self._assemble_kfac(theta, curvature, scale, tau, index, shapes)
        if s is Structure.EFB:
            taus = self._layer_tau(tau)
            bases = curvature["bases"]
            values = [scale * e + t for e, t in zip(curvature["eigs"], taus)]
            return EigenKroneckerGaussian(
                theta,
                index,
                shapes,
                pack([b.eigvecs_out for b in bases]),
                pack([b.eigvecs_in for b in bases]),
                pack(values),
            )
        # DEF
        lows = curvature["lows"]
        prec_diag = scale * curvature["corrections"] + tau
        invalid = prec_diag <= 0
        n_clipped = int(invalid.sum())
        self.fit_info["n_clipped"] = n_clipped
        if n_clipped:
            logger.info("laplace def: %d entries with N·D + τ <= 0 set to τ (D clipped at 0; Lemma 3)", n_clipped)
        return KroneckerLowRankPlusDiagGaussian(
            theta,
            index,
            shapes,
            torch.tensor([list(low.eigenvalues.shape) for low in lows], device=theta.device),
            pack([low.factor_out for low in lows]),
            pack([low.factor_in for low in lows]),
            pack([scale * low.eigenvalues for low in lows]),
            torch.where(invalid, tau, prec_diag),
        )

    def _cast(self, posterior: StructuredGaussian) -> StructuredGaussian:
        """``posterior`` with its floating tensors in the model's dtype."""
        fields = {f.name: getattr(posterior, f.name) for f in dataclasses.fields(posterior)}
        dtype = self.theta.dtype
        return type(posterior)(**{k: v.to(dtype) if v.is_floating_point() else v for k, v in fields.items()})

    # ------------------------------------------------------------------ (N, τ) search (DEF App. E.3.1)
    def use_validation(self, x_val: Tensor, y_val: Tensor, run_dir: str | Path | None = None) -> None:
        """Give ``search`` its validation set (the runner passes the run's; never test data) and the run
        folder that receives ``laplace_search.csv``."""
        self._val = (x_val, y_val)
        self._run_dir = None if run_dir is None else Path(run_dir)

    def _check_validation(self) -> None:
        if isinstance(self.search, SearchSettings) and (self._val is None or self._val[0].shape[0] == 0):
            raise ConfigError(
                "laplace: method.search chooses (N, τ) on the validation set, but this run has none; give the data "
                "one (data.n_val=10000 for vision/mnist, data.val_fraction=0.1 for UCI) or set method.search=null"
            )

    def _search(self, theta: Tensor, curvature: dict[str, Any]) -> StructuredGaussian:
        """Lee et al. (2020), App. E.3.1: every (N, τ) of the grid on one curvature fit; keep the lowest
        validation ``criterion`` among points whose validation accuracy is within ``accuracy_tolerance``
        of the MAP's. For each N, τ goes from large to small and, once accuracy falls more than
        ``prune_accuracy_drop`` below the MAP's, the smaller τ are skipped (``pruned``)."""
        self._check_validation()
        assert self._val is not None and isinstance(self.search, SearchSettings)
        cfg, p = self.search, self.problem
        x_val, y_val = self._val
        if cfg.max_val_examples is not None:
            x_val, y_val = x_val[: cfg.max_val_examples], y_val[: cfg.max_val_examples]
        started = time.perf_counter()
        reference = predictive_metrics(p.likelihood, self._val_outputs(None, x_val, 1, 0), y_val)
        if cfg.criterion not in reference:
            raise ConfigError(
                f"laplace: method.search.criterion={cfg.criterion!r} is not a validation metric of this likelihood "
                f"(choices: {', '.join(sorted(reference))})"
            )
        map_accuracy = reference.get("accuracy")
        seed = int(torch.randint(2**31 - 1, (1,), generator=p.generator, device=p.generator.device))
        rows: list[dict[str, Any]] = []
        for scale in cfg.dataset_scale:
            pruned = False
            for tau in sorted(cfg.prior_precision, reverse=True):
                row: dict[str, Any] = {"dataset_scale": scale, "prior_precision": tau, "status": "pruned"}
                rows.append(row)
                if pruned:
                    continue
                tic = time.perf_counter()
                posterior = self._cast(self._assemble(theta, curvature, scale, torch.full_like(theta, tau)))
                f = self._val_outputs(posterior, x_val, cfg.n_samples, seed)
                metrics = predictive_metrics(p.likelihood, f, y_val)
                row.update({f"val_{k}": metrics[k] for k in _SEARCH_COLUMNS if k in metrics})
                row.update(status="evaluated", time_s=time.perf_counter() - tic)
                if map_accuracy is not None and cfg.prune_accuracy_drop is not None:
                    pruned = metrics["accuracy"] < map_accuracy - cfg.prune_accuracy_drop
        evaluated = [r for r in rows if r["status"] == "evaluated" and math.isfinite(r[f"val_{cfg.criterion}"])]
        if not evaluated:
            raise ConfigError("laplace: no grid point of method.search gave a finite validation criterion")
        for r in evaluated:
            r["eligible"] = (
                map_accuracy is None
                or cfg.accuracy_tolerance is None
                or r["val_accuracy"] >= map_accuracy - cfg.accuracy_tolerance
            )
        eligible = [r for r in evaluated if r["eligible"]]
        if not eligible:  # nothing keeps the MAP's accuracy: take the most accurate point
            logger.warning("laplace search: no grid point within the accuracy tolerance; taking the most accurate")
            best = max(evaluated, key=lambda r: r["val_accuracy"])
        else:
            best = min(eligible, key=lambda r: r[f"val_{cfg.criterion}"])
        best["chosen"] = True
        self.search_rows = rows
        self._write_search_csv(rows)
        chosen_scale, chosen_tau = best["dataset_scale"], best["prior_precision"]
        logger.info(
            "laplace search: N=%g, τ=%g (validation %s %.4g) of %d grid points in %.0f s",
            chosen_scale,
            chosen_tau,
            cfg.criterion,
            best[f"val_{cfg.criterion}"],
            len(evaluated),
            time.perf_counter() - started,
        )
        posterior = self._cast(self._assemble(theta, curvature, chosen_scale, torch.full_like(theta, chosen_tau)))
        self.extra_metrics.update(
            {
                "chosen_dataset_scale": chosen_scale,
                "chosen_prior_precision": chosen_tau,
                f"search_val_{cfg.criterion}": best[f"val_{cfg.criterion}"],
                "search_n_evaluated": len(evaluated),
                "search_time_s": time.perf_counter() - started,
                **({"search_map_val_accuracy": map_accuracy} if map_accuracy is not None else {}),
                **({"search_val_accuracy": best["val_accuracy"]} if "val_accuracy" in best else {}),
            }
        )
        return posterior

    def _val_outputs(self, posterior: StructuredGaussian | None, x: Tensor, n_samples: int, seed: int) -> Tensor:
        """Outputs at ``n_samples`` draws of ``posterior`` (``None``: the MAP), from a generator seeded
        with ``seed``: every grid point sees the same noise (common random numbers)."""
        saved_posterior, saved_problem = self._posterior, self.problem
        generator = torch.Generator(device=saved_problem.generator.device).manual_seed(seed)
        self._posterior, self.problem = posterior, dataclasses.replace(saved_problem, generator=generator)
        try:
            return self.predict_sets({"val": x}, n_samples)["val"]
        finally:
            self._posterior, self.problem = saved_posterior, saved_problem

    def _write_search_csv(self, rows: list[dict[str, Any]]) -> None:
        if self._run_dir is None:
            return
        columns = ["dataset_scale", "prior_precision", "status", *(f"val_{k}" for k in _SEARCH_COLUMNS)]
        columns += ["eligible", "chosen", "time_s"]
        with open(self._run_dir / SEARCH_FILE, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns, restval="", extrasaction="ignore")
            writer.writeheader()
            writer.writerows({**r, "chosen": r.get("chosen", False)} for r in rows)

    # ------------------------------------------------------------------ marginal likelihood (method.search=marglik)
    def evidence(self, theta: Tensor, curvature: dict[str, Any], x: Tensor, y: Tensor) -> LaplaceEvidence:
        """The log marginal likelihood of :class:`MarglikSettings` as a function of (log τ per group, log γ)."""
        p = self.problem
        settings = self.search if isinstance(self.search, MarglikSettings) else MarglikSettings()
        groups = torch.zeros(theta.shape[0], dtype=torch.long, device=theta.device)
        if settings.prior == "layer":
            for k, slot in enumerate(self._layout.slots):
                groups[block_index(slot, theta.device)] = k
        with torch.no_grad():
            rows = max(1, _PREDICT_BUDGET // _widest_activation(p.model, self.theta.detach(), x[:1]))
            f = torch.cat([forward_with(p.model, self.theta.detach(), xs) for xs in x.split(rows)]).double()
        gaussian = isinstance(p.likelihood, Gaussian)
        if gaussian:
            data_term = ((f.squeeze(-1) - y.double()) ** 2).sum()
        else:
            data_term = p.likelihood.nll(f, y).sum()
        return LaplaceEvidence(self, theta, curvature, groups, data_term, y.shape[0], gaussian)

    def _marglik(self, theta: Tensor, curvature: dict[str, Any], x: Tensor, y: Tensor) -> StructuredGaussian:
        """Adam on :meth:`evidence` from the run's prior (mean per group) and noise; the posterior at the optimum."""
        settings = self.search
        assert isinstance(settings, MarglikSettings)
        p, started = self.problem, time.perf_counter()
        objective = self.evidence(theta, curvature, x, y)
        self.last_evidence = objective  # for inspection (tests: gradients against finite differences)
        prior = p.prior_precision.detach().double() if self.prior_precision is None else None
        if prior is None:
            prior = torch.full_like(theta, float(self.prior_precision))
        n_groups = int(objective.groups.max()) + 1
        start = torch.zeros(n_groups, dtype=theta.dtype, device=theta.device).index_add_(0, objective.groups, prior)
        counts = torch.bincount(objective.groups, minlength=n_groups).to(theta)
        log_tau = (start / counts).log().requires_grad_(True)
        log_gamma = torch.tensor(math.log(objective.noise0), dtype=theta.dtype, device=theta.device)
        residual_noise = objective.gaussian and settings.noise == "residual"
        if residual_noise:  # γ = n / Σ residual² of the MAP, held fixed
            log_gamma = torch.log(objective.n_data / objective.data_term.detach()).to(log_gamma)
        fit_noise = objective.gaussian and settings.noise is True
        params = [log_tau, log_gamma.requires_grad_(True)] if fit_noise else [log_tau]
        optimizer = torch.optim.Adam(params, lr=settings.lr)
        with torch.no_grad():
            initial = float(objective(log_tau, log_gamma))
        for _ in range(settings.n_steps):
            optimizer.zero_grad()
            loss = -objective(log_tau, log_gamma)
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            value = float(objective(log_tau, log_gamma))
            tau = log_tau.exp()
            posterior = self._cast(objective.posterior(log_tau, log_gamma))
        if not math.isfinite(value):
            raise FloatingPointError(
                "laplace: the marginal likelihood is not finite at the end of method.search=marglik"
            )
        metrics: dict[str, float] = {
            "marglik": value / objective.n_data,
            "marglik_initial": initial / objective.n_data,
            "search_time_s": time.perf_counter() - started,
        }
        metrics.update({f"chosen_prior_precision_{k}": float(t) for k, t in enumerate(tau)})
        if fit_noise or residual_noise:
            gamma = float(log_gamma.detach().exp())
            metrics["chosen_noise_precision"] = gamma  # standardised targets
            self.fitted_likelihood = Gaussian(gamma)
        self.extra_metrics.update(metrics)
        logger.info(
            "laplace marglik: log p(D)/n %.4g -> %.4g, τ %s%s in %.1f s",
            metrics["marglik_initial"],
            metrics["marglik"],
            [f"{float(t):.3g}" for t in tau],
            f", γ {metrics['chosen_noise_precision']:.3g}" if fit_noise or residual_noise else "",
            metrics["search_time_s"],
        )
        return posterior

    # ------------------------------------------------------------------ prediction
    def posterior(self) -> StructuredGaussian | None:
        return self._posterior

    @torch.no_grad()
    def predict(self, x: Tensor, n_samples: int) -> Tensor:
        """``(n_samples, N, out)`` outputs at posterior samples (the MAP's, repeated, before the posterior is fitted)."""
        return self.predict_sets({"x": x}, n_samples)["x"]

    @torch.no_grad()
    def predict_sets(self, sets: Mapping[str, Tensor], n_samples: int) -> dict[str, Tensor]:
        """:meth:`predict` on several inputs, with the same posterior samples for all of them.

        The samples are drawn in chunks of at most ``_SAMPLE_BUDGET`` parameter entries (one (S, D) tensor per
        chunk, no model copies: the network is evaluated functionally at each row of it), and each chunk is
        evaluated on every set before the next is drawn, writing into the preallocated ``(n_samples, N, out)``
        outputs. Forward passes are sliced so that no activation exceeds ``_PREDICT_BUDGET`` entries (large fresh
        tensors cost more in page faults than in arithmetic on the CPU): a small set takes several samples per
        pass (vmapped), a large one is cut into row slices; the linearised predictive then evaluates all of the
        chunk's samples on a slice at once, so :math:`f(x;\theta_{MAP})` and the activations it linearises around
        are computed once per slice, not once per sample. Image inputs are evaluated channels-last (the faster
        convolution layout on the CPU; same numbers up to rounding).
        """
        model, theta = self.problem.model, self.theta.detach()
        probe = next((x[:1] for x in sets.values() if x.shape[0] > 0), None)
        rows = 1 if probe is None else max(1, _PREDICT_BUDGET // _widest_activation(model, theta, probe))
        sets = {name: _channels_last(x) for name, x in sets.items()}
        if self._posterior is None or probe is None:
            maps = {
                name: torch.cat([forward_with(model, theta, xs) for xs in x.split(rows)]) for name, x in sets.items()
            }
            return {name: f[None].expand(n_samples, *f.shape) for name, f in maps.items()}
        out_shape = forward_with(model, theta, probe).shape[1:]
        outs = {name: theta.new_empty(n_samples, x.shape[0], *out_shape) for name, x in sets.items()}
        chunk = max(1, min(_PREDICT_CHUNK, _SAMPLE_BUDGET // theta.numel()))
        for start in range(0, n_samples, chunk):
            thetas = self._posterior.rsample(min(chunk, n_samples - start), self.problem.generator)
            for name, x in sets.items():
                self._outputs_at(thetas, x, rows, outs[name][start : start + len(thetas)])
        return outs

    def _outputs_at(self, thetas: Tensor, x: Tensor, rows: int, out: Tensor) -> None:
        """Write ``(S, N, out)`` outputs at the parameter samples ``thetas`` ``(S, D)`` into ``out``, in passes of
        at most ``rows`` (samples x examples): several samples vmapped over a small ``x``; else row slices, one
        sample at a time (``sample``) or all S at once around one shared MAP pass (``linearised``)."""
        per_pass = rows // max(1, x.shape[0])  # samples per pass over the whole of x
        if per_pass >= 2 or len(thetas) == 1:
            for k, group in zip(range(0, len(thetas), max(1, per_pass)), thetas.split(max(1, per_pass))):
                for r, xs in zip(range(0, x.shape[0], rows), x.split(rows)):
                    out[k : k + len(group), r : r + len(xs)] = self._forward(group, xs)
            return
        if self.predictive is Predictive.LINEARISED:
            step = max(1, rows // len(thetas))
            for r, xs in zip(range(0, x.shape[0], step), x.split(step)):
                out[:, r : r + len(xs)] = self._forward(thetas, xs)
            return
        for k, th in enumerate(thetas):
            for r, xs in zip(range(0, x.shape[0], rows), x.split(rows)):
                out[k, r : r + len(xs)] = self._forward(th[None], xs)[0]

    def _forward(self, thetas: Tensor, x: Tensor) -> Tensor:
        """One pass: ``(S, N, out)`` outputs at ``thetas`` ``(S, D)`` (per ``predictive``)."""
        model, theta = self.problem.model, self.theta.detach()
        if self.predictive is Predictive.SAMPLE:
            if len(thetas) == 1:
                return forward_with(model, thetas[0], x)[None]
            return vmap(lambda th: forward_with(model, th, x))(thetas)

        def linear(delta: Tensor) -> Tensor:  # under vmap the MAP pass (unbatched primal) runs once
            f0, jd = jvp(lambda th: forward_with(model, th, x), (theta,), (delta,))
            return f0 + jd

        if len(thetas) == 1:
            return linear(thetas[0] - theta)[None]
        return vmap(linear)(thetas - theta)

    @torch.no_grad()
    def predictive_moments(self, x: Tensor) -> tuple[Tensor, Tensor] | None:
        r"""The linearised predictive in closed form: :math:`f(x;\theta_{MAP})` and
        :math:`\operatorname{diag}(J\Sigma J^\top)` per example and output, ``(N, out)`` each (laplace-torch's
        ``pred_type="glm"``). With a Gaussian likelihood the predictive is exactly
        :math:`\mathcal N(f, \operatorname{diag}(J\Sigma J^\top) + \gamma^{-1})`; the runner scores it beside
        the MC mixture of ``trainer.n_test_mc_samples`` samples, which underestimates its spread when γ⁻¹ is
        small against the function variance. ``None`` for ``predictive: sample`` or before the posterior exists.

        The Jacobian rows :math:`J(x_i)` are formed per example (vmapped) in slices of at most ``_SAMPLE_BUDGET``
        entries (a Jacobian of the whole slice would hold slice² activations), and
        :math:`\Sigma J^\top` comes from the posterior's ``solve`` (Kronecker, low-rank or dense alike).
        """
        if self.predictive is not Predictive.LINEARISED or self._posterior is None:
            return None
        model, theta, posterior = self.problem.model, self.theta.detach(), self._posterior
        means, variances = [], []
        out_dim = int(forward_with(model, theta, x[:1]).shape[-1]) if x.shape[0] else 1
        rows = max(1, _SAMPLE_BUDGET // (theta.numel() * out_dim))

        def one(th: Tensor, xi: Tensor) -> Tensor:  # one example's outputs: Jacobians cost O(out·D) per example
            return forward_with(model, th, xi[None])[0]

        for xs in x.split(rows):
            mean = forward_with(model, theta, xs)  # (n, out)
            jac = vmap(jacrev(one), in_dims=(None, 0))(theta, xs).reshape(-1, theta.numel())  # per-example rows
            jac = jac.to(posterior.dtype)
            var = (jac * posterior.solve(jac.mT).mT).sum(-1).reshape(mean.shape)
            means.append(mean)
            variances.append(var.to(mean.dtype))
        return torch.cat(means), torch.cat(variances)

    def point_estimate(self) -> Tensor:
        """:math:`\\theta_{MAP}` (the posterior's mean once it is fitted)."""
        return self.theta.detach()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "theta": self.theta.detach().clone(),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
        }
        if self._posterior is not None:
            for f in dataclasses.fields(self._posterior):
                state[f"posterior.{f.name}"] = getattr(self._posterior, f.name).detach().clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.theta.copy_(state["theta"])
        load_adam_state(self.optimizer, state["optimizer"])
        fields = {k.removeprefix("posterior."): v for k, v in state.items() if k.startswith("posterior.")}
        self._posterior = _posterior_class(self.structure, set(fields))(**fields) if fields else None


class LaplaceEvidence:
    """:class:`MarglikSettings`' log marginal likelihood at a fitted MAP and curvature, differentiable in
    (log τ per group, log γ); built by :meth:`Laplace.evidence`.

    Attributes:
        groups: ``(D,)`` the prior group of each parameter.
        n_data: the number of training examples in the data term.
        gaussian: whether the likelihood is Gaussian (then γ enters; else it is ignored).
        noise0: the noise precision γ₀ the curvature was computed at (1 for classification).
        data_term: Σ (f_* − y)² for a Gaussian likelihood (standardised targets), else the summed NLL at θ_*.
    """

    def __init__(
        self,
        method: Laplace,
        theta: Tensor,
        curvature: dict[str, Any],
        groups: Tensor,
        data_term: Tensor,
        n_data: int,
        gaussian: bool,
    ) -> None:
        self._method, self._theta, self._curvature = method, theta, curvature
        self.groups, self.data_term, self.n_data, self.gaussian = groups, data_term, n_data, gaussian
        likelihood = method.problem.likelihood
        self.noise0 = float(likelihood.noise_precision) if isinstance(likelihood, Gaussian) else 1.0
        p = method.problem
        self._scale = float(p.n_data) if method.dataset_scale is None else method.dataset_scale

    def posterior(self, log_tau: Tensor, log_gamma: Tensor) -> StructuredGaussian:
        """The float64 posterior of precision :math:`N(\\gamma/\\gamma_0)\\mathbf I + \\operatorname{diag}(\\tau)`."""
        ratio = (log_gamma - math.log(self.noise0)).exp() if self.gaussian else 1.0
        return self._method._assemble(self._theta, self._curvature, self._scale * ratio, log_tau.exp()[self.groups])

    def __call__(self, log_tau: Tensor, log_gamma: Tensor) -> Tensor:
        """:math:`\\log p(\\mathcal D\\mid\\theta_*,\\gamma) - \\frac12\\sum\\tau_d\\theta_d^2 + \\frac12\\sum\\log\\tau_d
        - \\frac12\\log|P|` (the 2π of prior and posterior cancel)."""
        tau = log_tau.exp()[self.groups]
        if self.gaussian:
            n = self.n_data
            log_lik = 0.5 * n * (log_gamma - math.log(2 * math.pi)) - 0.5 * log_gamma.exp() * self.data_term
        else:
            log_lik = -self.data_term
        prior = -0.5 * (tau * self._theta.square()).sum() + 0.5 * log_tau[self.groups].sum()
        return log_lik + prior - 0.5 * self.posterior(log_tau, log_gamma).logdet_precision()
