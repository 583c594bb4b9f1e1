"""Adam as the point-estimate methods use it: PyTorch's fused kernel where the device has one (one pass over
parameters, gradients and moments per step instead of about eight; the same update up to float rounding).
``meta`` (the device check's stand-in for a GPU) has no fused kernel and gets the plain one."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

FUSED_DEVICE_TYPES = ("cpu", "cuda")


def adam(params: Iterable[Tensor], lr: float) -> torch.optim.Adam:
    """``torch.optim.Adam(params, lr)``, fused on a CPU or CUDA device."""
    params = list(params)
    return torch.optim.Adam(params, lr=lr, fused=params[0].device.type in FUSED_DEVICE_TYPES)


def load_adam_state(optimizer: torch.optim.Adam, state: Mapping[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``, keeping ``optimizer``'s own kernel choice.

    A state dict carries its optimizer's ``fused``/``foreach`` flags, which ``load_state_dict`` would
    otherwise copy: a checkpoint written by the plain Adam would switch a resumed run back to it."""
    kernels = [{k: group[k] for k in ("fused", "foreach")} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, flags in zip(optimizer.param_groups, kernels):
        group.update(flags)
