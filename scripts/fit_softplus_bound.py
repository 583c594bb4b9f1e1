"""Build the piecewise quadratic upper bound on softplus that ``bdl_bench/quadrature.py`` tabulates.

``python scripts/fit_softplus_bound.py`` prints ``_PW_BREAKS`` and ``_PW_COEFFS`` for ``max_gap = 1.5e-4``
(R = 20 pieces; the table in the package). The construction follows Marlin, Khan & Murphy (2011), "Piecewise
bounds for estimating Bernoulli-logistic latent Gaussian models", whose published coefficients are not in this
repository: a constant first piece, a linear (slope 1) last piece, every interior piece the minimax quadratic
upper bound on its interval (a linear program), intervals grown greedily so each piece's maximum gap is
``max_gap``, then every interior ``c_r`` raised by ``1e-7`` to cover the grid the linear program was solved on.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

LIFT = 1e-7  # added to each interior c_r: covers the space between the grid points (the gap bends slowly)


def fit_softplus_bound(max_gap: float, *, n_grid: int = 300) -> tuple[list[float], list[tuple[float, float, float]]]:
    r"""A piecewise quadratic upper bound on :math:`\log(1+e^x)` with every gap ≤ ``max_gap``.

    The first piece is the constant :math:`\ell(t_1)` on :math:`(-\infty, t_1]` with :math:`\ell(t_1) =`
    ``max_gap``; each next piece starts where the last ended and is stretched (bisection on its right end) as far
    as the minimax quadratic upper bound on it (a linear program over ``n_grid`` points,
    ``scipy.optimize.linprog``) keeps its gap ≤ ``max_gap``; once :math:`-t_1` is reached the last piece is
    :math:`x + \ell(-t_{R-1})` on :math:`[t_{R-1}, \infty)`. Each interior piece is checked on a 20,001-point
    grid, lifted by the worst violation there and then by :data:`LIFT`.

    Returns:
        ``(breaks, coeffs)``: the R-1 interior breakpoints and R ``(a, b, c)`` triples; every gap is at most
        ``max_gap + 1e-7``.
    """
    from scipy.optimize import linprog

    if not 0 < max_gap < math.log(2):
        raise ValueError(f"max_gap must be in (0, log 2), got {max_gap}")

    def softplus(x: np.ndarray) -> np.ndarray:
        return np.logaddexp(0.0, x)

    def piece(lo: float, hi: float) -> tuple[tuple[float, float, float], float]:
        mid, half = (lo + hi) / 2, (hi - lo) / 2
        x = np.linspace(lo, hi, n_grid)
        z = (x - mid) / half
        y = softplus(x)
        design = np.stack([z * z, z, np.ones_like(z)], 1)
        a_ub = np.vstack([np.hstack([-design, np.zeros((n_grid, 1))]), np.hstack([design, -np.ones((n_grid, 1))])])
        res = linprog([0, 0, 0, 1], A_ub=a_ub, b_ub=np.concatenate([-y, y]), bounds=[(None, None)] * 4)
        az, bz, cz, _ = res.x
        a = az / half**2
        b = bz / half - 2 * az * mid / half**2
        c = az * mid**2 / half**2 - bz * mid / half + cz
        xd = np.linspace(lo, hi, 20001)
        gap = a * xd**2 + b * xd + c - softplus(xd)
        c -= min(gap.min(), 0.0)
        return (float(a), float(b), float(c) + LIFT), float(gap.max() - min(gap.min(), 0.0))

    t1 = math.log(math.expm1(max_gap))
    breaks: list[float] = [t1]
    coeffs: list[tuple[float, float, float]] = [(0.0, 0.0, float(softplus(np.array(t1))))]
    left = t1
    while left < -t1:
        if piece(left, -t1)[1] <= max_gap:
            coeffs.append(piece(left, -t1)[0])
            left = -t1
            break
        lo, hi = left, -t1
        for _ in range(40):
            mid = (lo + hi) / 2
            if piece(left, mid)[1] <= max_gap:
                lo = mid
            else:
                hi = mid
        coeffs.append(piece(left, lo)[0])
        breaks.append(lo)
        left = lo
    breaks.append(left)
    coeffs.append((0.0, 1.0, float(softplus(np.array(-left)))))
    return breaks, coeffs


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-gap", type=float, default=1.5e-4)
    breaks, coeffs = fit_softplus_bound(parser.parse_args().max_gap)
    print("_PW_BREAKS = (", *(f"    {t!r}," for t in breaks), ")", sep="\n")
    print("_PW_COEFFS = (", *(f"    {c!r}," for c in coeffs), ")", sep="\n")
