"""The OpenAI API's sampling fields over the tiny text Llama and the official client: logprobs equal
to log_softmax of transformers' logits (the tolerance table's float32 model bound), streamed as
whole; n choices; seed, penalties, logit_bias; response_format / regex answers that parse and
validate; tool calls read from the template conventions and constrained by tool_choice."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

pytest.importorskip("onnxruntime", reason="the engine runs ONNX Runtime")
openai = pytest.importorskip("openai", reason="the tests speak through the official openai client")
pytest.importorskip("transformers", reason="chat prompts are rendered by transformers' apply_chat_template")
pytest.importorskip("uvicorn", reason="the API is served by uvicorn")

from rmsnorm_deploy.contract.tolerances import tolerance_for  # noqa: E402
from rmsnorm_deploy.serving.engine.sampling import Chooser, SamplingFields, log_softmax  # noqa: E402
from rmsnorm_deploy.serving.openai import protocol as api  # noqa: E402
from rmsnorm_deploy.serving.openai.tools import CallStream, read_calls  # noqa: E402
from tests.serving._openai import openai_server  # noqa: E402
from tests.serving.conftest import TEXT_LLAMA, TEXT_VOCAB  # noqa: E402

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 99},
                                           "colour": {"enum": ["red", "green"]}},
          "required": ["ok", "n", "colour"], "additionalProperties": False}


@pytest.fixture(scope="module")
def folder(text_exports):
    return text_exports("ort")


@pytest.fixture(scope="module")
def server(folder):
    with openai_server(folder) as served:
        yield served


@pytest.fixture(scope="module")
def torch_model():
    """The transformers model the text export came from (same config, same seed)."""
    from rmsnorm_deploy.exporter import hf

    return hf.from_config({**hf.TINY_CONFIGS["llama"], **TEXT_LLAMA, "vocab_size": TEXT_VOCAB}, "float32",
                          seed=0).module.model.eval()


def _greedy_reference(torch_model, ids: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens after ``ids`` and log_softmax (float64) of its logits at each step."""
    import torch

    ids, rows = list(ids), []
    with torch.no_grad():
        for _ in range(steps):
            row = log_softmax(torch_model(torch.tensor([ids])).logits[0, -1].double().numpy())
            rows.append(row)
            ids.append(int(np.argmax(row)))
    return ids[-steps:], np.stack(rows)


def _check_close(got: np.ndarray, want: np.ndarray) -> float:
    tol = tolerance_for("model", "onnxruntime", "float32")
    assert got.shape == want.shape and got.size and np.isfinite(got).all()
    assert np.all(np.abs(got - want) <= tol.atol + tol.rtol * np.abs(want)), np.abs(got - want).max()
    return float(np.abs(got - want).max())


def test_chat_logprobs_are_log_softmax_of_the_models_logits_streamed_or_not(server, torch_model):
    client = server.client()
    messages = [{"role": "user", "content": "hello the world"}]
    answer = client.chat.completions.create(model="model", messages=messages, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=5)
    content = answer.choices[0].logprobs.content
    assert "".join(c.token for c in content) == answer.choices[0].message.content
    assert all(bytes(c.bytes).decode(errors="replace") == c.token for c in content)
    prompt = [int(t) for t in server.engine.model.tokenizer.encode(
        "<s>user\nhello the world</s>\n<s>assistant\n", add_special_tokens=False).ids]
    tokens, want = _greedy_reference(torch_model, prompt, len(content))
    assert server.engine.model.decode(tokens) == answer.choices[0].message.content
    got_top = np.array([[t.logprob for t in c.top_logprobs] for c in content])
    _check_close(got_top, -np.sort(-want, axis=1)[:, :5])
    _check_close(np.array([c.logprob for c in content]), want.max(axis=1))  # greedy: the top token
    chunks = client.chat.completions.create(model="model", messages=messages, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=5, stream=True)
    streamed = [c for chunk in chunks for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    # the same tokens; the logprobs within float32 rounding: the second request prefills only what the
    # prefix cache does not hold, so its logits are summed in other chunks
    assert [c.token for c in streamed] == [c.token for c in content]
    _check_close(np.array([c.logprob for c in streamed]), np.array([c.logprob for c in content]))


def test_completion_logprobs_in_the_legacy_shape(server, torch_model):
    prompt = [1, 40, 50, 60, 70]
    answer = server.client().completions.create(model="model", prompt=prompt, max_tokens=5, temperature=0,
                                                logprobs=3)
    lp = answer.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == answer.choices[0].text and lp.text_offset[0] == 0
    # keyed by text: tokens whose bytes both show as U+FFFD share a key
    assert all(1 <= len(top) <= 3 and max(top.values()) == chosen for top, chosen in zip(lp.top_logprobs,
                                                                                          lp.token_logprobs))
    _, want = _greedy_reference(torch_model, prompt, 5)
    _check_close(np.array(lp.token_logprobs), want.max(axis=1))


def test_n_choices_share_the_request_and_choice_i_samples_with_seed_plus_i(server):
    client = server.client()
    before = server.engine.token_stats()
    many = client.completions.create(model="model", prompt="hello", max_tokens=8, temperature=1.0, seed=7, n=3)
    after = server.engine.token_stats()  # one prefill: the other two choices copied it
    assert after["shared_prefills"] - before["shared_prefills"] == 2
    assert after["prefill_tokens"] - before["prefill_tokens"] <= len(server.engine.model.encode("hello"))
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    texts = {c.index: c.text for c in many.choices}
    for index in range(3):
        one = client.completions.create(model="model", prompt="hello", max_tokens=8, temperature=1.0, seed=7 + index)
        assert one.choices[0].text == texts[index]
    assert len(set(texts.values())) > 1
    assert many.usage.completion_tokens == 24
    chunks = list(client.completions.create(model="model", prompt="hello", max_tokens=8, temperature=1.0, seed=7,
                                            n=3, stream=True))
    streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)}
    assert streamed == texts


def test_logit_bias_of_100_forces_its_token_and_unknown_ids_are_refused(server):
    client = server.client()
    answer = client.completions.create(model="model", prompt="hello", max_tokens=4, temperature=0,
                                       logit_bias={"70": 100})
    assert answer.choices[0].text == "C" * 4  # id 70: the byte "C" (3 specials, then the 256 bytes in order)
    with pytest.raises(openai.BadRequestError, match="logit_bias: '999' is not a token id"):
        client.completions.create(model="model", prompt="hello", logit_bias={"999": 1})


def test_penalties_follow_openai_and_vllm_formulas():
    logits = np.array([[2.0, -1.0, 0.5, 3.0]], np.float32)
    fields = SamplingFields(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                            logit_bias={1: 1.5})
    chooser = Chooser(fields, prompt=[2])
    chooser.output, chooser._counts = [3, 3], np.array([0.0, 0.0, 0.0, 2.0])
    scores = logits[0].astype(np.float64)
    chooser._adjust(scores)
    # bias, then repetition on prompt+output tokens (2 and 3), then frequency/presence on output counts
    want = np.array([2.0, 0.5, 0.5 / 2.0, 3.0 / 2.0 - 0.25 * 2 - 0.5])
    np.testing.assert_array_equal(scores, want)
    min_p = Chooser(SamplingFields(temperature=1.0, min_p=0.5, seed=0))
    # p(3)/p(0) = e^-1 < 0.5: only token 0 can be drawn
    assert {int(min_p(np.array([[5.0, 4.0, -9.0, -9.0]]))[0]) for _ in range(20)} == {0}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answers_parse_and_validate(server, stream):
    jsonschema = pytest.importorskip("jsonschema", reason="the answer is validated against its schema")
    pytest.importorskip("llguidance", reason="constrained decoding runs llguidance")
    request = dict(model="model", messages=[{"role": "user", "content": "hello"}], max_tokens=60, temperature=1.0,
                   seed=3, n=2, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    client = server.client()
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **request))
        texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                 for i in range(2)]
    else:
        texts = [c.message.content for c in client.chat.completions.create(**request).choices]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_regex_and_grammar_answers_match(server):
    pytest.importorskip("llguidance", reason="constrained decoding runs llguidance")
    client = server.client()
    # a random model writes strings without end: "}" (id 3 + 125) favoured so that the object closes
    text = client.completions.create(model="model", prompt="hi", max_tokens=20, temperature=0,
                                     logit_bias={"128": 30},
                                     extra_body={"response_format": {"type": "json_object"}}).choices[0].text
    assert json.loads(text) == {}
    answer = client.completions.create(model="model", prompt="hi", max_tokens=20, temperature=1, seed=1,
                                       extra_body={"regex": "(yes|no), [0-9]{2}"})
    assert re.fullmatch("(yes|no), [0-9]{2}", answer.choices[0].text) and answer.choices[0].finish_reason == "stop"
    answer = client.completions.create(model="model", prompt="hi", max_tokens=20, temperature=0,
                                       extra_body={"grammar": 'start: "a" BC BC "."\nBC: "b" | "c"'})
    assert re.fullmatch("a[bc]{2}\\.", answer.choices[0].text) and answer.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="the regex is not valid") as bad:
        client.completions.create(model="model", prompt="hi", extra_body={"regex": "(unclosed"})
    assert "\n" not in bad.value.body["message"]


def test_a_named_or_required_tool_choice_gives_tool_calls(server):
    pytest.importorskip("llguidance", reason="constrained decoding runs llguidance")
    tool = {"type": "function", "function": {"name": "paint", "parameters": {
        "type": "object", "properties": {"colour": {"enum": ["red", "blue"]}}, "required": ["colour"],
        "additionalProperties": False}}}
    client = server.client()
    messages, named = [{"role": "user", "content": "paint it"}], None
    for choice in ({"type": "function", "function": {"name": "paint"}}, "required"):
        answer = client.chat.completions.create(model="model", messages=messages, tools=[tool], tool_choice=choice,
                                                max_tokens=60, temperature=0)
        call = answer.choices[0].message.tool_calls[0]
        assert answer.choices[0].finish_reason == "tool_calls" and call.function.name == "paint"
        assert json.loads(call.function.arguments)["colour"] in ("red", "blue")
        named = call if isinstance(choice, dict) else named
    streamed = client.chat.completions.create(model="model", messages=messages, tools=[tool], max_tokens=60,
                                              tool_choice={"type": "function", "function": {"name": "paint"}},
                                              temperature=0, stream=True)
    chunks = [chunk.model_dump(exclude_unset=True) for chunk in streamed]
    assert _assembled(chunks) == (None, [("paint", named.function.arguments)], "tool_calls")
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("tool_calls")) > 3
    with pytest.raises(openai.BadRequestError, match="chat template does not take tools"):
        client.chat.completions.create(model="model", messages=messages, tools=[tool])


def _assembled(chunks) -> tuple[str | None, list[tuple[str, str]], str]:
    """What the openai client's own stream accumulation makes of chat chunks: content, (name, arguments)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    state = ChatCompletionStreamState()
    for data in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(data))
    message = state.current_completion_snapshot.choices[0].message
    return (message.content or None, [(c.function.name, c.function.arguments) for c in message.tool_calls or []],
            state.current_completion_snapshot.choices[0].finish_reason)


@pytest.mark.parametrize("text,fragments", [
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": [1, 2]}}\n</tool_call>'
     '\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET \\"x\\" }"}}</tool_call>', True),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {}}',
     True),
    ('{"name": "other", "parameters": {}}', False),
    ('<tool_call>{"name": "get_time", "zone": 1, "arguments": {"a": 1}}</tool_call>', False),  # sent whole at the end
    ("No tools needed: it is < 5 degrees.", False),
])
def test_tool_calls_streamed_piece_by_piece_assemble_to_the_whole_answers(text, fragments):
    """Every character its own piece: the openai client's accumulation of the deltas equals read_calls."""
    names = {"get_weather", "get_time"}
    reader = CallStream("parse", names)
    deltas = [d for c in text for d in reader.push(c)] + reader.finish()
    chunks = [api.chunk("x", "m", chat=True, role=True)]
    chunks += [api.chunk("x", "m", chat=True, text=d.get("content"), tool_calls=d.get("tool_calls")) for d in deltas]
    content, calls = read_calls(text, "parse", names)
    chunks.append(api.chunk("x", "m", chat=True, finish_reason="tool_calls" if calls else "stop"))
    assert _assembled(chunks)[:2] == (content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls])
    if fragments:  # the arguments came in many fragments, the name in the first delta of its call
        assert sum(1 for d in deltas if "tool_calls" in d and "id" not in d["tool_calls"][0]) > 5


def test_tool_calls_are_read_in_the_hermes_and_llama3_conventions():
    names = {"get_weather"}
    content, calls = read_calls('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                                "</tool_call>", "parse", names)
    assert content == "Let me check." and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    content, calls = read_calls('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', "parse",
                                names)
    assert content is None and calls[0]["function"]["name"] == "get_weather"
    assert read_calls('{"name": "other", "parameters": {}}', "parse", names) == (
        '{"name": "other", "parameters": {}}', [])


def test_a_template_that_takes_tools_renders_them(folder):
    import transformers

    from rmsnorm_deploy.serving.openai.text import ChatTemplate

    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    source = "{% for t in tools %}<tool>{{ t.function.name }}</tool>{% endfor %}{{ messages[0].content }}"
    tokenizer.chat_template = source
    text = ChatTemplate(tokenizer, source).render([{"role": "user", "content": "hi"}],
                                                  tools=[{"type": "function", "function": {"name": "paint"}}])
    assert text == "<tool>paint</tool>hi"
