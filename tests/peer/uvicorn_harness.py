"""llmserver's harness for uvicorn's own protocol tests (its `tests/protocols/test_http.py`): written
as `conftest.py` beside that file in the copy taken from uvicorn's source package at test time
(tests/peer/test_uvicorn_suite.py). Nothing of uvicorn's is copied into this repository.

- The suite's `http_protocol_cls` fixture names one protocol: the one llmserver ships.
- The suite's `MockLoop` has no clock and its `MockTask` cannot be cancelled; the protocol uses
  both (one timer per connection, re-armed from the loop's clock; cancel-on-disconnect). The clock
  stands still at 0: the suite moves time by firing timers (`run_later`), not by a clock.
- A coroutine the suite's loop was handed but never ran (a test that stops before the protocol's
  request task: the WebSocket-upgrade tests, answered as plain HTTP here) warns when it is collected.
  Collected at the end of each test, so that the warning fails the test that left it, not whichever
  test the garbage collector happens to run in.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from llmserver.server.http_protocol import GatewayProtocol, Limits, protocol_with
from tests.protocols import test_http as suite


def _time(self: Any) -> float:
    return 0.0


def _cancel(self: Any, msg: Any = None) -> bool:
    return False


suite.MockLoop.time = _time  # type: ignore[attr-defined]
suite.MockTask.cancel = _cancel  # type: ignore[attr-defined]


@pytest.fixture
def http_protocol_cls() -> type[GatewayProtocol]:
    return protocol_with(Limits())


@pytest.fixture(autouse=True)
def _collect_what_the_test_left() -> Iterator[None]:
    yield
    gc.collect()
