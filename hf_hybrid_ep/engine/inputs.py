"""Start-up check that the data-parallel ranks read different data.

Every rank of a hybrid-EP world is a data-parallel rank for the dense weights: each must train on its own
micro-batches. A launch the training loop did not see as distributed (``torchrun`` on a CPU machine under a
``TrainingArguments`` that decided on one process, a loader without a distributed sampler) hands every rank the
same batches; the engine still averages the gradients, so the run trains on ``1/W`` of its data with nothing to
see but identical losses. :func:`check_distinct_inputs` compares a digest of every rank's first batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
from torch import nn

from ..errors import HybridEPConfigError
from .state import state_of

INPUT_KEYS = ("input_ids", "inputs_embeds", "pixel_values", "input_features", "labels")


def batch_digest(inputs: Mapping | list) -> str | None:
    """sha256 of a batch's first tensor among :data:`INPUT_KEYS` (its bytes and shape), ``None`` without one or for
    a batch of raw examples (a list: TRL's GRPO trainer receives prompts that it repeats across ranks on purpose,
    each rank sampling its own completions)."""
    if not isinstance(inputs, Mapping):
        return None
    tensor = next((inputs[k] for k in INPUT_KEYS if torch.is_tensor(inputs.get(k))), None)
    if tensor is None:
        return None
    t = tensor.detach().cpu().contiguous()
    return hashlib.sha256(str(tuple(t.shape)).encode() + t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def check_distinct_inputs(model: nn.Module, inputs: dict) -> None:
    """Raise on every rank when two ranks received the same batch ``inputs`` (call with the first one).
    Collective over the model's world.

    Raises:
        HybridEPConfigError: naming the ranks that share a batch.
    """
    mesh = state_of(model).mesh
    if mesh.world_group is None:
        return
    everyone = mesh.gather_objects(batch_digest(inputs), "all_gather of every rank's first-batch digest (start-up "
                                   "data check)")
    same: dict[str, list[int]] = {}
    for rank, digest in enumerate(everyone):
        if digest is not None:
            same.setdefault(digest, []).append(rank)
    shared = [ranks for ranks in same.values() if len(ranks) > 1]
    if shared:
        raise HybridEPConfigError(
            f"ranks {shared[0]} received the same first batch: every rank of the {mesh.world_size}-rank world trains "
            "the dense weights data-parallel and must read its own data. The training loop did not see the launch "
            "as distributed: on a CPU machine give TrainingArguments use_cpu=True (scripts/train.py does) or set "
            "ACCELERATE_USE_CPU=1 before it is built; in a loop of your own, shard the data by rank "
            "(torch.utils.data.DistributedSampler)")
