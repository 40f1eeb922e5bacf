"""A placement table per MoE layer, through the config, the engine, the checkpoint index (format
version 2; version-1 single-table checkpoints still load), convert/reshard, saving, loading and
offloaded inference."""

from __future__ import annotations

import json

import dist_cases as cases
import pytest
import torch
from checkpoint_fixtures import save_source
from safetensors import safe_open
from tiny_models import build_tiny_model

import hf_hybrid_ep as hep
from hf_hybrid_ep.checkpoint import CheckpointError, read_index
from hf_hybrid_ep.checkpoint.format import INDEX_NAME
from hf_hybrid_ep.checkpoint.manifest import MANIFEST_KEY, content_digest
from hf_hybrid_ep.cli import main as cli
from hf_hybrid_ep.model_io.rank_local import checkpoint_placement

LAYER0, LAYER1 = "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"
PER_LAYER = {LAYER0: [[3, 0], [1, 2]], LAYER1: [[0, 1, 2], [2, 3, 0]]}  # a permutation; replicas


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_source("mixtral", tmp_path_factory.mktemp("per_layer") / "src")  # per-expert keys


def _experts_in(directory, name):
    """{layer prefix: expert ids} of the per-expert keys stored in file ``name``."""
    out: dict[str, set[int]] = {}
    for key, file in read_index(directory).weight_map.items():
        if file == name and ".experts." in key:
            prefix, rest = key.split(".experts.")
            out.setdefault(prefix, set()).add(int(rest.split(".")[0]))
    return out


def test_the_config_takes_a_table_per_layer():
    config = hep.HybridEPConfig(placement=PER_LAYER)
    assert config.resolve(2, 4) == (1, 2)  # the tables' row count fixes the EP degree
    with pytest.raises(hep.HybridEPConfigError, match="different row counts"):
        hep.HybridEPConfig(placement={LAYER0: [[0, 1], [2, 3]], LAYER1: [[0, 1, 2, 3]]})
    with pytest.raises(hep.HybridEPConfigError, match="must be an experts module's qualified name"):
        hep.HybridEPConfig(placement={0: [[0, 1], [2, 3]]})
    with pytest.raises(hep.HybridEPConfigError, match=f"placement table of layer '{LAYER1}'"):
        hep.HybridEPConfig(placement={LAYER1: [[0, 1], ["2"]]})
    with pytest.raises(hep.HybridEPConfigError, match="rows but ep_degree=4"):
        hep.HybridEPConfig(ep_degree=4, placement=PER_LAYER).resolve(4, 4)


def test_a_layer_the_model_lacks_is_named():
    model = build_tiny_model("mixtral", num_experts=4)
    with pytest.raises(hep.HybridEPConfigError, match=r"names layer 'model.layers.7.mlp.experts'.*its MoE layers are"):
        hep.parallelize(model, hep.HybridEPConfig(placement={"model.layers.7.mlp.experts": [[0, 1, 2, 3]]}))
    model = build_tiny_model("mixtral", num_experts=4)
    with pytest.raises(hep.HybridEPConfigError, match=f"placement of layer '{LAYER0}'.*places no replica of expert"):
        hep.parallelize(model, hep.HybridEPConfig(placement={LAYER0: [[0, 1, 2]]}))


def test_training_with_a_table_per_layer_is_faithful(pools):
    """Layer 0 permuted, layer 1 with replicas (every layer's own slot counts), layers unnamed contiguous."""
    results = pools(2).run(cases.train_parity, "mixtral", 1, 2, 4, placement=PER_LAYER)
    partial = pools(2).run(cases.train_parity, "mixtral", 1, 2, 4, steps=2, placement={LAYER1: PER_LAYER[LAYER1]})
    for r in (*results, *partial):
        assert r["max_loss_rel"] <= cases.REL_TOL and r["max_grad_rel_step0"] <= cases.REL_TOL, r
        assert r["max_norm_rel"] <= cases.REL_TOL and r["violations"] == [], r
    assert all(r["placements"] == PER_LAYER for r in results)
    assert all(r["placements"] == {LAYER0: [[0, 1], [2, 3]], LAYER1: PER_LAYER[LAYER1]} for r in partial)


def test_convert_writes_each_layer_by_its_own_table(source, tmp_path):
    (tmp_path / "placement.json").write_text(json.dumps({"placement": PER_LAYER}))
    assert cli(["convert", str(source), str(tmp_path / "ckpt"), "--placement", str(tmp_path / "placement.json")]) == 0
    meta = read_index(tmp_path / "ckpt").hybrid_ep
    assert meta.format_version == 2 and meta.per_layer and meta.placement == PER_LAYER and meta.ep_degree == 2
    assert checkpoint_placement(tmp_path / "ckpt") == PER_LAYER
    for name, info in meta.files.items():
        if info.role == "experts":  # a key lives in its first holder's file, layer by layer
            stored = _experts_in(tmp_path / "ckpt", name)
            for i, (layer, rows) in enumerate(PER_LAYER.items()):
                prefix = f"model.layers.{i}.block_sparse_moe"  # the source's key format, not the module names
                first = {e for e in range(4) if [r for r, row in enumerate(rows) if e in row][0] == info.ep_rank}
                assert stored.get(prefix, set()) == first, (name, layer)
    assert cli(["inspect", str(tmp_path / "ckpt")]) == 0
    # back to one table: the compact form, as format version 1 wrote it
    hep.convert_checkpoint(tmp_path / "ckpt", tmp_path / "one", placement=[[1, 0], [3, 2]], progress=False)
    assert read_index(tmp_path / "one").hybrid_ep.placement == [[1, 0], [3, 2]]
    hep.export_checkpoint(tmp_path / "ckpt", tmp_path / "plain", progress=False)
    for key, file in read_index(source).weight_map.items():
        with safe_open(source / file, framework="pt") as a:
            plain = read_index(tmp_path / "plain")
            with safe_open(tmp_path / "plain" / plain.weight_map[key], framework="pt") as b:
                assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key


def test_bad_per_layer_placements_are_refused_before_writing(source, tmp_path):
    with pytest.raises(CheckpointError, match="names layer 'model.layers.9.mlp.experts'"):
        hep.convert_checkpoint(source, tmp_path / "a", placement={"model.layers.9.mlp.experts": [[0, 1], [2, 3]]},
                               progress=False)
    with pytest.raises(CheckpointError, match="ep_degree=4 disagrees with the placement's 2 rows"):
        hep.convert_checkpoint(source, tmp_path / "b", ep_degree=4, placement=PER_LAYER, progress=False)
    (tmp_path / "bad.json").write_text(json.dumps({"placement": {LAYER0: [[0, True], [2, 3]]}}))
    assert cli(["convert", str(source), str(tmp_path / "c"), "--placement", str(tmp_path / "bad.json")]) == 2
    assert not any((tmp_path / n).exists() for n in "abc")


def _as_format_version_1(directory):
    """Rewrite a single-table index as format version 1 wrote it (and re-seal the manifest's digest)."""
    path = directory / INDEX_NAME
    body = json.loads(path.read_text())
    body["metadata"]["hybrid_ep"]["format_version"] = 1
    body["metadata"][MANIFEST_KEY]["file_sha256"] = content_digest(body)
    path.write_text(json.dumps(body, indent=2) + "\n")


def test_loading_follows_the_index_per_layer_and_version_1_still_loads(pools, source, tmp_path):
    per_layer = hep.convert_checkpoint(source, tmp_path / "per_layer", placement=PER_LAYER, progress=False)
    old = hep.convert_checkpoint(source, tmp_path / "v1", placement=[[3, 0], [1, 2]], progress=False)
    _as_format_version_1(old)
    assert read_index(old).hybrid_ep.format_version == 1
    pool = pools(2)
    for ckpt, want in ((per_layer, PER_LAYER), (old, {LAYER0: [[3, 0], [1, 2]], LAYER1: [[3, 0], [1, 2]]})):
        for rank, r in enumerate(pool.run(cases.train_parity, "mixtral", 1, 2, 4, steps=2, load_from=str(ckpt))):
            assert r["placements"] == want, (ckpt, rank)  # the tables came from the index
            assert r["max_loss_rel"] <= cases.REL_TOL and r["violations"] == [], (ckpt, rank, r)
    results = pool.run(cases.save_and_reload_placement, str(tmp_path / "saved"), PER_LAYER)
    assert checkpoint_placement(tmp_path / "saved") == PER_LAYER
    for r in results:
        assert r["reloaded_per_layer"] == PER_LAYER and r["equal"], r


def test_offloaded_inference_reads_a_per_layer_checkpoint(source, tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt = hep.convert_checkpoint(source, tmp_path / "ckpt", placement=PER_LAYER, progress=False)
    reference = AutoModelForCausalLM.from_pretrained(source).eval()
    model = hep.load_offloaded(ckpt, capacity=2)
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert ((got - want).norm() / want.norm()).item() <= 1e-6
