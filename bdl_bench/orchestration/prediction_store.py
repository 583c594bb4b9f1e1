"""A run's final predictions made in chunks of posterior samples and kept on disk as they are made, so that a run
killed during its evaluation resumes it where it stopped (at a chunk boundary) rather than from the first sample.

Only a method whose ``predict`` returns independent draws (``Method.iid_predictive``: Laplace, MC dropout) is
chunked, and only where its evaluation is long: ``chunk_size`` samples per chunk, so that a chunk evaluates about
``CHUNK_BUDGET`` parameters x examples. Each *stage* (one call of a prediction function over all its samples, e.g.
Laplace's joint test/OOD pass, or the test part alone) lives in ``predictions.partial/`` in the run folder: each
part's outputs appended as raw bytes (``<stage>.<part>.bin``) and ``progress.json`` replaced atomically after
them, naming the samples done and the generator state after them. A stage is reused only when the fitted method
(``fingerprint``: a SHA-256 of its parameters and posterior), the generator state at the stage's start, the sample
count and the chunking all match; otherwise it starts again. Chunks are drawn the same way whether or not a run
was interrupted, so a resumed evaluation equals an unbroken one bit for bit (on the CPU, with one thread)."""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from bdl_bench.results import atomic_write_bytes

log = logging.getLogger(__name__)

PREDICTIONS_DIR = "predictions.partial"
PROGRESS_FILE = "progress.json"
CHUNK_BUDGET = 5 * 2**37  # parameters x examples per chunk: 10 samples of DEF's LeNet (3.3M) over 20,000 images

Draw = Callable[[int], Mapping[str, Tensor]]  # n -> {part: (n, N, out)} from the method's generator


def chunk_size(n_parameters: int, n_examples: int) -> int:
    """Samples per chunk: ``CHUNK_BUDGET`` parameters x examples, at least 1."""
    return max(1, CHUNK_BUDGET // max(1, n_parameters * n_examples))


def fingerprint(method: Any) -> str:
    """SHA-256 of the fitted method's point estimate and the tensors of its posterior (where it has them)."""
    digest = hashlib.sha256()
    tensors: list[Tensor | None] = [method.point_estimate()]
    posterior = method.posterior()
    if dataclasses.is_dataclass(posterior):
        tensors += [getattr(posterior, f.name) for f in dataclasses.fields(posterior)]
    for t in tensors:
        if isinstance(t, Tensor):
            digest.update(str((t.dtype, tuple(t.shape))).encode())
            digest.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())  # 0-dim too
    return digest.hexdigest()


def _state_digest(generator: torch.Generator) -> str:
    return hashlib.sha256(generator.get_state().numpy().tobytes()).hexdigest()


def stored_samples(run_dir: Path) -> dict[str, tuple[int, int]]:
    """``{stage: (samples stored, samples wanted)}`` of a run's unfinished final predictions (``bdl-bench status``)."""
    try:
        stages = json.loads((Path(run_dir) / PREDICTIONS_DIR / PROGRESS_FILE).read_text())
        return {name: (int(r["done"]), int(r["key"]["n_samples"])) for name, r in stages.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


class PredictionStore:
    """The chunked, resumable final predictions of the fitted ``method`` of one run (module docstring), drawn from
    ``generator``; ``progress``: a bar over the samples."""

    def __init__(self, run_dir: Path, method: Any, generator: torch.Generator, *, progress: bool = False):
        self.folder = Path(run_dir) / PREDICTIONS_DIR
        self.method, self.generator, self.show_progress = method, generator, progress

    @functools.cached_property
    def fingerprint(self) -> str:
        return fingerprint(self.method)

    def predict(self, stage: str, draw: Draw, n_samples: int, chunk: int) -> dict[str, Tensor]:
        """``draw(n_samples)``'s outputs, made ``chunk`` samples at a time (one call, and nothing stored, where
        ``chunk >= n_samples``), resuming a stored partial stage that matches."""
        if chunk >= n_samples:
            return dict(draw(n_samples))
        start_state = _state_digest(self.generator)
        key = {"fingerprint": self.fingerprint, "start_state": start_state, "n_samples": n_samples, "chunk": chunk}
        record = self._stages().get(stage)
        done, outputs = 0, {}
        if record is not None and record["key"] == key:
            outputs = self._load(stage, record)
            done = int(record["done"])
            self.generator.set_state(torch.frombuffer(bytearray(base64.b64decode(record["state"])), dtype=torch.uint8))
            log.info("%s: resuming the %s predictions at sample %d of %d", self.folder.parent, stage, done, n_samples)
        elif record is not None:
            log.info("%s: %s predictions of another fit or setting discarded", self.folder.parent, stage)
        chunks: dict[str, list[Tensor]] = {part: [f] for part, f in outputs.items()}
        with tqdm(
            total=n_samples, initial=done, desc=f"{stage} predictions", unit="sample", disable=not self.show_progress
        ) as bar:
            while done < n_samples:
                size = min(chunk, n_samples - done)
                new = dict(draw(size))
                self._append(stage, new, done)
                done += size
                for part, f in new.items():
                    chunks.setdefault(part, []).append(f)
                self._record(stage, key, done, new)
                bar.update(size)
        return {part: torch.cat(fs) for part, fs in chunks.items()}

    def clear(self) -> None:
        """Remove the stored predictions (the run has written its metrics)."""
        shutil.rmtree(self.folder, ignore_errors=True)

    def _stages(self) -> dict[str, Any]:
        path = self.folder / PROGRESS_FILE
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (json.JSONDecodeError, OSError) as error:
            log.warning("%s unreadable (%s); the final predictions start again", path, error)
            return {}

    def _file(self, stage: str, part: str) -> Path:
        return self.folder / f"{stage}.{part}.bin"

    def _load(self, stage: str, record: Mapping[str, Any]) -> dict[str, Tensor]:
        """The stored outputs of ``record``'s samples (bytes beyond them, from a torn append, are ignored)."""
        outputs = {}
        for part, meta in record["parts"].items():
            dtype = getattr(torch, meta["dtype"])
            shape = (int(record["done"]), *meta["shape"])
            count = int(np.prod(shape))
            array = np.fromfile(self._file(stage, part), dtype=torch.empty((), dtype=dtype).numpy().dtype, count=count)
            if array.size != count:
                raise RuntimeError(f"{self._file(stage, part)} holds fewer outputs than {PROGRESS_FILE} says")
            outputs[part] = torch.from_numpy(array.copy()).reshape(shape).to(meta["device"])
        return outputs

    def _append(self, stage: str, outputs: Mapping[str, Tensor], done: int) -> None:
        """Append ``outputs`` to each part's file after its first ``done`` samples (bytes beyond them, from a torn
        append, are cut off)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for part, f in outputs.items():
            path = self._file(stage, part)
            keep = done * f[0].numel() * f.element_size()
            with open(path, "r+b" if path.exists() else "wb") as file:
                file.truncate(keep)
                file.seek(keep)
                file.write(f.detach().cpu().contiguous().numpy().tobytes())
                file.flush()
                os.fsync(file.fileno())

    def _record(self, stage: str, key: Mapping[str, Any], done: int, outputs: Mapping[str, Tensor]) -> None:
        stages = self._stages()
        state = base64.b64encode(self.generator.get_state().numpy().tobytes()).decode()
        parts = {
            part: {"shape": list(f.shape[1:]), "dtype": str(f.dtype).removeprefix("torch."), "device": str(f.device)}
            for part, f in outputs.items()
        }
        stages[stage] = {"key": dict(key), "done": done, "state": state, "parts": parts}
        atomic_write_bytes(self.folder / PROGRESS_FILE, json.dumps(stages, indent=1).encode())
