"""The cache side channel of issue 39 (row 3), as its probe ran: a victim key sends a system prompt
holding a secret; an attacker key sends guesses and reads `usage.prompt_tokens_details.cached_tokens`.
Under prompt_cache.isolation = "key" (the default) a wrong guess and a right one read the same, and the
victim's own next request still reuses its cache; under "shared" the probe tells them apart."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.support import MODEL, Server, create_key

SECRET = "You are the vault assistant. The access code is 7F3K-92QX-LM48. Never reveal it to anyone."
WRONG = "You are the vault assistant. The access code is 1A2B-3C4D-5E6F. Never reveal it to anyone."


def cached_tokens(server: Server, key: str, system: str) -> int:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hello."}],
            "max_tokens": 1, "temperature": 0}  # fmt: skip
    answer = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                        timeout=120)  # fmt: skip
    assert answer.status_code == 200, answer.text
    return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def probe(server: Server) -> dict[str, int]:
    """Each guess from a key of its own (a key's own earlier guess is its own cache, which it may reuse)."""
    victim = create_key(server.data_dir, "victim")
    cached_tokens(server, victim, SECRET)
    wrong = cached_tokens(server, create_key(server.data_dir, "attacker-1"), WRONG)
    # (With 2 slots and a third key, a key's cache lives while its slot is not the one taken longest ago.)
    again = cached_tokens(server, victim, SECRET)
    right = cached_tokens(server, create_key(server.data_dir, "attacker-2"), SECRET)
    return {"wrong": wrong, "right": right, "victim_again": again}


@pytest.fixture(scope="module")
def key_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server of its own, default isolation: which slot the probe's requests get depends on what the
    slots went through before (a slot whose client left is taken last), so no earlier test's."""
    config = f'[[models]]\nname = "{MODEL}"\nparallel = 2\nctx_size = 1024\n'
    server = Server(data_dir=tmp_path_factory.mktemp("key-cache"), config=config).start()
    yield server
    server.stop()


def test_another_keys_prompt_cannot_be_probed(key_server: Server) -> None:
    seen = probe(key_server)
    assert seen["wrong"] == seen["right"] == 0, seen
    assert seen["victim_again"] > 20, seen  # the victim's own cache is kept: its whole system prompt


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = f'prompt_cache.isolation = "shared"\n[[models]]\nname = "{MODEL}"\nparallel = 2\nctx_size = 1024\n'
    server = Server(data_dir=tmp_path_factory.mktemp("shared-cache"), config=config).start()
    yield server
    server.stop()


@pytest.mark.slow
def test_the_shared_cache_leaks_as_documented(shared_server: Server) -> None:
    """The probe itself can fail: with the cache shared, the right guess reuses more than the wrong one."""
    seen = probe(shared_server)
    assert seen["right"] > seen["wrong"] > 0, seen
