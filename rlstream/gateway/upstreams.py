"""Where the gateway may send requests (and with them the upstream's key): ``gateway.upstream_allowlist``.

A replica's address comes from its worker's heartbeat in Redis; whoever can write Redis could otherwise point the
gateway at a listener of their own and receive the clients' conversations with ``Authorization: Bearer <upstream
key>``. Only hosts and networks in the allowlist are used; a heartbeat naming anything else is ignored, logged once
per address and counted (``refused``)."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Iterable

import httpx

from rlstream.schemas.masking import mask_url
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
