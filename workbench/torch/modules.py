"""Drop-in modules over the ``torch.ops.workbench`` GEMMs: ``MarlinLinear``, ``MarlinMoE`` and ``replace_linears``.

A module holds a ``MarlinWeight``'s arrays as buffers (``qweight``, ``scales``, ``zeros``, ``g_idx``, ``perm``; an
MoE layer one such set per expert stack, with a leading expert axis), so ``state_dict`` saves them, ``load_state_dict``
restores them bit for bit, and ``.to(device)`` moves them. The layout parameters (weight type, group size, K, N) are
the module's extra state: loading a state dict of another layout fails and says which parameter differs.

Shapes follow the GEMM's (docs/formats.md, "Shapes that are not tile multiples"): any N, K a multiple of the pack
factor, a group size that divides K or leaves a partial last group. The buffers are the Marlin arrays of the weight
zero-padded to whole 16 x 64 tiles (``MarlinWeight.require_padded_arrays``'s shapes); the true K and N are the
extra state's ``size_k`` / ``size_n``, passed to every GEMM, and the output has exactly N columns.

Where the weights come from: a layer that ``workbench.load`` returns (``from_weight``, ``MarlinMoE.from_weights``, or
``replace_linears(..., weights=...)``), or an ``nn.Linear`` / dense expert weights quantized on the fly by the
reference RTN quantizer (``workbench.quantize``).

Forward runs the CUDA kernels only: on a CPU input it raises (there is no slow fallback that would pass for the
kernel). A bias goes to the GEMM's epilogue as ``b_bias``: added to the fp32 sums before the one rounding.
"""
from __future__ import annotations

import dataclasses
import fnmatch
from typing import Iterable

import numpy as np
import torch
from torch import nn

from workbench.formats.marlin_tile import marlin_qweight_shape
from workbench.formats.scales import num_groups, padded_n
from workbench.scalar_types import ScalarType
from workbench.torch import ops
from workbench.torch._tensors import ArraySpec, from_numpy, numpy_dtype, to_numpy, torch_dtype
from workbench.torch.ops import REPRESENTATIVE_ROWS
from workbench.torch.scalar_ids import vllm_id
from workbench.weight import MarlinWeight

# Lock counters for up to this many SMs (2 per SM, gemm.workspace_numel): every current GPU has fewer, and the GEMM
# checks the count against the device's.
WORKSPACE_SMS = 512


def _needs_cuda(module: str, x: torch.Tensor) -> None:
    if x.device.type != "cuda" and x.device.type != "meta":
        raise RuntimeError(f"{module}.forward needs a CUDA device: the Marlin kernels run on CUDA only and there is no "
                           f"CPU fallback (the input is on {x.device}); move the module and its input with "
                           f".to('cuda')")


def _workspace() -> torch.Tensor:
    from workbench import gemm

    return torch.zeros(gemm.workspace_numel(WORKSPACE_SMS), dtype=torch.int32)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What the buffers' shapes follow from; saved as the module's extra state."""

    size_k: int
    size_n: int
    weight_type: ScalarType
    group_size: int
    act_dtype: torch.dtype
    act_order: bool
    is_k_full: bool
    num_experts: int | None = None

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype] | None]:
        """buffer name -> (shape, dtype), None for a buffer this layout has no use for: the padded Marlin arrays of
        the true sizes (as ``MarlinWeight.require_padded_arrays`` checks them)."""
        return _buffer_shapes(self.size_k, self.size_n, self.weight_type, self.group_size, self.act_dtype,
                              self.act_order, self.num_experts)

    def state(self) -> dict:
        return {"size_k": self.size_k, "size_n": self.size_n, "weight_type": self.weight_type.label,
                "group_size": self.group_size, "act_dtype": str(self.act_dtype).removeprefix("torch."),
                "act_order": self.act_order, "is_k_full": self.is_k_full, "num_experts": self.num_experts}

    @classmethod
    def of(cls, w: MarlinWeight) -> "_Layout":
        return cls(w.size_k, w.size_n, w.weight_type, w.group_size, torch_dtype(w.act_dtype), w.has_act_order,
                   w.is_k_full, w.num_experts)


def _buffer_shapes(size_k: int, size_n: int, wt: ScalarType, group_size: int, act_dtype: torch.dtype = torch.float16,
                   act_order: bool = False, experts: int | None = None):
    lead = () if experts is None else (experts,)
    ng, n_pad = num_groups(size_k, group_size), padded_n(size_n)
    return {"qweight": (lead + marlin_qweight_shape(size_k, size_n, wt.bits), torch.int32),
            "scales": (lead + (ng, n_pad), act_dtype),
            "zeros": (lead + (ng, n_pad // wt.pack_factor), torch.int32) if wt.has_zero_points else None,
            "g_idx": (lead + (size_k,), torch.int32) if act_order else None,
            "perm": (lead + (size_k,), torch.int32) if act_order else None}


def _check_layout(layout: _Layout) -> None:
    from workbench import gemm

    if layout.weight_type not in gemm.GEMM_WEIGHT_TYPES:
        raise ValueError(f"weight_type = {layout.weight_type} is not a Marlin weight type")
    if layout.act_dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"act_dtype = {layout.act_dtype}: the Marlin GEMM takes float16 or bfloat16 activations")
    reason = unsupported_shape(layout.size_k, layout.size_n, layout.weight_type, layout.group_size)
    if reason:
        raise ValueError(reason)


def unsupported_shape(size_k: int, size_n: int, weight_type, group_size: int) -> str | None:
    """Why a K x N weight cannot be a Marlin layer of this type and group size, or None when it can: the format's
    group rule (``check_group_size``: -1 or positive; a partial last group is fine), then the dense GEMM's own shape
    rules (``gemm.check_gemm_shapes``: K a multiple of the pack factor, a group size it takes, ...) run on the padded
    buffers such a layer would have."""
    from workbench import gemm
    from workbench.formats.scales import check_group_size

    wt = ScalarType.parse(weight_type)
    try:
        check_group_size(size_k, group_size)
        shapes = _buffer_shapes(size_k, size_n, wt, group_size)
        f16, i32 = np.dtype(np.float16), np.dtype(np.int32)
        spec = (lambda name, dtype: None if shapes[name] is None else ArraySpec.contiguous(shapes[name][0], dtype))
        lda = _row_stride(size_k)  # (the rows forward hands the GEMM)
        a = ArraySpec((REPRESENTATIVE_ROWS, size_k), f16, (lda * f16.itemsize, f16.itemsize), lda == size_k)
        gemm.check_gemm_shapes(a, spec("qweight", i32),
                               spec("scales", f16), spec("zeros", i32), None, None, wt, REPRESENTATIVE_ROWS, size_n,
                               size_k, True)
    except ValueError as exc:
        return f"K x N = {size_k} x {size_n}: {exc}"
    return None


def _row_stride(size_k: int) -> int:
    """The row stride of the activations MarlinLinear passes: K, or K rounded up to whole 16-byte chunks where K
    ends inside one (an 8-bit K that is a multiple of 4 but not of 8); the GEMM reads rows in such chunks and never
    past K (docs/formats.md, "Shapes that are not tile multiples")."""
    from workbench.gemm.checks import A_CHUNK

    return -(-size_k // A_CHUNK) * A_CHUNK


class _MarlinBuffers(nn.Module):
    """Registers one weight's buffers under ``prefix`` and keeps their layouts as extra state."""

    def __init__(self):
        super().__init__()
        self._layouts: dict[str, _Layout] = {}
        self.register_buffer("workspace", _workspace(), persistent=False)  # zeroed lock counters, left zero

    def _add(self, prefix: str, layout: _Layout, weight: MarlinWeight | None = None) -> None:
        _check_layout(layout)
        self._layouts[prefix] = layout
        for name, meta in layout.shapes().items():
            value = None
            if meta is not None:
                shape, dtype = meta
                value = torch.zeros(shape, dtype=dtype)
                if weight is not None:
                    value = _tensor_of(getattr(weight, name), f"{prefix}{name}", shape, dtype)
            self.register_buffer(f"{prefix}{name}", value)

    def _tensors(self, prefix: str) -> dict[str, torch.Tensor | None]:
        return {name: getattr(self, f"{prefix}{name}") for name in ("qweight", "scales", "zeros", "g_idx", "perm")}

    def marlin_weight(self, prefix: str = "") -> MarlinWeight:
        """The buffers as a host ``MarlinWeight`` (NumPy copies), e.g. to check them against the reference."""
        layout = self._layouts[prefix]
        t = {k: None if v is None else to_numpy(v.detach().cpu()).copy() for k, v in self._tensors(prefix).items()}
        return MarlinWeight(t["qweight"], t["scales"], t["zeros"], t["g_idx"], t["perm"], layout.size_k,
                            layout.size_n, layout.group_size, layout.weight_type, numpy_dtype(layout.act_dtype, "a"),
                            layout.is_k_full, layout.num_experts)

    def get_extra_state(self) -> dict:
        return {prefix: layout.state() for prefix, layout in self._layouts.items()}

    def set_extra_state(self, state: dict) -> None:
        mine = self.get_extra_state()
        if set(state) != set(mine):
            raise ValueError(f"the state dict holds weights {sorted(state)}, this module {sorted(mine)}")
        for prefix, fields in state.items():
            for key, value in fields.items():
                if mine[prefix].get(key) != value:
                    raise ValueError(f"the state dict's {prefix or 'weight'} has {key} = {value!r}, this module "
                                     f"{mine[prefix].get(key)!r}; build the module with the same layout to load it")


def _tensor_of(x, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A MarlinWeight array (NumPy or tensor) as a tensor the module owns, checked against its layout."""
    if isinstance(x, torch.Tensor):
        t = x.detach().to("cpu").clone()
    else:
        a = np.array(x, copy=True)
        t = from_numpy(a.view(np.int32) if a.dtype == np.uint32 else a)  # uint32 words: the same bits
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{name} has shape {tuple(t.shape)} and dtype {t.dtype}, expected {tuple(shape)} {dtype}")
    return t


class MarlinLinear(_MarlinBuffers):
    """``y = x @ dequant(W) + bias`` through ``torch.ops.workbench.marlin_gemm``; W is K x N (in x out features).

    Build one with ``from_weight`` (a ``MarlinWeight``, e.g. from ``workbench.load``), ``from_linear`` (quantize an
    ``nn.Linear``), or the constructor (zero buffers of the right shapes, to ``load_state_dict`` into).

    ``deterministic`` / ``batch_invariant``: the GEMM's modes (``workbench.gemm.gptq_marlin_gemm``; docs/performance.md,
    "Batch invariance"): with ``batch_invariant`` a row's output bits do not depend on how many rows share the call.
    They choose how the layer runs, not what it stores, so they are not in the state dict."""

    def __init__(self, in_features: int, out_features: int, weight_type="u4b8", group_size: int = 128, *,
                 bias: bool = False, act_dtype: torch.dtype = torch.float16, act_order: bool = False,
                 is_k_full: bool = True, deterministic: bool = False, batch_invariant: bool = False,
                 _weight: MarlinWeight | None = None):
        super().__init__()
        layout = _Layout(int(in_features), int(out_features), ScalarType.parse(weight_type), int(group_size),
                         act_dtype, bool(act_order), bool(is_k_full))
        self._add("", layout, _weight)
        self.in_features, self.out_features = layout.size_k, layout.size_n
        self.register_buffer("bias", torch.zeros(layout.size_n, dtype=act_dtype) if bias else None)
        self._type_id = vllm_id(layout.weight_type)
        self._is_k_full = layout.is_k_full
        self.deterministic, self.batch_invariant = bool(deterministic), bool(batch_invariant)
        self._lda = _row_stride(layout.size_k)

    @property
    def _modes(self) -> dict:
        """The GEMM's keyword-only modes this layer sets (only those on: the op's defaults are off)."""
        return {name: True for name in ("deterministic", "batch_invariant") if getattr(self, name)}

    @classmethod
    def from_weight(cls, weight: MarlinWeight, bias=None, *, deterministic: bool = False,
                    batch_invariant: bool = False) -> "MarlinLinear":
        """A layer over a single-layer MarlinWeight (copied; NumPy or torch arrays) in the padded layout of its true
        sizes (docs/formats.md, "Shapes that are not tile multiples"); ``bias`` [N] optional."""
        if not isinstance(weight, MarlinWeight):
            raise TypeError(f"weight must be a MarlinWeight, got {type(weight).__name__}")
        if weight.num_experts is not None:
            raise ValueError(f"weight is a stack of {weight.num_experts} experts; use MarlinMoE.from_weights or "
                             f"weight.expert(e)")
        layout = _Layout.of(weight)
        module = cls(layout.size_k, layout.size_n, layout.weight_type, layout.group_size, bias=bias is not None,
                     act_dtype=layout.act_dtype, act_order=layout.act_order, is_k_full=layout.is_k_full,
                     deterministic=deterministic, batch_invariant=batch_invariant, _weight=weight)
        if bias is not None:
            b = bias.detach().to("cpu") if isinstance(bias, torch.Tensor) else from_numpy(np.asarray(bias))
            if tuple(b.shape) != (layout.size_n,):
                raise ValueError(f"bias has shape {tuple(b.shape)}, expected ({layout.size_n},)")
            module.bias = b.to(layout.act_dtype).clone()
        return module

    @classmethod
    def from_linear(cls, linear: nn.Linear, weight_type="u4b8", group_size: int = 128, *, act_order: bool = False,
                    act_dtype: torch.dtype | None = None, seed: int = 0, deterministic: bool = False,
                    batch_invariant: bool = False) -> "MarlinLinear":
        """Quantize ``linear`` with the reference RTN quantizer (``workbench.quantize.quantize_weights``) and repack;
        the result sits on ``linear``'s device. ``act_dtype`` defaults to the weight's dtype when it is fp16/bf16."""
        from workbench.quantize import quantize_weights
        from workbench.weight import make_marlin_weight

        reason = quantizable(linear, weight_type, group_size)
        if reason:
            raise ValueError(reason)
        if act_dtype is None:
            act_dtype = linear.weight.dtype if linear.weight.dtype in (torch.float16, torch.bfloat16) else torch.float16
        w = linear.weight.detach().to(device="cpu", dtype=torch.float32).numpy().T  # (K, N) = (in, out)
        q = quantize_weights(w, weight_type, group_size, act_order=act_order, act_dtype=numpy_dtype(act_dtype, "a"),
                             seed=seed)
        module = cls.from_weight(make_marlin_weight(q),
                                 None if linear.bias is None else linear.bias.detach().to("cpu", act_dtype),
                                 deterministic=deterministic, batch_invariant=batch_invariant)
        return module.to(linear.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:  # (the attribute, not x.device: this runs on every call)
            _needs_cuda(type(self).__name__, x)
        k, n = self.in_features, self.out_features
        if x.shape[-1] != k:
            raise ValueError(f"{type(self).__name__}: x has {x.shape[-1]} features (shape {tuple(x.shape)}), the "
                             f"layer takes in_features = {k}")
        rows = x if x.dim() == 2 else x.reshape(-1, k)
        if self._lda != k:  # K ends inside a 16-byte chunk: the rows as a view of padded rows (read up to K only)
            padded = rows.new_empty((rows.shape[0], self._lda))
            padded[:, :k].copy_(rows)
            rows = padded[:, :k]
        elif rows.stride(-1) != 1:
            rows = rows.contiguous()
        b = self._buffers  # (the dict itself: nn.Module.__getattr__ is slow on the per-call path)
        y = ops.marlin_gemm_functional(rows, None, b["qweight"], b["bias"], b["scales"], None, None, b["zeros"],
                                       b["g_idx"], b["perm"], b["workspace"], self._type_id, rows.shape[0], n, k,
                                       self._is_k_full, False, True, False, **self._modes)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)

    def extra_repr(self) -> str:
        layout = self._layouts[""]
        return (f"in_features={self.in_features}, out_features={self.out_features}, weight_type={layout.weight_type}, "
                f"group_size={layout.group_size}, act_order={layout.act_order}, bias={self.bias is not None}"
                + "".join(f", {name}=True" for name in self._modes))


def quantizable(linear: nn.Module, weight_type="u4b8", group_size: int = 128) -> str | None:
    """Why ``linear`` cannot become a MarlinLinear of this type and group size, or None when it can."""
    if not isinstance(linear, nn.Linear):
        return f"it is a {type(linear).__name__}, not an nn.Linear"
    if linear.weight.device.type == "meta":
        return "its weight is on the meta device (not materialized)"
    if not linear.weight.is_floating_point():
        return f"its weight has dtype {linear.weight.dtype}, not a floating-point dtype"
    from workbench.quantize import SUPPORTED_GROUP_SIZES

    why = unsupported_shape(linear.in_features, linear.out_features, weight_type, group_size)
    if why is None and group_size not in SUPPORTED_GROUP_SIZES and group_size != linear.in_features:
        # (the GEMM takes one partial group of any size as channelwise; the reference quantizer does not)
        why = (f"K x N = {linear.in_features} x {linear.out_features}: group_size = {group_size} is not one of the "
               f"reference quantizer's {SUPPORTED_GROUP_SIZES}")
    return why


@dataclasses.dataclass
class ReplaceReport:
    """What ``replace_linears`` did: replaced layer names, skipped ones with the reason, patterns that matched no
    nn.Linear."""

    replaced: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    unmatched_patterns: list[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"replaced {len(self.replaced)} nn.Linear layers with MarlinLinear"]
        lines += [f"skipped {name}: {why}" for name, why in self.skipped.items()]
        lines += [f"pattern {p!r} matched no nn.Linear" for p in self.unmatched_patterns]
        return "\n".join(lines)


def replace_linears(model: nn.Module, patterns: str | Iterable[str] = "*", weight_type="u4b8", group_size: int = 128,
                    *, act_order: bool = False, act_dtype: torch.dtype | None = None, weights: dict | None = None,
                    exclude: str | Iterable[str] = (), seed: int = 0, deterministic: bool = False,
                    batch_invariant: bool = False) -> ReplaceReport:
    """Swap, in place, every ``nn.Linear`` of ``model`` whose qualified name matches one of ``patterns`` (shell-style,
    ``fnmatch``: ``"*.q_proj"``, ``"encoder.layer.*.output.dense"``) and none of ``exclude`` for a ``MarlinLinear``.

    A layer named in ``weights`` (``{name: MarlinWeight}``, as ``workbench.load`` returns) takes that weight (its
    K, N must equal in/out features); any other is quantized on the fly (``MarlinLinear.from_linear``). Every new
    layer takes ``deterministic`` / ``batch_invariant`` (MarlinLinear's modes). Any N and any K the weight type's
    pack factor divides are taken (the buffers are padded to whole tiles), and so is a group size that leaves a
    partial last group; layers the GEMM refuses (K not a multiple of the pack factor, a group size it has no kernel
    for, ...) are left as they are and listed with the GEMM's reason in the returned report."""
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    exclude = [exclude] if isinstance(exclude, str) else list(exclude)
    weights = weights or {}
    modes = {"deterministic": deterministic, "batch_invariant": batch_invariant}
    report = ReplaceReport()
    hits = {p: 0 for p in patterns}
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or isinstance(module, MarlinLinear):
            continue
        matched = [p for p in patterns if fnmatch.fnmatchcase(name, p)]
        for p in matched:
            hits[p] += 1
        if not matched or any(fnmatch.fnmatchcase(name, p) for p in exclude):
            continue
        if name in weights:
            w = weights[name]
            if (w.size_k, w.size_n) != (module.in_features, module.out_features):
                report.skipped[name] = (f"the given weight is K x N = {w.size_k} x {w.size_n}, the layer "
                                        f"{module.in_features} x {module.out_features}")
                continue
            new = MarlinLinear.from_weight(w, module.bias, **modes).to(module.weight.device)
        else:
            reason = quantizable(module, weight_type, group_size)
            if reason:
                report.skipped[name] = reason
                continue
            new = MarlinLinear.from_linear(module, weight_type, group_size, act_order=act_order,
                                           act_dtype=act_dtype, seed=seed, **modes)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        report.replaced.append(name)
    report.unmatched_patterns = [p for p, n in hits.items() if n == 0]
    return report


class MarlinMoE(_MarlinBuffers):
    """An MoE layer: ``out[t] = Σ_j w[t, j] · down_e(silu(gate_e(x_t)) · up_e(x_t))``, e = the token's j-th expert,
    through ``moe_align_block_size`` and two ``moe_wna16_marlin_gemm`` launches.

    Stacks: ``w13`` (gate and up of every expert, K = hidden, N = 2 · intermediate, gate columns first) and ``w2``
    (down, K = intermediate, N = hidden). Routing: softmax over the router logits (from ``router``, an ``nn.Linear``
    hidden -> experts, when the module has one, else passed to forward), top ``top_k``, renormalized when
    ``renormalize``. ``batch_invariant``: both GEMMs in the fused kernel's batch-invariant mode (one tile for every
    MoE block size, so a token's bits do not depend on how many tokens were routed with it); not in the state dict."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int, weight_type="u4b8",
                 group_size: int = 128, *, act_dtype: torch.dtype = torch.float16, renormalize: bool = True,
                 router: nn.Linear | None = None, batch_invariant: bool = False, _w13: MarlinWeight | None = None,
                 _w2: MarlinWeight | None = None):
        super().__init__()
        wt = ScalarType.parse(weight_type)
        e, h, i = int(num_experts), int(hidden_size), int(intermediate_size)
        if not 1 <= int(top_k) <= e:
            raise ValueError(f"top_k = {top_k} must be in [1, num_experts = {e}]")
        self._add("w13_", _Layout(h, 2 * i, wt, group_size, act_dtype, False, True, e), _w13)
        self._add("w2_", _Layout(i, h, wt, group_size, act_dtype, False, True, e), _w2)
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, i
        self.top_k, self.renormalize = int(top_k), bool(renormalize)
        self.router = router
        self._type_id = vllm_id(wt)
        self.batch_invariant = bool(batch_invariant)

    @classmethod
    def from_weights(cls, w13: MarlinWeight, w2: MarlinWeight, top_k: int, *, renormalize: bool = True,
                     router: nn.Linear | None = None, batch_invariant: bool = False) -> "MarlinMoE":
        """A layer over two expert stacks (``MarlinWeight`` with ``num_experts``; e.g. from ``workbench.load`` or
        ``workbench.ops.stack_gptq_experts_to_marlin``); copied."""
        for name, w in (("w13", w13), ("w2", w2)):
            if not isinstance(w, MarlinWeight) or w.num_experts is None:
                raise ValueError(f"{name} must be a stacked MarlinWeight (num_experts set)")
            if w.has_act_order:
                raise ValueError(f"{name} has act-order (g_idx / perm): the fused MoE kernel does not support it")
        if (w13.num_experts, w13.size_k, w13.size_n) != (w2.num_experts, w2.size_n, 2 * w2.size_k) or \
                (w13.weight_type, w13.group_size) != (w2.weight_type, w2.group_size):
            raise ValueError(f"w13 (E, K, N, type, group) = {(w13.num_experts, w13.size_k, w13.size_n)}, "
                             f"{w13.weight_type}, {w13.group_size} and w2 = {(w2.num_experts, w2.size_k, w2.size_n)},"
                             f" {w2.weight_type}, {w2.group_size} do not form one layer (w13 N = 2 x w2 K, w2 N = "
                             f"w13 K, one type and group size)")
        return cls(w13.num_experts, w13.size_k, w2.size_k, top_k, w13.weight_type, w13.group_size,
                   act_dtype=torch_dtype(w13.act_dtype), renormalize=renormalize, router=router,
                   batch_invariant=batch_invariant, _w13=w13, _w2=w2)

    @classmethod
    def quantize(cls, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, top_k: int, weight_type="u4b8",
                 group_size: int = 128, *, act_dtype: torch.dtype = torch.float16, renormalize: bool = True,
                 router: nn.Linear | None = None, seed: int = 0, batch_invariant: bool = False) -> "MarlinMoE":
        """Quantize dense experts with the reference RTN quantizer: ``gate``, ``up`` [E, I, H] and ``down`` [E, H, I]
        in nn.Linear's (out, in) orientation (as Mixtral-style checkpoints store them)."""
        from workbench.moe import stack_marlin_weights
        from workbench.quantize import quantize_weights
        from workbench.weight import make_marlin_weight

        if gate.dim() != 3 or gate.shape != up.shape or down.shape != (gate.shape[0], gate.shape[2], gate.shape[1]):
            raise ValueError(f"gate {tuple(gate.shape)}, up {tuple(up.shape)} must be [E, I, H] and down "
                             f"{tuple(down.shape)} [E, H, I]")
        act = numpy_dtype(act_dtype, "act_dtype")
        host = (lambda t: t.detach().to("cpu", torch.float32).numpy())
        w13, w2 = [], []
        for e in range(gate.shape[0]):
            both = np.concatenate([host(gate[e]).T, host(up[e]).T], axis=1)  # (H, 2I): gate columns first
            w13.append(make_marlin_weight(quantize_weights(both, weight_type, group_size, act_dtype=act,
                                                           seed=seed + e)))
            w2.append(make_marlin_weight(quantize_weights(host(down[e]).T, weight_type, group_size, act_dtype=act,
                                                          seed=seed + e)))
        return cls.from_weights(stack_marlin_weights(w13), stack_marlin_weights(w2), top_k, renormalize=renormalize,
                                router=router, batch_invariant=batch_invariant)

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights float32 [M, top_k], topk_ids int32 [M, top_k]) from router logits [M, E]."""
        probs = torch.softmax(router_logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.contiguous(), ids.to(torch.int32).contiguous()

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor | None = None) -> torch.Tensor:
        from workbench.moe import choose_block_size

        _needs_cuda(type(self).__name__, hidden_states)
        if router_logits is None:
            if self.router is None:
                raise ValueError("MarlinMoE has no router: pass router_logits [M, num_experts]")
            router_logits = self.router(hidden_states)
        x = hidden_states.reshape(-1, self.hidden_size).contiguous()
        m, e, h, i, k = x.shape[0], self.num_experts, self.hidden_size, self.intermediate_size, self.top_k
        topk_weights, topk_ids = self.route(router_logits.reshape(m, e))
        block = choose_block_size(m, k, e)
        sorted_ids, expert_ids, post = ops.allocate_align_buffers(topk_ids, e, block)
        ops.moe_align_block_size(topk_ids, e, block, sorted_ids, expert_ids, post)
        w13, w2 = self._tensors("w13_"), self._tensors("w2_")
        bi = self.batch_invariant
        g1 = ops.moe_wna16_marlin_gemm(x, None, w13["qweight"], None, w13["scales"], None, None, w13["zeros"], None,
                                       None, self.workspace, sorted_ids, expert_ids, post, topk_weights, block, k,
                                       False, self._type_id, m, 2 * i, h, True, False, True, False,
                                       batch_invariant=bi)
        # SiLU(gate) * up in fp32, rounded once (as workbench.moe.silu_and_mul and the MoE reference round)
        act = (torch.nn.functional.silu(g1[:, :i].float()) * g1[:, i:].float()).to(x.dtype)
        y = ops.moe_wna16_marlin_gemm(act.contiguous(), None, w2["qweight"], None, w2["scales"], None, None,
                                      w2["zeros"], None, None, self.workspace, sorted_ids, expert_ids, post,
                                      topk_weights, block, 1, True, self._type_id, m * k, h, i, True, False, True,
                                      False, batch_invariant=bi)
        return y.view(m, k, h).sum(dim=1).reshape(hidden_states.shape)

    def extra_repr(self) -> str:
        layout = self._layouts["w13_"]
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, top_k={self.top_k}, weight_type={layout.weight_type}, "
                f"group_size={layout.group_size}" + (", batch_invariant=True" if self.batch_invariant else ""))
