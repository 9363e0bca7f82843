"""Admission of structured output (``serving.engine.constraints``, ``schema_recursion``) without a
server, over the byte-level test tokenizer: each refusal in one line naming its problem (limits,
no text, only the empty text, a schema requiring itself, a dead end), a limit met mid-answer as
``GrammarStopped``, tool parameters whose ``$ref`` s stay their own under ``tool_choice:
"required"``; and admission as a property (hypothesis): any regex or schema built from hostile
pieces is admitted or refused in one line, and an admitted one generates or stops with
``GrammarStopped``, never another exception."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("llguidance", reason="structured output runs through llguidance (the serve extra)")
hypothesis = pytest.importorskip("hypothesis", reason="the admission property is tested with hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from rmsnorm_deploy.errors import InputError  # noqa: E402
from rmsnorm_deploy.serving.engine.constraints import Grammars, GrammarStopped  # noqa: E402
from rmsnorm_deploy.serving.engine.schema_recursion import endless_requirement  # noqa: E402
from tests.serving import _hostile  # noqa: E402
from tests.serving.conftest import TEXT_VOCAB  # noqa: E402

EOS = 2


@pytest.fixture(scope="module")
def grammars(tmp_path_factory):
    from tests.serving._tokenizer import write_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    assert write_tokenizer(folder) == TEXT_VOCAB
    return Grammars((folder / "tokenizer.json").read_text(), TEXT_VOCAB, [EOS])


SELF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}

REFUSALS = [
    ("json_schema", SELF, "the json_schema can match no value: no finite JSON value matches it: '#' -> "
                          "'#/properties/a' -> '#' require each other without end"),
    ("json_schema", {"type": "integer", "minimum": 5, "maximum": 3},
     "the json_schema can match no value: minimum (5) is greater than maximum (3)"),
    ("regex", "a{1000000}", "the regex is beyond the grammar engine's limits (lexer error: too many expressions "
                            "constructed)"),
    ("grammar", 'start: "a"{1000000}', "the grammar is beyond the grammar engine's limits (parser error: Too many "
                                       "items (limit 50000"),
    ("grammar", "start: " + " | ".join(f'"w{i}"' for i in range(2500)),
     "the grammar is beyond the grammar engine's limits (Parser Error: Current row has 2501 items; max is 2000"),
    ("regex", r"[^\s\S]", "the regex can match no text, so no answer could satisfy it"),
    ("regex", r"abc[^\s\S]", "the regex can match no text"),
    ("regex", "(|)", "the regex matches only the empty text, so there is nothing to generate"),
    ("grammar", 'start: "a" x\nx: x "b"', "the grammar has no way to go on after the text 'a'"),
    ("grammar", "start: x", 'the grammar is not valid: at 1(8): unknown name: "x"'),
    ("regex", "(a", "the regex is not valid: at 1(8): invalid regex"),
]


@pytest.mark.parametrize("kind,source,message", REFUSALS, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(REFUSALS)])
def test_admission_refuses_in_one_line_naming_the_problem(grammars, kind, source, message):
    start = time.perf_counter()
    with pytest.raises(InputError) as refused:
        grammars.constraints(kind, source)
    assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    assert not any(leak in str(refused.value) for leak in _hostile.LEAKS)
    assert time.perf_counter() - start < _hostile.TIME_LIMIT_S


def test_admitted_grammars_are_n_fresh_matchers(grammars):
    first, second = grammars.constraints("regex", "(yes|no), [0-9]{2}", 2)
    first.advance(int(np.flatnonzero(first.allowed() & ~grammars.eos)[0]))
    assert first.tokens == 1 and second.tokens == 0
    assert second.allowed().sum() > 0 and not second.matcher.is_error()


def test_a_limit_met_mid_answer_stops_with_grammar_stopped(grammars):
    constraint = grammars.constraints("regex", "[a-z]{100}a{1000000}")[0]  # the probe walks 16 tokens only
    rng = np.random.default_rng(0)
    with pytest.raises(GrammarStopped, match=r"beyond the grammar engine's limits after \d+ tokens of the answer"):
        for _ in range(400):
            constraint.advance(int(rng.choice(np.flatnonzero(constraint.allowed()))))
    assert constraint.tokens > 16


@pytest.mark.parametrize("schema,cycle", [
    (SELF, "'#' -> '#/properties/a' -> '#'"),
    ({"$ref": "#"}, "'#' -> '#'"),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "'#' -> '#/items' -> '#'"),
    ({"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1}, "'#' -> '#/prefixItems/0' -> '#'"),
    ({"allOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#"}},
                                                        "required": ["x"]}}},
     "'#' -> '#/allOf/0' -> '#/$defs/a' -> '#/$defs/a/properties/x' -> '#'"),
    ({"anyOf": [SELF, {"type": "array", "items": {"$ref": "#"}, "minItems": 2}]}, "'#/anyOf/0/properties/a' -> '#'"),
])
def test_a_schema_that_requires_itself_is_named_by_its_cycle(schema, cycle):
    assert cycle in endless_requirement(schema)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"$ref": "#"}}},  # optional
    {"type": "array", "items": {"$ref": "#"}},  # minItems 0
    {"anyOf": [SELF, {"type": "null"}]},  # a branch that ends
    {"properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # no type: a number matches
    {"type": ["object", "string"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"$ref": "http://example.com/x.json"}, {"type": [{}], "required": "abc", "allOf": 3, "anyOf": []}, True, 5,
])
def test_a_schema_some_finite_value_matches_passes(schema):
    assert endless_requirement(schema) is None


def test_required_tool_choice_keeps_each_functions_refs_its_own(grammars):
    from rmsnorm_deploy.serving.openai import protocol as api
    from rmsnorm_deploy.serving.openai.tools import tool_plan

    tree = {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {
        "type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}, "required": ["v"]}},
        "$ref": "#/$defs/node"}
    req = api.ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                          "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "tree", "parameters": tree}},
        {"type": "function", "function": {"name": "flat", "parameters": {"type": "object"}}}]})
    _, (kind, schema), reading = tool_plan(req, None)
    assert reading == "array" and schema["$defs"]["tool0"]["$ref"] == "#/$defs/tool0/$defs/node"
    assert grammars.constraints(kind, schema)  # (the refs resolve: "#/$defs/node" is not the wrapper's)


# -- admission as a property ----------------------------------------------------------------------
ATOMS = ["a", "b", ".", r"\d", r"[^\s\S]", "[a-c]", "(|)", r"\w", "x"]


def _regexes():
    repeat = st.sampled_from(["", "*", "+", "?", "{2}", "{0}", "{1000}", "{100000}", "{3,9}"])
    piece = st.tuples(st.sampled_from(ATOMS), repeat).map("".join)
    group = st.lists(piece, min_size=1, max_size=4).map(lambda p: "(" + "".join(p) + ")")
    return st.lists(st.one_of(piece, group, group.map(lambda g: g + "{50}")), min_size=1, max_size=5).map("".join)


def _schemas():
    leaf = st.sampled_from([{"type": "integer"}, {"type": "string", "maxLength": 5}, {"enum": ["a", "b"]},
                            {"$ref": "#"}, {"type": "string", "pattern": "^a{100000}$"}, {"type": "boolean"}])
    return st.recursive(leaf, lambda inner: st.one_of(
        st.dictionaries(st.sampled_from(["p", "q", "r"]), inner, min_size=1, max_size=3).flatmap(
            lambda props: st.sampled_from([[], list(props)]).map(
                lambda req: {"type": "object", "properties": props, "required": req})),
        inner.map(lambda s: {"type": "array", "items": s, "minItems": 1}),
        st.lists(inner, min_size=1, max_size=3).map(lambda xs: {"anyOf": xs})), max_leaves=8)


def _admitted_or_refused(grammars, kind, source):
    """Admission's property: an InputError in one line (no engine state) or a constraint that
    generates up to 48 tokens or stops with GrammarStopped; within the time limit."""
    start = time.perf_counter()
    try:
        constraint = grammars.constraints(kind, source)[0]
    except InputError as exc:
        assert "\n" not in str(exc) and not any(leak in str(exc) for leak in _hostile.LEAKS), str(exc)
        return
    finally:
        assert time.perf_counter() - start < _hostile.TIME_LIMIT_S
    rng = np.random.default_rng(0)
    try:
        for _ in range(48):
            allowed = np.flatnonzero(constraint.allowed())
            assert allowed.size, "a mask that allows nothing must stop the grammar"
            token = int(rng.choice(allowed))
            constraint.advance(token)
            if token == EOS:
                assert constraint.matcher.is_accepting()
                return
    except GrammarStopped as exc:
        assert "\n" not in str(exc) and constraint.tokens > 0, str(exc)


PROPERTY = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
                    derandomize=True)


@PROPERTY
@given(pattern=_regexes())
def test_any_regex_is_admitted_or_refused_in_one_line(grammars, pattern):
    _admitted_or_refused(grammars, "regex", pattern)


@PROPERTY
@given(schema=_schemas())
def test_any_schema_is_admitted_or_refused_in_one_line(grammars, schema):
    _admitted_or_refused(grammars, "json_schema", schema)
