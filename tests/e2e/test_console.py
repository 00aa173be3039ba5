"""The web console in real headless Chromium (Debian's `chromium`, driven by Playwright) against a real
server with the embedded model. Every test checks that no request from the page left the server's
origin; screenshots of each page go to the test's temp folder (and to $LLMSERVER_CONSOLE_SHOTS when
set: docs/console/ was made that way)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import gzip
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmserver import console
from tests.support import MODEL, Server, create_key, store_rows, wait_for

ADMIN = "console-admin-key-0123456789abcdef"
ROOT = Path(__file__).resolve().parents[2] / "src" / "llmserver" / "console" / "static"
# Priced (per million tokens, in the default currency USD): spend and budgets have something to show.
CONFIG = (
    f'[[models]]\nname = "{MODEL}"\nctx_size = 1024\nparallel = 2\nmax_instances = 2\n'
    "prices = { input = 1000.0, output = 2000.0 }\n"
)


@dataclass
class Browser:
    server: Server
    shots: Path
    page: Any = None
    requests: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)  # every confirm() the page asked (each accepted)
    missing: list[str] = field(default_factory=list)  # what the page asked for and got 404

    def open(self, key: str | None = None) -> Any:
        self.page.goto(self.server.url + "/console")
        if key is not None:
            self.page.fill("#api-key", key)
            self.page.click("#sign-in-form button[type=submit]")
            self.page.wait_for_selector("#tabs:not([hidden])")
        return self.page

    def shoot(self, name: str) -> None:
        path = self.shots / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        published = os.environ.get("LLMSERVER_CONSOLE_SHOTS")
        if published:
            shutil.copy(path, Path(published) / path.name)

    def offsite(self) -> list[str]:
        local = (self.server.url, "data:", "blob:")
        return [url for url in self.requests if not url.startswith(local)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    data_dir = tmp_path_factory.mktemp("console")
    running = Server(data_dir=data_dir, config=CONFIG, env={"LLMSERVER_ADMIN_KEY": ADMIN}).start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def browser(chromium: Any, server: Server, tmp_path: Path) -> Iterator[Browser]:
    context = chromium.new_context(viewport={"width": 1280, "height": 800})
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
    page = context.new_page()
    session = Browser(server, tmp_path, page)
    page.on("request", lambda request: session.requests.append(request.url))
    page.on("dialog", lambda dialog: (session.dialogs.append(dialog.message), dialog.accept()))
    page.on("response", lambda response: session.missing.append(response.url) if response.status == 404 else None)
    try:
        yield session
        assert session.offsite() == []  # nothing left the server's origin
        assert session.missing == []  # nor asked for anything it does not serve (a favicon, say)
    finally:
        context.close()


def user_key(server: Server, name: str) -> str:
    return create_key(server.data_dir, name)


def test_the_page_and_its_assets_come_from_the_server_with_a_strict_policy(server: Server) -> None:
    page = httpx.get(server.url + "/console")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert httpx.get(server.url + "/console/assets/console.js").headers["content-security-policy"] == policy
    assert httpx.get(server.url + "/console/assets/vendor/libsodium.js").status_code == 200
    assert httpx.get(server.url + "/docs").status_code == 404  # Swagger UI needs a CDN: dropped
    assert httpx.get(server.url + "/openapi.json").status_code == 200


def test_sign_in_with_a_wrong_key_shows_the_servers_error_and_a_user_key_sees_its_own_pages(browser: Browser) -> None:
    page = browser.open()
    page.fill("#api-key", "sk-not-a-real-key")
    page.click("#sign-in-form button[type=submit]")
    page.wait_for_function("() => document.querySelector('#sign-in-error').textContent.length > 0")
    refused = httpx.get(browser.server.url + "/api/me", headers={"Authorization": "Bearer sk-not-a-real-key"})
    assert page.text_content("#sign-in-error") == refused.json()["error"]["message"]
    key = user_key(browser.server, "console-user")
    page.fill("#api-key", key)
    page.click("#sign-in-form button[type=submit]")
    page.wait_for_selector("#playground:not([hidden])")
    assert page.is_hidden("#tabs button[data-tab=overview]") and page.is_hidden("#tabs button[data-tab=keys]")
    assert page.evaluate("sessionStorage.getItem('llmserver.key')") == key
    assert page.evaluate("document.cookie") == "" and key not in page.url
    browser.shoot("sign-in-user")
    page.click("#sign-out")
    page.wait_for_selector("#sign-in:not([hidden])")
    assert page.evaluate("sessionStorage.getItem('llmserver.key')") is None
    assert key not in browser.server.log()  # never logged


def instances(server: Server) -> list[dict[str, Any]]:
    answer = httpx.get(server.url + "/api/instances", headers={"Authorization": f"Bearer {ADMIN}"})
    return list(answer.json()["data"])


def test_the_admin_overview_shows_the_real_instance_and_refreshes_live(browser: Browser) -> None:
    page = browser.open(ADMIN)
    page.wait_for_selector("#instances-table tbody tr")
    real = instances(browser.server)[0]
    row = f"#instances-table tr[data-instance='{real['instance_id']}']"
    assert page.text_content(f"{row} .pid") == str(real["pid"])
    assert page.text_content("#models-table tbody td") == MODEL
    first = page.text_content("#overview-status")
    page.wait_for_function(f"() => document.querySelector('#overview-status').textContent !== {first!r}", timeout=5000)
    page.get_by_role("button", name=f"Start instance of {MODEL}").click()
    status = "document.querySelector('#overview-status').textContent"
    page.wait_for_function(f"() => {status}.startsWith('Started')", timeout=60000)
    assert len(instances(browser.server)) == 2
    page.wait_for_function("() => document.querySelectorAll('#instances-table tbody tr').length === 2")
    browser.shoot("overview")
    page.emulate_media(color_scheme="dark")
    browser.shoot("overview-dark")
    page.emulate_media(color_scheme="light")
    added = next(i["instance_id"] for i in instances(browser.server) if i["instance_id"] != real["instance_id"])
    page.get_by_role("button", name=f"Drain instance {added}").click()
    page.wait_for_function(f"() => {status}.endsWith('drained and stopped.')")
    asked = f"Drain instance {added}? It takes no new requests, finishes those in flight, then stops."
    assert browser.dialogs == [asked]  # asked first (accepted here), as Revoke does
    assert [i["instance_id"] for i in instances(browser.server)] == [real["instance_id"]]


def test_an_instance_s_last_log_lines_open_under_the_table_with_no_key_in_them(browser: Browser) -> None:
    page = browser.open(ADMIN)
    real = instances(browser.server)[0]
    page.get_by_role("button", name=f"Log of instance {real['instance_id']}").click()
    page.wait_for_function(
        "() => !['', 'Reading…'].includes(document.querySelector('#instance-log-lines').textContent)"
    )
    shown = str(page.text_content("#instance-log-lines"))
    tail = httpx.get(
        f"{browser.server.url}/api/instances/{real['instance_id']}/log", headers={"Authorization": f"Bearer {ADMIN}"}
    )
    started = next(line for line in tail.json()["lines"] if "starting:" in line)  # the command llmserver ran
    assert started in shown and "llama-server" in shown and browser.server.instance_key not in shown
    assert page.evaluate("document.activeElement.id") == "instance-log-title"
    browser.shoot("overview-instance-log")
    page.click("#instance-log-close")
    assert page.is_hidden("#instance-log") and page.text_content("#instance-log-lines") == ""


def test_an_admin_creates_a_key_that_works_at_once_edits_it_and_revokes_it(browser: Browser) -> None:
    page = browser.open(ADMIN)
    page.click("#tabs button[data-tab=keys]")

    def key_count() -> int:
        listed = httpx.get(browser.server.url + "/api/keys", headers={"Authorization": f"Bearer {ADMIN}"})
        return len(listed.json()["data"])

    before = key_count()
    page.fill("#key-quota", "0")
    page.fill("#key-rpm", "-3")
    page.click("#key-submit")
    # Every problem at once, each at its field, before anything is sent.
    for name in ("name", "quota_tokens", "rpm"):
        assert page.text_content(f"#key-form .field-error[data-for={name}]"), name
    said = str(page.text_content("#key-form .field-error[data-for=quota_tokens]"))
    assert said.startswith("A whole number") and "quota_tokens" not in said  # the page's words, not the API's
    assert page.get_attribute("#key-rpm", "aria-invalid") == "true" and key_count() == before
    page.fill("#key-name", "made-in-the-console")
    page.fill("#key-quota", "50000")
    page.fill("#key-rpm", "")
    page.fill("#key-models", f"{MODEL}, SmolLM2-*")
    page.select_option("#key-period", "day")
    page.click("#key-submit")
    page.wait_for_selector("#new-key:not([hidden])")
    secret = page.text_content("#new-key-value")
    page.click("#copy-key")
    assert page.evaluate("navigator.clipboard.readText()") == secret
    used = httpx.post(
        browser.server.url + "/api/generate",
        json={"prompt": "hi", "max_tokens": 2},
        headers={"Authorization": f"Bearer {secret}"},
        timeout=60,
    )
    assert used.status_code == 200, used.text
    row = page.locator("#keys-table tbody tr", has_text="made-in-the-console")
    row.get_by_role("button", name="Edit the limits of made-in-the-console").click()
    page.fill("#key-rpm", "30")
    page.click("#key-submit")
    page.wait_for_function("() => document.querySelector('#keys-status').textContent.includes('saved')")
    # Where its quota stands now: the tokens of the request just made, what is left, when it resets.
    page.wait_for_function("() => /of 50,000 used today \\(UTC\\); [0-9,]+ left, resets /.test("
                           "[...document.querySelectorAll('#keys-table tbody tr')].find((r) => r.textContent.includes("
                           "'made-in-the-console'))?.querySelector('td.quota').textContent)")  # fmt: skip
    browser.shoot("keys")
    row.get_by_role("button", name="Revoke made-in-the-console").click()
    page.wait_for_function("() => document.querySelector('#keys-status').textContent.includes('revoked')")
    refused = httpx.post(
        browser.server.url + "/api/generate", json={"prompt": "hi"}, headers={"Authorization": f"Bearer {secret}"}
    )
    assert refused.status_code == 401
    listed = httpx.get(browser.server.url + "/api/keys", headers={"Authorization": f"Bearer {ADMIN}"}).json()["data"]
    made = next(k for k in listed if k["name"] == "made-in-the-console")
    assert (made["quota_tokens"], made["quota_period"], made["rpm"]) == (50000, "day", 30) and made["revoked_at"]
    assert made["models"] == [MODEL, "SmolLM2-*"]


def test_a_key_gets_an_expiry_and_is_rotated_from_the_keys_page(browser: Browser) -> None:
    """The Keys page sets an expiry (a past one is a problem at its field), shows when each key expires and
    was last used, and rotates a key: the new secret shown once, the old one still working for the grace."""
    page = browser.open(ADMIN)
    page.click("#tabs button[data-tab=keys]")
    page.fill("#key-name", "expiring-in-console")
    page.fill("#key-expires", "2001-01-01T00:00")
    page.click("#key-submit")
    assert "future" in (page.text_content("#key-form .field-error[data-for=expires_at]") or "")
    page.fill("#key-expires", "2099-06-30T12:00")
    page.click("#key-submit")
    page.wait_for_selector("#new-key:not([hidden])")
    old = page.text_content("#new-key-value") or ""
    row = "#keys-table tbody tr:has(td.name:text-is('expiring-in-console'))"
    page.wait_for_selector(row)
    key_id = page.get_attribute(row, "data-key")
    listed = httpx.get(browser.server.url + "/api/keys", headers={"Authorization": f"Bearer {ADMIN}"}).json()["data"]
    expires_at = next(k for k in listed if k["id"] == key_id)["expires_at"]
    shown = page.evaluate("(t) => new Date(t * 1000).toLocaleString()", expires_at)
    assert shown in (page.text_content(row) or "") and expires_at > 4_000_000_000
    assert httpx.get(browser.server.url + "/v1/models", headers={"Authorization": f"Bearer {old}"}).status_code == 200
    page.click(f"{row} button[aria-label^=Rotate]")
    page.wait_for_function("(old) => document.querySelector('#new-key-value').textContent !== old", arg=old)
    new = page.text_content("#new-key-value") or ""
    assert new.startswith("llms-") and "old one works until" in (page.text_content("#new-key-note") or "")
    assert browser.dialogs[-1].startswith("Give the key expiring-in-console a new secret?")
    for secret in (new, old):  # the old one through its hour of grace
        used = httpx.get(browser.server.url + "/v1/models", headers={"Authorization": f"Bearer {secret}"})
        assert used.status_code == 200
    # Used just now: the row says when, once the gateway has written it (every 2 s) and the page re-read it.
    last_used = f"#keys-table tbody tr[data-key='{key_id}'] td.last-used"
    page.wait_for_function(
        f"() => (document.querySelector(\"{last_used}\")?.textContent ?? '\N{EN DASH}') !== '\N{EN DASH}'",
        timeout=15000,
    )
    browser.shoot("keys-rotated")


def test_the_key_form_questions_its_allow_list_and_shows_each_refusal_at_its_field(browser: Browser) -> None:
    """`,,,` once made a key allowed every model and `no-such-model` one allowed none, silently; the
    server's refusals were shown in the form's general line, in the API's words."""
    page = browser.open(ADMIN)
    page.click("#tabs button[data-tab=keys]")
    page.wait_for_selector("#keys-table tbody tr")
    posted: list[str] = []
    page.on("request", lambda r: posted.append(r.url) if r.method == "POST" and r.url.endswith("/api/keys") else None)

    def error_at(field: str) -> str:
        return str(page.text_content(f"#key-form .field-error[data-for={field}]"))

    def names() -> list[str]:
        listed = httpx.get(browser.server.url + "/api/keys", headers={"Authorization": f"Bearer {ADMIN}"})
        return [k["name"] for k in listed.json()["data"]]

    page.fill("#key-name", "allow-list")
    page.fill("#key-models", ",,,")
    page.click("#key-submit")
    assert "empty" in error_at("models") and page.get_attribute("#key-models", "aria-invalid") == "true"
    assert posted == []  # seen before sending
    # What only the server knows (which models it has): at the field, without the API's name in front.
    page.fill("#key-models", f"{MODEL}, no-such-model")
    page.click("#key-submit")
    page.wait_for_function("() => document.querySelector('#key-form .field-error[data-for=models]').textContent")
    refused = httpx.post(browser.server.url + "/api/keys", json={"name": "x", "models": [MODEL, "no-such-model"]},
                         headers={"Authorization": f"Bearer {ADMIN}"}).json()["error"]  # fmt: skip
    assert refused["param"] == "models" and refused["message"].startswith("models: ")
    assert error_at("models") == refused["message"].removeprefix("models: ")
    assert page.text_content("#key-error") == "" and "allow-list" not in names()
    # A quota without its period: at the period's field, in the page's words.
    page.fill("#key-models", "SmolLM2-*")
    page.fill("#key-quota", "1000")
    page.click("#key-submit")
    assert error_at("quota_period").startswith("A token quota needs a period") and "allow-list" not in names()
    # Enter on the period's select submits the form, as Enter does in its text fields.
    page.select_option("#key-period", "month")
    page.focus("#key-period")
    page.keyboard.press("Enter")
    page.wait_for_selector("#new-key:not([hidden])")
    listed = httpx.get(browser.server.url + "/api/keys", headers={"Authorization": f"Bearer {ADMIN}"}).json()["data"]
    made = next(k for k in listed if k["name"] == "allow-list")
    assert (made["models"], made["quota_tokens"], made["quota_period"]) == (["SmolLM2-*"], 1000, "month")
    # A key allowed no model yet ([]) keeps that through an edit of another limit (its field is empty).
    none = httpx.post(browser.server.url + "/api/keys", json={"name": "no-model-yet", "models": []},
                      headers={"Authorization": f"Bearer {ADMIN}"}).json()  # fmt: skip
    row = page.locator(f"#keys-table tbody tr[data-key='{none['id']}']")
    row.wait_for(timeout=10_000)  # the page's 5-s refresh
    assert row.locator("td.models").text_content() == "none"
    row.get_by_role("button", name="Edit the limits of no-model-yet").click()
    page.fill("#key-rpm", "12")
    page.click("#key-submit")
    page.wait_for_function("() => document.querySelector('#keys-status').textContent.includes('saved')")
    kept = httpx.get(browser.server.url + "/api/keys", headers={"Authorization": f"Bearer {ADMIN}"}).json()["data"]
    assert [(k["models"], k["rpm"]) for k in kept if k["id"] == none["id"]] == [([], 12)]


def playground(browser: Browser, name: str, message: str, max_tokens: int) -> Any:
    """The playground, signed in with a new user key, the message and max_tokens filled in."""
    page = browser.open(user_key(browser.server, name))
    page.wait_for_selector("#play-model option", state="attached")
    page.fill("#play-message", message)
    page.fill("#play-max-tokens", str(max_tokens))
    return page


def test_a_streamed_playground_answer_appears_token_by_token(browser: Browser) -> None:
    page = playground(browser, "streamer", "Write a long story about a cat.", 120)
    page.click("#play-send")
    lengths: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and page.is_disabled("#play-send"):
        lengths.append(len(page.text_content("#play-output") or ""))
        time.sleep(0.05)
    assert page.text_content("#play-error") == ""
    grown = sorted(set(lengths))
    assert len(grown) >= 5, grown  # it grew while streaming, not in one piece at the end
    assert page.text_content("#stat-instance") == instances(browser.server)[0]["instance_id"]
    assert int(page.text_content("#stat-completion") or "0") > 0 and page.text_content("#stat-speed") != "\N{EN DASH}"
    browser.shoot("playground")
    page.click("#copy-curl")
    code = page.text_content("#play-code") or ""
    assert code.startswith("curl -s " + browser.server.url + "/v1/chat/completions") and "$LLMSERVER_API_KEY" in code


def test_a_users_model_picker_lists_only_models_a_request_can_reach(browser: Browser) -> None:
    """A stopped model (max_instances 0) answers every request 503: it is no choice in the playground."""
    body = {"name": "stopped-one", "min_instances": 0, "max_instances": 0, "ctx_size": 512, "parallel": 1}
    with catalog_model(browser.server, body):
        key = user_key(browser.server, "picker")
        listed = httpx.get(browser.server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).json()
        available = {m["id"]: m["available"] for m in listed["data"]}
        assert available == {MODEL: True, "stopped-one": False}
        page = browser.open(key)
        page.wait_for_selector("#play-model option", state="attached")
        assert page.eval_on_selector_all("#play-model option", "(options) => options.map((o) => o.value)") == [MODEL]


def docx(text: str) -> bytes:
    from docx import Document

    document = Document()
    document.add_paragraph(text)
    buffer = io.BytesIO()
    document.save(buffer)
    return buffer.getvalue()


def test_an_attached_docx_goes_into_the_prompt_and_an_oversized_file_is_refused_before_upload(
    browser: Browser, tmp_path: Path
) -> None:
    page = playground(browser, "documents", "What is the code word in the document? Answer with the word.", 16)
    page.fill("#play-temperature", "0")
    page.click("#play-send")
    page.wait_for_function("() => !document.querySelector('#play-send').disabled")
    bare = int(page.text_content("#stat-prompt") or "0")
    assert page.input_value("#play-message") == ""  # sent and answered: the box is free for the next turn
    page.click("#play-clear")  # the same question again, alone but for the document
    page.fill("#play-message", "What is the code word in the document? Answer with the word.")
    report = tmp_path / "report.docx"
    report.write_bytes(docx("Quarterly report. " * 40 + "The code word is PINEAPPLE."))
    page.set_input_files("#play-files", str(report))
    page.click("#play-send")
    page.wait_for_function("() => !document.querySelector('#play-send').disabled")
    assert page.text_content("#play-error") == ""
    with_document = int(page.text_content("#stat-prompt") or "0")
    assert with_document > bare + 100, (bare, with_document)  # the document's text reached the model
    assert page.evaluate("document.querySelector('#play-files').files.length") == 0  # sent once, with its turn
    print(f"answer from the DOCX: {page.text_content('#play-output')!r}")
    huge = tmp_path / "huge.txt"
    huge.write_bytes(b"a" * (15 * 1024 * 1024 + 1))
    sent = len([u for u in browser.requests if u.endswith("/v1/chat/completions")])
    page.set_input_files("#play-files", str(huge))
    page.fill("#play-message", "And in this one?")
    page.click("#play-send")
    page.wait_for_function("() => document.querySelector('#play-error').textContent.length > 0")
    assert "huge.txt is over" in (page.text_content("#play-error") or "")
    assert len([u for u in browser.requests if u.endswith("/v1/chat/completions")]) == sent  # nothing uploaded


def test_an_async_answer_is_decrypted_in_the_page_and_the_server_keeps_no_plaintext(browser: Browser) -> None:
    page = playground(browser, "async", "Name three colours.", 40)
    page.check("#play-async")
    page.click("#play-send")
    page.wait_for_selector("#play-output[data-decrypted=true]", timeout=60000)
    answer = page.text_content("#play-output") or ""
    assert page.text_content("#play-error") == "" and len(answer) >= 10, answer
    browser.shoot("playground-async")
    # SQLite or PostgreSQL; in a thread of its own: Playwright's sync API keeps an event loop running here.
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        jobs = repr(thread.submit(store_rows, browser.server.data_dir, "SELECT * FROM jobs").result())
    files = b"".join(p.read_bytes() for p in browser.server.data_dir.glob("llmserver.db*"))  # SQLite's pages too
    assert answer[:10] not in jobs and answer[:10].encode() not in files
    assert answer[:10] not in browser.server.log()
    assert any(re.search(r"/console/assets/[0-9a-f]{16}/vendor/libsodium\.js$", u) for u in browser.requests)


def test_the_usage_page_charts_the_requests_just_made(browser: Browser) -> None:
    key = user_key(browser.server, "charted")
    for prompt in ("one", "two", "three"):
        answer = httpx.post(
            browser.server.url + "/api/generate",
            json={"prompt": prompt, "max_tokens": 2},
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
        assert answer.status_code == 200
    key_id = httpx.get(browser.server.url + "/api/me", headers={"Authorization": f"Bearer {key}"}).json()["id"]
    page = browser.open(ADMIN)
    page.click("#tabs button[data-tab=usage]")
    page.wait_for_selector(f"#usage-key option[value='{key_id}']", state="attached")
    page.select_option("#usage-key", key_id)  # a choice takes effect at once, no Show needed
    page.wait_for_function("() => document.querySelector('#usage-status').textContent.startsWith('3 requests')")
    assert page.locator("#chart-tokens svg rect").count() >= 1
    assert page.locator("#usage-table tbody tr").count() == 1
    assert page.text_content("#usage-table tbody td:nth-child(3)") == "3"
    browser.shoot("usage")
    with page.expect_download() as download:
        page.click("#usage-csv")
    lines = Path(download.value.path()).read_text().splitlines()
    assert lines[0].startswith("start,key,model,requests,errors,cancelled")
    assert lines[1].split(",")[1:4:2] == [key_id, "3"]  # whose usage, and the requests
    assert download.value.suggested_filename.startswith(f"llmserver-usage-{key_id}-")
    # Each series its own colour (p50 and p95 told apart), and the error rate on a scale of its own.
    colours = page.eval_on_selector_all("#chart-latency path", "paths => paths.map((p) => p.getAttribute('stroke'))")
    assert len(colours) == 2 and len(set(colours)) == 2
    assert "100%" in (page.text_content("#chart-requests svg") or "")
    # The user's own view: its usage only, no key picker.
    page.click("#sign-out")
    browser.open(key)
    page.click("#tabs button[data-tab=usage]")
    page.wait_for_function("() => document.querySelector('#usage-status').textContent.startsWith('3 requests')")
    assert page.is_hidden("#usage-key-field")


def test_page_weight_and_first_render(browser: Browser) -> None:
    sizes: list[int] = []
    browser.page.on("response", lambda response: sizes.append(len(response.body())))
    started = time.perf_counter()
    page = browser.open()
    page.wait_for_selector("#api-key")
    # The element can be in the page a moment before its first paint is recorded: wait for the entry.
    painted = page.wait_for_function(
        "performance.getEntriesByType('paint').find(e => e.name === 'first-contentful-paint')?.startTime ?? null",
        timeout=10_000,
    ).json_value()
    loaded = time.perf_counter() - started
    assert painted is not None
    print(f"console: {sum(sizes) / 1024:.0f} KB before sign-in, first contentful paint {painted:.0f} ms, "
          f"load {loaded * 1000:.0f} ms")  # fmt: skip
    page.set_viewport_size({"width": 390, "height": 844})  # a phone
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    assert wait_for(lambda: page.is_visible("#sign-in-form"), 2)


def refusals(url: str, headers: dict[str, str]) -> Callable[[dict[str, str], int, str, str | None], None]:
    """A check that a GET of `url` with these query parameters is refused with this status, type and param."""

    def refused(params: dict[str, str], status: int, kind: str, param: str | None) -> None:
        answer = httpx.get(url, params=params, headers=headers)
        assert answer.status_code == status, answer.text
        assert answer.json()["error"]["type"] == kind and answer.json()["error"].get("param") == param

    return refused


def test_me_and_usage_series_answer_with_their_limits(server: Server) -> None:
    key = user_key(server, "series")
    headers = {"Authorization": f"Bearer {key}"}
    me = httpx.get(server.url + "/api/me", headers=headers).json()
    assert me["name"] == "series" and me["admin"] is False and me["server"]["max_files"] == 5
    assert me["server"]["max_file_bytes"] == 15 * 1024 * 1024 and me["server"]["max_images"] == 4
    for _ in range(2):
        generated = httpx.post(server.url + "/api/generate", json={"prompt": "hi", "max_tokens": 2}, headers=headers)
        assert generated.status_code == 200
    series = httpx.get(server.url + "/api/usage/series", params={"offset_minutes": 330}, headers=headers).json()
    assert sum(p["requests"] for p in series["points"]) == 2 and series["bucket"] == 86400
    assert sum(p["errors"] + p["cancelled"] for p in series["points"]) == 0
    # A request its client gives up on (the Playground's Stop): cancelled, not an error.
    asked = [{"role": "user", "content": "Count to 500."}]
    body = {"model": MODEL, "messages": asked, "stream": True, "max_tokens": 400}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as stream:
        next(stream.iter_lines())

    def points() -> list[dict[str, Any]]:
        return list(httpx.get(server.url + "/api/usage/series", headers=headers).json()["points"])

    assert wait_for(lambda: sum(p["cancelled"] for p in points()) == 1, 30)
    assert sum(p["errors"] for p in points()) == 0 and sum(p["requests"] for p in points()) == 3
    assert all((p["start"] + 330 * 60) % 86400 == 0 for p in series["points"])  # local midnight at +05:30

    refused = refusals(server.url + "/api/usage/series", headers)
    refused({"bucket": "week"}, 400, "invalid_request_error", "bucket")
    refused({"offset_minutes": "841"}, 400, "invalid_request_error", "offset_minutes")
    refused({"bucket": "hour", "since": "0"}, 400, "invalid_request_error", "bucket")  # over 2,000 buckets
    refused({"since": "yesterday"}, 400, "invalid_request_error", "since")
    refused({"key": "*"}, 403, "permission_error", None)


def visible_text(page: Any) -> str:
    """What the page holds that a person could read: its text, its fields' values, its storage."""
    return str(
        page.evaluate(
            "() => [document.body.innerText, document.body.textContent,"
            " ...[...document.querySelectorAll('input, textarea, select')].map((e) => e.value),"
            " JSON.stringify(sessionStorage), JSON.stringify(localStorage)].join('\\n')"
        )
    )


def test_sign_out_leaves_nothing_of_the_session_and_no_page_opens_signed_out(browser: Browser) -> None:
    page = browser.open()
    page.goto(browser.server.url + "/console#/keys")  # a page's address before any sign-in: the form stays
    assert page.is_visible("#sign-in-form") and page.is_hidden("#keys") and page.is_hidden("#tabs")
    page.fill("#api-key", ADMIN)
    page.click("#sign-in-form button[type=submit]")
    page.wait_for_selector("#keys:not([hidden])")  # the address's page, an admin's
    assert page.evaluate("document.activeElement.id") == "keys-title"  # focus on the page, not lost to the body
    assert page.get_attribute("#tabs button[data-tab=keys]", "aria-selected") == "true"
    page.fill("#key-name", "secret-holder")
    page.check("#key-admin")
    page.click("#key-submit")
    page.wait_for_selector("#new-key:not([hidden])")
    secret = page.text_content("#new-key-value") or ""
    assert len(secret) >= 32
    page.click("#tabs button[data-tab=playground]")
    assert page.url.endswith("#/playground")
    page.wait_for_selector("#play-model option", state="attached")
    page.fill("#play-message", "my private question")
    page.click("#sign-out")
    page.wait_for_selector("#sign-in:not([hidden])")
    assert page.is_hidden("#tabs") and not page.url.endswith("#/playground")
    assert page.text_content("#who-name") == ""  # hidden, yet it held "admin (admin)"
    held = visible_text(page)
    assert secret not in held and "my private question" not in held and "secret-holder" not in held
    assert "secret-holder" not in page.content()
    page.goto(browser.server.url + "/console#/keys")
    page.evaluate("() => window.dispatchEvent(new HashChangeEvent('hashchange'))")
    assert page.is_hidden("#keys") and page.is_visible("#sign-in-form")


def test_the_audit_page_lists_the_admin_actions_just_taken_filters_and_pages(browser: Browser) -> None:
    """An admin's actions in the console (a key created, changed, revoked) are rows of the Audit page at once:
    who, what, on what, the change; filtered by action and target, paged; a user key has no Audit tab."""
    page = browser.open(ADMIN)
    page.click("#tabs button[data-tab=keys]")
    page.fill("#key-name", "audited-in-console")
    page.fill("#key-rpm", "30")
    page.click("#key-submit")
    page.wait_for_selector("#new-key:not([hidden])")
    made = page.get_attribute("#keys-table tbody tr:has(td.name:text-is('audited-in-console'))", "data-key")
    secret = page.text_content("#new-key-value") or ""
    assert made and httpx.delete(f"{browser.server.url}/api/keys/{made}", headers={"Authorization": f"Bearer {ADMIN}"})
    page.click("#tabs button[data-tab=audit]")
    assert page.url.endswith("#/audit")
    page.wait_for_selector(f"#audit-table tbody tr:has-text('{made}')")
    rows = page.eval_on_selector_all(
        "#audit-table tbody tr", "(rows) => rows.map((r) => [...r.cells].map((c) => c.textContent))"
    )
    revoked, created = rows[0], next(r for r in rows if r[2] == "keys.create" and "audited-in-console" in r[5])
    assert revoked[2:5] == ["keys.delete", made, "200"] and created[3:5] == [made, "201"]  # what the create made
    assert created[1].startswith("LLMSERVER_ADMIN_KEY") and "rpm: 30" in created[5]
    assert secret not in (page.text_content("#audit") or "")
    browser.shoot("audit")
    page.select_option("#audit-action", "keys.delete")
    page.wait_for_function(
        "() => [...document.querySelectorAll('#audit-table tbody tr td:nth-child(3)')]"
        ".every((cell) => cell.textContent === 'keys.delete')"
    )
    page.select_option("#audit-action", "")
    page.fill("#audit-target", made)
    page.press("#audit-target", "Enter")
    page.wait_for_function("() => document.querySelectorAll('#audit-table tbody tr').length === 2")  # made, revoked
    page.fill("#audit-target", "")
    page.select_option("#audit-size", "25")
    page.wait_for_function("() => document.querySelectorAll('#audit-table tbody tr').length >= 2")
    # A user key has no Audit tab, and its address does not open the page.
    page.click("#sign-out")
    page.wait_for_selector("#sign-in:not([hidden])")
    page.goto(browser.server.url + "/console#/audit")
    page.fill("#api-key", user_key(browser.server, "audit-less"))
    page.click("#sign-in-form button[type=submit]")
    page.wait_for_selector("#tabs:not([hidden])")
    assert page.is_hidden("#tabs button[data-tab=audit]") and page.is_hidden("#audit")


def test_a_revoked_key_is_signed_out_with_the_reason(browser: Browser) -> None:
    key = user_key(browser.server, "soon-revoked")
    page = browser.open(key)
    key_id = httpx.get(browser.server.url + "/api/me", headers={"Authorization": f"Bearer {key}"}).json()["id"]
    revoked = httpx.delete(f"{browser.server.url}/api/keys/{key_id}", headers={"Authorization": f"Bearer {ADMIN}"})
    assert revoked.status_code == 200
    page.click("#tabs button[data-tab=usage]")
    page.wait_for_selector("#sign-in:not([hidden])")
    assert (page.text_content("#sign-in-error") or "").startswith("Signed out: the server refused this key")
    # Revoked while the tab was away: a reload says why, too.
    page.evaluate(f"sessionStorage.setItem('llmserver.key', {key!r})")
    page.reload()
    page.wait_for_function("() => document.querySelector('#sign-in-error').textContent.startsWith('Signed out:')")
    assert page.is_visible("#sign-in-form") and page.is_hidden("#tabs")
    browser.missing.clear()  # the refused calls' 401s are no missing files, and no 404 came


def test_the_playground_keeps_a_conversation_until_a_new_one_is_started(browser: Browser) -> None:
    sent: list[tuple[dict[str, Any], str | None]] = []

    def record(request: Any) -> None:
        if request.url.endswith("/v1/chat/completions"):
            sent.append((json.loads(request.post_data), request.headers.get("x-session-id")))

    browser.page.on("request", record)
    page = playground(browser, "chatter", "My name is Ada.", 8)
    for turn, message in enumerate(["My name is Ada.", "I live in Paris.", "What is my name?"]):
        page.fill("#play-message", message)
        if turn == 2:
            page.press("#play-message", "Control+Enter")  # the keyboard's way to send
        else:
            page.click("#play-send")
        turns(page, 2 * (turn + 1))
    third, session = sent[2]
    assert [m["role"] for m in third["messages"]] == ["user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in third["messages"][::2]] == ["My name is Ada.", "I live in Paris.", "What is my name?"]
    assert all(m["content"].strip() for m in third["messages"][1::2])  # the answers as they streamed in
    assert session and {s for _, s in sent} == {session}  # one conversation, one X-Session-Id: one instance
    page.click("#play-clear")
    assert page.is_hidden("#play-history")
    page.fill("#play-message", "Hello again.")
    page.click("#play-send")
    turns(page, 2)
    fourth, new_session = sent[3]
    assert len(fourth["messages"]) == 1 and new_session not in (None, session)


# Every record the playground keeps in this browser, as stored (read after the page made its database).
KEPT = """() => new Promise((resolve, reject) => {
  const opening = indexedDB.open('llmserver-console');
  opening.onerror = () => reject(opening.error);
  opening.onsuccess = () => {
    const all = opening.result.transaction('conversations').objectStore('conversations').getAll();
    all.onsuccess = () => resolve(all.result.map(
      (r) => ({ slot: r.slot, nonce: Array.from(r.nonce), box: Array.from(r.box) })));
  };
})"""


def turns(page: Any, count: int) -> None:
    """Wait until the conversation shows `count` messages and Send is back (the answer kept)."""
    page.wait_for_function(
        f"() => document.querySelectorAll('#play-history > li').length === {count}"
        " && !document.querySelector('#play-send').disabled",
        timeout=60000,
    )


def test_conversations_are_kept_encrypted_for_their_key_across_reloads_and_sign_ins(browser: Browser) -> None:
    """Before, a reload lost the conversation and nothing listed earlier ones. Now each is kept in the
    browser's IndexedDB, sealed under a key derived from the API key: another key lists none of them,
    the stored bytes hold no word of it, sign-out leaves nothing readable, and the owner finds them
    again at the next sign-in; they rename, delete and delete all."""
    key, stranger = user_key(browser.server, "keeper"), user_key(browser.server, "stranger")
    page = browser.open(key)
    page.wait_for_selector("#play-model option", state="attached")
    page.fill("#play-max-tokens", "8")
    page.fill("#play-message", "My secret word is PERIWINKLE.")
    page.click("#play-send")
    turns(page, 2)
    page.wait_for_selector("#chats li")
    assert page.text_content("#chats li .chat-title") == "My secret word is PERIWINKLE."
    # The answer is shown once, in the conversation (it was also in an answer box below it).
    assert page.evaluate("document.querySelectorAll('#playground .output').length") == 0
    assert page.evaluate("document.querySelector('#play-history').contains(document.querySelector('#play-output'))")
    page.reload()  # the tab keeps its sign-in, and now the conversation it had open
    turns(page, 2)
    assert "PERIWINKLE" in (page.text_content("#play-history") or "")
    (record,) = page.evaluate(KEPT)
    stored = bytes(record["box"])
    assert b"PERIWINKLE" not in stored and b"secret" not in stored and key not in json.dumps(record)
    assert len(record["nonce"]) == 24 and len(stored) > len("My secret word is PERIWINKLE.") + 16
    page.click("#sign-out")
    page.wait_for_selector("#sign-in:not([hidden])")
    assert "PERIWINKLE" not in visible_text(page) and page.evaluate("sessionStorage.length") == 0

    page.fill("#api-key", stranger)  # another key in the same browser: none of them
    page.click("#sign-in-form button[type=submit]")
    page.wait_for_function("() => document.querySelector('#chats-status').textContent === 'None kept yet.'")
    assert page.locator("#chats li").count() == 0 and page.is_hidden("#play-history")
    page.click("#sign-out")

    page.fill("#api-key", key)  # the owner again: the conversation is listed, and opens
    page.click("#sign-in-form button[type=submit]")
    page.wait_for_selector("#chats li")
    page.click("#chats li .chat-title")
    turns(page, 2)
    assert "PERIWINKLE" in (page.text_content("#play-history") or "")
    page.click("#chats li button[aria-label^=Rename]")
    page.fill("#chats li input", "Word games")
    page.press("#chats li input", "Enter")
    page.wait_for_function("() => document.querySelector('#chats li .chat-title')?.textContent === 'Word games'")
    page.click("#play-clear")
    assert page.is_hidden("#play-history")
    page.fill("#play-message", "Hello there.")
    page.click("#play-send")
    turns(page, 2)
    page.wait_for_function("() => document.querySelectorAll('#chats li').length === 2")
    titles = page.eval_on_selector_all("#chats .chat-title", "(nodes) => nodes.map((n) => n.textContent)")
    assert titles == ["Hello there.", "Word games"]  # the latest first
    assert page.get_attribute("#chats li:first-child .chat-title", "aria-current") == "true"
    browser.shoot("playground-conversations")
    page.reload()  # renamed and kept: the titles survive a reload
    page.wait_for_function("() => document.querySelectorAll('#chats li').length === 2")
    assert page.eval_on_selector_all("#chats .chat-title", "(nodes) => nodes.map((n) => n.textContent)") == titles
    page.click("#chats li:first-child button[aria-label^=Delete]")
    page.wait_for_function("() => document.querySelectorAll('#chats li').length === 1")
    assert page.is_hidden("#play-history")  # the open one was deleted: a new conversation
    assert len(page.evaluate(KEPT)) == 1
    page.click("#chats-delete-all")
    page.wait_for_function("() => document.querySelector('#chats-status').textContent === 'None kept yet.'")
    assert page.evaluate(KEPT) == [] and browser.dialogs[-1].startswith("Delete all 1 conversations")


def test_each_message_copies_and_edits_and_the_last_answer_regenerates(browser: Browser) -> None:
    sent: list[dict[str, Any]] = []
    browser.page.on(
        "request",
        lambda request: sent.append(json.loads(request.post_data))
        if request.url.endswith("/v1/chat/completions") else None,
    )  # fmt: skip
    page = playground(browser, "editor", "Name a fruit.", 6)
    page.click("#play-send")
    turns(page, 2)
    page.fill("#play-message", "Name a colour.")
    page.click("#play-send")
    turns(page, 4)
    page.click("#play-history > li:nth-child(1) button[aria-label^=Copy]")
    assert page.evaluate("navigator.clipboard.readText()") == "Name a fruit."
    # Regenerate: the same turns sent again, the last answer replaced (still four messages).
    with page.expect_request("**/v1/chat/completions"):
        page.click("#play-history button[aria-label^=Regenerate]")
    turns(page, 4)
    assert len(sent) == 3 and sent[2]["messages"] == sent[1]["messages"]
    assert page.locator("#play-history button[aria-label^=Regenerate]").count() == 1
    # Edit the first message: it and every turn after it are replaced by the edited one and its answer.
    page.click("#play-history > li:nth-child(1) button[aria-label^=Edit]")
    assert page.input_value("#play-message") == "Name a fruit." and page.is_visible("#play-editing")
    page.fill("#play-message", "Name a vegetable.")
    with page.expect_request("**/v1/chat/completions"):
        page.click("#play-send")
    turns(page, 2)
    assert [m["content"] for m in sent[3]["messages"]] == ["Name a vegetable."]
    history = page.text_content("#play-history") or ""
    assert "Name a vegetable." in history and "Name a colour." not in history and "Name a fruit." not in history
    assert page.input_value("#play-message") == "" and page.is_hidden("#play-editing")


def test_copy_as_curl_in_async_mode_submits_polls_and_decrypts_as_copied(browser: Browser) -> None:
    """The copied script once stopped after submitting; now it polls and decrypts the answer itself, with
    PyNaCl as the docs say (the python3 first on PATH here is this project's, which has it)."""
    page = playground(browser, "async-curl", "Say yes.", 4)
    page.check("#play-async")
    page.click("#copy-curl")
    code = page.text_content("#play-code") or ""
    assert code.startswith("RESULT_KEY=$(openssl rand -base64 32)") and '"mode":"async"' in code
    key = user_key(browser.server, "async-curl-runner")
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    ran = subprocess.run(["bash", "-c", code], capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "LLMSERVER_API_KEY": key, "PATH": path})  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    usage = httpx.get(browser.server.url + "/api/usage", headers={"Authorization": f"Bearer {key}"}).json()
    assert ran.stdout.strip() and usage["requests"] == 1 and usage["completion_tokens"] >= 1, (ran.stdout, usage)


def test_a_stopped_server_is_shown_as_stale_and_the_page_recovers(chromium: Any, tmp_path: Path) -> None:
    server = Server(data_dir=tmp_path / "data", config=CONFIG, env={"LLMSERVER_ADMIN_KEY": ADMIN}).start()
    context = chromium.new_context(viewport={"width": 1280, "height": 800})
    try:
        session = Browser(server, tmp_path, context.new_page())
        page = session.open(ADMIN)
        page.click("#tabs button[data-tab=playground]")  # its model list read while the server is up
        page.wait_for_selector("#play-model option", state="attached")
        page.click("#tabs button[data-tab=overview]")
        page.wait_for_selector("#instances-table tbody tr button:not([disabled])")
        server.stop()
        page.wait_for_function("() => document.querySelector('#overview').classList.contains('stale')", timeout=10_000)
        assert (page.text_content("#overview-status") or "").startswith("Not up to date: the server cannot be reached")
        assert page.is_disabled("#instances-table tbody tr button") and "error" in (
            page.get_attribute("#overview-status", "class") or ""
        )
        session.shoot("overview-stale")
        page.click("#tabs button[data-tab=models]")  # the Models page says so too
        page.wait_for_function("() => document.querySelector('#models').classList.contains('stale')", timeout=10_000)
        assert (page.text_content("#catalog-status") or "").startswith("Not up to date: the server cannot be reached")
        # Keys and Usage as well (they showed a bare "Failed to fetch"), their actions disabled.
        for tab, status in (("keys", "keys-status"), ("usage", "usage-status"), ("audit", "audit-status")):
            page.click(f"#tabs button[data-tab={tab}]")
            page.wait_for_function(f"() => document.getElementById('{tab}').classList.contains('stale')", timeout=9000)
            assert (page.text_content(f"#{status}") or "").startswith("Not up to date: the server cannot be reached")
            assert page.is_disabled(f"#{tab} form button[type=submit]")
        # The playground says a message it could not send was not sent, and keeps it to send again.
        page.click("#tabs button[data-tab=playground]")
        page.fill("#play-message", "Are you there?")
        page.click("#play-send")
        page.wait_for_function("() => document.querySelector('#play-error').textContent !== ''")
        assert (page.text_content("#play-error") or "").startswith("Not sent: the server cannot be reached")
        assert page.input_value("#play-message") == "Are you there?"
        page.click("#tabs button[data-tab=keys]")
        server.start(keep_port=True)
        # The Keys page comes back by itself, without a resubmit.
        page.wait_for_function("() => !document.querySelector('#keys').classList.contains('stale')", timeout=30_000)
        assert page.is_enabled("#key-submit")
        assert (page.text_content("#keys-status") or "").startswith("Up to date again")
        page.click("#tabs button[data-tab=models]")
        page.wait_for_function("() => !document.querySelector('#models').classList.contains('stale')", timeout=30_000)
        assert page.locator("#catalog-table tbody tr").count() == 1
        page.click("#tabs button[data-tab=overview]")
        page.wait_for_function("() => !document.querySelector('#overview').classList.contains('stale')", timeout=30_000)
        assert (page.text_content("#overview-status") or "").startswith("Updated")
        assert page.is_enabled("#instances-table tbody tr button")
    finally:
        context.close()
        server.stop()


def test_assets_are_compressed_and_revalidated_and_a_new_secret_is_never_stored(server: Server) -> None:
    url = server.url + "/console/assets/vendor/libsodium.js"
    plain = httpx.get(url, headers={"Accept-Encoding": "identity"})
    with httpx.stream("GET", url, headers={"Accept-Encoding": "gzip"}) as packed:
        wire = b"".join(packed.iter_raw())  # as sent, before httpx decodes it
    assert packed.headers["content-encoding"] == "gzip" and gzip.decompress(wire) == plain.content
    assert len(wire) < len(plain.content) / 2
    sizes = len(plain.content) / 1024, len(wire) / 1024
    print("libsodium.js: {:.0f} KiB, {:.0f} KiB gzipped".format(*sizes))
    assert plain.headers["cache-control"] == "no-cache" and "content-security-policy" in packed.headers
    again = httpx.get(url, headers={"If-None-Match": plain.headers["etag"]})
    assert again.status_code == 304 and again.content == b""
    assert httpx.get(server.url + "/console/assets/favicon.svg").headers["content-type"].startswith("image/svg+xml")
    admin = {"Authorization": f"Bearer {ADMIN}"}
    created = httpx.post(server.url + "/api/keys", json={"name": "no-store"}, headers=admin)
    assert created.status_code == 201 and created.headers["cache-control"] == "no-store"


def test_no_page_has_a_serious_accessibility_violation_light_or_dark(browser: Browser) -> None:
    from tests.support import axe

    page = browser.open()
    found = {"sign-in": axe.violations(page)}
    page.fill("#api-key", ADMIN)
    page.click("#sign-in-form button[type=submit]")
    page.wait_for_selector("#instances-table tbody tr")
    for scheme in ("light", "dark"):
        page.emulate_media(color_scheme=scheme)
        for tab in ("overview", "models", "keys", "teams", "usage", "audit", "playground"):
            page.click(f"#tabs button[data-tab={tab}]")
            page.wait_for_selector(f"#{tab}:not([hidden])")
            found[f"{tab} ({scheme})"] = axe.violations(page)
    print({where: [v["id"] for v in problems] for where, problems in found.items()})
    assert {where: problems for where, problems in found.items() if problems} == {}


# The page's visible controls smaller than 24 x 24 px, by name and size.
TOO_SMALL = """() => [...document.querySelectorAll('main button, main input[type=checkbox], main select')]
    .filter((e) => e.offsetParent !== null)
    .map((e) => [e.id || e.getAttribute('aria-label') || e.textContent, e.getBoundingClientRect()])
    .filter(([, r]) => r.width < 24 || r.height < 24)
    .map(([name, r]) => `${name} ${Math.round(r.width)}x${Math.round(r.height)}`)"""


def test_every_page_fits_a_phone_and_row_actions_stay_in_reach(browser: Browser) -> None:
    user_key(browser.server, "a-key-with-a-very-long-name-" + "x" * 120)
    page = browser.open()
    page.set_viewport_size({"width": 390, "height": 844})
    page.fill("#api-key", ADMIN)
    page.click("#sign-in-form button[type=submit]")
    page.wait_for_selector("#instances-table tbody tr")
    wide, small = {}, {}
    for tab in ("overview", "models", "keys", "teams", "usage", "audit", "playground"):
        page.click(f"#tabs button[data-tab={tab}]")
        page.wait_for_selector(f"#{tab}:not([hidden])")
        if tab == "models":
            page.wait_for_selector("#catalog-table tbody tr")
        page.wait_for_timeout(300)  # the charts are drawn at the width they are given
        width = page.evaluate("document.documentElement.scrollWidth")
        if width > 390:
            wide[tab] = width
        browser.shoot(f"phone-{tab}")
        # Touch targets of at least 24 x 24 px (WCAG 2.5.8): the -/+ were 30 x 20, the checkboxes 13 x 13.
        small[tab] = page.evaluate(TOO_SMALL)
    assert wide == {} and {tab: found for tab, found in small.items() if found} == {}
    # The Models table as a card per model: every cell of a row in view, none under the row's actions.
    page.click("#tabs button[data-tab=models]")
    hidden = page.evaluate("""() => [...document.querySelectorAll('#catalog-table tbody tr:first-child td')]
      .filter((td) => {
        td.scrollIntoView({ block: 'center' });
        const r = td.getBoundingClientRect(), hit = document.elementFromPoint(r.left + 4, r.top + r.height / 2);
        return !(r.right <= 390 && hit && td.contains(hit)); }).map((td) => td.dataset.label || td.className)""")
    assert hidden == []
    # A table wider than the phone scrolls inside its own frame, its actions kept in view at the right.
    page.click("#tabs button[data-tab=keys]")
    page.wait_for_selector("#keys-table tbody tr")
    box = (
        page.locator("#keys-table tbody tr", has_text="a-key-with-a-very-long-name")
        .get_by_role("button", name="Revoke a-key-with-a-very-long-name", exact=False)
        .bounding_box()
    )
    assert box is not None and box["x"] + box["width"] <= 390


HOSTILE_ANSWER = (
    "## Steps\n\n1. Run **this**:\n2. then `that`\n\n```sh\necho '<b>not bold</b>'\n```\n\n"
    "<img src=x onerror=\"document.title='owned'\"> and [docs](https://example.org/x) and [bad](javascript:alert(1))"
)


def test_answers_render_as_markdown_and_html_in_them_stays_text(browser: Browser) -> None:
    """The model's output is whatever a prompt made it say: a canned answer (a model cannot be made to
    say exactly this) streamed through the page's own code, as llama-server's events would be."""
    page = playground(browser, "markdown", "Show me.", 64)
    pieces = [HOSTILE_ANSWER[i : i + 7] for i in range(0, len(HOSTILE_ANSWER), 7)]
    events = [{"choices": [{"delta": {"content": piece}}]} for piece in pieces]
    stream = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(status=200, body=stream,
               headers={"Content-Type": "text/event-stream"}))  # fmt: skip
    page.click("#play-send")
    page.wait_for_selector("#play-output.markdown")
    output = "#play-output"
    assert page.text_content(f"{output} h5") == "Steps"
    assert page.eval_on_selector_all(f"{output} ol li", "items => items.length") == 2
    assert page.text_content(f"{output} ol strong") == "this" and page.text_content(f"{output} ol code") == "that"
    assert page.text_content(f"{output} pre code") == "echo '<b>not bold</b>'"
    assert page.eval_on_selector_all(f"{output} img, {output} b, {output} script", "nodes => nodes.length") == 0
    assert "<img src=x" in (page.text_content(output) or "") and page.title() != "owned"
    links = page.eval_on_selector_all(f"{output} a", "links => links.map((a) => [a.textContent, a.href, a.rel])")
    assert links == [["docs", "https://example.org/x", "noopener noreferrer nofollow"]]  # javascript: stays text
    print(f"console.js: {len((ROOT / 'console.js').read_bytes()) / 1024:.1f} KiB with its Markdown renderer")


def test_versioned_assets_are_kept_a_year_and_the_page_revalidated(server: Server) -> None:
    page = httpx.get(server.url + "/console")
    names = re.findall(r'"/console/assets/([0-9a-f]{16})/([a-z.]+)"', page.text)
    assert {name for _, name in names} == {"favicon.svg", "console.css", "console.js"}
    version = names[0][0]
    assert {v for v, _ in names} == {version} and version == console.version()
    for _, name in names:
        asset = httpx.get(f"{server.url}/console/assets/{version}/{name}")
        assert asset.status_code == 200 and asset.content == (ROOT / name).read_bytes()
        assert asset.headers["cache-control"] == "public, max-age=31536000, immutable"
        assert "content-security-policy" in asset.headers
    # A page loaded before an upgrade names an older version: the current file, revalidated, never kept.
    older = httpx.get(f"{server.url}/console/assets/{'0' * 16}/console.js")
    assert older.status_code == 200 and older.headers["cache-control"] == "no-cache"
    assert httpx.get(server.url + "/console/assets/console.js").headers["cache-control"] == "no-cache"
    assert httpx.get(f"{server.url}/console/assets/{version}/nothing.js").status_code == 404
    # The page itself: revalidated every load, a 304 while no asset changed.
    assert page.headers["cache-control"] == "no-cache"
    again = httpx.get(server.url + "/console", headers={"If-None-Match": page.headers["etag"]})
    assert again.status_code == 304 and again.content == b""


def test_the_assets_version_changes_with_any_assets_bytes(tmp_path: Path) -> None:
    folder = tmp_path / "static"
    shutil.copytree(ROOT, folder)
    first = console.version(folder)
    (folder / "index.html").write_text("changed")  # the page names the version: not part of it
    assert console.version(folder) == first
    (folder / "console.css").write_bytes((folder / "console.css").read_bytes() + b"\n")
    assert console.version(folder) != first


def test_tabs_are_one_tab_stop_and_arrow_keys_move_between_them(browser: Browser) -> None:
    page = browser.open(ADMIN)
    page.wait_for_selector("#overview:not([hidden])")
    stops = (
        "() => [...document.querySelectorAll('#tabs button')].filter((b) => b.tabIndex === 0).map((b) => b.dataset.tab)"
    )
    assert page.evaluate(stops) == ["overview"]
    page.focus("#tabs button[data-tab=overview]")
    focused = "document.activeElement.dataset.tab"
    for key, tab in (("ArrowRight", "models"), ("End", "playground"), ("ArrowRight", "overview"),
                     ("ArrowLeft", "playground"), ("Home", "overview"), ("ArrowRight", "models")):  # fmt: skip
        page.keyboard.press(key)
        page.wait_for_selector(f"#{tab}:not([hidden])")
        assert page.evaluate(focused) == tab and page.url.endswith(f"#/{tab}"), key
        assert page.get_attribute(f"#tabs button[data-tab={tab}]", "aria-selected") == "true"
        assert page.evaluate(stops) == [tab]
    # A user key's tab list skips the admin pages it does not have.
    page.click("#sign-out")
    browser.open(user_key(browser.server, "arrows"))
    page.focus("#tabs button[data-tab=playground]")
    page.keyboard.press("ArrowRight")
    page.wait_for_selector("#usage:not([hidden])")
    page.keyboard.press("ArrowRight")
    page.wait_for_selector("#playground:not([hidden])")


def catalog(server: Server, name: str) -> httpx.Response:
    return httpx.get(f"{server.url}/api/models/{name}", headers={"Authorization": f"Bearer {ADMIN}"})


def test_the_models_page_adds_scales_edits_and_removes_a_model_with_problems_at_their_fields(browser: Browser) -> None:
    page = browser.open(ADMIN)
    page.click("#tabs button[data-tab=models]")
    served = page.locator(f"#catalog-table tr[data-model='{MODEL}']")
    served.locator(".badge.ready").first.wait_for()
    assert served.get_by_role("button", name=f"Edit {MODEL}").is_disabled()  # from the config file: changed there
    # From the config file: in the catalog (SQLite), or this gateway's own beside a shared one (PostgreSQL).
    assert "127.0.0.1:" in served.text_content() and served.locator("td").nth(2).text_content().startswith("file")

    def error_at(field: str) -> str:
        return str(page.text_content(f"#model-form .field-error[data-for={field}]"))

    # Every problem the page can see, at once, before anything is sent.
    page.fill("#model-min", "100")
    page.fill("#model-more", "{oops")
    page.click("#model-submit")
    assert error_at("name") and "0 to 64" in error_at("min_instances") and error_at("more").startswith("Not JSON")
    assert page.get_attribute("#model-min", "aria-invalid") == "true"
    # What only the server knows, at the field it names: the API's own message.
    page.fill("#model-name", "has a space")
    page.fill("#model-min", "0")
    page.fill("#model-more", "")
    page.click("#model-submit")
    refused = httpx.post(browser.server.url + "/api/models", json={"name": "has a space", "min_instances": 0},
                         headers={"Authorization": f"Bearer {ADMIN}"})  # fmt: skip
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "name"
    page.wait_for_function("() => document.querySelector('#model-form .field-error[data-for=name]').textContent !== ''")
    said = refused.json()["error"]["message"].removeprefix("name: ")  # the label says which field
    assert error_at("name") == said[0].upper() + said[1:]
    # A check across fields names the one to fix (it was the form's general line): the page sees it first.
    half = httpx.post(browser.server.url + "/api/models", json={"name": "half", "hf_repo": "org/repo"},
                      headers={"Authorization": f"Bearer {ADMIN}"}).json()["error"]  # fmt: skip
    assert half["param"] == "hf_file" and half["message"] == "hf_file: hf_repo and hf_file go together"
    page.fill("#model-hf-repo", "org/repo")
    page.click("#model-submit")
    assert "go together" in error_at("hf_file") and page.text_content("#model-error") == ""
    page.fill("#model-hf-repo", "")
    page.fill("#model-name", "console-added")
    page.fill("#model-more", '{"no_such_setting": 1}')
    page.click("#model-submit")
    page.wait_for_function("() => document.querySelector('#model-form .field-error[data-for=more]').textContent !== ''")
    assert error_at("more") == "Unrecognized request argument supplied: no_such_setting"
    assert catalog(browser.server, "console-added").status_code == 404  # nothing added by the refusals
    # Added, with no instance kept; then scaled to one, which starts and serves.
    page.fill("#model-more", '{"cache_ram_mb": 0}')
    page.fill("#model-ctx", "512")
    page.fill("#model-parallel", "1")
    page.click("#model-submit")
    added = page.locator("#catalog-table tr[data-model='console-added']")
    added.wait_for()
    assert "0 ready of 0 (0\u20131)" in added.text_content() and added.locator("td").nth(2).text_content() == "api"
    added.get_by_role("button", name="Keep one instance more of console-added running").click()
    added.locator(".badge.ready").first.wait_for(timeout=60_000)
    assert catalog(browser.server, "console-added").json()["settings"]["min_instances"] == 1
    asked = {"model": "console-added", "prompt": "hi", "max_tokens": 2}
    answer = httpx.post(
        browser.server.url + "/api/generate", json=asked, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60
    )
    assert answer.status_code == 200, answer.text
    browser.shoot("models")
    added.get_by_role("button", name="Edit console-added").click()
    assert page.input_value("#model-ctx") == "512" and page.is_disabled("#model-name")
    page.fill("#model-ctx", "768")
    page.click("#model-submit")
    page.wait_for_function("() => document.querySelector('#catalog-status').textContent.includes('saved')")
    settings = catalog(browser.server, "console-added").json()
    assert (settings["settings"]["ctx_size"], settings["settings"]["min_instances"], settings["revision"]) == (
        768,
        1,
        3,
    )
    # Minus to no instance kept: the idle one stops now (not after its idle_timeout); minus again stops it.
    row_says = (
        "(text) => document.querySelector(\"#catalog-table tr[data-model='console-added']\").textContent.includes(text)"
    )
    page.wait_for_function(row_says, arg="1 ready of 1")
    added.get_by_role("button", name="Keep one instance fewer of console-added running").click()
    page.wait_for_function(row_says, arg="0 ready of 0", timeout=15_000)
    added.get_by_role("button", name="Stop console-added").click()
    page.wait_for_function("() => document.querySelector('#catalog-status').textContent.includes('stopped')")
    assert browser.dialogs[-1].startswith("Stop console-added?")
    assert catalog(browser.server, "console-added").json()["settings"]["max_instances"] == 0
    added.get_by_role("button", name="Remove console-added").click()
    page.wait_for_function("() => !document.querySelector(\"#catalog-table tr[data-model='console-added']\")")
    assert browser.dialogs[-1].startswith("Remove the model console-added?")
    assert catalog(browser.server, "console-added").status_code == 404
    names = httpx.get(browser.server.url + "/v1/models", headers={"Authorization": f"Bearer {ADMIN}"}).json()["data"]
    assert [m["id"] for m in names] == [MODEL]


@contextlib.contextmanager
def catalog_model(server: Server, body: dict[str, Any]) -> Iterator[None]:
    """A model added to the catalog through the admin API for the while, removed after."""
    added = httpx.post(server.url + "/api/models", json=body, headers={"Authorization": f"Bearer {ADMIN}"})
    assert added.status_code == 201, added.text
    try:
        yield
    finally:
        httpx.delete(f"{server.url}/api/models/{body['name']}", headers={"Authorization": f"Bearer {ADMIN}"})


def test_scale_minus_undoes_plus_and_each_says_what_the_row_then_shows(browser: Browser) -> None:
    """+ raised max_instances with min_instances; - lowered only the minimum and said "1 instance kept
    running" while the row went on showing 2 of 2."""
    body = {"name": "scale-me", "min_instances": 1, "max_instances": 1, "ctx_size": 512, "parallel": 1}
    with catalog_model(browser.server, {**body, "cache_ram_mb": 0}):
        page = browser.open(ADMIN)
        page.click("#tabs button[data-tab=models]")
        row = page.locator("#catalog-table tr[data-model='scale-me']")
        row_says = "(text) => document.querySelector(\"tr[data-model='scale-me']\")?.textContent.includes(text)"
        page.wait_for_function(row_says, arg="1 ready of 1 (1\u20131)", timeout=60_000)
        row.get_by_role("button", name="Keep one instance more of scale-me running").click()
        page.wait_for_function("() => document.querySelector('#catalog-status').textContent.startsWith('scale-me: 2')")
        assert page.text_content("#catalog-status") == "scale-me: 2 instances kept running."
        page.wait_for_function(row_says, arg="2 ready of 2 (2\u20132)", timeout=60_000)
        row.get_by_role("button", name="Keep one instance fewer of scale-me running").click()
        page.wait_for_function("() => document.querySelector('#catalog-status').textContent.startsWith('scale-me: 1')")
        settings = catalog(browser.server, "scale-me").json()["settings"]
        assert (settings["min_instances"], settings["max_instances"]) == (1, 1)
        said = "scale-me: 1 instance kept running; the idle ones above that stop now."
        assert page.text_content("#catalog-status") == said
        page.wait_for_function(row_says, arg="1 ready of 1 (1\u20131)", timeout=15_000)  # as said
        assert len([i for i in instances(browser.server) if i["model"] == "scale-me"]) == 1


def test_a_model_that_cannot_start_says_why_at_its_row_and_its_log_is_a_click_away(browser: Browser) -> None:
    """A catalog model whose GGUF llama-server cannot load (its header reads, it holds no tensor): the
    row shows why its instance failed, and its llama-server log's last lines open under it."""
    empty = browser.server.data_dir / "models" / "empty.gguf"
    empty.parent.mkdir(parents=True, exist_ok=True)
    empty.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))
    with catalog_model(browser.server, {"name": "cannot-load", "path": str(empty), "ctx_size": 512, "parallel": 1}):
        page = browser.open(ADMIN)
        page.click("#tabs button[data-tab=models]")
        row = page.locator("#catalog-table tr[data-model='cannot-load']")
        row.locator(".start-failure summary").wait_for(timeout=60_000)  # the page refreshes every 3 s
        failure = catalog(browser.server, "cannot-load").json()["last_start_failure"]
        assert failure["message"] in row.locator(".start-failure .problem").text_content()
        assert not row.locator(".start-failure pre").is_visible()  # a click away
        row.locator(".start-failure summary").click()
        log_shown = str(row.locator(".start-failure pre").text_content())
        # The model is retried: the page may show a later attempt's log than the one read above, the same
        # lines but for llama-server's elapsed-time stamps.
        unstamped = re.sub(r"(?m)^[0-9.]+ ", "", log_shown)
        assert (
            row.locator(".start-failure pre").is_visible() and re.sub(r"^[0-9.]+ ", "", failure["log"][-1]) in unstamped
        )
        assert "failed to load model" in log_shown  # llama-server's own words
        browser.shoot("models-start-failure")


def test_the_usage_page_shows_each_key_and_model_the_quota_and_pages_the_request_log(browser: Browser) -> None:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    made = httpx.post(browser.server.url + "/api/keys", headers=admin,
                      json={"name": "logged", "quota_tokens": 90000, "quota_period": "day"}).json()  # fmt: skip
    key, key_id = made["key"], made["id"]
    for i in range(27):
        answer = httpx.post(browser.server.url + "/api/generate", json={"prompt": f"n{i}", "max_tokens": 1},
                            headers={"Authorization": f"Bearer {key}"}, timeout=60)  # fmt: skip
        assert answer.status_code == 200, answer.text
    page = browser.open(ADMIN)
    page.click("#tabs button[data-tab=usage]")
    page.wait_for_selector(f"#usage-keys tr[data-key='{key_id}']")  # all keys: a row per key
    row = page.locator(f"#usage-keys tr[data-key='{key_id}']")
    assert row.locator("td").nth(0).text_content() == "logged" and row.locator("td").nth(1).text_content() == "27"
    assert re.search(
        r"of 90,000 used today \(UTC\); [\d,]+ left, resets ", row.locator("td.quota").text_content() or ""
    )
    page.select_option("#usage-key", key_id)
    # One key: its quota above, no per-key table (waited for: alone, every key's total is 27 requests too).
    page.wait_for_function(
        "() => document.querySelector('#usage-status').textContent.startsWith('27 requests')"
        " && document.querySelector('#usage-keys-part').hidden"
    )
    assert page.text_content("#usage-quota").startswith("Quota of logged: ")
    assert page.locator("#usage-models tbody tr").count() == 1
    assert page.text_content("#usage-models tbody td:nth-child(2)") == "27"
    # The request log, newest first, 25 a page: the first page, the next (2 more), and back.
    page.select_option("#log-size", "25")
    page.wait_for_function("() => document.querySelectorAll('#log-table tbody tr').length === 25")
    assert page.text_content("#log-status-line").startswith("Requests 1\u201325, newest first")
    logged = httpx.get(
        browser.server.url + "/api/usage/requests", params={"key": key_id, "limit": 27}, headers=admin
    ).json()
    ids = [
        int(i) for i in page.eval_on_selector_all("#log-table tbody tr", "rows => rows.map((r) => r.dataset.request)")
    ]
    assert ids == [r["id"] for r in logged["data"][:25]]
    first = page.locator("#log-table tbody tr").first
    assert first.locator("td").nth(1).text_content() == "logged" and first.locator("td").nth(4).text_content() == "ok"
    assert first.locator("td").nth(10).text_content() == logged["data"][0]["instance_id"]
    cost = logged["data"][0]["cost"]
    assert cost > 0 and first.locator("td").nth(9).text_content() == shown_money(page, cost)  # at its price
    page.click("#log-older")
    page.wait_for_function("() => document.querySelectorAll('#log-table tbody tr').length === 2")
    assert page.text_content("#log-status-line").startswith("Requests 26\u201327") and page.is_disabled("#log-older")
    browser.shoot("usage-log")
    page.click("#log-newer")
    page.wait_for_function("() => document.querySelectorAll('#log-table tbody tr').length === 25")
    assert page.is_disabled("#log-newer")
    page.select_option("#log-status", "cancelled")
    page.wait_for_function("() => document.querySelector('#log-status-line').textContent === 'No requests match.'")


def shown_money(page: Any, amount: float) -> str:
    """An amount of USD as the page writes it, in the browser's locale: cents, or 6 digits below a cent."""
    digits = 6 if 0 < abs(amount) < 0.01 else 2
    return str(page.evaluate(
        "([a, d]) => a.toLocaleString(undefined, {style: 'currency', currency: 'USD', minimumFractionDigits: 2,"
        " maximumFractionDigits: d})",
        [amount, digits],
    ))  # fmt: skip


def test_the_request_log_and_quota_standing_answer_with_their_limits(server: Server) -> None:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    made = httpx.post(server.url + "/api/keys", headers=admin,
                      json={"name": "log-api", "quota_tokens": 90000, "quota_period": "day"}).json()  # fmt: skip
    headers = {"Authorization": f"Bearer {made['key']}"}
    for prompt in ("a", "b", "c"):
        assert (
            httpx.post(
                server.url + "/api/generate", json={"prompt": prompt, "max_tokens": 2}, headers=headers
            ).status_code
            == 200
        )
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count to 500."}],
        "stream": True,
        "max_tokens": 400,
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as stream:
        next(stream.iter_lines())  # then gone: a cancelled request

    def log(**params: Any) -> dict[str, Any]:
        answer = httpx.get(server.url + "/api/usage/requests", params=params, headers=headers)
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    assert wait_for(lambda: len(log()["data"]) == 4, 30)
    newest = log(limit=3)
    assert len(newest["data"]) == 3 and newest["has_more"] is True
    rest = log(limit=3, before=newest["next_before"])
    assert len(rest["data"]) == 1 and rest["has_more"] is False and rest["next_before"] is None
    everything = newest["data"] + rest["data"]
    assert [r["id"] for r in everything] == sorted((r["id"] for r in everything), reverse=True)
    assert [r["status"] for r in everything] == ["cancelled", "ok", "ok", "ok"]
    assert everything[0]["outcome"] == "client_closed" and everything[0]["endpoint"] == "/v1/chat/completions"
    assert {r["key"] for r in everything} == {made["id"]} and all(r["instance_id"] for r in everything[1:])
    assert len(log(status="ok")["data"]) == 3 and len(log(status="error")["data"]) == 0
    assert len(log(model=MODEL)["data"]) == 4 and log(model="no-such-model")["data"] == []
    # Where its quota stands: the same on /api/me and in the admin's key list, once nothing is in flight.
    me = httpx.get(server.url + "/api/me", headers=headers).json()
    assert wait_for(lambda: httpx.get(server.url + "/api/me", headers=headers).json()["quota"]["reserved"] == 0, 30)
    me = httpx.get(server.url + "/api/me", headers=headers).json()
    quota = me["quota"]
    assert quota["used"] > 0 and quota["used"] + quota["left"] == 90000 and quota["period"] == "day"
    tomorrow = time.gmtime(time.time() + 86400)
    assert quota["resets_at"] == time.strftime("%Y-%m-%dT00:00:00+00:00", tomorrow)
    listed = httpx.get(server.url + "/api/keys", headers=admin).json()["data"]
    assert next(k for k in listed if k["id"] == made["id"])["quota"] == quota
    assert httpx.get(server.url + "/api/me", headers=admin).json()["quota"] is None  # no quota: none to show

    refused = refusals(server.url + "/api/usage/requests", headers)
    refused({"limit": "0"}, 400, "invalid_request_error", "limit")
    refused({"limit": "501"}, 400, "invalid_request_error", "limit")
    refused({"status": "failed"}, 400, "invalid_request_error", "status")
    refused({"before": "0"}, 400, "invalid_request_error", "before")
    refused({"before": "newest"}, 400, "invalid_request_error", "before")
    refused({"before": str(2**63)}, 400, "invalid_request_error", "before")  # past a database's integers
    refused({"since": "yesterday"}, 400, "invalid_request_error", "since")
    refused({"key": "*"}, 403, "permission_error", None)
    refused({"key": "key_of_someone_else"}, 403, "permission_error", None)


def test_the_teams_page_makes_a_team_its_keys_spend_against_its_budget_bar_and_usage_by_team(browser: Browser) -> None:
    """An admin makes a team (its problems at their fields first), puts two keys in it from the Keys page,
    and sees the members' spend on the team's budget bar, on the Keys page and summed per team on the
    Usage page, each equal to what the API says; a team with keys is not deleted; its team admin signs in
    to its own team's keys only."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    page = browser.open(ADMIN)
    page.click("#tabs button[data-tab=teams]")
    page.fill("#team-name", "console-team")
    page.fill("#team-budget", "-1")
    page.fill("#team-quota", "100000")
    page.click("#team-submit")
    assert (
        page.text_content("#team-form .field-error[data-for=budget]") == "An amount of more than 0, or empty for none."
    )
    assert page.text_content("#team-form .field-error[data-for=quota_period]")  # every problem at once
    page.fill("#team-budget", "2")
    page.select_option("#team-period", "day")
    page.click("#team-submit")
    assert page.text_content("#team-form .field-error[data-for=budget_period]", timeout=2000)
    page.select_option("#team-budget-period", "day")
    page.click("#team-submit")
    page.wait_for_function("() => document.querySelector('#teams-status').textContent.includes('created')")
    row = page.locator("#teams-table tbody tr", has_text="console-team")
    team_id = row.get_attribute("data-team")
    assert row.locator("td.members").text_content() == "none"
    assert (row.locator("td.budget").text_content() or "").startswith("$0.00 of $2.00 spent today (UTC)")

    page.click("#tabs button[data-tab=keys]")
    secrets: dict[str, str] = {}
    for name, team_admin in (("console-member", False), ("console-team-admin", True)):
        page.fill("#key-name", name)
        page.select_option("#key-team", label="console-team")
        if team_admin:
            page.check("#key-team-admin")
        page.click("#key-submit")
        page.wait_for_function(
            "(n) => document.querySelector('#keys-status').textContent === `Key ${n} created.`", arg=name
        )
        secrets[name] = page.text_content("#new-key-value") or ""
    listed = {k["name"]: k for k in httpx.get(browser.server.url + "/api/keys", headers=admin).json()["data"]}
    assert listed["console-member"]["team_id"] == team_id and not listed["console-member"]["team_admin"]
    assert listed["console-team-admin"]["team_id"] == team_id and listed["console-team-admin"]["team_admin"]
    member_row = page.locator(f"#keys-table tbody tr[data-key='{listed['console-member']['id']}']")
    assert member_row.locator("td.team").text_content() == "console-team"
    assert (
        page.locator(
            f"#keys-table tbody tr[data-key='{listed['console-team-admin']['id']}'] td:nth-child(3)"
        ).text_content()
        == "team admin"
    )

    for i in range(3):
        answer = httpx.post(browser.server.url + "/api/generate", json={"prompt": f"spend {i}", "max_tokens": 4},
                            headers={"Authorization": f"Bearer {secrets['console-member']}"}, timeout=60)  # fmt: skip
        assert answer.status_code == 200, answer.text
    team = httpx.get(f"{browser.server.url}/api/teams/{team_id}", headers=admin).json()
    assert team["spend"]["spent"] > 0 and team["spend"]["reserved"] == 0
    assert sorted(k["name"] for k in team["keys"]) == ["console-member", "console-team-admin"]

    page.click("#tabs button[data-tab=teams]")
    page.wait_for_function(
        "([id, spent]) => Math.abs("
        "Number(document.querySelector(`#teams-table tr[data-team='${id}'] meter`)?.value) - spent) < 1e-9",
        arg=[team_id, team["spend"]["spent"]],
    )  # fmt: skip
    assert row.locator("td.members").text_content() == "console-member, console-team-admin"
    bar = row.locator("meter")
    assert float(bar.get_attribute("max") or 0) == 2 and float(bar.get_attribute("high") or 0) == 1.6
    browser.shoot("teams")
    row.get_by_role("button", name="Delete the team console-team").click()
    page.wait_for_function("() => document.querySelector('#teams-status').classList.contains('error')")
    assert "2 active keys" in (page.text_content("#teams-status") or "") and "Delete the team" in browser.dialogs[-1]
    assert httpx.get(f"{browser.server.url}/api/teams/{team_id}", headers=admin).status_code == 200
    page.fill("#team-name", "console-team")  # the server's refusal, at the field it names
    page.click("#team-submit")
    page.wait_for_function("() => document.querySelector('#team-form .field-error[data-for=name]').textContent")
    assert "already exists" in (page.text_content("#team-form .field-error[data-for=name]") or "")

    page.click("#tabs button[data-tab=usage]")
    team_row = page.locator(f"#usage-teams tr[data-team='{team_id}']")
    team_row.wait_for()
    usage = httpx.get(
        browser.server.url + "/api/usage", params={"key": listed["console-member"]["id"]}, headers=admin
    ).json()
    assert team_row.locator("td").nth(0).text_content() == "console-team"
    assert team_row.locator("td").nth(1).text_content() == "3"
    assert team_row.locator("td").nth(5).text_content() == shown_money(page, usage["cost"])
    assert (team_row.locator("td.budget").text_content() or "").endswith("resets " + page.evaluate(
        "(t) => new Date(t).toLocaleString()", team["spend"]["resets_at"]))  # fmt: skip

    # The team's admin: its own team's keys, nothing of the server's.
    page.click("#sign-out")
    page.fill("#api-key", secrets["console-team-admin"])
    page.click("#sign-in-form button[type=submit]")
    page.wait_for_selector("#keys:not([hidden])")
    assert page.text_content("#who-name") == "console-team-admin (admin of team console-team)"
    visible = page.eval_on_selector_all("#tabs button:not([hidden])", "b => b.map((x) => x.dataset.tab)")
    assert visible == ["keys", "usage", "playground"]
    page.wait_for_function("() => document.querySelectorAll('#keys-table tbody tr').length === 2")
    assert page.is_hidden("#key-team") and page.is_hidden("#key-admin") and page.is_hidden("#key-team-admin")
    page.fill("#key-name", "made-by-the-team-admin")
    page.fill("#key-budget", "5")  # more than the team's: refused at the field
    page.select_option("#key-budget-period", "day")
    page.click("#key-submit")
    page.wait_for_function("() => document.querySelector('#key-form .field-error[data-for=budget]').textContent")
    assert page.text_content("#key-form .field-error[data-for=budget]") == "At most the team's 2.0"
    page.fill("#key-budget", "0.5")
    page.click("#key-submit")
    page.wait_for_function(
        "() => document.querySelector('#keys-status').textContent === 'Key made-by-the-team-admin created.'"
    )
    made = next(k for k in httpx.get(browser.server.url + "/api/keys", headers=admin).json()["data"]
                if k["name"] == "made-by-the-team-admin")  # fmt: skip
    assert made["team_id"] == team_id and made["budget"] == 0.5 and made["budget_period"] == "day"
    page.goto(browser.server.url + "/console#/teams")  # an admin page by its address: not for this key
    page.wait_for_selector("#tabs:not([hidden])")
    assert page.is_hidden("#teams")
