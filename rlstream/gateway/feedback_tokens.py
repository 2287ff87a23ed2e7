"""Presigned feedback tokens: the ``x-rlstream-feedback-token`` of a captured response.

A token lets whoever holds the response (an agent's front end, a browser's thumbs-up button) send feedback for that
one trajectory or session without an API key, as LangSmith's presigned feedback URLs do. It is
``rlsft1.<payload>.<mac>``: the payload (base64url JSON) names the tenant, what is addressed (a trajectory or a
session) and an expiry (unix seconds); the mac is HMAC-SHA256 over ``rlsft1.<payload>`` with the gateway's secret.
Every gateway behind one load balancer must share the secret (``--feedback-secret`` or its environment variable);
a gateway without one generates a random secret at start, and its tokens die with it.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from typing import Literal

PREFIX = "rlsft1"
#: what a token addresses: a trajectory id or a (tenant-scoped) session id
TargetKind = Literal["trajectory", "session"]
_KIND_CODES: dict[str, TargetKind] = {"t": "trajectory", "s": "session"}
_CODE_OF_KIND = {kind: code for code, kind in _KIND_CODES.items()}
#: tokens longer than this are refused before any decoding (a trajectory id is 32 hex digits)
MAX_TOKEN_CHARS = 2048


class FeedbackTokenError(ValueError):
    """A token that is malformed, not signed by this gateway's secret, or expired (``expired`` says which)."""

    def __init__(self, message: str, expired: bool = False) -> None:
        super().__init__(message)
        self.expired = expired


@dataclass(frozen=True)
class FeedbackGrant:
    """What a valid token allows: feedback for ``target_id`` (a ``kind``) of ``tenant``, until ``expires_at``."""

    tenant: str
    kind: TargetKind
    target_id: str
    expires_at: int


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def is_feedback_token(value: str) -> bool:
    """True when ``value`` has the shape of a feedback token (as opposed to an API key)."""
    return value.startswith(PREFIX + ".")


def generate_secret() -> bytes:
    """A fresh 32-byte signing secret."""
    return secrets.token_bytes(32)


class FeedbackSigner:
    """Issues and checks feedback tokens with one secret."""

    def __init__(self, secret: bytes | str, ttl_s: float) -> None:
        key = secret.encode() if isinstance(secret, str) else secret
        if len(key) < 16:
            raise ValueError("the feedback token secret must have at least 16 bytes")
        self._keyed = hmac.new(key, digestmod=hashlib.sha256)  # copied per token: the key is set up once
        self.ttl_s = ttl_s

    def _mac(self, signed: str) -> str:
        mac = self._keyed.copy()
        mac.update(signed.encode("ascii"))
        return _b64(mac.digest())

    def issue(self, tenant: str, kind: TargetKind, target_id: str, now: float | None = None) -> str:
        """A token for feedback on ``target_id`` by ``tenant``, valid for ``ttl_s`` from ``now``."""
        expires = int((time.time() if now is None else now) + self.ttl_s)
        payload = json.dumps([tenant, _CODE_OF_KIND[kind], target_id, expires], separators=(",", ":"))
        signed = f"{PREFIX}.{_b64(payload.encode())}"
        return f"{signed}.{self._mac(signed)}"

    def verify(self, token: str, now: float | None = None) -> FeedbackGrant:
        """The grant of ``token``; :class:`FeedbackTokenError` when it is malformed, forged or expired."""
        if len(token) > MAX_TOKEN_CHARS or not is_feedback_token(token):
            raise FeedbackTokenError("not a feedback token")
        signed, _, mac = token.rpartition(".")
        if not hmac.compare_digest(self._mac(signed).encode(), mac.encode("ascii", errors="replace")):
            raise FeedbackTokenError("feedback token not valid (wrong signature)")
        try:
            tenant, code, target_id, expires = json.loads(_unb64(signed.split(".", 1)[1]))
            grant = FeedbackGrant(str(tenant), _KIND_CODES[code], str(target_id), int(expires))
        except (binascii.Error, ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
            raise FeedbackTokenError("feedback token not valid (malformed payload)") from exc
        if (time.time() if now is None else now) >= grant.expires_at:
            raise FeedbackTokenError("feedback token expired", expired=True)
        return grant
