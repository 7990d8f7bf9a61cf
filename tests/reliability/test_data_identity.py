"""Resuming on training data whose content changed (issue 20): before, only a changed row count was seen
(`num_examples=65 but this iterator has 64`); an edited row resumed silently, the iterator's (epoch, position) then
pointing into other prompts. Now the iterator's state records the data's identity (megatron_dapo/data/identity.py)
and a resume on other content is a one-line start-up error naming the file; an older checkpoint without the
identity still loads, checked by row count, with a notice.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from megatron_dapo.checkpoint import CheckpointManager
from megatron_dapo.config import load_config
from megatron_dapo.data import PromptDataset
from megatron_dapo.data import PromptIterator
from megatron_dapo.data import write_rows
from megatron_dapo.dev.tiny import make_tiny_run
from megatron_dapo.dev.tiny import make_tiny_tokenizer
from megatron_dapo.inputs import RunInputs
from megatron_dapo.inputs import agree_at_startup
from megatron_dapo.launch import StartupError
from megatron_dapo.resume import Resume
from megatron_dapo.resume import trainer_state
from megatron_dapo.rollout.exchange import RolloutExchange

ROOT = Path(__file__).resolve().parents[2]
WAY_OUT = "use a new trainer.run_dir or checkpoint.resume=never"


def _row(question: str, truth: str = "2") -> dict:
    return {
        "prompt": [{"role": "user", "content": question}],
        "reward_model": {"ground_truth": truth},
        "data_source": "t",
    }


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _rows(n: int = 6) -> list[dict]:
    return [_row(f"{i}+1=?", str(i + 1)) for i in range(n)]


def _saved_state(files: list[str], **kw) -> dict:
    data = PromptDataset(files, **kw)
    it = PromptIterator(data.examples, seed=1, identity=data.identity)
    it.next_batch(4)
    return it.state_dict()


def _iterator(files: list[str], **kw) -> PromptIterator:
    data = PromptDataset(files, **kw)
    return PromptIterator(data.examples, seed=1, identity=data.identity)


# ------------------------------------------------------------------------------------------------ iterator level
def test_same_content_resumes_whatever_the_file_format(tmp_path):
    state = _saved_state([_write(tmp_path / "a.jsonl", _rows())])
    assert set(state["identity"]) == {"sha256", "num_examples", "files"}
    again = _iterator([_write(tmp_path / "a.jsonl", _rows())])
    again.load_state_dict(state)
    assert (again.epoch, again.position) == (0, 4)
    # Only content counts: the same rows as parquet (or with other keys, or another path) have the same identity.
    parquet = PromptDataset([write_rows([{**r, "ability": "MATH"} for r in _rows()], tmp_path / "a.parquet")])
    assert parquet.identity["sha256"] == state["identity"]["sha256"]
    assert parquet.identity["files"][0]["sha256"] == state["identity"]["files"][0]["sha256"]


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda rows: rows[:5], "a.jsonl has 5 rows, 6 when the checkpoint was saved"),
        (lambda rows: rows + [_row("9+9=?", "18")], "a.jsonl has 7 rows, 6 when the checkpoint was saved"),
        (lambda rows: rows[:2] + [_row("2+1=?", "4")] + rows[3:], "a.jsonl: the content of its 6 rows changed"),
        (lambda rows: rows[:2] + [_row("7+1=?", "3")] + rows[3:], "a.jsonl: the content of its 6 rows changed"),
        (lambda rows: [rows[1], rows[0], *rows[2:]], "a.jsonl: the content of its 6 rows changed"),
    ],
    ids=["row_removed", "row_added", "ground_truth_edited", "prompt_edited", "rows_swapped"],
)
def test_changed_content_is_refused_naming_the_file(tmp_path, edit, expected):
    path = tmp_path / "a.jsonl"
    state = _saved_state([_write(path, _rows())])
    it = _iterator([_write(path, edit(_rows()))])
    with pytest.raises(ValueError) as err:
        it.load_state_dict(state)
    message = str(err.value)
    assert message.startswith("data iterator state: cannot resume, the training data changed (")
    assert expected in message and message.endswith(WAY_OUT) and "\n" not in message
    assert (it.epoch, it.position) == (0, 0)  # nothing restored


def test_only_the_changed_file_is_named(tmp_path):
    a, b = _write(tmp_path / "a.jsonl", _rows()), _write(tmp_path / "b.jsonl", _rows(3))
    state = _saved_state([a, b])
    _write(tmp_path / "b.jsonl", [_row("0+1=?", "5"), *_rows(3)[1:]])
    with pytest.raises(ValueError) as err:
        _iterator([a, b]).load_state_dict(state)
    assert "b.jsonl: the content of its 3 rows changed" in str(err.value) and "a.jsonl" not in str(err.value)


def test_length_filter_keeping_other_rows_is_named(tmp_path):
    tok = make_tiny_tokenizer(tmp_path / "tok")
    rows = _rows(5) + [_row("1+" * 30 + "1=?")]
    path = _write(tmp_path / "a.jsonl", rows)
    kw = {"tokenizer": tok, "filter_overlong": True, "log": lambda _line: None}
    state = _saved_state([path], max_prompt_length=200, **kw)
    with pytest.raises(ValueError, match=r"the length filter and duplicate removal kept 5 prompts, 6 when"):
        _iterator([path], max_prompt_length=40, **kw).load_state_dict(state)


def test_state_without_identity_loads_with_a_notice(tmp_path):
    path = _write(tmp_path / "a.jsonl", _rows())
    old = {k: v for k, v in _saved_state([path]).items() if k != "identity"}  # saved by an older version
    it = _iterator([path])
    lines: list[str] = []
    it.check_state(old, where="ckpt", log=lines.append)
    it.load_state_dict(old)
    assert (it.epoch, it.position) == (0, 4)
    assert lines == ["ckpt has no fingerprint of its training data (an older version): checking its row count only"]
    with pytest.raises(ValueError, match=rf"has num_examples=6 but this iterator has 5; {WAY_OUT}"):
        _iterator([_write(tmp_path / "short.jsonl", _rows(5))]).load_state_dict(old)
    # An iterator without identity (plain sequences) checks what it can and ignores a saved identity.
    plain = PromptIterator(list(range(6)), seed=1)
    plain.load_state_dict(_saved_state([path]))
    assert "identity" not in plain.state_dict()


# ------------------------------------------------------------------------------------------------ trainer level
class Startup:
    """The trainer's start-up on one rank from its public parts (RunInputs, Resume and the checkpoint manager, in
    agree_at_startup as the trainer runs them), with no process group, actor or engine."""

    def __init__(self, config, ckpt: CheckpointManager | None = None) -> None:
        self.config, self.step = config, 0
        self.exchange = RolloutExchange(1, timeout_s=60)
        self.ckpt = ckpt or CheckpointManager(Path(config.trainer.run_dir) / "checkpoints", 2, log=_notice)
        self.resume = Resume(self.ckpt, config, 0, 1, _notice)
        self.inputs = agree_at_startup(self.exchange, lambda: RunInputs(config, _notice))

    def find(self):
        """The checkpoint to resume from, as the trainer's start-up decides it (StartupError: one line)."""
        return agree_at_startup(self.exchange, lambda: self.resume.find(self.inputs))

    def trainer_state(self) -> dict:
        data, architecture = self.inputs.train_data.state_dict(), self.inputs.architecture
        return trainer_state(self.step, data, [], None, architecture, run_updates=self.step)


def _notice(line: str) -> None:
    print(f"[megatron_dapo] {line}", file=sys.stderr, flush=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_run(tmp_path_factory.mktemp("tiny_identity"), num_train=8, num_test=2)


def tiny_config(tiny, run_dir, *overrides: str):
    return load_config(
        ROOT / "examples" / "tiny_cpu.yaml",
        [
            f"--actor.model_path={tiny['model']}",
            f"--data.train_files={tiny['train']}",
            f"--data.eval_files={tiny['test']}",
            f"--trainer.run_dir={run_dir}",
            *overrides,
        ],
    )


def test_resume_on_edited_data_is_a_one_line_startup_error(tiny, tmp_path, capsys):
    train = Path(tiny["train"])
    original = train.read_text()
    config = tiny_config(tiny, tmp_path / "run")
    first = Startup(config)
    first.inputs.train_data.skip(3)
    first.step = 1
    saved = first.ckpt.save(1, first.trainer_state(), config.to_dict(), lambda d: d.mkdir())

    assert Startup(config).find() == saved

    rows = [json.loads(line) for line in original.splitlines()]
    rows[5]["reward_model"]["ground_truth"] = "99"
    try:
        _write(train, rows)
        edited = Startup(config)
        with pytest.raises(StartupError) as err:
            edited.find()
    finally:
        train.write_text(original)
    assert str(err.value) == (
        f"{saved}: cannot resume, the training data changed ({train}: the content of its 8 rows changed); {WAY_OUT}"
    )

    # A checkpoint of an older version (no identity in its data state) resumes, with a notice.
    old = Startup(tiny_config(tiny, tmp_path / "old"))
    old.step = 1
    state = old.trainer_state()
    del state["data"]["identity"]
    path = old.ckpt.save(1, state, old.config.to_dict(), lambda d: d.mkdir())
    capsys.readouterr()
    assert old.find() == path
    assert "has no fingerprint of its training data (an older version)" in capsys.readouterr().err
