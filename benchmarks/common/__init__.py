"""Code shared by several benchmarks: ``demo`` (the embedded demo's model config and data) and ``kernels``
(a random routing problem and CUDA event timing for the dispatch kernels)."""
