"""A drafter on the Hugging Face Hub: the files read from a repo, and a drafter published in any of its layouts.

Kept apart from the drafter contract (:mod:`.base`), whose ``from_pretrained`` and ``push_to_hub`` call these.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from .model_card import write_model_card
from .registry import kind_of

if TYPE_CHECKING:
    from torch import nn

    from .base import Drafter

# The files a drafter of any readable layout is loaded from (what from_pretrained downloads from the Hub).
DRAFTER_FILES = ("config.json", "README.md", "*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin",
                 "pytorch_model.bin.index.json", "hot_token_map.pt")


def download_drafter(repo_id: str, **hub_kwargs) -> Path:
    """The local folder of the drafter repo ``repo_id`` (huggingface_hub's ``snapshot_download``), fetching only
    what a drafter is read from: public drafter repos often also hold training states."""
    from huggingface_hub import snapshot_download

    hub_kwargs.setdefault("allow_patterns", list(DRAFTER_FILES))
    return Path(snapshot_download(repo_id, **hub_kwargs))


def push_drafter(drafter: Drafter, repo_id: str, private: bool | None = None, token: str | None = None,
                 commit_message: str | None = None, model_card: dict | None = None, layout: str = "tlt",
                 verifier_name_or_path: str | nn.Module | None = None, **export_kwargs) -> str:
    """Upload ``drafter`` with a model card as the model repo ``repo_id``; returns the commit URL (see
    :meth:`Drafter.push_to_hub`)."""
    from huggingface_hub import HfApi

    layouts = kind_of(drafter).exports
    if layout != "tlt" and layout not in layouts:
        raise ValueError(f"layout={layout!r}: choose 'tlt' or one of {sorted(layouts)}.")
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    card = {"repo_id": repo_id, **(model_card or {})}
    with tempfile.TemporaryDirectory() as tmp:
        if layout == "tlt":
            drafter.save_pretrained(tmp, model_card=card)
        else:
            drafter.export(tmp, layout, verifier_name_or_path, **export_kwargs)
            served = {"sglang": "sglang_model"}.get(layout, "vllm_model")
            k = export_kwargs.get("num_speculative_tokens", 3)
            write_model_card(drafter, tmp, **({served: repo_id, "num_speculative_tokens": k} | card))
        info = api.upload_folder(repo_id=repo_id, folder_path=tmp,
                                 commit_message=commit_message or f"Upload {drafter.config.architecture} ({layout})")
    return str(info)
