"""A torn last line of metrics.jsonl (a kill while a row was being written) no longer blocks resume (issue 12,
item 6): before, every resume died in json.loads; now the line is dropped and named. End to end in
test_run_faults.py."""

from __future__ import annotations

import json

from megatron_dapo.trainer import _truncate_metrics


def test_torn_last_line_is_dropped_and_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 0.5 * s} for s in range(4)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_text(text + '{"step": 4, "actor/lo')  # torn mid-write, no newline
    lines: list[str] = []
    _truncate_metrics(path, 2, lines.append)
    assert [json.loads(x) for x in path.read_text().splitlines()] == rows[:3]
    assert len(lines) == 1 and "metrics.jsonl line 5: not a metrics row" in lines[0], lines


def test_garbage_in_the_middle_is_dropped_too(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n\xff\xfe\x00garbage\n{"step": 2}\n[]\n')
    lines: list[str] = []
    _truncate_metrics(path, 5, lines.append)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert [x.split(":")[0].rsplit(" ", 1)[-1] for x in lines] == ["2", "4"], lines
