import hashlib
import importlib.util
import json
import os
import re
from pathlib import Path

import pytest

from megatron_dapo.data import PromptDataset
from megatron_dapo.data import generate_items
from megatron_dapo.data import make_dataset
from megatron_dapo.data.reasoning_gym_tasks import task_config_fields
from megatron_dapo.data.reasoning_gym_tasks import validate_task_kwargs

TINY_CHAIN = {"min_terms": 2, "max_terms": 2, "max_digits": 1}  # 200 distinct questions in all
TOOL = Path(__file__).resolve().parents[2] / "tools" / "data" / "make_dataset.py"


def _digests(out_dir):
    return {p: hashlib.sha256((Path(out_dir) / p).read_bytes()).hexdigest() for p in sorted(os.listdir(out_dir))}


def _questions(path):
    return [e.extra_info["question"] for e in PromptDataset(path)]


def test_integer_only_filter():
    import reasoning_gym

    raw = reasoning_gym.create_dataset("gsm_symbolic", size=1500, seed=0)
    decimal = [i for i in range(1500) if not re.fullmatch(r"-?\d+", raw[i]["answer"])]
    assert decimal, "expected reasoning-gym to produce some decimal gsm_symbolic answers in 1500 draws"
    stop = decimal[0] + 2
    items = generate_items("gsm_symbolic", stop - 1, seed=0)
    assert all(re.fullmatch(r"-?\d+", it.answer) for it in items)
    assert decimal[0] not in {it.source_index for it in items}
    assert raw[decimal[0]]["question"] not in {it.question for it in items}
    assert items[-1].source_index >= stop - 1  # the decimal item was skipped, a later one taken instead


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_same_seed_byte_identical_files(tmp_path, fmt):
    kw = dict(num_train=30, num_test=10, formats=[fmt], task_kwargs={"max_terms": 3})
    make_dataset("basic_arithmetic", out_dir=tmp_path / "a", seed=4, **kw)
    make_dataset("basic_arithmetic", out_dir=tmp_path / "b", seed=4, **kw)
    make_dataset("basic_arithmetic", out_dir=tmp_path / "c", seed=5, **kw)
    a, b, c = (_digests(tmp_path / d) for d in "abc")
    assert set(a) == {f"train.{fmt}", f"test.{fmt}", "manifest.json"}
    assert a == b
    assert a[f"train.{fmt}"] != c[f"train.{fmt}"]


def test_jsonl_and_parquet_hold_the_same_examples(tmp_path):
    paths = make_dataset("chain_sum", num_train=20, num_test=5, out_dir=tmp_path, formats=["jsonl", "parquet"])
    for split in ("train", "test"):
        jsonl, parquet = paths[split]
        assert PromptDataset(jsonl).examples == PromptDataset(parquet).examples
    ex = PromptDataset(paths["train"][0])[0]
    assert ex.data_source == "reasoning_gym/chain_sum"
    assert ex.prompt_messages[-1]["content"].startswith("Solve the following math problem step by step.")
    assert ex.extra_info["question"] in ex.prompt_messages[-1]["content"]


def test_held_out_split_is_disjoint_in_a_small_problem_space(tmp_path):
    # 150 of the 200 possible questions: nearby draws repeat questions, so the dedupe must do real work.
    paths = make_dataset("chain_sum", num_train=110, num_test=40, seed=0, out_dir=tmp_path, task_kwargs=TINY_CHAIN)
    train, test = _questions(paths["train"][0]), _questions(paths["test"][0])
    assert len(train) == 110 and len(test) == 40
    assert len(set(train)) == 110 and len(set(test)) == 40
    assert not set(train) & set(test)
    undeduped = generate_items("chain_sum", 110, seed=0, task_kwargs=TINY_CHAIN)
    assert {it.question for it in undeduped} & set(test), "the exclusion was never exercised"
    with pytest.raises(ValueError, match=r"only \d+ new integer-answer questions"):
        make_dataset("chain_sum", num_train=180, num_test=40, out_dir=tmp_path / "x", task_kwargs=TINY_CHAIN)


def test_few_shot_examples_come_from_another_seed(tmp_path):
    paths = make_dataset(
        "chain_sum",
        num_train=60,
        num_test=20,
        out_dir=tmp_path,
        template="few_shot",
        num_shots=2,
        task_kwargs=TINY_CHAIN,
    )
    manifest = json.loads(Path(paths["manifest"][0]).read_text())
    shot_q = set(manifest["shot_questions"])
    assert len(shot_q) == 2
    train, test = _questions(paths["train"][0]), _questions(paths["test"][0])
    assert not shot_q & (set(train) | set(test))
    ex = PromptDataset(paths["test"][0])[0]
    assert [m["role"] for m in ex.prompt_messages] == ["user", "assistant", "user", "assistant", "user"]
    assert re.search(r"\nAnswer: -?\d+$", ex.prompt_messages[1]["content"])


def test_task_kwargs_are_checked_and_passed_through():
    fields = task_config_fields("basic_arithmetic")
    assert {"min_terms", "max_terms", "min_digits", "max_digits", "operators"} <= set(fields)
    assert {"min_terms", "max_terms", "min_digits", "max_digits"} <= set(task_config_fields("chain_sum"))
    with pytest.raises(ValueError, match=r"unknown chain_sum kwargs \['max_term'\]; valid: .*max_terms"):
        validate_task_kwargs("chain_sum", {"max_term": 2})
    with pytest.raises(ValueError, match="set by the generator"):
        validate_task_kwargs("chain_sum", {"seed": 2})
    with pytest.raises(ValueError, match="max_terms must be >= min_terms"):
        validate_task_kwargs("chain_sum", {"min_terms": 3, "max_terms": 2})
    with pytest.raises(ValueError, match="unknown task"):
        validate_task_kwargs("gsm8k", {})
    items = generate_items(
        "basic_arithmetic", 40, seed=0, task_kwargs={"operators": ["+"], "max_terms": 2, "allow_negation": False}
    )
    assert all("+" in it.question and not re.search(r"[*/]|\d\s*-", it.question) for it in items)
    chain = generate_items("chain_sum", 40, seed=0, task_kwargs={"max_digits": 1, "min_terms": 3, "max_terms": 3})
    assert all(len(re.findall(r"\d+", it.question)) == 3 for it in chain)
    assert all(len(n) == 1 for it in chain for n in re.findall(r"\d+", it.question))


def _load_tool():
    spec = importlib.util.spec_from_file_location("make_dataset_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli(tmp_path, capsys):
    tool = _load_tool()
    argv = ["--task", "chain_sum", "--num-train", "8", "--num-test", "4", "--out", str(tmp_path), "--format", "both"]
    assert tool.main([*argv, "--task-kwargs", '{"max_terms": 3}']) == 0
    assert f"train: {tmp_path / 'train.parquet'}" in capsys.readouterr().out
    assert len(PromptDataset(str(tmp_path / "test.jsonl"))) == 4
    with pytest.raises(SystemExit, match="not valid JSON"):
        tool.main([*argv, "--task-kwargs", "{max_terms: 3}"])
    with pytest.raises(SystemExit, match="unknown chain_sum kwargs"):
        tool.main([*argv, "--task-kwargs", '{"terms": 3}'])
