"""Detection by probing, --norm-spec declarations, and the float64 run of MoE and Mamba-style models."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.cases import DTYPES

from rmsnorm_deploy import RMSNormSpec
from rmsnorm_deploy.contract.dtypes import torch_dtype
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.exporter.detect import (
    NOT_CALLED,
    NormMismatchError,
    NotExportedNorm,
    UnknownNormError,
    class_path,
    detect_norms,
    parse_norm_spec,
    refuse_calls_of_not_exported,
)
from rmsnorm_deploy.exporter.loaded_model import TokenLogits
from rmsnorm_deploy.exporter.probing import normal_form

WIDTHS = [1, 7, 760]


class Wrapper(torch.nn.Module):
    def __init__(self, **children):
        super().__init__()
        for name, child in children.items():
            setattr(self, name, child)

    def forward(self, x):
        for child in self.children():
            x = child(x)
        return x


class RenamedLlamaNorm(torch.nn.Module):
    """HF LlamaRMSNorm's code under another name (as Mixtral, Granite, SmolLM3, ... ship it)."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class RenamedGemmaNorm(torch.nn.Module):
    """HF GemmaRMSNorm's code: ``(1 + w)`` in float32, then cast."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        output = x.float()
        output = output * torch.rsqrt(output.pow(2).mean(-1, keepdim=True) + self.eps)
        return (output * (1.0 + self.weight.float())).type_as(x)


class TorchStyleNorm(torch.nn.Module):
    """Scale in float32, then cast (torch.nn.RMSNorm, OLMo2), with its epsilon named ``epsilon``."""

    def __init__(self, dim, epsilon=1e-5):
        super().__init__()
        self.epsilon = epsilon
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.epsilon) * self.weight.float()).to(x.dtype)


def _set_weight(module, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.weight.add_(torch.randn(module.weight.shape, generator=gen) * 0.3)
    return module.to(torch_dtype(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("cls, eps, expected, named", [
    (RenamedLlamaNorm, 1e-5, RMSNormSpec.llama(1e-5), "llama"),
    (RenamedGemmaNorm, 1e-6, RMSNormSpec.gemma(1e-6), "gemma"),
    (TorchStyleNorm, 1e-5, RMSNormSpec.torch_rmsnorm(1e-5), "torch"),
])
def test_probing_finds_the_one_spec_of_a_renamed_norm(cls, eps, expected, named, width, dtype):
    norm = _set_weight(cls(width, eps), seed=width, dtype=dtype)
    (found,) = detect_norms(Wrapper(block=Wrapper(norm=norm))).norms
    assert normal_form(found.spec) == normal_form(expected)
    assert found.how == f"confirmed by probing: {named} (eps {eps:g})"
    assert found.path == "block.norm" and found.weight is norm.weight and found.normalized_shape == (width,)


def test_a_gain_of_all_ones_still_shows_how_it_is_applied():
    # The module's weight is all ones: gain none, weight and both orders give the same bits on it;
    # the random-weight probes tell them apart.
    (found,) = detect_norms(Wrapper(n=RenamedLlamaNorm(64).half())).norms
    assert (found.spec.gain, found.spec.order) == ("weight", "cast_then_scale")


def test_a_module_that_runs_only_in_float32_is_ambiguous_and_refused():
    class Float32OnlyNorm(TorchStyleNorm):
        def forward(self, x):
            if x.dtype != torch.float32:
                raise TypeError("float32 only")
            return super().forward(x)

    with pytest.raises(UnknownNormError, match=r"module 'n' \(.*Float32OnlyNorm\): probing cannot decide between 2 "
                                               r"specs .* in float32 \(it does not run in float16, bfloat16\): torch "
                                               r"\(eps 1e-05\); .*--norm-spec Float32OnlyNorm=SPEC"):
        detect_norms(Wrapper(n=_set_weight(Float32OnlyNorm(16), 1, "float32")))


def test_a_norm_matching_no_candidate_is_refused_with_the_closest_and_its_ulp_distance():
    class SqrtOfNPlusOneNorm(RenamedLlamaNorm):  # mean over n + 1: close to Llama, not equal
        def forward(self, x):
            xf = x.float()
            v = xf.pow(2).sum(-1, keepdim=True) / (xf.shape[-1] + 1)
            return self.weight * (xf * torch.rsqrt(v + self.variance_epsilon)).to(x.dtype)

    with pytest.raises(UnknownNormError, match=r"module 'n' \(.*SqrtOfNPlusOneNorm\) computes none of the \d+ candidate "
                                               r"RMSNorm specs bit for bit \(probed in float32, float16, bfloat16\); "
                                               r"closest: (torch|llama) \(eps 1e-06\) \[.*\], [\d.e+]+ ULP off at"):
        detect_norms(Wrapper(n=_set_weight(SqrtOfNPlusOneNorm(760), 2, "float32")))


class L2Norm(torch.nn.Module):
    """Llama4 text's weightless qk norm: no weight, no width attribute."""

    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


class HeadsModel(torch.nn.Module):
    def __init__(self, hidden=21, heads=3):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)
        self.qk_norm = L2Norm()
        self.heads = heads

    def forward(self, x):
        h = self.proj(x)
        h = h.view(*h.shape[:-1], self.heads, -1)
        return self.qk_norm(h).flatten(-2)


def test_a_weightless_norm_is_probed_at_the_width_it_sees_inside_the_model():
    model = HeadsModel()
    (found,) = detect_norms(model, example={"x": torch.randn(2, 5, 21)}).norms
    assert found.normalized_shape == (7,) and found.spec.gain == "none" and found.spec.epsilon == 1e-6
    assert found.how.startswith("confirmed by probing: nogain")
    with pytest.raises(UnknownNormError, match=r"module 'qk_norm' .* has no weight and no normalized_shape, so its "
                                               r"width is read from a run of the model"):
        detect_norms(model)


class MeanVarianceNormLayer(torch.nn.Module):
    """Phi-4-multimodal's audio input normalization: named like a norm, no weight, no normalized_shape."""

    def __init__(self, width=8):
        super().__init__()
        self.register_buffer("global_mean", torch.linspace(-1, 1, width))
        self.register_buffer("global_invstd", torch.linspace(0.5, 2, width))

    def forward(self, x):
        return (x - self.global_mean) * self.global_invstd


class DeclaredGainlessNorm(torch.nn.Module):
    """A declared spec without a gain or a width: its width is read from the model's run too."""

    rmsnorm_spec = RMSNormSpec(1e-6, gain="none")

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x)


class TextWithAudio(torch.nn.Module):
    """A text model whose audio branch runs only when audio is given (the export's example has none)."""

    def __init__(self, audio_norm):
        super().__init__()
        self.norm = _set_weight(RenamedLlamaNorm(16), 1, "float32")
        self.audio_norm = audio_norm

    def forward(self, x, audio=None):
        h = self.norm(x)
        if audio is not None:
            h = h + self.audio_norm(audio).mean(-1, keepdim=True)
        return h


@pytest.mark.parametrize("audio_norm", [MeanVarianceNormLayer, DeclaredGainlessNorm])
def test_a_weightless_norm_the_example_run_never_calls_is_listed_as_not_exported(audio_norm):
    model = TextWithAudio(audio_norm())
    detection = detect_norms(model, example={"x": torch.randn(2, 3, 16)})
    assert [n.path for n in detection.norms] == ["norm"]
    assert detection.not_exported == [NotExportedNorm("audio_norm", "audio_norm", class_path(audio_norm), NOT_CALLED)]
    assert detection.not_exported[0].to_dict()["reason"].endswith("so it is not on the exported path")
    with refuse_calls_of_not_exported(model, detection):  # the traced run on the example: not called
        model(torch.randn(2, 3, 16))


def test_a_weightless_norm_the_example_run_calls_is_still_refused_when_unconfirmable():
    model = TextWithAudio(MeanVarianceNormLayer())
    with pytest.raises(UnknownNormError, match=r"^module 'audio_norm' \(.*MeanVarianceNormLayer\) computes none of "
                                               r"the \d+ candidate"):
        detect_norms(model, example={"x": torch.randn(2, 3, 16), "audio": torch.randn(2, 3, 8)})


def test_a_not_exported_norm_that_the_traced_run_calls_stops_the_export():
    model = TextWithAudio(MeanVarianceNormLayer())
    detection = detect_norms(model, example={"x": torch.randn(2, 3, 16)})
    with pytest.raises(UnknownNormError, match=r"^module 'audio_norm' \(.*MeanVarianceNormLayer\) is called by the "
                                               r"forward the export traces but not by the example run"):
        with refuse_calls_of_not_exported(model, detection):
            model(torch.randn(2, 3, 16), audio=torch.randn(2, 3, 8))


def test_an_embedding_named_norm_is_not_a_norm_but_its_inner_norm_is_seen():
    class InklingNormedEmbedding(torch.nn.Embedding):
        def __init__(self):
            super().__init__(32, 16)
            self.norm = RenamedLlamaNorm(16)

        def forward(self, ids):
            return self.norm(super().forward(ids))

    detection = detect_norms(Wrapper(embed=InklingNormedEmbedding()))
    assert [(n.path, n.how) for n in detection.norms] == [("embed.norm", "confirmed by probing: llama (eps 1e-06)")]


def test_a_container_named_norm_that_is_not_one_is_seen_through():
    class NormBlock(torch.nn.Module):  # takes (x, mask): not a one-tensor normalization
        def __init__(self):
            super().__init__()
            self.inner = TorchStyleNorm(16)

        def forward(self, x, mask):
            return self.inner(x) * mask

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = NormBlock()

        def forward(self, x):
            return self.block(x, torch.ones_like(x))

    detection = detect_norms(Model(), example={"x": torch.randn(3, 16)})
    assert [n.path for n in detection.norms] == ["block.inner"]


def test_a_leaf_that_needs_a_second_input_is_refused():
    class GatedRMSNorm(RenamedLlamaNorm):
        def forward(self, x, gate):
            return super().forward(x) * torch.nn.functional.silu(gate)

    with pytest.raises(UnknownNormError, match=r"module 'n' .*GatedRMSNorm\) is named like a normalization but "
                                               r"forward\(x\) fails .*a gated norm takes a second input"):
        detect_norms(Wrapper(n=GatedRMSNorm(8)))


def test_a_layernorm_is_refused_as_one_without_advice_to_swap_it():
    class CohereLayerNorm(torch.nn.Module):
        def __init__(self, hidden, eps=1e-5):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(hidden))
            self.variance_epsilon = eps

        def forward(self, x):
            xf = x.float()
            xf = xf - xf.mean(-1, keepdim=True)
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (self.weight.float() * xf).to(x.dtype)

    with pytest.raises(UnknownNormError) as info:
        detect_norms(Wrapper(layers=Wrapper(ln=CohereLayerNorm(16))))
    message = str(info.value)
    assert "module 'layers.ln'" in message and "is a LayerNorm (it subtracts the mean" in message
    assert "RMSNorm" not in message.split("not an RMSNorm")[1] and "torch.nn.RMSNorm" not in message


def test_messages_name_modules_by_the_wrapped_models_own_paths():
    inner = Wrapper(model=Wrapper(layers=Wrapper(n=_set_weight(RenamedLlamaNorm(16), 3, "float32"))))
    wrapped = TokenLogits(inner)
    (found,) = detect_norms(wrapped).norms
    assert (found.path, found.name) == ("model.model.layers.n", "model.layers.n")
    with pytest.raises(NormMismatchError, match=r"^norm 'model.layers.n' \(.*RenamedLlamaNorm\) differs from its spec "
                                                r".*\d ULP\)"):
        detect_norms(wrapped, overrides=[parse_norm_spec("RenamedLlamaNorm=gemma")])


# -- --norm-spec ---------------------------------------------------------------------------
def test_a_declared_spec_is_confirmed_and_takes_its_epsilon_from_the_module():
    model = Wrapper(a=_set_weight(RenamedLlamaNorm(16, eps=1e-5), 1, "float16"),
                    b=_set_weight(TorchStyleNorm(16), 2, "float16"))
    detection = detect_norms(model, overrides=[parse_norm_spec("RenamedLlamaNorm=llama"),
                                               parse_norm_spec("b=eps=1e-5,gain=weight,order=scale_then_cast")])
    assert detection.specs == {"a": RMSNormSpec.llama(1e-5), "b": RMSNormSpec.torch_rmsnorm(1e-5)}
    assert {n.how for n in detection.norms} == {"declared --norm-spec"}


@pytest.mark.parametrize("text, message", [
    ("llama", r"give CLASS_OR_PATH=SPEC"),
    ("X=", r"give CLASS_OR_PATH=SPEC"),
    ("X=lama", r"--norm-spec 'X=lama': unknown named spec 'lama'; choose one of torch, llama, gemma"),
    ("X=eps=abc", r"epsilon 'abc' in spec 'eps=abc' is not a number"),
    ("X=eps=-1", r"epsilon must be finite and > 0"),
    ("X=gain=twice", r"unknown gain 'twice'"),
    ("X=colour=red", r"cannot read 'colour=red' in spec 'colour=red': expected FIELD=VALUE"),
])
def test_norm_spec_parse_errors_are_one_line(text, message):
    with pytest.raises(UserError, match=message) as info:
        parse_norm_spec(text)
    assert "\n" not in str(info.value)


def test_a_declaration_matching_no_module_is_an_error():
    with pytest.raises(UserError, match=r"--norm-spec Missing=llama: no module of the model has the class or path"):
        detect_norms(Wrapper(n=RenamedLlamaNorm(8)), overrides=[parse_norm_spec("Missing=llama")])


# -- the float64 run ---------------------------------------------------------------------------
def test_a_parent_reading_its_childs_weight_runs_in_float64():
    from rmsnorm_deploy.exporter.upcast import float64_outputs

    class Mixer(torch.nn.Module):  # as Mamba's and Jamba's mixers do: self.dt_proj.weight @ x
        def __init__(self):
            super().__init__()
            self.dt_proj = torch.nn.Linear(6, 6)

        def forward(self, x):
            return (self.dt_proj.weight @ x.transpose(-1, -2)).transpose(-1, -2)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mixer = Mixer()

        def forward(self, x):
            return {"y": self.mixer(x)}

    model, x = Model(), torch.randn(2, 6, dtype=torch.float64)  # as an Embedding's float64 rows would be
    got = float64_outputs(model, (), x=x)["y"]
    want = copy.deepcopy(model).double()(x)["y"]
    assert got.dtype == torch.float64 and torch.equal(got, want.detach())
    assert model.mixer.dt_proj.weight.dtype == torch.float32


def test_a_moe_models_float64_reference_run_works_and_leaves_its_experts_as_they_were():
    # Slower than most (transformers builds the Mixtral model: several seconds on 2 cores); one layer.
    pytest.importorskip("transformers", reason="a transformers MoE model is built from its config")
    from rmsnorm_deploy.exporter import hf
    from rmsnorm_deploy.exporter.upcast import experts_implementation, float64_outputs

    config = dict(hf.TINY_CONFIGS["llama"], model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                  num_hidden_layers=1)
    loaded = hf.from_config(config, "float32", seed=0)
    module = loaded.module
    impl = module.model.config._experts_implementation_internal
    assert impl == "grouped_mm"  # the default, which has no float64 kernel
    norms = detect_norms(module, dtype="float32").norms
    ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(0))
    got = float64_outputs(module, norms, input_ids=ids)["logits"]
    assert got.dtype == torch.float64 and bool(torch.isfinite(got).all())
    assert module.model.config._experts_implementation_internal == impl
    with torch.no_grad():
        same = module(input_ids=ids)["logits"]
    from rmsnorm_deploy.contract.compare import compare
    from rmsnorm_deploy.contract.tolerances import tolerance_for

    assert compare(same, got, tolerance_for("model", "onnxruntime", "float32"), dtype="float32").passed
    with experts_implementation(module) as count:
        assert count == 1 and module.model.config._experts_implementation_internal == "batched_mm"
    assert module.model.config._experts_implementation_internal == impl


def test_a_block_named_like_a_norm_that_computes_none_is_not_claimed_and_its_norms_are_seen():
    class NormalizedMLP(torch.nn.Module):  # maps x to the same shape, but is a block
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(16, 16)
            self.norm = RenamedLlamaNorm(16)

        def forward(self, x):
            return x + self.up(self.norm(x))

    detection = detect_norms(Wrapper(mlp=NormalizedMLP()), example={"x": torch.randn(2, 16)})
    assert [n.path for n in detection.norms] == ["mlp.norm"]


def test_a_float64_run_that_fails_is_one_line_not_a_traceback():
    from rmsnorm_deploy.exporter.upcast import Float64RunError, float64_outputs

    class Float32Kernel(torch.nn.Module):  # like a kernel with no float64 version
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            if x.dtype == torch.float64:
                raise RuntimeError("Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double\n  at kernel.cpp")
            return {"y": x * self.scale}

    with pytest.raises(Float64RunError, match=r"^the float64 reference run of the model failed, so its parity cannot "
                                              r"be checked: RuntimeError: Expected mat_a .* got Double") as info:
        float64_outputs(Float32Kernel(), (), x=torch.randn(2, 4, dtype=torch.float64))
    assert "\n" not in str(info.value) and isinstance(info.value, UserError)
