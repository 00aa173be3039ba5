"""The model catalog: the models the servers offer, as rows in the database (`store.CatalogStore`).

Each row is a model's settings (a `ModelConfig`, as the JSON of the fields that differ from the
defaults), where they came from, and a revision that counts its changes. The admin API
(`/api/models`) and `llmserver models add|update|remove` write rows; every gateway reads them at
start and at each heartbeat of its lease after (`cluster/gateways.py`: every fifth of
`state.gateway_lease_seconds`, 2 s by default; and at once after its own API's changes), and
hands the models to its supervisor (`Supervisor.apply`: a new model gets a pool, a changed one rolls
its instances over one by one, a removed one is drained and its requests answered 404). A node reads
none of this: the scheduler (cluster/scheduler.py) hands it the models it is to run.

Config files and the catalog, exactly:
- one host (role `all`): the file's models (its [[models]], `--model`, or the embedded default when
  there are none) are mirrored into rows of origin `file` at every start — added, changed, and
  removed when the file no longer names them. Models added through the API (origin `api`) stay
  across restarts. A name in the file that the API also added, with other settings, is refused at
  start (which is meant?); the API refuses to change or remove a row of origin `file` (409: change
  the file).
- many gateways of role `all` on one PostgreSQL (each running its own instances): each serves its
  own file's models, never written to the catalog (other hosts' files may differ), and the catalog's
  `api` rows, which they all serve.
- many hosts (role `gateway`): a file's [[models]] seed an empty catalog (as origin `api`: from then
  on the catalog is the truth, managed through the API). When the catalog has rows, a model the file
  names must equal its row, or the gateway refuses to start and says which differ; a gateway whose
  file names no model simply serves the catalog. The embedded default never seeds a gateway's catalog.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError

from llmserver.errors import Conflict, InvalidRequest, NotFound, validation_error
from llmserver.settings import FileRoots, ModelConfig, Settings, meant, share_threads
from llmserver.store import CatalogEntry, CatalogStore, is_postgres

log = logging.getLogger("llmserver.model_catalog")  # its name before the move: log_levels name it

FILE, API = "file", "api"


class CatalogConflict(Exception):
    """The config file and the catalog disagree in a way only the operator can settle."""


def stored(model: ModelConfig) -> str:
    """A model's settings as the catalog keeps them: the fields that differ from the defaults (a
    `threads` the settings shared out is not one), as canonical JSON."""
    fields = model.model_dump(mode="json", exclude_defaults=True)
    if model._threads_computed:
        fields.pop("threads", None)
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


def loaded(entry: CatalogEntry) -> ModelConfig:
    return ModelConfig.model_validate(entry.settings())


def differences(a: str, b: str) -> list[str]:
    """The settings two stored models give differently, by name."""
    first, second = json.loads(a), json.loads(b)
    return sorted(key for key in first.keys() | second.keys() if first.get(key) != second.get(key))


async def seed(store: CatalogStore, settings: Settings) -> list[CatalogEntry]:
    """Bring the config file's models into the catalog by the rules above; the catalog's rows after."""
    rows = {entry.name: entry for entry in await store.catalog()}
    given = settings.models if (settings.models_given or settings.role != "gateway") else []
    if settings.role == "gateway":
        if not rows:
            for model in given:
                await store.catalog_put(model.name, stored(model), API, create=None)
                log.info("model catalog: %s added from the config file (the catalog is the truth from now on)",
                         model.name)  # fmt: skip
        else:
            for model in given:
                row = rows.get(model.name)
                if row is None:
                    raise CatalogConflict(
                        f"the config file names the model {model.name!r}, which the model catalog does not have: "
                        f"add it with `llmserver models add` (or POST /api/models), or take it out of the file"
                    )
                if row.config != stored(model):
                    raise CatalogConflict(
                        f"the config file's model {model.name!r} differs from the catalog's (revision {row.revision}) "
                        f"in {', '.join(differences(row.config, stored(model)))}: the catalog is the truth once "
                        f"seeded; take [[models]] out of the file, or make it agree"
                    )
    else:
        for model in given:
            row, wanted = rows.get(model.name), stored(model)
            if row is not None and row.origin == API:
                if row.config != wanted:
                    raise CatalogConflict(
                        f"the model {model.name!r} is in the config file and was added through the API with other "
                        f"settings ({', '.join(differences(row.config, wanted))}): remove it from one of them "
                        f"(`llmserver models remove {model.name}`, or the file)"
                    )
                continue
            if shared_store(settings):
                continue  # its own: never written where other gateways, with other files, read
            if row is None or row.config != wanted:
                await store.catalog_put(model.name, wanted, FILE, create=None)
                log.info("model catalog: %s %s from the config file", model.name, "added" if row is None else "changed")
        names = {model.name for model in given}
        for row in rows.values() if not shared_store(settings) else ():
            if row.origin == FILE and row.name not in names:
                await store.catalog_delete(row.name)
                log.info("model catalog: %s removed (the config file no longer names it)", row.name)
    return await store.catalog()


def shared_store(settings: Settings) -> bool:
    """Whether other gateways read this catalog (PostgreSQL), rather than this host alone (SQLite)."""
    return is_postgres(settings.state.database_url)


def served(entries: list[CatalogEntry], settings: Settings, own: list[ModelConfig]) -> list[ModelConfig]:
    """The models this gateway serves: the catalog's, and for a gateway of role `all` on a shared
    database also its config file's own (`own`), which it keeps out of the catalog."""
    if settings.role == "gateway" or not shared_store(settings):
        return models_of(entries)
    names = {model.name for model in own}
    models = [*own, *models_of([e for e in entries if e.origin == API and e.name not in names])]
    share_threads(models)
    return models


def models_of(entries: list[CatalogEntry]) -> list[ModelConfig]:
    """The catalog's models, CPUs shared out among those that set no `threads`. A row that no longer
    validates (written by a newer llmserver, say) is skipped, and logged."""
    models: list[ModelConfig] = []
    for entry in entries:
        try:
            models.append(loaded(entry))
        except ValidationError as exc:
            log.error("model catalog: %s (revision %d) is not valid here, skipped: %s", entry.name, entry.revision, exc)
    share_threads(models)
    return models


Apply = Callable[[list[CatalogEntry]], Awaitable[None]]


class CatalogFollower:
    """A gateway's side: the catalog read at each heartbeat of the gateway's lease (`follow`, one of
    its `on_beat` works: one wake-up and a burst of store calls every 2 s rather than a timer of its
    own), each change handed to `apply`."""

    def __init__(self, store: CatalogStore, apply: Apply) -> None:
        self._store = store
        self._apply = apply
        self._seen: dict[str, int] = {}
        self._following = False
        self._lock = asyncio.Lock()
        self.entries: list[CatalogEntry] = []

    def start(self, entries: list[CatalogEntry]) -> None:
        self.entries = entries
        self._seen = {entry.name: entry.revision for entry in entries}
        self._following = True

    async def stop(self) -> None:
        """No change is applied after this (the heartbeat goes on until the lease is let go)."""
        self._following = False
        async with self._lock:  # a change being applied finishes first
            pass

    async def follow(self) -> None:
        """A heartbeat's read: what changed since the last one applied (between start and stop)."""
        if not self._following:
            return
        try:
            await self.refresh()
        except Exception as exc:  # the database's outage is logged by the store; the models stay as they are
            log.debug("model catalog not read: %s", exc)

    async def refresh(self) -> None:
        """Read the catalog now and apply what changed."""
        async with self._lock:
            if not self._following:
                return
            entries = await self._store.catalog()
            seen = {entry.name: entry.revision for entry in entries}
            if seen == self._seen:
                return
            self.entries, self._seen = entries, seen
            await self._apply(entries)


def entry_body(entry: CatalogEntry, status: dict[str, Any] | None = None) -> dict[str, Any]:
    """A catalog row as the admin API shows it: its settings with every default filled in."""
    try:
        model = loaded(entry).model_dump(mode="json")
    except ValidationError:
        model = entry.settings()
    return {
        "name": entry.name, "object": "model", "settings": model, "origin": entry.origin,
        "revision": entry.revision, "updated_at": entry.updated_at, **(status or {}),
    }  # fmt: skip


# Changes, from the admin API and `llmserver models` alike


def _validated(fields: dict[str, Any], roots: FileRoots) -> ModelConfig:
    try:
        model = ModelConfig.model_validate(fields)
    except ValidationError as exc:
        error = validation_error(exc.errors())
        first = exc.errors()[0]
        if first["type"] == "extra_forbidden" and (close := meant(("models", 0, *first["loc"]))):
            error.message += f" (did you mean {' or '.join(close)}?)"
        raise error from None
    field = roots.outside(model)
    if field is not None:
        raise InvalidRequest(
            f"{field}: {getattr(model, field)} is outside the directories model files may be in "
            f"({', '.join(str(root) for root in roots.dirs)}; the model_dirs setting adds more)",
            param=field,
        )
    field = roots.missing(model)
    if field is not None:  # checked now: once saved, a model that cannot run is only marked so
        raise InvalidRequest(f"{field}: {getattr(model, field)} is not a file on this host", param=field)
    return model


def _owned(entry: CatalogEntry | None, name: str, doing: str) -> CatalogEntry:
    if entry is None:
        raise NotFound(f"The model catalog has no model {name!r}.", param="name")
    if entry.origin == FILE:
        raise Conflict(
            f"The model {name!r} comes from the server's config file, which sets it again at every start: "
            f"{doing} it there."
        )
    return entry


async def find(store: CatalogStore, name: str) -> CatalogEntry | None:
    return next((entry for entry in await store.catalog() if entry.name == name), None)


async def add(store: CatalogStore, fields: dict[str, Any], roots: FileRoots) -> CatalogEntry:
    """A new model (409 if the name is taken), its files within `roots` (Settings.model_file_roots)."""
    model = _validated(fields, roots)
    entry = await store.catalog_put(model.name, stored(model), API, create=True)
    if entry is None:
        raise Conflict(f"The model catalog already has a model {model.name!r}: change it with PATCH.", param="name")
    log.info("model catalog: %s added", model.name)
    return entry


async def update(store: CatalogStore, name: str, changes: dict[str, Any], roots: FileRoots) -> CatalogEntry:
    """A model's settings changed: `changes` over its current ones (a null sets one back to its default)."""
    entry = _owned(await find(store, name), name, "change")
    if "name" in changes and changes["name"] != name:
        raise InvalidRequest("A model cannot be renamed: add one under the new name, then remove this one.",
                             param="name")  # fmt: skip
    fields = {**entry.settings(), **changes}
    model = _validated({key: value for key, value in fields.items() if value is not None}, roots)
    if stored(model) == entry.config:
        return entry
    written = await store.catalog_put(name, stored(model), API, create=False)
    if written is None:
        raise NotFound(f"The model catalog has no model {name!r}.", param="name")
    log.info("model catalog: %s changed (%s)", name, ", ".join(differences(entry.config, written.config)))
    return written


async def stop(store: CatalogStore, name: str, roots: FileRoots) -> CatalogEntry:
    """Stop a model now and keep its row: max_instances 0 (its instances drain, its requests are answered
    503 at once) until `start`."""
    return await update(store, name, {"min_instances": 0, "max_instances": 0}, roots)


async def start(store: CatalogStore, name: str, instances: int, roots: FileRoots) -> CatalogEntry:
    """Keep `instances` of a model running (min_instances), max_instances raised to that if below it (a
    stopped model's 0 included)."""
    entry = _owned(await find(store, name), name, "start")
    most = max(instances, 1, ModelConfig.model_validate(entry.settings()).max_instances)
    return await update(store, name, {"min_instances": instances, "max_instances": most}, roots)


async def remove(store: CatalogStore, name: str) -> CatalogEntry:
    entry = _owned(await find(store, name), name, "remove")
    if not await store.catalog_delete(name):
        raise NotFound(f"The model catalog has no model {name!r}.", param="name")
    log.info("model catalog: %s removed", name)
    return entry
