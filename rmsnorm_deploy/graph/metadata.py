"""What our ONNX files say about themselves, in ``metadata_props`` under ``rmsnorm_deploy.*``.

Writers (the standalone builder, the export pipeline) and readers (``validate``, ``build``,
``audit``) share this one description, so a model file alone is enough to rebuild its
source, generate valid inputs and choose TensorRT profiles.

=================  ==========================================================================
key                value (JSON unless noted)
=================  ==========================================================================
format             ``"1"`` (plain string): the version of this layout
specs              ``{norm name: RMSNormSpec.to_dict()}``, one entry per norm in the graph; in
                   exported models the name is the norm's module path, also its node's name
lowering           plain string: function, native, ort, inline or plugin
dtype              plain string: the activation dtype (float32, float16, bfloat16)
source             ``{"kind": "standalone" | "preset" | "hf" | "gguf", ...}``: enough to rebuild the
                   PyTorch module (``sources.rebuild_source``):
                   ``{"kind": "preset", "name": str, "toml": str (the preset's whole TOML text),
                   "seed": int}``; ``{"kind": "hf", "path": str (absolute folder),
                   "model_type": str}`` for a saved model, or ``{"kind": "hf", "config": {...}
                   (the full transformers config), "seed": int}`` for random weights;
                   ``{"kind": "gguf", "path": str (absolute .gguf file), "sha256": str,
                   "architecture": str (the file's own), "model_type": str}`` for a GGUF file
inputs             ``{input name: {"dtype": str, "shape": [int | str], "kind": "activations" |
                   "token_ids" | "weight", "high": int (token_ids only)}}``; strings are dynamic dims.
                   Exported language models take ``input_ids`` (int64 ``["batch", "seq"]``,
                   ``kind: token_ids``, ids in ``[0, high)``) and return ``logits``
dims               ``{dynamic dim name: [min, opt, max]}``: the range the model supports, the
                   defaults for TensorRT optimization profiles. For exported language models
                   ``opt`` is the example shape the export traced and checked; ``max`` is
                   ``max(8, batch)`` for ``batch`` and the model's positions (at most 4096) for
                   ``seq``
versions           ``{package: version}`` of the tools that wrote the file
placements         ``{norm call name: {"placement": str, "output": str}}``: where the source
                   model places each call of a norm (``graph/placement.py``: pre, post,
                   sublayer_output, qk, final, other) and the tensor the call writes, which
                   names the norm in every lowering; the second call of a norm is
                   ``path#2``. Exported models only; the audit checks the graph against it
kv_cache           only in KV-cache graphs (``export --kv-cache``): the I/O convention,
                   ``decoder.convention.KVCacheLayout.to_dict()`` (layers, heads, head_dim,
                   vocabulary, maximum length, dtype, graph ``target``: portable or onnxruntime,
                   ``past_present_share_buffer``); read back through
                   ``KVCacheLayout.from_dict``, which checks every field
quantization       only in weight-only quantized graphs (``export --quantize``): the scheme,
                   bits, block size, ``accuracy_level`` and the dtype it computes in, whether the
                   LM head is quantized, and per ``MatMulNBits`` its packed weight, scales and the
                   Linear modules (with their rows) it holds; read back through
                   ``decoder.quantize.quantization_of``, which checks every field
=================  ==========================================================================
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import onnx

from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.errors import ModelFileError
from rmsnorm_deploy.resources import __version__, package_version

PREFIX = "rmsnorm_deploy."
FORMAT = "1"
_JSON_KEYS = ("specs", "source", "inputs", "dims", "versions", "placements", "kv_cache", "quantization")
_TEXT_KEYS = ("format", "lowering", "dtype")


@dataclasses.dataclass
class ModelMetadata:
    specs: dict[str, RMSNormSpec]
    lowering: str
    dtype: str
    source: dict[str, Any] = dataclasses.field(default_factory=lambda: {"kind": "standalone"})
    inputs: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    dims: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    placements: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    #: KV-cache graphs only: the I/O convention (``decoder.convention``); ``None`` otherwise.
    kv_cache: dict[str, Any] | None = None
    #: Weight-only quantized graphs only (``decoder.quantize``); ``None`` otherwise.
    quantization: dict[str, Any] | None = None

    def to_props(self) -> dict[str, str]:
        props = {
            "format": FORMAT,
            "specs": json.dumps({k: v.to_dict() for k, v in self.specs.items()}, sort_keys=True),
            "lowering": self.lowering,
            "dtype": self.dtype,
            "source": json.dumps(self.source, sort_keys=True),
            "inputs": json.dumps(self.inputs, sort_keys=True),
            "dims": json.dumps(self.dims, sort_keys=True),
            "versions": json.dumps(self.versions, sort_keys=True),
        }
        if self.placements:
            props["placements"] = json.dumps(self.placements, sort_keys=True)
        if self.kv_cache is not None:
            props["kv_cache"] = json.dumps(self.kv_cache, sort_keys=True)
        if self.quantization is not None:
            props["quantization"] = json.dumps(self.quantization, sort_keys=True)
        return props

    def write(self, model: onnx.ModelProto) -> None:
        """Replace the model's ``rmsnorm_deploy.*`` entries with these."""
        kept = [p for p in model.metadata_props if not p.key.startswith(PREFIX)]
        del model.metadata_props[:]
        model.metadata_props.extend(kept)
        for key, value in self.to_props().items():
            model.metadata_props.add(key=PREFIX + key, value=value)

    @classmethod
    def read(cls, model: onnx.ModelProto) -> ModelMetadata | None:
        """The metadata of a model this project wrote, or ``None`` for any other model."""
        raw = {p.key[len(PREFIX):]: p.value for p in model.metadata_props if p.key.startswith(PREFIX)}
        if "specs" not in raw:
            return None
        try:
            parsed = {k: json.loads(raw[k]) for k in _JSON_KEYS if k in raw}
            _check_types(parsed, raw)
            specs = {name: RMSNormSpec.from_dict(d) for name, d in parsed.get("specs", {}).items()}
            placements = parsed.get("placements", {})
            if not isinstance(placements, dict) or not all(
                    isinstance(v, dict) and isinstance(v.get("placement"), str) and isinstance(v.get("output"), str)
                    for v in placements.values()):
                raise ValueError("placements is not {name: {placement, output}}")
        except (ValueError, TypeError, KeyError) as exc:
            raise ModelFileError(f"the model's rmsnorm_deploy metadata is damaged ({exc}); export it again") from None
        return cls(
            specs=specs,
            lowering=raw.get("lowering", ""),
            dtype=raw.get("dtype", ""),
            source=parsed.get("source", {"kind": "unknown"}),
            inputs=parsed.get("inputs", {}),
            dims=parsed.get("dims", {}),
            versions=parsed.get("versions", {}),
            placements=placements,
            kv_cache=parsed.get("kv_cache"),
            quantization=parsed.get("quantization"),
        )


def _check_types(parsed: dict[str, Any], raw: dict[str, str]) -> None:
    """Every field of the layout above has its type (metadata is untrusted input): a ValueError naming
    the first field that does not."""

    def need(ok: bool, field: str, what: str) -> None:
        if not ok:
            raise ValueError(f"{field} must be {what}")

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    specs = parsed.get("specs", {})
    need(isinstance(specs, dict) and all(isinstance(v, dict) for v in specs.values()), "specs",
         "an object of spec objects")
    source = parsed.get("source", {"kind": "unknown"})
    need(isinstance(source, dict), "source", "an object")
    need(isinstance(source.get("kind", ""), str), "source.kind", "a string")
    for key, types, what in (("path", str, "a string"), ("toml", str, "a string"), ("name", str, "a string"),
                             ("model_type", str, "a string"), ("config", dict, "an object"),
                             ("sha256", str, "a string"), ("architecture", str, "a string")):
        need(source.get(key) is None or isinstance(source[key], types), f"source.{key}", what)
    need(source.get("seed") is None or (is_int(source["seed"]) and source["seed"] >= 0), "source.seed",
         "an integer >= 0")
    inputs = parsed.get("inputs", {})
    need(isinstance(inputs, dict) and all(isinstance(v, dict) for v in inputs.values()), "inputs",
         "an object of input objects")
    for name, info in inputs.items():
        for key in ("kind", "dtype", "gain"):
            need(info.get(key) is None or isinstance(info[key], str), f"inputs.{name}.{key}", "a string")
        need(info.get("high") is None or (is_int(info["high"]) and info["high"] >= 1), f"inputs.{name}.high",
             "an integer >= 1")
        need(info.get("shape") is None or (isinstance(info["shape"], list) and all(
            isinstance(d, str) or (is_int(d) and d >= 0) for d in info["shape"])), f"inputs.{name}.shape",
            "a list of sizes and dim names")
    dims = parsed.get("dims", {})
    need(isinstance(dims, dict), "dims", "an object")
    for name, rng in dims.items():
        # 0 is a size: a KV-cache graph's past starts empty
        need(isinstance(rng, list) and len(rng) == 3 and all(is_int(d) for d in rng) and 0 <= rng[0] <= rng[1] <= rng[2],
             f"dims.{name}", "[min, opt, max] with 0 <= min <= opt <= max")
    need(parsed.get("quantization") is None or isinstance(parsed["quantization"], dict), "quantization", "an object")
    versions = parsed.get("versions", {})
    need(isinstance(versions, dict) and all(isinstance(v, str) for v in versions.values()), "versions",
         "an object of version strings")


@functools.lru_cache(maxsize=1)
def _versions() -> tuple[tuple[str, str], ...]:

    versions = {"rmsnorm-deploy": __version__}
    for dist in ("torch", "onnx", "onnxscript", "transformers"):
        version = package_version(dist)
        if version != "not installed":
            versions[dist] = version
    return tuple(versions.items())


def tool_versions() -> dict[str, str]:
    """Versions of the packages that shape an exported graph."""
    return dict(_versions())
