"""Prompt KV kept across requests: a request whose prompt starts with tokens the engine has already
computed prefills only the rest.

Two places hold computed KV (``serving.engine.slots.SlotBatch`` uses both):

- the slots themselves, as llama-server's ``cache_prompt`` does: a slot that a stream leaves keeps
  the KV of the tokens it fed (prompt and generated), and a newcomer goes to the free slot whose
  tokens share the longest prefix with its prompt (a chat's next turn finds its conversation);
- :class:`PrefixStore`, an LRU of copied prefixes within ``--prefix-cache-mb``: before a slot's
  tokens are overwritten by an unrelated prompt they are copied here, and a later prompt that
  starts with them has them copied back into its slot.

Why not vLLM's block hashes: its KV cache is paged (a block table per sequence), so a hashed
16-token block can be shared by many sequences in place. ``GroupQueryAttention`` here reads each
row's keys from one contiguous [kv_heads, slot_length, head_dim] region (valid keys first), so a
prefix can be reused only by leaving it where it is (slot reuse) or copying it into a row (the
store). Both are exact: the key and value at position ``i`` depend only on tokens ``0..i``, and
ONNX Runtime's CPU kernels compute each row and position alike whatever was batched or chunked
with it (``serving.engine.slots``), so a prefix's KV is the KV a cold prefill would write; the tests hold
the tokens to a cold run.

At least the prompt's last token is always prefilled: its logits pick the first new token.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import numpy as np

__all__ = ["PrefixStore", "common_prefix"]


def common_prefix(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """The number of leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(differ[0]) if differ.size else n


@dataclasses.dataclass
class _Entry:
    tokens: np.ndarray  # int64 [n]
    arrays: list[np.ndarray]  # per past/present pair: [kv_heads, n, head_dim] (copies)
    nbytes: int


class PrefixStore:
    """An LRU of token prefixes and copies of their KV, at most ``budget_bytes`` in all (0: off)."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = max(0, int(budget_bytes))
        self.entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()  # oldest first
        self.nbytes = 0
        self._keys = iter(range(1 << 62))

    def longest(self, prompt: Sequence[int]) -> tuple[int, int | None]:
        """``(tokens shared, entry key)`` of the entry sharing the longest prefix with ``prompt``."""
        best, key = 0, None
        for k, entry in self.entries.items():
            n = common_prefix(entry.tokens, prompt)
            if n > best:
                best, key = n, k
        return best, key

    def copy_into(self, key: int, n: int, rows: list[np.ndarray]) -> None:
        """Copy the first ``n`` positions of entry ``key`` into ``rows`` (one [kv_heads, L, head_dim]
        view per pair) and mark it recently used."""
        entry = self.entries[key]
        self.entries.move_to_end(key)
        for row, saved in zip(rows, entry.arrays):
            row[:, :n, :] = saved[:, :n, :]

    def put(self, tokens: Sequence[int], rows: list[np.ndarray]) -> bool:
        """Keep a copy of ``rows[:, :len(tokens)]`` for ``tokens``, evicting the least recently used
        entries to stay within the budget; a prefix already covered by an entry only refreshes it,
        and entries that are prefixes of ``tokens`` go. False when it does not fit at all."""
        n = len(tokens)
        nbytes = sum(row[:, :n, :].nbytes for row in rows)
        if n == 0 or nbytes > self.budget_bytes:
            return False
        tokens = np.asarray(tokens, np.int64)
        for k, entry in list(self.entries.items()):
            shared = common_prefix(entry.tokens, tokens)
            if shared == n:  # already kept (as this or a longer prefix)
                self.entries.move_to_end(k)
                return True
            if shared == len(entry.tokens):  # a shorter prefix of this one: redundant now
                self._drop(k)
        while self.entries and self.nbytes + nbytes > self.budget_bytes:
            self._drop(next(iter(self.entries)))
        arrays = [row[:, :n, :].copy() for row in rows]
        self.entries[next(self._keys)] = _Entry(tokens, arrays, nbytes)
        self.nbytes += nbytes
        return True

    def _drop(self, key: int) -> None:
        self.nbytes -= self.entries.pop(key).nbytes
