"""``backend.base_model`` as NAT users write it: a local directory, a Hugging Face model id already in the local
cache, or nothing (the base model the vLLM server serves). Nothing is ever downloaded at run time."""
from __future__ import annotations

import os
from pathlib import Path

import httpx

from rlstream.nat.nat_config import NatConfigError


def local_dir(value: str, cwd: Path | None = None) -> Path | None:
    """``value`` as an existing local directory (relative to ``cwd``), else None."""
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = (cwd or Path.cwd()) / path
    return path.resolve() if path.is_dir() else None


def cached_snapshot(model_id: str) -> Path | None:
    """The local snapshot of a Hugging Face model id (never downloaded; ``HF_HUB_OFFLINE`` or not), else None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(model_id, local_files_only=True))
    except HFValidationError:
        return None  # not a valid repo id: a path that does not exist
    except Exception:  # LocalEntryNotFoundError and friends: not in the cache
        return None


def served_base_model(server_url: str, api_key: str | None = None) -> str | None:
    """The base model of the vLLM server at ``server_url`` (``root`` of its first non-LoRA ``/v1/models`` entry)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{server_url.rstrip('/')}/v1/models", headers=headers, timeout=10.0)
        response.raise_for_status()
        models = response.json().get("data", [])
    except (httpx.HTTPError, ValueError) as exc:
        raise NatConfigError(f"backend.base_model is not set and the vLLM server {server_url} did not list its "
                             f"models ({type(exc).__name__}: {exc}): set backend.base_model") from exc
    for model in models:
        if not model.get("parent"):  # a LoRA adapter names its base model as parent
            return str(model.get("root") or model.get("id"))
    return None


def resolve_base_model(value: str | None, server_url: str | None, api_key: str | None = None) -> Path:
    """The local directory of the model to train (see the module docstring); a clear ``NatConfigError`` when
    ``value`` is neither a directory nor a cached model id."""
    source = "backend.base_model"
    if not value:
        if not server_url:
            raise NatConfigError("backend.base_model is not set and there is no vLLM server to ask: set "
                                 "backend.base_model to the model's directory")
        value = served_base_model(server_url, api_key)
        if not value:
            raise NatConfigError(f"backend.base_model is not set and the vLLM server {server_url} lists no base "
                                 "model: set backend.base_model")
        source = f"the base model of the vLLM server {server_url} (backend.base_model not set)"
    found = local_dir(value) or cached_snapshot(value)
    if found is not None:
        return found
    offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") \
        else ""
    raise NatConfigError(
        f"{source} {value!r} is neither a local directory (looked in {Path.cwd()}) nor a model in the Hugging Face "
        f"cache{offline}; rlstream never downloads at run time: download it first (`huggingface-cli download "
        f"{value}`), or point base_model at the directory vLLM serves (`rlstream models tiny DIR` builds a small "
        "test model)")
