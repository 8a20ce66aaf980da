"""`specdec serve`: a real uvicorn server on a free port of 127.0.0.1, spoken to with the OpenAI Python client
and with raw HTTP. Every reply is compared with the same decoding done alone, by a second copy of the model
outside the server (the server's engine thread holds its own model's lock for its whole life)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import tiny_model, tiny_tokenizer
from helpers import RandomProposer

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from specdec import SpeculativeDecoder  # noqa: E402
from specdec.contracts import Draft, Proposer  # noqa: E402
from specdec.serving.app import Settings, create_app  # noqa: E402

MODEL = "tiny-llama"
PROMPTS = ["w5 w9 w17", "w40 w41", "w7 w7 w7 w8 w100 w3", "w60", "w12 w90 w33 w2", "w99 w98 w97 w96 w95"]


class SlowProposer(RandomProposer):
    """Random drafts, 30 ms each: keeps a request running long enough to walk away from it."""

    name = "test-slow"

    def propose(self, state):
        time.sleep(0.03)
        return super().propose(state)


class FailingProposer(Proposer):
    """Raises while drafting for a row whose prompt holds w4; drafts nothing otherwise."""

    name = "test-failing"

    def propose(self, state):
        if (state.tokens[0, : state.prompt_length] == 4).any():
            raise RuntimeError("planted failure")
        return Draft(tokens=state.tokens.new_empty(1, 0))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, decoder: SpeculativeDecoder, **settings) -> None:
        self.port = free_port()
        app = create_app(decoder, Settings(model_name=MODEL, proposer=type(decoder.proposer).name,
                                           batch_size=settings.pop("batch_size", 4), **settings))
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, key: str = "unused"):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def post(self, path: str, body, headers: dict | None = None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        payload = body if isinstance(body, (bytes, str)) else json.dumps(body)
        conn.request("POST", path, body=payload, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        data = json.loads(response.read() or b"null")
        conn.close()
        return response.status, data

    def get(self, path: str) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("GET", path)
        response = conn.getresponse()
        text = response.read().decode()
        conn.close()
        return response.status, text

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def decoder_for(proposer_class=None, **proposer_options) -> SpeculativeDecoder:
    model = tiny_model("llama", seed=3, dtype=torch.float32, max_positions=256)
    if proposer_class is None:
        return SpeculativeDecoder.from_model(model, tiny_tokenizer(), proposer="ngram", **proposer_options)
    decoder = SpeculativeDecoder.from_model(model, tiny_tokenizer(), proposer="autoregressive")
    proposer = proposer_class(proposer_class.Config(), decoder.target)
    return SpeculativeDecoder(decoder.target, proposer)


@pytest.fixture(scope="module")
def alone():
    """Plain greedy decoding of one prompt at a time, on a model of its own."""
    return SpeculativeDecoder.from_model(tiny_model("llama", seed=3, dtype=torch.float32, max_positions=256),
                                         tiny_tokenizer(), proposer="autoregressive")


@pytest.fixture(scope="module")
def server():
    server = Server(decoder_for())
    yield server
    server.close()


def test_health_models_and_a_chat_reply_equal_to_decoding_alone(server, alone):
    assert server.get("/health")[0] == 200
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                           temperature=0, max_tokens=24)
    want = alone.generate(PROMPTS[0], max_new_tokens=24)
    assert reply.choices[0].message.content == want.text
    assert reply.choices[0].finish_reason == ("stop" if want.stop_reason == "eos" else "length")
    assert reply.usage.completion_tokens == len(want.token_ids)
    assert reply.usage.prompt_tokens == alone.encode_prompt(PROMPTS[0]).shape[1]


def test_streaming_chat_and_completions_give_the_same_text(server, alone):
    client = server.client()
    for prompt in PROMPTS[:3]:
        want = alone.generate(prompt, max_new_tokens=30, raw=True).text
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=30,
                                                stream=True))
        assert "".join(c.choices[0].text for c in chunks) == want
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        whole = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=30)
        assert whole.choices[0].text == want
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}],
                                            temperature=0, max_tokens=20, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == alone.generate(PROMPTS[1], max_new_tokens=20).text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_token_id_prompts_and_returned_token_ids(server, alone):
    ids = alone.target.tokenizer(PROMPTS[4], add_special_tokens=True)["input_ids"]
    want = alone.generate_ids([ids], max_new_tokens=15)[0]
    for prompt in (ids, [ids]):
        code, reply = server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 15,
                                                      "temperature": 0, "return_token_ids": True})
        assert code == 200 and reply["choices"][0]["token_ids"] == want.token_ids
        assert reply["choices"][0]["text"] == want.text
    code, reply = server.post("/v1/completions", {"model": MODEL, "prompt": [5, 128], "max_tokens": 2})
    assert code == 400 and "[0, 128)" in reply["error"]["message"]
    code, reply = server.post("/v1/completions", {"model": MODEL, "prompt": [5], "stream": True,
                                                  "return_token_ids": True})
    assert code == 400 and reply["error"]["param"] == "return_token_ids"


def test_stop_strings_are_left_out_of_the_text_as_openai_does(server, alone):
    full = alone.generate(PROMPTS[2], max_new_tokens=30, raw=True)
    words = full.text.split()
    assert len(words) > 4, "the random model should say something here"
    stop = " " + words[3]
    want = full.text[: full.text.index(stop)]
    client = server.client()
    got = client.completions.create(model=MODEL, prompt=PROMPTS[2], temperature=0, max_tokens=30, stop=[stop])
    assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[2], temperature=0, max_tokens=30, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want


def test_concurrent_requests_each_equal_their_solo_output(server, alone):
    """Greedy requests decoded in one batch (with sampled ones beside them) give exactly their solo output."""
    client = server.client()

    def greedy(i: int) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPTS[i], temperature=0, max_tokens=12 + 5 * i
                                         ).choices[0].text

    def sampled(i: int) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPTS[i], temperature=0.8, top_p=0.9, seed=i,
                                         max_tokens=20).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(greedy, i) for i in range(len(PROMPTS))] + [pool.submit(sampled, i) for i in (0, 1)]
        got = [f.result() for f in futures]
    for i, text in enumerate(got[: len(PROMPTS)]):
        assert text == alone.generate(PROMPTS[i], max_new_tokens=12 + 5 * i, raw=True).text, i
    assert all(isinstance(text, str) for text in got[len(PROMPTS):])


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"model": "other", "prompt": "w5"}, 404, "model"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": "w5", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "w5", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "w5", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "w5", "n": 2}, 400, "n"),
    ({"model": MODEL, "prompt": "w5", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"model": MODEL, "prompt": "w5", "logprobs": 3}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "w5", "temprature": 0.5}, 400, "temprature"),
    ({"model": MODEL, "prompt": "w5", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"model": MODEL, "prompt": "w5", "seed": -1}, 400, "seed"),
    ({"model": MODEL, "prompt": "w5", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"model": MODEL, "prompt": " ".join(["w5"] * 300)}, 400, None),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status, param):
    code, reply = server.post("/v1/completions", body)
    assert code == status, reply
    error = reply["error"]
    assert error["message"].endswith(".") and "\n" not in error["message"]
    assert error["param"] == param
    if isinstance(body, dict) and len(body.get("prompt", "")) > 500:
        assert error["code"] == "context_length_exceeded"
    code, reply = server.post("/v1/completions", {"model": MODEL, "prompt": "w5 w6", "max_tokens": 3,
                                                  "temperature": 0})
    assert code == 200 and reply["choices"][0]["finish_reason"] in ("stop", "length")


def test_prompt_past_the_context_window_is_named(server):
    code, reply = server.post("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": " ".join(["w5"] * 300)}]})
    assert code == 400 and reply["error"]["code"] == "context_length_exceeded"
    assert "context window is 256" in reply["error"]["message"]
    code, reply = server.post("/v1/chat/completions", {"model": MODEL, "messages": []})
    assert code == 400 and reply["error"]["param"] == "messages"


def test_metrics_in_prometheus_text(server):
    server.client().completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=8)
    status, text = server.get("/metrics")
    assert status == 200
    samples = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert line.startswith(("# HELP specdec_", "# TYPE specdec_"))
            continue
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    assert samples['specdec_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    server.get("/no/such/path")
    text = server.get("/metrics")[1]
    assert 'endpoint="other",status="404"' in text and "/no/such/path" not in text
    assert samples["specdec_generation_tokens_total"] >= 8
    assert samples["specdec_mean_acceptance_length"] >= 1.0
    assert samples["specdec_queue_depth"] == 0
    assert samples['specdec_time_to_first_token_seconds_bucket{le="+Inf"}'] == \
        samples["specdec_time_to_first_token_seconds_count"] >= 1
    assert any(k.startswith("specdec_spec_accepted_tokens_total{position=") for k in samples)


def test_api_key_is_checked():
    server = Server(decoder_for(), api_key="sesame")
    try:
        with pytest.raises(openai.AuthenticationError):
            server.client("wrong").models.list()
        code, reply = server.post("/v1/completions", {"model": MODEL, "prompt": "w5"})
        assert code == 401 and reply["error"]["code"] == "invalid_api_key"
        reply = server.client("sesame").completions.create(model=MODEL, prompt="w5", max_tokens=2)
        assert len(reply.choices) == 1
        assert server.get("/health")[0] == 200  # health and metrics stay open, as in vLLM
    finally:
        server.close()


def test_a_client_that_disconnects_frees_its_row():
    server = Server(decoder_for(SlowProposer), batch_size=2)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"model": MODEL, "prompt": "w5 w9", "max_tokens": 200, "temperature": 0, "stream": True}),
            headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        assert response.read(6) == b"data: "  # the first chunk arrived: the row is decoding
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        deadline = time.time() + 10
        while True:
            text = server.get("/metrics")[1]
            if 'specdec_generations_total{reason="cancelled"} 1' in text and "specdec_running_requests 0" in text:
                break
            assert time.time() < deadline, text
            time.sleep(0.05)
        generated = float(next(line.split()[1] for line in text.splitlines()
                                if line.startswith("specdec_generation_tokens_total")))
        assert generated < 100  # left long before its 200 tokens (30 ms per step)
        reply = server.client().completions.create(model=MODEL, prompt="w5", max_tokens=3)
        assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        server.close()


def test_a_failing_step_ends_its_requests_with_500_and_the_server_goes_on(alone):
    server = Server(decoder_for(FailingProposer))
    try:
        code, reply = server.post("/v1/completions", {"model": MODEL, "prompt": "w4 w5", "max_tokens": 5,
                                                      "temperature": 0})
        assert code == 500 and "planted failure" in reply["error"]["message"]
        code, reply = server.post("/v1/completions", {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 9,
                                                      "temperature": 0})
        assert code == 200
        assert reply["choices"][0]["text"] == alone.generate(PROMPTS[1], max_new_tokens=9, raw=True).text
        assert server.get("/health")[0] == 200
    finally:
        server.close()


def test_cli_refuses_bad_options_before_loading(tmp_path):
    from click.testing import CliRunner

    from specdec.cli import main

    runner = CliRunner()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = runner.invoke(main, ["serve", "--port", str(port), "--proposer", "ngram"])
    assert result.exit_code == 2 and f"Port {port} on 127.0.0.1 is in use" in result.output
    for args, words in ((["--batch-size", "0"], "--batch-size"), (["--port", "70000"], "--port"),
                        (["--api-key", " "], "--api-key is empty"), (["--draft-budget", "x"], "--draft-budget")):
        result = runner.invoke(main, ["serve", *args])
        assert result.exit_code == 2 and words in result.output, result.output
        assert "Traceback" not in result.output


def test_a_full_queue_answers_503_and_the_rest_finish():
    server = Server(decoder_for(SlowProposer), batch_size=1, max_waiting=1)
    try:
        body = {"model": MODEL, "prompt": "w5 w9", "max_tokens": 12, "temperature": 0}
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(server.post, "/v1/completions", body)  # runs (one batch slot)
            deadline = time.time() + 10
            while "specdec_running_requests 1" not in server.get("/metrics")[1]:
                assert time.time() < deadline
                time.sleep(0.01)
            second = pool.submit(server.post, "/v1/completions", body)  # waits (the one place in the queue)
            while "specdec_queue_depth 1" not in server.get("/metrics")[1]:
                assert time.time() < deadline
                time.sleep(0.01)
            code, reply = server.post("/v1/completions", body)
            assert code == 503 and reply["error"]["code"] == "queue_full"
            assert first.result()[0] == 200 and second.result()[0] == 200
            assert first.result()[1]["choices"][0]["text"] == second.result()[1]["choices"][0]["text"]
    finally:
        server.close()


class Fatal(BaseException):
    """Not an Exception: gets past the per-step guard and stops the engine thread."""


class FatalProposer(Proposer):
    name = "test-fatal"

    def propose(self, state):
        raise Fatal("planted fatal error")


def test_a_stopped_engine_is_reported_by_health_and_refuses_requests():
    server = Server(decoder_for(FatalProposer))
    try:
        code, reply = server.post("/v1/completions", {"model": MODEL, "prompt": "w5 w6", "max_tokens": 4})
        assert code == 500 and "planted fatal error" in reply["error"]["message"]
        status, text = server.get("/health")
        assert status == 503 and "Fatal: planted fatal error" in json.loads(text)["error"]["message"]
        code, reply = server.post("/v1/completions", {"model": MODEL, "prompt": "w5 w6", "max_tokens": 4})
        assert code == 503 and reply["error"]["code"] == "engine_stopped"
    finally:
        server.close()


class _CharTokenizer:
    """Token i is the character chr(i): text and ids line up one to one."""

    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


@pytest.mark.parametrize("text, stops, want", [
    ("Hello world", ["Hello"], ""),  # the stop string at the very start: nothing of it may leak
    ("abHello", ["Hello"], "ab"),
    ("one\n\nUser: two", ["\n\nUser:"], "one"),
    ("no stop here", ["zz"], "no stop here"),
    ("plain", [], "plain"),
])
def test_streamed_text_never_shows_part_of_a_stop_string(text, stops, want):
    from specdec.detokenize import StreamingText

    streamed = StreamingText(_CharTokenizer(), stops)
    pieces = [streamed.push([ord(c)]) for c in text] + [streamed.finish()]
    assert "".join(pieces) == want
    assert all(want.startswith("".join(pieces[: i + 1])) for i in range(len(pieces)))
    assert StreamingText(_CharTokenizer(), stops).full([ord(c) for c in text]) == want


def test_max_tokens_past_the_context_window_is_refused(server):
    code, reply = server.post("/v1/completions", {"model": MODEL, "prompt": "w5 w6", "max_tokens": 255})
    assert code == 400 and reply["error"]["code"] == "context_length_exceeded"
    assert "ask for at most 254" in reply["error"]["message"]
    code, reply = server.post("/v1/completions", {"model": MODEL, "prompt": "w5 w6", "max_tokens": 254,
                                                  "temperature": 0})
    assert code == 200
