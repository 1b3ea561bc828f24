"""Repack throughput and peak memory of ``workbench repack`` for a synthetic GPTQ checkpoint with Llama-3-8B shapes.

    python bench/bench_checkpoint.py [--layers 24] [--backend numpy|numba] [--workdir /tmp/wb-bench] [--keep]

``--backend numpy`` (default) is the CPU reference path; ``--backend numba`` runs the Numba kernels on the GPU (NumPy
column blocks go to the device and back, so the disk, the host copies and the kernels are all in the time).

The checkpoint: ``--layers`` decoder layers of Llama-3-8B (hidden 4096, intermediate 14336, 8 KV heads of 128), GPTQ
4-bit, group 128, symmetric, fp16 scales, one shard per layer, plus ``embed_tokens`` and ``lm_head`` (128256 x 4096
bf16, 1 GiB each, the largest tensors) and the norms, carried over untouched. Weights are random int32 words (the
repack moves bits; their values do not change its cost), scales random fp16, qzeros the symmetric 0x77777777.

Each repack runs in a fresh process (``python -m workbench repack``); its peak resident memory is the kernel's
``ru_maxrss`` for that child, and the constant is measured the same way for a process that only imports the
workbench. Throughput = source bytes / wall seconds. Results: ``bench/results/checkpoint.json`` (schema:
bench/README.md), one row per (backend, checkpoint); a run replaces its backend's rows and keeps the other's.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

HIDDEN, INTER, KV, VOCAB = 4096, 14336, 1024, 128256
LINEARS = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN, KV), "self_attn.v_proj": (HIDDEN, KV),
           "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (HIDDEN, INTER), "mlp.up_proj": (HIDDEN, INTER),
           "mlp.down_proj": (INTER, HIDDEN)}
GROUP = 128
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BACKENDS = ("numpy", "numba")


def write_source(root: str, layers: int, with_embeddings: bool, seed: int = 0) -> tuple[int, int]:
    """Returns (total tensor bytes, largest tensor bytes)."""
    rng = np.random.default_rng(seed)
    os.makedirs(root, exist_ok=True)
    weight_map, total, largest = {}, 0, 0

    def emit(fname: str, tensors: dict) -> None:
        nonlocal total, largest
        save_file(tensors, os.path.join(root, fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.nbytes
            largest = max(largest, t.nbytes)

    shards = layers + (2 if with_embeddings else 0)
    names = iter(f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards))
    if with_embeddings:
        emb = rng.standard_normal((VOCAB, HIDDEN), dtype=np.float32).astype(ml_dtypes.bfloat16)
        emit(next(names), {"model.embed_tokens.weight": emb, "model.norm.weight": np.ones(HIDDEN, ml_dtypes.bfloat16)})
        emit(next(names), {"lm_head.weight": emb})
        del emb
    for layer in range(layers):
        tensors = {f"model.layers.{layer}.input_layernorm.weight": np.ones(HIDDEN, np.float16)}
        for linear, (k, n) in LINEARS.items():
            p = f"model.layers.{layer}.{linear}"
            tensors[f"{p}.qweight"] = rng.integers(0, 2**32, (k // 8, n), dtype=np.uint32).view(np.int32)
            tensors[f"{p}.qzeros"] = np.full((k // GROUP, n // 8), 0x77777777, np.int32)
            tensors[f"{p}.scales"] = (rng.random((k // GROUP, n), dtype=np.float32) * 0.01 + 1e-3).astype(np.float16)
            tensors[f"{p}.g_idx"] = (np.arange(k) // GROUP).astype(np.int32)
        emit(next(names), tensors)
    with open(os.path.join(root, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN, "intermediate_size": INTER,
              "num_hidden_layers": layers, "torch_dtype": "float16",
              "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
                                      "sym": True, "checkpoint_format": "gptq"}}
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(config, f)
    return total, largest


def run_child(args: list[str]) -> tuple[float, int, int]:
    """(wall seconds, peak RSS bytes, exit code) of a child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    return wall, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--workdir", default="/tmp/wb-bench-checkpoint")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--backend", choices=BACKENDS, default="numpy",
                        help="numpy: the CPU reference path; numba: the Numba kernels on the GPU")
    parser.add_argument("--results-dir", default=RESULTS_DIR)
    parser.add_argument("--generate", metavar="DIR", help=argparse.SUPPRESS)  # child: write a source and exit
    parser.add_argument("--embeddings", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.generate:
        print(json.dumps(write_source(args.generate, args.layers, args.embeddings)))
        return
    shutil.rmtree(args.workdir, ignore_errors=True)
    rows = []
    try:
        baseline_wall, baseline_rss, _ = run_child(["-c", "import workbench.checkpoint, workbench.ops;"
                                                         " from workbench import hardware; hardware.gpu_available()"])
        for label, with_embeddings in (("layers + embed_tokens + lm_head", True), ("layers only", False)):
            src = os.path.join(args.workdir, "src")
            out = os.path.join(args.workdir, "out")
            shutil.rmtree(args.workdir, ignore_errors=True)
            # generated in a child: a forked/exec'd process inherits its parent's RSS high-water mark, so the parent
            # must stay small for ru_maxrss of the repack child to mean anything
            gen = subprocess.run([sys.executable, __file__, "--generate", src, "--layers", str(args.layers)]
                                 + (["--embeddings"] if with_embeddings else []), check=True, capture_output=True,
                                 text=True)
            total, largest = json.loads(gen.stdout.strip().splitlines()[-1])
            os.sync()
            wall, rss, rc = run_child(["-m", "workbench", "repack", src, "--out", out, "--no-progress",
                                       "--backend", args.backend])
            assert rc == 0, f"repack exited {rc}"
            vwall, vrss, vrc = run_child(["-m", "workbench", "verify", out, "--against", src, "--no-progress"])
            assert vrc == 0, f"verify exited {vrc}"
            out_bytes = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
            row = {"checkpoint": label, "layers": args.layers, "source_bytes": total, "largest_tensor_bytes": largest,
                   "output_bytes": out_bytes, "repack_seconds": round(wall, 2),
                   "repack_MB_per_s": round(total / wall / 1e6, 1), "repack_peak_rss_bytes": rss,
                   "verify_seconds": round(vwall, 2), "verify_peak_rss_bytes": vrss,
                   "import_only_peak_rss_bytes": baseline_rss}
            rows.append(row)
            print(json.dumps(row))
    finally:
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)
    import pathlib

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import timing

    dev = None
    if args.backend == "numba":
        dev = timing.device()
    for r in rows:  # the schema's keys: one call of `workbench repack` per row
        r.update(method="ours", backend=args.backend, us=round(r["repack_seconds"] * 1e6, 1))
    path = pathlib.Path(args.results_dir) / "checkpoint.json"
    kept = []
    if path.exists():
        kept = [r for r in json.loads(path.read_text())["rows"] if r.get("backend") != args.backend]
    method = {"shapes": "Llama-3-8B: hidden 4096, intermediate 14336, kv 1024, vocab 128256; GPTQ 4-bit g128 sym",
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python"
                         f" {platform.python_version()}, numpy {np.__version__}",
              "measure": "wall seconds of one `python -m workbench repack` child; peak RSS = its ru_maxrss"}
    timing.write_results(args.results_dir, "checkpoint",
                         timing.meta(pathlib.Path(__file__).resolve().parent.parent, dev, None, method, {}),
                         kept + rows)
    gib = 1024**3
    print("\n| checkpoint | source | largest tensor | repack | throughput | peak RSS | import-only RSS | verify |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['checkpoint']} ({r['layers']} layers) | {r['source_bytes'] / gib:.2f} GiB |"
              f" {r['largest_tensor_bytes'] / gib:.2f} GiB | {r['repack_seconds']:.1f} s |"
              f" {r['repack_MB_per_s']:.0f} MB/s | {r['repack_peak_rss_bytes'] / gib:.2f} GiB |"
              f" {r['import_only_peak_rss_bytes'] / gib:.2f} GiB | {r['verify_seconds']:.1f} s"
              f" ({r['verify_peak_rss_bytes'] / gib:.2f} GiB) |")


if __name__ == "__main__":
    main()
