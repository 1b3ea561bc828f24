"""Dense GEMM partition check against a previous version of the kernels (GPU; run by the device scripts).

    python bench/partition_check.py OLD_DIR

OLD_DIR holds a previous commit's ``workbench/gemm.py`` and ``kernels_cuda/*`` (the device scripts' HEAD copies,
e.g. ``artifacts/r6_kernels_old``). The cases reach partitions tests/gpu/test_gemm.py does not (it runs on all SMs,
where small shapes give every block <= 1 step): few "SMs", so blocks straddle slices or share them (a slice summed
from up to ~8 contributors' slots), slice-aligned and striped grids, every reduction mode. Each run must be within
the fp32 bound, write all of C (poisoned beforehand), repeat bitwise, and equal OLD's output bitwise (same
configuration, same grid, so the same partition and the same fp operations in the same order: what a change that only
moves data or address arithmetic must give). Exit status 1 on any failure.

Importable: ``run(old_dir, cases=CASES) -> int`` (the number of failing runs).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load(name: str, path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def load_old_gemm(old_dir: pathlib.Path):
    """OLD's workbench/gemm.py as module ``gemm_old``, compiling OLD's kernels."""
    old = _load("gemm_old", pathlib.Path(old_dir) / "gemm.py")
    old.KERNEL_DIR = pathlib.Path(old_dir)
    old.kernel_source.cache_clear()
    return old


def cases():
    """(m, k, n, weight type, group size, activation dtype, "SMs")."""
    import ml_dtypes
    import numpy as np

    from workbench.scalar_types import ScalarType as S

    BF16 = np.dtype(ml_dtypes.bfloat16)

    return [(1, 2048, 1024, S.U4B8, 128, np.float16, 5), (1, 2048, 1024, S.U4B8, 128, BF16, 12),
            (1, 2048, 1024, S.U4B8, 128, np.float16, 16), (40, 1024, 512, S.U4, 128, np.float16, 5),
            (1, 4096, 1024, S.U4B8, 128, np.float16, 5), (16, 2048, 1024, S.U8B128, 128, np.float16, 5),
            (1, 2048, 1024, S.FE4M3FN, -1, BF16, 5), (64, 2048, 512, S.U8, 64, np.float16, 3),
            (8, 2048, 1024, S.U4, 64, BF16, 7), (5, 1024, 1024, S.U8B128, 128, np.float16, 4),
            (12, 2048, 1024, S.U4B8, 128, np.float16, 5), (3, 1024, 512, S.U4, 32, np.float16, 6),
            (33, 1024, 1024, S.U4B8, 128, BF16, 5), (80, 1024, 512, S.FE4M3FN, -1, np.float16, 4),
            # 64-row tiles of 256 columns: the last slice's warp fold split over the k groups, beside
            # earlier slices folded whole
            (64, 2048, 1024, S.U4B8, 128, np.float16, 5), (64, 1024, 2048, S.U4B8, 128, BF16, 16),
            (128, 1024, 1024, S.U4, 128, np.float16, 7), (256, 1024, 512, S.FE4M3FN, -1, np.float16, 6),
            # the remaining M of the GEMM bench (2, 4, 32; 128 and 256 with the other weight types)
            (2, 2048, 1024, S.U4B8, 128, np.float16, 5), (4, 1024, 1024, S.U8B128, 128, BF16, 6),
            (32, 2048, 1024, S.FE4M3FN, -1, np.float16, 5), (32, 1024, 512, S.U4, 128, BF16, 3),
            (128, 2048, 1024, S.U4B8, 128, BF16, 5), (256, 1024, 1024, S.U8B128, 128, np.float16, 7)]


def run(old_dir, case_list=None) -> int:
    import cupy as cp
    import numpy as np

    sys.path.insert(0, str(ROOT))
    tg = _load("tg", ROOT / "tests" / "gpu" / "test_gemm.py")
    old = load_old_gemm(old_dir)
    from workbench import gemm
    from workbench.policy import DEFAULT_GEMM_POLICY
    from workbench.weight import random_marlin_weight

    case_list = cases() if case_list is None else case_list
    old_policies = hasattr(old, "_default")  # OLD takes policy= (else its module switches are set)
    old_rows_wide = old._default().rows_wide_first if old_policies else getattr(old, "ROWS_WIDE_FIRST", False)
    # The tiles and grids without the pair policy, in both versions (its choices are checked against the reference by
    # tests/gpu; left on in OLD alone, OLD's launches took its pairs where the configurations compared below are
    # without); slices with two blocks each are still summed in clusters on sm_90. And a tile rule newer than OLD
    # only where OLD has it (rows_wide_first).
    policies = {align: dataclasses.replace(DEFAULT_GEMM_POLICY, pair_clusters=False, rows_wide_first=old_rows_wide,
                                           align_slices=align) for align in (True, False)}

    def old_kw(align: bool) -> dict:
        if old_policies:
            return {"policy": policies[align]}
        if (old.PAIR_CLUSTERS, old.ALIGN_SLICES) != (False, align):  # (a tree before policies: its switches, and
            old.PAIR_CLUSTERS, old.ALIGN_SLICES = False, align  # its plans, which do not key on them, forgotten)
            old._array_plans.clear()
            old._prepared.clear()
        return {}

    _, _, smem_limit, sm_smem = gemm.device_properties(0)
    cfgs = {name: [mod.choose_config(gemm.act_scalar_type(act), wt, m, n, k, gs, False, smem_limit, sm_smem=sm_smem,
                                     sms=sms, **kw) for m, k, n, wt, gs, act, sms in case_list]
            for name, mod, kw in (("new", gemm, {"policy": policies[True]}), ("old", old, old_kw(True)))}
    # the same kernel configuration and grid as OLD, so the same partition (compared by the fields that set the tile
    # geometry and the loop: template arguments that no longer exist may differ)
    fields = ("m_blocks", "n_tiles", "k_warp", "stages", "group_mode", "blocks_per_sm", "swap")
    assert ([tuple(getattr(c, f) for f in fields) for c in cfgs["new"]]
            == [tuple(getattr(c, f) for f in fields) for c in cfgs["old"]]), cfgs
    assert all(gemm.grid_blocks(a, m, n, k, sms, policy=policies[True]) == old.grid_blocks(b, m, n, k, sms,
                                                                                          **old_kw(True))
               for (m, k, n, wt, gs, act, sms), a, b in zip(case_list, cfgs["new"], cfgs["old"]))
    gemm.precompile(cfgs["new"], workers=8)
    old.precompile(cfgs["old"], workers=8)
    rng = np.random.default_rng()

    def old_run(a, w, mode, sms, align):
        c = tg.poisoned(a.shape[0], w.size_n, a.dtype)
        return cp.asnumpy(old.marlin_gemm(cp.asarray(a), w, c=c, sms=sms, **tg.MODES[mode],
                                          **old_kw(align))).astype(np.float32)

    failures = 0
    same_by_swap = {}
    for (m, k, n, wt, gs, act, sms), cfg in zip(case_list, cfgs["new"]):
        mw, q = random_marlin_weight(k, n, wt, gs, act_dtype=act, seed=int(rng.integers(1 << 30)))
        w = gemm.upload_weight(mw)
        a = rng.standard_normal((m, k), dtype=np.float32).astype(act)
        ref = a.astype(np.float32) @ q.w_ref
        for mode in ("fp32", "deterministic", "in_c"):
            for align in (True, False):
                out = tg.run(a, w, mode, sms=sms, policy=policies[align])  # poisoned C, locks left zero
                again = tg.run(a, w, mode, sms=sms, policy=policies[align])
                # fp32 accumulation in a different order than NumPy's: tests/gpu's bound for the mode
                excess = float((np.abs(out - ref) - tg.error_bound(a, q.w_ref, act, mode, k)).max())
                same = np.array_equal(out, old_run(a, w, mode, sms, align))
                same_by_swap.setdefault(cfg.swap, []).append(same)
                if not (np.all(np.isfinite(out)) and excess <= 0 and np.array_equal(out, again) and same):
                    failures += 1
                    print(f"FAIL m={m} k={k} n={n} {wt} {np.dtype(act)} sms={sms} {mode} align={align}: "
                          f"excess {excess:.3g}, bitwise = old: {same}, repeatable: {np.array_equal(out, again)}")
        print(f"checked m={m} k={k} n={n} {wt} {np.dtype(act)} sms={sms} grid "
              f"{gemm.grid_blocks(cfg, m, n, k, sms, policy=policies[True])} "
              f"{cfg.name_expression}")
    for sw, flags in sorted(same_by_swap.items()):
        print(f"{'swapped' if sw else 'unswapped'} loop: bitwise = old in {sum(flags)} of {len(flags)} runs")
    print("partition check:", "PASS" if failures == 0 else f"{failures} FAILURES")
    return failures


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(1 if run(pathlib.Path(sys.argv[1])) else 0)
