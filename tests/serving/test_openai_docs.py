"""The OpenAI API's examples in docs/serving.md, run as they are written against the API, and curl's
``--no-buffer`` stream as a shell script reads it.

The examples name the address the section's ``serve`` line gives the API (checked below). The
server the tests start listens on a free loopback port instead, and each example runs with that
address put in place of the documented one: a fixed port may be taken on the machine running the
suite, between any check and the bind."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime", reason="the engine runs ONNX Runtime")
pytest.importorskip("openai", reason="the examples use the official openai client")
pytest.importorskip("transformers", reason="chat prompts are rendered by transformers' apply_chat_template")
pytest.importorskip("uvicorn", reason="the API is served by uvicorn")

from rmsnorm_deploy.decoder.generate import KVCacheModel, generate  # noqa: E402
from tests.serving._openai import openai_server  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
SECTION = "## The OpenAI-compatible API"
TIMEOUT_S = 60


def _section() -> str:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index(SECTION):]
    following = section.find("\n## ", len(SECTION))
    return section if following < 0 else section[:following]


def _documented_serve() -> tuple[list[str], str]:
    """The section's ``rmsnorm-deploy serve`` command line and the address its comment promises."""
    found = re.search(r"^rmsnorm-deploy serve (.*?)\s+# the OpenAI API at http://([\d.]+:\d+)/v1$", _section(), re.M)
    assert found, "the section shows no `rmsnorm-deploy serve ...  # the OpenAI API at http://HOST:PORT/v1` line"
    return found.group(1).split(), found.group(2)


SERVE_ARGS, DOC_ADDRESS = _documented_serve()


def _examples() -> list[tuple[str, str]]:
    """``(language, code)`` of each Python block, and each bash block that is a curl command, in the section."""
    section = _section()
    blocks = re.findall(r"```(python|bash)\n(.*?)```", section, flags=re.S)
    return [(language, code) for language, code in blocks if language == "python" or code.startswith("curl ")]


EXAMPLES = _examples()


@pytest.fixture(scope="module")
def server(text_exports):
    """The API on a free loopback port (a plain ``serve`` gives none: the command asks for it)."""
    with openai_server(text_exports("ort")) as served:
        yield served


def _served_address(server) -> str:
    """HOST:PORT of the running server, which the examples are given in place of the documented address."""
    address = server.url.removeprefix("http://").removesuffix("/v1")
    assert re.fullmatch(r"127\.0\.0\.1:\d+", address), server.url
    return address


def test_the_documented_serve_line_serves_the_api_on_the_documented_address():
    """``serve``'s own rule for where the API goes, applied to the documented flags."""
    from types import SimpleNamespace

    from rmsnorm_deploy.serving.openai.serve import openai_placement

    flags = dict(zip(SERVE_ARGS[1::2], SERVE_ARGS[2::2]))
    text_model = SimpleNamespace(tokenizer=object(), folder=SERVE_ARGS[0])
    port = int(flags["--openai-port"]) if "--openai-port" in flags else None
    assert openai_placement(text_model, enabled="--no-openai" not in SERVE_ARGS, port=port) == ("port", None)
    host = flags.get("--host", "127.0.0.1")
    assert f"{host}:{port}" == DOC_ADDRESS


def test_the_section_has_python_and_curl_examples():
    assert [language for language, _ in EXAMPLES] == ["python", "python", "python", "bash", "bash"]
    assert all(DOC_ADDRESS in code for _, code in EXAMPLES)


@pytest.mark.parametrize(("language", "code"), EXAMPLES, ids=[f"{i}-{lang}" for i, (lang, _) in enumerate(EXAMPLES)])
def test_each_example_runs_as_written(server, language, code):
    if language == "bash" and shutil.which("curl") is None:
        pytest.skip("curl is not installed on this machine")
    code = code.replace(DOC_ADDRESS, _served_address(server))
    argv = [sys.executable, "-c", code] if language == "python" else ["bash", "-c", "set -euo pipefail\n" + code]
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    before = server.engine.stats()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and '"error"' not in done.stdout
    after = server.engine.stats()
    ended = {k: after[k] - before.get(k, 0) for k in after if k not in ("running", "waiting")}
    ended = {k: n for k, n in ended.items() if n}
    assert ended and set(ended) <= {"stop", "length"}, f"the example's streams ended as {ended}"
    # an example that samples (no temperature: 1) may draw end-of-sequence at once: an empty answer, rightly
    assert done.stdout.strip() or ended.get("stop"), "the example printed nothing, and no stream ended on its own"


def test_curl_no_buffer_prints_each_event_as_it_comes(server, text_exports):
    """A shell reading ``curl --no-buffer``: the first event arrives while the engine still generates,
    the events end with ``data: [DONE]``, and their text is ``generate``'s."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed on this machine")
    prompt, n = "hello the world", 300
    with KVCacheModel(text_exports("ort")) as model:
        want = generate(model, [model.encode(prompt)], max_new_tokens=n).text[0]
    body = json.dumps({"model": "model", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True})
    process = subprocess.Popen(["curl", "--no-buffer", "--silent", "--show-error", "--max-time", str(TIMEOUT_S),
                                f"{server.url}/completions", "-H", "Content-Type: application/json", "-d", body],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines: list[bytes] = []
    first_while_running: list[bool] = []

    def read() -> None:
        for line in process.stdout:
            if not lines:
                first_while_running.append(server.engine.stats()["running"] == 1)
            lines.append(line)

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(TIMEOUT_S)
    assert process.wait(TIMEOUT_S) == 0, process.stderr.read()
    events = [line[len(b"data: "):].strip() for line in lines if line.startswith(b"data: ")]
    assert first_while_running == [True], "curl printed the first event before the stream ended"
    assert events[-1] == b"[DONE]" and all(line in (b"\n",) or line.startswith(b"data: ") for line in lines)
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
