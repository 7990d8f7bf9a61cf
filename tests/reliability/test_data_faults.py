"""Data faults of issue 12, item 6, found when the data loads with a one-line error naming file and line:

- an over-long prompt: before, found only when sampled (step 11 of a probe run), and removing the row then broke
  resume (`num_examples=65 but this iterator has 64`); now an error at load naming file and row, or
  (data.filter_overlong_prompts) dropped at load, logged, so the iterator's size is fixed from step 0;
- non-UTF-8 bytes and deeply nested JSON: before, a bare traceback without file or line.
"""

from __future__ import annotations

import json

import pytest

from megatron_dapo.data import PromptDataset
from megatron_dapo.data import PromptIterator
from megatron_dapo.data import iter_rows
from megatron_dapo.data.dataset import prompt_token_ids
from megatron_dapo.tiny import make_tiny_tokenizer


def _row(question: str) -> dict:
    return {
        "prompt": [{"role": "user", "content": question}],
        "reward_model": {"ground_truth": "1"},
        "data_source": "t",
    }


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def data_file(tmp_path):
    rows = [_row("1+1=?") for _ in range(5)]
    rows[3] = _row("1+" * 60 + "1=?")
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_overlong_prompt_is_an_error_at_load_naming_file_and_row(data_file, tokenizer):
    assert len(prompt_token_ids(tokenizer, _row("1+1=?")["prompt"])) < 32
    n = len(prompt_token_ids(tokenizer, _row("1+" * 60 + "1=?")["prompt"]))
    with pytest.raises(ValueError) as err:
        PromptDataset([str(data_file)], tokenizer=tokenizer, max_prompt_length=32)
    message = str(err.value)
    assert message.startswith(f"{data_file} row 3 (line 4): prompt has {n} tokens with the chat template, more than")
    assert "data.max_prompt_length=32" in message and "\n" not in message


def test_overlong_prompt_filtered_at_load_keeps_the_iterator_stable(data_file, tokenizer):
    n = len(prompt_token_ids(tokenizer, _row("1+" * 60 + "1=?")["prompt"]))
    lines: list[str] = []
    ds = PromptDataset(
        [str(data_file)], tokenizer=tokenizer, max_prompt_length=32, filter_overlong=True, log=lines.append
    )
    assert [ex.index for ex in ds] == [0, 1, 2, 4]
    assert len(lines) == 1 and "dropped 1 of 5 prompts" in lines[0] and f"row 3 (line 4), {n} tokens" in lines[0]
    # The iterator is built over the filtered data from the start: a checkpointed state reloads into a new run.
    it = PromptIterator(ds.examples, seed=3)
    it.next_batch(3)
    again = PromptIterator(
        PromptDataset(
            [str(data_file)], tokenizer=tokenizer, max_prompt_length=32, filter_overlong=True, log=print
        ).examples,
        seed=3,
    )
    again.load_state_dict(it.state_dict())
    assert [e.index for e in again.next_batch(4)] == [e.index for e in it.next_batch(4)]


def test_non_utf8_bytes_name_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(json.dumps(_row("ok")).encode() + b"\n" + b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 2: not valid UTF-8 \(byte 0xe9 at column 16\)$"):
        list(iter_rows(path))


def test_deeply_nested_json_names_file_and_line(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps(_row("ok")) + "\n\n" + "[" * 200_000 + "]" * 200_000 + "\n")
    with pytest.raises(ValueError, match=r"deep.jsonl line 3: JSON nested too deeply to be a data row$"):
        PromptDataset([str(path)])
