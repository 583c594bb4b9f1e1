"""Score laplace-torch beside bdl-bench on the same MAPs: a UCI Laplace sweep's run folders, one per split.

For each finished run below ``--results`` (``metrics.json`` + ``params.pt``) of ``--data`` and ``--structure``,
the MAP θ is loaded into a ``torch.nn.Sequential`` twin of our MLP and handed to laplace-torch (not a dependency
of bdl-bench: ``pip install laplace-torch`` into a scratch environment or ``--target`` folder on ``PYTHONPATH``).
laplace-torch then does what its users usually do, as the reference numbers in conf/experiment/laplace_uci_marglik.yaml did: ``sigma_noise`` = the MAP's
training RMSE, ``optimize_prior_precision(method="marglik")``, the ``glm`` (linearised) predictive in closed
form. Prints one JSON line per split (laplace-torch's and our test LL, their noise and prior) and a summary line
with both means ± standard errors. Compare with our runs of ``method.search={marglik: {noise: residual}}``:

    PYTHONPATH=/path/to/laplace-torch python scripts/compare_laplace_torch.py \
        --results results/laplace_uci_marglik --data uci/boston --structure diag --noise residual
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch
import yaml
from torch import nn

from bdl_bench.data import build_dataset
from bdl_bench.likelihoods import Gaussian
from bdl_bench.metrics import gaussian_predictive_metrics


def mlp_twin(in_features: int, hidden: list[int], activation: str) -> nn.Sequential:
    """An ``nn.Sequential`` with our MLP's parameter order (weight, bias per layer), for laplace-torch."""
    act = {"relu": nn.ReLU, "tanh": nn.Tanh}[activation]
    layers: list[nn.Module] = []
    width = in_features
    for h in hidden:
        layers += [nn.Linear(width, h), act()]
        width = h
    return nn.Sequential(*layers, nn.Linear(width, 1))


def compare(run: Path, structure: str) -> dict:
    from laplace import Laplace  # laplace-torch

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    ours = json.loads((run / "metrics.json").read_text())
    theta = torch.load(run / "params.pt", weights_only=True)["theta"].double()
    ds = build_dataset(cfg["data"])
    model = mlp_twin(ds.x_train.shape[1], list(cfg["model"]["hidden"]), cfg["model"]["activation"]).double()
    nn.utils.vector_to_parameters(theta, model.parameters())
    x, y = ds.x_train.double(), ds.y_train.double()
    with torch.no_grad():
        sigma = float((model(x).squeeze(-1) - y).square().mean().sqrt())
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y[:, None]), batch_size=64)
    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure=structure, sigma_noise=sigma)
    la.fit(loader)
    la.optimize_prior_precision(method="marglik", pred_type="glm")
    f_mu, f_var = la(ds.x_test.double(), pred_type="glm")
    noise = Gaussian(la.sigma_noise.item() ** -2)  # N(f_mu, f_var + sigma^2), scored as our runs score theirs
    ll = gaussian_predictive_metrics(noise, f_mu, f_var, ds.y_test, y_std=ds.y_std)["test_ll"]
    return {
        "split": cfg["data"]["split"],
        "laplace_torch_test_ll": ll,
        "ours_test_ll": ours["test_ll"],
        "laplace_torch_sigma": la.sigma_noise.item(),
        "ours_sigma": ours.get("chosen_noise_precision", math.nan) ** -0.5,
        "laplace_torch_prior": la.prior_precision.detach().flatten().tolist(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path("results/laplace_uci_marglik"))
    parser.add_argument("--data", default="uci/boston")
    parser.add_argument("--structure", default="diag", choices=["diag", "kron", "kfac", "full"])
    parser.add_argument("--noise", default="residual", help="our runs' method.search.marglik.noise to compare with")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lt_structure = "kron" if args.structure == "kfac" else args.structure
    ours_structure = "kfac" if args.structure == "kron" else args.structure
    runs = []
    for path in sorted(args.results.rglob("metrics.json")):
        cfg = yaml.safe_load((path.parent / "config.yaml").read_text())
        marglik = (cfg["method"].get("search") or {}) if isinstance(cfg["method"].get("search"), dict) else {}
        noise = (marglik.get("marglik") or {}).get("noise", True)
        if (
            cfg["data"]["name"] == args.data
            and cfg["method"]["structure"] == ours_structure
            and str(noise) == args.noise
            and (path.parent / "params.pt").exists()
        ):
            runs.append(path.parent)
    if not runs:
        raise SystemExit(f"no finished {args.data} {ours_structure} runs with noise={args.noise} below {args.results}")
    rows = []
    for run in runs:
        rows.append(compare(run, lt_structure))
        print(json.dumps(rows[-1]), flush=True)
    summary = {"n": len(rows)}
    for key in ("laplace_torch_test_ll", "ours_test_ll"):
        values = [r[key] for r in rows]
        se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan
        summary[key] = [statistics.mean(values), se]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
