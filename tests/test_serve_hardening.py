"""`blockspec serve` under hostile and careless clients (issue 16): one request never harms
another, every bad input is a 4xx in OpenAI's shape, nothing grows without bound."""

from __future__ import annotations

import json
import resource
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import blockspec
from test_serve import MODEL, PROMPT, LiveServer

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def decoder():
    return blockspec.load("default", "auto", block_size=8)


@pytest.fixture(scope="module")
def live(decoder):
    with LiveServer(decoder, max_queue=16, max_batch=4, request_timeout_s=120, max_body_bytes=64 * 1024) as server:
        yield server


def post(live, body, timeout=120):
    return httpx.post(live.url + "/v1/completions", json=body, timeout=timeout)


def chat(live, body, timeout=120):
    return httpx.post(live.url + "/v1/chat/completions", json=body, timeout=timeout)


def good(prompt=PROMPT, **fields):
    return {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, **fields}


BAD = [
    ("temperature above 2", good(temperature=2.5)),
    ("temperature infinity", None),  # JSON has no Infinity: sent raw below
    ("max_tokens true", good(max_tokens=True)),
    ("max_tokens as a string", good(max_tokens="5")),
    ("stream as a string", good(stream="yes")),
    ("seed past 64 bits", good(seed=2**63)),
    ("five stop strings", good(stop=["a", "b", "c", "d", "e"])),
    ("a huge stop string", good(stop="x" * 600)),
    ("logprobs true on completions", good(logprobs=True)),
]


def test_bad_inputs_are_400_in_openais_shape(live):
    for name, body in BAD:
        if body is None:
            response = httpx.post(live.url + "/v1/completions", timeout=60, headers={"content-type": "application/json"},
                                  content=b'{"model": "default", "prompt": "x", "temperature": Infinity}')
        else:
            response = post(live, body)
        assert response.status_code == 400, (name, response.status_code, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], name
    wrong_role = chat(live, {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]})
    assert wrong_role.status_code == 400 and "role" in wrong_role.text


def test_content_parts_and_a_tiny_temperature_are_served(live):
    parts = chat(live, {"model": MODEL, "max_tokens": 6, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Name three "}, {"type": "text", "text": "colors."}]}]})
    plain = chat(live, {"model": MODEL, "max_tokens": 6, "temperature": 0,
                        "messages": [{"role": "user", "content": "Name three colors."}]})
    assert parts.status_code == plain.status_code == 200
    assert parts.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    tiny = post(live, good(temperature=1e-37, seed=3))
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == post(live, good()).json()["choices"][0]["text"]  # ~greedy


def test_bodies_past_the_cap_are_413_before_they_are_read(live):
    large = json.dumps(good(prompt="word " * 20_000)).encode()
    assert len(large) > 64 * 1024
    assert httpx.post(live.url + "/v1/completions", content=large, timeout=60,
                      headers={"content-type": "application/json"}).status_code == 413

    def chunks():  # no Content-Length: the cap applies as the body streams in
        for start in range(0, len(large), 8192):
            yield large[start:start + 8192]

    refused = httpx.post(live.url + "/v1/completions", content=chunks(), timeout=60,
                         headers={"content-type": "application/json"})
    assert refused.status_code == 413 and refused.json()["error"]["message"]
    assert httpx.get(live.url + "/health").status_code == 200


def test_a_keyless_loopback_server_refuses_foreign_host_headers(live):
    response = httpx.get(live.url + "/v1/models", headers={"host": "evil.example:80"})
    assert response.status_code == 400 and "Host" in response.json()["error"]["message"]
    assert httpx.get(live.url + "/v1/models", headers={"host": f"localhost:{live.port}"}).status_code == 200


def test_the_key_takes_any_case_of_bearer_and_429_says_when_to_retry(decoder, live):
    with LiveServer(decoder, api_key="k3y", max_queue=1, max_batch=1) as keyed:
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert httpx.get(keyed.url + "/v1/models", headers={"authorization": f"{scheme} k3y"}).status_code == 200
        headers = {"authorization": "Bearer k3y"}
        body = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 120, "temperature": 0}
        with ThreadPoolExecutor(2) as pool:
            busy = [pool.submit(httpx.post, keyed.url + "/v1/completions", json=body, headers=headers, timeout=120)]
            time.sleep(0.5)
            busy.append(pool.submit(httpx.post, keyed.url + "/v1/completions", json=body, headers=headers,
                                    timeout=120))
            time.sleep(0.5)
            refused = httpx.post(keyed.url + "/v1/completions", json=body, headers=headers, timeout=60)
            assert refused.status_code == 429 and refused.headers.get("retry-after") == "1"
            too_many = httpx.post(keyed.url + "/v1/completions", json=dict(body, n=2), headers=headers, timeout=60)
            assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"  # never fits: not a 429
            for future in busy:
                assert future.result().status_code == 200


def test_a_non_streaming_client_that_leaves_frees_its_slot_within_a_second(live):
    worker = live.app.state.worker
    with pytest.raises(httpx.ReadTimeout):
        post(live, good(prompt="1, 2, 3, 4, 5, 6, 7, 8,", max_tokens=600), timeout=1.5)
    left = time.perf_counter()
    while worker.engine.busy and time.perf_counter() - left < 5:
        time.sleep(0.05)
    assert not worker.engine.busy, "the decode went on for a client that left"
    assert time.perf_counter() - left < 2.0


def test_a_seeded_request_gives_the_same_text_alone_or_batched(live):
    body = good(prompt="Write one sentence about the sea.", temperature=0.8, seed=1234, max_tokens=24)
    alone = post(live, body).json()["choices"][0]["text"]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda b: post(live, b).json()["choices"][0]["text"],
                                 [body, body, good(prompt="Count to five:", temperature=0.8, seed=9), body]))
    assert together[0] == together[1] == together[3] == alone


def test_a_mixed_load_has_no_500_and_every_good_answer_is_its_solo_answer(live):
    prompts = [f"List {i} fruits:" for i in range(6)]
    solo = {p: post(live, good(prompt=p)).json()["choices"][0]["text"] for p in prompts}
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def client(index: int):
        kind = index % 4
        if kind == 0:
            return ("good", prompts[index % 6], post(live, good(prompt=prompts[index % 6])))
        if kind == 1:
            return ("bad", None, post(live, good(temperature=9)))
        if kind == 2:  # hangs up mid-stream
            with httpx.stream("POST", live.url + "/v1/completions", timeout=60,
                              json=good(prompt=prompts[0], stream=True, max_tokens=200)) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        break
            return ("left", None, None)
        return ("tiny", None, post(live, good(prompt=prompts[1], temperature=1e-30, seed=index)))

    with ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(client, range(32)))
    for kind, prompt, response in outcomes:
        if response is None:
            continue
        assert response.status_code != 500, response.text
        if kind == "good":
            assert response.status_code == 200 and response.json()["choices"][0]["text"] == solo[prompt]
        if kind == "bad":
            assert response.status_code == 400
        if kind == "tiny":
            assert response.status_code == 200
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mb < 300, f"peak RSS grew {grown_mb:.0f} MB over the load"
    assert httpx.get(live.url + "/health").status_code == 200
    metrics = httpx.get(live.url + "/metrics").text
    assert 'blockspec_request_errors_total{status="500"}' not in metrics


@pytest.mark.parametrize("timeout", ["nan", "-5", "0", "inf"])
def test_a_request_timeout_that_is_not_a_positive_number_is_refused_before_loading(timeout, capsys):
    from blockspec.cli import main

    assert main(["serve", "--request-timeout", timeout]) == 2
    assert "--request-timeout must be a positive number" in capsys.readouterr().err


def test_host_names_with_and_without_ports_are_read_right():
    from blockspec.serve.app import Guard, ServerConfig
    from blockspec.serve.metrics import Metrics

    guard = Guard(None, ServerConfig(model_name="m"), Metrics())
    for host in ("127.0.0.1:8000", "localhost", "[::1]:8000", "[::1]", "::1"):
        assert guard._refusal({"host": host}, "/v1/models") is None, host
    for host in ("evil.example", "evil.example:80", "[2001:db8::1]:80", "127.0.0.2:8000"):
        assert guard._refusal({"host": host}, "/v1/models")[0] == 400, host
