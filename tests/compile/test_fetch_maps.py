"""The main loop's copy and read positions (kernels_cuda/marlin_mainloop.cuh, marlin_gemm.cu, marlin_moe.cu) are
the ones of the straightforward enumeration, so the shared memory a stage holds is unchanged bit for bit. Needs no
GPU: a host program built with nvcc checks WeightFetch's own constexpr functions; the A-side identities are checked
here over every geometry the kernels instantiate.
"""
import pathlib
import shutil
import subprocess

import pytest

from workbench import gemm

DATA = pathlib.Path(__file__).parent / "data"
THREADS = 256


def a_index(r: int, c: int, bk: int) -> int:
    """Geometry::a_index: chunk c of stage row r, swizzled by r % 8 (int4 units)."""
    return r * (bk // 8) + (c ^ (r % 8))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_weight_fetch_covers_every_b_int4_at_heads_position(tmp_path):
    exe = tmp_path / "fetch_maps"
    subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-I", str(gemm.KERNEL_DIR), "-o", str(exe),
                    str(DATA / "fetch_maps.cu")], check=True, capture_output=True, text=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(": ok") == 28, run.stdout


@pytest.mark.parametrize("n_tiles,k_warp", sorted(gemm.thread_shapes()))
@pytest.mark.parametrize("m_blocks", [1, 2, 3, 4])
def test_a_fetch_copies_share_one_swizzle(m_blocks, n_tiles, k_warp):
    """Thread t's A copy n goes to a_index(t // row + n * rows_per_pass, t % row) = copy 0's + n * 256 (the kernels
    add 16 * n * kThreads bytes) — with 4 rows per pass (BK = 512), odd copies: copy 1's + (n - 1) * 256 (the
    kernel's a_dst_odd) — and the copies of all threads cover the stage exactly once."""
    bk = 16 * k_warp * (8 // n_tiles)
    row = bk // 8
    rows_per_pass = THREADS // row
    a_i4 = 16 * m_blocks * bk // 8
    seen = []
    for t in range(THREADS):
        for n in range(-(-a_i4 // THREADS)):
            i = t + n * THREADS
            if i >= a_i4:
                continue
            r, c = t // row + n * rows_per_pass, t % row
            assert (r, c) == (i // row, i % row)
            if rows_per_pass % 8 == 0 or n % 2 == 0:
                assert a_index(r, c, bk) == a_index(t // row, c, bk) + n * THREADS
            else:
                assert rows_per_pass == 4, rows_per_pass
                assert a_index(r, c, bk) == a_index(t // row + rows_per_pass, c, bk) + (n - 1) * THREADS
            seen.append(a_index(r, c, bk))
    assert sorted(seen) == list(range(a_i4))


@pytest.mark.parametrize("n_tiles,k_warp", sorted(gemm.thread_shapes()))
@pytest.mark.parametrize("swap", [0, 1])
def test_ldmatrix_address_of_tile_i_is_tile_0_xor_32i(n_tiles, k_warp, swap):
    """WarpLoop::compute_stage reads tile i of a warp's K_WARP tiles at (byte offset of tile 0) ^ (32 i)."""
    bk = 16 * k_warp * (8 // n_tiles)
    for kg in range(8 // n_tiles):
        kt0 = kg * k_warp
        for lane in range(32):
            # (the swapped loop's ldmatrix.x2 ignores the addresses of lanes 16..31)
            r, b = (lane % 8, (lane // 8) % 2) if swap else (lane % 16, lane // 16)
            base = 16 * a_index(r, 2 * kt0 + b, bk)
            for i in range(k_warp):
                assert base ^ (32 * i) == 16 * a_index(r, 2 * (kt0 + i) + b, bk), (kg, lane, i)


@pytest.mark.parametrize("n_tiles", [1, 2])
@pytest.mark.parametrize("k_warp", [2, 4])
@pytest.mark.parametrize("swap", [0, 1])
@pytest.mark.parametrize("prob_m", [1, 5, 8, 9, 16])
def test_per_warp_a_copies_are_what_the_group_reads(n_tiles, k_warp, swap, prob_m):
    """marlin_gemm.cu's kWarpFetch (one or two 64-column tiles, one m16 block): thread g of a k group's 32 N_TILES
    copies n = chunk j = i % (2 K_WARP) of row i / (2 K_WARP), i = g + 32 N_TILES n, of the group's k range (chunk
    2 kt0 + j). With one chunk, the copies a group issues are exactly the rows < prob_m its warps read (rows 0..7
    swapped with one half, else 0..15) at its chunks 2 kt0 .. 2 kt0 + 2 K_WARP - 1 (what their ldmatrix addresses
    cover: the test above), each once; the rows read beyond prob_m are the ones zeroed before the loop; no two groups
    write one position."""
    if swap == 1 and prob_m > 8:
        pytest.skip("one half covers 8 rows")
    bk = 16 * k_warp * (8 // n_tiles)
    group = 32 * n_tiles
    chunks_per_row = 2 * k_warp
    rows_read = 8 if swap == 1 else 16
    copies = -(-rows_read * chunks_per_row // group)
    written = {}
    for kg in range(8 // n_tiles):
        issued = []
        for g in range(group):
            for n in range(copies):
                i = g + group * n
                r, c = i // chunks_per_row, 2 * k_warp * kg + i % chunks_per_row
                if i < rows_read * chunks_per_row and r < prob_m:
                    issued.append((r, c))
                    dst = a_index(r, c, bk)
                    assert dst not in written, (kg, r, c)
                    written[dst] = kg
        reads = [(r, 2 * k_warp * kg + j) for r in range(rows_read) for j in range(chunks_per_row)]
        assert sorted(issued) == sorted(rc for rc in reads if rc[0] < prob_m)
    assert all(0 <= d < 16 * bk // 8 for d in written)
