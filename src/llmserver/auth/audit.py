"""The audit log: one append-only row per admin action, through the API or the command line.

Which requests are audited is read from the route table, not listed here: every route of an
`Access.ADMIN` router called with a method that changes something (POST, PUT, PATCH, DELETE), whatever
its answer — a refused change is recorded with its status, as one that went through. The admin
dependency (`api/access.admin_key`) notes the action once the caller is known to be an admin; the
front (`server/front.Front`) hands it here with the answer's status once the answer is sent.

A row: when, the admin key (id and name), the action (`keys.create`, `models.update`, `nodes.drain`:
the route's resource and verb), the target (the route's path parameters), the change, the status, the
client's address and the request id. The change holds the request's fields that are known settings
and limits (an allowlist: a model's settings, a key's name and limits, an instance's model and node);
any other field is named with its value withheld — a key or a secret never reaches a row.

A call to an admin route by a key that may not make it (a team admin key on `PATCH /api/teams/…`, a user
key on `POST /api/models`) is recorded too, with its 403: the attempts a security team looks for first.

The command line changes keys, teams and models by writing the database itself (`llmserver keys`, `teams`,
`models`): each of those commands writes its row the same way (`operator_row`), the operator's user and host
as the actor (`key.id` "cli"), its status 200 or 201, or that of the refusal it ended with.

The write goes on in a task of its own, so that a client that goes away does not take its row with it;
a read of the log (`page`) waits for the writes under way first. A row that cannot be written (the
database is away) is logged, action and target, as an error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from llmserver.errors import APIError
from llmserver.store import AuditQuery, AuditStore, KeyLimits

log = logging.getLogger(__name__)

CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
VERBS = {"POST": "create", "PUT": "replace", "PATCH": "update", "DELETE": "delete"}
# The fields whose values a row keeps, besides a model's settings (which the app adds): what admin routes
# take that is configuration, never a credential.
RECORDED = frozenset(
    {*(f.name for f in dataclasses.fields(KeyLimits))}
    | {"name", "admin", "expires_at", "grace_seconds", "model", "node", "instances", "team_id", "team_admin"}
)
WITHHELD = "(withheld)"


@dataclass(frozen=True)
class Action:
    """An admin action noted before it runs; `Audit.record` adds its status."""

    time: float
    key_id: str
    key_name: str
    action: str
    target: str | None
    change: dict[str, Any] | None
    client: str | None
    request_id: str | None

    def row(self, status: int) -> dict[str, object]:
        change = json.dumps(self.change, sort_keys=True, default=str) if self.change else None
        return {**dataclasses.asdict(self), "change": change, "status": status}


def action_of(method: str, path_format: str, path_params: Mapping[str, str]) -> tuple[str, str | None]:
    """The action's name and target from its route: `/api/<resource>/…`, the verb the method's (POST
    create, PATCH update, DELETE delete), a literal last segment's (`/api/models/{name}/stop`: stop), or
    the `action` path parameter's (`/api/nodes/{node}/{action}`: cordon); the target, the other path
    parameters' values joined by "/"."""
    parts = [part for part in path_format.split("/") if part]
    resource = parts[1] if len(parts) > 1 and parts[0] == "api" else parts[0]
    last = parts[-1]
    if "action" in path_params:
        verb = path_params["action"]
    elif len(parts) > 2 and not last.startswith("{"):
        verb = last
    else:
        verb = VERBS.get(method, method.lower())
    target = "/".join(value for name, value in path_params.items() if name != "action") or None
    return f"{resource}.{verb}", target


OPERATOR_KEY_ID = "cli"  # the actor of a change made at the command line


def operator_row(
    action: str, target: str | None, change: Mapping[str, Any] | None, status: int, recorded: frozenset[str] = RECORDED
) -> dict[str, object]:
    """The row of a change made with the CLI: the operator (user@host) as its actor."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container's)
        user = f"uid {os.getuid()}"
    host = socket.gethostname()
    noted = Action(
        time.time(), OPERATOR_KEY_ID, f"{user}@{host} (cli)", action, target, change_of(change, {}, recorded), host,
        None,
    )  # fmt: skip
    return noted.row(status)


def change_of(
    body: Mapping[str, Any] | None, query: Mapping[str, str], recorded: frozenset[str]
) -> dict[str, Any] | None:
    """What the request asked to change: body and query fields by the allowlist, others withheld."""
    fields = {**query, **(body or {})}
    change = {name: value if name in recorded else WITHHELD for name, value in fields.items() if name != "api_key"}
    return change or None


class Audit:
    def __init__(
        self,
        store: AuditStore,
        settings_fields: frozenset[str],
        on_recorded: Callable[[str, int], None] | None = None,
    ) -> None:
        """`settings_fields`: a model's settings (ModelConfig's fields), recorded with RECORDED."""
        self._store = store
        self._recorded = RECORDED | settings_fields
        self._on_recorded = on_recorded  # called with (action, status) once a row is written
        self._writes: set[asyncio.Task[None]] = set()

    def note(
        self,
        *,
        method: str,
        path_format: str,
        path_params: Mapping[str, str],
        key_id: str,
        key_name: str,
        body: Mapping[str, Any] | None,
        query: Mapping[str, str],
        client: str | None,
        request_id: str | None,
    ) -> Action:
        action, target = action_of(method, path_format, path_params)
        change = change_of(body, query, self._recorded)
        return Action(time.time(), key_id, key_name, action, target, change, client, request_id)

    def record(self, action: Action, status: int, created: str | None = None) -> None:
        """Write the action's row with its answer's status (`created`: what a create made, its target)."""
        if action.target is None and created is not None:
            action = dataclasses.replace(action, target=created)
        task = asyncio.get_running_loop().create_task(self._write(action, status))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, action: Action, status: int) -> None:
        try:
            await self._store.audit_append(action.row(status))
        except APIError as exc:
            log.error("audit row not written (%s): %s %s by key %s, status %d",
                      exc.message, action.action, action.target or "", action.key_id, status)  # fmt: skip
            return
        if self._on_recorded is not None:
            self._on_recorded(action.action, status)

    async def flush(self) -> None:
        """Wait for the rows being written (a read after an action sees it)."""
        if self._writes:
            await asyncio.wait(set(self._writes))

    async def page(self, query: AuditQuery) -> list[dict[str, object]]:
        await self.flush()
        return await self._store.audit_page(query)
