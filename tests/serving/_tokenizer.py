"""A tiny byte-level BPE tokenizer with a chat template, written into a Hugging Face folder so that
an export carries it like a real model's (no hub: made here, the same every time).

Byte-level on purpose: a character of several UTF-8 bytes ("é", "日") is split across tokens, so
the OpenAI API's incremental text is tested where it can go wrong. The merges make a few words
single tokens (" the", " hello", " stop") so that text spans tokens of different lengths.
"""

from __future__ import annotations

import json
from pathlib import Path

from rmsnorm_deploy.serving.openai.choices import byte_chars

SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2: the tiny Llama's pad, bos and eos
#: a ChatML-like template: each message in <s>role\n...</s>, the assistant's turn opened at the end;
#: roles it does not know are refused through transformers' raise_exception
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('this template knows the roles system, user and assistant, not ' + m['role']) }}"
    "{% endif %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
_WORDS = [" the", " a", " to", " and", "in", "er", "on", " hello", " world", " stop", "END", "é", " café"]


def write_tokenizer(folder: Path, *, chat_template: bool = True) -> int:
    """``tokenizer.json`` and ``tokenizer_config.json`` in ``folder``; returns the vocabulary size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    chars = byte_chars()
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for b in range(256):
        vocab[chars[b]] = len(vocab)
    merges = []
    words = ["".join(chars[b] for b in text.encode()) for text in _WORDS]
    words.append("".join(chars[b] for b in "日".encode())[:2])  # two of the character's three bytes
    for word in words:
        current = word[0]
        for char in word[1:]:
            if current + char not in vocab:
                merges.append((current, char))
                vocab[current + char] = len(vocab)
            current += char
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "pad_token": "<pad>", "model_max_length": 4096}
    if chat_template:
        config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    return tokenizer.get_vocab_size()
