"""Device timing for the repack benchmarks (bench_repack.py's table and its A/B), one set-up for both.

A timed run: flush the L2 (fill a 512 MiB buffer), queue a ~200 µs sleep kernel so the host's launch overhead hides
behind it instead of landing between the events, record the start event, launch, record the end event; the result
is the median over ``reps`` runs after 3 untimed ones (and one warm launch first, which also compiles). The copy
ceiling is a ``cudaMemcpyAsync`` device-to-device copy of the same byte count, timed the same way, cached per size.
"""
from __future__ import annotations

import statistics


class DeviceTimer:
    """CUDA-event timer on one Numba stream, shared with CuPy; also hands out fresh random device inputs."""

    WARMUP = 3
    FLUSH_BYTES = 512 << 20  # larger than the H200's 50 MiB L2

    def __init__(self, reps: int):
        import cupy as cp
        from numba import cuda

        self.cp, self.cuda, self.reps = cp, cuda, reps
        dev = cuda.get_current_device()
        self.gpu = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
        self.compute_capability = list(dev.compute_capability)
        self.stream = cuda.stream()
        handle = self.stream.handle
        self.stream_ptr = handle.value if hasattr(handle, "value") else int(handle)  # ctypes or cuda-python handle
        self.cp_stream = cp.cuda.ExternalStream(self.stream_ptr)
        self._flush = cp.empty(self.FLUSH_BYTES, dtype=cp.uint8)
        self._start, self._end = cuda.event(), cuda.event()
        self._copy_seconds = {}

        @cuda.jit
        def sleep_kernel(rounds):
            for _ in range(rounds):
                cuda.nanosleep(50_000)

        self._sleep = sleep_kernel

    def timed(self, launch) -> float:
        """Median seconds of ``launch()`` (which queues its work on self.stream) over self.reps runs."""
        launch()  # compile + warm
        self.stream.synchronize()
        times = []
        for r in range(self.WARMUP + self.reps):
            with self.cp_stream:
                self._flush.fill(r & 0xFF)
            self._sleep[1, 1, self.stream](4)
            self._start.record(self.stream)
            launch()
            self._end.record(self.stream)
            self._end.synchronize()
            if r >= self.WARMUP:
                times.append(self.cuda.event_elapsed_time(self._start, self._end) * 1e-3)
        return statistics.median(times)

    def copy_seconds(self, nbytes: int) -> float:
        """Time of a device-to-device copy of ``nbytes`` (the ceiling: it reads and writes nbytes)."""
        if nbytes not in self._copy_seconds:
            cp = self.cp
            src = cp.ones(nbytes, dtype=cp.uint8)
            dst = cp.empty(nbytes, dtype=cp.uint8)
            self._copy_seconds[nbytes] = self.timed(lambda: cp.cuda.runtime.memcpyAsync(
                dst.data.ptr, src.data.ptr, nbytes, cp.cuda.runtime.memcpyDeviceToDevice, self.stream_ptr))
        return self._copy_seconds[nbytes]

    def rand_words(self, shape):
        """Fresh random uint32 words (a Numba view of a CuPy array)."""
        cp = self.cp
        return self.cuda.as_cuda_array(cp.random.randint(0, 2**32, size=shape, dtype=cp.uint64).astype(cp.uint32))

    def rand_u8(self, shape):
        cp = self.cp
        return self.cuda.as_cuda_array(cp.random.randint(0, 256, size=shape, dtype=cp.uint8))

    def rand_perms(self, experts: int, size_k: int):
        """int32 [experts, K], one random permutation of range(K) per expert."""
        cp = self.cp
        return self.cuda.as_cuda_array(cp.stack([cp.random.permutation(size_k) for _ in range(experts)])
                                       .astype(cp.int32))
