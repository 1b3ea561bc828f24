"""`workbench tour` end to end through the Numba kernels (simulator here, the GPU on a GPU machine)."""
from workbench import tour


def test_tour_through_numba_kernels_is_all_exact():
    rows = tour.run_tour(size_k=128, size_n=128, backend="numba", progress=False)
    assert all(r.backend == "numba" for r in rows)
    assert all(r.exact for r in rows), [(r.fmt, r.detail) for r in rows if not r.exact]
