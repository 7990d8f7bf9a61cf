"""The run's user inputs, loaded once per process by both programs of a launch (the trainer and a split launch's
engine rank): the tokenizer, the prompt data (train and evaluation), the stop and pad ids, the model's architecture.

    RunInputs(config, log)      loads and checks them (a bad input is one ValueError / OSError naming the file, row
                                or field; the caller runs it inside `agree_at_startup` so every rank stops alike)
      .render(example)          prompt token ids (chat template applied)
      .fresh(offset)            (example index, ground truth, prompt ids) of the data's offset-th next prompt
    agree_at_startup(exchange, fn, release)   a start-up step on every rank; one StartupError on every rank when any
                                rank's step failed (so none is left waiting in a collective)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_dapo.actor.arch import is_moe
from megatron_dapo.checkpoint import CheckpointError
from megatron_dapo.config import RunConfig
from megatron_dapo.envs.base import prompt_record
from megatron_dapo.launch import StartupError
from megatron_dapo.resume import model_architecture


class RunInputs:
    """Tokenizer, prompt data and model facts of one run (see the module docstring).

    Attributes: tokenizer; architecture (resume.model_architecture of the model's config.json); moe; stop_ids (EOS);
    pad_id (the tokenizer's pad id, else EOS); train_data (PromptIterator over the training prompts); eval_examples
    (evaluation prompts, [] without data.eval_files); longest_prompt (tokens, over both sets).
    """

    def __init__(self, config: RunConfig, log: Callable[[str], None], hook: Callable[[str], None] | None = None):
        """config: the run's; log: one line for the user (data cache, dropped rows); hook: the trainer's testing hook
        (called with "fresh_prompt" before each fresh prompt is read)."""
        from transformers import AutoConfig
        from transformers import AutoTokenizer

        from megatron_dapo.data import PromptDataset
        from megatron_dapo.data import PromptIterator

        c = config
        self.hook = hook or (lambda point: None)
        self.tokenizer = AutoTokenizer.from_pretrained(c.actor.model_path)
        hf_config = AutoConfig.from_pretrained(c.actor.model_path)
        self.architecture = model_architecture(hf_config)
        self.moe = is_moe(hf_config)
        """A mixture-of-experts model (its checkpoints' expert layout: checkpoint.check_compatible)."""
        self.stop_ids = [self.tokenizer.eos_token_id]
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        prompts = prompt_settings(c, self.tokenizer, hf_config, log)
        train = PromptDataset(c.data.train_files, **prompts)
        self.train_data = PromptIterator(
            train.examples, seed=c.data.seed, shuffle=c.data.shuffle, identity=train.identity
        )
        evals = PromptDataset(c.data.eval_files, **prompts) if c.data.eval_files else None
        self.eval_examples = evals.examples if evals is not None else []
        self.longest_prompt = max(train.longest_prompt or 0, (evals.longest_prompt or 0) if evals else 0)
        self._train_by_index = {example.index: example for example in train.examples}
        self._prompt_ids: dict[int, list[int]] = {}
        self._cached_prompt_ids = train.cache.prompt_ids_of_index if train.cache is not None else None

    def render(self, example: Any) -> list[int]:
        """Prompt token ids (lengths were checked when the data loaded)."""
        from megatron_dapo.data.dataset import prompt_token_ids

        return prompt_token_ids(self.tokenizer, example.prompt_messages)

    def record(self, index: int) -> dict[str, Any]:
        """The training prompt of example `index` as an environment's episode starts from it (envs/base.py
        prompt_record: its messages, source, index and extra_info)."""
        return prompt_record(self._train_by_index[index])

    def fresh(self, offset: int) -> tuple[int, str, list[int]]:
        """(example index, ground truth, prompt ids) of the data's offset-th next prompt (a fresh queue position); the
        ids come from the prompt cache, or without it are kept by example index once rendered (indices are per
        dataset: evaluation ones are not here)."""
        self.hook("fresh_prompt")
        example = self.train_data.peek(offset)
        if self._cached_prompt_ids is not None:  # the prompt cache's mapped token ids
            return example.index, example.ground_truth, self._cached_prompt_ids(example.index)
        ids = self._prompt_ids.get(example.index)
        if ids is None:
            ids = self._prompt_ids[example.index] = self.render(example)
        return example.index, example.ground_truth, ids


def prompt_settings(config: RunConfig, tokenizer: Any, hf_config: Any, log: Callable[[str], None]) -> dict[str, Any]:
    """PromptDataset's keyword arguments for this run: the tokenizer and every length check (a prompt plus a full
    response must fit the model's positions, PromptLimit.of), de-duplication, the prompt cache. The trainer, the
    engine ranks and `megatron-dapo eval` read prompts with these."""
    c = config
    return {
        "tokenizer": tokenizer,
        "max_prompt_length": c.data.max_prompt_length,
        "max_positions": getattr(hf_config, "max_position_embeddings", None),
        "max_response_length": c.rollout.max_response_length,
        "filter_overlong": c.data.filter_overlong_prompts,
        "drop_duplicates": c.data.drop_duplicates,
        "cache_dir": c.data.cache_dir or None,
        "log": log,
    }


def agree_at_startup(exchange: Any, fn: Callable[[], Any], release: Callable[[], None] = lambda: None) -> Any:
    """Run a start-up step on every rank (collective over `exchange`, a RolloutExchange). A user error on any rank (a
    bad input, a held run-dir lock, no usable checkpoint: StartupError, CheckpointError, ValueError, OSError) becomes
    the same StartupError on every rank, after `release()` (the run-dir lock); returns fn()'s result otherwise."""
    error = None
    try:
        result = fn()
    except (StartupError, CheckpointError, ValueError, OSError) as err:
        error, result = str(err).splitlines()[0] if str(err) else type(err).__name__, None
    errors = [e for e in exchange.all_gather([error], "start-up") if e is not None]
    if errors:
        release()
        raise StartupError(errors[0])
    return result
