"""PromptDataset: a run's training or evaluation files as validated, de-duplicated, length-checked examples, read
directly (dataset.py) or through the prompt cache (cache.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from megatron_dapo.data.cache import PromptCache
from megatron_dapo.data.dataset import Example
from megatron_dapo.data.dataset import PromptLimit
from megatron_dapo.data.dataset import _paths
from megatron_dapo.data.dataset import check_prompt_lengths
from megatron_dapo.data.dataset import read_examples
from megatron_dapo.data.files import check_data_file
from megatron_dapo.data.identity import data_identity

__all__ = ["PromptDataset"]


class PromptDataset:
    """Validated examples from jsonl/parquet files (DataConfig.train_files / eval_files), indexable by position.

    With a tokenizer and max_prompt_length, over-long prompts are found here, at load (see check_prompt_lengths);
    max_positions (the model's max_position_embeddings) with max_response_length lowers the limit (PromptLimit.of).
    drop_duplicates drops rows that repeat an earlier row's prompt and ground truth (read_examples). With cache_dir
    as well, the result comes from the prompt cache (cache.py: built once per dataset version, memory-mapped; the
    examples are then decoded on access and ``cache.prompt_ids`` reads their token ids). ``identity`` fingerprints the
    content for checkpoints (identity.py); the same data gives the same examples, identity and log lines either way.
    """

    def __init__(
        self,
        files: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        prompt_key: str = "prompt",
        tokenizer: Any = None,
        max_prompt_length: int | None = None,
        max_positions: int | None = None,
        max_response_length: int = 0,
        filter_overlong: bool = False,
        drop_duplicates: bool = False,
        cache_dir: str | os.PathLike | None = None,
        log: Callable[[str], None] = print,
    ):
        self.files = _paths(files)
        self.longest_prompt: int | None = None
        """Tokens of the longest prompt with the chat template (known when a tokenizer was given)."""
        self.cache: Any = None
        """The prompt cache entry the examples come from (cache.PromptCache), when cache_dir was given."""
        checked = tokenizer is not None and max_prompt_length is not None
        limit = PromptLimit.of(max_prompt_length, max_positions, max_response_length) if checked else None
        if limit is not None and cache_dir:
            for path in self.files:  # a missing file or an unknown extension: the same one line as without the cache
                check_data_file(path)
            self.cache = PromptCache.open(cache_dir, self.files, tokenizer, limit, prompt_key=prompt_key,
                                          filter_overlong=filter_overlong, drop_duplicates=drop_duplicates,
                                          log=log)  # fmt: skip
            for note in self.cache.notes:
                log(note)
            self.examples: Sequence[Example] = self.cache.examples
            self.longest_prompt, self.identity = self.cache.longest_prompt, self.cache.identity
            return
        read = read_examples(self.files, prompt_key, drop_duplicates)
        for note in read.notes:
            log(note)
        self.examples = read.examples
        if limit is not None:
            self.examples, self.longest_prompt = check_prompt_lengths(
                self.examples, tokenizer, limit, filter_overlong=filter_overlong, log=log
            )
        self.identity = data_identity(read.files, self.examples)
        """What a checkpoint records of this data (PromptIterator state); see identity.py."""

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Example:
        return self.examples[i]

    def __iter__(self):
        return iter(self.examples)
