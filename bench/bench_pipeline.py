"""Throughput and peak host memory of the pipelined ``workbench repack``: the GPU path and the CPU path with 1, 2, 4,
8 and 16 worker processes, from page cache, outputs written but not fsync'ed.

    python bench/bench_pipeline.py                     # the full run (about 2 minutes on the H200 machine)
    python bench/bench_pipeline.py --tiny --no-gpu     # a few MB, 1 and 2 workers: checks the script itself

The checkpoint is synthetic and written first: DeepSeek-V3-shaped MoE experts (hidden 7168, expert intermediate
2048; gate and up 7168 x 2048, down 2048 x 7168) in block-FP8 (DeepSeek-V3's own format: E4M3 weights, float32
scales per 128 x 128 block) and, for the GPU, the same shapes in GPTQ 4-bit (group 128, symmetric). Weights are
random bytes (random int32 words for GPTQ): the repack moves bits, their values do not change its cost. Source and
outputs live on a tmpfs (``/dev/shm`` when it has room, else a temporary folder or ``--workdir``); the source was
just written, so it is read from the page cache, and the measured process turns ``os.fsync`` into a no-op, so the
outputs are written but not synced: what is timed is the pipeline (read, convert, write), not a disk.

Each measurement runs ``workbench.checkpoint.repack`` in a fresh process: its ``Stats`` give the time, the bytes
read, the measured peak resident memory of the coordinator and of the largest worker process (``ru_maxrss``) and
the bound the pipeline keeps to (tasks in flight x the largest task + staging buffers). Every output's per-shard
checksums (the manifest's) are compared with the first one's: every configuration writes the same bytes.
Throughput = source bytes / wall seconds of the repack call. Results: ``bench/results/pipeline.json``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULT = os.path.join(ROOT, "bench", "results", "pipeline.json")
HIDDEN, EXPERT_INTER, GROUP = 7168, 2048, 128
PROJECTIONS = {"gate_proj": (HIDDEN, EXPERT_INTER), "up_proj": (HIDDEN, EXPERT_INTER),
               "down_proj": (EXPERT_INTER, HIDDEN)}  # (K, N)
SHARD_BYTES = 1 << 30  # source files of about 1 GB, as HF writes DeepSeek-V3 (163 files of 4.3 GB there)


def _fp8_tensors(prefix: str, k: int, n: int, rng) -> dict:
    import ml_dtypes

    codes = rng.integers(0, 256, size=(n, k), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes: a real checkpoint has none
    inv = (rng.random((-(-n // 128), k // 128), dtype=np.float32) + 0.5) * np.float32(1e-3)
    return {f"{prefix}.weight": codes.view(ml_dtypes.float8_e4m3fn), f"{prefix}.weight_scale_inv": inv}


def _gptq_tensors(prefix: str, k: int, n: int, rng) -> dict:
    return {f"{prefix}.qweight": rng.integers(-2**31, 2**31, size=(k // 8, n), dtype=np.int32),
            f"{prefix}.qzeros": np.full((k // GROUP, n // 8), 0x77777777, np.int32),  # symmetric: stored zero - 1 = 7
            f"{prefix}.scales": (rng.random((k // GROUP, n), dtype=np.float32) * 0.01 + 0.001).astype(np.float16),
            f"{prefix}.g_idx": (np.arange(k) // GROUP).astype(np.int32)}


TINY = {name: (k // 8, n // 8) for name, (k, n) in PROJECTIONS.items()}  # --tiny: the same layout, 1/64 the bytes


def write_source(root: str, fmt: str, target_bytes: int, seed: int = 0, shapes: dict = PROJECTIONS) -> dict:
    """An MoE checkpoint of about ``target_bytes``: layer 0's experts, as many as fit, in ~1 GB files."""
    from safetensors.numpy import save_file

    from workbench.checkpoint import synthetic as sy

    rng = np.random.default_rng(seed)
    make = _fp8_tensors if fmt == "block-fp8" else _gptq_tensors
    per_expert = sum(t.nbytes for p, (k, n) in shapes.items() for t in make("x", k, n, rng).values())
    experts = max(1, target_bytes // per_expert)
    os.makedirs(root, exist_ok=True)
    shards, current, size = [], {}, 0
    for e in range(experts):
        for proj, (k, n) in shapes.items():
            tensors = make(f"model.layers.0.mlp.experts.{e}.{proj}", k, n, rng)
            current.update(tensors)
            size += sum(t.nbytes for t in tensors.values())
        if size >= SHARD_BYTES or e == experts - 1:
            shards.append(current)
            current, size = {}, 0
    shards[-1]["model.norm.weight"] = np.ones(next(iter(shapes.values()))[0], np.float16)
    weight_map, total, largest = {}, 0, 0
    for i, tensors in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(root, fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.nbytes
            largest = max(largest, t.nbytes)
    with open(os.path.join(root, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    opt = sy.Options(fmt=fmt, bits=4, group_size=GROUP)
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                   "quantization_config": sy.quant_config(opt)}, f)
    return {"format": fmt, "experts": int(experts), "files": len(shards), "source_bytes": int(total),
            "largest_tensor_bytes": int(largest)}


_CHILD = r"""
import json, os, shutil, sys, time
os.fsync = lambda fd: None  # outputs written to the page cache, not synced: the pipeline's time, not the disk's
from workbench.checkpoint import repack
from workbench.checkpoint.pipeline import Stats
from workbench.checkpoint import pipeline
out, backend, workers, warm = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
pipeline.WORKER_WRITE = os.environ.get("WB_BENCH_WRITE") or pipeline.WORKER_WRITE  # how tasks write their results
for w in filter(None, warm.split(",")):  # compile the kernels of each format before the timed runs
    repack(w, out + ".warm", backend=backend, workers=1, progress=False, log=lambda m: None)
    shutil.rmtree(out + ".warm")
runs = []  # (GPU mode, source): "T:own" = T converter threads, each on its own stream; "T:shared" = on one stream
for item in sys.argv[5:]:
    mode, src = item.split("=", 1)
    runs.append((mode, src))
for mode, src in runs:
    threads, streams = mode.split(":")[:2]
    pipeline.GPU_STREAMS, pipeline.OWN_STREAMS = int(threads), streams == "own"
    pipeline.DEVICE_RESULTS = not mode.endswith(":host")  # "T:own:host": results back through host arrays
    stats = Stats()
    # 1 GB output files: finishing one (checksum, rename) overlaps converting the next, as in a 700 GB run
    manifest = repack(src, out, backend=backend, workers=workers, max_shard_bytes=1 << 30, progress=False,
                      log=lambda m: None, stats=stats)
    shutil.rmtree(out)
    print(json.dumps({"source": src, "mode": mode, "seconds": stats.seconds,
                      "baseline_rss_bytes": stats.baseline_rss_bytes,
                      "startup_seconds": stats.startup_seconds, "cpu_seconds": stats.cpu_seconds,
                      "source_bytes": stats.source_bytes, "output_bytes": stats.output_bytes, "path": stats.path,
                      "workers": stats.workers, "peak_rss_bytes": stats.peak_rss_bytes,
                      "peak_worker_rss_bytes": stats.peak_worker_rss_bytes,
                      "memory_bound_bytes": stats.memory_bound_bytes, "write_mode": pipeline.WORKER_WRITE,
                      "stage_seconds": stats.stage_seconds, "finish_seconds": stats.finish_seconds,
                      "tail_seconds": stats.tail_seconds, "device_tasks": stats.device_tasks,
                      "shards": {k: v["digest"] for k, v in manifest["shards"].items()}}), flush=True)
"""


# GPU rows: "T:own" = T converter threads, each on a stream of its own (the pipeline's default is 2); "T:shared" =
# all on one stream (the legacy default stream)
# all on one stream (the legacy default stream); a ":host" suffix: the results back through host arrays
# (pipeline.DEVICE_RESULTS off), as before the device path
GPU_MODES = ("2:own", "4:own", "1:own", "2:own:host")


def measure(sources: list, out: str, backend: str, workers: int, warm: str = "", timeout: float = 400,
            write_mode: str = "") -> list:
    """One fresh process repacking each of ``sources`` in turn (paths, or (GPU mode, path) pairs; the GPU rows
    share one process, so the kernels compile once; a row's peak RSS is then that process's so far).
    ``write_mode``: how the tasks write their results (``pipeline.WORKER_WRITE``; empty: the pipeline's default)."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "WB_BENCH_WRITE": write_mode}
    runs = [f"{s[0]}={s[1]}" if isinstance(s, tuple) else f"2:own={s}" for s in sources]
    done = subprocess.run([sys.executable, "-c", _CHILD, out, backend, str(workers), warm, *runs], env=env,
                          capture_output=True, text=True, timeout=timeout)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(out + ".warm", ignore_errors=True)
    if done.returncode != 0:
        raise RuntimeError(f"repack ({backend}, {workers} workers) failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def host_ceilings(path: str, nbytes: int = 1 << 28) -> dict:
    """Host memcpy and page-cache read bandwidth (GB/s): what bounds a pipeline that reads and writes host memory."""
    a = np.ones(nbytes, np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)
    t = time.perf_counter()
    for _ in range(4):
        np.copyto(b, a)
    copy = 4 * a.nbytes / (time.perf_counter() - t) / 1e9
    buf = bytearray(64 << 20)
    t, n = time.perf_counter(), 0
    with open(path, "rb", buffering=0) as f:
        while True:
            got = f.readinto(buf)
            if not got:
                break
            n += got
    read = n / (time.perf_counter() - t) / 1e9
    return {"copy_gbs": round(copy, 2), "read_gbs": round(read, 2), "mma_tflops": None, "cublas_tflops": None}


def _versions() -> dict:
    from importlib import metadata

    out = {}
    for name, dists in (("torch", ("torch",)), ("cupy", ("cupy-cuda13x", "cupy-cuda12x", "cupy"))):
        out[name] = ""
        for dist in dists:  # the installed distribution's version, without importing it (torch takes seconds)
            try:
                out[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    try:
        text = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=20).stdout
        out["nvcc"] = text.strip().splitlines()[-1] if text else ""
    except (OSError, subprocess.TimeoutExpired):
        out["nvcc"] = ""
    return out


def _gpu() -> tuple[str, int]:
    from workbench import hardware

    if not hardware.gpu_available():
        return "", 0
    from numba import cuda

    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    return name, int(dev.MULTIPROCESSOR_COUNT)


def _workdir(need: int, given: str | None) -> str:
    if given:
        os.makedirs(given, exist_ok=True)
        return tempfile.mkdtemp(prefix="wb-pipeline-", dir=given)
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > need:
        return tempfile.mkdtemp(prefix="wb-pipeline-", dir="/dev/shm")
    return tempfile.mkdtemp(prefix="wb-pipeline-")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu-gb", type=float, default=2.0, help="source size of each GPU measurement (GB)")
    p.add_argument("--cpu-gb", type=float, default=4.0,
                   help="source size of the CPU measurements (GB; 4 GB = 90 experts, 180 tasks of 22-29 MB, 11 per"
                        " worker at 16 workers: the 0.48 GB used before gave 33 tasks, 2 per worker, and measured"
                        " the workers' start and the half-empty last wave rather than the scaling)")
    p.add_argument("--workers", default="1,2,4,8,16", help="CPU worker counts to measure")
    p.add_argument("--write-modes", default="mmap,pwrite",
                   help="how the CPU tasks write their results (pipeline.WORKER_WRITE): every worker count with the"
                        " first, the largest count again with each other one")
    p.add_argument("--gpu-write-mode", default="", help="how the GPU path's threads write (mmap, pwrite; default:"
                                                             " the pipeline's)")
    p.add_argument("--gpu-modes", default=",".join(GPU_MODES),
                   help="GPU rows: T:own = T converter threads with a stream each, T:shared = on one stream")
    p.add_argument("--no-gpu", action="store_true", help="skip the GPU path")
    p.add_argument("--tiny", action="store_true", help="a few MB (checks the script, measures nothing useful)")
    p.add_argument("--budget-s", type=float, default=120.0, help="stop starting measurements after this long")
    p.add_argument("--workdir", default=None, help="where source and outputs go (default: /dev/shm when it has room)")
    p.add_argument("--out", default=RESULT, help="results file")
    p.add_argument("--gpu-timeout-s", type=float, default=400.0, help="limit of the process timing the GPU rows")
    args = p.parse_args(argv)
    started = time.perf_counter()
    if args.tiny:
        args.gpu_gb = args.cpu_gb = 0.004
    workers = [int(w) for w in args.workers.split(",") if w]
    gpu, sms = ("", 0) if args.no_gpu else _gpu()
    need = int((2 * args.gpu_gb * (0 if not gpu else 2) + 3 * args.cpu_gb) * 1e9) + (1 << 30)
    work = _workdir(need, args.workdir)
    rows, sources, ceilings, versions = [], {}, {}, _versions()
    def save() -> None:
        """The results so far (after every row: a run stopped by a timeout still leaves its rows)."""
        commit = os.environ.get("WORKBENCH_COMMIT") or subprocess.run(  # a copy without .git says its commit
            ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        result = {"schema": 1, "family": "pipeline",
                  "meta": {"gpu": gpu or f"none ({platform.processor() or platform.machine()})", "sms": sms,
                           "date": datetime.date.today().isoformat(), "commit": commit, **versions,
                           "ceilings": ceilings,
                           "method": {"what": "workbench.checkpoint.repack, one fresh process per row; source in page"
                                              " cache, outputs written but not fsync'ed (os.fsync a no-op there)",
                                      "workdir": work,
                                      "cores": len(os.sched_getaffinity(0)), "sources": sources,
                                      "tiny": bool(args.tiny), "wall_s": round(time.perf_counter() - started, 1),
                                      "us": "wall time of the whole repack call (one run)",
                                      "gpu_rows": "one process for all GPU rows (kernels compiled once before"
                                                  " timing); its peak RSS is that process's so far",
                                      "gbs": "source bytes / that time",
                                      "stage_s": "per row: each task stage's wall seconds (read = preadv of the"
                                                 " source tensors, convert, write = into the shard file at the"
                                                 " planned offsets) summed over the tasks, so up to workers x the"
                                                 " run; finish_s = the files' checksum read and rename; tail_s ="
                                                 " from the last task's result to the end",
                                      "write_mode": "how the tasks write their results: mmap = a shared mapping"
                                                    " of the range, pages populated up front (the default);"
                                                    " pwrite = positional writes (one file's writers take turns"
                                                    " on its inode lock)"},
                           "peers": {}},
                  "rows": rows}
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    try:
        cpu_src = os.path.join(work, "src-fp8-cpu")
        shapes = TINY if args.tiny else PROJECTIONS
        sources["cpu"] = write_source(cpu_src, "block-fp8", int(args.cpu_gb * 1e9), shapes=shapes)
        warm = os.path.join(work, "warm")
        write_source(warm, "block-fp8", 1, shapes=TINY)  # one small expert: compiles the kernels before timing
        first_file = os.path.join(cpu_src, sorted(f for f in os.listdir(cpu_src) if f.endswith(".safetensors"))[0])
        ceilings.update(host_ceilings(first_file, (1 << 24) if args.tiny else (1 << 28)))
        reference = {}

        def record(source, fmt, path_kind, result, info, mode=None):
            ident = reference.setdefault(source, result["shards"]) == result["shards"]
            row = {"method": "ours", "path": path_kind, "format": fmt, "workers": result["workers"],
                   "us": round(result["seconds"] * 1e6, 1), "gbs": round(result["source_bytes"] / result["seconds"]
                                                                          / 1e9, 3),
                   "startup_s": round(result["startup_seconds"], 2), "cpu_s": round(result["cpu_seconds"], 2),
                   "gbs_after_startup": round(result["source_bytes"] / max(result["seconds"]
                                                                           - result["startup_seconds"], 1e-9) / 1e9, 3),
                   "gbs_per_cpu_second": round(result["source_bytes"] / max(result["cpu_seconds"], 1e-9) / 1e9, 4),
                   "source_bytes": result["source_bytes"], "output_bytes": result["output_bytes"],
                   "baseline_rss_bytes": result["baseline_rss_bytes"], "peak_rss_bytes": result["peak_rss_bytes"],
                   "peak_worker_rss_bytes": result["peak_worker_rss_bytes"],
                   "memory_bound_bytes": result["memory_bound_bytes"],
                   "largest_tensor_bytes": info["largest_tensor_bytes"], "identical_to_first": ident}
            row["cell"] = "GPU path" if path_kind == "gpu" else "CPU path (worker processes)"
            # where the time went: each task stage's seconds summed over the tasks (over parallel workers: up to
            # workers x the wall time), the files' finishing (checksum read, fsync) and the tail after the last task
            row["write_mode"] = result.get("write_mode", "")
            row["stage_s"] = {k: round(v, 3) for k, v in result.get("stage_seconds", {}).items()}
            row["finish_s"] = round(result.get("finish_seconds", 0.0), 3)
            row["tail_s"] = round(result.get("tail_seconds", 0.0), 3)
            if mode is not None:
                threads, kind = mode.split(":")[:2]
                row["gpu_threads"] = int(threads)
                row["results"] = "host arrays" if mode.endswith(":host") else "device, into page-locked buffers"
                row["device_tasks"] = int(result.get("device_tasks", 0))
                row["streams"] = "one per thread" if kind == "own" else "one shared (the legacy default stream)"
            # the table's memory columns (the exact bytes stay in the row)
            row["peak_rss_mb"] = round(result["peak_rss_bytes"] / 2**20)
            if path_kind == "cpu":
                row["peak_worker_rss_mb"] = round(result["peak_worker_rss_bytes"] / 2**20)
            row["memory_bound_mb"] = round(result["memory_bound_bytes"] / 2**20)
            rows.append(row)
            print(json.dumps(row), flush=True)
            save()
            if not ident:
                print(f"MISMATCH: {fmt} {path_kind} {result['workers']} workers wrote other bytes than the first run",
                      flush=True)

        if gpu:
            gpu_sources = [(cpu_src, "block-fp8", sources["cpu"])]  # first: its bytes must be the CPU rows'
            for fmt in ("block-fp8", "gptq"):
                src = os.path.join(work, f"src-{fmt}-gpu")
                sources[f"gpu-{fmt}"] = write_source(src, fmt, int(args.gpu_gb * 1e9), seed=1, shapes=shapes)
                gpu_sources.append((src, fmt, sources[f"gpu-{fmt}"]))
            warm_gptq = os.path.join(work, "warm-gptq")
            write_source(warm_gptq, "gptq", 1, shapes=TINY)
            modes = [m for m in args.gpu_modes.split(",") if m]
            runs = [(modes[0], gpu_sources[0])] + [(m, g) for m in modes for g in gpu_sources[1:]]
            results = measure([(m, g[0]) for m, g in runs], os.path.join(work, "out"), "numba", 1,
                              f"{warm},{warm_gptq}", timeout=args.gpu_timeout_s, write_mode=args.gpu_write_mode)
            for (mode, (src, fmt, info)), result in zip(runs, results):
                record(src, fmt, "gpu", result, info, mode)
            for src, _, _ in gpu_sources[1:]:
                shutil.rmtree(src, ignore_errors=True)
        write_modes = [m for m in args.write_modes.split(",") if m]
        cpu_runs = [(n, write_modes[0]) for n in workers] + [(max(workers), m) for m in write_modes[1:]]
        for n, mode in cpu_runs:
            if time.perf_counter() - started > args.budget_s:
                print(f"budget reached: {n} workers ({mode}) and beyond not measured", flush=True)
                break
            (result,) = measure([cpu_src], os.path.join(work, "out"), "numpy", n, write_mode=mode)
            record(cpu_src, "block-fp8", "cpu", result, sources["cpu"])
        base = next((r["gbs"] for r in rows if r["path"] == "cpu" and r["workers"] == 1), None)
        for r in rows:
            if r["path"] == "cpu" and base:
                r["speedup_vs_1_worker"] = round(r["gbs"] / base, 2)
                r["speedup_after_startup"] = round(r["gbs_after_startup"] / base, 2)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    save()
    print(f"wrote {args.out} in {time.perf_counter() - started:.0f} s")
    return 0 if all(r["identical_to_first"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
