"""A byte-level tokenizer with ChatML markers and megatron_dapo.dev.tiny's chat template: any text round-trips, so
the environments can be tested on real text offline."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def byte_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers import decoders
    from tokenizers import models
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from megatron_dapo.dev.tiny import CHAT_TEMPLATE

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<pad>",
                                  additional_special_tokens=["<|im_start|>"])  # fmt: skip
    tok.chat_template = CHAT_TEMPLATE
    return tok
