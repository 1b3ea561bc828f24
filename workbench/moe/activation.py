"""The activation between an MoE layer's two GEMMs, as data: ``Activation(name, alpha, limit)``.

Both act on the gate_up GEMM's output row ``x = [gate (N columns) | up (N columns)]`` (gate first: a checkpoint
whose gate and up rows interleave, gpt-oss's, is de-interleaved once when its stack is built, workbench.moe.gpt_oss):

* ``"silu"``: ``silu(g) · u`` (Llama, Mixtral, DeepSeek, Qwen MoE);
* ``"swigluoai"``: gpt-oss's clamped SwiGLU (vLLM's ``swigluoai_and_mul``, transformers' GptOssExperts):
  ``g' = min(g, limit)``, ``u' = clip(u, -limit, limit)``, ``(u' + 1) · g' · sigmoid(alpha · g')``, with ``alpha``
  (1.702) and ``limit`` (config.json ``swiglu_limit``, 7.0) as data.

The kernels compute in fp32 and round once to the activation type (kernels_cuda/marlin_moe.cu); ``reference`` is the
same formula in float64 (no rounding) for the NumPy spec (workbench.moe.reference).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

NAMES = ("silu", "swigluoai")
ALIASES = {"silu": "silu", "swiglu": "silu", "swigluoai": "swigluoai", "swiglu_oai": "swigluoai"}
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0
# |d/dg (g · sigmoid(alpha g))| <= 1.0998 for every g and alpha > 0 (the maximum of s + x s (1 - s), x = alpha g,
# s = sigmoid(x), at x ~ 2.4); min(g, limit) and clip(u) are 1-Lipschitz: moe_error_bound's propagation constant.
SWIGLU_GATE_LIPSCHITZ = 1.1


@dataclasses.dataclass(frozen=True)
class Activation:
    name: str = "silu"
    alpha: float = GPT_OSS_ALPHA  # swigluoai only
    limit: float = GPT_OSS_LIMIT  # swigluoai only

    def __post_init__(self):
        if self.name not in NAMES:
            raise ValueError(f"activation {self.name!r} is not one of {NAMES}")
        for field in ("alpha", "limit"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) or \
                    not math.isfinite(float(v)) or float(v) <= 0:
                raise ValueError(f"activation {field} = {v!r} must be a finite number > 0")
            if float(v) > float(np.finfo(np.float32).max):
                raise ValueError(f"activation {field} = {v!r} does not fit float32 (the kernel's parameter)")

    @property
    def kernel_args(self) -> tuple[int, int]:
        """(alpha, limit) as the int32 bit patterns of their float32 values (the kernel's parameters)."""
        return tuple(int(np.array([v], np.float32).view(np.int32)[0]) for v in (self.alpha, self.limit))

    def reference(self, g) -> np.ndarray:
        """[..., 2N] gate|up pre-activations -> [..., N], float64 (no rounding)."""
        g = np.asarray(g, dtype=np.float64)
        if g.shape[-1] % 2:
            raise ValueError(f"gate_up has {g.shape[-1]} columns; gate and up halves need an even count")
        n = g.shape[-1] // 2
        gate, up = g[..., :n], g[..., n:]
        if self.name == "silu":
            return gate / (1.0 + np.exp(-gate)) * up
        gate = np.minimum(gate, self.limit)
        up = np.clip(up, -self.limit, self.limit)
        return (up + 1.0) * gate / (1.0 + np.exp(-self.alpha * gate))


SILU = Activation("silu")
GPT_OSS = Activation("swigluoai", GPT_OSS_ALPHA, GPT_OSS_LIMIT)


def activation_of(spec) -> Activation:
    """An Activation from None ("silu"), a name ("silu", "swigluoai" / "swiglu_oai"), a dict as workbench's
    checkpoint manifests record it (``{"name": "swiglu_oai", "alpha": 1.702, "limit": 7.0}``) or an Activation."""
    if spec is None:
        return SILU
    if isinstance(spec, Activation):
        return spec
    if isinstance(spec, str):
        if spec not in ALIASES:
            raise ValueError(f"activation {spec!r} is not one of {sorted(ALIASES)}")
        return Activation(ALIASES[spec])
    if isinstance(spec, dict):
        unknown = set(spec) - {"name", "alpha", "limit"}
        if unknown or "name" not in spec:
            raise ValueError(f"activation {spec!r}: expected keys name, alpha, limit (unknown: {sorted(unknown)})")
        name = spec["name"]
        if name not in ALIASES:
            raise ValueError(f"activation {name!r} is not one of {sorted(ALIASES)}")
        return Activation(ALIASES[name], spec.get("alpha", GPT_OSS_ALPHA), spec.get("limit", GPT_OSS_LIMIT))
    raise TypeError(f"activation must be a name, a dict or an Activation, got {type(spec).__name__}")
