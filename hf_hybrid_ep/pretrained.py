"""``from_pretrained``: a hybrid-EP model built from a checkpoint, each rank reading only the dense tensors and its
own experts (:mod:`hf_hybrid_ep.model_io.rank_local`), optionally under PEFT with fresh or saved adapters."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from .checkpoint.atomic import open_checkpoint
from .checkpoint.dequantize import quantization_of
from .checkpoint.peft_files import adapter_directory, check_fresh_init, read_adapter_config
from .checkpoint.sources import hub_metadata
from .config import HybridEPConfig
from .engine import parallelize
from .errors import HybridEPConfigError
from .model_io.adapters import init_adapters_, load_adapter_
from .model_io.rank_local import load_rank_local_, with_checkpoint_placement
from .model_io.side_state import load_side_state
from .moe.architecture import build_meta_model, read_config
from .moe.layer import ShardedExperts
from .parallel.devices import rank_device
from .parallel.mesh import default_device_type


def _with_peft(model: nn.Module, peft_config, adapter, is_trainable: bool) -> tuple[nn.Module, Path | None]:
    """``model`` (on the meta device) under PEFT for ``peft_config`` or for the config of the adapter directory
    ``adapter`` (then also returned), with every adapter parameter on the meta device: nothing is drawn."""
    if peft_config is None and adapter is None:
        return model, None
    if peft_config is not None and adapter is not None:
        raise HybridEPConfigError("pass peft_config or adapter, not both: an adapter directory carries its config")
    import copy

    from peft import get_peft_model

    directory = None
    if getattr(peft_config, "modules_to_save", None):
        raise HybridEPConfigError("from_pretrained with PEFT does not load modules_to_save; apply get_peft_model to "
                                  "a model in memory and parallelize it")
    if adapter is not None:
        directory = adapter_directory(adapter)
        peft_config = read_adapter_config(directory)
        peft_config.inference_mode = not is_trainable
    else:
        check_fresh_init(peft_config)
        peft_config = copy.deepcopy(peft_config)  # PEFT rewrites targets in place
    with torch.device("meta"):
        return get_peft_model(model, peft_config), directory


def from_pretrained(
    path: str | os.PathLike[str],
    config: HybridEPConfig | None = None,
    *,
    dtype: torch.dtype | None = None,
    revision: str | None = None,
    verify: bool | None = None,
    trust_remote_code: bool = False,
    peft_config=None,
    adapter: str | os.PathLike[str] | None = None,
    is_trainable: bool = False,
) -> nn.Module:
    """Build a hybrid-EP model reading only dense tensors and this rank's experts.

    With ``peft_config`` (a ``peft.LoraConfig``) the model returned is a ``PeftModel`` with fresh adapters
    (:func:`hf_hybrid_ep.model_io.adapters.init_adapters_`); with ``adapter`` (a PEFT adapter directory or Hub
    repo id) one with that adapter, of whose expert factors a rank reads only its own experts' (trainable
    with ``is_trainable``, as ``PeftModel.from_pretrained``). Base weights are frozen.

    ``path`` is a hybrid-EP or plain safetensors checkpoint directory, or a Hub repo id. The model is
    created with parameters on the meta device, sharded by :func:`hf_hybrid_ep.parallelize`, and then
    filled from the checkpoint, each tensor put on this rank's device as it is read (``cuda:LOCAL_RANK``
    under NCCL, the CPU under gloo). The placement stored in a hybrid-EP index (per layer or one table) is used when the
    config gives no explicit table (``placement="contiguous"``, the default) and the layout has its
    EP degree; at another EP degree the experts are laid out contiguously (logged). Collective: call
    on every rank.

    A block-FP8 or MXFP4 checkpoint (its config's ``quantization_config``) is dequantized as it is read
    (to ``dtype``, default bfloat16), of the experts only those this rank holds; the model's config then
    carries no ``quantization_config``. Other quantization methods are refused before any weight is read.

    Every file a rank reads is checked against the index's manifest first: size and save id always,
    sha256 unless ``verify=False`` (default: ``config.verify_checksums``, on). No code from the
    checkpoint runs unless ``trust_remote_code=True``.
    """
    fetch = None
    if Path(path).is_dir():
        root = Path(path)
    else:  # a Hub repo: config, index and side files now; weight files only when a needed key is in them
        from huggingface_hub import hf_hub_download

        root, source, _ = hub_metadata(str(path), revision)

        def fetch(name: str) -> Path:
            return Path(hf_hub_download(source["repo_id"], name, revision=source["revision"]))

    hf_config = read_config(root, trust_remote_code)
    quantization = quantization_of(hf_config, str(path))
    if quantization is not None:  # the model built here is the dequantized one
        del hf_config.quantization_config
    config = with_checkpoint_placement(config or HybridEPConfig(), root)
    verifier = open_checkpoint(root, verify=config.verify_checksums if verify is None else verify,
                               local=fetch is None)
    hf_config._name_or_path = str(path)  # what a PEFT adapter saved from this model names as its base
    model, adapter_dir = _with_peft(build_meta_model(hf_config, trust_remote_code), peft_config, adapter,
                                    is_trainable)
    device = rank_device(default_device_type())  # each tensor goes there as it is read

    def materialize(m: nn.Module, layers: list[ShardedExperts]) -> None:
        if adapter_dir is not None:
            load_adapter_(m, layers, adapter_dir, device=device)
        elif peft_config is not None:
            init_adapters_(m, layers, device=device)
        load_rank_local_(root, m, layers, dtype, fetch, verifier, quantization, device)

    parallelize(model, config, materialize=materialize, source=str(path))
    load_side_state(model, root, verifier)
    model.eval()
    return model

