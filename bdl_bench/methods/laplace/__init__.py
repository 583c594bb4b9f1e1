r"""Laplace approximations after a MAP fit: diagonal, KFAC, EFB, DEF, exact block-diagonal and full (``method=laplace``).

Lee et al. (2020), "Representing model uncertainty of neural networks in sparse information form".
The posterior is :math:`\mathcal N(\theta_{MAP}, P^{-1})` with

.. math::

    P \approx N\,\mathbf I + \operatorname{diag}(\tau),\qquad
    \mathbf I = \tfrac1n\textstyle\sum_i \mathbb E[\delta\theta_i\,\delta\theta_i^\top],

the mean curvature :math:`\mathbf I` over the n training examples (GGN, or the Fisher with labels sampled from the
model: ``curvature``), the prior precision :math:`\tau` (``prior_precision``; by default the run's per-parameter
prior, MAP's weight decay) and the paper's dataset-size scaling N (``dataset_scale``; by default n, which makes P
the Hessian of the negative log joint under the GGN). ``search`` chooses N and τ on validation data (App. E.3.1)
or by the marginal likelihood, from one curvature pass (:mod:`.search`). ``structure`` picks the approximation of
:math:`\mathbf I`, one class of :mod:`.structures` each: ``diag``, ``kfac`` (eq. 3), ``efb`` (eq. 4), ``def``
(eq. 9), ``block`` (exact per-layer blocks, "FB") and ``full`` (small nets). Per-chunk curvature work runs in
``curvature_dtype``; sums across chunks, eigendecompositions and the posterior's construction are float64, and the
posterior is then cast to the model's dtype. ``predict`` samples networks (Lee et al. eq. 7) or the linearised model
(:mod:`.predictive`).

The MAP: ``fit`` runs the MAP loop of ``methods/map.py`` and fits the posterior right before the last epoch's
callback, so the last ``history.csv`` row and the final metrics are the Laplace predictive; with ``map_dir`` it takes
:math:`\theta_{MAP}` from a finished run folder instead (:mod:`.map_dir`). Options in practice: ``docs/laplace.md``."""

from bdl_bench.methods.laplace.map_dir import load_map_parameters
from bdl_bench.methods.laplace.method import Laplace
from bdl_bench.methods.laplace.search import SEARCH_FILE, LaplaceEvidence

__all__ = ["SEARCH_FILE", "Laplace", "LaplaceEvidence", "load_map_parameters"]
