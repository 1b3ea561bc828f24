"""Independent oracles for the tests, written from the spec's *other* descriptions of each fact (vLLM's python
table construction, ferrum-kernels' nested loops), not from workbench's maps. Tests compare workbench against these."""
import numpy as np


def vllm_style_weight_perm(bits: int) -> np.ndarray:
    """docs/formats.md "Closed form and the 1024-entry permutation": the 1024-entry table over 16×16 sub-blocks laid out one after another (row-major each)."""
    perm = []
    for i in range(32):
        col = i // 4
        entries = []
        for block in (0, 1):
            for row in (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4) + 8, 2 * (i % 4) + 9):
                entries.append(16 * row + col + 8 * block)
        for j in range(4):
            perm.extend(256 * j + e for e in entries)
    perm = np.array(perm)
    interleave = np.array([0, 2, 4, 6, 1, 3, 5, 7]) if bits == 4 else np.array([0, 2, 1, 3])
    return perm.reshape(-1, len(interleave))[:, interleave].ravel()


def vllm_style_marlin_weights(codes: np.ndarray, bits: int) -> np.ndarray:
    """docs/formats.md "Closed form and the 1024-entry permutation", steps 1-4 (reshape into sub-blocks, gather by the table, pack pf consecutive entries per word)."""
    k, n = codes.shape
    pf = 32 // bits
    t = codes.reshape(k // 16, 16, n // 16, 16).transpose(0, 2, 1, 3).reshape(k // 16, n * 16)
    t = t.reshape(-1, 1024)[:, vllm_style_weight_perm(bits)].reshape(k // 16, n * 16)
    out = np.zeros((k // 16, n * 16 // pf), dtype=np.uint32)
    for j in range(pf):
        out |= t[:, j::pf].astype(np.uint32) << np.uint32(bits * j)
    return out.view(np.int32)


def seed_nested_fp8_tiles(source: np.ndarray, k: int, n: int) -> np.ndarray:
    """ferrum-kernels' `block_fp8_direct_repack_indices_match_nested_marlin_tile_oracle` loops, over a flat [N*K] byte
    array; returns the packed bytes."""
    nested = np.zeros(n * k, dtype=np.uint8)
    for k_tile in range(k // 16):
        for n_tile in range(n // 64):
            output_base = (k_tile * (n // 64) + n_tile) * 16 * 64
            for thread in range(32):
                col = thread // 4
                row = (thread % 4) * 2
                for warp in range(4):
                    for half in range(2):
                        out = n_tile * 64 + warp * 16 + col + half * 8
                        rows = [row, row + 8, row + 1, row + 9]
                        word = thread * 8 + warp * 2 + half
                        for byte, r in enumerate(rows):
                            nested[output_base + word * 4 + byte] = source[out * k + k_tile * 16 + r]
    return nested


def seed_scale_source_index(destination: int, size_k: int, size_n: int) -> int:
    """ferrum-kernels' `block_fp8_group128_scale_source_index`, literally."""
    group_count = size_k // 128
    width = 32 if group_count == 1 else 64
    lane = destination % width
    if width == 32:
        columns = [0, 1, 8, 9, 16, 17, 24, 25]
        src = 2 * (lane // 8) + columns[lane % 8]
    else:
        src = lane // 8 + 8 * (lane % 8)
    logical = destination // width * width + src
    group, out = divmod(logical, size_n)
    return (out // 128) * group_count + group


def vllm_style_zero_points(zp: np.ndarray, bits: int) -> np.ndarray:
    """docs/formats.md "Zero points": P64 over chunks of 64, interleave within pf, then column pack."""
    p64 = np.array([i + 8 * j for i in range(8) for j in range(8)])
    interleave = np.array([0, 2, 4, 6, 1, 3, 5, 7]) if bits == 4 else np.array([0, 2, 1, 3])
    ng, n = zp.shape
    z = zp.reshape(-1, 64)[:, p64].reshape(-1, len(interleave))[:, interleave].reshape(ng, n)
    pf = 32 // bits
    out = np.zeros((ng, n // pf), dtype=np.uint32)
    for j in range(pf):
        out |= z[:, j::pf].astype(np.uint32) << np.uint32(bits * j)
    return out.view(np.int32)
