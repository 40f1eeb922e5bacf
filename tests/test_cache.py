"""ExpertCache policies on hand-made traces, and offloaded decoding against the fully resident model."""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
from collections import Counter

import pytest
import torch
from sync_counting import SyncCounter
from tiny_models import build_tiny_model

import hf_hybrid_ep as hep
from hf_hybrid_ep.inference import offload as offloading
from hf_hybrid_ep.inference.offload import offload_state_of
from hf_hybrid_ep.inference.policies import ExpertCache, replay


def _evictions(policy: str, trace, capacity: int = 2, **kw) -> list[int]:
    cache = ExpertCache(capacity, policy, future=trace if policy == "belady" else None, **kw)
    evicted = []
    for step in trace:
        before = set(cache.resident)
        cache.request(step)
        evicted += sorted(before - set(cache.resident))
    return evicted


def test_lru_evicts_the_least_recently_used():
    assert _evictions("lru", [[0], [1], [0], [2], [3]]) == [1, 0]


def test_lfu_evicts_the_least_frequently_used():
    assert _evictions("lfu", [[0], [0], [1], [2], [3]]) == [1, 2]


def test_pinned_lru_keeps_the_hottest_expert():
    # capacity 3, one pinned slot: expert 0 was used most, so pinned-lru keeps it where lru evicts it
    trace = [[0], [0], [0], [1], [2], [3]]
    assert _evictions("lru", trace, capacity=3) == [0]
    assert _evictions("pinned-lru", trace, capacity=3, pin_fraction=1 / 3) == [1]


def test_belady_evicts_the_farthest_next_use():
    trace = [[0], [1], [2], [0], [1], [2]]
    assert _evictions("belady", trace) == [1, 0]  # at step 2: next uses 0 -> 1 step, 1 -> 2 steps
    assert replay(trace, 2, "belady").hits >= max(replay(trace, 2, p).hits for p in ("lru", "lfu", "pinned-lru"))


def test_resize_down_and_up_keeps_resident_experts():
    cache = ExpertCache(4, "lru", expert_bytes=100)
    cache.request([0, 1, 2, 3])
    cache.request([3])
    moves = cache.resize(2)
    assert list(cache.resident) == [2, 3] and sorted(moves.values()) == [0, 1]
    cache.resize_bytes(500)
    assert cache.capacity == 5 and list(cache.resident) == [2, 3]
    with pytest.raises(hep.HybridEPConfigError, match="3 experts requested at once, capacity is 2"):
        ExpertCache(2, "lru").request([0, 1, 2])


@pytest.mark.parametrize("policy", ["lru", "lfu", "pinned-lru"])
def test_offloaded_decoding_equals_resident_decoding(policy):
    torch.manual_seed(0)
    model = build_tiny_model("mixtral", num_experts=8)
    model.eval()
    reference = copy.deepcopy(model)
    hep.offload(model, capacity=3, policy=policy)
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True,
              attention_mask=torch.ones_like(ids))
    got, want = model.generate(ids, **kw), reference.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):  # every decoding step
        assert ((a - b).norm() / b.norm()).item() <= 1e-6
    stats = hep.cache_stats(model)
    full_layer_bytes = sum(p.numel() * p.element_size() for p in reference.model.layers[0].mlp.experts.parameters())
    for layer in stats.values():
        assert layer["evictions"] > 0 and layer["resident_experts"] <= layer["capacity"] == 3
        assert layer["resident_bytes"] == full_layer_bytes * 3 // 8  # never more than the budget
    hep.resize_offload(model, 2)  # down, then up: still the same tokens
    assert torch.equal(model.generate(ids, **kw).sequences, want.sequences)
    hep.resize_offload(model, 6)
    assert torch.equal(model.generate(ids, **kw).sequences, want.sequences)


@pytest.fixture(scope="module", params=["mixtral", "gpt_oss"])  # per-expert keys (rank files); fused tensors
def converted(request, tmp_path_factory):
    from checkpoint_fixtures import save_source

    root = tmp_path_factory.mktemp(f"store-{request.param}")
    source = save_source(request.param, root / "source", num_experts=8)
    return hep.convert_checkpoint(source, root / "hybrid", ep_degree=2, progress=False)


def _decode(model, ids):
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True,
              attention_mask=torch.ones_like(ids))
    return model.generate(ids, **kw)


@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
def test_safetensors_store_decoding_equals_resident_decoding(converted, prefetch):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(converted).eval()
    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    with torch.no_grad():  # the resident copies are not the store: zero them, so only the files can serve
        for _, module in hep.find_experts_modules(model):
            for p in module.parameters(recurse=False):
                p.zero_()
    hep.offload(model, capacity=3, policy="lru", store=converted, prefetch=prefetch)
    assert isinstance(model._hybrid_ep_offload[0].store, hep.inference.offload.SafetensorsStore)
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    got, want = _decode(model, ids), _decode(reference, ids)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):  # every decoding step
        assert ((a - b).norm() / b.norm()).item() <= 1e-6
    stats = hep.cache_stats(model)
    for i, layer in enumerate(stats.values()):
        assert layer["evictions"] > 0 and layer["resident_experts"] <= layer["capacity"] == 3
        if prefetch and i > 0:  # the first layer has no previous layer to predict it
            assert layer["prefetched"] > 0 and layer["used"] > 0
            assert 0.0 < layer["prefetch_recall"] <= 1.0
        else:
            assert layer["prefetched"] == 0 and layer["used"] == 0
    hep.resize_offload(model, 2)  # down, then up, at run time: still the same tokens
    assert torch.equal(_decode(model, ids).sequences, want.sequences)
    assert all(layer["resident_experts"] <= 2 for layer in hep.cache_stats(model).values())
    hep.resize_offload(model, 5)
    assert torch.equal(_decode(model, ids).sequences, want.sequences)


def test_safetensors_store_of_another_model_is_refused(converted, tmp_path):
    model = build_tiny_model("mixtral", num_experts=8, hidden=32).eval()
    with pytest.raises(hep.HybridEPConfigError, match="expert shape|has no tensor for"):
        hep.offload(model, capacity=2, store=converted)


def test_load_offloaded_never_holds_more_than_capacity_experts(converted):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(converted).eval()
    model = hep.load_offloaded(converted, capacity=2, prefetch=True)  # meta build: dense read, experts stay on disk
    for _, module in hep.find_experts_modules(model):
        assert all(p.shape[0] == 2 for p in module.parameters(recurse=False))
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(2))
    got, want = _decode(model, ids), _decode(reference, ids)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):
        assert ((a - b).norm() / b.norm()).item() <= 1e-6
    assert all(layer["evictions"] > 0 for layer in hep.cache_stats(model).values())


def test_load_offloaded_refuses_a_tensor_of_another_shape_naming_it(converted, tmp_path):
    # a config.json that disagrees with the weights (another vocabulary): the first tensor of another shape (the
    # output projection) is refused by name, as rank-local loading refuses it, never installed at the file's shape
    wrong = tmp_path / "wrong"
    shutil.copytree(converted, wrong)
    config = json.loads((wrong / "config.json").read_text())
    config["vocab_size"] += 8
    (wrong / "config.json").write_text(json.dumps(config))
    with pytest.raises(hep.CheckpointError, match=r"'lm_head\.weight' has shape \(\d+, \d+\), the model expects "
                                                  r"\(\d+, \d+\)"):
        hep.load_offloaded(wrong, capacity=2)


# ---------------------------------------------------------------------------------------------- the CUDA paths


class _HostStream(torch.Stream):
    """A real stream of the CPU standing in for a CUDA stream: ``record_stream`` of a host tensor on it raises
    NotImplementedError, exactly as it does for host memory on a CUDA machine; waits between streams do nothing."""

    def wait_stream(self, other) -> None:
        pass


class _Event:
    def __init__(self, log: Counter) -> None:
        self.log = log

    def record(self, stream) -> None:
        self.log["events"] += 1

    def synchronize(self) -> None:
        self.log["host_waits"] += 1


@pytest.fixture
def cuda_on_cpu(monkeypatch):
    """torch.cuda's stream and event API and pinned allocations on the CPU, counted; ``host`` makes the
    machine look like a CUDA host for the duration of a block."""
    log: Counter = Counter()
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _HostStream("cpu"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _HostStream("cpu"))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", lambda: _Event(log))

    def pinned(nbytes: int) -> torch.Tensor:
        log["pinned_buffers"] += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(offloading, "pinned_buffer", pinned)

    @contextlib.contextmanager
    def host():
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "is_available", lambda: True)
            yield

    return log, host


def test_cuda_loads_stage_through_a_few_pinned_buffers(cuda_on_cpu):
    # The CUDA code path with CPU tensors: a store of pageable memory (pinning every expert at once runs a
    # real host out of page-locked memory), no record_stream on host memory (it has no CPU kernel, so the
    # first load on a GPU raised), a ring of staging buffers reused once their transfer completed.
    log, host = cuda_on_cpu
    torch.manual_seed(0)
    model = build_tiny_model("mixtral", num_experts=8).eval()
    reference = copy.deepcopy(model)
    with host():
        hep.offload(model, capacity=3, prefetch=True)
    layers = offload_state_of(model)
    transfers = offloading.ExpertTransfers(torch.device("cuda"), layers[0].staging_bytes())
    for layer in layers:
        layer.transfers = transfers
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    got, want = _decode(model, ids), _decode(reference, ids)
    assert torch.equal(got.sequences, want.sequences)
    stats = hep.cache_stats(model).values()
    loads = sum(s["misses"] + s["prefetched"] for s in stats)
    assert log["events"] == loads > offloading.STAGING_BUFFERS == log["pinned_buffers"]
    assert log["host_waits"] == loads - offloading.STAGING_BUFFERS  # only when the ring comes round


@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
def test_offload_decisions_read_the_device_once_per_layer(prefetch):
    # Which experts to load is decided on the host from one read per layer and forward: its routed counts, with
    # the next layer's predicted counts when prefetching; a read per expert is a host synchronisation per expert
    # on CUDA, and so is a second read per layer.
    torch.manual_seed(0)
    model = build_tiny_model("mixtral", num_experts=8).eval()
    hep.offload(model, capacity=6, prefetch=prefetch)
    layers = offload_state_of(model)
    assert len(layers) > 1 and (layers[0].next is not None) == prefetch
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    with SyncCounter() as syncs, torch.no_grad():
        model(ids)
    assert dict(syncs.counts) == {"Tensor.tolist": len(layers)}
    if prefetch:
        assert all(s["prefetched"] > 0 for s in list(hep.cache_stats(model).values())[1:])
