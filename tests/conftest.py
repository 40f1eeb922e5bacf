"""Shared fixtures: one pool of gloo worker processes per world size, reused by every test."""

from __future__ import annotations

import os
import sys

# Triton reads TRITON_INTERPRET when it is first imported, which may be while another test module is
# collected: set it for the whole session (CPU only; it affects nothing but Triton kernels).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

from worker_pool import WorkerPool  # noqa: E402


class _Pools:
    def __init__(self) -> None:
        self._pools: dict[int, WorkerPool] = {}

    def __call__(self, world_size: int) -> WorkerPool:
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            pool = WorkerPool(world_size)
            self._pools[world_size] = pool
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()


@pytest.fixture(autouse=True)
def _parity_case_name(request):
    """Tell the parity criterion which test it is checking (for HEP_PARITY_FIGURES)."""
    import parity

    parity.CURRENT_CASE = request.node.nodeid
    yield


@pytest.fixture(scope="session")
def pools():
    """``pools(W)`` → a live :class:`WorkerPool` of ``W`` ranks (created once per session)."""
    p = _Pools()
    yield p
    p.close()
