"""One rank of the fault drills of tests/test_fault_drills.py, started as a bare process (the way srun starts
ranks: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment; rank 0 hosts the c10d store).

    python tests/fault_worker.py TIMEOUT_S STEPS [STOP_RANK STOP_STEP]
    python tests/fault_worker.py async TIMEOUT_S STOP_RANK

The first trains a tiny Qwen3-MoE at dp 2 × ep 2 with ``collective_timeout_s=TIMEOUT_S`` and prints ``step N`` after
every optimizer step (flushed); with ``STOP_RANK``, that rank stops itself (``SIGSTOP``) at step ``STOP_STEP`` after
its backward, before the gradient norm's all-reduce over the world, printing ``stopping`` first.

The second is what NCCL does to the host: every rank launches a token exchange asynchronously and waits for it
later; ``STOP_RANK`` stops itself before launching it. Meanwhile ranks 0 and 1 wait in another collective of the
package over ranks [0, 1, 2], and rank 3 in a collective the package does not see (a barrier over ranks [2, 3],
as a read of a result such as ``loss.item()`` waits under NCCL). The groups' own timeouts are long: the watchdog
alone ends the ranks.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

import hf_hybrid_ep as hep  # noqa: E402


def _stop_here() -> None:
    print("stopping", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)


def main(timeout_s: float, steps: int, stop: tuple[int, int] | None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    from tiny_models import build_tiny_model

    torch.manual_seed(0)
    model = build_tiny_model("qwen3_moe", num_experts=4)
    model.train()
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=2, ep_degree=2, collective_timeout_s=timeout_s))
    optimizer = hep.make_optimizer(model, torch.optim.AdamW, model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for step in range(1, steps + 1):
        ids = torch.randint(3, 100, (2, 16), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        if stop == (dist.get_rank(), step):
            _stop_here()
        hep.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        hep.after_optimizer_step(model)
        print(f"step {step}", flush=True)
    dist.destroy_process_group()


def exchange_later(timeout_s: float, stop_rank: int) -> None:
    from hf_hybrid_ep.dispatch.alltoall import all_to_all_async
    from hf_hybrid_ep.parallel import watchdog

    long = datetime.timedelta(seconds=600)
    dist.init_process_group("gloo", timeout=long)
    rank, world = dist.get_rank(), dist.get_world_size()
    others = dist.new_group([0, 1, 2], timeout=long)
    pair = dist.new_group([2, 3], timeout=long)
    watchdog.start(timeout_s)
    splits = [1] * world
    for layer in range(2):
        watchdog.set_label(f"model.layers.{layer}.mlp.experts")
        if layer == 1 and rank == stop_rank:
            _stop_here()
        out, exchange = all_to_all_async(torch.full((world, 4), float(rank)), splits, splits, dist.group.WORLD)
        if layer == 1 and rank in (0, 1):
            with watchdog.watched("all_reduce of the loss", others):
                dist.all_reduce(torch.ones(1), group=others)
        elif layer == 1:
            dist.barrier(group=pair)
        exchange.wait(out)
        print(f"exchanged {layer}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "async":
        exchange_later(float(sys.argv[2]), int(sys.argv[3]))
    else:
        main(float(sys.argv[1]), int(sys.argv[2]), (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else None)
