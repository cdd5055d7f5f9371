"""`blockspec serve`: a live server on a free loopback port, driven by the official
`openai` client, on the real default target with its shipped drafter."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn

import blockspec
from blockspec.serve.app import ServerConfig, create_app

pytestmark = pytest.mark.real

MODEL = "default"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three primary colors."}]
MAX_TOKENS = 16


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveServer:
    def __init__(self, decoder, **config):
        self.port = free_port()
        app = create_app(decoder, ServerConfig(model_name=MODEL, **config))
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def decoder():
    return blockspec.load("default", "auto", block_size=8)


@pytest.fixture(scope="module")
def expected(decoder):
    """What `blockspec generate` gives for the same prompts (computed before the server runs)."""
    return {
        "completion": decoder.generate(PROMPT, raw=True, max_new_tokens=MAX_TOKENS).text,
        "chat": decoder.generate(MESSAGES, max_new_tokens=MAX_TOKENS).text,
        "many": [decoder.generate(f"Count from {i} to {i + 5}:", raw=True, max_new_tokens=MAX_TOKENS).text
                 for i in range(8)],
    }


@pytest.fixture(scope="module")
def live(decoder, expected):
    with LiveServer(decoder, max_queue=16, request_timeout_s=120) as server:
        yield server


@pytest.fixture()
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_completions_and_chat_equal_blockspec_generate(client, expected):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == expected["completion"]
    assert out.usage.completion_tokens > 0 and out.usage.prompt_tokens > 0
    assert out.model_extra["spec_accept_length"] >= 1.0
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    assert chat.choices[0].message.content == expected["chat"]
    assert chat.choices[0].finish_reason in ("stop", "length")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True) if c.choices)
    assert streamed == expected["completion"]
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}) if c.choices]
    assert "".join(pieces) == expected["chat"]


def test_logprobs_n_and_models(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=2, n=2)
    assert len(out.choices) == 2 and out.choices[0].message.content == out.choices[1].message.content
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens // 2
    assert all(item.logprob <= 0 and len(item.top_logprobs) == 2 for item in content)
    assert content[0].top_logprobs[0].logprob >= content[0].logprob - 1e-6  # greedy: the best token
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1)
    assert len(text.choices[0].logprobs.token_logprobs) == len(text.choices[0].logprobs.tokens)
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_eight_concurrent_streams_match_their_single_runs(client, expected):
    def run(i):
        stream = client.completions.create(model=MODEL, prompt=f"Count from {i} to {i + 5}:", max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True)
        return "".join(c.choices[0].text for c in stream if c.choices)

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(run, range(8))) == expected["many"]


BAD_REQUESTS = [
    ("malformed json", b"{not json", None),
    ("wrong type", None, {"model": MODEL, "prompt": PROMPT, "max_tokens": "ten"}),
    ("unknown model", None, {"model": "gpt-9", "prompt": PROMPT}),
    ("max_tokens <= 0", None, {"model": MODEL, "prompt": PROMPT, "max_tokens": 0}),
    ("max_tokens beyond context", None, {"model": MODEL, "prompt": PROMPT, "max_tokens": 10_000_000}),
    ("temperature < 0", None, {"model": MODEL, "prompt": PROMPT, "temperature": -1}),
    ("top_p 0", None, {"model": MODEL, "prompt": PROMPT, "top_p": 0}),
    ("top_p > 1", None, {"model": MODEL, "prompt": PROMPT, "top_p": 1.5}),
    ("n too large", None, {"model": MODEL, "prompt": PROMPT, "n": 9}),
    ("n zero", None, {"model": MODEL, "prompt": PROMPT, "n": 0}),
    ("empty prompt", None, {"model": MODEL, "prompt": ""}),
    ("over-long prompt", None, {"model": MODEL, "prompt": "word " * 9000}),
    ("missing prompt", None, {"model": MODEL}),
    ("several prompts in one request", None, {"model": MODEL, "prompt": ["a", "b"]}),
]


def test_bad_requests_get_400_while_a_good_one_completes(live, client, expected):
    with ThreadPoolExecutor(1) as pool:
        good = pool.submit(lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                             temperature=0))
        for name, raw, body in BAD_REQUESTS:
            response = httpx.post(live.url + "/v1/completions", content=raw if raw is not None else json.dumps(body),
                                  headers={"content-type": "application/json"}, timeout=60)
            assert response.status_code == 400, (name, response.text)
            error = response.json()["error"]
            assert error["message"] and error["type"] == "invalid_request_error", name
        assert good.result().choices[0].text == expected["completion"]
    # unknown fields are ignored, as OpenAI clients send many
    ok = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                                        "frequency_penalty": 0, "user": "x", "suffix": None})
    assert ok.status_code == 200


def test_disconnect_frees_the_worker_and_metrics_move(live, client):
    before = httpx.get(live.url + "/metrics").text
    started = time.perf_counter()
    with httpx.stream("POST", live.url + "/v1/completions", json={
            "model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 2000,
            "temperature": 0, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up
    # the worker must be free almost at once: a short request finishes long before
    # 2000 tokens could have been generated
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].text
    assert time.perf_counter() - started < 60
    after = httpx.get(live.url + "/metrics").text

    def value(text: str, name: str) -> float:
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    assert value(after, "blockspec_requests_total") > value(before, "blockspec_requests_total")
    assert value(after, "blockspec_generation_tokens_total") > value(before, "blockspec_generation_tokens_total")
    assert value(after, "blockspec_spec_decode_num_draft_tokens_total") >= value(
        before, "blockspec_spec_decode_num_draft_tokens_total")
    assert "blockspec_time_per_output_token_seconds_count" in after


def test_api_key_is_enforced_on_every_route_but_health(decoder, live):
    live_app_worker = live.app.state.worker  # the shared decoder must not run two jobs at once
    with LiveServer(decoder, api_key="sekrit") as keyed:
        assert httpx.get(keyed.url + "/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            assert httpx.get(keyed.url + path).status_code == 401
            assert httpx.get(keyed.url + path, headers={"authorization": "Bearer wrong"}).status_code == 401
            assert httpx.get(keyed.url + path, headers={"authorization": "Bearer sekrit"}).status_code == 200
        denied = httpx.post(keyed.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT})
        assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
        assert live_app_worker.jobs.empty()
        keyed_client = openai.OpenAI(base_url=keyed.url + "/v1", api_key="sekrit", max_retries=0)
        assert keyed_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0).choices


def test_a_full_queue_answers_429(decoder, live):
    with LiveServer(decoder, max_queue=1, max_batch=2) as small:
        body = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 150, "temperature": 0}
        with ThreadPoolExecutor(3) as pool:
            running = []
            for _ in range(3):  # two decode together, the third waits in the queue of 1
                running.append(pool.submit(httpx.post, small.url + "/v1/completions", json=body, timeout=120))
                time.sleep(0.5)
            refused = httpx.post(small.url + "/v1/completions", json=body, timeout=60)
            assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
            for future in running:
                future.result().raise_for_status()
