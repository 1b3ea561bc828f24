"""The timing every bench script shares: CUDA graphs and plain launches, inputs rotated past L2, interleaved repeats,
the bandwidth and cuBLAS ceilings of the same run, and the results file (schema 1, bench/README.md).

Method
* A *cell* is timed as ``LAUNCHES`` calls that cycle through enough copies of the inputs to exceed ``L2_MULTIPLE``
  times the L2 cache (``copies_for``), so every call reads its weights from HBM.
* ``graph``: the calls are captured once into a CUDA graph (``torch.cuda.graph``) and the graph is replayed between
  two events; µs per call = elapsed / LAUNCHES. No host launch cost is in the figure.
* ``plain``: the same calls issued one by one from Python between two events on an idle stream; the host's launch
  cost is in the figure wherever it exceeds the kernel's time (what an eager caller sees).
* ``isolated``: one call after an L2 flush, with a spin kernel queued ahead of the start event so that the host
  queues the call while the GPU is busy (the events bracket device work only); for calls that allocate (no graph).
* Every method of a cell is timed ``ROUNDS`` times, the methods interleaved and their order rotated from round to
  round (``interleaved``); a row reports the median and the interquartile range.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import pathlib
import subprocess
import statistics
from typing import Callable, Mapping, Sequence

from workbench.render.bench import CEILING_KEYS, SCHEMA_VERSION as SCHEMA, validate_results

L2_MULTIPLE = 3  # inputs rotated past this many times the L2 cache
LAUNCHES = 20  # calls per graph (and per plain-launch timing)
ROUNDS = 5  # interleaved repeats per method and cell (the median is reported)
FLUSH_MULTIPLE = 4  # an L2 flush writes this many times the L2 cache
SPIN_NS = 2_000_000  # ahead of an isolated call's start event: longer than the host takes to queue the call



# ---------------------------------------------------------------------------------------------------------------
# Pure helpers (no GPU): tested on CPU
# ---------------------------------------------------------------------------------------------------------------
def copies_for(nbytes: int, l2_bytes: int, multiple: int = L2_MULTIPLE) -> int:
    """How many copies of ``nbytes`` of inputs a cell cycles through so that one pass exceeds multiple x L2 (at
    least 2: a call never finds the previous call's inputs)."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    return max(2, math.ceil(multiple * l2_bytes / nbytes))


def gbs(nbytes: float, us: float) -> float:
    """GB/s of ``nbytes`` moved in ``us`` microseconds."""
    if us <= 0:
        raise ValueError(f"time must be positive, got {us} us")
    return nbytes / (us * 1e-6) / 1e9


def summary(values: Sequence[float]) -> dict:
    """median, first and third quartile (inclusive method: defined for two samples too) and the sample count."""
    if not values:
        raise ValueError("no samples")
    v = sorted(float(x) for x in values)
    if len(v) == 1:
        return {"us": v[0], "q1": v[0], "q3": v[0], "n": 1}
    q1, _, q3 = statistics.quantiles(v, n=4, method="inclusive")
    return {"us": statistics.median(v), "q1": q1, "q3": q3, "n": len(v)}


def interleaved(timers: Mapping[str, Callable[[], float]], rounds: int = ROUNDS) -> dict[str, dict]:
    """Each timer (a call returning µs) ``rounds`` times, the timers interleaved and their order rotated by one
    every round (so no method always runs right after the same other one); the summary of each."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(timers)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        shift = r % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            samples[name].append(float(timers[name]()))
    return {n: summary(s) for n, s in samples.items()}


def results_document(family: str, meta: Mapping, rows: Sequence[Mapping]) -> dict:
    """The results file's document; ResultsSchemaError (a ValueError) naming the first key that breaks the schema
    (workbench.render.bench.validate_results, the one place its rules live)."""
    doc = {"schema": SCHEMA, "family": family, "meta": dict(meta), "rows": [dict(r) for r in rows]}
    return validate_results(doc, source=f"{family}.json", family=family)


def write_results(out_dir, family: str, meta: Mapping, rows: Sequence[Mapping]) -> pathlib.Path:
    """``out_dir/<family>.json`` in the results schema (checked before anything is written)."""
    doc = results_document(family, meta, rows)
    path = pathlib.Path(out_dir) / f"{family}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def commit_of(root: pathlib.Path) -> str:
    """BENCH_COMMIT if set (the device copy has no .git), else the checkout's short HEAD, else "unknown"."""
    env = os.environ.get("BENCH_COMMIT")
    if env:
        return env
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def nvcc_version() -> str:
    try:
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    lines = [ln for ln in out.splitlines() if "release" in ln]
    return lines[-1].split("release")[-1].strip() if lines else "unknown"


# ---------------------------------------------------------------------------------------------------------------
# The GPU side (torch streams, graphs and events; CuPy for the read-only kernel)
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    sms: int
    l2_bytes: int
    compute_capability: int


def device() -> Device:
    import torch

    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    return Device(p.name, p.multi_processor_count, int(p.L2_cache_size), 10 * p.major + p.minor)


class GraphTimer:
    """``launches`` (zero-argument calls on the current torch stream) captured once as one graph; each call of the
    timer replays it between two events and returns µs per launch."""

    def __init__(self, launches: Sequence[Callable[[], object]]):
        import torch

        self.torch = torch
        self.n = len(launches)
        self.stream = torch.cuda.Stream()
        with torch.cuda.stream(self.stream):
            for f in launches[:2]:  # warm-up outside capture: compilation, plan caches, allocator
                f()
        self.stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.stream):
            for f in launches:
                f()
        self.graph.replay()
        torch.cuda.synchronize()

    def __call__(self) -> float:
        torch = self.torch
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record()
            self.graph.replay()
            stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) * 1e3 / self.n


class PlainTimer:
    """The same launches issued one by one from Python between two events (host launch cost included where it
    exceeds the kernel time); µs per launch."""

    def __init__(self, launches: Sequence[Callable[[], object]]):
        import torch

        self.torch = torch
        self.launches = list(launches)
        self.stream = torch.cuda.Stream()
        with torch.cuda.stream(self.stream):
            for f in self.launches[:2]:
                f()
        self.stream.synchronize()

    def __call__(self) -> float:
        torch = self.torch
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.stream.synchronize()
        with torch.cuda.stream(self.stream):
            start.record()
            for f in self.launches:
                f()
            stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) * 1e3 / len(self.launches)


class IsolatedTimer:
    """One call after an L2 flush (a write of FLUSH_MULTIPLE x L2), a spin kernel queued between the flush and the
    start event so the events bracket the call's device work; µs. For calls that allocate their outputs."""

    def __init__(self, fn: Callable[[], object], l2_bytes: int, spin: bool = True):
        import torch

        self.torch = torch
        self.fn = fn
        self.flush = torch.empty(FLUSH_MULTIPLE * l2_bytes, dtype=torch.uint8, device="cuda")
        # cycles at up to 2.1 GHz: at least SPIN_NS; without the spin the host's time to issue the call shows where
        # it exceeds the device's (an eager caller's view: the "plain" rows)
        self.spin_cycles = int(SPIN_NS * 2.1) if spin else 0
        fn()  # warm-up
        torch.cuda.synchronize()

    def __call__(self) -> float:
        torch = self.torch
        self.flush.zero_()
        if self.spin_cycles:
            torch.cuda._sleep(self.spin_cycles)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) * 1e3


# a read-only stream: every thread loads 16-byte words and folds them; one store per block that cannot be elided
READ_SOURCE = r"""
extern "C" __global__ void read_words(const int4* __restrict__ src, long long n, int* __restrict__ sink) {
  int acc = 0;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    int4 v = __ldcs(src + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x7fffffff) sink[blockIdx.x] = acc;
}
"""


def ceilings(dev: Device, nbytes: int = 1 << 30, rounds: int = 5) -> dict:
    """copy_gbs (device-to-device copy, bytes read + written), read_gbs (the read-only kernel above), cublas_tflops
    (torch.matmul fp16 8192^3), mma_tflops None (not measured here); medians of ``rounds``."""
    import cupy as cp
    import torch

    src = torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda")
    dst = torch.empty_like(src)

    def events(fn, reps=5):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        start.record()
        for _ in range(reps):
            fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) * 1e3 / reps

    kernel = cp.RawKernel(READ_SOURCE, "read_words")
    sink = cp.zeros(dev.sms * 8, dtype=cp.int32)
    words = nbytes // 16

    def read():
        s = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        kernel((dev.sms * 8,), (512,), (src.data_ptr(), cp.int64(words), sink), stream=s)

    a = torch.randn(8192, 8192, dtype=torch.float16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.float16, device="cuda")
    c = torch.empty_like(a)
    copy_us = summary([events(lambda: dst.copy_(src)) for _ in range(rounds)])["us"]
    read_us = summary([events(read) for _ in range(rounds)])["us"]
    mm_us = summary([events(lambda: torch.matmul(a, b, out=c), 3) for _ in range(rounds)])["us"]
    del src, dst, a, b, c
    torch.cuda.empty_cache()
    return {"copy_gbs": round(gbs(2 * nbytes, copy_us), 1), "read_gbs": round(gbs(nbytes, read_us), 1),
            "mma_tflops": None, "cublas_tflops": round(2 * 8192 ** 3 / (mm_us * 1e-6) / 1e12, 1)}


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except ImportError:
        return "absent"


def meta(root: pathlib.Path, dev: Device | None, ceil: Mapping | None, method: Mapping, peers: Mapping) -> dict:
    """The results file's meta; ``dev`` None for a CPU-only run (gpu "none", ceilings null)."""
    ceil = dict(ceil) if ceil else {k: None for k in CEILING_KEYS}
    return {"gpu": dev.name if dev else "none", "sms": dev.sms if dev else 0,
            "date": datetime.date.today().isoformat(), "commit": commit_of(root), "torch": _version("torch"),
            "cupy": _version("cupy"), "nvcc": nvcc_version(), "ceilings": ceil,
            "method": {"launches_per_graph": LAUNCHES, "rounds": ROUNDS, "l2_multiple": L2_MULTIPLE,
                       "l2_bytes": dev.l2_bytes if dev else None, **method},
            "peers": dict(peers)}
