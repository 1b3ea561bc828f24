"""How every ``workbench::`` op is registered: one ``torch.library.Library``, a schema, kernels, a fake, autograd.

Registration is the low-level ``Library.define`` + ``Library.impl`` rather than ``torch.library.custom_op``: the
schema is written out (vLLM's, argument for argument) and a call crosses from Python into the dispatcher and back at
most once. ``custom_op`` and ``register_autograd`` each add a Python kernel at the Autograd key that walks every
argument and dispatches again; here the kernel at the Autograd key *is* the implementation for plain eager tensors,
and redispatches below autograd only for what tracing hands it (fake, functional and meta tensors).

Eager fast paths skip the dispatcher altogether when every tensor is a plain CPU/CUDA tensor that autograd does not
track, nothing is tracing, profiling or transforming (vmap, grad) and no TorchDispatchMode / TorchFunctionMode is
active (a mode or the profiler must see the op):

* ``torch.ops.workbench.<op>(...)``, the OpOverloadPacket a vLLM-style caller uses, and
  ``torch.ops.workbench.<op>.default(...)``, the OpOverload that compiled graphs (Inductor's fallback for a custom
  op), ``opcheck`` and tracing call (``_fast_packet``, ``_fast_overload``): the dispatcher's round trip into a Python
  kernel (boxing the op's arguments into IValues and back, the Python-key and mode checks) costs more than the
  kernel's own Python work, so it is taken only where it decides something;
* the Python functions of ``workbench.torch`` (``bypass``; quack's ``_torch_library_op.py`` does the same for
  ``custom_op``).

bench/bench_torch.py measures the ways in against the CuPy path.

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
    eager = _eager_check(op)
    _fast_overload(op, eager, cpu, cuda)  # (first: it changes the overload's hash, before anything keys on it)
    LIB.impl(name, cpu, "CPU")
    LIB.impl(name, cuda, "CUDA")
    torch.library.register_fake(f"{NAMESPACE}::{name}", pad(fake), lib=LIB)
    LIB.impl(name, _autograd_kernel(op, name, eager, cpu, cuda, mutates), "Autograd", with_keyset=True)
    _fast_packet(name, eager, cpu, cuda)
    op.eager_device = eager
    return op


def _autograd_kernel(op, name: str, eager: Callable, cpu: Callable, cuda: Callable, mutates: bool) -> Callable:
    """The kernel at the Autograd key. Plain eager tensors autograd does not track: the implementation, right here.
    Tracked inputs of a functional op: the op below autograd inside a Function whose backward raises. Anything else
    (tracing's fake and functional tensors; mutating ops, whose kernels refuse tracked inputs): below autograd."""
    below = torch._C._after_autograd_keyset
    no_backward = _no_backward(name)

    class NoBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, keyset, kwargs, *args):
            return op.redispatch(keyset & below, *args, **kwargs)

        @staticmethod
        def backward(ctx, *grads):
            no_backward(ctx, *grads)

    def kernel(keyset, *args, **kwargs):  # (kwargs: the schema's keyword-only arguments a caller set)
        device = eager(args)
        if device is not None:
            return (cuda if device == "cuda" else cpu)(*args, **kwargs)
        if not mutates and torch.is_grad_enabled() and _tracked(args):
            return NoBackward.apply(keyset, kwargs, *args)
        return op.redispatch(keyset & below, *args, **kwargs)

    return kernel


def _tracked(args) -> bool:
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in args)


def _padding(op):
    """Kernels and fakes receive the arguments a caller passed, positionally, without the trailing defaults it left
    out; this wraps a kernel so it always gets the full list (the defaults read from the op's schema). Keyword-only
    arguments stay keywords (the dispatcher passes those a caller set; the kernel's own defaults are the schema's)."""
    arguments = [a for a in op._schema.arguments if not a.kwarg_only]
    defaults = [a.default_value if a.has_default_value() else None for a in arguments]
    full = len(arguments)

    def wrap(fn):
        @functools.wraps(fn)
        def padded(*args, **kwargs):
            if len(args) < full:
                args = args + tuple(defaults[len(args):])
            return fn(*args, **kwargs)

        return padded

    return wrap


_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_transforms = torch._C._are_functorch_transforms_active  # vmap / grad: their wrappers are plain-typed tensors
_profiling = torch.autograd._profiler_enabled  # the profiler records ops in the dispatcher
_OPTIONAL_TENSOR = torch._C.OptionalType.ofTensor()


def _tensor_positions(op) -> tuple[int, ...]:
    """The positions of ``op``'s Tensor and Tensor? arguments (read from its schema)."""
    return tuple(i for i, a in enumerate(op._schema.arguments) if a.type.isSubtypeOf(_OPTIONAL_TENSOR))


def _eager_check(op) -> Callable:
    """``eager(args)``: "cuda" or "cpu" (the backend the dispatcher would pick: CUDA if any tensor is on it) when
    the eager bypass may run on the positional ``args`` of ``op``, else None: something must see the op (a
    dispatch mode, a transform, the profiler), a tensor argument is a subclass (fake, functional, ...) or not a
    tensor, is on another device (meta, ...) or would be tracked by autograd. Only the schema's tensor positions
    are read, and only cheap
    attributes: this runs on every eager call."""
    positions = _tensor_positions(op)

    def eager(args) -> str | None:
        if _dispatch_modes() or _transforms() or _profiling():
            return None
        grad = torch.is_grad_enabled()
        device = "cpu"
        n = len(args)
        for i in positions:
            if i >= n:
                break
            x = args[i]
            if x is None:
                continue
            t = type(x)
            if t is not _TENSOR and t is not _PARAMETER:
                return None
            if grad and x.requires_grad:
                return None
            if x.is_cuda:
                device = "cuda"
            elif not x.is_cpu:
                return None
        return device

    return eager


def bypass(op, impl: Callable) -> Callable:
    """The function to call ``op`` through: the registered op while compiling (Dynamo folds ``is_compiling()``
    and records the op node) or under a TorchFunctionMode, else ``impl`` directly for plain tensors, else the
    dispatcher. Keyword arguments are the schema's keyword-only ones (the Python functions pass nothing else by
    name)."""

    eager = op.eager_device

    @functools.wraps(impl)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling() or _function_modes() or eager(args) is None:
            return op(*args, **kwargs)
        return impl(*args, **kwargs)

    call.op = op
    return call


def _fast(through_dispatcher: Callable, eager: Callable, cpu: Callable, cuda: Callable, name: str) -> Callable:
    """A call target that runs the kernel on plain eager positional arguments and hands everything else (keyword
    arguments, tracing, modes, fake and tracked tensors) to ``through_dispatcher`` unchanged."""

    def call(*args, **kwargs):
        if kwargs or torch.compiler.is_compiling() or _function_modes():
            return through_dispatcher(*args, **kwargs)
        device = eager(args)
        if device is None:
            return through_dispatcher(*args)
        return (cuda if device == "cuda" else cpu)(*args)

    call.__name__ = call.__qualname__ = name
    call.through_dispatcher = through_dispatcher  # (the way every call went before: bench_torch measures both)
    return call


def _fast_packet(name: str, eager: Callable, cpu: Callable, cuda: Callable) -> None:
    """Let ``torch.ops.workbench.<name>(...)`` itself (the OpOverloadPacket vLLM-style callers use) skip the
    dispatcher for plain eager tensors: its call target becomes ``_fast``'s."""
    packet = getattr(getattr(torch.ops, NAMESPACE), name)
    packet._op = _fast(packet._op, eager, cpu, cuda, name)  # (set before anything hashes the packet: its hash is
    # its target's)


def _fast_overload(op, eager: Callable, cpu: Callable, cuda: Callable) -> None:
    """The same for ``torch.ops.workbench.<name>.default``: ``OpOverload.__call__`` calls its ``_op``. An
    OpOverload's hash is its target's, and torch keeps every overload in a set (``torch._ops.cached_ops``), so the
    overload leaves that set under its old hash and re-enters it under the new one."""
    cached = getattr(torch._ops, "cached_ops", None)
    held = cached is not None and op in cached
    if held:
        cached.discard(op)
    op._op = _fast(op._op, eager, cpu, cuda, op.__name__)
    if held:
        cached.add(op)
