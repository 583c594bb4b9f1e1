"""``make_laplace(**options)``: a Laplace method from ``conf/method/laplace.yaml`` with those options changed."""

from __future__ import annotations

from pathlib import Path

import yaml

from bdl_bench.methods import build_method
from bdl_bench.methods.laplace import Laplace

CONF = Path(__file__).resolve().parents[2] / "conf" / "method" / "laplace.yaml"


def make_laplace(**overrides: object) -> Laplace:
    method = build_method({**yaml.safe_load(CONF.read_text()), **overrides})
    assert isinstance(method, Laplace)
    return method
