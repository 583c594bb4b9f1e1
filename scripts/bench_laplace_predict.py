"""Time the Laplace predictive of DEF's MNIST LeNet against one MAP training epoch.

Everything runs in this one process, on the same model: DEF's LeNet (conv 5x5x32, conv 5x5x64, FC 1024, FC 10;
``--channels``/``--hidden``/``--image-size`` shrink it), random images ``(1, 28, 28)`` with random labels, float32,
``--threads`` torch threads (1 by default), on ``--device`` (``auto``: CUDA when present).

- **epoch**: one epoch of ``method=map`` (Adam, lr 0.001, batch ``--batch-size`` = 50) over ``--n-data`` images,
  after a two-step warm-up, scaled linearly to MNIST's 50,000 training images when ``--n-data`` is smaller;
- **predict**: ``Laplace.predict_sets`` with ``--n-samples`` (10) posterior samples over ``--n-predict`` images
  split as the runner splits them (test, validation, OOD: 10k each for 30k), for each ``--structures`` posterior
  (fitted on ``--n-fit`` images; the fit is not timed) and each ``--predictives``, after a warm-up call on a few
  images; scaled linearly to ``--predict-to`` images (30,000: MNIST test + validation + notMNIST) when smaller.

The issue's target: ``ratio_to_epoch <= 1``. ``flop_ratio`` is that ratio in multiply-adds for a predictive that
evaluates ``--n-samples`` networks (:func:`flop_ratio`): one forward pass per sample and image, over a MAP epoch's
forward, weight and input gradients (:func:`bench_laplace_fit.multiply_adds` on one training step); for DEF's LeNet,
10 samples and 30,000 images it is about 2. ``cpu_ratio_to_epoch`` is the same ratio from this process's CPU
time (less sensitive to other jobs on a shared machine). On CUDA every timed region ends with a synchronisation
and ``cuda_peak_mib`` is the peak memory allocated during it. One JSON line per (structure, predictive):

    {"structure": "diag", "predictive": "sample", "predict_s": ..., "epoch_s": ..., "ratio_to_epoch": ..., ...}

    python scripts/bench_laplace_predict.py --n-data 5000 --n-predict 3000
    python scripts/bench_laplace_predict.py --n-data 100 --n-predict 60 --channels 2,3 --hidden 8 --image-size 8  # smoke
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from bdl_bench.methods import build_method
from bdl_bench.methods.laplace import Laplace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_laplace_fit import lenet_bench, multiply_adds, problem, step_macs_per_example, timed  # noqa: E402  (the same timing: warm, synchronised, CUDA peak memory)

FULL_N = 50_000  # MNIST training images (DEF Table 1)
PREDICT_TO = 30_000  # what a def_table1 run predicts: MNIST test (10k) + validation (10k) + notMNIST (about 10k)
PRIOR_PRECISION = 0.001  # experiment=def_table1
LR = 0.001
STRUCTURE_OPTIONS = {  # conf/variant/def_table1/*.yaml
    "diag": {"structure": "diag", "curvature": "ggn", "curvature_batch_size": 64},
    "kfac": {"structure": "kfac", "curvature": "fisher", "curvature_batch_size": 256},
    "def": {"structure": "def", "curvature": "fisher", "curvature_batch_size": 64, "rank": 200},
}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-data", type=int, default=FULL_N, help=f"MAP epoch images (default {FULL_N})")
    parser.add_argument("--n-predict", type=int, default=PREDICT_TO, help=f"predicted images (default {PREDICT_TO})")
    parser.add_argument("--n-fit", type=int, default=2000, help="images the posterior is fitted on (not timed)")
    parser.add_argument("--n-samples", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--structures", default="diag,kfac,def")
    parser.add_argument("--predictives", default="sample,linearised")
    parser.add_argument("--channels", default="32,64")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--image-size", type=int, default=28)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args(argv)
    if min(ns.n_data, ns.n_predict, ns.n_fit) < 3 or ns.n_samples < 1:
        parser.error("--n-data, --n-predict and --n-fit must be >= 3, --n-samples >= 1")
    for key, known in (("structures", STRUCTURE_OPTIONS), ("predictives", ("sample", "linearised"))):
        unknown = set(getattr(ns, key).split(",")) - set(known)
        if unknown:
            parser.error(f"unknown {key} {sorted(unknown)}; choose from {', '.join(known)}")
    return ns


def flop_ratio(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, n_samples: int) -> float:
    """Multiply-adds of ``n_samples`` forward passes over ``PREDICT_TO`` images, over those of a MAP epoch of
    ``FULL_N`` images in minibatches like ``x``, ``y`` (one Adam step of ``method=map`` counted): what
    ``ratio_to_epoch`` would be for a sampled predictive if every convolution and matrix product ran at the
    training step's speed; the linearised predictive's tangent passes cost more."""
    with torch.no_grad():
        forward = multiply_adds(lambda: model(x[:1]))
    return n_samples * PREDICT_TO * forward / (step_macs_per_example(model, x, y) * FULL_N)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ns = _parse(argv)
    bench = lenet_bench(ns, "bench_laplace_predict.py")
    device, model, x, y, theta, epoch = bench.device, bench.model, bench.x, bench.y, bench.theta, bench.epoch_times
    third = ns.n_predict // 3
    images = torch.rand(ns.n_predict, 1, ns.image_size, ns.image_size, generator=bench.generator).to(device)
    sets = {"test": images[:third], "val": images[third : 2 * third], "ood": images[2 * third :]}
    epoch_scale, predict_scale = FULL_N / ns.n_data, PREDICT_TO / ns.n_predict
    floor = flop_ratio(model, x[: ns.batch_size], y[: ns.batch_size], ns.n_samples)

    records = []
    for structure in ns.structures.split(","):
        for predictive in ns.predictives.split(","):
            laplace = build_method(
                {
                    "name": "laplace",
                    "n_curvature_samples": 1,
                    "prior_precision": None,
                    "dataset_scale": None,
                    "rank": None,
                    "lr": LR,
                    "map_dir": None,
                    **STRUCTURE_OPTIONS[structure],
                    "predictive": predictive,
                    "curvature_subset": None,
                }
            )
            assert isinstance(laplace, Laplace)
            laplace.setup(problem(model, device, ns.seed + 3))
            with torch.no_grad():
                laplace.theta.copy_(theta)
            laplace.fit_posterior(x[: ns.n_fit], y[: ns.n_fit])
            laplace.predict_sets({k: v[:2] for k, v in sets.items()}, 2)  # warm-up
            predict = timed(lambda method=laplace: method.predict_sets(sets, ns.n_samples), device)
            record = {
                "structure": structure,
                "predictive": predictive,
                "predict_s": round(predict[0] * predict_scale, 3),
                "epoch_s": round(epoch[0] * epoch_scale, 3),
                "ratio_to_epoch": round(predict[0] * predict_scale / (epoch[0] * epoch_scale), 3),
                "flop_ratio": round(floor, 3),
                "cpu_ratio_to_epoch": round(predict[1] * predict_scale / (epoch[1] * epoch_scale), 3),
                "n_samples": ns.n_samples,
                "n_predict": ns.n_predict,
                "n_data": ns.n_data,
                "scaled_to": {"predict": PREDICT_TO, "epoch": FULL_N},
                "scaling": f"linear in the images: predict_s x {predict_scale:g}, epoch_s x {epoch_scale:g}",
                "measured_predict_s": round(predict[0], 6),
                "measured_epoch_s": round(epoch[0], 6),
                "cuda_peak_mib": None if predict[2] is None else round(predict[2], 1),
                "epoch_cuda_peak_mib": None if epoch[2] is None else round(epoch[2], 1),
                "threads": ns.threads,
                "device": str(device),
                "model": {k: v for k, v in bench.model_cfg.items() if k != "name"},
                "torch": torch.__version__,
            }
            print(json.dumps(record), flush=True)
            records.append(record)
    return records


if __name__ == "__main__":
    main(sys.argv[1:])
