"""A LLaMA-style pre-norm transformer whose every norm is a :class:`SpecRMSNorm`.

The block is the two lines of every pre-norm decoder::

    h   = x + attention(attention_norm(x))
    out = h + feed_forward(ffn_norm(h))

with grouped-query attention (rotary position embeddings, causal mask), a gated
feed-forward (SwiGLU, or GeGLU for Gemma), optional RMSNorm of q and k over ``head_dim``
(Qwen3), and a stack of blocks between a token embedding and a final norm + output head.
:class:`ModelArgs` names the shape; the presets in ``models/*.toml`` are data for it.

The norms compute ``reference(spec, x, w)``, so the spec in the preset *is* the model's
numerics: there is no second RMSNorm formula here.

``Transformer.forward_cached`` is the same stack with a key/value cache (the ``--kv-cache``
export, ``decoder/kv_model.py``): explicit positions (left padding), past keys and values
concatenated before attention, and a mask from the attention mask and causality. A query
whose every key is padding (a padded slot of a left-padded prompt) still sees itself, so no
row of the softmax is empty; those positions' outputs are never used.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from rmsnorm_deploy.contract.dtypes import torch_dtype
from rmsnorm_deploy.contract.reference import SpecRMSNorm
from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.resources import check_memory

Activation = Literal["silu", "gelu_tanh"]
ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_tanh")


class ModelArgsError(UserError):
    """Model arguments that do not describe a buildable model."""


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """The shape of a pre-norm decoder (gpt-fast's ``ModelArgs`` in spirit)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    intermediate_size: int
    n_kv_heads: int | None = None  # None: as many as n_heads (no grouping)
    head_dim: int | None = None  # None: dim // n_heads
    norm: RMSNormSpec = dataclasses.field(default_factory=lambda: RMSNormSpec.llama(1e-5))
    qk_norm: bool = False  # RMSNorm of q and k over head_dim, before the rotary embedding (Qwen3)
    activation: Activation = "silu"
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    embedding_scale: bool = False  # multiply embeddings by sqrt(dim) (Gemma)
    tie_embeddings: bool = False  # output head shares the embedding matrix
    attention_bias: bool = False  # bias on the q, k, v projections (Qwen2)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "intermediate_size", "max_seq_len"):
            _positive_int(name, getattr(self, name))
        if self.n_kv_heads is not None:
            _positive_int("n_kv_heads", self.n_kv_heads)
            if self.n_heads % self.n_kv_heads:
                raise ModelArgsError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim is None and self.dim % self.n_heads:
            raise ModelArgsError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}; give head_dim")
        if self.head_dim is not None:
            _positive_int("head_dim", self.head_dim)
        if self.resolved_head_dim % 2:
            raise ModelArgsError(f"head_dim {self.resolved_head_dim} must be even for rotary embeddings")
        if self.activation not in ACTIVATIONS:
            raise ModelArgsError(f"unknown activation {self.activation!r}; choose one of {', '.join(ACTIVATIONS)}")
        if not isinstance(self.norm, RMSNormSpec):
            raise ModelArgsError(f"norm must be an RMSNormSpec, got {type(self.norm).__name__}")
        if self.norm.normalized_dims != 1:
            raise ModelArgsError("the norms of a pre-norm block normalize the last dim only: normalized_dims must be 1")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            raise ModelArgsError(f"rope_theta must be a positive number, got {self.rope_theta!r}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    def norm_count(self) -> int:
        """RMSNorms in the model: two per block (four with q/k norms) and the final one."""
        return self.n_layers * (4 if self.qk_norm else 2) + 1

    def parameter_count(self) -> int:
        """Parameters of the model these args build (tied weights counted once)."""
        hd, d = self.resolved_head_dim, self.dim
        attn = d * self.n_heads * hd + 2 * d * self.kv_heads * hd + self.n_heads * hd * d
        if self.attention_bias:
            attn += self.n_heads * hd + 2 * self.kv_heads * hd
        ffn = 3 * d * self.intermediate_size
        norms = 2 * d + (2 * hd if self.qk_norm else 0)
        if not self.norm.has_gain:
            norms = 0
        block = attn + ffn + norms
        embed = self.vocab_size * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        final = d if self.norm.has_gain else 0
        return self.n_layers * block + embed + head + final

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["norm"] = self.norm.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ModelArgsError(f"unknown model field(s) {unknown}; known fields: {sorted(names)}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                         and f.name not in data)
        if missing:
            raise ModelArgsError(f"missing model field(s) {missing}")
        fields = dict(data)
        if isinstance(fields.get("norm"), dict):
            fields["norm"] = RMSNormSpec.from_dict(fields["norm"])
        try:
            return cls(**fields)
        except TypeError as exc:
            raise ModelArgsError(f"bad model fields: {exc}") from None


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelArgsError(f"{name} must be an integer >= 1, got {value!r}")


# -- the model ------------------------------------------------------------------------
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_cos_sin(seq_len: int, head_dim: int, theta: float, dtype: torch.dtype, device: Any = None):
    """cos and sin of the rotary angles for positions ``0..seq_len-1``: computed in float32, then cast
    to the activation dtype (as HF Llama does), shaped ``[seq, head_dim]``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    positions = torch.arange(seq_len, dtype=torch.float32, device=device)
    freqs = positions[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotary_cos_sin_at(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos and sin of the rotary angles at ``positions`` ``[batch, seq]``, shaped ``[batch, 1, seq, head_dim]``
    (the numbers of :func:`rotary_cos_sin` at those positions)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def cached_attention_mask(attention_mask: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[batch, 1, seq, total]`` booleans: key ``j`` is visible to query ``i`` (at ``total - seq + i``)
    when it is not padding and not in the future; each query always sees itself."""
    total = attention_mask.shape[1]
    query = torch.arange(seq_len, device=attention_mask.device) + (total - seq_len)
    key = torch.arange(total, device=attention_mask.device)
    allowed = (key[None, :] <= query[:, None])[None] & attention_mask[:, None, :].bool()
    return (allowed | (key[None, :] == query[:, None])[None])[:, None]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: Any = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.resolved_head_dim
        self.rope_theta = float(args.rope_theta)
        kw = dict(dtype=dtype, device=device)
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=args.attention_bias, **kw)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=args.attention_bias, **kw)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=args.attention_bias, **kw)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False, **kw)
        if args.qk_norm:
            self.q_norm = SpecRMSNorm(args.norm, self.head_dim, dtype=dtype)
            self.k_norm = SpecRMSNorm(args.norm, self.head_dim, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None

    def _heads(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries, keys and values [batch, heads, seq, head_dim]: projected, q/k-normed, rotated."""
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q, k, v = self._heads(x, cos, sin)
        if self.n_kv_heads != self.n_heads:
            repeat = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(bsz, seqlen, self.n_heads * self.head_dim))

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past_k: torch.Tensor,
                       past_v: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`forward` after ``past_k``/``past_v``; returns the output and the presents."""
        bsz, seqlen, _ = x.shape
        q, k, v = self._heads(x, cos, sin)
        k, v = torch.cat((past_k, k), dim=2), torch.cat((past_v, v), dim=2)
        kr, vr = k, v
        if self.n_kv_heads != self.n_heads:
            repeat = self.n_heads // self.n_kv_heads
            kr, vr = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(bsz, seqlen, self.n_heads * self.head_dim)), k, v


class FeedForward(nn.Module):
    """``w2(act(w1(x)) * w3(x))``: SwiGLU with silu, GeGLU with gelu_tanh."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: Any = None):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.w1 = nn.Linear(args.dim, args.intermediate_size, **kw)
        self.w3 = nn.Linear(args.dim, args.intermediate_size, **kw)
        self.w2 = nn.Linear(args.intermediate_size, args.dim, **kw)
        self.activation = args.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x)
        gate = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.w2(gate * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: Any = None):
        super().__init__()
        self.attention_norm = SpecRMSNorm(args.norm, args.dim, dtype=dtype)
        self.attention = Attention(args, dtype, device)
        self.ffn_norm = SpecRMSNorm(args.norm, args.dim, dtype=dtype)
        self.feed_forward = FeedForward(args, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past_k: torch.Tensor,
                       past_v: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, k, v = self.attention.forward_cached(self.attention_norm(x), cos, sin, past_k, past_v, mask)
        h = x + a
        return h + self.feed_forward(self.ffn_norm(h)), k, v


class Transformer(nn.Module):
    """Token ids ``[batch, seq]`` to logits ``[batch, seq, vocab]`` through ``n_layers`` pre-norm blocks."""

    def __init__(self, args: ModelArgs, dtype: Any = torch.float32, device: Any = None):
        super().__init__()

        dtype = torch_dtype(dtype)
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, dtype=dtype, device=device)
        self.layers = nn.ModuleList(TransformerBlock(args, dtype, device) for _ in range(args.n_layers))
        self.norm = SpecRMSNorm(args.norm, args.dim, dtype=dtype)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False, dtype=dtype, device=device)
        self.tie_weights()

    def tie_weights(self) -> None:
        """With ``tie_embeddings``, the output head's weight *is* the embedding matrix (one Parameter)."""
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(input_ids)
        if self.args.embedding_scale:
            h = h * torch.tensor(math.sqrt(self.args.dim), dtype=h.dtype)
        cos, sin = rotary_cos_sin(input_ids.shape[1], self.args.resolved_head_dim, self.args.rope_theta, h.dtype, h.device)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    def forward_cached(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                       past: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits and the presents (``[k0, v0, k1, v1, ...]``) after ``past`` (see the module docstring)."""
        h = self.tok_embeddings(input_ids)
        if self.args.embedding_scale:
            h = h * torch.tensor(math.sqrt(self.args.dim), dtype=h.dtype)
        cos, sin = rotary_cos_sin_at(position_ids, self.args.resolved_head_dim, self.args.rope_theta, h.dtype)
        mask = cached_attention_mask(attention_mask, input_ids.shape[1])
        presents: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            h, k, v = layer.forward_cached(h, cos, sin, past[2 * i], past[2 * i + 1], mask)
            presents += [k, v]
        return self.output(self.norm(h)), presents


def build_model(args: ModelArgs, dtype: Any = "float32", *, seed: int = 0) -> Transformer:
    """The model of ``args`` in ``dtype`` with seeded random weights (see :func:`init_weights`).

    Built on the meta device and materialized once in ``dtype``, so a 1B-parameter model never
    holds a float32 copy or a default initialization it would overwrite.
    """

    with torch.device("meta"):
        model = Transformer(args, dtype)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    check_memory(nbytes, f"a model of {sum(p.numel() for p in model.parameters()):,} parameters in {dtype}",
                 "choose a smaller model or a machine with more memory")
    model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives each module its own tensor
    init_weights(model, seed=seed)
    return model.eval()


#: Elements drawn per step: bounds the float32 scratch a large weight needs while it is filled.
_INIT_CHUNK = 1 << 22


@torch.no_grad()
def init_weights(model: nn.Module, *, seed: int = 0, std: float = 0.02) -> None:
    """Seeded random weights, the same numbers in every dtype (drawn in float32, then rounded).

    Projections and embeddings ~ N(0, std^2); norm gains ~ 1 + N(0, 0.1^2) (``weight``) or
    N(0, 0.1^2) (``offset``), so that rounding order and the gain are exercised rather than
    multiplied by exactly one; biases ~ N(0, std^2). Each parameter draws from its own
    generator seeded from ``seed`` and its position, so filling one does not shift another.
    """
    for index, (name, param) in enumerate(model.named_parameters()):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        if isinstance(owner, SpecRMSNorm):
            center, scale = (1.0 if owner.spec.gain == "weight" else 0.0), 0.1
        else:
            center, scale = 0.0, std
        flat = param.view(-1)
        for start in range(0, flat.numel(), _INIT_CHUNK):
            stop = min(start + _INIT_CHUNK, flat.numel())
            chunk = torch.randn(stop - start, generator=gen, dtype=torch.float32) * scale + center
            flat[start:stop].copy_(chunk)
