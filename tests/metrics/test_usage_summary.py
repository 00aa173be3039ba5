from __future__ import annotations

import pytest

from llmserver.errors import InvalidRequest
from llmserver.metrics.usage import parse_time


def test_times_parse_as_unix_seconds_or_iso() -> None:
    assert parse_time(None, 5.0, "since") == 5.0
    assert parse_time("100.5", 0, "since") == 100.5
    assert parse_time("1970-01-02T00:00:00", 0, "since") == 86400.0
    assert parse_time("1970-01-02T01:00:00+01:00", 0, "since") == 86400.0


@pytest.mark.parametrize("value", ["-2.7644000799169396e+245", "nan", "inf", "1e20", "yesterday", "-1"])
def test_out_of_range_times_are_400(value: str) -> None:  # found by schemathesis: these were 500s
    with pytest.raises(InvalidRequest) as caught:
        parse_time(value, 0, "since")
    assert caught.value.param == "since"
