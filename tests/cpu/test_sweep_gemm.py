"""bench/sweep_gemm.py without a GPU: the forced-configuration hook of the launch path (``prepare_launch(record,
config=, grid=)``) on the stand-in driver of tests/fake_device.py, the sweep's candidate sets (every candidate is
one the hook accepts, today's choice is in every set), and the JSON / table writer."""
import dataclasses
import json
import pathlib
import sys

import numpy as np
import pytest

from fake_device import PLAIN_GEMM_POLICY, PROPS, SMS, FakeArray, default_policies, installed
from workbench import gemm, gemm_abi
from workbench.scalar_types import ScalarType as S

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import sweep_gemm  # noqa: E402

_, _, SMEM_LIMIT, SM_SMEM = PROPS


NO_PAIRS = dataclasses.replace(PLAIN_GEMM_POLICY, pair_clusters=False)


@pytest.fixture
def fake():
    with installed() as (cupy, driver), default_policies(NO_PAIRS):
        yield cupy, driver


@pytest.fixture(autouse=True)
def no_pair_policy():
    """The forced-configuration tests start from the two-block / (2, 4)-tile defaults of the policy without pairs
    (tests/cpu/test_gemm_policy.py pins the pair choices); the sweep's own default is the calls' default policy."""
    with default_policies(NO_PAIRS):
        yield


def record(m=1, k=4096, n=4096, wt=S.U4B8, group=128, act=S.F16):
    ng = 1 if group == -1 else k // group
    arrays = [FakeArray(s, np.int32) for s in ((m, k), (k // 16, n * 16 // wt.pack_factor), (m, n),
                                               (gemm.c_tmp_numel(SMS),), (ng, n), (gemm.workspace_numel(SMS),))]
    a, b, c, c_tmp, scales, work = (x.data.ptr for x in arrays)
    return gemm_abi.MarlinMmRequest(
        weight_type=wt, act_type=act,
        buffers=gemm_abi.MarlinMmBuffers(a=a, b=b, c=c, c_tmp=c_tmp, b_scales=scales, workspace=work),
        problem=gemm_abi.MarlinMmProblem(m=m, n=n, k=k, lda=k, num_groups=ng, group_size=group),
        execution=gemm_abi.MarlinMmExecution(sms=SMS)).into_launch()


def launch_of(prepared, driver):
    """Launch a prepared plan on dummy addresses; (grid, smem, function) of what reached cuLaunchKernel."""
    prepared.launch(1 << 32, 2 << 32, 3 << 32, 4 << 32, 5 << 32, 0, 0, 0, 0, 6 << 32, 0)
    f, grid, _, smem, _, _ = driver.launches[-1]
    return grid[0], smem, f


def test_forced_config_and_grid_reach_the_launch_and_are_not_cached(fake):
    _, driver = fake
    rec = record()
    default = gemm.prepare_launch(rec)
    assert len(gemm.launch._prepared) == 1
    cfg = dataclasses.replace(default.cfg, n_tiles=1, k_warp=1, stages=6, blocks_per_sm=1, cluster=1)
    forced = gemm.prepare_launch(rec, config=cfg, grid=77)
    assert forced.cfg == cfg and forced is not default
    grid, smem, f = launch_of(forced, driver)
    assert (grid, smem) == (77, cfg.smem_bytes)
    # the kernel's division plan is the forced grid's: steps = q 77 + r
    steps = -(-rec.prob_m // cfg.block_m) * (rec.prob_n // cfg.block_n) * (rec.prob_k // cfg.block_k)
    assert driver.launches[-1][5][14:18] == (steps // 77, steps % 77, *gemm.fast_div_plan(77))
    assert gemm.prepare_launch(rec) is default, "the forced plan must not replace the cached automatic one"
    assert len(gemm.launch._prepared) == 1
    grid_d, smem_d, f_d = launch_of(default, driver)
    assert (grid_d, smem_d) == (default.grid, default.cfg.smem_bytes) and f_d != f


def test_forced_grid_alone_keeps_the_configuration(fake):
    _, driver = fake
    rec = record(m=8, k=8192, n=8192)
    default = gemm.prepare_launch(rec)
    forced = gemm.prepare_launch(rec, grid=SMS)
    assert default.cfg.cluster == 2, "8192^2 M = 8: two blocks per slice on the aligned grid, one cluster each"
    assert forced.cfg == dataclasses.replace(default.cfg, cluster=1) and default.grid != SMS
    assert launch_of(forced, driver)[:2] == (SMS, default.cfg.smem_bytes)


def test_forced_grid_reaches_a_programmatic_launch_when_fewer_blocks_are_resident(fake, monkeypatch):
    """A plan for two blocks per SM on a device that keeps one: PreparedLaunch shrinks its grid, and a forced grid
    (all resident) must still be the one cuLaunchKernelEx gets, not the shrunk grid its configuration was built with."""
    _, driver = fake
    programmatic = dataclasses.replace(NO_PAIRS, programmatic_launch=True)
    monkeypatch.setattr(gemm.kernels, "device_properties", lambda device: (90,) + PROPS[1:])
    monkeypatch.setattr(gemm.kernels, "pin_occupancy_of", lambda kernel, device, smem, blocks_per_sm: smem)
    monkeypatch.setattr(gemm.kernels, "resident_blocks", lambda name, device: 1)
    rec = record()
    cfg = dataclasses.replace(gemm.prepare_launch(rec, policy=programmatic).cfg, n_tiles=1, k_warp=2, stages=3,
                              blocks_per_sm=2, cluster=1)
    forced = gemm.prepare_launch(rec, config=cfg, grid=77, policy=programmatic)
    assert forced.programmatic
    forced.launch(1 << 32, 2 << 32, 3 << 32, 4 << 32, 5 << 32, 0, 0, 0, 0, 6 << 32, 0)
    assert driver.programmatic[-1] == len(driver.launches) - 1 and driver.launches[-1][1][0] == 77


def test_forced_config_alone_takes_the_policy_grid(fake):
    rec = record()
    cfg = dataclasses.replace(gemm.prepare_launch(rec).cfg, n_tiles=4, k_warp=2, cluster=1)
    assert gemm.prepare_launch(rec, config=cfg).grid == gemm.grid_blocks(cfg, 1, 4096, 4096, SMS)


@pytest.mark.parametrize("change,message", [
    (dict(weight=S.U8B128), "does not match the problem's"),
    (dict(group_mode=gemm.GROUP_CHANNELWISE), "does not match the problem's"),
    (dict(n_tiles=3), "is not a kernel shape"),
    (dict(m_blocks=5), "is not a kernel shape"),
    (dict(blocks_per_sm=2, m_blocks=2), "blocks_per_sm = 2 with m_blocks = 2"),
    (dict(blocks_per_sm=3), "blocks_per_sm = 3"),
    (dict(swap=True, m_blocks=2), "swap = True needs m_blocks = 1"),
    (dict(stages=40), "bytes of shared memory"),
    (dict(blocks_per_sm=2, stages=8), "2 block(s) per SM leave"),
])
def test_forced_config_that_cannot_compute_the_problem_is_refused(fake, change, message):
    rec = record()
    cfg = dataclasses.replace(gemm.prepare_launch(rec).cfg, cluster=1, **change)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        gemm.prepare_launch(rec, config=cfg, grid=64)


def test_forced_swap_needs_at_most_8_rows_per_half(fake):
    rec = record(m=9)
    cfg = gemm.prepare_launch(rec).cfg
    assert cfg.swap == gemm.swap_halves(9)
    with pytest.raises(ValueError, match=r"swap = True needs m_blocks = 1 and size_m <= 8 \(got 1, 9\)"):
        gemm.prepare_launch(rec, config=dataclasses.replace(cfg, swap=True))
    with pytest.raises(ValueError, match=r"swap = 2 is not 0 or 1"):  # (the 16-row form is gone)
        gemm.prepare_launch(rec, config=dataclasses.replace(cfg, swap=2))


def test_forced_tile_must_divide_the_problem_and_the_group(fake):
    rec = record(k=4096 + 128, n=4096 + 64)
    cfg = gemm.prepare_launch(rec).cfg
    with pytest.raises(ValueError, match=r"\(thread_k, thread_n\) = \(256, 128\) does not divide"):
        gemm.prepare_launch(rec, config=dataclasses.replace(cfg, n_tiles=2, k_warp=4))
    rec32 = record(group=32)
    cfg32 = gemm.prepare_launch(rec32).cfg
    assert cfg32.block_k % 32 == 0  # 32 divides every thread_k: accepted
    gemm.prepare_launch(rec32, config=dataclasses.replace(cfg32, n_tiles=2, k_warp=4, cluster=1))


@pytest.mark.parametrize("grid", [0, -1, 2 * SMS + 1, 1.5, True, "64"])
def test_forced_grid_outside_what_can_be_resident_is_refused(fake, grid):
    rec = record()
    with pytest.raises(ValueError, match=r"grid = .* must be an int in \[1, "):
        gemm.prepare_launch(rec, grid=grid)


def test_forced_grid_needs_every_block_resident(fake, monkeypatch):
    # (since round 18 M = 16 takes one block of 512 x 128 here)
    p = dataclasses.replace(NO_PAIRS, rows_wide_first=False)
    rec = record(m=16, k=8192, n=8192)  # a two-block default
    default = gemm.prepare_launch(rec, policy=p)
    assert default.cfg.blocks_per_sm == 2
    monkeypatch.setattr(gemm.kernels, "resident_blocks", lambda name, device: 1)
    cfg = dataclasses.replace(default.cfg, cluster=1)
    with pytest.raises(ValueError, match="cannot all be resident"):
        gemm.prepare_launch(rec, config=cfg, grid=SMS + 1, policy=p)
    assert gemm.prepare_launch(rec, config=cfg, grid=SMS, policy=p).grid == SMS


def test_forced_path_still_runs_every_record_check(fake):
    rec = record()
    rec.prob_k = 4096 + 8
    with pytest.raises(ValueError, match="not divisible by tile_size"):
        gemm.prepare_launch(rec, grid=64)
    with pytest.raises(TypeError, match="KernelConfig"):
        gemm.prepare_launch(record(), config=(2, 4, 8))


# ---- the sweep's candidate sets -----------------------------------------------------------------------------------
def test_cells_cover_the_brief_in_order_of_importance():
    cells = sweep_gemm.CELLS
    assert [c.label for c in cells[:2]] == ["u4b8 g128 fp16 4096x4096 M=1", "u4b8 g128 fp16 8192x8192 M=1"]
    assert cells[2].weight is S.FE4M3FN
    want = {(S.U4B8, 128, k, n, m) for m in (1, 2, 8, 16)
            for k, n in ((4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192))}
    want |= {(wt, gs, k, n, m) for wt, gs in ((S.FE4M3FN, -1), (S.U8B128, 128)) for m in (1, 16)
             for k, n in ((8192, 8192), (8192, 28672))}
    large = {(S.U4B8, 128, k, n, m) for m in (1, 16) for k, n in ((8192, 28672), (28672, 8192))}
    want |= large  # added after HEAD's run (round 6, "policy"): after the first 24 cells, which keep their indices
    fp8_narrow = {(S.FE4M3FN, -1, k, n, 1) for k, n in ((4096, 4096), (4096, 14336), (14336, 4096))}
    want |= fp8_narrow  # added in round 10
    fp8_m16 = (S.FE4M3FN, -1, 4096, 14336, 16)
    want.add(fp8_m16)  # added in round 12
    large_m = {(S.U4B8, 128, k, n, m) for m in (32, 64)
               for k, n in ((4096, 4096), (14336, 4096), (8192, 8192), (4096, 14336))}
    want |= large_m  # added in round 18, last
    key = [(c.weight, c.group_size, c.k, c.n, c.m) for c in cells]
    assert set(key[-16:-12]) == large
    assert set(key[-12:-9]) == fp8_narrow
    assert key[-9] == fp8_m16
    assert set(key[-8:]) == large_m
    assert {(c.weight, c.group_size, c.k, c.n, c.m) for c in cells} == want and len(cells) == len(want)
    assert all(c.act == "float16" for c in cells)


@pytest.mark.parametrize("cell", sweep_gemm.CELLS, ids=lambda c: c.label)
def test_every_candidate_is_accepted_by_the_launch_hook(fake, cell):
    _, driver = fake
    cands = sweep_gemm.candidates(cell, SMS, SMEM_LIMIT, SM_SMEM)
    default = cands[0]
    assert default.is_default and sum(c.is_default for c in cands) == 1
    rec = record(m=cell.m, k=cell.k, n=cell.n, wt=cell.weight, group=cell.group_size)
    auto = gemm.prepare_launch(rec)
    assert (default.cfg, default.grid) == (auto.cfg, auto.grid), "the sweep's default is what the library runs"
    assert len({(c.cfg.name_expression, c.grid) for c in cands}) == len(cands), "no candidate twice"
    for cand in cands:
        prepared = gemm.prepare_launch(rec, config=cand.cfg, grid=cand.grid)
        assert launch_of(prepared, driver)[:2] == (cand.grid, cand.cfg.smem_bytes)
        assert cand.grid <= SMS * cand.cfg.blocks_per_sm
    variants = {c.variant for c in cands}
    assert ("swap-flip" in variants) == (cell.m <= 8)
    # every thread shape that divides the problem and fits shared memory with the fewest stages the sweep tries (the
    # 512 x 128 tile's 8-bit stages do not fit), one and two blocks per SM
    m_blocks = min(4, -(-cell.m // 16))
    fewest = min(sweep_gemm.ONE_BLOCK_STAGES if m_blocks <= 2 else sweep_gemm.LARGE_M_STAGES)

    def fits(n_tiles, k_warp):
        cfg = gemm.KernelConfig(S.F16, cell.weight, m_blocks, n_tiles, k_warp, fewest, cands[0].cfg.group_mode)
        return cfg.smem_bytes <= SMEM_LIMIT

    shapes = {(c.cfg.block_k, c.cfg.block_n) for c in cands}
    assert shapes == {(tk, tn) for shape, (tk, tn) in gemm.thread_shapes().items()
                      if cell.k % tk == 0 and cell.n % tn == 0 and fits(*shape)}
    assert {c.cfg.blocks_per_sm for c in cands} == ({1, 2} if m_blocks == 1 else {1})  # (two: 16-row tiles only)


def test_grid_options_include_the_striped_aligned_and_smaller_grids():
    cell = sweep_gemm.CELLS[0]  # 4096 x 4096, M = 1
    cfg = sweep_gemm.default_config(cell, SMS, SMEM_LIMIT, SM_SMEM)
    slices, ki, total = sweep_gemm.geometry(cfg, 1, 4096, 4096)
    options = dict((kinds[0], g) for g, kinds in sweep_gemm.grid_options(cfg, 1, 4096, 4096, SMS))
    assert options["policy"] == gemm.grid_blocks(cfg, 1, 4096, 4096, SMS)
    assert options["striped"] == min(total, SMS * cfg.blocks_per_sm)
    assert options["aligned-half"] < options["policy"] and options["aligned-half"] % slices == 0
    two = dataclasses.replace(cfg, blocks_per_sm=2, stages=3)
    kinds = {k for _, ks in sweep_gemm.grid_options(two, 1, 4096, 4096, SMS) for k in ks}
    assert {"striped", "striped-1x"} <= kinds


# ---- results ------------------------------------------------------------------------------------------------------
def fake_result(cell, rng):
    cands = sweep_gemm.candidates(cell, SMS, SMEM_LIMIT, SM_SMEM)
    rows = []
    for i, cand in enumerate(cands):
        row = sweep_gemm.candidate_row(cand, cell)
        if i == 3:
            row.update(ok=False, excess_over_bound=1.0)  # a wrong candidate, fastest of all: must not be ranked
            row["us"] = 0.1
        elif i == 4:
            row["error"] = "refused: test"
        else:
            us = float(rng.uniform(5, 50))
            row.update(ok=True, us=us, pct_copy=40.0)
        rows.append(row)
    return dict(label=cell.label, default_config=rows[0]["config"], default_grid=rows[0]["grid"],
                default_us=rows[0]["us"], default_us_first=rows[0]["us"], default_us_last=rows[0]["us"] * 1.01,
                complete=True, candidates=rows)


def test_results_are_ranked_correct_only_and_written_whole(tmp_path):
    rng = np.random.default_rng()
    results = [fake_result(c, rng) for c in sweep_gemm.CELLS[:2]]
    meta = dict(gpu="fake", sms=SMS, date="today", commit="x", copy_gbs=4000.0, stopped="done")
    sweep_gemm.write_results(tmp_path, "fake", meta, results)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep_fake.json", "sweep_fake.md"]  # no .tmp left
    data = json.loads((tmp_path / "sweep_fake.json").read_text())
    assert data["meta"]["stopped"] == "done" and len(data["cells"]) == 2
    for res in results:
        ranked = sweep_gemm.rank_rows(res["candidates"])
        assert all(r["ok"] for r in ranked) and [r["us"] for r in ranked] == sorted(r["us"] for r in ranked)
        assert len(ranked) == len(res["candidates"]) - 2
        table = sweep_gemm.cell_table(res)
        assert "1 WRONG" in table and f"{ranked[0]['us']:.2f}" in table
        assert "(default)" in table  # the default row is always shown
    md = (tmp_path / "sweep_fake.md").read_text()
    summary = sweep_gemm.summary_table(results)
    assert summary in md
    best = sweep_gemm.rank_rows(results[0]["candidates"])[0]
    assert f"{best['us'] / results[0]['default_us']:.3f}" in summary.splitlines()[2]


def test_list_mode_needs_no_gpu(capsys):
    assert sweep_gemm.main(["--list", "--cells", "0,2"]) == 0
    out = capsys.readouterr().out
    assert "2 cells" in out and "u4b8 g128 fp16 4096x4096 M=1" in out


def test_clusters_that_cannot_all_be_resident_fall_back_to_the_global_sum(fake, monkeypatch):
    """A grid of more clusters than the device keeps resident at once would run some in a second wave: the plan keeps
    its grid and sums in global memory instead (gemm.resident_clusters; the query itself needs a GPU)."""
    _, driver = fake
    rec = record(m=8, k=8192, n=8192)
    assert gemm.prepare_launch(rec).cfg.cluster == 2  # 64 slices x 2
    gemm.launch._prepared.clear()
    monkeypatch.setattr(gemm.kernels, "resident_clusters", lambda cfg, device, grid: grid // cfg.cluster - 1)
    plan = gemm.prepare_launch(rec)
    assert plan.cfg.cluster == 1 and plan.grid == 128
    assert "marlin_gemm_cluster" not in plan.cfg.name_expression
    assert launch_of(plan, driver)[:2] == (128, plan.cfg.smem_bytes)


def test_two_block_pairs_reach_the_plan_and_keep_their_partition_without_cluster_sums(fake, monkeypatch):
    """choose_config returns a two-block pair with cluster = 2 (u4b8 4096 x 14336 at M <= 8 on sm_90): the plan gives
    each of the 112 slices two blocks in clusters of two; with the cluster sums switched off the same grid runs the
    plain kernel (global sums), never a cluster kernel whose blocks the grid does not pair."""
    _, driver = fake
    pairs = dataclasses.replace(NO_PAIRS, pair_clusters=True)
    rec = record(m=4, k=4096, n=14336)
    plan = gemm.prepare_launch(rec, policy=pairs)
    assert (plan.cfg.blocks_per_sm, plan.cfg.cluster, plan.grid) == (2, 2, 224)
    assert "marlin_gemm_cluster" in plan.cfg.name_expression
    plan = gemm.prepare_launch(rec, policy=dataclasses.replace(pairs, cluster_sums=False))
    assert (plan.cfg.blocks_per_sm, plan.cfg.cluster, plan.grid) == (2, 1, 224)
    assert "marlin_gemm_cluster" not in plan.cfg.name_expression
    assert launch_of(plan, driver)[0] == 224
