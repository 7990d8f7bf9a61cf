"""Prompt data: DAPO-Math-17k style files, reasoning-gym generators and prompt templates. See README.md."""

from megatron_dapo.data.dataset import Example
from megatron_dapo.data.dataset import load_examples
from megatron_dapo.data.files import iter_rows
from megatron_dapo.data.files import write_rows
from megatron_dapo.data.generate import make_dataset
from megatron_dapo.data.iterator import PromptIterator
from megatron_dapo.data.prompts import PromptDataset
from megatron_dapo.data.reasoning_gym_tasks import SUPPORTED_TASKS
from megatron_dapo.data.reasoning_gym_tasks import generate_items
from megatron_dapo.data.templates import DAPO_TEMPLATE
from megatron_dapo.data.templates import TEMPLATES
from megatron_dapo.data.templates import render_prompt

__all__ = [
    "DAPO_TEMPLATE",
    "SUPPORTED_TASKS",
    "TEMPLATES",
    "Example",
    "PromptDataset",
    "PromptIterator",
    "generate_items",
    "iter_rows",
    "load_examples",
    "make_dataset",
    "render_prompt",
    "write_rows",
]
