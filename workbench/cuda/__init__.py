"""The one runtime under the native kernels (``workbench.gemm``, ``workbench.moe``, and the Numba kernels of
``kernels_numba``, compiled by Numba and launched here: ``kernels_numba._launch``): arrays and streams from any
framework, one compile path, one argument-block builder, one launch call.

* ``arrays``: device pointers of CuPy, PyTorch and Numba arrays (``__cuda_array_interface__``, torch's own
  accessors), which framework an array belongs to, and allocation from that framework's pool.
* ``streams``: a raw stream handle from an int, a CuPy / Numba / PyTorch stream or any ``__cuda_stream__`` object;
  ``None`` is the current stream of the framework the inputs came from.
* ``compile``: a kernel source with its local headers inlined, compiled once per process and device (NVRTC through
  CuPy; the compiled cubins live in CuPy's on-disk kernel cache, ``CUPY_CACHE_DIR``, keyed by source, NVRTC
  version, options and architecture).
* ``launch``: ``ArgBlock`` (a kernel's parameters as one reusable block) and ``Launch`` (a prepared launch whose
  programmatic-dependent and cluster forms are attributes), launched through ``cuda.bindings``'s cuLaunchKernelEx.

Nothing here imports CuPy, PyTorch or the CUDA bindings before a call needs them: ``import workbench`` works on a
machine without any of them.
"""
from workbench.cuda.arrays import (DeviceArray, as_device_array, cupy, cupy_array_type, device_pointer,
                                   framework_of, torch_tensor_type)
from workbench.cuda.compile import KernelModule, inline_includes
from workbench.cuda.launch import ArgBlock, Launch, launch_kernel
from workbench.cuda.streams import cupy_stream, stream_handle

__all__ = ["ArgBlock", "DeviceArray", "KernelModule", "Launch", "as_device_array", "cupy", "cupy_array_type",
           "cupy_stream", "device_pointer", "framework_of", "inline_includes", "launch_kernel", "stream_handle",
           "torch_tensor_type"]
