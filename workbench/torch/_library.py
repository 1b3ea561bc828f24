"""How every ``workbench::`` op is registered: one ``torch.library.Library``, a schema, kernels, a fake, autograd.

Registration is the low-level ``Library.define`` + ``Library.impl`` rather than ``torch.library.custom_op``: the
schema is written out (vLLM's, argument for argument) and a call crosses from Python into the dispatcher and back at
most once. ``custom_op`` and ``register_autograd`` each add a Python kernel at the Autograd key that walks every
argument and dispatches again; here the kernel at the Autograd key *is* the implementation for plain eager tensors,
and redispatches below autograd only for what tracing hands it (fake, functional and meta tensors).

Two eager fast paths skip the dispatcher altogether when every tensor is a plain CPU/CUDA tensor that autograd does
not track, nothing is tracing and no TorchDispatchMode / TorchFunctionMode is active (a mode must see the op):

* ``torch.ops.workbench.<op>(...)``, the OpOverloadPacket a vLLM-style caller uses (``_fast_packet``);
* the Python functions of ``workbench.torch`` (``bypass``; quack's ``_torch_library_op.py`` does the same for
  ``custom_op``).

``OpOverload``s (``torch.ops.workbench.<op>.default``), which tracing, ``opcheck`` and compiled graphs call, always
go through the dispatcher. bench/bench_torch.py measures the ways in against the CuPy path.

Inference only: a functional op called on inputs that autograd tracks returns outputs whose backward raises;
mutating ops (``*_out``, ``moe_align_block_size``) cannot carry a backward, so their kernels refuse inputs that
require grad while grad mode is on.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

NAMESPACE = "workbench"
LIB = torch.library.Library(NAMESPACE, "DEF")


def _no_backward(name: str):
    def backward(ctx, *grads):
        raise RuntimeError(f"{NAMESPACE}::{name} is inference-only: it has no backward (the Marlin kernels compute "
                           f"C = A @ dequant(B) for serving); run the forward under torch.no_grad()")

    return backward


def refuse_grad(name: str, tensors: dict[str, Any]) -> None:
    """For mutating ops (no autograd formula possible): refuse a tracked input instead of dropping its gradient."""
    if not torch.is_grad_enabled():
        return
    for arg, x in tensors.items():
        if isinstance(x, torch.Tensor) and x.requires_grad:
            raise RuntimeError(f"{NAMESPACE}::{name} is inference-only, but {arg} requires grad; run it under "
                               f"torch.no_grad() or torch.inference_mode()")


def define(name: str, schema: str, *, fake: Callable, cpu: Callable, cuda: Callable, mutates: bool = False):
    """Define ``workbench::name`` with ``schema`` (arguments and return, without the name) and its kernels; returns
    the OpOverload. ``fake`` computes output metadata only (shapes, dtypes, devices) and runs every check that needs
    no values, so bad input fails while ``torch.compile`` traces."""
    LIB.define(f"{name}{schema}")
    op = getattr(getattr(torch.ops, NAMESPACE), name).default
    pad = _padding(op)
    cpu, cuda = pad(cpu), pad(cuda)
    LIB.impl(name, cpu, "CPU")
    LIB.impl(name, cuda, "CUDA")
    torch.library.register_fake(f"{NAMESPACE}::{name}", pad(fake), lib=LIB)
    LIB.impl(name, _autograd_kernel(op, name, cpu, cuda, mutates), "Autograd", with_keyset=True)
    _fast_packet(name, cpu, cuda)
    return op


def _autograd_kernel(op, name: str, cpu: Callable, cuda: Callable, mutates: bool) -> Callable:
    """The kernel at the Autograd key. Plain eager tensors autograd does not track: the implementation, right here.
    Tracked inputs of a functional op: the op below autograd inside a Function whose backward raises. Anything else
    (tracing's fake and functional tensors; mutating ops, whose kernels refuse tracked inputs): below autograd."""
    below = torch._C._after_autograd_keyset
    no_backward = _no_backward(name)

    class NoBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, keyset, *args):
            return op.redispatch(keyset & below, *args)

        @staticmethod
        def backward(ctx, *grads):
            no_backward(ctx, *grads)

    def kernel(keyset, *args):
        device = _eager_device(args)
        if device is not None:
            return (cuda if device == "cuda" else cpu)(*args)
        if not mutates and torch.is_grad_enabled() and _tracked(args):
            return NoBackward.apply(keyset, *args)
        return op.redispatch(keyset & below, *args)

    return kernel


def _tracked(args) -> bool:
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in args)


def _padding(op):
    """Kernels and fakes receive the arguments a caller passed, positionally, without the trailing defaults it left
    out; this wraps a kernel so it always gets the full list (the defaults read from the op's schema)."""
    arguments = op._schema.arguments
    defaults = [a.default_value if a.has_default_value() else None for a in arguments]
    full = len(arguments)

    def wrap(fn):
        @functools.wraps(fn)
        def padded(*args):
            if len(args) < full:
                args = args + tuple(defaults[len(args):])
            return fn(*args)

        return padded

    return wrap


_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_NOT_TENSORS = frozenset((type(None), int, bool, float, str, list, tuple))  # (isinstance(x, Tensor) is slow)


def _eager_device(args) -> str | None:
    """"cuda" or "cpu" (the backend the dispatcher would pick: CUDA if any tensor is on it) when the eager bypass
    may run, else None: a TorchDispatchMode is active (it must see the op), a tensor subclass (fake, functional,
    ...), a tensor on another device (meta, ...), or a tensor that autograd would track. (Reads only the cheap
    attributes: this runs on every eager call.)"""
    if _dispatch_modes():
        return None
    grad = torch.is_grad_enabled()
    device = "cpu"
    for x in args:
        t = type(x)
        if t is _TENSOR or t is _PARAMETER:
            if grad and x.requires_grad:
                return None
            if x.is_cuda:
                device = "cuda"
            elif not x.is_cpu:
                return None
        elif t not in _NOT_TENSORS and isinstance(x, _TENSOR):
            return None
    return device


def _plain(args) -> bool:
    return _eager_device(args) is not None


def bypass(op, impl: Callable) -> Callable:
    """The function to call ``op`` through: the registered op while compiling (Dynamo folds ``is_compiling()``
    and records the op node) or under a TorchFunctionMode, else ``impl`` directly for plain tensors, else the
    dispatcher."""

    @functools.wraps(impl)
    def call(*args):
        if torch.compiler.is_compiling() or _function_modes() or _eager_device(args) is None:
            return op(*args)
        return impl(*args)

    call.op = op
    return call


def _fast_packet(name: str, cpu: Callable, cuda: Callable) -> None:
    """Let ``torch.ops.workbench.<name>(...)`` itself (the OpOverloadPacket vLLM-style callers use) skip the
    dispatcher for plain eager tensors: its call target becomes a function that runs the kernel on the positional
    arguments, and hands everything else (keyword arguments, tracing, modes, fake and tracked tensors) to the
    packet's own target unchanged. ``OpOverload``s (``.default``), which tracing, ``opcheck`` and compiled graphs
    call, are untouched."""
    packet = getattr(getattr(torch.ops, NAMESPACE), name)
    through_dispatcher = packet._op

    def call(*args, **kwargs):
        if kwargs or torch.compiler.is_compiling() or _function_modes():
            return through_dispatcher(*args, **kwargs)
        device = _eager_device(args)
        if device is None:
            return through_dispatcher(*args)
        return (cuda if device == "cuda" else cpu)(*args)

    call.__name__ = call.__qualname__ = name
    packet._op = call  # (set before anything hashes the packet: its hash is its target's)
