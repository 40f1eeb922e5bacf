"""Checkpoint cases: saving hybrid models and loading checkpoints rank-locally.

``save_pretrained`` after training, rank-local loading from disk (sabotaged to prove each rank reads
only its own bytes) and from a Hub stub, a missing expert file, and a ZeRO-1 save right after
``step()``.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import hf_hybrid_ep as hep

from .common import _build, _global_inputs, _local_view, _rank_slice, _rel


def save_generate_reload(model_type: str, dp: int, ep: int, num_experts: int, directory: str) -> dict:
    """After a training step: generate matches the reference, and save_pretrained writes a full vanilla
    checkpoint whose logits match the trained hybrid model."""
    from transformers import AutoModelForCausalLM

    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = _build(model_type, num_experts)
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep))
    batch = _global_inputs(ref, world, seed=5)
    for m, inputs in ((model, _rank_slice(batch, rank)), (ref, batch)):
        torch.optim.SGD(m.parameters(), lr=0.1).zero_grad()
        m(**inputs).loss.backward()
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    model.eval()
    ref.eval()
    prompt = _rank_slice(batch, rank)["input_ids"][:, :4]
    kw = {"attention_mask": torch.ones_like(prompt), "max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False}
    generated = model.generate(prompt, **kw)
    want = ref.generate(prompt, **kw)
    model.save_pretrained(directory)
    reloaded = AutoModelForCausalLM.from_pretrained(directory)
    reloaded.eval()
    with torch.no_grad():
        local = _rank_slice(batch, rank)
        got = reloaded(input_ids=local["input_ids"]).logits
        hybrid = model(input_ids=local["input_ids"]).logits
    return {
        "generate_equal": bool(torch.equal(generated, want)),
        "reload_rel": _rel(got, hybrid),
        "config_experts": model.config.num_local_experts if hasattr(model.config, "num_local_experts") else None,
    }


def rank_local_load(ckpt: str, dp: int, ep: int, reference_dir: str, sabotage: bool = False) -> dict:
    """Load with hf_hybrid_ep.from_pretrained and compare with a vanilla single-process load.

    With ``sabotage``, the rank loads from its own copy of the checkpoint in which every expert file
    holding none of its experts is deleted (per-expert storage) and every other rank's rows of fused
    expert tensors are NaN (fused storage): a clean, correct model proves it read only its own bytes.
    """
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from hf_hybrid_ep.checkpoint import read_index
    from hf_hybrid_ep.checkpoint.safetensors_io import read_header

    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(ckpt)
    deleted = poisoned = 0
    if sabotage:
        meta = read_index(root).hybrid_ep
        per = meta.num_experts // ep
        mine = set(range((rank % ep) * per, (rank % ep + 1) * per))
        copy_dir = root.parent / f"{root.name}-rank{rank}"
        shutil.copytree(root, copy_dir)
        for name, info in meta.files.items():
            if info.role == "experts" and not mine & set(meta.placement[info.ep_rank]):
                (copy_dir / name).unlink()
                deleted += 1
            elif info.role == "fused":
                tensors = load_file(copy_dir / name)
                for value in tensors.values():
                    others = [e for e in range(meta.num_experts) if e not in mine]
                    value[others] = float("nan")
                    poisoned += len(others)
                save_file(tensors, copy_dir / name, metadata=read_header(copy_dir / name)[1])  # same save id
        root = copy_dir
    # the whole-file sha256 would (rightly) refuse the poisoned fused files: skip only the hash here
    model = hep.from_pretrained(root, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep), verify=not poisoned)
    ref = AutoModelForCausalLM.from_pretrained(reference_dir)
    ref.eval()
    state = hep.state_of(model)
    local = {id(p): layer.local_experts for layer in state.layers for p in layer.expert_parameters()}
    ref_params = dict(ref.named_parameters())
    mismatched = []
    for name, p in model.named_parameters():
        want = ref_params[name].detach()
        want = want[local[id(p)]] if id(p) in local else want
        if not torch.equal(p.detach(), want):
            mismatched.append(name)
    batch = _rank_slice(_global_inputs(ref, world, seed=21), rank)
    with torch.no_grad():
        got = model(input_ids=batch["input_ids"]).logits
        want = ref(input_ids=batch["input_ids"]).logits
    return {"mismatched": mismatched, "logits_rel": _rel(got, want), "finite": bool(torch.isfinite(got).all()),
            "deleted": deleted, "poisoned": poisoned, "expert_bytes": sum(
                p.numel() * p.element_size() for layer in state.layers for p in layer.expert_parameters())}


def _poison_other_experts(tensors: dict, mine: set[int], num_experts: int) -> int:
    """Make every scale of an expert not in ``mine`` non-finite (NaN; e8m0 byte 255): dequantizing any
    of them is refused, so a clean load proves they were never dequantized. Returns how many."""
    from hf_hybrid_ep.checkpoint.format import PER_EXPERT_KEY

    others = [e for e in range(num_experts) if e not in mine]
    poisoned = 0
    for key, value in tensors.items():
        if not key.endswith(("_scale_inv", "_scales")):
            continue
        match = PER_EXPERT_KEY.match(key)
        rows = others if match is None and ".experts." in key else [] if match is None else (
            [slice(None)] if int(match["expert"]) in others else [])
        for row in rows:
            if value.dtype.is_floating_point and value.dtype != torch.float8_e8m0fnu:
                value[row] = float("nan")
            else:
                value.view(torch.uint8)[row] = 255
            poisoned += 1
    return poisoned


def quantized_rank_local_load(src: str, reference: str) -> dict:
    """hf_hybrid_ep.from_pretrained on a quantized (block-FP8 or MXFP4) checkpoint at ep = world: every
    parameter equals the converted checkpoint's tensor (this rank's rows of expert tensors), from a
    copy in which the other ranks' experts have poisoned scales."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(src)
    copy = root.parent / f"{root.name}-quantized-rank{rank}"
    shutil.copytree(root, copy)
    tensors = load_file(copy / "model.safetensors")
    ref = AutoModelForCausalLM.from_pretrained(reference)
    num_experts = next(m.num_experts for _, m in hep.moe.discovery.find_experts_modules(ref))
    per = num_experts // world
    poisoned = _poison_other_experts(tensors, set(range(rank * per, (rank + 1) * per)), num_experts)
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    model = hep.from_pretrained(copy, hep.HybridEPConfig(ep_degree=world))
    state = hep.state_of(model)
    local = {id(p): layer.local_experts for layer in state.layers for p in layer.expert_parameters()}
    want = dict(ref.named_parameters())
    mismatched = []
    for name, p in model.named_parameters():
        expected = want[name].detach()
        expected = expected[local[id(p)]] if id(p) in local else expected
        if not torch.equal(p.detach().float(), expected.float()):
            mismatched.append(name)
    try:  # the poison bites: a layout in which every rank holds every expert reads it
        hep.from_pretrained(copy, hep.HybridEPConfig(ep_degree=1, dp_degree=world))
        refused = ""
    except hep.CheckpointError as err:
        refused = str(err)
    return {"mismatched": mismatched, "poisoned": poisoned, "compared": len(want), "refused": refused,
            "quantization_config": hasattr(model.config, "quantization_config")}


def hub_rank_local_load(endpoint: str, repo_id: str, cache_base: str, reference_dir: str, dp: int, ep: int) -> dict:
    """hf_hybrid_ep.from_pretrained on a Hub repo id: each rank fetches only the files it needs."""
    from huggingface_hub import constants
    from transformers import AutoModelForCausalLM

    rank, world = dist.get_rank(), dist.get_world_size()
    # Point this worker's Hub client at the loopback stub (the env twins are read at import time).
    constants.ENDPOINT = endpoint
    constants.HUGGINGFACE_CO_URL_TEMPLATE = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    constants.HF_HUB_DISABLE_XET = True
    constants.HF_HUB_CACHE = f"{cache_base}/rank{rank}"
    model = hep.from_pretrained(repo_id, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep))
    ref = AutoModelForCausalLM.from_pretrained(reference_dir)
    ref.eval()
    batch = _rank_slice(_global_inputs(ref, world, seed=22), rank)
    with torch.no_grad():
        rel = _rel(model(input_ids=batch["input_ids"]).logits, ref(input_ids=batch["input_ids"]).logits)
    return {"logits_rel": rel}


def load_with_a_missing_file(ckpt: str, bad_rank: int) -> dict:
    """One rank's copy lacks its expert file: that rank names the file, every other rank raises too."""
    import shutil
    from pathlib import Path

    rank = dist.get_rank()
    root = Path(ckpt)
    mine = root.parent / f"{root.name}-missing-rank{rank}"
    shutil.copytree(root, mine)
    if rank == bad_rank:
        (mine / f"model-experts-rank{rank:03d}-of-002.safetensors").unlink()
    try:
        hep.from_pretrained(mine, hep.HybridEPConfig(ep_degree=2))
    except Exception as err:  # noqa: BLE001 - the message is the result
        message = f"{type(err).__name__}: {err}"
    else:
        message = ""
    flag = torch.ones(1)
    dist.all_reduce(flag)
    return {"message": message, "alive": flag.item() == dist.get_world_size()}


def save_right_after_step(directory: str, dp: int, ep: int) -> dict:
    """ZeRO-1 with overlapped parameter gathers: a save and a ``state_dict`` taken right after ``step()``
    (gathers still pending, no forward in between) hold the updated parameters."""
    from transformers import AutoModelForCausalLM

    from hf_hybrid_ep.model_io.save import save_hybrid_checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = _build("mixtral", 4)
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep, optimizer_sharding="zero1",
                                              bucket_size_mb=0.01))
    opt = hep.make_optimizer(model, torch.optim.AdamW, model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    batch = _global_inputs(ref, world, seed=3)
    model(**_rank_slice(batch, rank)).loss.backward()
    ref(**batch).loss.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    opt.step()
    ref_opt.step()
    pending = sum(b.gather_work is not None for b in hep.state_of(model).reducer.sharding.buckets)
    state = {k: v.clone() for k, v in model.state_dict().items()}  # waits for the gathers
    save_hybrid_checkpoint(model, directory)
    reloaded = dict(AutoModelForCausalLM.from_pretrained(directory).named_parameters())
    want = dict(ref.named_parameters())
    saved_rel = max(_rel(reloaded[n], want[n].detach()) for n in want)
    local = dict(model.named_parameters())
    state_rel = max(_rel(state[n], _local_view(model, want[n].detach(), local[n])) for n in local)
    return {"pending": pending, "saved_rel": saved_rel, "state_dict_rel": state_rel}


class _LiveBytes(TorchDispatchMode):
    """The peak bytes of storages created inside (op outputs that alias no input), alive at the same time;
    a storage counts until Python frees it."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if torch.is_tensor(t)}
        for t in pytree.tree_leaves(out):
            if not torch.is_tensor(t) or t.is_meta or t.untyped_storage().data_ptr() in inputs:
                continue
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            inputs.add(storage.data_ptr())
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, nbytes)
        return out

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


def _spans_of_collectives(spans: list[int], points_done: Callable[[], int]) -> contextlib.AbstractContextManager:
    """Record, for every ``torch.distributed`` collective call inside, how many of rank 0's write points passed
    while it waited (``points_done()`` before and after; the library looks the collectives up per call)."""
    names = ("broadcast", "barrier", "all_reduce", "all_gather_into_tensor", "all_gather_single",
             "broadcast_object_list", "all_gather_object", "all_to_all_single", "reduce_scatter_tensor")

    @contextlib.contextmanager
    def counted():
        saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}
        for n, real in saved.items():
            def wrapper(*args, _real=real, **kwargs):
                before = points_done()
                try:
                    return _real(*args, **kwargs)
                finally:
                    spans.append(points_done() - before)
            setattr(dist, n, wrapper)
        try:
            yield
        finally:
            for n, real in saved.items():
                setattr(dist, n, real)

    return counted()


def save_costs(directory: str, write_delay: float) -> dict:
    """One save of a tiny Qwen3-MoE (4 layers, every one MoE) at ep = world, with rank 0's every write point (a file
    opened or closed, an fsync, a rename, the index) slowed by ``write_delay`` seconds and counted in a file every
    rank reads: this rank's peak bytes of tensors allocated during the save, one MoE layer's and all layers' expert
    bytes (unsharded), this rank's collective calls during the save and the most write points one of them spanned,
    and rank 0's write points."""
    from tiny_models import build_tiny_model

    from hf_hybrid_ep.checkpoint import safetensors_io
    from hf_hybrid_ep.model_io.save import save_hybrid_checkpoint
    from hf_hybrid_ep.parallel import heartbeat

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_tiny_model("qwen3_moe", num_experts=4, num_layers=4)
    hep.parallelize(model, hep.HybridEPConfig(ep_degree=world))
    layers = hep.state_of(model).layers
    layer_bytes = [sum(p.numel() * p.element_size() for p in layer.expert_parameters()) * layer.num_experts
                   // len(layer.local_experts) for layer in layers]
    counter = Path(f"{directory}.write-points")  # one byte per write point of rank 0

    def point(name: str) -> None:
        with counter.open("ab") as f:
            f.write(b".")
        time.sleep(write_delay)

    if rank == 0:
        counter.write_bytes(b"")
        safetensors_io._write_point = point
    dist.barrier()
    heartbeat.INTERVAL_S, interval = 0.05, heartbeat.INTERVAL_S
    spans: list[int] = []
    memory = _LiveBytes()
    try:
        with _spans_of_collectives(spans, lambda: counter.stat().st_size), memory:
            save_hybrid_checkpoint(model, directory)
    finally:
        safetensors_io._write_point, heartbeat.INTERVAL_S = None, interval
    dist.barrier()
    return {"peak_bytes": memory.peak, "layer_bytes": max(layer_bytes), "all_layers_bytes": sum(layer_bytes),
            "waits": len(spans), "most_points_in_one_wait": max(spans), "write_points": counter.stat().st_size}


def resume_another_model(directory: str) -> dict:
    """A checkpoint of a 4-expert model resumed into an 8-expert one (EP 2: rank 1's experts 4–7 are not in it):
    every rank refuses with the same message, before reading a weight."""
    from hf_hybrid_ep.model_io.rank_local import load_checkpoint_into_
    from hf_hybrid_ep.model_io.save import save_hybrid_checkpoint

    small, _ = _build("qwen3_moe", 4)
    hep.parallelize(small, hep.HybridEPConfig(ep_degree=dist.get_world_size()))
    save_hybrid_checkpoint(small, directory)
    large, _ = _build("qwen3_moe", 8)
    hep.parallelize(large, hep.HybridEPConfig(ep_degree=dist.get_world_size()))
    try:
        load_checkpoint_into_(directory, large)
    except hep.CheckpointError as err:
        return {"message": str(err)}
    return {"message": ""}
