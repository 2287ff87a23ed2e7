"""Where the gateway may send requests (and with them the upstream's key): ``gateway.upstream_allowlist``.

A replica's address comes from its worker's heartbeat in Redis; whoever can write Redis could otherwise point the
gateway at a listener of their own and receive the clients' conversations with ``Authorization: Bearer <upstream
key>``. Only hosts and networks in the allowlist are used; a heartbeat naming anything else is ignored, logged once
per address and counted (``refused``)."""
from __future__ import annotations

import asyncio

import ipaddress
from pathlib import Path
from dataclasses import dataclass, field
from typing import Iterable

import httpx

from rlstream.schemas.masking import mask_url
from rlstream.schemas.sampling import server_default_temperature
from rlstream.transport.log import get_logger

log = get_logger(__name__)

#: an allowlist entry that admits any address (the allowlist off)
ANY = "*"

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _host(url: str) -> str | None:
    try:
        host = httpx.URL(url).host
    except (httpx.InvalidURL, ValueError, TypeError):
        return None
    return host.strip("[]").lower() or None


@dataclass
class UpstreamAllowlist:
    """Hosts (any port, compared case-insensitively) and networks (CIDR; they match hosts written as addresses:
    no name is resolved, so a DNS answer cannot widen the list)."""

    hosts: frozenset[str]
    networks: tuple[Network, ...]
    any_host: bool = False
    refused: int = 0  # replica addresses ignored because they are not on the list
    _logged: set[str] = field(default_factory=set)

    @classmethod
    def parse(cls, entries: Iterable[str], upstreams: Iterable[str] = ()) -> "UpstreamAllowlist":
        """The allowlist of ``entries``; without any entry, the hosts of the configured ``upstreams``.
        :class:`ValueError` for an entry that is neither a host nor a network."""
        entries = [e.strip() for e in entries if e.strip()]
        if not entries:
            entries = [h for h in (_host(u) for u in upstreams) if h]
        hosts: set[str] = set()
        networks: list[Network] = []
        for entry in entries:
            if entry == ANY:
                return cls(frozenset(), (), any_host=True)
            if "/" in entry:
                networks.append(ipaddress.ip_network(entry, strict=False))
            elif entry.replace(".", "").replace("-", "").replace(":", "").replace("[", "").replace("]", "").isalnum():
                hosts.add(entry.strip("[]").lower())
            else:
                raise ValueError(f"upstream_allowlist: {entry!r} is neither a host nor a CIDR network")
        return cls(frozenset(hosts), tuple(networks))

    def allows(self, url: str) -> bool:
        """True when requests may go to ``url``; a refusal is counted (and logged once per address)."""
        if self.any_host:
            return True
        host = _host(url)
        if host is not None and (host in self.hosts or self._in_networks(host)):
            return True
        self.refused += 1
        shown = mask_url(url)
        if shown not in self._logged and len(self._logged) < 1024:
            self._logged.add(shown)
            log.warning("replica address not on gateway.upstream_allowlist: ignored", url=shown)
        return False

    def _in_networks(self, host: str) -> bool:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in network for network in self.networks)


def served_base_root(listing: object) -> str | None:
    """The base model of an OpenAI-compatible ``/v1/models`` answer: ``root`` (vLLM: the path or id it loaded) of
    the first entry without a ``parent`` (a LoRA adapter names its base as parent); None when there is none."""
    data = listing.get("data") if isinstance(listing, dict) else None
    for model in data if isinstance(data, list) else []:
        if isinstance(model, dict) and not model.get("parent") and isinstance(model.get("root"), str):
            return str(model["root"])
    return None


async def upstream_default_temperature(client: httpx.AsyncClient, base: str, timeout_s: float = 5.0) -> float | None:
    """The temperature the upstream at ``base`` (ending in ``/v1``) samples a request that names none at, read from
    its base model's ``generation_config.json`` as vLLM does with ``--generation-config auto``
    (:func:`server_default_temperature`); None when it cannot be told (the upstream does not answer, or its base
    model is no directory on this host)."""
    try:  # bounded whatever the transport (a start never waits on an upstream longer)
        response = await asyncio.wait_for(client.get(f"{base}/models", timeout=timeout_s), timeout_s)
        root = served_base_root(response.json()) if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, asyncio.TimeoutError) as exc:
        log.info("upstream's default temperature not known yet", upstream=mask_url(base), error=type(exc).__name__)
        return None
    if root is None or not Path(root).is_dir():
        return None
    return server_default_temperature(root)
