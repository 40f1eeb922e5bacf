"""Publish a hybrid-EP checkpoint or a PEFT adapter to the Hub with a model card (through ``huggingface_hub``)."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from .checkpoint.format import read_index
from .errors import CheckpointError

# The repository's model_cards/ directory, shipped in the wheel as the package hf_hybrid_ep.model_cards.
TEMPLATE = resources.files("hf_hybrid_ep.model_cards").joinpath("hybrid_ep_model_card.md")
ADAPTER_TEMPLATE = resources.files("hf_hybrid_ep.model_cards").joinpath("lora_adapter_model_card.md")
ADAPTER_CONFIG = "adapter_config.json"  # a PEFT adapter directory (save_pretrained of a PeftModel)


def render_model_card(ckpt_dir: str | os.PathLike[str], repo_id: str):
    """A ``huggingface_hub.ModelCard`` for the checkpoint, rendered from the repository's ``model_cards/hybrid_ep_model_card.md`` (package data of ``hf_hybrid_ep.model_cards``)."""
    from huggingface_hub import ModelCard, ModelCardData

    if not TEMPLATE.is_file():
        raise CheckpointError(f"model-card template {str(TEMPLATE)!r} is missing")
    index = read_index(ckpt_dir)
    meta = index.hybrid_ep
    if meta is None:
        raise CheckpointError(f"{str(ckpt_dir)!r} is not a hybrid-EP checkpoint (no hybrid_ep metadata)")
    base_model = meta.source.get("repo_id")
    data = ModelCardData(
        base_model=base_model,
        library_name="transformers",
        tags=["moe", "hybrid-ep", "expert-parallel", "safetensors"],
    )
    if meta.per_layer:
        placement_summary = f"one table per MoE layer ({len(meta.placement)} layers; see the index's metadata)"
    else:
        from .dispatch import PlacementTable

        contiguous = PlacementTable.from_rows(meta.num_experts, meta.placement).is_contiguous()
        placement_summary = (f"contiguous, {len(meta.placement[0])} experts per EP rank" if contiguous
                             else str(meta.placement))
    return ModelCard.from_template(
        data,
        template_path=str(TEMPLATE),
        model_name=repo_id.split("/")[-1],
        base_model=base_model or "a local checkpoint",
        ep_degree=meta.ep_degree,
        num_experts=meta.num_experts,
        num_moe_layers=meta.num_moe_layers,
        placement_summary=placement_summary,
        storage=meta.storage,
        dtype=meta.dtype,
        weights=_weights_origin(meta.source),
        repo_id=repo_id,
    )


def render_adapter_card(adapter_dir: str | os.PathLike[str], repo_id: str):
    """A ``huggingface_hub.ModelCard`` for a PEFT LoRA adapter directory, naming its base model and its LoRA
    targets, rendered from ``model_cards/lora_adapter_model_card.md``."""
    import json

    from huggingface_hub import ModelCard, ModelCardData

    if not ADAPTER_TEMPLATE.is_file():
        raise CheckpointError(f"model-card template {str(ADAPTER_TEMPLATE)!r} is missing")
    path = Path(adapter_dir) / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{str(path)!r} is not a PEFT adapter config: {err}") from err
    named = config.get("base_model_name_or_path") or ""
    local = os.path.isabs(named) or Path(named).exists() or named.count("/") > 1
    base_model = None if local or not named else named  # a Hub repo id; never a local path on the Hub
    shown = base_model or (f"a local checkpoint ({Path(named).name})" if named else "a local checkpoint")

    def targets(key: str) -> str:
        value = config.get(key) or []
        return ", ".join(f"`{t}`" for t in sorted(value)) if not isinstance(value, str) else f"`{value}`"

    data = ModelCardData(base_model=base_model, library_name="peft",
                         tags=["lora", "moe", "hybrid-ep", "expert-parallel", "safetensors"])
    return ModelCard.from_template(
        data, template_path=str(ADAPTER_TEMPLATE), model_name=repo_id.split("/")[-1],
        base_model=shown, rank=config.get("r"), alpha=config.get("lora_alpha"),
        target_modules=targets("target_modules") or "none", target_parameters=targets("target_parameters") or "none",
        repo_id=repo_id,
    )


def _weights_origin(source: dict) -> str:
    """Where the weights' values come from: ``dequantized from fp8 block 128×128 to bfloat16`` or as is."""
    record = source.get("dequantized_from")
    if not record:
        return "as in the source"
    return f"dequantized from {record['description']} to {record['dtype']} (hf-hybrid-ep convert)"


def push_to_hub(
    ckpt_dir: str | os.PathLike[str],
    repo_id: str,
    *,
    token: str | None = None,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str = "Upload hybrid-EP checkpoint",
) -> str:
    """Create ``repo_id`` if needed and upload the checkpoint folder plus a rendered README.md: a hybrid-EP
    checkpoint, or a PEFT adapter directory (``save_pretrained`` of a parallelized ``PeftModel``; its card names
    the base model and the LoRA targets).

    Returns the commit URL. The token is passed to ``huggingface_hub`` and never printed or logged.
    """
    from huggingface_hub import HfApi

    adapter = (Path(ckpt_dir) / ADAPTER_CONFIG).is_file()
    card = render_adapter_card(ckpt_dir, repo_id) if adapter else render_model_card(ckpt_dir, repo_id)
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    (Path(ckpt_dir) / "README.md").write_text(str(card))
    info = api.upload_folder(
        folder_path=str(ckpt_dir), repo_id=repo_id, revision=revision, commit_message=commit_message,
    )
    return str(getattr(info, "commit_url", info))
