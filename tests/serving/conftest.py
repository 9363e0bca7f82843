"""The tiny models the serving tests serve, each exported once per run for every worker
(``tests/made_once.py``): the tiny preset plain and with a KV cache, and tiny Llamas."""

from __future__ import annotations

import pytest

from rmsnorm_deploy.cli import main
from tests.made_once import made_once


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory):
    """``rmsnorm-deploy export tiny -o DIR``: the folder holding ``model.onnx`` (float32, function lowering)."""
    def make(folder):
        assert main(["export", "tiny", "-o", str(folder / "model.onnx"), "--force"]) == 0

    return made_once(tmp_path_factory, "tiny-export", make)


@pytest.fixture(scope="session")
def tiny_kv_export(tmp_path_factory):
    """``rmsnorm-deploy export tiny --kv-cache -o DIR``: the folder."""
    def make(folder):
        assert main(["export", "tiny", "--kv-cache", "-o", str(folder), "--force"]) == 0

    return made_once(tmp_path_factory, "tiny-kv-export", make)


#: The tiny Llama of the engine tests: the exporter's tiny config (vocabulary 256, end of sequence 2)
#: with room for streams long enough to be cancelled mid-way on a fast machine (16384 positions).
ENGINE_LLAMA = {"max_position_embeddings": 16384}


@pytest.fixture(scope="session")
def engine_exports(tmp_path_factory):
    """``kind -> folder``: the tiny Llama exported with ``--kv-cache --target onnxruntime`` (``ort``),
    the same with ``--share-buffer`` (``ort-shared``), and as the portable graph (``portable``),
    each exported once, on first use."""
    from rmsnorm_deploy.exporter import hf

    options = {"ort": ["--target", "onnxruntime"], "ort-shared": ["--target", "onnxruntime", "--share-buffer"],
               "portable": []}

    def save_source(folder):
        hf.from_config({**hf.TINY_CONFIGS["llama"], **ENGINE_LLAMA}, "float32", seed=0).module.model \
            .save_pretrained(folder)

    def get(kind: str):
        source = made_once(tmp_path_factory, "engine-llama", save_source)

        def make(folder):
            assert main(["export", str(source), "--kv-cache", *options[kind], "-o", str(folder), "--force"]) == 0

        return made_once(tmp_path_factory, f"engine-export-{kind}", make)

    return get


@pytest.fixture(scope="session")
def engine_llama():
    """The transformers model the engine exports came from (same config, same seed)."""
    from rmsnorm_deploy.exporter import hf

    return hf.from_config({**hf.TINY_CONFIGS["llama"], **ENGINE_LLAMA}, "float32", seed=0).module.model


#: The tiny Llama of the OpenAI API tests: the byte-level tokenizer of ``tests/serving/_tokenizer.py``
#: (vocabulary 292) and room for long streams.
TEXT_LLAMA = {"max_position_embeddings": 512}
TEXT_VOCAB = 292


@pytest.fixture(scope="session")
def text_exports(tmp_path_factory):
    """``kind -> folder``: a tiny Llama whose Hugging Face folder has a tokenizer with a chat template,
    exported with ``--kv-cache --target onnxruntime`` (``ort``) or as the portable graph (``portable``),
    each once, on first use; the export copies the tokenizer files beside the model."""
    from rmsnorm_deploy.exporter import hf
    from tests.serving._tokenizer import write_tokenizer

    options = {"ort": ["--target", "onnxruntime"], "portable": []}

    def save_source(folder):
        hf.from_config({**hf.TINY_CONFIGS["llama"], **TEXT_LLAMA, "vocab_size": TEXT_VOCAB}, "float32",
                       seed=0).module.model.save_pretrained(folder)
        assert write_tokenizer(folder) == TEXT_VOCAB

    def get(kind: str):
        source = made_once(tmp_path_factory, "text-llama", save_source)

        def make(folder):
            assert main(["export", str(source), "--kv-cache", *options[kind], "-o", str(folder), "--force"]) == 0

        return made_once(tmp_path_factory, f"text-export-{kind}", make)

    return get
