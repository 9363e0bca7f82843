"""transformers' causal LM as the reference for KV-cache graphs: its forward with its own cache,
step by step, and its ``generate``.

:class:`TransformersStep` is the model as a step of the one decode loop
(``decoder.loop.decode_loop``), so transformers gets the same mask, positions
(``decoder.convention.position_ids_for``), token choice and timings as every graph it is compared
with. The cache is the one the model would make itself, ``DynamicCache(config=...)``, passed as
``cache=`` (transformers 5 deprecates ``past_key_values=`` with a warning).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rmsnorm_deploy.decoder.families import family_of
from rmsnorm_deploy.decoder.loop import Generation, decode_loop, forced, greedy
from rmsnorm_deploy.errors import InputError


class TransformersStep:
    """One forward of a transformers causal LM with its own cache: the decode loop's ``Step``."""

    def __init__(self, lm: Any):
        self.lm = lm
        family = family_of(lm.config)
        #: what ``generate`` does on its own and the loop does for it (``decode_steps``)
        self.recompute_past = family.recompute_past(lm.config) if family is not None else None

    def empty_cache(self, batch: int) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.lm.config)

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
            cache: Any) -> tuple[np.ndarray, Any]:
        """The last position's logits as float32 numpy (bfloat16 and float16 upcast exactly; a float64 run
        keeps float64)."""
        import torch

        device = next(self.lm.parameters()).device  # inputs go where the model is (a CUDA model too)
        with torch.no_grad():
            out = self.lm(input_ids=torch.from_numpy(input_ids).to(device),
                          attention_mask=torch.from_numpy(attention_mask).to(device),
                          position_ids=torch.from_numpy(position_ids).to(device), cache=cache, use_cache=True)
        logits = out.logits[:, -1, :]
        # .cpu() waits for the device: a step's time is its whole time
        return (logits if logits.dtype == torch.float64 else logits.float()).cpu().numpy(), out.cache


def transformers_steps(lm: Any, input_ids: np.ndarray, attention_mask: np.ndarray | None = None, *,
                       new_tokens: int | None = None, tokens: Any = None, keep_logits: bool = True) -> Generation:
    """Prefill, then one step per token of ``lm`` with its own cache: each step's last-position
    logits (``step_logits``) and the tokens. Greedy (argmax) for ``new_tokens`` steps, or fed
    ``tokens`` [batch, steps] (teacher forcing: the logits of step i come before token i, as a
    graph's loop that produced those tokens saw them). Left padding: zeros in ``attention_mask``."""
    if (new_tokens is None) == (tokens is None):
        raise InputError("give transformers_steps either new_tokens (greedy) or tokens (fed), not both or neither")
    if tokens is not None:
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 2 or tokens.shape[:1] != np.shape(input_ids)[:1] or tokens.shape[1] < 1:
            raise InputError(f"tokens must be [batch, steps >= 1] with the batch of input_ids "
                             f"{list(np.shape(input_ids))}, got shape {list(tokens.shape)}")
        new_tokens, pick = tokens.shape[1], forced(tokens)
    else:
        pick = greedy
    return decode_loop(TransformersStep(lm), input_ids, attention_mask, max_new_tokens=new_tokens, pick=pick,
                       keep_logits=keep_logits)


def transformers_generate(lm: Any, input_ids: np.ndarray, attention_mask: np.ndarray, *, max_new_tokens: int,
                          pad_token_id: int, stop_at_eos: bool = True) -> np.ndarray:
    """transformers' own greedy ``generate`` (its cache, and its end-of-sequence rule unless
    ``stop_at_eos`` is false: then every row runs all ``max_new_tokens``, as a benchmark loop does):
    the new tokens [batch, new], left padding in ``attention_mask``."""
    import torch

    # eos_token_id=None here overrides the model's generation config for this call only
    no_eos = {} if stop_at_eos else {"eos_token_id": None}
    with torch.no_grad():
        out = lm.generate(input_ids=torch.from_numpy(np.asarray(input_ids, dtype=np.int64)),
                          attention_mask=torch.from_numpy(np.asarray(attention_mask, dtype=np.int64)),
                          do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id, **no_eos)
    return out[:, np.shape(input_ids)[1]:].numpy()
