r"""Laplace approximations after a MAP fit: diagonal, KFAC, EFB, DEF, exact block-diagonal and full (``method=laplace``).

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
``metrics.json`` (``chosen_dataset_scale``, ``chosen_prior_precision``); ``search: marglik`` maximises
the Laplace marginal likelihood instead (:mod:`.search`).
``structure`` picks the approximation of :math:`\mathbf I` (``bdl_bench.curvature``), one class of
:mod:`.structures` each (the maths in its docstring), held by its own ``StructuredGaussian``: ``diag``
(``DiagGaussian``), ``kfac`` (Lee et al. eq. 3, ``KroneckerGaussian``), ``efb`` (eq. 4, ``EigenKroneckerGaussian``),
``def`` (eq. 9, ``KroneckerLowRankPlusDiagGaussian``), ``block`` (exact per-layer blocks, "FB",
``BlockDiagGaussian``) and ``full`` (``FullGaussian``, small nets).

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
:math:`f(x;\theta_{MAP}) + J(x)(\theta_s - \theta_{MAP})` (``predictive: linearised``; :mod:`.predictive`).

The MAP: by default ``fit`` runs the MAP loop of ``methods/map.py`` (Adam, learning rate ``lr``,
``trainer.n_epochs`` epochs) and fits the posterior right before the last epoch's callback, so the
last ``history.csv`` row and the final metrics are the Laplace predictive (earlier rows are MAP).
With ``map_dir`` it instead takes :math:`\theta_{MAP}` from a finished run folder (see
:func:`~.map_dir.load_map_parameters`) and trains nothing.

Modules: :mod:`.method` (the registered :class:`Laplace`), :mod:`.structures`, :mod:`.predictive`,
:mod:`.search`, :mod:`.map_dir`.
"""

from bdl_bench.methods.laplace.map_dir import load_map_parameters
from bdl_bench.methods.laplace.method import Laplace
from bdl_bench.methods.laplace.predictive import GaussianPredictive, Predictive
from bdl_bench.methods.laplace.search import (
    SEARCH_FILE,
    LaplaceEvidence,
    MarglikSettings,
    SearchResult,
    SearchSettings,
    write_search_table,
)
from bdl_bench.methods.laplace.structures import MAX_DEF_RANK, STRUCTURES, KfacPrior, LaplaceStructure, Structure

__all__ = [
    "MAX_DEF_RANK",
    "SEARCH_FILE",
    "STRUCTURES",
    "GaussianPredictive",
    "KfacPrior",
    "Laplace",
    "LaplaceEvidence",
    "LaplaceStructure",
    "MarglikSettings",
    "Predictive",
    "SearchResult",
    "SearchSettings",
    "Structure",
    "load_map_parameters",
    "write_search_table",
]
