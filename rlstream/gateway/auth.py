"""Who may call the gateway: bearer API keys per tenant (LiteLLM's virtual keys are the model).

A key (``Authorization: Bearer <key>``) belongs to one tenant and carries scopes (``inference``: chat completions,
responses, models, sessions; ``feedback``: ``/v1/feedback``; ``admin``: ``/rlstream/stats``), the models it may call
(default: the policy's own), the tasks it may name (default: its tenant; ``X-Rlstream-Task`` picks among them),
and optional limits (requests per minute, concurrent requests). Keys come from ``--api-key`` / the
``RLSTREAM_GATEWAY_API_KEYS`` environment variable (the default tenant, every scope, any task, any model) and from a keys file (YAML or JSON),
re-read when it changes, without a restart.

Keys are looked up by their SHA-256 digest (no comparison of the key itself: its timing says nothing about the key),
are never logged (a log line names a key by its ``name`` or a fingerprint), and are registered with the secrets
masking, so that a key quoted in an error is masked wherever logs and reports go.

Without keys the gateway is open (one tenant, every scope): ``rlstream gateway serve`` then binds loopback only.
"""
from __future__ import annotations

import hashlib
import ipaddress
import json
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Literal, MutableMapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from rlstream.gateway.feedback_tokens import is_feedback_token
from rlstream.schemas.config import StreamsConfig
from rlstream.schemas.masking import remember_secret
from rlstream.transport.log import get_logger

log = get_logger(__name__)
_STREAMS = StreamsConfig.model_fields  # the defaults below are the stream app's, declared there

#: ``evaluate``: may name any version (``policy@N`` for an N that neither serves nor is the canary: a candidate)
Scope = Literal["inference", "feedback", "admin", "evaluate"]
ALL_SCOPES: frozenset[str] = frozenset({"inference", "feedback", "admin", "evaluate"})
#: the tenant of ``--api-key`` keys and of an open gateway (no keys)
DEFAULT_TENANT = "default"
TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
#: shorter keys are refused: a key is a secret, not a password someone types
MIN_KEY_CHARS = 16
#: ``models: ["*"]`` lets a key call any model at the upstream (only the policy's calls are captured)
ANY_MODEL = "*"
#: ``tasks: ["*"]`` lets a key name any task (``--api-key`` keys: the operator's own)
ANY_TASK = "*"
#: environment variable with ``--api-key`` keys, comma separated
API_KEYS_ENV = "RLSTREAM_GATEWAY_API_KEYS"
#: where the middleware leaves the caller (a :class:`Principal`, or None for a feedback call without a key)
PRINCIPAL_KEY = "rlstream.principal"
#: where it leaves a feedback token sent as the bearer credential
BEARER_TOKEN_KEY = "rlstream.bearer_token"


class ApiKeySpec(BaseModel):
    """One key of a keys file."""

    model_config = ConfigDict(extra="forbid")

    key: SecretStr = Field(description="the bearer key (a secret: never logged)")
    name: str | None = Field(None, max_length=128, description="a label for logs (the key itself never is)")
    tenant: str = Field(pattern=TENANT_PATTERN, description="whose traffic this key is: sessions, trajectories and "
                        "feedback are scoped to it (required: an entry without one would share the operator's "
                        "tenant, 'default', and with it every trajectory and session of the --api-key keys)")
    scopes: list[Scope] = Field(default_factory=lambda: ["inference", "feedback"],
                                description="inference, feedback, admin, evaluate (policy@N for a version that "
                                "neither serves nor is the canary)")
    models: list[str] | None = Field(None, description="models the key may call; None: the policy's own names; "
                                     "'*': any model of the upstream (calls for other models are not captured)")
    tasks: list[str] | None = Field(None, description="tasks (baseline keys) the key may name with "
                                    "X-Rlstream-Task, the first being its default; None: [tenant]; '*': any task "
                                    "(without the header, none)")
    rpm: int | None = Field(None, ge=1, description="requests per minute (429 beyond)")
    max_concurrent: int | None = Field(None, ge=1, description="requests in flight at once (429 beyond)")

    @field_validator("key")
    @classmethod
    def _long_enough(cls, value: SecretStr) -> SecretStr:
        if len(value.get_secret_value()) < MIN_KEY_CHARS:
            raise ValueError(f"an API key has at least {MIN_KEY_CHARS} characters")
        if is_feedback_token(value.get_secret_value()):
            raise ValueError("an API key cannot look like a feedback token (rlsft1.)")
        return value

    @field_validator("tasks")
    @classmethod
    def _some_task(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("tasks: give at least one task, or leave it out (the tenant)")
        return value


class AccessConfig(BaseModel):
    """Who may call the gateway and what feedback it takes (``prepare_gateway`` fills it from the gateway section,
    the process's flags and the environment)."""

    model_config = ConfigDict(extra="forbid")

    api_keys: list[SecretStr] = Field(default_factory=list, description="keys of the default tenant with every "
                                      "scope (secrets, masked in every output)")
    api_keys_file: Path | None = Field(None, description="YAML or JSON keys file (KeysFile), re-read when it "
                                       "changes")
    feedback_secret: SecretStr | None = Field(None, description="HMAC secret of the feedback tokens (at least 16 "
                                              "bytes; shared by every gateway behind one load balancer). None: a "
                                              "random one per start")
    feedback_secret_previous: SecretStr | None = Field(None, description="the rotated-out secret: its tokens still "
                                                       "verify, none are signed with it")
    feedback_token_ttl_s: float = Field(_STREAMS["reward_window_s"].default, gt=0, description="a feedback token "
                                        "expires this long after its response (gateway.feedback_token_ttl_s, else "
                                        "streams.reward_window_s)")
    reward_range: tuple[float, float] = Field(_STREAMS["reward_range"].default, description="rewards and components "
                                              "outside [low, high] are answered 422 (streams.reward_range)")

    def key_store(self) -> "KeyStore":
        return KeyStore([k.get_secret_value() for k in self.api_keys], self.api_keys_file)


class KeysFile(BaseModel):
    """A keys file: ``keys: [{key, tenant, scopes, models, tasks, rpm, max_concurrent}, ...]`` (or the bare list)."""

    model_config = ConfigDict(extra="forbid")
    keys: list[ApiKeySpec]


def fingerprint(key: str) -> str:
    """A short, non-reversible name of a key for logs."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Principal:
    """The caller of a request."""

    tenant: str
    label: str  # names the key in logs (its ``name`` or a fingerprint)
    key_id: str  # the key's fingerprint: its limits are counted under it
    scopes: frozenset[str]
    models: frozenset[str] | None  # None: the policy's own names
    tasks: tuple[str, ...] | None  # None: any (an open gateway: X-Rlstream-Task as sent)
    rpm: int | None = None
    max_concurrent: int | None = None
    open_access: bool = False

    @classmethod
    def from_spec(cls, spec: ApiKeySpec) -> "Principal":
        key = spec.key.get_secret_value()
        return cls(tenant=spec.tenant, label=spec.name or f"key:{fingerprint(key)}",
                   key_id=fingerprint(key), scopes=frozenset(spec.scopes),
                   models=frozenset(spec.models) if spec.models is not None else None,
                   tasks=tuple(spec.tasks) if spec.tasks is not None else (spec.tenant,), rpm=spec.rpm,
                   max_concurrent=spec.max_concurrent)

    def may_call(self, model: str, policy_models: Iterable[str]) -> bool:
        if self.open_access or (self.models is not None and ANY_MODEL in self.models):
            return True
        allowed = self.models if self.models is not None else frozenset(policy_models)
        return model in allowed


#: the caller of an open gateway (no keys configured)
OPEN = Principal(tenant=DEFAULT_TENANT, label="open", key_id="", scopes=ALL_SCOPES, models=None, tasks=None,
                 open_access=True)


class AuthRefusal(Exception):
    """A request refused before its handler: an HTTP status and an OpenAI-style error."""

    def __init__(self, status: int, message: str, kind: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code

    def body(self) -> bytes:
        return json.dumps({"error": {"message": self.message, "type": self.kind, "param": None,
                                     "code": self.code}}).encode()


def unauthorized(message: str, code: str = "invalid_api_key") -> AuthRefusal:
    return AuthRefusal(401, message, "authentication_error", code)


def forbidden(message: str, code: str = "permission_denied") -> AuthRefusal:
    return AuthRefusal(403, message, "permission_error", code)


def task_for(principal: Principal, asked: str | None) -> str | None:
    """The task (baseline key) of a call: ``asked`` (``X-Rlstream-Task``) when the key may name it, the key's
    first task when none is asked; :class:`AuthRefusal` (403) otherwise."""
    if principal.tasks is None or ANY_TASK in principal.tasks:
        return asked
    if asked is None:
        return principal.tasks[0]
    if asked in principal.tasks:
        return asked
    raise forbidden(f"this API key may not name task {asked!r}", "task_not_allowed")


@dataclass
class _KeyUsage:
    """Token bucket (requests per minute) and in-flight count of one key."""

    tokens: float
    refilled: float
    in_flight: int = 0


def _read_keys_file(path: Path) -> list[ApiKeySpec]:
    raw = yaml.safe_load(path.read_text())  # JSON is YAML too
    data = {"keys": raw} if isinstance(raw, list) else raw
    return KeysFile.model_validate(data).keys


class KeysFileExposed(ValueError):
    """The keys file is readable by its group or by everyone (refused: chmod 600 it)."""


class KeyStore:
    """The gateway's keys: the inline ones and those of a keys file (re-read when its mtime or size changes,
    checked at most every ``reload_check_s``). The file fails closed: at start, a missing, unparsable or exposed one
    (readable by other users: :class:`KeysFileExposed`) raises; later, none of its keys is accepted (logged) while it
    is missing, unparsable or exposed, until it is fixed."""

    def __init__(self, inline_keys: Iterable[str] = (), keys_file: Path | None = None,
                 reload_check_s: float = 1.0) -> None:
        self.keys_file = keys_file
        self.reload_check_s = reload_check_s
        every_scope: list[Scope] = ["inference", "feedback", "admin", "evaluate"]
        self._inline = [ApiKeySpec(key=SecretStr(k), name=f"cli-key-{i}", tenant=DEFAULT_TENANT, scopes=every_scope,
                                   tasks=[ANY_TASK], models=[ANY_MODEL])
                        for i, k in enumerate(inline_keys)]
        self._by_digest: dict[bytes, Principal] = {}
        self._by_key_id: dict[str, Principal] = {}
        self._file_stamp: tuple[int, int, int] | None = None  # mtime, size, mode
        self._checked = 0.0
        self._lock = threading.Lock()
        self._usage: dict[str, _KeyUsage] = {}
        #: called after each change of the keys (a reload of the keys file, or its keys refused)
        self.on_change: list[Callable[[], None]] = []
        self.reloads = 0
        self.reload_errors = 0
        self._rebuild(self._load_file() if keys_file is not None else [])  # at start a bad file stops the start

    @property
    def enabled(self) -> bool:
        """True when any key is configured (or a keys file is, even while it is empty)."""
        return bool(self._by_digest) or self.keys_file is not None

    def __len__(self) -> int:
        return len(self._by_digest)

    @property
    def tenants(self) -> int:
        """How many tenants have keys now."""
        return len({principal.tenant for principal in self._by_digest.values()})

    def _load_file(self) -> list[ApiKeySpec]:
        assert self.keys_file is not None
        stat = self.keys_file.stat()
        if stat.st_mode & 0o077:
            raise KeysFileExposed(f"the API keys file {self.keys_file} is readable by other users (mode "
                                  f"{stat.st_mode & 0o777:o}); chmod 600 it")
        specs = _read_keys_file(self.keys_file)
        self._file_stamp = (stat.st_mtime_ns, stat.st_size, stat.st_mode)
        return specs

    def _refuse_file(self, exc: Exception) -> None:
        """Fail closed: none of the keys file's keys is accepted (the inline keys stay)."""
        self.reload_errors += 1
        self._rebuild([])
        # the message of a validation error may quote a key: only its kind and location are logged
        where = [".".join(str(p) for p in e["loc"]) for e in exc.errors()] if isinstance(exc, ValidationError) else []
        log.error("API keys file unusable: its keys are refused until it is fixed", path=str(self.keys_file),
                  error=type(exc).__name__, fields=where,
                  reason=str(exc) if isinstance(exc, (KeysFileExposed, FileNotFoundError)) else None)
        try:
            stat = self.keys_file.stat() if self.keys_file is not None else None
            self._file_stamp = (stat.st_mtime_ns, stat.st_size, stat.st_mode) if stat is not None else None
        except OSError:
            self._file_stamp = None

    def _rebuild(self, file_specs: list[ApiKeySpec]) -> None:
        table: dict[bytes, Principal] = {}
        for spec in [*self._inline, *file_specs]:
            key = spec.key.get_secret_value()
            remember_secret(key)
            table[hashlib.sha256(key.encode()).digest()] = Principal.from_spec(spec)
        self._by_digest = table
        self._by_key_id = {principal.key_id: principal for principal in table.values()}
        for listener in self.on_change:
            listener()

    def maybe_reload(self, now: float | None = None) -> bool:
        """Re-read the keys file when it changed; True when the keys were replaced."""
        if self.keys_file is None:
            return False
        now = time.monotonic() if now is None else now
        if now - self._checked < self.reload_check_s:
            return False
        with self._lock:
            self._checked = now
            try:
                stat = self.keys_file.stat()
                if (stat.st_mtime_ns, stat.st_size, stat.st_mode) == self._file_stamp:
                    return False
                self._rebuild(self._load_file())
            except (OSError, yaml.YAMLError, ValidationError, ValueError) as exc:
                if not (isinstance(exc, FileNotFoundError) and self._file_stamp is None):  # once, not per check
                    self._refuse_file(exc)
                return False
        self.reloads += 1
        log.info("API keys file reloaded", path=str(self.keys_file), keys=len(self._by_digest))
        return True

    def may_reward(self, key_id: str, tenant: str) -> bool:
        """True while the key with this id (:func:`fingerprint`) is configured, in ``tenant``, with the ``feedback``
        scope: a feedback token it caused dies once the key is removed, moved to another tenant or loses the scope
        (after a reload of the keys file)."""
        self.maybe_reload()
        principal = self._by_key_id.get(key_id)
        return principal is not None and principal.tenant == tenant and "feedback" in principal.scopes

    def authenticate(self, key: str) -> Principal | None:
        """The principal of ``key``, or None for an unknown key."""
        self.maybe_reload()
        return self._by_digest.get(hashlib.sha256(key.encode()).digest())

    # -- limits --
    def acquire(self, principal: Principal, now: float | None = None) -> None:
        """Count a request of ``principal`` against its limits; :class:`AuthRefusal` (429) past one of them.
        Every successful call is paired with :meth:`release`."""
        if principal.rpm is None and principal.max_concurrent is None:
            return
        now = time.monotonic() if now is None else now
        usage = self._usage.get(principal.key_id)
        if usage is None:
            usage = self._usage[principal.key_id] = _KeyUsage(tokens=float(principal.rpm or 0), refilled=now)
        if principal.max_concurrent is not None and usage.in_flight >= principal.max_concurrent:
            raise AuthRefusal(429, f"too many concurrent requests for this API key (at most "
                              f"{principal.max_concurrent})", "rate_limit_error", "concurrency_limit_exceeded")
        if principal.rpm is not None:
            usage.tokens = min(float(principal.rpm), usage.tokens + (now - usage.refilled) * principal.rpm / 60.0)
            usage.refilled = now
            if usage.tokens < 1.0:
                wait = math.ceil((1.0 - usage.tokens) * 60.0 / principal.rpm)
                raise AuthRefusal(429, f"rate limit of {principal.rpm} requests per minute reached for this API "
                                  f"key; retry in {wait} s", "rate_limit_error", "rate_limit_exceeded")
            usage.tokens -= 1.0
        usage.in_flight += 1

    def charge(self, principal: Principal, cost: int, now: float | None = None) -> None:
        """Count ``cost`` more requests of ``principal`` against its requests per minute (the choices of a chat
        request beyond the first: ``n=256`` costs 256 in all); :class:`AuthRefusal` (429) when they are not left."""
        if principal.rpm is None or cost <= 0:
            return
        now = time.monotonic() if now is None else now
        usage = self._usage.get(principal.key_id)
        if usage is None:
            usage = self._usage[principal.key_id] = _KeyUsage(tokens=float(principal.rpm), refilled=now)
        usage.tokens = min(float(principal.rpm), usage.tokens + (now - usage.refilled) * principal.rpm / 60.0)
        usage.refilled = now
        if cost + 1 > principal.rpm:
            raise AuthRefusal(429, f"this request counts as {cost + 1} requests (n), more than this API key's "
                              f"{principal.rpm} per minute", "rate_limit_error", "rate_limit_exceeded")
        if usage.tokens < cost:
            wait = math.ceil((cost - usage.tokens) * 60.0 / principal.rpm)
            raise AuthRefusal(429, f"rate limit of {principal.rpm} requests per minute reached for this API key "
                              f"(this request counts as {cost + 1}, n); retry in {wait} s", "rate_limit_error",
                              "rate_limit_exceeded")
        usage.tokens -= cost

    def release(self, principal: Principal) -> None:
        usage = self._usage.get(principal.key_id)
        if usage is not None and usage.in_flight > 0:
            usage.in_flight -= 1


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_problem(host: str, keys_enabled: bool, insecure_no_auth: bool) -> str | None:
    """Why the gateway must not start on ``host`` (a routable address without keys), or None."""
    if keys_enabled or insecure_no_auth or is_loopback(host):
        return None
    return (f"refusing to serve {host} without API keys: anyone who reaches it could steer training. Give "
            "--api-key / --api-keys-file (or RLSTREAM_GATEWAY_API_KEYS), bind 127.0.0.1, or pass --insecure-no-auth")


def inline_keys_from_env(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """The keys of ``RLSTREAM_GATEWAY_API_KEYS`` (comma separated)."""
    value = (os.environ if environ is None else environ).get(API_KEYS_ENV, "")
    return [k.strip() for k in value.split(",") if k.strip()]


#: paths that take feedback: rlstream's own, and the shapes observability tools send (feedback_shapes.py)
FEEDBACK_PATHS = frozenset({"/v1/feedback", "/api/public/scores", "/api/public/ingestion", "/feedback",
                            "/api/v1/feedback", "/v1/logs"})
#: paths open to anyone: the health and readiness checks, and LangSmith's ``/info`` (asked by every client at start;
#: it names no tenant's data)
OPEN_PATHS = frozenset({"/health", "/ready", "/info", "/api/v1/info"})
#: LangSmith's feedback updates: PATCH /feedback/{id}
FEEDBACK_UPDATE_PREFIXES = ("/feedback/", "/api/v1/feedback/")


def is_feedback_path(path: str) -> bool:
    """True for the paths that take feedback (the feedback scope, or a feedback token)."""
    return path in FEEDBACK_PATHS or path.startswith(FEEDBACK_UPDATE_PREFIXES)


def required_scope(path: str) -> str | None:
    """The scope a path needs (None: open to anyone, the health and readiness checks)."""
    if path in OPEN_PATHS:
        return None
    if path.startswith("/s/"):  # /s/{session}/v1/...
        return "inference"
    if is_feedback_path(path):
        return "feedback"
    if path.startswith("/v1/"):
        return "inference"
    return "admin"


ASGIApp = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
                   Awaitable[None]]


@dataclass
class AuthMiddleware:
    """ASGI middleware: authenticates every request but the health check, checks the path's scope and the key's
    limits, and leaves the caller in ``scope[PRINCIPAL_KEY]``. ``/v1/feedback`` may come without a key (or with a
    feedback token as the bearer credential): its handler then requires a feedback token."""

    app: ASGIApp
    keys: KeyStore
    #: called with the code of every refusal (e.g. ``LimitStats.count``: metric ``gateway/requests_rejected``)
    count: Callable[[str], None] | None = None

    async def __call__(self, scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        needed = required_scope(scope["path"])
        if needed is None or not self.keys.enabled:
            scope[PRINCIPAL_KEY] = OPEN
            await self.app(scope, receive, send)
            return
        bearer = _bearer(scope)
        if needed == "feedback" and (bearer is None or is_feedback_token(bearer)):
            scope[PRINCIPAL_KEY] = None
            scope[BEARER_TOKEN_KEY] = bearer
            await self.app(scope, receive, send)
            return
        try:
            principal = self._principal(bearer, needed)
            self.keys.acquire(principal)
        except AuthRefusal as refusal:
            await self._refuse(refusal, send)
            return
        scope[PRINCIPAL_KEY] = principal
        try:
            await self.app(scope, receive, send)
        finally:
            self.keys.release(principal)

    def _principal(self, bearer: str | None, needed: str) -> Principal:
        if bearer is None:
            raise unauthorized("no API key: send 'Authorization: Bearer <key>'", "missing_api_key")
        principal = self.keys.authenticate(bearer)
        if principal is None:
            raise unauthorized("invalid API key")
        if needed not in principal.scopes:
            raise forbidden(f"this API key lacks the {needed!r} scope", "scope_missing")
        return principal

    async def _refuse(self, refusal: AuthRefusal, send: Callable[[Any], Awaitable[None]]) -> None:
        if self.count is not None:
            self.count(refusal.code)
        await send_refusal(refusal, send)


async def send_refusal(refusal: AuthRefusal, send: Callable[[Any], Awaitable[None]]) -> None:
    body = refusal.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if refusal.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _bearer(scope: MutableMapping[str, Any]) -> str | None:
    """The caller's credential: ``Authorization: Bearer <key>``; on the feedback paths also Basic ``public:<key>``
    (Langfuse's clients) and ``x-api-key: <key>`` (LangSmith's); on ``/v1/messages`` also ``x-api-key`` (Anthropic's
    clients)."""
    path = str(scope.get("path", ""))
    feedback = is_feedback_path(path)
    anthropic = path.endswith("/v1/messages")
    api_key: str | None = None
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            scheme, _, credential = value.decode("latin-1").partition(" ")
            credential = credential.strip()
            if scheme.lower() == "basic" and feedback:
                return _basic_secret(credential)
            return credential if scheme.lower() == "bearer" and credential else None
        if name == b"x-api-key" and (feedback or anthropic):
            api_key = value.decode("latin-1").strip() or None
    return api_key


def _basic_secret(credential: str) -> str | None:
    """The password of a Basic credential (Langfuse sends public key : secret key; the secret is the key)."""
    import base64
    import binascii

    try:
        decoded = base64.b64decode(credential, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    _, sep, secret = decoded.partition(":")
    return secret.strip() or None if sep else None
