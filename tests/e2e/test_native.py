"""POST /api/generate against the real server."""

from __future__ import annotations

import httpx

from tests.support import MODEL, Server

RESPONSE_FIELDS = {
    "response": str,
    "model": str,
    "instance_id": str,
    "prompt_tokens": int,
    "completion_tokens": int,
    "tokens_per_second": float,
    "latency_ms": float,
}


def test_generate_with_every_parameter(client: httpx.Client, api_key: str) -> None:
    body = {
        "api_key": api_key,
        "model": MODEL,
        "prompt": "Explain recursion in one paragraph.",
        "temperature": 0.7,
        "top_k": 40,
        "top_p": 0.9,
        "max_tokens": 24,
        "repeat_penalty": 1.1,
        "stop": [],
        "system": "You are a helpful assistant.",
        "seed": 7,
    }
    response = httpx.post(client.base_url.join("/api/generate"), json=body, timeout=120)  # key in the body only
    assert response.status_code == 200, response.text
    data = response.json()
    assert set(data) == set(RESPONSE_FIELDS)
    for name, kind in RESPONSE_FIELDS.items():
        assert type(data[name]) is kind, (name, data[name])
    assert data["model"] == MODEL
    assert data["response"].strip()
    assert 0 < data["completion_tokens"] <= 24
    assert data["latency_ms"] > 0
    expected_speed = data["completion_tokens"] / (data["latency_ms"] / 1000)
    assert abs(data["tokens_per_second"] - expected_speed) <= 0.05 * expected_speed + 0.01


def test_max_tokens_is_honoured(client: httpx.Client) -> None:
    prompt = "Write a long story about a dragon who learns to cook."
    data = client.post("/api/generate", json={"prompt": prompt, "max_tokens": 5, "temperature": 0}).json()
    assert data["completion_tokens"] == 5


def test_stop_strings_are_honoured(client: httpx.Client) -> None:
    base = {"prompt": "Count from 1 to 20, separated by commas.", "max_tokens": 60, "temperature": 0, "seed": 1}
    free = client.post("/api/generate", json=base).json()["response"]
    assert "5" in free, free  # the model really counts past 5 when not stopped
    stopped = client.post("/api/generate", json={**base, "stop": ["5"]}).json()
    assert "5" not in stopped["response"]
    assert free.startswith(stopped["response"].rstrip())
    assert stopped["completion_tokens"] < 60


def test_prompt_tokens_match_the_tokenizer_and_survive_the_prompt_cache(server: Server, client: httpx.Client) -> None:
    body = {"prompt": "What is the capital of France?", "system": "Be brief.", "max_tokens": 4, "temperature": 0}
    first = client.post("/api/generate", json=body).json()
    second = client.post("/api/generate", json=body).json()  # llama-server reuses its prompt cache here
    assert first["prompt_tokens"] == second["prompt_tokens"]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    templated = server.instance_post("/apply-template", {"messages": messages})["prompt"]
    tokens = server.instance_post("/tokenize", {"content": templated, "add_special": True})
    assert first["prompt_tokens"] == len(tokens["tokens"])


def test_completion_tokens_match_the_tokenizer(server: Server, client: httpx.Client) -> None:
    data = client.post(
        "/api/generate", json={"prompt": "Name three colors.", "max_tokens": 12, "temperature": 0}
    ).json()
    tokens = server.instance_post("/tokenize", {"content": data["response"]})["tokens"]
    # A detokenized text can re-tokenize one token differently at a boundary, never by more.
    assert abs(len(tokens) - data["completion_tokens"]) <= 1


def test_raw_prompt_skips_the_template(client: httpx.Client, server: Server) -> None:
    prompt = "The capital of France is"
    data = client.post("/api/generate", json={"prompt": prompt, "raw": True, "max_tokens": 3, "temperature": 0}).json()
    tokens = server.instance_post("/tokenize", {"content": prompt, "add_special": True})
    assert data["prompt_tokens"] == len(tokens["tokens"])
    assert data["completion_tokens"] == 3


def test_same_seed_same_answer(client: httpx.Client) -> None:
    body = {"prompt": "Invent a name for a cat.", "max_tokens": 10, "temperature": 1.0, "seed": 42}
    assert (
        client.post("/api/generate", json=body).json()["response"]
        == client.post("/api/generate", json=body).json()["response"]
    )
