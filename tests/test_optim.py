"""The fused Adam helper: the plain Adam's update, and a resumed run keeps the fused kernel."""

from __future__ import annotations

import copy

import torch
from torch.testing import assert_close

from bdl_bench.optim import adam, load_adam_state


def gradients(step: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(step), dtype=torch.float64)


def test_fused_adam_follows_the_plain_adam_over_several_steps() -> None:
    start = torch.randn(4, 6, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    fused_p, plain_p = start.clone().requires_grad_(True), start.clone().requires_grad_(True)
    fused, plain = adam([fused_p], 0.01), torch.optim.Adam([plain_p], lr=0.01)
    assert fused.param_groups[0]["fused"] and not plain.param_groups[0]["fused"]
    for step in range(6):
        for p, opt in ((fused_p, fused), (plain_p, plain)):
            p.grad = gradients(step, p.shape)
            opt.step()
    assert_close(fused_p, plain_p, rtol=1e-12, atol=1e-14)
    assert not torch.equal(fused_p, start)


def test_loading_a_plain_adam_state_keeps_the_fused_kernel() -> None:
    """A checkpoint written by the plain Adam resumes with the same moments but the fused kernel."""
    p = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    plain = torch.optim.Adam([p], lr=0.01)
    p.grad = gradients(0, p.shape)
    plain.step()
    q = p.detach().clone().requires_grad_(True)
    fused = adam([q], 0.01)
    load_adam_state(fused, copy.deepcopy(plain.state_dict()))  # as a checkpoint file gives it: no shared tensors
    assert fused.param_groups[0]["fused"] is True
    assert_close(fused.state[q]["exp_avg_sq"], plain.state[p]["exp_avg_sq"], rtol=0, atol=0)
    for param, opt in ((p, plain), (q, fused)):
        param.grad = gradients(1, param.shape)
        opt.step()
    assert_close(q, p, rtol=1e-12, atol=1e-14)


def test_meta_tensors_get_the_plain_kernel() -> None:
    assert not adam([torch.zeros(3, device="meta", requires_grad=True)], 0.1).param_groups[0]["fused"]
