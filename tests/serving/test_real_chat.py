"""The OpenAI API on a real chat model: the official client's chat answer is transformers' own.

SmolLM2-135M-Instruct exported with ``--kv-cache --target onnxruntime`` (``tests/real_weights.py``:
exported once per run, shared) is served as ``serve --openai-port`` serves it (``tests/serving/_openai.py``:
the same engine and app in this process, without Triton's start-up, which ``test_openai_serve.py``
covers); a greedy chat request through the ``openai`` client must answer exactly what transformers
generates greedily on the prompt the checkpoint's chat template makes, decoded the same way
(special tokens left out), and stop where transformers stops: at the end-of-turn token.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime", reason="the engine runs ONNX Runtime")
pytest.importorskip("transformers", reason="transformers is the reference the answer is held to")
openai = pytest.importorskip("openai", reason="the test speaks through the official openai client")
pytestmark = pytest.mark.slow  # the exports of a 135M model, made once per run

from rmsnorm_deploy.decoder.transformers_step import transformers_generate  # noqa: E402
from tests.serving._openai import openai_server  # noqa: E402

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 24


def test_the_chat_answer_is_transformers_greedy_answer_on_the_chat_template(real_weights):
    folder = real_weights.export("kv-ort").folder
    lm = real_weights.reference().module.model
    prompt = real_weights.chat_ids(QUESTION)
    eos = lm.generation_config.eos_token_id
    new = transformers_generate(lm, np.array([prompt]), np.ones((1, len(prompt)), dtype=np.int64),
                                max_new_tokens=MAX_TOKENS, pad_token_id=lm.generation_config.pad_token_id)[0].tolist()
    assert eos in new, f"transformers did not end its answer in {MAX_TOKENS} tokens: {new}"
    new = new[:new.index(eos) + 1]
    want = real_weights.tokenizer().decode(new, skip_special_tokens=True)
    assert "Paris" in want, want

    with openai_server(folder) as served:
        answer = served.client().chat.completions.create(model="model", messages=QUESTION, max_tokens=MAX_TOKENS,
                                                         temperature=0)
    choice = answer.choices[0]
    assert choice.message.content == want
    assert choice.finish_reason == "stop"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(prompt), len(new))
