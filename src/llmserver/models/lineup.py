"""The models this process serves now: the one owner of that list.

At start it is what the configuration named (or, with the catalog, what the catalog holds with the
configuration's models brought in: models/catalog.py `served`); then it changes as the catalog does
(the follower hands each change to the supervisor, which rolls the pools and replaces the list) or, on
a node that takes the scheduler's assignments, as those do. Settings keep what was configured and
never change after they are loaded: whoever needs the models served reads them here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from llmserver.settings import ModelConfig


class Lineup:
    def __init__(self, models: Iterable[ModelConfig] = ()) -> None:
        self._models = list(models)

    @property
    def models(self) -> list[ModelConfig]:
        """The models, in order (a copy: changed only through `replace`)."""
        return list(self._models)

    def __iter__(self) -> Iterator[ModelConfig]:
        return iter(list(self._models))

    def __len__(self) -> int:
        return len(self._models)

    def get(self, name: str) -> ModelConfig | None:
        return next((model for model in self._models if model.name == name), None)

    def replace(self, models: Iterable[ModelConfig]) -> None:
        self._models = list(models)
