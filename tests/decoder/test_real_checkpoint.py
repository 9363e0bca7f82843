"""Generation from the real SmolLM2-135M-Instruct exports against transformers on the same weights.

Random weights hide what 30 trained layers do to rounding; here ``generate`` over each KV-cache
export of the real checkpoint (``tests/real_weights.py``: exported once per run, shared) must
give transformers' own greedy tokens on real text: a chat prompt, a left-padded batch of prompts
of different lengths, and a prompt longer than 512 tokens. A quantized export must give the greedy
tokens of the model its parity check holds it to: transformers with the weights dequantized from
the graph (``decoder.quantize.dequantized_reference``).
"""

from __future__ import annotations

import contextlib

import onnx
import pytest

from rmsnorm_deploy.decoder.convention import left_padded
from rmsnorm_deploy.decoder.generate import KVCacheModel, generate
from rmsnorm_deploy.decoder.quantize import dequantized_reference
from rmsnorm_deploy.decoder.transformers_step import transformers_generate
from rmsnorm_deploy.graph.metadata import ModelMetadata

pytest.importorskip("transformers", reason="transformers is the reference the exports are held to")
pytest.importorskip("onnxruntime", reason="generate runs ONNX Runtime")
pytestmark = pytest.mark.slow  # the exports of a 135M model, made once per run

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
#: Three prompts of different lengths: a batch left-padded by different amounts.
SENTENCES = [
    "The weather today is",
    "Water boils at one hundred degrees Celsius at sea level, and at higher altitudes it",
    "In the early morning the fishing boats left the harbour one after another, and by noon the market "
    "by the river was full of people who had come from the villages to buy bread, cheese and",
]
#: Repeated until the prompt is longer than 512 tokens (real text: a trained model's attention over
#: it is nothing like its attention over random ids).
PASSAGE = ("The old library stood at the end of a narrow street. Every morning the librarian opened the heavy "
           "wooden doors, lit the lamps, and sorted the books that readers had returned the day before. "
           "Children came after school to read stories about ships, mountains and distant cities. ")
LONG_PROMPT = 512
#: New tokens per case: modest, for the suite's time; the long prompt only needs a few.
NEW_TOKENS = {"chat": 16, "batch of 3": 12, "longer than 512": 4}
#: A quantized export's short greedy run. At int8 compute (the default accuracy level) the graph and
#: its reference differ by about a logit at this depth (an activation's int8 rounding flips with float
#: noise, layer after layer), so a long run meets near ties either may decide: the int8 export's 8th
#: token of this answer is one (its reference's two best logits 0.012 apart).
QUANTIZED_NEW_TOKENS = 6
FLOAT_EXPORTS = ["kv-ort"]
QUANTIZED_EXPORTS = ["kv-ort-int8", "kv-ort-int4"]


def _prompts(real_weights, case: str) -> list[list[int]]:
    if case == "chat":
        return [real_weights.chat_ids(QUESTION)]
    if case == "batch of 3":
        return [real_weights.text_ids(s) for s in SENTENCES]
    repeats = LONG_PROMPT // len(real_weights.text_ids(PASSAGE)) + 1
    return [real_weights.text_ids(PASSAGE * repeats)]


@pytest.fixture(scope="module")
def transformers_tokens(real_weights):
    """``case -> (prompts, pad id, transformers' greedy tokens)``, each computed once, on first use."""
    made: dict[str, tuple[list[list[int]], int, list[list[int]]]] = {}

    def get(case: str):
        if case not in made:
            prompts = _prompts(real_weights, case)
            pad = real_weights.reference().module.model.generation_config.pad_token_id
            ids, mask = left_padded(prompts, pad)
            tokens = transformers_generate(real_weights.reference().module.model, ids, mask,
                                           max_new_tokens=NEW_TOKENS[case], pad_token_id=pad)
            made[case] = prompts, pad, tokens.tolist()
        return made[case]

    return get


def test_the_prompts_are_what_the_cases_say(real_weights):
    chat, = _prompts(real_weights, "chat")
    assert real_weights.tokenizer().decode(chat).endswith("What is the capital of France?<|im_end|>\n"
                                                          "<|im_start|>assistant\n")
    assert len({len(p) for p in _prompts(real_weights, "batch of 3")}) == 3
    long, = _prompts(real_weights, "longer than 512")
    assert LONG_PROMPT < len(long) < 2 * LONG_PROMPT


@pytest.fixture(scope="module")
def sessions(real_weights):
    """``kind -> KVCacheModel``: the export opened once for the tests that follow each other on it (an
    ONNX Runtime session over 300-600 MB of weights); one open at a time."""
    with contextlib.ExitStack() as stack:
        opened: dict[str, KVCacheModel] = {}

        def get(kind: str) -> KVCacheModel:
            if kind not in opened:
                stack.close()
                opened.clear()
                opened[kind] = stack.enter_context(KVCacheModel(real_weights.export(kind).folder))
            return opened[kind]

        yield get


@pytest.mark.parametrize("case", list(NEW_TOKENS))
@pytest.mark.parametrize("kind", FLOAT_EXPORTS)
def test_generate_gives_transformers_greedy_tokens(sessions, transformers_tokens, kind, case):
    prompts, pad, want = transformers_tokens(case)
    model = sessions(kind)
    assert model.special["pad_token_id"] == pad
    got = generate(model, prompts, max_new_tokens=NEW_TOKENS[case])
    assert got.tokens == want
    if case == "chat":  # the weights are a trained model's, not noise that two runtimes agree on
        assert "Paris" in got.text[0], got.text[0]


@pytest.mark.parametrize("kind", QUANTIZED_EXPORTS)
def test_a_quantized_export_generates_its_dequantized_references_greedy_tokens(real_weights, sessions, kind):
    export = real_weights.export(kind)
    loaded = real_weights.reference()
    prompts = _prompts(real_weights, "chat")
    model = sessions(kind)
    pad = model.special["pad_token_id"]
    got = generate(model, prompts, max_new_tokens=QUANTIZED_NEW_TOKENS)
    graph = onnx.load(str(export.model), load_external_data=False)
    ids, mask = left_padded(prompts, pad)
    with dequantized_reference(loaded.module, graph, ModelMetadata.read(graph).quantization, base_dir=export.folder):
        want = transformers_generate(loaded.module.model, ids, mask, max_new_tokens=QUANTIZED_NEW_TOKENS,
                                     pad_token_id=pad)
    assert got.tokens == want.tolist()
