"""`rmsnorm-deploy generate --prompt`: text in, text out, for every kind of folder an export writes
(the portable graph and ``--target onnxruntime``), the text being the decode of the greedy tokens,
as the OpenAI API answers it."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("onnxruntime", reason="generate runs ONNX Runtime")
pytest.importorskip("tokenizers", reason="the folder's tokenizer.json is read by tokenizers")

from rmsnorm_deploy.cli import main  # noqa: E402
from rmsnorm_deploy.decoder.generate import KVCacheModel, Sampling, generate  # noqa: E402


@pytest.mark.parametrize("kind", ["ort", "portable"])
def test_generate_takes_a_prompt_as_text_and_prints_text(capsys, text_exports, kind):
    folder = text_exports(kind)
    capsys.readouterr()  # the export's own output
    prompt = "hello the world café 日本"
    with KVCacheModel(folder) as model:
        ids = model.encode(prompt)
        want = generate(model, [ids], max_new_tokens=12)
        sampled = generate(model, [ids], max_new_tokens=12,
                           sampling=Sampling(do_sample=True, seed=4, temperature=0.8, top_p=0.9))
    assert ids[0] == 1 and len(ids) > len(prompt.split()), "the folder's tokenizer adds <s> and splits characters"
    assert main(["generate", str(folder), "--prompt", prompt, "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert want.text[0] == model.decode(want.tokens[0]) and out.startswith(want.text[0] + "\nprefill ")
    assert main(["generate", str(folder), "--prompt", prompt, "--max-new-tokens", "12", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["prompts"], result["tokens"], result["text"]) == ([ids], want.tokens, want.text)
    assert main(["generate", str(folder), "--prompt", prompt, "--max-new-tokens", "12", "--json", "--sample",
                 "--seed", "4", "--temperature", "0.8", "--top-p", "0.9"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == sampled.text
