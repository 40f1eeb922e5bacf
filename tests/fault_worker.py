"""One rank of a plain hybrid-EP training loop, started as a bare process (the way srun starts ranks: RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment; rank 0 hosts the c10d store), for the fault drills
of tests/test_fault_drills.py.

    python tests/fault_worker.py TIMEOUT_S STEPS

Trains a tiny Qwen3-MoE at dp 2 × ep 2 with ``collective_timeout_s=TIMEOUT_S`` and prints ``step N`` after every
optimizer step (flushed), so the driver knows when to send its signal.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

import hf_hybrid_ep as hep  # noqa: E402


def main(timeout_s: float, steps: int) -> None:
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
        hep.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        hep.after_optimizer_step(model)
        print(f"step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]))
