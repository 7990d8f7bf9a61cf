"""A torn last line of metrics.jsonl (a kill while a row was being written) no longer blocks resume (issue 12,
item 6): before, every resume died in json.loads; now the line is dropped and named. End to end in
test_run_faults.py."""

from __future__ import annotations

import json

from megatron_dapo.metrics import drop_unsaved_metrics
from megatron_dapo.metrics import metrics_row
from megatron_dapo.metrics import truncate_metrics


def test_torn_last_line_is_dropped_and_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 0.5 * s} for s in range(4)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_text(text + '{"step": 4, "actor/lo')  # torn mid-write, no newline
    lines: list[str] = []
    truncate_metrics(path, 2, lines.append)
    assert [json.loads(x) for x in path.read_text().splitlines()] == rows[:3]
    assert len(lines) == 1 and "metrics.jsonl line 5: not a metrics row" in lines[0], lines


def test_garbage_in_the_middle_is_dropped_too(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n\xff\xfe\x00garbage\n{"step": 2}\n[]\n')
    lines: list[str] = []
    truncate_metrics(path, 5, lines.append)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert [x.split(":")[0].rsplit(" ", 1)[-1] for x in lines] == ["2", "4"], lines


def test_torn_row_of_the_checkpointed_step_is_restored_from_the_checkpoint(tmp_path):
    """The torn line is the row of the step the checkpoint holds (issue 20: it was dropped, and that step's metrics
    lost for good): the checkpoint's own copy of the row is written back, once, and named."""
    path = tmp_path / "metrics.jsonl"
    rows = [metrics_row(s, {"loss": 0.5 * s, "actor/grad_norm": float("nan")}) for s in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]) + '{"step": 3, "actor/lo')
    lines: list[str] = []
    truncate_metrics(path, 3, lines.append, restore=rows[3])
    assert [json.loads(x) for x in path.read_text().splitlines()] == rows
    assert rows[3]["actor/grad_norm"] is None  # stored as the file stores it
    assert "step 3's metrics row was missing; restored it from the checkpoint" in lines[-1], lines
    lines.clear()
    truncate_metrics(path, 3, lines.append, restore=rows[3])  # present: nothing added twice
    assert [json.loads(x) for x in path.read_text().splitlines()] == rows and not lines
    path.unlink()
    truncate_metrics(path, 3, lines.append, restore=rows[3])  # the whole file lost
    assert [json.loads(x) for x in path.read_text().splitlines()] == rows[3:]


def test_a_start_from_step_0_drops_the_rows_of_an_earlier_start_that_saved_nothing(tmp_path):
    """A restarted attempt (or a rerun) whose first attempt failed before its first checkpoint logs steps 0.. again:
    the old rows go, named, instead of appearing twice (found by tools/experiments/restart_trials.py: a rank raising
    in step 1's save left `1 1 2 3 4`)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "actor/lo')
    lines: list[str] = []
    drop_unsaved_metrics(path, lines.append)
    assert path.read_text() == ""
    assert lines == [
        f"{path}: dropped 3 row(s) of an earlier start that saved no checkpoint; this run starts at step 0"
    ]
    drop_unsaved_metrics(tmp_path / "none.jsonl", lines.append)  # no file, or an empty one: nothing to say
    drop_unsaved_metrics(path, lines.append)
    assert len(lines) == 1


MALFORMED = {
    "a step past float range": '{"step": 1e400, "loss": 1}',
    "a step of NaN": '{"step": NaN}',
    "a fractional step": '{"step": 1.5}',
    "a step of true": '{"step": true}',
    "a negative step": '{"step": -3}',
    "a string step": '{"step": "2"}',
    "no step": '{"loss": 0.5}',
    "a list": "[1, 2]",
    "a number": "7",
    "null": "null",
    "an infinite value": '{"step": 1, "loss": Infinity}',
    "a value past float range": '{"step": 1, "loss": -1e999}',
    "a string value": '{"step": 1, "loss": "low"}',
    "a nested value": '{"step": 1, "loss": {"a": 1}}',
    "a huge integer": '{"step": ' + "9" * 5000 + "}",
}


def test_every_malformed_row_is_dropped_with_one_line_on_resume_and_in_plots(tmp_path):
    """Issue 38 item 4: `step: 1e400` broke resume (OverflowError in int()); a fractional or boolean step was taken as
    a step. Each malformed row is dropped with one line naming the line and why, both when resume repairs the file
    and when `plot` reads it; the good rows stay."""
    from megatron_dapo.metrics import plot_run
    from megatron_dapo.metrics import read_metrics

    good = [json.dumps(metrics_row(s, {"reward/acc": 0.1 * s})) for s in (1, 2)]
    for name, bad in MALFORMED.items():
        path = tmp_path / "metrics.jsonl"
        path.write_text("\n".join([good[0], bad, good[1]]) + "\n")
        lines: list[str] = []
        assert [r["step"] for r in read_metrics(tmp_path, lines.append)] == [1, 2], name
        assert len(lines) == 1 and "metrics.jsonl line 2: not a metrics row" in lines[0], (name, lines)
        lines.clear()
        truncate_metrics(path, 5, lines.append)
        assert path.read_text() == good[0] + "\n" + good[1] + "\n", name
        assert len(lines) == 1 and "line 2: not a metrics row" in lines[0] and "\n" not in lines[0], (name, lines)
    path.write_text("\n".join([good[0], MALFORMED["a step past float range"], good[1]]) + "\n")
    assert (tmp_path / "plots" / "accuracy.png") in plot_run(tmp_path)  # plots what is there, warns on stderr
