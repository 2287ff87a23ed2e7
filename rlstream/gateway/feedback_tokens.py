"""Presigned feedback tokens: the ``x-rlstream-feedback-token`` of a captured response.

A token lets whoever holds the response (an agent's front end, a browser's thumbs-up button) send feedback for that
one trajectory or session without an API key, as LangSmith's presigned feedback URLs do. It is
``rlsft1.<payload>.<mac>``: the payload (base64url JSON) names the tenant, what is addressed (a trajectory or a
session), an expiry (unix seconds), the id of the API key whose call the token came with (a token dies with that
key: the gateway refuses it once the key is revoked) and, for a trajectory, its example and group ids: any gateway
publishes the reward from the token alone, without having seen the call; the mac is HMAC-SHA256 over
``rlsft1.<payload>`` with the gateway's secret. Every gateway behind one load balancer must share the secret
(``gateway.feedback_secret``); a gateway without one generates a random secret at start, and its tokens die with it.
Rotation: the new secret becomes ``feedback_secret`` and the old one ``feedback_secret_previous``; both verify, only
the current one signs.
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
    """What a valid token allows: feedback for ``target_id`` (a ``kind``) of ``tenant``, until ``expires_at``, while
    the key ``key_id`` (whose call issued it; '' on an open gateway) is not revoked. A trajectory's token also names
    its ``example_id`` and ``group_id`` ('' in a token issued without them)."""

    tenant: str
    kind: TargetKind
    target_id: str
    expires_at: int
    key_id: str = ""
    example_id: str = ""
    group_id: str = ""


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


def _keyed(secret: bytes | str) -> "hmac.HMAC":
    key = secret.encode() if isinstance(secret, str) else secret
    if len(key) < 16:
        raise ValueError("the feedback token secret must have at least 16 bytes")
    return hmac.new(key, digestmod=hashlib.sha256)


class FeedbackSigner:
    """Issues feedback tokens with one secret and checks them with it or ``previous`` (a rotated-out secret)."""

    def __init__(self, secret: bytes | str, ttl_s: float, previous: bytes | str | None = None) -> None:
        self._keyed = [_keyed(secret)]  # copied per token: each key is set up once
        if previous is not None:
            self._keyed.append(_keyed(previous))
        self.ttl_s = ttl_s

    def _mac(self, signed: str, keyed: "hmac.HMAC | None" = None) -> str:
        mac = (keyed or self._keyed[0]).copy()
        mac.update(signed.encode("ascii"))
        return _b64(mac.digest())

    def issue(self, tenant: str, kind: TargetKind, target_id: str, now: float | None = None,
              key_id: str = "", example_id: str = "", group_id: str = "") -> str:
        """A token for feedback on ``target_id`` by ``tenant``, valid for ``ttl_s`` from ``now`` while the key
        ``key_id`` (the caller's) stays valid; a trajectory's ``example_id`` and ``group_id`` ride along."""
        expires = int((time.time() if now is None else now) + self.ttl_s)
        fields: list[object] = [tenant, _CODE_OF_KIND[kind], target_id, expires, key_id]
        if example_id or group_id:
            fields += [example_id, group_id]
        payload = json.dumps(fields, separators=(",", ":"))
        signed = f"{PREFIX}.{_b64(payload.encode())}"
        return f"{signed}.{self._mac(signed)}"

    def verify(self, token: str, now: float | None = None) -> FeedbackGrant:
        """The grant of ``token``; :class:`FeedbackTokenError` when it is malformed, forged or expired."""
        if len(token) > MAX_TOKEN_CHARS or not is_feedback_token(token):
            raise FeedbackTokenError("not a feedback token")
        signed, _, mac = token.rpartition(".")
        given = mac.encode("ascii", errors="replace")
        # every secret is tried (a list, not a short-circuit): the time does not say which one matched
        if not any([hmac.compare_digest(self._mac(signed, keyed).encode(), given) for keyed in self._keyed]):
            raise FeedbackTokenError("feedback token not valid (wrong signature)")
        try:
            fields = json.loads(_unb64(signed.split(".", 1)[1]))
            tenant, code, target_id, expires, key_id = fields[:5]
            example_id, group_id = fields[5:7] if len(fields) >= 7 else ("", "")
            grant = FeedbackGrant(str(tenant), _KIND_CODES[code], str(target_id), int(expires), str(key_id),
                                  str(example_id), str(group_id))
        except (binascii.Error, ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
            raise FeedbackTokenError("feedback token not valid (malformed payload)") from exc
        if (time.time() if now is None else now) >= grant.expires_at:
            raise FeedbackTokenError("feedback token expired", expired=True)
        return grant
