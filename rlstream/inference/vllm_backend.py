"""The vLLM server's weight-management endpoints, over HTTP.

LoRA: ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (needs
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``). Full weights: ``/pause`` -> ``/collective_rpc``
``reload_weights`` -> ``/reset_prefix_cache`` -> ``/resume`` (needs ``VLLM_SERVER_DEV_MODE=1``).
"""
from __future__ import annotations

from pathlib import Path

import httpx

from rlstream.transport.log import get_logger

log = get_logger(__name__)


class BackendError(RuntimeError):
    """The server refused or failed a weight operation."""


class VllmBackend:
    """Async admin client of one vLLM OpenAI server (``url`` without ``/v1``); with ``api_key`` (the server's
    ``--api-key``) every request carries ``Authorization: Bearer``."""

    def __init__(self, url: str, timeout_s: float = 120.0, api_key: str | None = None) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=self.url, timeout=timeout_s, headers=headers)

    async def close(self) -> None:
        await self.http.aclose()

    async def _post(self, path: str, what: str, **kwargs: object) -> httpx.Response:
        try:
            response = await self.http.post(path, **kwargs)  # type: ignore[arg-type]
        except httpx.HTTPError as exc:
            raise BackendError(f"{what}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 300:
            raise BackendError(f"{what}: HTTP {response.status_code}: {response.text[:500]}")
        return response

    async def healthy(self, timeout_s: float | None = None) -> bool:
        """Whether the server answers ``/health`` with 200 (within ``timeout_s``; default: the client's timeout)."""
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s
        try:
            return (await self.http.get("/health", timeout=timeout)).status_code == 200
        except httpx.HTTPError:
            return False

    async def models(self) -> list[str]:
        """The names the server answers to (base model and loaded adapters)."""
        try:
            response = await self.http.get("/v1/models")
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise BackendError(f"list models: {exc}") from exc
        return [m["id"] for m in response.json().get("data", [])]

    async def load_lora(self, name: str, path: Path) -> None:
        await self._post("/v1/load_lora_adapter", f"load LoRA {name}", json={"lora_name": name, "lora_path": str(path)})
        log.info("LoRA adapter loaded", name=name, path=str(path))

    async def unload_lora(self, name: str) -> None:
        await self._post("/v1/unload_lora_adapter", f"unload LoRA {name}", json={"lora_name": name})
        log.info("LoRA adapter unloaded", name=name)

    async def pause(self) -> None:
        await self._post("/pause", "pause", params={"mode": "wait"})

    async def resume(self) -> None:
        await self._post("/resume", "resume")

    async def reload_weights(self, weights_dir: Path) -> None:
        await self._post("/collective_rpc", f"reload weights from {weights_dir}",
                         json={"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}})

    async def reset_prefix_cache(self) -> None:
        await self._post("/reset_prefix_cache", "reset prefix cache")

    async def load_full(self, weights_dir: Path, rollback_dir: Path | None = None) -> None:
        """Swap all weights: pause (in-flight requests finish), reload, reset the prefix cache, resume.

        If the reload fails and ``rollback_dir`` is given, the previous weights are reloaded before
        resuming, so the server never serves a half-loaded model. The server is always resumed.
        """
        await self.pause()
        try:
            try:
                await self.reload_weights(weights_dir)
            except BackendError:
                if rollback_dir is not None:
                    log.warning("full reload failed; restoring the previous weights", previous=str(rollback_dir))
                    await self.reload_weights(rollback_dir)
                raise
            finally:
                await self.reset_prefix_cache()
        finally:
            await self.resume()
        log.info("full weights reloaded", weights=str(weights_dir))
