"""Text out of a token stream (``serving.openai.text.TextStream``): the pieces joined are exactly the
tokenizer's decode of all the tokens, a character split across tokens is never handed out half,
stop strings are cut at their first match across token boundaries, and the decode stays windowed;
the folder's chat template (``ChatTemplate``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers", reason="the tests decode with a real tokenizer")

from rmsnorm_deploy.errors import InputError, UserError  # noqa: E402
from rmsnorm_deploy.serving.openai.text import ANCHOR_EVERY, ANCHOR_KEEP, ChatTemplate, TextStream  # noqa: E402
from tests.serving._tokenizer import CHAT_TEMPLATE, write_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(folder)
    return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))


def _decode(tokenizer, calls: list[int] | None = None):
    def decode(ids):
        if calls is not None:
            calls.append(len(ids))
        return tokenizer.decode(list(ids), skip_special_tokens=True)
    return decode


def _run(stream: TextStream, ids) -> list[str]:
    pieces = [stream.push(t) for t in ids]
    pieces.append(stream.finish())
    return pieces


@pytest.mark.parametrize("seed", range(8))
def test_the_pieces_joined_are_the_decode_of_all_tokens_and_never_half_a_character(tokenizer, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, tokenizer.get_vocab_size(), size=int(rng.integers(1, 300))).tolist()
    full = tokenizer.decode(ids, skip_special_tokens=True)
    pieces = _run(TextStream(_decode(tokenizer)), ids)
    assert "".join(pieces) == full
    for n in range(len(ids)):  # what was handed out after n + 1 tokens is final: a prefix of the whole text
        assert full.startswith("".join(pieces[:n + 1]))


def test_a_character_split_across_three_tokens_comes_out_whole(tokenizer):
    ids = tokenizer.encode("a 日本 b", add_special_tokens=False).ids
    assert len(ids) > len("a 日本 b".split()) + 2, "the characters are split across tokens"
    pieces = _run(TextStream(_decode(tokenizer)), ids)
    assert "".join(pieces) == "a 日本 b"
    assert all("\ufffd" not in piece for piece in pieces)  # a naive decode of each token gives U+FFFD here


def test_an_incomplete_character_at_the_end_is_what_decode_says(tokenizer):
    ids = tokenizer.encode("ok 日", add_special_tokens=False).ids[:-1]  # the character's last byte never comes
    stream = TextStream(_decode(tokenizer))
    held = "".join(stream.push(t) for t in ids)
    assert held == "ok " and stream.finish() == tokenizer.decode(ids)[len("ok "):] == "\ufffd"


@pytest.mark.parametrize(("text", "stops", "want"), [
    ("hello the world stop here", [" stop"], "hello the world"),
    ("hello the world stop here", ["ld st"], "hello the wor"),  # across " world" and " stop"
    ("hello the world", ["zzz", "e w"], "hello th"),  # the first match of any
    ("hello the world", ["world", "the"], "hello "),  # the earliest, whichever string
    ("hello the world", ["hello"], ""),
    ("café 日本 END", ["本 E"], "café 日"),  # a stop string starting inside a split character
    ("hello the world", ["worlds"], "hello the world"),  # a prefix held back, then released at the end
])
def test_the_text_ends_before_the_first_stop_string(tokenizer, text, stops, want):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    stream = TextStream(_decode(tokenizer), stops)
    pieces = _run(stream, ids)
    assert "".join(pieces) == want
    assert stream.stopped == any(s in text for s in stops)
    for piece in pieces:
        assert not any(s in piece for s in stops)


def test_text_that_could_start_a_stop_string_is_held_back_until_it_cannot(tokenizer):
    stream = TextStream(_decode(tokenizer), ["END!"])
    got = [stream.push(t) for t in tokenizer.encode("a ENDx", add_special_tokens=False).ids]
    assert "".join(got) == "a ENDx" and "END" not in "".join(got[:-1])  # "END" waited for the "x"


def test_tokens_after_a_stop_string_add_nothing(tokenizer):
    stream = TextStream(_decode(tokenizer), ["the"])
    ids = tokenizer.encode("a the world", add_special_tokens=False).ids
    assert "".join(stream.push(t) for t in ids) + stream.finish() == "a "
    assert stream.ids == ids[:2], "the stream stops taking tokens at the stop string"


def test_the_decode_stays_windowed_on_a_byte_level_tokenizer(tokenizer):
    ids = tokenizer.encode("hello the world " * 80, add_special_tokens=False).ids
    calls: list[int] = []
    assert "".join(_run(TextStream(_decode(tokenizer, calls)), ids)) == "hello the world " * 80
    assert len(ids) > 200 and max(calls) <= ANCHOR_EVERY + ANCHOR_KEEP + 1


def test_a_decoder_that_joins_with_context_stays_exact():
    """SentencePiece's decoder drops the leading space of the first token it decodes: a window that
    starts mid-text would lose a space, so the anchor only moves where a split checks out."""
    words = ["▁a", "▁b", "c", "▁d", "é"]
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="é")
    tok = tokenizers.Tokenizer(model)
    tok.decoder = tokenizers.decoders.Metaspace()
    ids = np.random.default_rng(3).integers(0, 4, size=200).tolist()
    assert "".join(_run(TextStream(_decode(tok)), ids)) == tok.decode(ids)


def test_an_empty_stop_string_is_refused():
    with pytest.raises(InputError, match="a stop string is empty; give non-empty strings"):
        TextStream(str, ["a", ""])


# -- the chat template -------------------------------------------------------------------------------
pytest.importorskip("transformers", reason="chat templates are rendered by transformers")


def test_the_chat_template_renders_the_folders_template(tmp_path):
    write_tokenizer(tmp_path)
    template, refusal = ChatTemplate.load(tmp_path)
    assert refusal is None
    assert template.render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]) == \
        "<s>system\ns</s>\n<s>user\nu</s>\n<s>assistant\n"
    with pytest.raises(InputError, match="^the model's chat template refused these messages: this template knows "
                                         "the roles system, user and assistant, not tool$"):
        template.render([{"role": "tool", "content": "x"}])


def test_a_chat_template_jinja_file_is_read_too(tmp_path):
    write_tokenizer(tmp_path, chat_template=False)
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE.replace("<s>assistant", "<s>model"))
    template, refusal = ChatTemplate.load(tmp_path)
    assert refusal is None and template.render([{"role": "user", "content": "u"}]).endswith("<s>model\n")


@pytest.mark.parametrize(("config", "why"), [
    ({}, "has no chat template"),
    ({"chat_template": ""}, "has no chat template"),
    ({"chat_template": [{"name": "tool_use", "template": "x"}]}, "has no chat template"),
    ({"chat_template": "{{ raise_exception('no') }}"}, "does not render a one-message chat (the model's chat "
                                                        "template refused these messages: no)"),
    ({"chat_template": "{% for %}"}, "does not render a one-message chat"),
])
def test_a_folder_without_a_usable_template_refuses_chat_with_the_reason(tmp_path, config, why):
    write_tokenizer(tmp_path, chat_template=False)
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    template, refusal = ChatTemplate.load(tmp_path)
    assert template is None and why in refusal and "\n" not in refusal


def test_a_damaged_tokenizer_config_is_one_line(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(UserError, match="tokenizer_config.json: not readable JSON"):
        ChatTemplate.load(tmp_path)
