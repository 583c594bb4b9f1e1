"""A CPU-side device check: run code as if it were on an accelerator, on a machine without one.

Inside :func:`fake_device`, the device ``meta`` stands for a GPU. Tensors "on" it are :class:`DeviceTensor`
— a wrapper subclass whose ``.device`` is ``meta`` but which holds real CPU data, so the code computes its
usual numbers — and every operation that mixes them with ordinary CPU tensors raises :class:`DeviceMixError`,
as PyTorch does for CUDA and CPU tensors (so a tensor made without ``device=`` is found in the CPU test suite).
The rules follow PyTorch's for CUDA:

- a 0-dim CPU tensor may be an *input* of an operation on device tensors (TensorIterator's CPU-scalar
  rule), never its output or in-place target (``cpu_scalar += device_value`` fails on CUDA);
- CPU index tensors may index a device tensor (``aten.index``/``index_put``: PyTorch moves them);
- ``copy_`` and ``.to``/``.cpu()`` move data between devices;
- a generator must be on the device of the tensors it fills: ``torch.Generator(device="meta")`` inside
  the check gives a CPU generator that reports ``meta``, and using it for CPU tensors, or a CPU generator
  for device tensors, raises.

:attr:`DeviceCheck.syncs` counts the operations that make the host wait for a GPU (``.item()``,
``float(t)``, ``bool(t)``, copies to the CPU): tests use it to show that a training step has none.

What it cannot catch: anything decided by ``device.type == "cuda"`` (``torch.cuda.*`` calls, CUDA RNG
state); kernels that exist on the CPU only or behave differently on CUDA (dtype support, non-determinism,
TF32, out-of-memory, speed); mixes that a particular CUDA kernel rejects for 0-dim CPU tensors; CPU tensors
reaching a device op past the dispatcher (a custom C++ extension). ``torch.func`` transforms (``vmap``/``jvp``)
over device tensors (Laplace's linearised predictive) fail inside the wrapper. ``torch.save`` writes a device
tensor's data as a CPU tensor. Autograd, optimisers (non-fused), ``nn.Module.to`` and indexing work as on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("meta")  # the stand-in accelerator

_CPU = torch.device("cpu")
_MOVES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default, torch.ops.aten.copy.default}
_INDEXING = {
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put_.default,
    torch.ops.aten.index_put.default,
    torch.ops.aten._index_put_impl_.default,
}
_SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default}


class DeviceMixError(RuntimeError):
    """An operation mixed device tensors with CPU tensors in a way PyTorch refuses for CUDA."""


@dataclass
class DeviceCheck:
    """What :func:`fake_device` saw: ``syncs`` counts host-device synchronisations."""

    syncs: int = 0


_active: list[DeviceCheck] = []


def _is_device(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value = torch.device(value)
        except RuntimeError:
            return False
    return isinstance(value, torch.device) and value.type == DEVICE.type


class DeviceTensor(torch.Tensor):
    """CPU data reporting the stand-in device (see the module docstring)."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor, requires_grad: bool = False) -> DeviceTensor:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.shape,
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=DEVICE,
            requires_grad=requires_grad,
        )
        wrapper.elem = elem
        return wrapper

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"DeviceTensor({self.elem!r})"

    def data_ptr(self) -> int:  # the wrapper has no storage; code comparing pointers sees the data's
        return self.elem.data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        return self.elem.untyped_storage()

    def __reduce_ex__(self, protocol: Any) -> Any:  # torch.save: its data, as a CPU tensor (as map_location="cpu")
        return self.elem.__reduce_ex__(protocol)

    def tolist(self) -> Any:  # PyTorch refuses it for subclasses; on a GPU it copies to the host
        if _active:
            _active[-1].syncs += 1
        return self.elem.tolist()

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _dispatch(func, args, kwargs or {})


def _unwrap(t: Any) -> Any:
    return t.elem if isinstance(t, DeviceTensor) else t


def _dispatch(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """Run ``func`` on the CPU data of its device tensors, after checking that it mixes no devices."""
    flat = tree_flatten((args, kwargs))[0]
    on_device = any(isinstance(t, DeviceTensor) for t in flat)
    makes_device = _is_device(kwargs.get("device"))
    if not on_device and not makes_device:
        if any(type(t) is torch.Tensor and t.device.type == DEVICE.type for t in flat):
            raise RuntimeError(f"device check: {func} got a data-less {DEVICE.type} tensor it cannot emulate")
        return func(*args, **kwargs)
    _check_mix(func, args, kwargs)
    to_cpu = False
    if func is torch.ops.aten._to_copy.default and on_device:
        target = kwargs.get("device")
        to_cpu = target is not None and not _is_device(target)
    if _active and on_device and (func in _SYNCS or to_cpu):
        _active[-1].syncs += 1
    if makes_device:
        kwargs = {**kwargs, "device": _CPU}
    plain_args, plain_kwargs = tree_map(_unwrap, (args, kwargs))
    out = func(*plain_args, **plain_kwargs)
    if to_cpu:
        return out
    inputs = {id(t.elem): t for t in flat if isinstance(t, DeviceTensor)}
    plain_inputs = {id(t) for t in flat if type(t) is torch.Tensor}

    def wrap(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) in inputs:  # in-place / out= result: the wrapper that went in
            return inputs[id(t)]
        if id(t) in plain_inputs:  # e.g. cpu_tensor.copy_(device_tensor)
            return t
        return DeviceTensor(t)

    return tree_map(wrap, out)


def _written_arguments(func: Any, args: Any, kwargs: Any) -> list[Any]:
    """The arguments ``func`` writes to (in-place self, ``out=``)."""
    written = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            if i < len(args):
                written.append(args[i])
            elif argument.name in kwargs:
                written.append(kwargs[argument.name])
    return tree_flatten(written)[0]


def _check_mix(func: Any, args: Any, kwargs: Any) -> None:
    if func in _MOVES:
        return
    flat = tree_flatten((args, kwargs))[0]
    written = {id(t) for t in _written_arguments(func, args, kwargs)}
    indices = set()
    if func in _INDEXING:
        if not isinstance(args[0], DeviceTensor):
            raise DeviceMixError(f"{func}: a CPU tensor indexed with device indices")
        indices = {id(t) for t in tree_flatten(args[1])[0]}
    for t in flat:
        if type(t) is not torch.Tensor or t.device.type != "cpu" or id(t) in indices:
            continue
        if t.dim() > 0:
            raise DeviceMixError(
                f"{func} mixes device tensors with a CPU tensor of shape {tuple(t.shape)}; create it with device="
            )
        if id(t) in written:
            raise DeviceMixError(f"{func} writes device values into a 0-dim CPU tensor; create it with device=")


class _FakeGenerator(torch._C.Generator):
    """A CPU generator that reports the stand-in device (made by ``torch.Generator(device="meta")``)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return DEVICE


class _GeneratorFactory(torch._C.Generator):
    """Stands in for ``torch.Generator`` inside the check: ``device="meta"`` gives a :class:`_FakeGenerator`."""

    def __new__(cls, device: Any = "cpu") -> torch._C.Generator:  # type: ignore[misc]
        return _FakeGenerator() if _is_device(device) else torch._C.Generator(device)


def _op_on_device(args: Any, kwargs: Any) -> bool:
    """Whether a call's tensors live on the stand-in device (its ``device=``, else its tensor arguments)."""
    if kwargs.get("device") is not None:
        return _is_device(kwargs["device"])
    return any(isinstance(t, DeviceTensor) for t in tree_flatten((args, kwargs))[0])


_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}  # they copy their data below the dispatcher


class _CheckGenerators(TorchFunctionMode):
    """Refuses a generator on one device filling tensors on the other (checked here, before dispatch,
    where the generator is still the object the code made); makes ``torch.tensor(data, device="meta")``
    on the CPU and wraps it (PyTorch copies the data to the device below the dispatcher)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _FROM_DATA and _is_device(kwargs.get("device")):
            made = func(*args, **{**kwargs, "device": _CPU})
            return DeviceTensor(made.detach(), requires_grad=made.requires_grad)
        generator = kwargs.get("generator")
        if generator is None:
            generator = next((a for a in args if isinstance(a, torch._C.Generator)), None)
        if generator is not None and _op_on_device(args, kwargs) != isinstance(generator, _FakeGenerator):
            where = "device" if _op_on_device(args, kwargs) else "CPU"
            name = getattr(func, "__name__", func)
            raise DeviceMixError(f"{name}: a generator on {generator.device} fills {where} tensors")
        return func(*args, **kwargs)


class _RouteDevice(TorchDispatchMode):
    """Sends every operation that names the stand-in device (factories, ``.to``, the tensors PyTorch makes
    internally on a tensor's device) to :func:`_dispatch`."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _dispatch(func, args, kwargs or {})


@contextlib.contextmanager
def fake_device() -> Iterator[DeviceCheck]:
    """Run the body with ``meta`` as a GPU stand-in (see the module docstring); yields the sync counter.

    Example::

        with fake_device() as check:
            x = torch.ones(3, device="meta")
            torch.zeros(3) + x  # raises DeviceMixError
    """
    check = DeviceCheck()
    saved = torch.Generator
    torch.Generator = _GeneratorFactory  # type: ignore[misc]
    _active.append(check)
    try:
        with _CheckGenerators(), _RouteDevice():
            yield check
    finally:
        _active.pop()
        torch.Generator = saved  # type: ignore[misc]


def to_device(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` as a :class:`DeviceTensor` (a leaf; outside :func:`fake_device` too)."""
    return DeviceTensor(t.detach().clone(), requires_grad=t.requires_grad)
