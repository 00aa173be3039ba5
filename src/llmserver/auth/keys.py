"""API keys: generation, hashing, verification, expiry and rotation.

A key is shown once, at creation (and a new secret once, at a rotation); the store keeps only its
SHA-256. Logs name a key by its fingerprint (the first 8 hex digits of the hash), never by the key
itself. A key with `expires_at` is refused from then on, with a 401 that says so (only its holder
sees that message: an unknown key still gets "Invalid API key"). A rotation gives a key a new
secret and keeps the old one valid for a grace period, so that its users can switch without an
outage. Each gateway notes when it last saw each key and writes that in batches (`flush_used`).
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

from llmserver.errors import APIError, AuthenticationError, FieldProblem, KeyExpired
from llmserver.store import NO_LIMITS, KeyLimits, KeyRecord, KeyStore, TeamRecord, TeamStore


class KeysAndTeams(KeyStore, TeamStore, Protocol):
    """What the key service reads: keys, and the teams whose limits apply around their members'."""


KEY_PREFIX = "llms-"
ADMIN_ENV_KEY_ID = "env-admin"


@dataclass(frozen=True)
class Principal:
    """The caller a request was authenticated as."""

    key_id: str
    name: str
    fingerprint: str
    is_admin: bool
    limits: KeyLimits = NO_LIMITS
    expires_at: float | None = None  # the key's own expiry (KeyExpired from then on)
    retired_at: float | None = None  # a rotated-out secret's end of grace (an unknown key from then on)
    team: TeamRecord | None = None  # its team, whose limits apply around the key's own
    team_admin: bool = False  # it manages its team's keys (and nothing else)


PERIODS = ("day", "month", "total")
MAX_BUDGET = 1e9  # in billing.currency: counted in billionths, well within a 64-bit counter
MODEL_PATTERN = re.compile(r"^[A-Za-z0-9._:*?\[\]-]{1,128}$")


def check_limits(limits: KeyLimits) -> KeyLimits:
    """FieldProblem (naming the field at fault) unless the limits make sense together."""
    if limits.quota_tokens is not None:
        if limits.quota_tokens < 1:
            raise FieldProblem("must be at least 1", "quota_tokens")
        if limits.quota_period not in PERIODS:
            raise FieldProblem(f"a token quota needs a period: one of {', '.join(PERIODS)}", "quota_period")
    elif limits.quota_period is not None:
        raise FieldProblem("a period needs a token quota", "quota_tokens")
    if limits.budget is not None:
        if not 0 < limits.budget <= MAX_BUDGET:
            raise FieldProblem(f"must be more than 0 and at most {MAX_BUDGET:,.0f}", "budget")
        if limits.budget_period not in PERIODS:
            raise FieldProblem(f"a budget needs a period: one of {', '.join(PERIODS)}", "budget_period")
    elif limits.budget_period is not None:
        raise FieldProblem("a period needs a budget", "budget")
    for name in ("rpm", "max_concurrency"):
        value = getattr(limits, name)
        if value is not None and value < 1:
            raise FieldProblem("must be at least 1", name)
    for pattern in limits.models or ():
        if not MODEL_PATTERN.match(pattern):
            shape = "letters, digits, . _ : - * ? [ ]"
            raise FieldProblem(f"{pattern!r} is not a model name or pattern ({shape})", "models")
    return limits


def unmatched(patterns: tuple[str, ...] | None, names: Iterable[str]) -> list[str]:
    """The allow-list's entries that match none of `names` (the models a server knows)."""
    known = list(names)
    return [p for p in patterns or () if not any(fnmatch.fnmatchcase(name, p) for name in known)]


def describe(record: KeyRecord) -> dict[str, Any]:
    """A key as the API and the CLI's --json show it (one shape for both)."""
    return {
        "id": record.id,
        "name": record.name,
        "fingerprint": record.fingerprint,
        "admin": record.is_admin,
        "created_at": record.created_at,
        "revoked_at": record.revoked_at,
        "expires_at": record.expires_at,
        "last_used_at": record.last_used_at,
        "previous_valid_until": record.previous_until if (record.previous_until or 0) > time.time() else None,
        **limit_fields(record.limits),
        "team_id": record.team_id,
        "team_admin": record.team_admin,
    }


def limit_fields(limits: KeyLimits) -> dict[str, Any]:
    """A key's limits as the API shows them (the model list as a JSON list)."""
    return {**asdict(limits), "models": list(limits.models) if limits.models is not None else None}


def may_use(limits: KeyLimits, model: str) -> bool:
    """Whether a key's allow-list (names or fnmatch patterns; none: every model) lets it use `model`."""
    return limits.models is None or any(fnmatch.fnmatchcase(model, pattern) for pattern in limits.models)


def allowed(principal: Principal, model: str) -> bool:
    """Whether the key's allow-list and its team's both let it use `model`."""
    team = principal.team
    return may_use(principal.limits, model) and (team is None or may_use(team.limits, model))


def check_admin_team(admin: bool, team_id: str | None) -> None:
    """FieldProblem for an admin key in a team: admin keys belong to no team (auth/authority.py says why)."""
    if admin and team_id is not None:
        raise FieldProblem(
            "an admin key belongs to no team (it manages every key; a team is a team admin's scope)", "team_id"
        )


MAX_GRACE = 30 * 86400.0  # seconds a rotated-out secret may stay valid
DEFAULT_GRACE = 3600.0


def check_expiry(expires_at: float | None) -> float | None:
    """An expiry must lie ahead (a key made or set to expire in the past is a mistake, not a revocation)."""
    if expires_at is not None and expires_at <= time.time():
        raise FieldProblem(
            "must be in the future (Unix seconds or ISO-8601); to stop a key now, revoke it", "expires_at"
        )
    return expires_at


CACHE_ENTRIES = 10_000
ADMINS_REMEMBERED = 1_000
ADMIN_MEMORY = 24 * 3600.0  # seconds


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def fingerprint(key_hash: str) -> str:
    return key_hash[:8]


class KeyService:
    def __init__(self, store: KeysAndTeams, admin_key: str | None = None, cache_seconds: float = 0.0) -> None:
        self._store = store
        self._admin: tuple[str, Principal] | None = None  # LLMSERVER_ADMIN_KEY's hash and principal
        if admin_key:
            admin_hash = hash_key(admin_key)
            self._admin = admin_hash, Principal(ADMIN_ENV_KEY_ID, "LLMSERVER_ADMIN_KEY", fingerprint(admin_hash), True)
        # Key hash → (its principal, or None for an unknown or revoked key; when the entry expires): a
        # request whose key was seen within `cache_seconds` skips the store (a thread hop and a query)
        # and the principal's making (a principal is immutable: requests share it).
        self._cache_seconds = cache_seconds
        self._cache: dict[str, tuple[Principal | None, float]] = {}
        # Admin keys the store confirmed, by hash → when: /metrics accepts them while the store
        # cannot be reached (an operator needs the metrics most during an outage).
        self._admins_seen: dict[str, float] = {}
        self._used: dict[str, float] = {}  # key id → when this gateway last saw it, until flush_used

    async def create(
        self,
        name: str,
        *,
        admin: bool = False,
        limits: KeyLimits = NO_LIMITS,
        expires_at: float | None = None,
        team_id: str | None = None,
        team_admin: bool = False,
    ) -> tuple[KeyRecord, str]:
        """A new key: its record, and the key itself, which is never stored."""
        if not name.strip():
            raise FieldProblem("a key needs a non-empty name", "name")
        check_admin_team(admin, team_id)
        key = generate_key()
        key_hash = hash_key(key)
        record = await self._store.insert_key(
            key_id="key_" + secrets.token_hex(6),
            name=name.strip(),
            key_hash=key_hash,
            fingerprint=fingerprint(key_hash),
            is_admin=admin,
            limits=check_limits(limits),
            expires_at=check_expiry(expires_at),
            team_id=team_id,
            team_admin=team_admin,
        )
        return record, key

    async def set_expiry(self, key_id: str, expires_at: float | None) -> bool:
        changed = await self._store.set_key_expiry(key_id, check_expiry(expires_at))
        self._cache.clear()
        return changed

    async def rotate(self, key_id: str, grace_seconds: float) -> tuple[KeyRecord, str] | None:
        """A new secret for an active key (shown once); the old one is accepted `grace_seconds` more.
        None for an unknown or revoked key."""
        if not 0 <= grace_seconds <= MAX_GRACE:
            raise FieldProblem(f"must be 0 to {MAX_GRACE:.0f} seconds (30 days)", "grace_seconds")
        key = generate_key()
        key_hash = hash_key(key)
        if not await self._store.rotate_key(key_id, key_hash, fingerprint(key_hash), time.time() + grace_seconds):
            return None
        self._cache.clear()
        self._admins_seen.clear()
        record = await self._store.key_by_id(key_id)
        return (record, key) if record is not None else None

    async def flush_used(self) -> None:
        """Write when each key was last seen here (called on each lease beat)."""
        used, self._used = self._used, {}
        if not used:
            return
        try:
            await self._store.touch_keys(used)
        except APIError:  # the store is away: kept for the next beat
            for key_id, when in used.items():
                self._used[key_id] = max(when, self._used.get(key_id, 0.0))
            raise

    async def set_team(self, key_id: str, team_id: str | None, team_admin: bool = False) -> bool:
        """Move an active key into a team that exists (as one of its admins or not), or out of its team (None).
        FieldProblem for an admin key sent into a team (admin keys belong to no team: auth/authority.py)."""
        if team_id is not None and (record := await self._store.key_by_id(key_id)) is not None:
            check_admin_team(record.is_admin, team_id)
        moved = await self._store.set_key_team(key_id, team_id, team_admin)
        self._cache.clear()
        return moved

    def forget(self) -> None:
        """Drop what this gateway remembers of keys (a team's limits changed)."""
        self._cache.clear()

    async def update(self, key_id: str, limits: KeyLimits) -> bool:
        changed = await self._store.update_key_limits(key_id, check_limits(limits))
        self._cache.clear()  # at once on this gateway; elsewhere within cache_seconds
        return changed

    async def get(self, key_id: str) -> KeyRecord | None:
        return await self._store.key_by_id(key_id)

    async def list(self) -> list[KeyRecord]:
        return await self._store.list_keys()

    async def revoke(self, key_id: str) -> bool:
        revoked = await self._store.revoke_key(key_id)
        self._cache.clear()
        self._admins_seen.clear()
        return revoked

    async def _lookup(self, key_hash: str) -> Principal | None:
        record = await self._store.key_by_hash(key_hash)
        retired_at = None
        if record is None:
            record = await self._store.key_by_previous_hash(key_hash, time.time())  # rotated out, in its grace
            if record is None or record.previous_until is None:
                return None
            retired_at = record.previous_until
        principal = _principal_of(record)
        if principal is None:
            return None
        team = await self._store.team_by_id(record.team_id) if record.team_id is not None else None
        if not (retired_at or team):
            return principal
        return replace(principal, retired_at=retired_at, team=team, team_admin=record.team_admin and team is not None)

    async def _principal(self, key_hash: str) -> Principal | None:
        if self._cache_seconds <= 0:
            return await self._lookup(key_hash)
        now = time.monotonic()
        cached = self._cache.get(key_hash)
        if cached is not None and cached[1] > now:
            return cached[0]
        principal = await self._lookup(key_hash)
        if len(self._cache) >= CACHE_ENTRIES:  # a flood of made-up keys cannot grow it without bound
            self._cache.clear()
        self._cache[key_hash] = (principal, now + self._cache_seconds)
        return principal

    async def authenticate(self, presented: str | None) -> Principal:
        """The principal for a presented key; AuthenticationError when missing, unknown or revoked."""
        if not presented:
            raise AuthenticationError()
        key_hash = hash_key(presented)
        if self._admin is not None and hmac.compare_digest(key_hash, self._admin[0]):
            return self._admin[1]
        principal = await self._principal(key_hash)
        if principal is None:
            self._admins_seen.pop(key_hash, None)
            raise AuthenticationError()
        if principal.expires_at is not None or principal.retired_at is not None:
            now = time.time()
            if principal.retired_at is not None and now >= principal.retired_at:
                raise AuthenticationError()  # its grace is over: as unknown as any other
            if principal.expires_at is not None and now >= principal.expires_at:
                raise KeyExpired(principal.expires_at)
        self._used[principal.key_id] = time.time()
        if principal.is_admin and len(self._admins_seen) < ADMINS_REMEMBERED:
            self._admins_seen[key_hash] = time.monotonic()
        return principal

    def admin_seen(self, presented: str | None, within: float = ADMIN_MEMORY) -> bool:
        """Whether the store confirmed this admin key within `within` seconds (for /metrics while the
        store cannot be reached)."""
        if not presented:
            return False
        seen = self._admins_seen.get(hash_key(presented))
        return seen is not None and time.monotonic() - seen < within


def _principal_of(record: KeyRecord | None) -> Principal | None:
    """The caller a stored key stands for; None for no key or a revoked one."""
    if record is None or not record.active:
        return None
    return Principal(record.id, record.name, record.fingerprint, record.is_admin, record.limits, record.expires_at)
