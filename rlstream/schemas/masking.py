"""Secrets in the configuration: typed fields that never show their value, and masking of text.

* :data:`Secret` (a pydantic ``SecretStr``) holds a password (``kafka.sasl_plain_password``, ``kafka.ssl_password``).
  Code that needs the value calls ``get_secret_value()``; ``str()``/``repr()`` show ``**********``.
* :data:`SecretUrl` is a plain ``str`` (every client takes it as is) whose password part
  (``redis://:PASSWORD@host``, ``https://user:PASSWORD@registry``, ``?password=PASSWORD``) is masked when the
  config is dumped as JSON/YAML (``rlstream config show``, files a run writes).
* JSON dumps mask by default. ``model_dump(mode="json", context=REVEAL)`` keeps the values (only for an in-memory
  round trip, never for output); ``context=OMIT`` writes ``null`` for a password (config files for child
  processes, which get the values through the environment: :func:`secret_env`).
* Every secret value a config held is remembered, so :func:`mask_text` (used by the log pipeline and
  ``rlstream status``) masks it wherever it appears, even inside an error message of a library.
"""
from __future__ import annotations

import re
import threading
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AfterValidator, PlainSerializer, SecretStr, SerializationInfo

if TYPE_CHECKING:
    from rlstream.schemas.config import RlstreamConfig

MASK = "**********"
#: ``model_dump(mode="json", context=REVEAL)``: secret values in clear (in-memory round trips only).
REVEAL = {"secrets": "reveal"}
#: ``model_dump(mode="json", context=OMIT)``: passwords as null, URL passwords masked (files for child processes).
OMIT = {"secrets": "omit"}
#: Shorter values are not masked inside free text (a one-letter password would garble every log line).
MIN_MASKED_LENGTH = 4
#: the api key sent to an OpenAI-compatible server when none is configured (vLLM accepts any)
PLACEHOLDER_API_KEY = "EMPTY"

# scheme://[user]:password@host  ->  the password; and password=... in a query string
_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:/?#@\"']*:)(?P<secret>[^\s@/?#\"']+)(?=@)")
_QUERY_PASSWORD = re.compile(r"(?P<head>[?&](?:password|passwd|pwd)=)(?P<secret>[^&#\s\"']+)", re.IGNORECASE)

_known: set[str] = set()
_known_lock = threading.Lock()
_known_pattern: re.Pattern[str] | None = None


def remember_secret(value: str | None) -> None:
    """Mask ``value`` wherever :func:`mask_text` sees it from now on (in this process)."""
    global _known_pattern
    if not value or len(value) < MIN_MASKED_LENGTH or value == MASK or value in _known:
        return
    with _known_lock:
        _known.add(value)
        # longest first, so that a secret containing another is masked whole
        _known_pattern = re.compile("|".join(re.escape(v) for v in sorted(_known, key=len, reverse=True)))


def url_password(url: str | None) -> str | None:
    """The password inside a URL (user info or a ``password=`` query parameter), else None."""
    if not url:
        return None
    found = _URL_PASSWORD.search(url) or _QUERY_PASSWORD.search(url)
    return found.group("secret") if found else None


def mask_url(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``**********``."""
    text = _URL_PASSWORD.sub(lambda m: m.group("head") + MASK, text)
    return _QUERY_PASSWORD.sub(lambda m: m.group("head") + MASK, text)


def mask_text(text: str) -> str:
    """``text`` with URL passwords and every remembered secret value masked."""
    if not isinstance(text, str) or not text:
        return text
    text = mask_url(text)
    pattern = _known_pattern
    return pattern.sub(MASK, text) if pattern is not None else text


def mask_data(value: Any) -> Any:
    """Masks secrets in every string of nested dicts/lists/tuples (e.g. a status report or a log event)."""
    if isinstance(value, str):
        return mask_text(value)
    if isinstance(value, SecretStr):
        return MASK
    if isinstance(value, dict):
        return {k: mask_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [mask_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(mask_data(v) for v in value)
    return value


def _policy(info: SerializationInfo) -> str:
    context = info.context if isinstance(info.context, dict) else {}
    return str(context.get("secrets", "mask"))


def _remember_secret_str(value: SecretStr) -> SecretStr:
    remember_secret(value.get_secret_value())
    return value


def _serialize_secret(value: SecretStr, info: SerializationInfo) -> Any:
    if not info.mode_is_json():
        return value  # python mode: the SecretStr itself (model_validate takes it back)
    policy = _policy(info)
    if policy == "reveal":
        return value.get_secret_value()
    return None if policy == "omit" else MASK


def _remember_url(value: str) -> str:
    remember_secret(url_password(value))
    return value


def _serialize_url(value: str, info: SerializationInfo) -> str:
    if not info.mode_is_json() or _policy(info) == "reveal":
        return value
    return mask_url(value)


#: A password: ``SecretStr`` that JSON-dumps as ``**********`` (or null/clear text with OMIT/REVEAL).
Secret = Annotated[SecretStr, AfterValidator(_remember_secret_str), PlainSerializer(_serialize_secret)]
#: A URL that may carry a password: a plain str whose password part JSON-dumps masked.
SecretUrl = Annotated[str, AfterValidator(_remember_url), PlainSerializer(_serialize_url)]


def secret_value(value: SecretStr | None) -> str | None:
    """The clear value of an optional secret."""
    return value.get_secret_value() if value is not None else None


def secret_env(cfg: "RlstreamConfig") -> dict[str, str]:
    """The environment variables that carry ``cfg``'s secrets to a child process whose config file was written
    with :data:`OMIT` (environment beats the file: see :mod:`rlstream.schemas.config`)."""
    env: dict[str, str] = {}
    kafka = cfg.kafka
    if kafka.sasl_plain_password is not None:
        env["RLSTREAM_KAFKA__SASL_PLAIN_PASSWORD"] = kafka.sasl_plain_password.get_secret_value()
    if kafka.ssl_password is not None:
        env["RLSTREAM_KAFKA__SSL_PASSWORD"] = kafka.ssl_password.get_secret_value()
    if kafka.schema_registry_basic_auth is not None:
        env["RLSTREAM_KAFKA__SCHEMA_REGISTRY_BASIC_AUTH"] = kafka.schema_registry_basic_auth.get_secret_value()
    if url_password(kafka.schema_registry_url):
        env["RLSTREAM_KAFKA__SCHEMA_REGISTRY_URL"] = str(kafka.schema_registry_url)
    if cfg.rollout.api_key is not None:
        env["RLSTREAM_ROLLOUT__API_KEY"] = cfg.rollout.api_key.get_secret_value()
    if cfg.inference.api_key is not None:
        env["RLSTREAM_INFERENCE__API_KEY"] = cfg.inference.api_key.get_secret_value()
    if url_password(cfg.redis.url):
        env["RLSTREAM_REDIS_URL"] = cfg.redis.url  # the shortcut: it outranks every other environment form
    return env


def public_config_text(cfg: "RlstreamConfig") -> str:
    """``cfg`` as YAML for a file a run writes: no secret in it (passwords null, URL passwords masked),
    with a header saying where the values come from."""
    import yaml

    names = ", ".join(sorted(secret_env(cfg))) or "none set"
    header = ("# written by rlstream: secrets are not stored here; the processes started with this file get them\n"
              f"# from the environment ({names})\n")
    return header + yaml.safe_dump(cfg.model_dump(mode="json", context=OMIT), sort_keys=False)
