"""A run's reference posterior (``reference:`` in the config, e.g. SLANG Table 1's full-Gaussian exact VI),
fitted once per split and cached under ``<cache_dir>/<key>.pt``, the key hashing everything the fit depends on.

Every column of a table compares its posterior with the same reference on the same split, so the reference
starts from the prior mean (zero parameters), not from wherever the method left the model. For exact VI of
logistic regression the ELBO is concave with a unique maximiser, so the start only matters up to the
optimiser's tolerance."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from bdl_bench.data.base import Dataset
from bdl_bench.gaussians.io import load_gaussian, save_gaussian
from bdl_bench.likelihoods import Likelihood
from bdl_bench.methods import Problem, build_method


def reference_posterior(
    reference_cfg: Mapping[str, Any],
    model: torch.nn.Module,
    likelihood: Likelihood,
    prior: torch.Tensor,
    dataset: Dataset,
    seed: int,
    cache_dir: Path | None = None,
) -> Any:
    """The posterior of the method ``reference_cfg`` on ``dataset``'s training set, fitted on a zeroed copy of
    ``model``, from ``cache_dir`` when it is there (``None``: no caching), under 32 hex digits of a SHA-256 of
    everything the fit depends on."""
    path = None
    if cache_dir is not None:
        digest = hashlib.sha256()
        described = {
            "reference": dict(reference_cfg),
            "model": repr(model),
            "likelihood": f"{type(likelihood).__name__}{sorted(vars(likelihood).items())!r}",
            "dtype": str(prior.dtype),
            "seed": seed,
        }
        digest.update(json.dumps(described, sort_keys=True, default=str).encode())
        for tensor in (dataset.x_train, dataset.y_train, prior):
            array = tensor.detach().cpu().contiguous()
            digest.update(str((tuple(array.shape), str(array.dtype))).encode())
            digest.update(array.numpy().tobytes())
        path = Path(cache_dir) / f"{digest.hexdigest()[:32]}.pt"
        if path.exists():
            cached = load_gaussian(path)
            return type(cached)(**{f.name: getattr(cached, f.name).to(prior) for f in dataclasses.fields(cached)})
    start = copy.deepcopy(model)
    with torch.no_grad():
        for param in start.parameters():
            param.zero_()
    reference = build_method(dict(reference_cfg))
    generator = torch.Generator(device=prior.device).manual_seed(seed + 4)
    reference.setup(
        Problem(model=start, likelihood=likelihood, n_data=dataset.n_train, prior_precision=prior, generator=generator)
    )
    reference.fit(
        dataset.x_train,
        dataset.y_train,
        n_epochs=1,
        batch_size=dataset.n_train,
        data_generator=torch.Generator().manual_seed(seed + 5),
    )
    posterior = reference.posterior()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_gaussian(posterior, path)  # atomic: concurrent sweep workers may write the same key
    return posterior
