"""Convert checks every checkpoint key against the model before it writes anything.

Tiny Mixtral (per-expert keys that transformers stacks into fused parameters) and GPT-OSS (fused
``[E, ...]`` keys with biases) checkpoints are damaged one way or several ways at once; each damage
must be named, with both shapes, in one CheckpointError, and OUT must stay absent with no staging
sibling left. The undamaged checkpoints must still convert.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_fixtures import save_source
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import hf_hybrid_ep as hep
from hf_hybrid_ep.checkpoint import CheckpointError, read_index
from hf_hybrid_ep.checkpoint.keys import classify_keys
from hf_hybrid_ep.checkpoint.safetensors_io import TensorSpec
from hf_hybrid_ep.cli import main as cli
from hf_hybrid_ep.model_io.validate import validate_against_model
from hf_hybrid_ep.moe.architecture import build_meta_model, model_experts, read_config

MIX_W1 = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
MIX_DENSE = "model.layers.0.self_attn.q_proj.weight"
OSS_GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"
OSS_DOWN_BIAS = "model.layers.1.mlp.experts.down_proj_bias"
OSS_DENSE = "model.layers.1.self_attn.o_proj.weight"


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    return {family: save_source(family, root / family) for family in ("mixtral", "gpt_oss")}


def _copy(sources: dict[str, Path], family: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(sources[family], tmp_path / "src"))


def _shape(src: Path, key: str) -> tuple[int, ...]:
    return read_index(src).specs[key].shape


def _edit(src: Path, changes: dict[str, torch.Tensor | None]) -> None:
    """Replace (tensor), add (tensor for a new key) or remove (None) keys of a sharded checkpoint in place."""
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map: dict[str, str] = index["weight_map"]
    first = sorted(set(weight_map.values()))[0]
    by_file: dict[str, dict[str, torch.Tensor | None]] = {}
    for key, value in changes.items():
        by_file.setdefault(weight_map.get(key, first), {})[key] = value
    for name, edits in by_file.items():
        tensors = load_file(src / name)
        for key, value in edits.items():
            if value is None:
                del tensors[key]
                del weight_map[key]
            else:
                tensors[key] = value
                weight_map[key] = name
        save_file(tensors, src / name, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


def _refused(src: Path, out: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        hep.convert_checkpoint(src, out, ep_degree=2, progress=False)
    assert not out.exists(), "nothing may be written at OUT"
    assert not list(out.parent.glob(f".{out.name}*")), "no staging sibling or claim may be left"
    return str(info.value)


def test_wrong_shaped_dense_tensor(sources, tmp_path):
    src = _copy(sources, "mixtral", tmp_path)
    rows, cols = _shape(src, MIX_DENSE)
    _edit(src, {MIX_DENSE: torch.zeros(rows + 1, cols)})
    msg = _refused(src, tmp_path / "out")
    assert msg.startswith(
        f"checkpoint {str(src)!r} does not match MixtralForCausalLM: 1 with the wrong shape")
    assert f"{MIX_DENSE}: ({rows + 1}, {cols}) in the file, the model expects ({rows}, {cols})" in msg


def test_wrong_shaped_per_expert_tensor(sources, tmp_path):
    src = _copy(sources, "mixtral", tmp_path)
    inter, hidden = _shape(src, MIX_W1)
    _edit(src, {MIX_W1: torch.zeros(inter, hidden + 1)})
    msg = _refused(src, tmp_path / "out")
    assert f"{MIX_W1}: ({inter}, {hidden + 1}) in the file, the model expects ({inter}, {hidden})" in msg
    assert f"part of model.layers.0.mlp.experts.gate_up_proj (4, {2 * inter}, {hidden})" in msg


def test_gpt_oss_gate_up_with_the_wrong_expert_count(sources, tmp_path):
    src = _copy(sources, "gpt_oss", tmp_path)
    experts, hidden, width = _shape(src, OSS_GATE_UP)
    bad = (experts + 1, hidden + 1, width + 1)
    _edit(src, {OSS_GATE_UP: torch.zeros(bad)})
    msg = _refused(src, tmp_path / "out")
    assert f"{OSS_GATE_UP}: {bad} in the file, the model expects {(experts, hidden, width)}" in msg


def test_gpt_oss_gate_up_with_mismatched_leading_dims(sources, tmp_path):
    src = _copy(sources, "gpt_oss", tmp_path)
    experts, hidden, width = _shape(src, OSS_GATE_UP)
    _edit(src, {OSS_GATE_UP: torch.zeros(experts - 1, hidden, width)})
    msg = _refused(src, tmp_path / "out")
    assert f"{OSS_GATE_UP}: {(experts - 1, hidden, width)} in the file, the model expects " \
           f"{(experts, hidden, width)}" in msg


def test_missing_dense_key(sources, tmp_path):
    src = _copy(sources, "mixtral", tmp_path)
    _edit(src, {"model.norm.weight": None})
    msg = _refused(src, tmp_path / "out")
    assert msg.endswith("does not match MixtralForCausalLM: 1 missing (model.norm.weight)")


def test_missing_gpt_oss_down_proj_bias(sources, tmp_path):
    src = _copy(sources, "gpt_oss", tmp_path)
    _edit(src, {OSS_DOWN_BIAS: None})
    msg = _refused(src, tmp_path / "out")
    assert msg.endswith(f"does not match GptOssForCausalLM: 1 missing ({OSS_DOWN_BIAS})")


def test_extra_key(sources, tmp_path):
    src = _copy(sources, "gpt_oss", tmp_path)
    _edit(src, {"model.layers.0.self_attn.extra_proj.weight": torch.zeros(2, 2)})
    msg = _refused(src, tmp_path / "out")
    assert msg.endswith("1 unexpected (model.layers.0.self_attn.extra_proj.weight)")


def test_several_faults_are_listed_in_one_error_and_the_cli_exits_2(sources, tmp_path, capsys):
    src = _copy(sources, "mixtral", tmp_path)
    rows, cols = _shape(src, MIX_DENSE)
    inter, hidden = _shape(src, MIX_W1)
    missing_expert = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    beyond = "model.layers.1.block_sparse_moe.experts.4.w1.weight"
    _edit(src, {
        MIX_DENSE: torch.zeros(cols, rows + 3),
        MIX_W1: torch.zeros(inter + 1, hidden),
        "model.norm.weight": None,
        missing_expert: None,
        beyond: torch.zeros(inter, hidden),
        "lm_head.extra": torch.zeros(3),
        "model.layers.0.input_layernorm.weight": torch.zeros(hidden, dtype=torch.int32),
    })
    out = tmp_path / "out"
    assert cli(["convert", str(src), str(out), "--ep-degree", "2"]) == 2
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))
    msg = capsys.readouterr().err
    assert "does not match MixtralForCausalLM: 2 missing (" in msg
    assert missing_expert in msg and "model.norm.weight" in msg
    assert f"2 unexpected (lm_head.extra, {beyond} (the model has 4 experts))" in msg
    assert f"{MIX_DENSE}: ({cols}, {rows + 3}) in the file, the model expects ({rows}, {cols})" in msg
    assert f"{MIX_W1}: ({inter + 1}, {hidden}) in the file, the model expects ({inter}, {hidden})" in msg
    assert "2 with the wrong shape" in msg
    assert ("1 with the wrong dtype (model.layers.0.input_layernorm.weight: I32 in the file, "
            "the model expects a floating-point tensor)") in msg


def test_long_lists_are_capped(sources, tmp_path):
    src = _copy(sources, "mixtral", tmp_path)
    keys = [k for k in read_index(src).specs if ".experts." not in k and k.startswith("model.layers.")]
    _edit(src, dict.fromkeys(keys))
    msg = _refused(src, tmp_path / "out")
    assert len(keys) > 10
    assert f"{len(keys)} missing (" in msg and f"... and {len(keys) - 10} more)" in msg


def test_classify_keys_refuses_an_experts_tensor_without_the_expert_dimension():
    specs = {OSS_GATE_UP: TensorSpec(OSS_GATE_UP, torch.float32, (5, 65, 65))}
    needle = r"gate_up_proj' of shape \(5, 65, 65\) is under an experts module.*expert count 4"
    with pytest.raises(CheckpointError, match=needle):
        classify_keys(specs, 4)


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_lm_head_may_be_absent(sources, tied):
    config = read_config(sources["mixtral"])
    config.tie_word_embeddings = tied
    specs = {k: s for k, s in read_index(sources["mixtral"]).specs.items() if k != "lm_head.weight"}
    if tied:
        validate_against_model(build_meta_model(config), specs, "tied")
    else:
        with pytest.raises(CheckpointError, match=r"MixtralForCausalLM: 1 missing \(lm_head.weight\)$"):
            validate_against_model(build_meta_model(config), specs, "untied")


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_unmodified_checkpoints_still_convert(sources, tmp_path, family, dtype):
    out = hep.convert_checkpoint(sources[family], tmp_path / "out", ep_degree=2, dtype=dtype, progress=False)
    index = read_index(out)
    assert index.specs.keys() == read_index(sources[family]).specs.keys()
    if dtype == "bfloat16":
        assert index.hybrid_ep.dtype == "bfloat16"


class _TensorOps(TorchDispatchMode):
    """The devices of every tensor an ATen op inside reads or makes, and the number of ops."""

    def __init__(self) -> None:
        super().__init__()
        self.ops, self.devices = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        self.devices.update(str(t.device) for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
        return out


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_validation_reads_no_tensor_data_and_reverses_each_fused_tensor_once(sources, family, monkeypatch):
    """What keeps validation cheap at any size, counted: every tensor op it runs is on the meta device (shapes
    only, no data read or made), and each converter's reverse runs once per model tensor the checkpoint fills
    through it (the tensors it does not name directly), not once per key."""
    from transformers.core_model_loading import WeightConverter

    model = model_experts(sources[family]).model
    specs = read_index(sources[family]).specs
    reversals = []
    real = WeightConverter.reverse_transform
    monkeypatch.setattr(WeightConverter, "reverse_transform", lambda self: reversals.append(self) or real(self))
    with _TensorOps() as ops:
        validate_against_model(model, specs, str(sources[family]))
    assert ops.devices <= {"meta"}, ops.devices
    fused = [f"{name}.{p}" for name, module in hep.find_experts_modules(model)  # combined from per-expert keys
             for p, _ in module.named_parameters(recurse=False) if f"{name}.{p}" not in specs]
    assert len(fused) == {"mixtral": 4, "gpt_oss": 0}[family], fused  # GPT-OSS checkpoints hold them fused
    assert len(reversals) == len(fused), (len(reversals), fused)
