r"""Laplace approximations after a MAP fit (``method=laplace``): diagonal, KFAC, EFB, DEF, exact blocks and full.

Lee et al. (2020), "Representing model uncertainty of neural networks in sparse information form".
The posterior is :math:`\mathcal N(\theta_{MAP}, P^{-1})` with

.. math::

    P \approx N\,\mathbf I + \operatorname{diag}(\tau),\qquad
    \mathbf I = \tfrac1n\textstyle\sum_i \mathbb E[\delta\theta_i\,\delta\theta_i^\top],

the mean curvature :math:`\mathbf I` over the n training examples (GGN, or the Fisher with labels sampled from the
model), the prior precision :math:`\tau` and the paper's dataset-size scaling N (by default n, which makes P the
Hessian of the negative log joint under the GGN). :mod:`.structures` holds the approximations of :math:`\mathbf I`
(eqs. 3, 4, 9), :mod:`.search` the choice of N and τ (App. E.3.1, or the marginal likelihood), :mod:`.predictive`
the predictives (eq. 7, or the linearised model) and :mod:`.map_dir` the MAP from a finished run; the options and
how a run uses them are in ``docs/laplace.md``."""

from bdl_bench.methods.laplace.map_dir import load_map_parameters
from bdl_bench.methods.laplace.method import Laplace
from bdl_bench.methods.laplace.search import SEARCH_FILE, LaplaceEvidence

__all__ = ["SEARCH_FILE", "Laplace", "LaplaceEvidence", "load_map_parameters"]
