r"""Per-example "pseudo-gradients" whose outer products are the GGN or the sampled-label Fisher.

For a network :math:`f(x;\theta)` with per-example loss :math:`\ell(f, y) = -\log p(y \mid f)`, the
generalised Gauss-Newton (GGN) of example i is :math:`J_i^\top \Lambda_i J_i`, with
:math:`J_i = \partial f_i / \partial\theta` and :math:`\Lambda_i = \partial^2 \ell / \partial f^2`. Writing
:math:`\Lambda_i = L_iL_i^\top` it is :math:`\sum_k g_{ik}g_{ik}^\top` with
:math:`g_{ik} = J_i^\top L_i e_k`, the backpropagation of the column :math:`L_ie_k` (Martens & Grosse
2015, Sec. 5; Botev et al. 2017). The Fisher with labels sampled from the model,
:math:`\mathbb E_{\tilde y\sim p(y\mid f_i)}[\nabla\ell\nabla\ell^\top]`, is estimated the same way with
:math:`g_{is} = S^{-1/2}\nabla_\theta\ell(f_i, \tilde y_{is})` for S label draws. For the three
likelihoods here (Gaussian, Bernoulli-logit, softmax) the exact Fisher equals the GGN.

For an ``nn.Linear`` layer :math:`z = Wa + b` each pseudo-gradient restricted to the layer is
:math:`\delta\,\tilde a^\top` with :math:`\tilde a = [a, 1]` (the bias absorbed, as in Lee et al.,
eq. 1) and :math:`\delta` the backpropagated vector at the layer's pre-activation. An ``nn.Conv2d``
layer is a linear layer applied at T spatial positions to the input patches :math:`\tilde a_t`
(``F.unfold``, with a trailing 1 for the bias), so its pseudo-gradient is
:math:`\sum_t\delta_t\tilde a_t^\top` (Grosse & Martens 2016, KFC); a linear layer is the case T = 1.
One forward pass and one vectorised backward pass of the K cotangents (K = the number of columns of
:math:`L_i`, or S) give every :math:`\tilde a_{it}` and :math:`\delta_{ikt}` of a minibatch; Kronecker
factors, diagonals and exact blocks are then formed from these (:mod:`bdl_bench.curvature.kron`,
:mod:`bdl_bench.curvature.exact`).

Block layout: a layer's parameters, read in the "augmented row-major" order of
:math:`\tilde W = [W, b]` (m x n: m outputs or output channels, n inputs or C_in·k_h·k_w, plus 1 with a
bias; a conv weight ``(m, C_in, k_h, k_w)`` flattens row-major into the unfold order), have for T = 1
the pseudo-gradient :math:`\operatorname{vec}_r(\delta\tilde a^\top) = \delta\otimes\tilde a`, so the
curvature block is :math:`\sum \delta\delta^\top\otimes\tilde a\tilde a^\top` and KFAC's is
:math:`G\otimes A`. (Lee et al. write :math:`A\otimes G` for column-stacked vec; the two are the same
matrix up to the perfect shuffle.) :func:`block_index` maps that order to the flat parameter vector.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bdl_bench.likelihoods import Bernoulli, Categorical, Gaussian, Likelihood
from bdl_bench.models.params import n_params, sequential_layers


class CurvatureKind(str, Enum):
    """Which per-example curvature the pseudo-gradients represent: the GGN :math:`J^\\top\\Lambda J`, or the Monte
    Carlo Fisher with labels sampled from the model's predictive (Lee et al., App. E)."""

    GGN = "ggn"
    FISHER = "fisher"


@dataclass(frozen=True)
class ConvSpec:
    """Geometry of an ``nn.Conv2d`` layer (``groups=1``, zero padding)."""

    kernel_size: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]


@dataclass(frozen=True)
class KronSlot:
    """Where one ``nn.Linear`` or ``nn.Conv2d`` layer sits in the model and the flat parameter vector."""

    module_index: int  # position in the nn.Sequential
    in_features: int  # n without the bias: inputs (linear) or C_in·k_h·k_w (conv)
    out_features: int  # m: outputs (linear) or output channels (conv)
    weight_offset: int  # the (row-major) weight's first entry in the flat vector
    bias_offset: int | None  # bias[0], or None without a bias
    conv: ConvSpec | None = None  # None for a linear layer

    @property
    def weight_slice(self) -> slice:
        return slice(self.weight_offset, self.weight_offset + self.out_features * self.in_features)

    @property
    def bias_slice(self) -> slice | None:
        if self.bias_offset is None:
            return None
        return slice(self.bias_offset, self.bias_offset + self.out_features)

    @property
    def shape(self) -> tuple[int, int]:
        """(m, n) of the augmented weight :math:`[W, b]`."""
        return self.out_features, self.in_features + (self.bias_offset is not None)


@dataclass(frozen=True)
class KronLayout:
    """The weight layers of an ``nn.Sequential`` and the size D of its flat parameter vector."""

    slots: tuple[KronSlot, ...]
    n_params: int


def kron_layout(model: nn.Module, *, convolutions: bool = True) -> KronLayout:
    """Locate every ``nn.Linear`` and (with ``convolutions``) ``nn.Conv2d`` layer of ``model`` in the flat
    parameter vector; ``ValueError`` unless ``model`` is an ``nn.Sequential`` of such layers, each used once
    (convolutions with groups=1 and numeric zero padding), and parameter-free modules."""
    what = "Kronecker factors" if convolutions else "per-example factors"
    kinds = "nn.Linear or nn.Conv2d" if convolutions else "nn.Linear"
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"{what} need an nn.Sequential model, got {type(model).__name__}")
    slots = []
    seen: set[int] = set()
    for index, module, layer in sequential_layers(model):
        is_conv = convolutions and isinstance(module, nn.Conv2d)
        if layer is None or not (isinstance(module, nn.Linear) or is_conv):
            if any(True for _ in module.parameters()):
                raise ValueError(
                    f"{what} handle {kinds} layers and parameter-free modules; module {index} is "
                    f"{type(module).__name__}"
                )
            continue
        if id(module) in seen:
            raise ValueError(f"{what} need distinct layers; module {index} reuses an earlier {type(module).__name__}")
        seen.add(id(module))
        weight_offset, bias_offset = layer.slices["weight"].start, layer.offset("bias")
        if not is_conv:
            slots.append(KronSlot(index, module.in_features, module.out_features, weight_offset, bias_offset))
            continue
        if module.groups != 1 or module.padding_mode != "zeros" or isinstance(module.padding, str):
            raise ValueError(
                f"module {index} ({module}): {what} handle convolutions with groups=1, zero padding given as numbers"
            )
        spec = ConvSpec(
            tuple(module.kernel_size),
            tuple(module.stride),
            tuple(module.padding),
            tuple(module.dilation),  # type: ignore[arg-type]
        )
        n_in = module.in_channels * spec.kernel_size[0] * spec.kernel_size[1]
        slots.append(KronSlot(index, n_in, module.out_channels, weight_offset, bias_offset, spec))
    if not slots:
        raise ValueError(f"{what} need at least one {kinds} layer")
    return KronLayout(slots=tuple(slots), n_params=n_params(model))


@dataclass(frozen=True)
class LayerPseudoGrads:
    """One weight layer's factors for a minibatch of M examples at T positions (T = 1: linear); :attr:`inputs`
    unfolds a conv's input map into patches only when a consumer asks for them."""

    slot: KronSlot
    layer_input: Tensor  # (M, n_in) or the feature map (M, C, H, W)
    output_grads: Tensor  # delta_ikt, (K, M, T, m)

    @cached_property
    def inputs(self) -> Tensor:
        """:math:`\\tilde a_{it}` (with a trailing 1 when the layer has a bias), ``(M, T, n)``."""
        return augmented_patches(self.layer_input, self.slot)

    @property
    def shape(self) -> tuple[int, int]:
        return self.slot.shape

    @property
    def n_positions(self) -> int:
        """T, the spatial positions (1 for a linear layer)."""
        return self.output_grads.shape[2]

    @property
    def uses_conv_taps(self) -> bool:
        """Whether this is a stride-1, dilation-1 convolution with at least ``_MIN_TAP_CHANNELS`` input channels,
        whose pseudo-gradients are formed from the input map by :func:`conv_taps` rather than from patches."""
        spec = self.slot.conv
        return (
            spec is not None
            and spec.stride == (1, 1)
            and spec.dilation == (1, 1)
            and self.layer_input.shape[1] >= _MIN_TAP_CHANNELS
        )

    def per_example(self, width: int | None = None) -> Tensor:
        """The pseudo-gradients :math:`\\sum_t\\delta_{ikt}\\tilde a_{it}^\\top` as matrices, ``(K, M, m, n)``, or
        ``(K, M, m, width)`` zero after column n (GEMMs on a multiple of the SIMD width run faster). From the
        input map (:func:`_conv_per_example`) where :attr:`uses_conv_taps`, else by one batched GEMM with the
        unfolded patches."""
        n = self.shape[1]
        width = n if width is None else width
        if width < n:
            raise ValueError(f"width must be >= n = {n}, got {width}")
        if self.n_positions == 1:
            return self.output_grads[:, :, 0, :, None] * _pad_columns(self.inputs[:, 0], width)[None, :, None, :]
        if self.uses_conv_taps:
            return _conv_per_example(self.layer_input, self.output_grads, self.slot, width)
        # one batched GEMM (m x T x n per example)
        return self.output_grads.transpose(2, 3) @ _pad_columns(self.inputs, width)


_MIN_TAP_CHANNELS = 8  # input channels from which _conv_per_example beats unfolding (its GEMMs have k_w·C columns)


def _pad_columns(rows: Tensor, width: int) -> Tensor:
    if rows.shape[-1] == width:
        return rows
    return F.pad(rows, (0, width - rows.shape[-1]))


def conv_taps(x: Tensor, deltas: Tensor, slot: KronSlot, out: Tensor | None = None) -> Tensor:
    r"""A stride-1 convolution's pseudo-gradients by kernel row, without unfolding patches: ``(kh, K, M, m, kw·C)``,
    entry ``[a, k, i, :, (b, c)]`` = :math:`\sum_t\delta_{ikt}x^p_{i,t+(a,b),c}` (the weight gradient's
    columns of kernel position (a, b) and input channel c; no bias column).

    For kernel row a, :math:`\sum_t\delta_t x^p_{t+(a,b)}` for all b is one GEMM of :math:`\delta` (zero-padded
    to the padded map's width, so that positions t are a flat range) with an overlapping strided view of
    :math:`x^p` (rows: positions; columns: (b, c), contiguous). ``x`` is the input map ``(M, C, H, W)``, ``deltas``
    ``(K, M, T, m)``; ``out``, when given (contiguous, ``deltas``' dtype), is filled and returned.
    """
    spec = slot.conv
    assert spec is not None
    (kh, kw), (ph, pw) = spec.kernel_size, spec.padding
    n_draws, n_rows, _, m = deltas.shape
    channels, height, width = x.shape[1:]
    out_h, out_w, padded_w = height + 2 * ph - kh + 1, width + 2 * pw - kw + 1, width + 2 * pw
    grid = F.pad(x, (pw, pw, ph, ph + 1)).permute(0, 2, 3, 1).contiguous()  # (M, H_p + 1, W_p, C): one spare row
    wide = F.pad(deltas.view(n_draws, n_rows, out_h, out_w, m), (0, 0, 0, padded_w - out_w))
    wide = wide.view(n_draws, n_rows, out_h * padded_w, m).transpose(2, 3)  # (K, M, m, out_h·W_p)
    taps = deltas.new_empty(kh, n_draws, n_rows, m, kw * channels) if out is None else out
    for a in range(kh):
        view = grid.as_strided(
            (n_rows, out_h * padded_w, kw * channels),
            (grid.stride(0), channels, 1),
            grid.storage_offset() + a * padded_w * channels,
        )
        for k in range(n_draws):
            torch.bmm(wide[k], view, out=taps[a, k])
    return taps


def _conv_per_example(x: Tensor, deltas: Tensor, slot: KronSlot, n_cols: int | None = None) -> Tensor:
    r"""A stride-1 convolution's :math:`\sum_t\delta_{ikt}\tilde a_{it}^\top`, ``(K, M, m, n)`` (or ``n_cols``
    columns, zero after n), from :func:`conv_taps` (no unfolded patches)."""
    spec = slot.conv
    assert spec is not None
    kh, kw = spec.kernel_size
    n_draws, n_rows, _, m = deltas.shape
    channels = x.shape[1]
    taps = conv_taps(x, deltas, slot)
    n_in, n = slot.in_features, slot.shape[1]
    grads = deltas.new_empty(n_draws, n_rows, m, n if n_cols is None else n_cols)
    # (a, K, M, m, (b, c)) -> (K, M, m, (c, a, b)), the unfold order, in one copy
    grads[..., :n_in].unflatten(-1, (channels, kh, kw)).copy_(
        taps.view(kh, n_draws, n_rows, m, kw, channels).permute(1, 2, 3, 5, 0, 4)
    )
    if slot.bias_slice is not None:
        grads[..., n_in] = deltas.sum(2)
    grads[..., n:].zero_()
    return grads


def augmented_patches(layer_input: Tensor, slot: KronSlot) -> Tensor:
    """The layer's inputs :math:`\\tilde a_{it} = [a_{it}, 1]` as ``(M, T, n)`` (``F.unfold`` patches for a conv)."""
    if slot.conv is None:
        a = layer_input[:, None, :]
    else:
        spec = slot.conv
        a = F.unfold(layer_input, spec.kernel_size, spec.dilation, spec.padding, spec.stride).mT  # (M, T, n_in)
    if slot.bias_slice is not None:
        a = torch.cat([a, torch.ones_like(a[..., :1])], dim=-1)
    return a


@dataclass(frozen=True)
class PseudoGrads:
    """Pseudo-gradients of one minibatch: ``sum_k g_ik g_ik^T`` is example i's curvature. ``labels`` are the
    sampled labels ``(S, M)`` behind ``fisher``'s pseudo-gradients (``None`` for the GGN): passing them back to
    :func:`pseudo_grads` recomputes the same ones."""

    layers: tuple[LayerPseudoGrads, ...]  # in model order
    layout: KronLayout
    n_examples: int  # M
    labels: Tensor | None = None

    def dense(self) -> Tensor:
        """All pseudo-gradients in flat parameter order, ``(K·M, D)`` (small nets only)."""
        first = self.layers[0].output_grads
        n_rows = first.shape[0] * first.shape[1]
        out = torch.zeros(n_rows, self.layout.n_params, dtype=first.dtype, device=first.device)
        for layer in self.layers:
            slot = layer.slot
            grads = layer.per_example().reshape(n_rows, slot.out_features, -1)
            out[:, slot.weight_slice] = grads[:, :, : slot.in_features].reshape(n_rows, -1)
            if slot.bias_slice is not None:
                out[:, slot.bias_slice] = grads[:, :, slot.in_features]
        return out


def block_index(slot: KronSlot, device: torch.device | None = None) -> Tensor:
    """Flat positions of a layer's parameters in augmented row-major order of :math:`[W, b]`, ``(m·n,)``."""
    m, n_in = slot.out_features, slot.in_features
    weight = slot.weight_offset + torch.arange(m * n_in, device=device).view(m, n_in)
    if slot.bias_offset is None:
        return weight.reshape(-1)
    bias = slot.bias_offset + torch.arange(m, device=device).view(m, 1)
    return torch.cat([weight, bias], dim=1).reshape(-1)


def sample_labels(likelihood: Likelihood, f: Tensor, n_samples: int, generator: torch.Generator) -> Tensor:
    """Labels drawn from the model's predictive :math:`p(y \\mid f)`, ``(S, M)``."""
    shape = (n_samples, *f.shape)
    if isinstance(likelihood, Gaussian):
        eps = torch.randn(shape, generator=generator, dtype=f.dtype, device=generator.device).to(f.device)
        return (f + eps / math.sqrt(likelihood.noise_precision)).squeeze(-1)
    if isinstance(likelihood, Bernoulli):
        u = torch.rand(shape, generator=generator, dtype=f.dtype, device=generator.device).to(f.device)
        return (u < torch.sigmoid(f)).to(f.dtype).squeeze(-1)
    if isinstance(likelihood, Categorical):
        probs = torch.softmax(f, dim=-1).expand(shape).reshape(-1, f.shape[-1])
        draws = torch.multinomial(probs.to(generator.device), 1, generator=generator).to(f.device)
        return draws.view(n_samples, f.shape[0])
    raise ValueError(f"cannot sample labels for likelihood {type(likelihood).__name__}")


def _forward(
    model: nn.Module, layout: KronLayout, theta: Tensor, x: Tensor
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """Network output at ``theta``, every layer's input (rows or feature maps, unfolded lazily) and its
    pre-activation (the roots of the graph), in layer order."""
    slot_of = {slot.module_index: slot for slot in layout.slots}
    inputs: list[Tensor] = []
    pre_activations: list[Tensor] = []
    h = x
    for index, module in enumerate(model):
        slot = slot_of.get(index)
        if slot is None:
            h = module(h)
            continue
        weight = theta[slot.weight_slice]
        bias = None if slot.bias_slice is None else theta[slot.bias_slice]
        inputs.append(h.detach())
        if slot.conv is None:
            z = F.linear(h, weight.view(slot.out_features, slot.in_features), bias)
        else:
            spec = slot.conv
            kernel = weight.view(slot.out_features, -1, *spec.kernel_size)
            z = F.conv2d(h, kernel, bias, spec.stride, spec.padding, spec.dilation)
        if not z.requires_grad:
            z.requires_grad_(True)
        pre_activations.append(z)
        h = z
    return h, inputs, pre_activations


def _backward(f: Tensor, roots: list[Tensor], cotangents: Tensor) -> tuple[Tensor, ...]:
    """:math:`\\delta` at every root for each of the K cotangents ``(K, M, out)``: ``(K, M, ...)`` per root, by one
    vectorised backward pass (a plain one for K = 1)."""
    if cotangents.shape[0] == 1:
        return tuple(g.unsqueeze(0) for g in torch.autograd.grad(f, roots, grad_outputs=cotangents[0]))
    return torch.autograd.grad(f, roots, grad_outputs=cotangents, is_grads_batched=True)


def pseudo_grads(
    model: nn.Module,
    theta: Tensor,
    x: Tensor,
    y: Tensor,
    likelihood: Likelihood,
    *,
    kind: CurvatureKind | str = CurvatureKind.GGN,
    n_samples: int = 1,
    generator: torch.Generator | None = None,
    labels: Tensor | None = None,
    layout: KronLayout | None = None,
) -> PseudoGrads:
    """Layer inputs and backpropagated vectors of one minibatch ``x`` ``(M, in)`` at ``theta`` ``(D,)`` (see the
    module docstring); K = S label draws for ``fisher``, the number of columns of :math:`L_i` for ``ggn`` (1 for
    one output, C for C classes). ``y`` is read only by a likelihood without a closed-form Hessian factor;
    ``labels`` ``(S, M)`` (``fisher`` only) are used instead of drawing from ``generator``; ``layout`` is
    ``kron_layout(model)``, to skip recomputing it.
    """
    kind = CurvatureKind(kind)
    layout = kron_layout(model) if layout is None else layout
    theta = theta.detach()
    x = x.to(theta.dtype)
    with torch.enable_grad():
        f, inputs, pre_activations = _forward(model, layout, theta, x)
        if kind is CurvatureKind.GGN:
            cotangents = likelihood.hessian_sqrt(f.detach(), y)  # (K, M, out)
        else:
            if labels is None:
                if generator is None:
                    raise ValueError("curvature=fisher needs a generator to draw labels")
                if n_samples < 1:
                    raise ValueError(f"n_samples must be >= 1, got {n_samples}")
                labels = sample_labels(likelihood, f.detach(), n_samples, generator)
            f_leaf = f.detach().expand(labels.shape[0], *f.shape).requires_grad_(True)
            losses = torch.stack([likelihood.nll(f_s, label) for f_s, label in zip(f_leaf, labels)])
            # (S, M, out): gradients of the nll at the sampled labels, scaled so that sum_s = mean_s
            cotangents = torch.autograd.grad(losses.sum(), f_leaf)[0] / math.sqrt(labels.shape[0])
        grads = _backward(f, pre_activations, cotangents)
    layers = tuple(  # deltas (K, M, T, m): a conv's (K, M, m, H', W') flattened over its positions
        LayerPseudoGrads(slot, a, d[:, :, None, :] if slot.conv is None else d.flatten(3).transpose(2, 3))
        for slot, a, d in zip(layout.slots, inputs, grads)
    )
    kept = labels if kind is CurvatureKind.FISHER else None
    return PseudoGrads(layers=layers, layout=layout, n_examples=x.shape[0], labels=kept)


def iter_pseudo_grads(
    model: nn.Module,
    theta: Tensor,
    x: Tensor,
    y: Tensor,
    likelihood: Likelihood,
    *,
    batch_size: int,
    labels: Sequence[Tensor | None] | None = None,
    **options: Any,
) -> Iterator[PseudoGrads]:
    """:func:`pseudo_grads` (``options``: its ``kind``, ``n_samples`` and ``generator``) over consecutive minibatches
    of ``batch_size`` rows of ``(x, y)``; ``labels``: for ``fisher``, one ``(S, M)`` tensor per minibatch (e.g. an
    earlier pass's :attr:`PseudoGrads.labels`)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n_chunks = -(-x.shape[0] // batch_size)
    if labels is not None and len(labels) != n_chunks:
        raise ValueError(f"labels must have one entry per minibatch ({n_chunks}), got {len(labels)}")
    layout = kron_layout(model)
    for chunk, start in enumerate(range(0, x.shape[0], batch_size)):
        rows = slice(start, start + batch_size)
        drawn = None if labels is None else labels[chunk]
        yield pseudo_grads(model, theta, x[rows], y[rows], likelihood, labels=drawn, layout=layout, **options)
