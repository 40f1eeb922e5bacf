"""The runtime's own cost, counted: the reducer's work per gradient hook as the model deepens."""

from __future__ import annotations

import torch
import torch.distributed as dist
from tiny_models import build_tiny_model, tiny_inputs
from work_counting import LineCounter

import hf_hybrid_ep as hep

from .common import BATCH_PER_RANK, SEQ

# the files a gradient's hook and the end-of-backward callback run in
REDUCTION_FILES = ("parallel/grads.py", "parallel/buckets.py", "engine/backward.py")


def reducer_work(model_type: str, dp: int, ep: int, depths: list[int]) -> dict:
    """Per depth (decoder layers): the parameters the reducer reduces, and the library lines executed in one
    reducing forward and one backward (after a warm-up step), in total and in the reduction's files."""
    out = {}
    for layers in depths:
        torch.manual_seed(0)
        model = build_tiny_model(model_type, num_experts=4, num_layers=layers)
        model.train()
        hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep))
        g = torch.Generator().manual_seed(dist.get_rank())
        batch = tiny_inputs(model, BATCH_PER_RANK, SEQ, g)
        model(**batch).loss.backward()  # warm-up: buffers allocated, first-use work done
        model.zero_grad(set_to_none=True)
        forward, backward = LineCounter(), LineCounter()
        with forward.active():
            loss = model(**batch).loss
        with backward.active():
            loss.backward()
        out[layers] = {
            "parameters": len(hep.state_of(model).reducer.parameters()),
            "forward_lines": forward.total(),
            "backward_lines": backward.total(),
            "reduction_lines": sum(backward.total(f) for f in REDUCTION_FILES),
        }
    return out
