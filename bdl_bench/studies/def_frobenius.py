r"""DEF Frobenius study (Lee et al. 2020, Sec. 4.1, Fig. 5): how well each approximation matches a layer's
exact information matrix.

After a MAP fit of the toy problem (``experiment=def_toy variant=def_toy/map``; by default with the
main text's 100 training points), take one layer's exact mean curvature block :math:`\mathbf I`
(GGN, or the sampled-label Fisher) and its approximations: Diag, KFAC (:math:`G\otimes A`), EFB
(eq. 4) and DEF (eq. 8) for every number K of kept top eigenvalues (L = g·a >= K after Alg. 1).
For each, the normalised Frobenius errors

.. math::

    e_{diag} = \frac{\|\operatorname{diag}(\mathbf I - \hat{\mathbf I})\|}{\|\operatorname{diag}\mathbf I\|},\quad
    e_{off} = \frac{\|\operatorname{off}(\mathbf I - \hat{\mathbf I})\|_F}{\|\operatorname{off}\mathbf I\|_F},\quad
    e = \frac{\|\mathbf I - \hat{\mathbf I}\|_F}{\|\mathbf I\|_F},

(0 = exact; "normalised from 0 to 1" in the paper) and the eigenvalue histogram of
:math:`\mathbf I`. Writes ``def_frobenius.csv`` and ``def_frobenius.png``.

Usage::

    python -m bdl_bench.studies.def_frobenius --out results/def_frobenius [--layer 0] [override ...]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from bdl_bench.curvature.def_lowrank import diagonal_correction, sparsify  # noqa: E402
from bdl_bench.curvature.exact import exact_blocks  # noqa: E402
from bdl_bench.curvature.kron import efb_eigenvalues, eigenbasis, flat_to_grid, kron_factors  # noqa: E402
from bdl_bench.curvature.pseudo_grads import CurvatureKind, iter_pseudo_grads  # noqa: E402
from bdl_bench.studies.def_toy import compose_variant, fit_method  # noqa: E402

DEFAULT_OVERRIDES = ("data.n_train=100",)


def frobenius_errors(exact: Tensor, approx: Tensor) -> dict[str, float]:
    """Normalised errors of ``approx`` against ``exact`` (both ``(P, P)``): diagonal, off-diagonal, total."""
    diff = exact - approx
    off = ~torch.eye(exact.shape[0], dtype=torch.bool, device=exact.device)

    def ratio(num: Tensor, den: Tensor) -> float:
        return float(num.norm() / den.norm()) if float(den.norm()) > 0 else float(num.norm())

    return {
        "err_diag": ratio(diff.diagonal(), exact.diagonal()),
        "err_offdiag": ratio(diff[off], exact[off]),
        "err_total": ratio(diff, exact),
    }


def layer_approximations(
    model: torch.nn.Module,
    theta: Tensor,
    x: Tensor,
    y: Tensor,
    likelihood,
    *,
    layer: int = 0,
    kind: CurvatureKind | str = CurvatureKind.GGN,
    n_samples: int = 1,
    generator: torch.Generator | None = None,
) -> tuple[pd.DataFrame, Tensor]:
    """Errors of Diag, KFAC, EFB and DEF(K) for every K on one layer; returns (table, eigenvalues of I).

    The pseudo-gradients are drawn once (a fixed sample for ``fisher``), so every approximation and the
    exact block describe the same matrix.
    """
    theta = theta.detach().double()
    batch = next(
        iter_pseudo_grads(
            model,
            theta,
            x.double(),
            y,
            likelihood,
            batch_size=x.shape[0],
            kind=kind,
            n_samples=n_samples,
            generator=generator,
        )
    )
    exact = exact_blocks([batch])[layer]
    factors = kron_factors([batch])[layer]
    bases = eigenbasis(kron_factors([batch]))
    eigs, diag = efb_eigenvalues([batch], bases)
    basis, lam = bases[layer], eigs[layer]
    vectors = torch.kron(basis.eigvecs_out, basis.eigvecs_in)
    rows = [
        {"method": "Diag", "rank": None, **frobenius_errors(exact, torch.diag(exact.diagonal()))},
        {"method": "KFAC", "rank": None, **frobenius_errors(exact, factors.dense())},
        {"method": "EFB", "rank": None, **frobenius_errors(exact, vectors @ torch.diag(lam.reshape(-1)) @ vectors.mT)},
    ]
    exact_diag = flat_to_grid(diag, basis.slot)
    for k in range(1, lam.numel() + 1):
        low = sparsify(basis.slot, basis.eigvecs_out, basis.eigvecs_in, lam, k)
        approx = low.dense() + torch.diag(diagonal_correction(exact_diag, low).reshape(-1))
        rows.append({"method": "DEF", "rank": k, "kept": low.rank, **frobenius_errors(exact, approx)})
    return pd.DataFrame(rows), torch.linalg.eigvalsh(exact)


def plot(table: pd.DataFrame, eigenvalues: Tensor, path: Path, title: str) -> Path:
    """Fig. 5: the three errors against K (DEF) with Diag/KFAC/EFB as lines, and the eigenvalue histogram."""
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.4))
    def_rows = table[table["method"] == "DEF"]
    colors = {"Diag": "tab:green", "KFAC": "tab:orange", "EFB": "tab:purple"}
    for ax, key, name in zip(axes, ("err_diag", "err_offdiag", "err_total"), ("diagonal", "off-diagonal", "overall")):
        ax.plot(def_rows["rank"], def_rows[key], marker="o", color="tab:blue", label="DEF (top-K kept)")
        for method, color in colors.items():
            ax.axhline(float(table.loc[table["method"] == method, key].iloc[0]), color=color, ls="--", label=method)
        ax.set_xlabel("K (top eigenvalues kept)")
        ax.set_title(f"{name} error ‖·‖_F / ‖I‖_F")
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    values = eigenvalues.clamp_min(0).cpu()
    axes[3].hist(values.numpy(), bins=30, color="tab:gray")
    axes[3].set_title(f"eigenvalues of I ({int((values <= 1e-10 * values.max()).sum())} ≈ 0)")
    axes[3].set_xlabel("eigenvalue")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_study(
    out: Path, overrides: Sequence[str] = DEFAULT_OVERRIDES, layer: int = 0, kind: str = "ggn"
) -> tuple[Path, Path]:
    """MAP fit, then :func:`layer_approximations` and :func:`plot`; returns (png, csv) paths."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = compose_variant("map", overrides)
    method, data, likelihood = fit_method(cfg)
    table, eigenvalues = layer_approximations(
        method.problem.model,
        method.theta,  # type: ignore[attr-defined]
        data.x_train,
        data.y_train,
        likelihood,
        layer=layer,
        kind=kind,
        n_samples=16,
        generator=torch.Generator().manual_seed(int(cfg.trainer.seed) + 4),
    )
    csv = out / "def_frobenius.csv"
    table.to_csv(csv, index=False)
    title = (
        f"Layer {layer} of the toy MLP {list(cfg.model.hidden)} ({kind}, N={data.n_train}): "
        "normalised Frobenius error against the exact block (Lee et al. 2020, Fig. 5)"
    )
    return plot(table, eigenvalues, out / "def_frobenius.png", title), csv


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bdl_bench.studies.def_frobenius", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, default=Path("results/def_frobenius"))
    parser.add_argument("--layer", type=int, default=0, help="which nn.Linear layer (0 = the first)")
    parser.add_argument("--curvature", default="ggn", choices=[k.value for k in CurvatureKind])
    parser.add_argument("overrides", nargs="*", help=f"Hydra overrides (default: {' '.join(DEFAULT_OVERRIDES)})")
    ns = parser.parse_args(argv)
    torch.set_num_threads(1)
    png, csv = run_study(ns.out, ns.overrides or DEFAULT_OVERRIDES, ns.layer, ns.curvature)
    print(pd.read_csv(csv).to_string(index=False))
    print(f"figure → {png}\ntable → {csv}")


if __name__ == "__main__":
    main()
