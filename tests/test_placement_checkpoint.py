"""A placement is a placement table stored in the checkpoint index, honoured by convert, reshard,
rank-local loading, saving and training."""

from __future__ import annotations

import json

import dist_cases as cases
import pytest
import torch
from checkpoint_fixtures import save_source
from safetensors import safe_open

import hf_hybrid_ep as hep
from hf_hybrid_ep.checkpoint import CheckpointError, read_index
from hf_hybrid_ep.cli import main as cli
from hf_hybrid_ep.model_io.rank_local import checkpoint_placement

PERMUTED = [[3, 0], [1, 2]]
REPLICATED = [[0, 1, 2], [2, 3, 0]]


def _tensors(directory):
    index = read_index(directory)
    out = {}
    for key, name in index.weight_map.items():
        with safe_open(directory / name, framework="pt") as f:
            out[key] = f.get_tensor(key)
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_source("mixtral", tmp_path_factory.mktemp("placed") / "src")  # per-expert keys


def test_convert_stores_the_table_and_files_follow_it(source, tmp_path):
    (tmp_path / "placement.json").write_text(json.dumps({"placement": PERMUTED, "ep_degree": 2}))
    assert cli(["convert", str(source), str(tmp_path / "ep2"), "--placement", str(tmp_path / "placement.json")]) == 0
    index = read_index(tmp_path / "ep2")
    meta = index.hybrid_ep
    assert meta.placement == PERMUTED and meta.ep_degree == 2 and checkpoint_placement(tmp_path / "ep2") == PERMUTED
    for name, info in meta.files.items():
        if info.role == "experts":  # rank 0's file holds experts 3 and 0, rank 1's 1 and 2
            experts = {int(k.split(".experts.")[1].split(".")[0]) for k, f in index.weight_map.items() if f == name}
            assert experts == set(PERMUTED[info.ep_rank]), name


def test_reshard_to_a_new_placement_and_export_is_bit_exact(source, tmp_path):
    placed = hep.convert_checkpoint(source, tmp_path / "perm", placement=PERMUTED, progress=False)
    (tmp_path / "rep.json").write_text(json.dumps(REPLICATED))
    assert cli(["reshard", str(placed), str(tmp_path / "rep"), "--placement", str(tmp_path / "rep.json")]) == 0
    meta = read_index(tmp_path / "rep").hybrid_ep
    assert meta.placement == REPLICATED
    # a replicated expert's keys live once, in its first holder's file (experts 0, 1, 2 on rank 0; 3 on rank 1)
    assert {info.ep_rank for info in meta.files.values() if info.role == "experts"} == {0, 1}
    hep.export_checkpoint(tmp_path / "rep", tmp_path / "plain", progress=False)
    original, exported = _tensors(source), _tensors(tmp_path / "plain")
    assert original.keys() == exported.keys()
    for key, value in original.items():
        assert torch.equal(value, exported[key]), key


def test_bad_placements_are_refused_before_writing(source, tmp_path):
    with pytest.raises(CheckpointError, match="places no replica of expert"):
        hep.convert_checkpoint(source, tmp_path / "a", placement=[[0, 1], [2]], progress=False)
    with pytest.raises(CheckpointError, match="ep_degree=4 disagrees with the placement's 2 rows"):
        hep.convert_checkpoint(source, tmp_path / "b", ep_degree=4, placement=PERMUTED, progress=False)
    (tmp_path / "bad.json").write_text('{"placement": "x"}')
    assert cli(["convert", str(source), str(tmp_path / "c"), "--placement", str(tmp_path / "bad.json")]) == 2
    assert not any((tmp_path / n).exists() for n in "abc")


@pytest.mark.parametrize("placement", [PERMUTED, REPLICATED], ids=["permutation", "replicas"])
def test_training_from_a_placed_checkpoint_is_faithful(pools, source, tmp_path, placement):
    placed = hep.convert_checkpoint(source, tmp_path / "placed", placement=placement, progress=False)
    results = pools(2).run(cases.train_parity, "mixtral", 1, 2, 4, load_from=str(placed))
    for rank, r in enumerate(results):
        assert r["placement"] == placement, rank  # the table came from the index
        assert r["max_loss_rel"] <= cases.REL_TOL and r["max_grad_rel_step0"] <= cases.REL_TOL, (rank, r)
        assert r["max_norm_rel"] <= cases.REL_TOL and r["violations"] == [], (rank, r)


def test_save_writes_the_model_table_and_loading_restores_it(pools, tmp_path):
    results = pools(2).run(cases.save_and_reload_placement, str(tmp_path / "ckpt"), PERMUTED)
    assert checkpoint_placement(tmp_path / "ckpt") == PERMUTED
    for r in results:
        assert r["reloaded"] == PERMUTED and r["equal"], r


def test_ep_groups_follow_the_topology(pools):
    pool = pools(4)
    # default ep with 2 GPUs per node: the EP group fills one node
    for r in pool.run(cases.mesh_layout, None, None, "gpus_per_node=2"):
        assert (r["kind"], r["ep"], len(r["nodes"])) == ("intra_node", 2, 1), r
    # ep 4 > 2 GPUs per node: hierarchical, the group spans both nodes
    for r in pool.run(cases.mesh_layout, 1, 4, "gpus_per_node=2"):
        assert (r["kind"], r["group"], r["nodes"]) == ("hierarchical", [0, 1, 2, 3], [0, 1]), r
