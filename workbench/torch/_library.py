"""How every ``workbench::`` op is registered: one ``torch.library.Library``, a schema, kernels, a fake, autograd.

Registration is the low-level ``Library.define`` + ``Library.impl`` rather than ``torch.library.custom_op``: the
schema is written out (vLLM's, argument for argument) and the eager call can skip the dispatcher altogether.
``custom_op``'s Python layer adds a per-call cost several times the kernel's own host time, and the dispatcher has a
per-call cost of its own. ``bypass(op, impl)`` returns the function callers use: under
``torch.compile`` it is the registered op (so the graph keeps one opaque node with its fake), in eager mode it calls
the implementation directly when every tensor is a plain CPU/CUDA tensor that autograd does not track. (quack's
``_torch_library_op.py`` does the same for ``custom_op``.) Measuring what this saves needs the GPU: not done here.

Inference only: functional ops get an autograd formula whose backward raises; mutating ops (``*_out``,
``moe_align_block_size``) cannot carry one, so their kernels refuse inputs that require grad while grad mode is on.
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


def _setup_nothing(ctx, inputs, output) -> None:
    """Nothing to save: the backward only raises."""


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
    LIB.impl(name, pad(cpu), "CPU")
    LIB.impl(name, pad(cuda), "CUDA")
    qualname = f"{NAMESPACE}::{name}"
    torch.library.register_fake(qualname, pad(fake), lib=LIB)
    if not mutates:
        torch.library.register_autograd(qualname, _no_backward(name), setup_context=_setup_nothing, lib=LIB)
    return op


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


def _plain(args) -> bool:
    """True when the eager bypass may run: no tensor subclass (fake, functional, ...), no meta tensor, no tensor
    that autograd would track."""
    grad = torch.is_grad_enabled()
    for x in args:
        if isinstance(x, torch.Tensor):
            if type(x) is not torch.Tensor or x.device.type not in ("cpu", "cuda") or (grad and x.requires_grad):
                return False
    return True


def bypass(op, impl: Callable) -> Callable:
    """The function to call ``op`` through: the registered op while compiling (Dynamo folds ``is_compiling()``
    and records the op node), else ``impl`` directly for plain tensors, else the dispatcher."""

    @functools.wraps(impl)
    def call(*args):
        if torch.compiler.is_compiling() or not _plain(args):
            return op(*args)
        return impl(*args)

    call.op = op
    return call
