"""Build ``data/libsvm/usps_3vs5.npz`` (USPS digits 3 vs 5, as used by SLANG) from ``usps.h5``.

Pools the classic 7291 training and 2007 test USPS digits, keeps the 3s and 5s (824 + 716 = 1540
images of 16x16 = 256 pixels), rescales the pixels from [0, 1] to the usual [-1, 1] (``2 * x - 1``)
and labels "5" as 1 and "3" as 0. Rows keep the pooled order (train rows first, then test rows).

Usage::

    python scripts/make_usps_3vs5.py [--source /work/shared/data/usps/usps.h5] [--out data/libsvm/usps_3vs5.npz]

``np.savez_compressed`` writes byte-identical files for identical arrays (fixed zip timestamps), so
the SHA-256 in ``data/SHA256SUMS`` stays valid after regeneration with the same NumPy/zlib.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

DEFAULT_SOURCE = Path("/work/shared/data/usps/usps.h5")
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "data" / "libsvm" / "usps_3vs5.npz"
NEGATIVE_DIGIT, POSITIVE_DIGIT = 3, 5
EXPECTED_ROWS, EXPECTED_FEATURES = 1540, 256


def build_usps_3vs5(source: Path) -> tuple[np.ndarray, np.ndarray]:
    """Read ``usps.h5`` and return the pooled 3-vs-5 inputs and labels.

    Args:
        source: Path of the ``usps.h5`` file (groups ``train`` and ``test``, datasets ``data`` and
            ``target``; pixels in [0, 1]).

    Returns:
        ``(x, y)``: ``x`` float32 of shape (1540, 256) in [-1, 1]; ``y`` int8 of shape (1540,), 1 for "5".

    Raises:
        ValueError: If the file does not give the expected 1540 x 256 digits.
    """
    import h5py  # only the build script needs h5py

    xs, ts = [], []
    with h5py.File(source, "r") as f:
        for part in ("train", "test"):
            xs.append(np.asarray(f[part]["data"][...], dtype=np.float64))
            ts.append(np.asarray(f[part]["target"][...]).astype(np.int64).ravel())
    pixels, digits = np.concatenate(xs), np.concatenate(ts)
    keep = (digits == NEGATIVE_DIGIT) | (digits == POSITIVE_DIGIT)
    x = (2.0 * pixels[keep] - 1.0).astype(np.float32)
    y = (digits[keep] == POSITIVE_DIGIT).astype(np.int8)
    if x.shape != (EXPECTED_ROWS, EXPECTED_FEATURES):
        raise ValueError(
            f"{source}: expected {EXPECTED_ROWS} x {EXPECTED_FEATURES} digits 3/5, got {x.shape}; "
            "is this the 7291/2007 usps.h5 described in data/README.md?"
        )
    return x, y


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="usps.h5 to read")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="npz file to write")
    args = parser.parse_args(argv)
    x, y = build_usps_3vs5(args.source)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, x=x, y=y)
    print(
        f"wrote {args.out}: x {x.shape} {x.dtype} in [{x.min():g}, {x.max():g}], "
        f"y {y.shape} {y.dtype} ({int((y == 0).sum())} threes, {int(y.sum())} fives)"
    )


if __name__ == "__main__":
    main()
