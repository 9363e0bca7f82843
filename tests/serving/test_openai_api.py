"""The OpenAI API with the official ``openai`` client, against the app served by uvicorn on a loopback
port over a real engine and a tiny Llama whose folder has a byte-level tokenizer and a chat template:
greedy answers are ``generate``'s (text, token counts), streaming or not; stop strings across tokens;
max_tokens; seeds; every refusal an OpenAI error object in one line; 429 when the queue is full; a
client that goes away frees its slot; 32 streaming chat clients at once, each exact."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("onnxruntime", reason="the engine runs ONNX Runtime")
openai = pytest.importorskip("openai", reason="the tests speak through the official openai client")
pytest.importorskip("transformers", reason="chat prompts are rendered by transformers' apply_chat_template")
pytest.importorskip("uvicorn", reason="the API is served by uvicorn")

from rmsnorm_deploy.decoder.generate import KVCacheModel, Sampling, generate  # noqa: E402
from tests.serving._openai import openai_server  # noqa: E402

EOS = 2
#: greedy generation of this prompt ends with the end-of-sequence token after 8 tokens
ENDS_AT_EOS = "hello a the café 日本"
PROMPTS = ["hello the world", "café 日本", "stop stop the and", ENDS_AT_EOS]
MESSAGES = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the world café"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "日本"}],
]


@pytest.fixture(scope="module")
def folder(text_exports):
    return text_exports("ort")


@pytest.fixture(scope="module")
def server(folder):
    with openai_server(folder) as served:
        yield served


@pytest.fixture(scope="module")
def reference(folder):
    """The same folder in a session of its own: ``generate``'s answers to compare with."""
    with KVCacheModel(folder) as model:
        yield model


def _chat_ids(folder, messages) -> list[int]:
    """The chat prompt's ids as transformers makes them from the folder (independently of the server)."""
    import transformers

    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))


def _complete(client, stream: bool, **request):
    """``(text, finish_reason, usage)`` of one completion or chat completion, streamed or not."""
    chat = "messages" in request
    create = client.chat.completions.create if chat else client.completions.create
    if not stream:
        answer = create(model="model", **request)
        choice = answer.choices[0]
        return (choice.message.content if chat else choice.text), choice.finish_reason, answer.usage
    pieces, finish, usage = [], None, None
    for chunk in create(model="model", stream=True, stream_options={"include_usage": True}, **request):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append((choice.delta.content or "") if chat else choice.text)
            finish = choice.finish_reason or finish
    return "".join(pieces), finish, usage


def _raw(server, path: str, body: bytes | str, *, method: str = "POST") -> tuple[int, dict]:
    """A plain HTTP request: the status and the JSON body, errors included."""
    data = body.encode() if isinstance(body, str) else body
    request = urllib.request.Request(server.url.removesuffix("/v1") + path, data=data if method == "POST" else None,
                                     method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_models_lists_the_one_served_model(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["model"]
    assert client.models.retrieve("model").owned_by == "rmsnorm-deploy"
    with pytest.raises(openai.NotFoundError, match="the model 'other' does not exist; this server serves 'model'"):
        client.models.retrieve("other")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_is_generate_on_the_same_prompt(server, reference, prompt, stream):
    ids = reference.encode(prompt)
    want = generate(reference, [ids], max_new_tokens=24)
    text, finish, usage = _complete(server.client(), stream, prompt=prompt, max_tokens=24, temperature=0)
    assert text == want.text[0]
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), len(want.tokens[0]))
    assert finish == ("stop" if want.tokens[0][-1] == EOS else "length")
    assert finish == ("stop" if prompt == ENDS_AT_EOS else "length")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("messages", MESSAGES, ids=["one", "system", "turns"])
def test_greedy_chat_is_generate_on_the_chat_templates_prompt(server, reference, folder, messages, stream):
    ids = _chat_ids(folder, messages)
    want = generate(reference, [ids], max_new_tokens=20)
    text, finish, usage = _complete(server.client(), stream, messages=messages, max_tokens=20, temperature=0)
    assert text == want.text[0] and finish == "length"
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(ids), 20, len(ids) + 20)


def test_a_completion_of_token_ids_is_generate_on_them(server, reference):
    ids = [1, 40, 77, 261, 278]
    text, finish, usage = _complete(server.client(), False, prompt=ids, max_tokens=12, temperature=0)
    assert text == generate(reference, [ids], max_new_tokens=12).text[0] and usage.prompt_tokens == 5


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_stop_string_that_spans_tokens_ends_the_text_before_it(server, reference, stream):
    prompt, stop = "stop stop the and", "t st"
    full = generate(reference, [reference.encode(prompt)], max_new_tokens=40)
    tokens, text = full.tokens[0], full.text[0]
    assert stop in text and not any(stop in reference.decode([t]) for t in tokens), "the stop string spans tokens"
    want = text[:text.index(stop)]
    # the tokens the server had to generate: up to the one that completes the stop string
    needed = next(n for n in range(1, len(tokens) + 1) if stop in reference.decode(tokens[:n]))
    got, finish, usage = _complete(server.client(), stream, prompt=prompt, max_tokens=40, temperature=0,
                                   stop=["never there", stop])
    assert (got, finish, usage.completion_tokens) == (want, "stop", needed)
    deadline = time.monotonic() + 5
    while server.engine.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.engine.stats()["running"] == 0, "the stop string cancelled the stream: its slot is free"


@pytest.mark.parametrize("max_tokens", [1, 5, 33])
def test_max_tokens_is_the_number_of_new_tokens(server, reference, max_tokens):
    want = generate(reference, [reference.encode("hello the world")], max_new_tokens=max_tokens)
    text, finish, usage = _complete(server.client(), False, prompt="hello the world", max_tokens=max_tokens,
                                    temperature=0)
    assert (text, finish, usage.completion_tokens) == (want.text[0], "length", max_tokens)


def test_completions_default_to_16_new_tokens_and_chat_to_the_room_left(server, folder):
    _, finish, usage = _complete(server.client(), False, prompt="hello the world", temperature=0)
    assert (finish, usage.completion_tokens) == ("length", 16)
    messages = MESSAGES[0]
    _, finish, usage = _complete(server.client(), False, messages=messages, temperature=0)
    assert usage.completion_tokens == 512 - len(_chat_ids(folder, messages)) or finish == "stop"


@pytest.mark.parametrize(("temperature", "top_p", "seed"), [(1.0, 1.0, 0), (0.7, 0.9, 12345), (1.5, 0.5, 2**63 - 1)])
def test_a_seed_gives_the_same_text_each_time_and_generate_samples_the_same(server, reference, temperature, top_p,
                                                                            seed):
    request = dict(prompt="hello the world", max_tokens=24, temperature=temperature, top_p=top_p, seed=seed)
    first = _complete(server.client(), False, **request)[0]
    assert _complete(server.client(), True, **request)[0] == first
    sampling = Sampling(do_sample=True, seed=seed, temperature=temperature, top_p=top_p)
    assert first == generate(reference, [reference.encode("hello the world")], max_new_tokens=24,
                             sampling=sampling).text[0]
    other = _complete(server.client(), False, **{**request, "seed": seed ^ 1})[0]
    assert other != first


def test_without_a_seed_sampling_differs_between_requests(server):
    texts = {_complete(server.client(), False, prompt="hello", max_tokens=16, temperature=1.0)[0] for _ in range(3)}
    assert len(texts) > 1


ERRORS = [
    # (path, body, status, message, param, code)
    ("/v1/completions", {"prompt": "hi", "n": 9}, 400, "n: input should be less than or equal to 8, got 9", "n",
     None),
    ("/v1/completions", {"prompt": "hi", "echo": True}, 400,
     "echo=True is not supported by this server (it answers echo=False); leave echo out", "echo", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400,
     "max_tokens: input should be a valid integer, got '5'", "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, 400,
     "max_tokens: input should be a valid integer, got True", "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400,
     "max_tokens: input should be greater than or equal to 1, got 0", "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400,
     "temperature: input should be a valid number, got 'hot'", "temperature", None),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400,
     "top_p: input should be greater than 0, got 0", "top_p", None),
    ("/v1/completions", {"prompt": "hi", "seed": -1}, 400,
     "seed: input should be greater than or equal to 0, got -1", "seed", None),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400,
     "stream: input should be a valid boolean, got 'yes'", "stream", None),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", 3]}, 400, "stop.1: input should be a valid string, got 3",
     "stop.1", None),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400,
     "stop has 5 strings; give at most 4", "stop", None),
    ("/v1/completions", {"prompt": "hi", "stop": ""}, 400, "stop holds an empty string; give non-empty strings",
     "stop", None),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400,
     "logprobs: input should be less than or equal to 20, got 21", "logprobs", None),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, 400,
     "best_of=2 is not supported by this server (it answers best_of=1); leave best_of out", "best_of", None),
    ("/v1/completions", {"prompt": "hi", "colour": "red"}, 400,
     "unknown parameter 'colour'; see the OpenAI API reference for this endpoint's parameters", "colour", None),
    ("/v1/completions", {"prompt": ""}, 400, "prompt is empty; give at least one character or token id", "prompt",
     None),
    ("/v1/completions", {"prompt": []}, 400, "prompt is empty; give at least one character or token id", "prompt",
     None),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt holds 2 prompts; this server takes one per request "
     "(send them as separate requests: they are batched together)", "prompt", None),
    ("/v1/completions", {"prompt": [1, -4]}, 400, "token id -4 is outside the model's vocabulary [0, 292)", "prompt",
     None),
    ("/v1/completions", {}, 400, "prompt is required", "prompt", None),
    ("/v1/completions", {"prompt": "hi " * 600, "max_tokens": 4}, 400,
     "the prompt has 1202 tokens, longer than the model's maximum of 512", "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 600}, 400,
     "3 prompt tokens + 600 new tokens exceed the model's maximum of 512; lower max_tokens to at most 509",
     "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages: list should have at least 1 item after validation, "
     "not 0, got []", "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages.0.role: input should be 'system', 'developer', 'user', 'assistant' or 'tool', got 'robot'",
     "messages.0.role", None),
    ("/v1/chat/completions", {"messages": [{"role": "developer", "content": "x"}]}, 400,
     "the model's chat template refused these messages: this template knows the roles system, user and assistant, "
     "not developer", "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]}, 400,
     "messages.0.content.0.type: input should be 'text', got 'image_url'", "messages.0.content.0.type", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                              "max_completion_tokens": 4}, 400,
     "max_tokens 3 and max_completion_tokens 4 differ; give one of them", "max_completion_tokens", None),
]


@pytest.mark.parametrize(("path", "body", "status", "message", "param", "code"), ERRORS,
                         ids=[f"{i}-{e[4]}" for i, e in enumerate(ERRORS)])
def test_a_bad_request_gets_an_openai_error_object_in_one_line(server, path, body, status, message, param, code):
    got_status, got = _raw(server, path, json.dumps({"model": "model", **body}))
    assert (got_status, got) == (status, {"error": {"message": message, "type": "invalid_request_error",
                                                    "param": param, "code": code}})


@pytest.mark.parametrize(("body", "message"), [
    (b'{"model": "model", "prompt": "hi"', "the body is not valid JSON (EOF while parsing an object at line 1 column 33)"),
    (b"[1, 2]", "the body must be a JSON object"),
    (b"", "the body is not valid JSON (EOF while parsing a value at line 1 column 0)"),
    (b"[" * 5000, "the body is not valid JSON (recursion limit exceeded at line 1 column 202)"),
    (b"\xff\xfe", "the body is not valid JSON (expected value at line 1 column 1)"),
])
def test_a_body_that_is_not_a_json_object_is_refused(server, body, message):
    assert _raw(server, "/v1/completions", body) == (400, {"error": {
        "message": message, "type": "invalid_request_error", "param": None, "code": None}})


def test_the_official_client_raises_its_own_errors_with_our_messages(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="model", prompt="hi", best_of=2)
    assert refused.value.status_code == 400 and refused.value.param == "best_of"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert unknown.value.code == "model_not_found"
    assert unknown.value.body["message"] == "the model 'gpt-4o' does not exist; this server serves 'model'"


def test_unknown_paths_methods_and_huge_bodies_get_one_line(server):
    assert _raw(server, "/v1/embeddings", "{}") == (404, {"error": {
        "message": "/v1/embeddings is not an endpoint of this server; see GET /v1/models",
        "type": "invalid_request_error", "param": None, "code": None}})
    assert _raw(server, "/v1/completions", "", method="GET")[0] == 405
    status, body = _raw(server, "/v1/completions", b" " * (2 << 20))
    assert (status, body["error"]["message"]) == (
        413, "the body is 2097152 bytes, over this server's limit of 1048576 bytes; send less "
             "(serve --max-request-bytes)")


def test_a_folder_without_a_chat_template_refuses_chat_in_one_line_and_still_completes(folder, tmp_path, reference):
    import shutil

    bare = tmp_path / "no-chat"
    shutil.copytree(folder, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    with openai_server(bare) as served:
        client = served.client()
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="model", messages=[{"role": "user", "content": "hi"}])
        assert refused.value.body == {
            "message": f"chat is not available: {bare} has no chat template (tokenizer_config.json's chat_template or "
                       "chat_template.jinja); send the prompt as text to /v1/completions",
            "type": "invalid_request_error", "param": "messages", "code": "chat_template_missing"}
        text = client.completions.create(model="model", prompt="hello", max_tokens=6, temperature=0).choices[0].text
        assert text == generate(reference, [reference.encode("hello")], max_new_tokens=6).text[0]


def test_a_full_queue_is_refused_with_429_at_once_and_the_server_keeps_answering(folder):
    with openai_server(folder, max_batch=1, max_queue=0) as served:
        client = served.client()
        running = client.completions.create(model="model", prompt="hello", max_tokens=400, temperature=0, stream=True)
        next(iter(running))  # its stream holds the one slot
        started = time.perf_counter()
        with pytest.raises(openai.RateLimitError) as busy:
            client.completions.create(model="model", prompt="hi", max_tokens=2)
        assert time.perf_counter() - started < 2
        assert busy.value.status_code == 429 and busy.value.body == {
            "message": "the server is busy: its 1 streams and its queue of 0 are full (--max-batch 1, --max-queue 0); "
                       "retry later", "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}
        running.close()  # the client goes away: its slot is freed
        deadline = time.monotonic() + 10
        while served.engine.stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.completions.create(model="model", prompt="hi", max_tokens=2).usage.completion_tokens == 2


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_client_that_disconnects_cancels_its_engine_stream(folder, stream):
    import http.client
    import socket

    with openai_server(folder, max_batch=2) as served:
        host, port = served.url.split("//")[1].split("/")[0].split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        body = json.dumps({"model": "model", "prompt": "hello", "max_tokens": 500, "temperature": 0, "stream": stream})
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        deadline = time.monotonic() + 20
        while served.engine.stats()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        if stream:
            assert connection.getresponse().status == 200
        connection.sock.shutdown(socket.SHUT_RDWR)
        connection.close()
        while served.engine.stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = served.engine.stats()
        assert (stats["running"], stats["cancelled"], stats.get("length", 0)) == (0, 1, 0)


def test_32_concurrent_streaming_chat_clients_each_get_generate_exactly(server, reference, folder):
    conversations = [[{"role": "user", "content": f"{word} {i}"}] for i, word in
                     enumerate(["hello", "the world", "café", "日本", "stop", "and a"] * 6)][:32]
    lengths = [8 + (i * 7) % 30 for i in range(32)]
    want = [generate(reference, [_chat_ids(folder, m)], max_new_tokens=n).text[0]
            for m, n in zip(conversations, lengths)]

    async def one(client, messages, n):
        pieces, finish = [], None
        stream = await client.chat.completions.create(model="model", messages=messages, max_tokens=n, temperature=0,
                                                      stream=True)
        async for chunk in stream:
            pieces += [c.delta.content or "" for c in chunk.choices]
            finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
        return "".join(pieces), finish

    async def all_at_once():
        async with server.async_client() as client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, m, n) for m, n in zip(conversations, lengths))), 120)

    got = asyncio.run(all_at_once())
    assert [text for text, _ in got] == want
    assert {finish for _, finish in got} <= {"stop", "length"}


def test_health_is_ready_while_the_engine_serves(server):
    assert _raw(server, "/health", "", method="GET") == (200, {"status": "ready"})


def test_a_slow_body_is_a_408_as_on_the_kserve_front(tmp_path):
    """A body at 1 byte/s was waited on for 47 s; the OpenAI API reads bodies as the KServe front does
    (``serving.asgi.body``), so it answers 408 at its timeout (made short here)."""
    import types

    from rmsnorm_deploy.serving.openai.app import openai_app

    model = types.SimpleNamespace(tokenizer=object(), folder=tmp_path)
    app = openai_app(types.SimpleNamespace(model=model), "model", body_timeout_s=0.2)
    sent: list[dict] = []
    first = [{"type": "http.request", "body": b'{"model": "mo', "more_body": True}]

    async def receive():
        if first:
            return first.pop()
        await asyncio.sleep(3600)  # the rest of the body never comes

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 5),
             "server": ("127.0.0.1", 8000)}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    assert sent[0]["status"] == 408
    assert json.loads(sent[1]["body"]) == {"error": {"message": "the body did not arrive within 0.2 s",
                                                     "type": "invalid_request_error", "param": None, "code": None}}
