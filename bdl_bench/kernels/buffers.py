"""Reused gradient buffers of the layer-wise VI steps' hand-written backwards."""

from __future__ import annotations

import torch
from torch import Tensor


def mm_into(x: Tensor, y: Tensor, out: Tensor | None, alpha: float = 1.0) -> Tensor:
    """``alpha * x @ y``, written into ``out`` if given (a reused gradient buffer)."""
    if out is None:
        return torch.mm(x, y).mul_(alpha) if alpha != 1.0 else torch.mm(x, y)
    return torch.addmm(out, x, y, beta=0.0, alpha=alpha, out=out)


def reusable_grad_buffer(leaf: Tensor, buffer: Tensor) -> Tensor:
    """``buffer``, to receive ``leaf``'s gradient, unless ``leaf.grad`` already shares its memory (a second
    backward without zeroing, which accumulates into ``leaf.grad``): then a fresh tensor."""
    grad = leaf.grad
    if grad is not None and grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
        return torch.empty_like(buffer)
    return buffer


def gather_part_grads(grads: tuple[Tensor | None, ...], sizes: list[int], out: Tensor) -> Tensor:
    """Write the parameter-shaped ``grads`` (sizes ``sizes``) into the flat ``out`` in order; a part without
    gradient (``None``) gets zeros, one already written in its place (a layer's backward with
    ``mm(out=...)``) is left as it is: the backward of splitting a flat vector, into a reused buffer where
    ``torch.split``'s backward would concatenate into fresh memory every step."""
    for segment, size, grad in zip(torch.split(out, sizes), sizes, grads):
        if grad is None:
            segment.zero_()
        elif not (grad.data_ptr() == segment.data_ptr() and grad.is_contiguous() and grad.numel() == size):
            segment.view(grad.shape).copy_(grad)
    return out
