"""Images in chat through the real server and a real vision path: llama-server loads a generated
mmproj (random weights, see tests/support/vision_model.py), encodes each image and counts its tokens."""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.support import MODEL, Server, assert_error, create_key, images, make_key_record, use_total_quota
from tests.support.local_http import LocalHTTPServer, QuietHandler
from tests.support.vision_model import IMAGE_TOKENS, write_vision_model

# This module starts a server of its own (two models, one vision-capable): selected out by -m 'not slow'.
pytestmark = pytest.mark.slow

VISION = "tiny-vision"
PHOTO = images.png(2000, 1000)


class ImageFiles(QuietHandler):
    hits = 0

    def do_GET(self) -> None:
        ImageFiles.hits += 1
        body = PHOTO if self.path == "/photo.png" else b"\x89PNG" + bytes(9 * 1024 * 1024)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    server = LocalHTTPServer()
    server.serve(ImageFiles)
    yield server.base_url
    server.stop()


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory: pytest.TempPathFactory, image_server: str) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("vision")
    model, mmproj = write_vision_model(folder / "model")
    config = f"""
limits.images.fetch_allow_hosts = ["{image_server.removeprefix("http://")}"]
server.max_request_bytes = 25165824

[[models]]
name = "{MODEL}"
parallel = 1
ctx_size = 1024

[[models]]
name = "{VISION}"
path = "{model}"
mmproj = "{mmproj}"
parallel = 2
ctx_size = 1024
"""
    server = Server(data_dir=folder / "data", config=config).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(vision_server: Server) -> Iterator[httpx.Client]:
    key = create_key(vision_server.data_dir, "vision")
    with httpx.Client(base_url=vision_server.url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as c:
        yield c


def chat(*parts: dict[str, object], model: str = VISION, **extra: object) -> dict[str, object]:
    content = [{"type": "text", "text": "What is in the picture?"}, *parts]
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


def prompt_tokens(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens"])


def test_models_say_which_are_vision_capable(client: httpx.Client) -> None:
    models = {m["id"]: m["vision_capable"] for m in client.get("/v1/models").json()["data"]}
    assert models == {MODEL: False, VISION: True}


def test_an_image_adds_its_tokens_and_is_sent_downscaled(vision_server: Server, client: httpx.Client) -> None:
    without = prompt_tokens(client.post("/v1/chat/completions", json=chat()))
    with_image = prompt_tokens(
        client.post("/v1/chat/completions", json=chat(images.image_part(images.data_uri(PHOTO))))
    )
    assert with_image == without + IMAGE_TOKENS
    # The gateway logs what it sent the instance: the 2000 x 1000 photo as 768 x 384.
    assert re.search(r"image 2000x1000 sent as 768x384", vision_server.log())


def test_a_streamed_request_with_an_image(client: httpx.Client) -> None:
    body = chat(images.image_part(images.data_uri(PHOTO)), stream=True, stream_options={"include_usage": True})
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert '"prompt_tokens"' in lines[-2]


def test_the_native_api_and_the_openai_sdk_take_images(vision_server: Server, client: httpx.Client) -> None:
    base = {"model": VISION, "prompt": "Describe.", "max_tokens": 2}
    plain = client.post("/api/generate", json=base).json()["prompt_tokens"]
    native = client.post("/api/generate", json={**base, "images": [images.data_uri(images.png(64, 64))]})
    assert native.status_code == 200, native.text
    assert native.json()["prompt_tokens"] == plain + IMAGE_TOKENS
    raw = client.post("/api/generate", json={**base, "raw": True, "images": [images.data_uri(PHOTO)]})
    assert_error(raw, 400, "invalid_request_error", "images")

    key = client.headers["Authorization"].removeprefix("Bearer ")
    with openai.OpenAI(base_url=vision_server.url + "/v1", api_key=key, max_retries=0) as sdk:
        answer = sdk.chat.completions.create(
            model=VISION,
            max_tokens=2,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Describe."},
                        {"type": "image_url", "image_url": {"url": images.data_uri(PHOTO)}},
                    ],
                }
            ],
        )
    assert answer.usage is not None and answer.usage.prompt_tokens > IMAGE_TOKENS


def test_images_by_url(client: httpx.Client, image_server: str) -> None:
    without = prompt_tokens(client.post("/v1/chat/completions", json=chat()))
    fetched = client.post("/v1/chat/completions", json=chat(images.image_part(image_server + "/photo.png")))
    assert prompt_tokens(fetched) == without + IMAGE_TOKENS
    big = client.post("/v1/chat/completions", json=chat(images.image_part(image_server + "/big.png")))
    assert_error(big, 413, "request_too_large", "messages.0.content.1.image_url.url")
    port = image_server.rsplit(":", 1)[1]
    for url in (f"http://127.0.0.2:{port}/photo.png", f"http://localhost:{port}/photo.png"):
        error = assert_error(
            client.post("/v1/chat/completions", json=chat(images.image_part(url))), 400, "invalid_request_error"
        )
        assert "private, loopback or reserved" in str(error["message"])


def test_refusals(vision_server: Server, client: httpx.Client) -> None:
    one = images.image_part(images.data_uri(images.png(32, 32)))
    error = assert_error(client.post("/v1/chat/completions", json=chat(*[one] * 5)), 400, "invalid_request_error")
    assert error["message"] == "The request has 5 images; at most 4 are accepted."
    assert prompt_tokens(client.post("/v1/chat/completions", json=chat(*[one] * 4))) > 4 * IMAGE_TOKENS
    text_as_png = images.image_part(images.data_uri(b"just some text, not an image"))
    assert_error(client.post("/v1/chat/completions", json=chat(text_as_png)), 400, "invalid_request_error")
    error = assert_error(client.post("/v1/chat/completions", json=chat(one, model=MODEL)), 400, "invalid_request_error")
    assert MODEL in str(error["message"]) and "not vision-capable" in str(error["message"])


def test_a_pixel_bomb_is_refused_without_decoding_it(vision_server: Server, client: httpx.Client) -> None:
    assert vision_server.process is not None
    gateway = psutil.Process(vision_server.process.pid)

    def peak_rss_mb() -> float:
        status = Path(f"/proc/{gateway.pid}/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]

    before = peak_rss_mb()
    bomb = images.image_part(images.data_uri(images.png_bomb(20_000)))
    error = assert_error(client.post("/v1/chat/completions", json=chat(bomb)), 400, "invalid_request_error")
    assert "pixels" in str(error["message"])
    assert peak_rss_mb() - before < 50  # decoded, it would be 1.2 GB


def test_files_are_checked_before_any_image_is_fetched(client: httpx.Client, image_server: str) -> None:
    before = ImageFiles.hits
    bad_file = {"type": "file", "file": {"filename": "a.pdf", "data": "https://example.com/a.pdf"}}
    body = chat(images.image_part(image_server + "/photo.png"), bad_file)
    assert_error(client.post("/v1/chat/completions", json=body), 400, "invalid_request_error")
    assert ImageFiles.hits == before
    native = {"model": VISION, "prompt": "Hi", "images": [image_server + "/photo.png"], "files": [bad_file]}
    assert_error(client.post("/api/generate", json=native), 400, "invalid_request_error")
    assert ImageFiles.hits == before


def test_keys_over_quota_or_rpm_never_make_the_server_fetch(vision_server: Server, image_server: str) -> None:
    spent_id, spent = make_key_record(vision_server.data_dir, "spent", quota_tokens=100, quota_period="total")
    use_total_quota(vision_server.data_dir, spent_id, 100)
    _, hasty = make_key_record(vision_server.data_dir, "hasty", rpm=1)
    body = chat(*[images.image_part(image_server + "/photo.png")] * 4)
    before = ImageFiles.hits
    assert httpx.post(
        vision_server.url + "/v1/chat/completions", json=body, headers=bearer(hasty), timeout=60
    ).is_success
    assert ImageFiles.hits == before + 4  # a key with room: the four URLs are fetched
    for key, type_ in ((spent, "insufficient_quota"), (hasty, "rate_limit_error")):
        seconds = []
        with httpx.Client(base_url=vision_server.url, headers=bearer(key)) as client:
            for _ in range(20):
                started = time.perf_counter()
                response = client.post("/v1/chat/completions", json=body)
                seconds.append(time.perf_counter() - started)
                assert_error(response, 429, type_)
        print(f"\n429 for 4 image URLs ({type_}): p50 {statistics.median(seconds) * 1000:.1f} ms")
        assert statistics.median(seconds) < 0.1
    assert ImageFiles.hits == before + 4  # the URL server saw nothing of the 40 refused requests


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
