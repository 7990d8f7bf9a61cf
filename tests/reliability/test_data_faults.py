"""Data faults of issue 12, item 6, found when the data loads with a one-line error naming file and line:

- an over-long prompt: before, found only when sampled (step 11 of a probe run), and removing the row then broke
  resume (`num_examples=65 but this iterator has 64`); now an error at load naming file and row, or
  (data.filter_overlong_prompts) dropped at load, logged, so the iterator's size is fixed from step 0;
- non-UTF-8 bytes and deeply nested JSON: before, a bare traceback without file or line;
- (issue 20) a prompt that with rollout.max_response_length does not fit the model's max_position_embeddings: before,
  not checked at all; now the same error or filter at load, with the limit the positions leave, and a response
  length that leaves no room for any prompt is an error naming both fields.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_dapo.config import load_config
from megatron_dapo.data import PromptDataset
from megatron_dapo.data import PromptIterator
from megatron_dapo.data import iter_rows
from megatron_dapo.data.dataset import prompt_token_ids
from megatron_dapo.dev.tiny import make_tiny_tokenizer
from megatron_dapo.launch import StartupError
from tests.reliability.test_data_identity import Startup

ROOT = Path(__file__).resolve().parents[2]


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


def _longest(tokenizer) -> int:
    return len(prompt_token_ids(tokenizer, _row("1+" * 60 + "1=?")["prompt"]))


def test_prompt_and_response_over_the_model_positions_is_an_error_at_load(data_file, tokenizer):
    n = _longest(tokenizer)
    kw = {"tokenizer": tokenizer, "max_prompt_length": 1000, "max_positions": n + 9, "max_response_length": 10}
    with pytest.raises(ValueError) as err:
        PromptDataset([str(data_file)], **kw)
    assert str(err.value) == (
        f"{data_file} row 3 (line 4): prompt has {n} tokens with the chat template, more than {n - 1} tokens "
        f"(the model's max_position_embeddings={n + 9} minus rollout.max_response_length=10; "
        "data.max_prompt_length=1000) (set data.filter_overlong_prompts=true to drop such rows)"
    )
    # Exactly at the limit it fits; data.max_prompt_length stays the rule while it is the smaller one.
    assert PromptDataset([str(data_file)], **{**kw, "max_positions": n + 10}).longest_prompt == n
    with pytest.raises(ValueError, match=r"more than data.max_prompt_length=32 tokens \(set"):
        PromptDataset([str(data_file)], **{**kw, "max_prompt_length": 32})


def test_prompt_over_the_model_positions_filtered_at_load(data_file, tokenizer):
    lines: list[str] = []
    kw = {"tokenizer": tokenizer, "max_prompt_length": 1000, "max_positions": 40, "max_response_length": 10}
    ds = PromptDataset([str(data_file)], filter_overlong=True, log=lines.append, **kw)
    assert [ex.index for ex in ds] == [0, 1, 2, 4] and ds.longest_prompt + 10 <= 40
    assert lines == [
        "dropped 1 of 5 prompts longer than 30 tokens (the model's max_position_embeddings=40 minus "
        "rollout.max_response_length=10; data.max_prompt_length=1000) (data.filter_overlong_prompts; "
        f"first: {data_file} row 3 (line 4), {_longest(tokenizer)} tokens)"
    ]


@pytest.mark.parametrize("max_response_length", [64, 100])
def test_response_length_leaving_no_room_for_a_prompt_is_a_config_error(data_file, tokenizer, max_response_length):
    with pytest.raises(ValueError) as err:
        PromptDataset(
            [str(data_file)], tokenizer=tokenizer, max_prompt_length=32, max_positions=64,
            max_response_length=max_response_length, filter_overlong=True,
        )  # fmt: skip
    assert str(err.value) == (
        f"rollout.max_response_length={max_response_length} leaves no room for a prompt in the model's "
        "max_position_embeddings=64 (config.json of actor.model_path)"
    )


def _model_dir(path: Path, max_positions: int) -> str:
    """Tokenizer and config.json only: all the trainer's data loading reads of a model."""
    from transformers import LlamaConfig

    tok = make_tiny_tokenizer(path)
    LlamaConfig(vocab_size=len(tok), max_position_embeddings=max_positions).save_pretrained(path)
    return str(path)


def test_trainer_reads_the_model_positions_at_startup(data_file, tokenizer, tmp_path):
    n = _longest(tokenizer)

    def start(max_positions: int, *overrides: str):
        config = load_config(
            ROOT / "examples" / "tiny_cpu.yaml",
            [
                f"--actor.model_path={_model_dir(tmp_path / f'model{max_positions}', max_positions)}",
                f"--data.train_files=[{data_file}]",
                "--data.eval_files=[]",
                f"--trainer.run_dir={tmp_path / 'run'}",
                "--data.max_prompt_length=1000",
                "--rollout.max_response_length=12",
                "--data.drop_duplicates=false",  # the fixture repeats rows; this test counts what the length keeps
                *overrides,
            ],
        )
        return Startup(config).inputs

    assert start(n + 12).longest_prompt == n
    with pytest.raises(StartupError, match=rf"^{data_file} row 3 \(line 4\): prompt has {n} tokens .* more than "):
        start(n + 11)
    kept = start(n + 11, "--data.filter_overlong_prompts=true")
    assert len(kept.train_data) == 4 and kept.longest_prompt + 12 <= n + 11
    with pytest.raises(StartupError, match=r"^rollout.max_response_length=12 leaves no room .*=12 \(config.json"):
        start(12)
