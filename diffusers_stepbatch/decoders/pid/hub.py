"""Loading the released nvidia/PiD checkpoints.

Layout (reference `scripts/convert_distcp_to_pt.py`): the Hub repository `nvidia/PiD` holds one file per
checkpoint, `checkpoints/<checkpoint>/model_ema_bf16.pth`, written by `torch.save` as a flat dict
`{"net.<parameter name>": bfloat16 tensor}` (the EMA weights, renamed from `net_ema.` to `net.`). There is no
config inside; the network shape comes from `configs.OFFICIAL_CONFIGS`.

The loader downloads with `hf_hub_download` (pinned revision, standard cache, `HF_HUB_OFFLINE` honoured),
checks the file against the checksum the Hub gave it, reads it with `torch.load(weights_only=True,
mmap=True)` (never full unpickling), maps the keys and loads strictly (`model.load_official_decoder`).

>>> path = download_official_checkpoint("PiD_res2k_sr4x_official_flux_distill_4step")
>>> state = map_official_keys(read_checkpoint(path))
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any, Mapping

import torch

from .configs import get_official_config

__all__ = [
    "DEFAULT_REVISION",
    "OFFICIAL_REPO_ID",
    "PiDCheckpointError",
    "PiDCheckpointNotFoundError",
    "download_official_checkpoint",
    "load_official_state_dict",
    "map_official_keys",
    "read_checkpoint",
    "save_official_checkpoint",
]

OFFICIAL_REPO_ID = "nvidia/PiD"
# NOTE: the Hub commit that released PiD v1.5 (linked from the reference README, July 2026); every checkpoint in
# `configs.OFFICIAL_CONFIGS` was published at or before it. Pass `revision=` to use another one.
DEFAULT_REVISION = "3348c59bb545d9d0e29c2dec4c79b94592b83e8c"

_EMA_PREFIX = "net_ema."
_NET_PREFIX = "net."
# Other modules a training checkpoint may carry next to the decoder; never part of the decoder.
_TRAINING_ONLY_PREFIXES = ("fake_score.", "discriminator.", "teacher.")
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")
_NESTED_KEYS = ("model", "state_dict", "ema", "net_ema", "net")
_MAX_LISTED_KEYS = 40


class PiDCheckpointError(RuntimeError):
    """A checkpoint file is unreadable, corrupted, or does not match the decoder."""


class PiDCheckpointNotFoundError(PiDCheckpointError, FileNotFoundError):
    """A checkpoint file is neither in the cache nor downloadable."""


def _offline() -> bool:
    # NOTE: huggingface_hub reads HF_HUB_OFFLINE once at import; re-read it so a later setting is honoured too.
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE", "")
    return constants.HF_HUB_OFFLINE or value.upper() in {"1", "ON", "YES", "TRUE"}


def download_official_checkpoint(
    checkpoint: str,
    *,
    repo_id: str = OFFICIAL_REPO_ID,
    revision: str | None = DEFAULT_REVISION,
    cache_dir: str | Path | None = None,
    force_download: bool = False,
    local_files_only: bool = False,
    token: str | bool | None = None,
) -> str:
    """Path of `checkpoints/<checkpoint>/model_ema_bf16.pth` in the local Hub cache, downloading it if needed."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, OfflineModeIsEnabled

    filename = f"checkpoints/{checkpoint}/model_ema_bf16.pth"
    offline = local_files_only or _offline()
    where = f"{filename} of {repo_id}@{revision or 'main'}"
    try:
        return hf_hub_download(
            repo_id=repo_id,
            filename=filename,
            revision=revision,
            cache_dir=cache_dir,
            force_download=force_download,
            local_files_only=offline,
            token=token,
            endpoint=os.environ.get("HF_ENDPOINT") or None,
        )
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:
        if offline:
            raise PiDCheckpointNotFoundError(
                f"{where} is not in the Hugging Face cache and downloads are off (HF_HUB_OFFLINE or "
                f"local_files_only=True). Fetch it once online: `hf download {repo_id} {filename} --revision "
                f"{revision or 'main'}`, or unset HF_HUB_OFFLINE."
            ) from exc
        raise PiDCheckpointNotFoundError(f"could not download {where}: {exc}") from exc
    except EntryNotFoundError as exc:
        raise PiDCheckpointNotFoundError(
            f"{where} does not exist; check the checkpoint name and the revision"
        ) from exc


def verify_cached_file(path: str | Path) -> None:
    """Compare a Hub-cache file with the checksum it is stored under (its blob name); raise if they differ.

    LFS files are stored under their sha256, small files under their git blob sha1. Files outside a Hub cache
    (no blob name to compare with) pass unchecked.
    """
    blob = Path(os.path.realpath(path))
    expected = blob.name
    if re.fullmatch(r"[0-9a-f]{64}", expected):
        digest = hashlib.sha256()
    elif re.fullmatch(r"[0-9a-f]{40}", expected):
        digest = hashlib.sha1(f"blob {blob.stat().st_size}\0".encode())
    else:
        return
    with open(blob, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise PiDCheckpointError(
            f"{path} is corrupted or truncated: its checksum {digest.hexdigest()} differs from the Hub's {expected}. "
            "Delete it or load again with force_download=True."
        )


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a `.pth` checkpoint memory-mapped, with `weights_only=True` (no arbitrary unpickling)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError, UnpicklingError, EOFError, ... here
        raise PiDCheckpointError(
            f"{path} is not a readable PyTorch checkpoint (truncated or corrupted download?): "
            f"{type(exc).__name__}: {exc}. Delete it or load again with force_download=True."
        ) from exc


def _unwrap(state: Mapping[str, Any]) -> Mapping[str, Any]:
    while len(state) == 1:
        (key, value), = state.items()
        if key not in _NESTED_KEYS or not isinstance(value, Mapping):
            break
        state = value
    return state


def map_official_keys(state: Mapping[str, Any]) -> dict[str, Any]:
    """Map a released (or training) state dict to `PiDDecoder` parameter names.

    `net_ema.<name>` (EMA weights, preferred when present) or `net.<name>` -> `<name>`; other copies and
    training-only modules (`fake_score.`, `discriminator.`, `teacher.`) are dropped; `_orig_mod.` / `module.`
    wrappers are stripped. Anything else is kept, so a strict load reports it.
    """
    state = _unwrap(state)
    keys = list(state)
    prefix = next((p for p in (_EMA_PREFIX, _NET_PREFIX) if any(k.startswith(p) for k in keys)), "")
    mapped: dict[str, Any] = {}
    for key, value in state.items():
        if prefix and key.startswith(prefix):
            key = key[len(prefix) :]
        elif prefix and key.startswith((_EMA_PREFIX, _NET_PREFIX, *_TRAINING_ONLY_PREFIXES)):
            continue
        while key.startswith(_WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        mapped[key] = value
    return mapped


def _listed(keys: list[str]) -> str:
    shown = ", ".join(keys[:_MAX_LISTED_KEYS])
    more = len(keys) - _MAX_LISTED_KEYS
    return f"[{shown}{f', ... and {more} more' if more > 0 else ''}]"


def load_official_state_dict(
    model: torch.nn.Module, state: Mapping[str, Any], *, source: str = "checkpoint", assign: bool = False
) -> None:
    """Load a released state dict strictly; missing, unexpected or mis-shaped keys raise one error listing them.

    `assign=True` adopts the given tensors (dtype and device included) instead of copying into the model's.
    """
    mapped = map_official_keys(state)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(mapped))
    unexpected = sorted(set(mapped) - set(expected))
    mismatched = [
        f"{k}: checkpoint {tuple(getattr(mapped[k], 'shape', ()))} vs model {tuple(expected[k].shape)}"
        for k in sorted(set(expected) & set(mapped))
        if not isinstance(mapped[k], torch.Tensor) or mapped[k].shape != expected[k].shape
    ]
    if missing or unexpected or mismatched:
        raise PiDCheckpointError(
            f"{source} does not match this PiDDecoder config: {len(missing)} missing keys {_listed(missing)}; "
            f"{len(unexpected)} unexpected keys {_listed(unexpected)}; {len(mismatched)} shape mismatches "
            f"{_listed(mismatched)}. Use the constructor values of the checkpoint (configs.OFFICIAL_CONFIGS)."
        )
    model.load_state_dict(mapped, strict=True, assign=assign)


def save_official_checkpoint(model: torch.nn.Module, path: str | Path, *, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write `model` in the released layout: `torch.save({"net.<name>": tensor})`, float tensors cast to `dtype`."""
    state = {
        f"{_NET_PREFIX}{k}": (v.detach().to(dtype) if v.is_floating_point() else v.detach()).cpu().contiguous()
        for k, v in model.state_dict().items()
    }
    torch.save(state, path)
