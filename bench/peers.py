"""Peer kernels timed beside ours in the same run: vLLM's Marlin (as vendored in ModelCloud/GPTQModel,
``gptqmodel_ext/marlin/``) and humming (mgoin/humming, a JIT library). Their sources are never part of this
repository: ``export`` copies them from public snapshots into an ignored folder, and the GPU machine builds them at
bench time, caching under /tmp (lost with the machine).

    python bench/peers.py export --dest _dev/peers_src [--mirror /work/.mirror]   (on a machine with the snapshots)
    python bench/peers.py build-vllm --src _dev/peers_src --wtypes u4b8,fe4m3fn    (on the GPU machine)

Layout of the source folder: ``vllm_marlin/`` (the marlin folder), ``humming/`` (the package), ``PEERS.json``
({peer: "owner/repo@commit"}).

vLLM's Marlin is built as a PyTorch extension (``torch.utils.cpp_extension.load``) from: one file per kernel
instantiation (one nvcc process each, MAX_JOBS in parallel), its dispatcher cut to the instantiations built (the
weight types asked for, fp16 activations, the group sizes the bench times, every tile and M-block count its
heuristic can choose, so its choice is the one a full build makes), the repack ops, and bindings of our own
(namespace ``peer_vllm_marlin``).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time

SOURCES = {  # peer: (owner/repo, the paths exported, where they land in the source folder)
    "vllm_marlin": ("ModelCloud/GPTQModel", "gptqmodel_ext/marlin", "vllm_marlin"),
    "humming": ("mgoin/humming", "humming", "humming"),
}
CACHE = pathlib.Path(os.environ.get("PEERS_CACHE", "/tmp/peers"))

# our weight-type names -> (vLLM ScalarType constant, group_blocks of the bench's group size)
VLLM_TYPES = {
    "u4b8": ("vllm::kU4B8", 8),  # group 128 = 8 blocks of 16 rows
    "u4": ("vllm::kU4", 8),
    "u8b128": ("vllm::kU8B128", 8),
    "fe4m3fn": ("vllm::kFE4M3fn", -1),  # channelwise
    "nvfp4": ("vllm::kFE2M1f", 1),  # group 16 = 1 block: E4M3 (S0E5M3) scale bytes and the fp32 global scale
}
# the scale type of a kernel where it is not the activations' (the dispatcher's own rule, gptq_marlin.cu _GET_IF)
VLLM_SCALE_TYPES = {("vllm::kFE2M1f", 1): "vllm::kFE4M3fn"}
# the dispatcher's tiles: (thread_n_blocks, thread_k_blocks, threads); one m16 block (8-row form too) or 2..4
M1_TILES = ((8, 8, 256), (8, 4, 128), (4, 8, 128))
M234_TILES = ((16, 4, 256), (8, 4, 128), (4, 8, 128))


# ---------------------------------------------------------------------------------------------------------------
# export (host side)
# ---------------------------------------------------------------------------------------------------------------
def export(dest: pathlib.Path, mirror: pathlib.Path) -> dict:
    dest.mkdir(parents=True, exist_ok=True)
    peers = {}
    for peer, (repo, path, target) in SOURCES.items():
        git_dir = mirror / repo.replace("/", "+") / "repo"
        commit = subprocess.run(["git", "--git-dir", str(git_dir), "rev-parse", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        out = dest / target
        if out.exists():
            subprocess.run(["rm", "-rf", str(out)], check=True)
        tmp = dest / f".{target}.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "--git-dir", str(git_dir), "archive", "HEAD", path], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        os.replace(tmp / path, out)
        subprocess.run(["rm", "-rf", str(tmp)], check=True)
        peers[peer] = f"{repo}@{commit}"
    (dest / "PEERS.json").write_text(json.dumps(peers, indent=1) + "\n")
    return peers


def peer_versions(src: pathlib.Path) -> dict:
    path = pathlib.Path(src) / "PEERS.json"
    return json.loads(path.read_text()) if path.exists() else {}


# ---------------------------------------------------------------------------------------------------------------
# vLLM's Marlin
# ---------------------------------------------------------------------------------------------------------------
def instantiations(wtypes) -> list[tuple]:
    """(type constant, thread_m_blocks, n_blocks, k_blocks, m_block_size_8, group_blocks, threads) per kernel."""
    out = []
    for w in wtypes:
        if w not in VLLM_TYPES:
            raise ValueError(f"vllm_marlin: weight type {w!r} not one of {sorted(VLLM_TYPES)}")
        t, gb = VLLM_TYPES[w]
        for nb, kb, th in M1_TILES:
            for m8 in (True, False):
                out.append((t, 1, nb, kb, m8, gb, th))
        for nb, kb, th in M234_TILES:
            for mb in (2, 3, 4):
                out.append((t, mb, nb, kb, False, gb, th))
    return out


def _kernel_file(inst) -> str:
    t, mb, nb, kb, m8, gb, th = inst
    b = "true" if m8 else "false"
    s = VLLM_SCALE_TYPES.get((t, gb), "vllm::kFloat16")
    return ('#include "kernel.h"\n#include "marlin_template.h"\nnamespace MARLIN_NAMESPACE_NAME {\n'
            f"template __global__ void Marlin<half, {t}.id(), {s}.id(), {th}, {mb}, {nb}, {kb}, {b}, "
            f"pipe_stages, {gb}, false>(MARLIN_KERNEL_PARAMS);\n}}\n")


def _dispatcher(source: str, insts) -> str:
    """gptq_marlin.cu with get_marlin_kernel's body replaced by a chain over exactly the kernels built (the
    file's own _GET_IF macro, so the matching is the file's)."""
    head = re.search(r"template <typename scalar_t>\s*MarlinFuncPtr get_marlin_kernel\([^)]*\)\s*\{", source)
    if head is None:
        raise RuntimeError("vllm_marlin: get_marlin_kernel not found in gptq_marlin.cu (the snapshot changed)")
    end = source.index("  return kernel;\n}", head.end())
    lines = ["  int num_bits = q_type.size_bits();", "  auto kernel = MarlinDefault;",
             "  if constexpr (std::is_same<scalar_t, half>::value) {", "    if (stages == pipe_stages) {",
             "      if (false) {", "      }"]
    for t, mb, nb, kb, m8, gb, th in insts:
        lines.append(f"      _GET_IF({t}, {mb}, {nb}, {kb}, {'true' if m8 else 'false'}, pipe_stages, {gb}, {th}, "
                     "false)")
    lines += ["    }", "  }", ""]
    return source[:head.end()] + "\n" + "\n".join(lines) + source[end:]


BINDINGS = r"""
#include <torch/library.h>
#include "core/scalar_type.hpp"
#include "gptq_marlin_repack.cuh"
#include "awq_marlin_repack.cuh"

torch::Tensor gptq_marlin_gemm_fp16(
    torch::Tensor& a, std::optional<torch::Tensor> c_or_none, torch::Tensor& b_q_weight,
    std::optional<torch::Tensor> const& b_bias_or_none, torch::Tensor& b_scales,
    std::optional<torch::Tensor> const& global_scale_or_none, std::optional<torch::Tensor> const& b_zeros_or_none,
    std::optional<torch::Tensor> const& g_idx_or_none, std::optional<torch::Tensor> const& perm_or_none,
    torch::Tensor& workspace, vllm::ScalarTypeId const& b_q_type_id, int64_t size_m, int64_t size_n,
    int64_t size_k, bool is_k_full, bool use_atomic_add, bool use_fp32_reduce, bool is_zp_float);

namespace {
torch::Tensor gemm(torch::Tensor a, std::optional<torch::Tensor> c, torch::Tensor b_q_weight,
                   std::optional<torch::Tensor> const& b_bias, torch::Tensor b_scales,
                   std::optional<torch::Tensor> const& global_scale, std::optional<torch::Tensor> const& b_zeros,
                   std::optional<torch::Tensor> const& g_idx, std::optional<torch::Tensor> const& perm,
                   torch::Tensor workspace, int64_t b_q_type_id, int64_t size_m, int64_t size_n, int64_t size_k,
                   bool is_k_full, bool use_atomic_add, bool use_fp32_reduce, bool is_zp_float) {
  return gptq_marlin_gemm_fp16(a, c, b_q_weight, b_bias, b_scales, global_scale, b_zeros, g_idx, perm, workspace,
                               static_cast<vllm::ScalarTypeId>(b_q_type_id), size_m, size_n, size_k, is_k_full,
                               use_atomic_add, use_fp32_reduce, is_zp_float);
}
torch::Tensor repack(torch::Tensor b_q_weight, torch::Tensor perm, int64_t size_k, int64_t size_n, int64_t bits) {
  return gptq_marlin_repack(b_q_weight, perm, size_k, size_n, bits);
}
torch::Tensor awq_repack(torch::Tensor b_q_weight, int64_t size_k, int64_t size_n, int64_t bits) {
  return awq_marlin_repack(b_q_weight, size_k, size_n, bits);
}
int64_t type_id(std::string name) {
  if (name == "u4b8") return vllm::kU4B8.id();
  if (name == "u4") return vllm::kU4.id();
  if (name == "u8b128") return vllm::kU8B128.id();
  if (name == "fe4m3fn") return vllm::kFE4M3fn.id();
  if (name == "nvfp4") return vllm::kFE2M1f.id();
  TORCH_CHECK(false, "unknown weight type ", name);
  return -1;
}
}  // namespace

TORCH_LIBRARY(peer_vllm_marlin, m) {
  m.def("gemm(Tensor a, Tensor? c, Tensor b_q_weight, Tensor? b_bias, Tensor b_scales, Tensor? global_scale, "
        "Tensor? b_zeros, Tensor? g_idx, Tensor? perm, Tensor workspace, int b_q_type_id, int size_m, int size_n, "
        "int size_k, bool is_k_full, bool use_atomic_add, bool use_fp32_reduce, bool is_zp_float) -> Tensor");
  m.def("gptq_marlin_repack(Tensor b_q_weight, Tensor perm, int size_k, int size_n, int num_bits) -> Tensor");
  m.def("awq_marlin_repack(Tensor b_q_weight, int size_k, int size_n, int num_bits) -> Tensor");
  m.def("type_id(str name) -> int", &type_id);  // no tensor arguments: a catch-all kernel
}
TORCH_LIBRARY_IMPL(peer_vllm_marlin, CUDA, m) {
  m.impl("gemm", &gemm);
  m.impl("gptq_marlin_repack", &repack);
  m.impl("awq_marlin_repack", &awq_repack);
}
"""


def build_vllm_marlin(src: pathlib.Path, wtypes, jobs: int = 16, record: bool = False):
    """Build (or load, when the build folder is current) vLLM's Marlin for ``wtypes``; (torch.ops namespace,
    seconds spent in build/load). The build folder: CACHE/vllm_marlin_<types>."""
    import torch.utils.cpp_extension as ext
    import torch

    marlin = pathlib.Path(src) / "vllm_marlin"
    wtypes = sorted(set(wtypes))
    build = CACHE / ("vllm_marlin_" + "_".join(wtypes))
    gen = build / "src"
    gen.mkdir(parents=True, exist_ok=True)
    insts = instantiations(wtypes)

    def write(path: pathlib.Path, text: str):  # unchanged files keep their time stamps: ninja rebuilds nothing
        if not path.exists() or path.read_text() != text:
            path.write_text(text)

    sources = []
    for i, inst in enumerate(insts):
        p = gen / f"kernel_{i:03d}.cu"
        write(p, _kernel_file(inst))
        sources.append(p)
    write(gen / "gptq_marlin_cut.cu", _dispatcher((marlin / "gptq_marlin.cu").read_text(), insts))
    write(gen / "gemm_fp16.cu", "#define MARLIN_GEMM_EXPORT_NAME gptq_marlin_gemm_fp16\n#define MARLIN_ENABLE_FP16 1\n"
                                "#define MARLIN_ENABLE_BF16 0\n#include \"gptq_marlin_cut.cu\"\n")
    write(gen / "bindings.cpp", BINDINGS)
    sources += [gen / "gemm_fp16.cu", gen / "bindings.cpp", marlin / "gptq_marlin_repack.cu",
                marlin / "awq_marlin_repack.cu"]
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    os.environ["MAX_JOBS"] = str(jobs)
    t0 = time.time()
    ext.load(name="peer_vllm_marlin_" + "_".join(wtypes), sources=[str(s) for s in sources],
             extra_include_paths=[str(marlin), str(gen)], build_directory=str(build), is_python_module=False,
             extra_cflags=["-O3", "-std=c++17"],
             # nvcc 13: template kernels instantiated in one file and launched from another need real stubs
             extra_cuda_cflags=["-O3", "-std=c++17", "-static-global-template-stub=false", "--expt-relaxed-constexpr",
                                "-DMARLIN_NAMESPACE_NAME=marlin"],
             verbose=False)
    seconds = time.time() - t0
    if record:  # the building process says what the build cost (a loader may only have waited for it)
        (build / "build_seconds.json").write_text(json.dumps({"seconds": round(seconds, 1), "wtypes": wtypes,
                                                              "kernels": len(insts)}))
    return torch.ops.peer_vllm_marlin, seconds


REPACK_BINDINGS = r"""
#include <torch/library.h>
#include "gptq_marlin_repack.cuh"
#include "awq_marlin_repack.cuh"

namespace {
torch::Tensor repack(torch::Tensor b_q_weight, torch::Tensor perm, int64_t size_k, int64_t size_n, int64_t bits) {
  return gptq_marlin_repack(b_q_weight, perm, size_k, size_n, bits);
}
torch::Tensor awq_repack(torch::Tensor b_q_weight, int64_t size_k, int64_t size_n, int64_t bits) {
  return awq_marlin_repack(b_q_weight, size_k, size_n, bits);
}
}  // namespace

TORCH_LIBRARY(peer_vllm_repack, m) {
  m.def("gptq_marlin_repack(Tensor b_q_weight, Tensor perm, int size_k, int size_n, int num_bits) -> Tensor");
  m.def("awq_marlin_repack(Tensor b_q_weight, int size_k, int size_n, int num_bits) -> Tensor");
}
TORCH_LIBRARY_IMPL(peer_vllm_repack, CUDA, m) {
  m.impl("gptq_marlin_repack", &repack);
  m.impl("awq_marlin_repack", &awq_repack);
}
"""


def build_vllm_repack(src: pathlib.Path, jobs: int = 16):
    """vLLM's two repack ops alone (their sources unchanged, bindings of our own, namespace ``peer_vllm_repack``):
    three files, so a repack comparison does not wait for the GEMM's instantiations; (namespace, seconds)."""
    import torch.utils.cpp_extension as ext
    import torch

    marlin = pathlib.Path(src) / "vllm_marlin"
    build = CACHE / "vllm_repack"
    build.mkdir(parents=True, exist_ok=True)
    bindings = build / "bindings.cpp"
    if not bindings.exists() or bindings.read_text() != REPACK_BINDINGS:
        bindings.write_text(REPACK_BINDINGS)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    os.environ["MAX_JOBS"] = str(jobs)
    t0 = time.time()
    ext.load(name="peer_vllm_repack", sources=[str(bindings), str(marlin / "gptq_marlin_repack.cu"),
                                               str(marlin / "awq_marlin_repack.cu")],
             extra_include_paths=[str(marlin)], build_directory=str(build), is_python_module=False,
             extra_cflags=["-O3", "-std=c++17"],
             extra_cuda_cflags=["-O3", "-std=c++17", "-static-global-template-stub=false", "--expt-relaxed-constexpr",
                                "-DMARLIN_NAMESPACE_NAME=marlin"],
             verbose=False)
    return torch.ops.peer_vllm_repack, time.time() - t0


def vllm_build_record(wtypes) -> dict:
    """What the last build of these types cost (build_vllm_marlin's record), {} if none."""
    path = CACHE / ("vllm_marlin_" + "_".join(sorted(set(wtypes)))) / "build_seconds.json"
    return json.loads(path.read_text()) if path.exists() else {}


def vllm_gemm(ops, type_ids: dict):
    """A call with our MarlinWeight fields (the formats are the same bytes) and vLLM's defaults (fp32 reduction,
    no atomics, K full)."""

    def call(a, w, c, workspace):
        name = w.weight_type.name.lower()
        return ops.gemm(a, c, w.qweight, None, w.scales, None, w.zeros, None, None, workspace, type_ids[name],
                        a.shape[0], w.size_n, w.size_k, True, False, True, False)

    return call


# ---------------------------------------------------------------------------------------------------------------
# humming
# ---------------------------------------------------------------------------------------------------------------
HUMMING_TYPES = {"u4b8": "int4"}  # symmetric 4-bit codes, fp16 group scales: the same bytes per weight as u4b8


def humming_import(src: pathlib.Path):
    os.environ.setdefault("HUMMING_CACHE_DIR", str(CACHE / "humming" / "cache"))
    os.environ.setdefault("HUMMING_TMP_DIR", str(CACHE / "humming" / "tmp"))
    os.environ.setdefault("HUMMING_COMPILER", "nvcc")  # one process per kernel: parallel compiles for sure
    pathlib.Path(os.environ["HUMMING_TMP_DIR"]).mkdir(parents=True, exist_ok=True)
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
    import humming  # noqa: F401
    from humming.layer import HummingLayer
    return HummingLayer


class HummingDense:
    """``copies`` humming layers of one shape (random codes and scales, transformed to humming's layout), and the
    heuristic's single-kernel config per M (so each timed M compiles one kernel, not the whole M range)."""

    def __init__(self, src, k: int, n: int, wtype: str, group: int, copies: int):
        import torch

        HummingLayer = humming_import(src)
        from humming.utils.test import random_fill_tensor

        self.torch = torch
        self.layers = []
        for _ in range(copies):
            layer = HummingLayer(shape_n=n, shape_k=k, torch_dtype=torch.float16,
                                 weight_config={"dtype": HUMMING_TYPES[wtype], "group_size": group,
                                                "scale_dtype": "float16"}).to("cuda:0")
            for t in layer.parameters():
                random_fill_tensor(t)
            layer.transform()
            self.layers.append(layer)
        self.meta = self.layers[0].humming_metas[""]
        self.weight_bytes = int(self.meta.weight_nbytes)

    def tuning(self, m: int) -> str:
        from humming.tune import get_heuristics_config

        return json.dumps(get_heuristics_config(self.meta, shape_m=m))

    def kernel_configs(self, m: int) -> dict:
        """The arguments of humming's HummingKernel for this M (what prepare_kernels builds)."""
        cfg = json.loads(self.meta.to_str())
        cfg.pop("sublayer_name", None)
        cfg.update(json.loads(self.tuning(m)))
        cfg.pop("num_sms", None)
        return cfg

    def call(self, i: int, a, c, m: int):
        return self.layers[i % len(self.layers)](inputs=a, outputs=c, tuning_config=self.tuning_cached(m))

    def tuning_cached(self, m: int) -> str:
        cache = self.__dict__.setdefault("_tuning", {})
        if m not in cache:
            cache[m] = self.tuning(m)
        return cache[m]


class HummingMoE:
    """A humming expert stack (random int4 codes, fp16 group scales) run as its indexed MoE GEMM on vLLM-style
    aligned routings (sorted token ids padded with M x top_k, one expert id per block, the padded count)."""

    def __init__(self, src, e: int, k: int, n: int, top_k: int, group: int = 128):
        import torch

        HummingLayer = humming_import(src)
        from humming.utils.test import random_fill_tensor

        self.layer = HummingLayer(shape_n=n, shape_k=k, num_experts=e, torch_dtype=torch.float16,
                                  weight_config={"dtype": "int4", "group_size": group,
                                                 "scale_dtype": "float16"}).to("cuda:0")
        for t in self.layer.parameters():
            random_fill_tensor(t)
        self.layer.transform()
        self.meta = self.layer.humming_metas[""]
        self.top_k = top_k
        self.compute = json.dumps({"gemm_type": "indexed"})
        self._tuning = {}

    def tuning(self, m: int) -> dict:
        """humming's heuristic config for m tokens (m x top_k routed rows); its block choice samples expert counts
        with NumPy's global generator, seeded here so every process picks the same kernel."""
        if m not in self._tuning:
            import numpy as np
            from humming.tune import get_heuristics_config

            np.random.seed(1000 + m)
            self._tuning[m] = get_heuristics_config(self.meta, shape_m=m * self.top_k, gemm_type="indexed")
        return self._tuning[m]

    def block(self, m: int) -> int:
        return int(self.tuning(m)["block_shape"][0])

    def kernel_configs(self, m: int) -> dict:
        cfg = json.loads(self.meta.to_str())
        cfg.pop("sublayer_name", None)
        cfg.update(json.loads(self.compute))
        cfg.update(json.loads(json.dumps(self.tuning(m))))
        cfg.pop("num_sms", None)
        return cfg

    def call(self, a, sorted_ids, expert_ids, num_padded, out, m: int):
        return self.layer(inputs=a, outputs=out, sorted_ids=sorted_ids, expert_ids=expert_ids,
                          num_tokens_padded=num_padded, compute_config=self.compute,
                          tuning_config=json.dumps(self.tuning(m)), top_k=self.top_k)


def humming_precompile(src, cells, workers: int = 16, ready_prefix: str | None = None, moe_models=()) -> float:
    """Compile humming's kernels for every (k, n, ms) of ``cells`` in parallel (HUMMING_COMPILER=nvcc: one process
    per kernel; humming's disk cache keeps them), the layers in order; after each layer's last kernel, touch
    ``<ready_prefix>.<k>x<n>`` (the bench times humming on a layer only once that file exists); seconds."""
    import torch
    from concurrent.futures import ThreadPoolExecutor, as_completed

    humming_import(src)
    from humming.kernel.humming import HummingKernel

    t0 = time.time()
    torch.cuda.init()
    left, futures = {}, {}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for k, n, ms in cells:
            layer = HummingDense(src, k, n, "u4b8", 128, 1)
            configs = {json.dumps(layer.kernel_configs(m), sort_keys=True): layer.kernel_configs(m) for m in ms}
            left[(k, n)] = len(configs)
            for cfg in configs.values():
                futures[pool.submit(lambda c=cfg: HummingKernel(**c))] = (k, n)
        for name, (e, k, n, top_k), ms in moe_models:  # (name, (experts, K, N, top-k), M values)
            stack = HummingMoE(src, e, k, n, top_k)
            configs = {json.dumps(stack.kernel_configs(m), sort_keys=True): stack.kernel_configs(m) for m in ms}
            left[("moe", name)] = len(configs)
            for cfg in configs.values():
                futures[pool.submit(lambda c=cfg: HummingKernel(**c))] = ("moe", name)
            del stack
        from humming.ops.utils import init_humming_launcher

        init_humming_launcher()  # its C++ launcher (a torch extension) builds while the kernels compile
        print(f"humming launcher ready after {time.time() - t0:.1f} s", flush=True)
        failed = set()
        for f in as_completed(futures):
            key = futures[f]
            try:
                f.result()
            except Exception as exc:  # that layer gets no ready file: the bench skips humming there, with a note
                print(f"humming {key}: a kernel failed to compile: {type(exc).__name__}: {exc}", flush=True)
                failed.add(key)
            left[key] -= 1
            if key in failed:
                continue
            if left[key] == 0:
                tag = f"{key[0]}.{key[1]}" if key[0] == "moe" else f"{key[0]}x{key[1]}"
                print(f"humming {tag}: compiled after {time.time() - t0:.1f} s", flush=True)
                if ready_prefix:
                    pathlib.Path(f"{ready_prefix}.{tag}").write_text("ok\n")
    return time.time() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("--dest", required=True, type=pathlib.Path)
    e.add_argument("--mirror", default="/work/.mirror", type=pathlib.Path)
    b = sub.add_parser("build-vllm")
    b.add_argument("--src", required=True, type=pathlib.Path)
    b.add_argument("--wtypes", default="u4b8")
    b.add_argument("--jobs", type=int, default=16)
    b.add_argument("--report", type=pathlib.Path, help="write {seconds, wtypes} here")
    h = sub.add_parser("jit-humming")
    h.add_argument("--src", required=True, type=pathlib.Path)
    h.add_argument("--shapes", default="", help="dense layers KxN,...")
    h.add_argument("--m", default="", help="dense M values")
    h.add_argument("--report", type=pathlib.Path)
    h.add_argument("--ready-prefix", help="touch PREFIX.KxN (PREFIX.moe.MODEL) when a layer's kernels are compiled")
    h.add_argument("--moe", default="", help="MoE models of bench_moe.MODELS, comma list (compiled after the dense layers)")
    h.add_argument("--moe-m", default="1,8,64,256")
    args = p.parse_args(argv)
    if args.cmd == "export":
        print(json.dumps(export(args.dest, args.mirror), indent=1))
        return 0
    if args.cmd == "build-vllm":
        wtypes = args.wtypes.split(",")
        _, seconds = build_vllm_marlin(args.src, wtypes, args.jobs, record=True)
        print(f"vllm_marlin built for {wtypes} in {seconds:.1f} s", flush=True)
        if args.report:
            args.report.write_text(json.dumps({"seconds": round(seconds, 1), "wtypes": wtypes}))
        return 0
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else []
    ms = [int(v) for v in args.m.split(",")] if args.m else []
    moe_models = []
    if args.moe:
        import bench_moe

        moe_ms = [int(v) for v in args.moe_m.split(",")]
        moe_models = [(name, bench_moe.MODELS[name], moe_ms) for name in args.moe.split(",")]
    seconds = humming_precompile(args.src, [(k, n, ms) for k, n in shapes], ready_prefix=args.ready_prefix,
                                 moe_models=moe_models)
    print(f"humming kernels for {len(shapes)} shapes x {len(ms)} M compiled in {seconds:.1f} s", flush=True)
    if args.report:
        args.report.write_text(json.dumps({"seconds": round(seconds, 1), "shapes": args.shapes, "m": ms}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
