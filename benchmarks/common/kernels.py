"""Inputs and timing for the dispatch-kernel benchmarks (``bench_dispatch``, ``bench_gpu_check``): a random
routing problem with its sort, and median CUDA-event times of a call and of a device-to-device copy."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from hf_hybrid_ep.dispatch.gathers import inverse_permutation


def cuda_seconds(fn: Callable[[], object], reps: int = 20) -> float:
    """Median seconds of one call of ``fn`` on the current CUDA stream (``torch.cuda.Event`` timing, one
    warm-up call, ``reps`` timed calls each bracketed by its own events)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times) / 1e3


def routed_batch(tokens: int, hidden: int, k: int, experts: int, device: torch.device | str,
                 dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random routing problem: ``x`` [T, H] activations, ``index`` [T, k] expert ids in ``[0, E)``,
    ``weights`` [T, k] in ``[0, 1)`` (``dtype``), ``order`` [T*k] the stable expert sort of the flat pairs,
    ``position`` [T*k] its inverse, ``rows`` [T*k, H] expert outputs in destination order."""
    g = torch.Generator(device=device).manual_seed(seed)
    index = torch.randint(0, experts, (tokens, k), device=device, generator=g)
    _, order = torch.sort(index.reshape(-1), stable=True)
    position = inverse_permutation(order)
    return {
        "x": torch.randn(tokens, hidden, device=device, dtype=torch.float32, generator=g).to(dtype),
        "index": index,
        "weights": torch.rand(tokens, k, device=device, generator=g).to(dtype),
        "order": order,
        "position": position,
        "rows": torch.randn(tokens * k, hidden, device=device, dtype=torch.float32, generator=g).to(dtype),
    }


def copy_seconds(numel: int, dtype: torch.dtype, reps: int = 20) -> float:
    """Median seconds of a device-to-device copy of ``numel`` elements (reads and writes ``numel`` each)."""
    src = torch.empty(numel, device="cuda", dtype=dtype)
    dst = torch.empty_like(src)
    return cuda_seconds(lambda: dst.copy_(src), reps)
