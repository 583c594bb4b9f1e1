"""The k-tied paper's post-training study on a finished GMFVI run (Swiatkowski et al. 2020, Sec. 2).

    bdl-bench run method=gmfvi data=vision/mnist model.hidden=[400,400] hydra.run.dir=results/gmfvi_mnist
    python scripts/low_rank_std_study.py results/gmfvi_mnist --ranks 1,2,3 --samples 100

Writes into the run folder (or ``--out``): ``low_rank_table.csv`` (Tables 2/3: -ELBO, NLL, accuracy,
Brier over the weight samples, ECE of the mixture, for the mean-field posterior and its rank-k
approximations), ``spectra.csv`` and ``spectra.png`` (Fig. 3: variance explained per singular value of
the std and mean matrices), and prints the table. With ``--snr RUN_DIR ...`` it also plots the
gradient SNR of those runs (``method.snr_window=10``) into ``grad_snr.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bdl_bench.studies.grad_snr import plot_grad_snr, snr_curves
from bdl_bench.studies.low_rank_std import MeanFieldNetwork, low_rank_study, plot_spectra, spectra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a finished gmfvi run folder (config.yaml + posterior.pt)")
    parser.add_argument("--ranks", default="1,2,3")
    parser.add_argument("--samples", type=int, default=100, help="weight samples (paper: 100)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: the run folder)")
    parser.add_argument("--snr", type=Path, nargs="*", default=[], help="run folders whose gradient SNR to plot")
    parser.add_argument(
        "--snr-column",
        default="grad_snr",
        help="grad_snr (all layers), grad_snr_l<i> (layer i), or grad_snr_median / grad_snr_median_l<i> (medians)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = args.out or args.run_dir
    out.mkdir(parents=True, exist_ok=True)

    net, dataset, likelihood = MeanFieldNetwork.from_run(args.run_dir)
    ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    table = low_rank_study(
        net,
        dataset,
        likelihood,
        ranks=ranks,
        n_samples=args.samples,
        generator=torch.Generator().manual_seed(args.seed),
    )
    table.to_csv(out / "low_rank_table.csv", index=False)
    frame = spectra(net)
    frame.to_csv(out / "spectra.csv", index=False)
    plot_spectra(frame, out / "spectra.png")
    shown = [c for c in table.columns if c.endswith("_mean") or c in ("approximation", "ensemble_ece", "n_std_params")]
    print(table[shown].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    top = frame[(frame["k"] <= 3)].pivot_table(index=["layer", "parameter"], columns="k", values="fraction")
    print(
        "\nfraction of variance explained by singular values 1-3:\n" + top.to_string(float_format=lambda v: f"{v:.3f}")
    )
    if args.snr:
        path = plot_grad_snr(snr_curves(args.snr), out / "grad_snr.png", column=args.snr_column)
        print(f"\ngradient SNR plot: {path}")


if __name__ == "__main__":
    main()
