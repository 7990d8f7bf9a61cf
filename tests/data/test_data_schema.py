import json
import re

import pytest

from megatron_dapo.data import Example
from megatron_dapo.data import PromptDataset
from megatron_dapo.data import load_examples
from megatron_dapo.data import write_rows


def _row(q="What is 1 + 1?", gt="2", **over):
    row = {
        "data_source": "test",
        "prompt": [{"role": "user", "content": q}],
        "ability": "math",
        "reward_model": {"ground_truth": gt, "style": "rule"},
        "extra_info": {"index": 7},
    }
    row.update(over)
    return row


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"prompt": []}, "field 'prompt' must be a non-empty list of {role, content} messages"),
        ({"prompt": "hi"}, "field 'prompt' must be a non-empty list"),
        ({"prompt": [{"role": "user"}]}, "field 'prompt'.*message 0 is not a"),
        ({"prompt": [{"role": "bot", "content": "x"}]}, "field 'prompt'.*role 'bot'"),
        ({"prompt": [{"role": "user", "content": "  "}]}, "field 'prompt'.*empty or non-string"),
        (
            {"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            "field 'prompt'.*last message",
        ),
        ({"reward_model": "2"}, "field 'reward_model' must be a dict"),
        ({"reward_model": {"style": "rule"}}, "field 'reward_model.ground_truth' is missing"),
        ({"reward_model": {"ground_truth": ""}}, "field 'reward_model.ground_truth' must be a non-empty string"),
        ({"reward_model": {"ground_truth": 1.5}}, "field 'reward_model.ground_truth'"),
        ({"reward_model": {"ground_truth": "2", "style": 3}}, "field 'reward_model.style'"),
        ({"data_source": ""}, "field 'data_source' must be a non-empty string"),
        ({"extra_info": [1]}, "field 'extra_info' must be a dict"),
    ],
)
def test_bad_row_names_file_row_and_field(tmp_path, bad, field):
    path = _write_jsonl(tmp_path / "train.jsonl", [_row(), _row(), _row(**bad)])
    with pytest.raises(ValueError, match=rf"^{re.escape(path)} row 2 \(line 3\): {field}") as e:
        load_examples(path)
    assert "\n" not in str(e.value)


def test_missing_required_field_and_non_object(tmp_path):
    row = _row()
    del row["reward_model"]
    path = _write_jsonl(tmp_path / "a.jsonl", [row])
    with pytest.raises(ValueError, match=r"a.jsonl row 0 \(line 1\): field 'reward_model' is missing"):
        load_examples(path)
    path = _write_jsonl(tmp_path / "b.jsonl", [[1, 2]])
    with pytest.raises(ValueError, match=r"b.jsonl row 0 \(line 1\): row must be a JSON object"):
        load_examples(path)
    row = _row()
    del row["prompt"]
    path = _write_jsonl(tmp_path / "c.jsonl", [row])
    with pytest.raises(ValueError, match=r"row 0 \(line 1\): field 'prompt' is missing"):
        load_examples(path)


def test_parquet_error_names_row(tmp_path):
    path = write_rows([_row(), _row(), _row(), _row(data_source="")], tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=rf"^{re.escape(path)} row 3: field 'data_source'"):
        load_examples(path)


def test_invalid_json_names_line_blank_lines_skipped(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(_row()) + "\n\n" + json.dumps(_row()) + "\n{not json\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(p))} line 4: invalid JSON"):
        load_examples(str(p))
    p.write_text(json.dumps(_row()) + "\n\n" + json.dumps(_row(data_source=None)) + "\n")
    with pytest.raises(ValueError, match=r"row 1 \(line 3\): field 'data_source'"):
        load_examples(str(p))


def test_missing_file_empty_file_and_extension(tmp_path):
    with pytest.raises(FileNotFoundError, match="data file not found: .*nope.jsonl"):
        PromptDataset(str(tmp_path / "nope.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no rows found"):
        load_examples(str(tmp_path / "empty.jsonl"))
    with pytest.raises(ValueError, match="unknown data file extension"):
        load_examples(str(tmp_path / "x.csv"))
    with pytest.raises(ValueError, match="no data files"):
        load_examples([])


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_round_trip(tmp_path, fmt):
    rows = [
        _row("Q0", "12"),
        _row("Q1", "-3"),
        _row(
            "Q2",
            "7",
            prompt=[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Q2 \u00e9"}],
            extra_info={"index": 9},
        ),
    ]
    path = write_rows(rows, tmp_path / f"d.{fmt}")
    ds = PromptDataset([path, path])
    assert len(ds) == 6
    assert ds[2] == Example(
        prompt_messages=[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Q2 \u00e9"}],
        ground_truth="7",
        data_source="test",
        index=2,
        extra_info={"index": 9},
    )
    assert [e.index for e in ds] == list(range(6))
    assert [e.ground_truth for e in ds] == ["12", "-3", "7"] * 2
    assert ds[4].prompt_messages == [{"role": "user", "content": "Q1"}]


def test_int_ground_truth_and_prompt_key(tmp_path):
    row = _row(gt=5)
    row["question"] = row.pop("prompt")
    path = _write_jsonl(tmp_path / "t.jsonl", [row])
    with pytest.raises(ValueError, match="field 'prompt' is missing"):
        load_examples(path)
    (ex,) = load_examples(path, prompt_key="question")
    assert ex.ground_truth == "5" and ex.extra_info == {"index": 7}
