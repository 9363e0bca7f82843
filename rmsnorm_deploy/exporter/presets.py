"""Model presets: pre-norm architectures as data (one TOML file each).

A preset names a :class:`~rmsnorm_deploy.exporter.blocks.ModelArgs` shape, the norm spec every norm
of the model uses, and the seed of its random weights::

    description = "..."
    [model]                 # ModelArgs fields: vocab_size, dim, n_layers, n_heads, ...
    [norm]                  # RMSNormSpec fields: epsilon, gain, order, accumulation, ...
    [weights]
    seed = 0

Presets are found by name in the package (``rmsnorm_deploy/exporter/preset_files/``: ``tiny``, which the
README's main job exports) and, in a source checkout, in the repository's ``models/``
folder; any other TOML file can be given by path. The exported model's metadata keeps the
TOML text and seed, so :func:`sources.rebuild_source` rebuilds exactly the same module.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.exporter.blocks import ModelArgs, build_model
from rmsnorm_deploy.exporter.loaded_model import LoadedModel, TokenLogits
from rmsnorm_deploy.exporter.rebuild import source_builder
from rmsnorm_deploy.graph.metadata import ModelMetadata

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

#: Presets shipped inside the package.
PACKAGE_PRESETS = Path(__file__).parent / "preset_files"
#: The repository's presets (present in a source checkout, not in an installed wheel).
REPO_PRESETS = Path(__file__).resolve().parents[2] / "models"
_SECTIONS = {"description", "model", "norm", "weights"}


class PresetError(UserError):
    """A preset that is missing or does not describe a model."""


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    args: Any  # blocks.ModelArgs (imported lazily: blocks imports torch modules)
    seed: int
    text: str
    description: str = ""
    path: Path | None = None

    def source(self) -> dict[str, Any]:
        """The metadata ``source`` entry of a model exported from this preset."""
        return {"kind": "preset", "name": self.name, "toml": self.text, "seed": self.seed}


def preset_dirs() -> list[Path]:
    return [d for d in (PACKAGE_PRESETS, REPO_PRESETS) if d.is_dir()]


def preset_names() -> list[str]:
    return sorted({p.stem for d in preset_dirs() for p in d.glob("*.toml")})


def looks_like_path(ref: str) -> bool:
    return ref.endswith(".toml") or "/" in ref or "\\" in ref or ref.startswith(".")


def find_preset(ref: str) -> Path:
    """The TOML file of a preset name or path."""
    if looks_like_path(ref):
        path = Path(ref)
        if not path.is_file():
            raise PresetError(f"preset file {ref} does not exist; give a preset TOML file, a preset name "
                              f"({', '.join(preset_names())}), a Hugging Face folder or a GGUF file")
        return path
    for folder in preset_dirs():
        candidate = folder / f"{ref}.toml"
        if candidate.is_file():
            return candidate
    raise PresetError(f"unknown model {ref!r}: not a preset name ({', '.join(preset_names())}), "
                      "a preset TOML file, a Hugging Face folder or a GGUF file")


def load_preset(ref: str) -> Preset:
    """The preset named ``ref`` or stored at path ``ref``."""
    path = find_preset(ref)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PresetError(f"preset {path}: cannot read it ({exc})") from None
    return parse_preset(text, name=path.stem, path=path)


def parse_preset(text: str, *, name: str, path: Path | None = None) -> Preset:
    """A preset from its TOML text; every mistake is one line naming the file and the field."""

    where = str(path) if path else f"preset {name!r}"
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PresetError(f"{where}: not valid TOML ({exc})") from None
    unknown = sorted(set(data) - _SECTIONS)
    if unknown:
        raise PresetError(f"{where}: unknown top-level entries {unknown}; a preset has {sorted(_SECTIONS)}")
    for section in ("model", "norm"):
        if not isinstance(data.get(section), dict):
            raise PresetError(f"{where}: missing the [{section}] table")
    weights = data.get("weights", {})
    seed = weights.get("seed", 0) if isinstance(weights, dict) else None
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise PresetError(f"{where}: [weights] seed must be an integer >= 0, got {seed!r}")
    try:
        norm = RMSNormSpec.from_dict(data["norm"])
        args = ModelArgs.from_dict({**data["model"], "norm": norm})
    except UserError as exc:
        raise PresetError(f"{where}: {exc}") from None
    description = data.get("description", "")
    return Preset(name, args, seed, text, str(description), path)


def build_preset(preset: Preset, dtype: str):
    """The preset's model in ``dtype``: a :class:`LoadedModel` with seeded random weights."""

    module = TokenLogits(build_model(preset.args, dtype, seed=preset.seed)).eval()
    return LoadedModel(
        name=preset.name, module=module, dtype=dtype, source=preset.source(), vocab_size=preset.args.vocab_size,
        max_seq_len=preset.args.max_seq_len, description=preset.description,
    )


@source_builder("preset")
def _rebuild(meta: ModelMetadata):
    source = meta.source
    if not isinstance(source.get("toml"), str):
        raise UserError("the model's preset source has no TOML text; export it again")
    preset = parse_preset(source["toml"], name=str(source.get("name", "preset")))
    preset = dataclasses.replace(preset, seed=int(source.get("seed", preset.seed)))
    return build_preset(preset, meta.dtype).module
