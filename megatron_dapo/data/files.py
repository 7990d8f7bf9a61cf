"""Read and write row files (jsonl or parquet) holding DAPO-Math-17k style rows.

Rows are plain dicts. Reading yields ``(row_number, line_number, row)``: row numbers count data rows from 0 in both
formats; line numbers are 1-based jsonl lines (None for parquet). Writing is deterministic: the same rows give a
byte-identical file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

__all__ = ["FORMATS", "check_data_file", "file_format", "iter_rows", "write_rows"]

FORMATS = ("jsonl", "parquet")
_PARQUET_BATCH_ROWS = 65536


def file_format(path: str | os.PathLike) -> str:
    """'jsonl' or 'parquet' from the file extension (.jsonl/.json lines, .parquet); ValueError otherwise."""
    name = os.fspath(path).lower()
    if name.endswith((".jsonl", ".json")):
        return "jsonl"
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    raise ValueError(f"{os.fspath(path)}: unknown data file extension (expected .jsonl, .json or .parquet)")


def check_data_file(path: str | os.PathLike) -> str:
    """The file's format; FileNotFoundError for a missing file, ValueError for an unknown extension (one line each,
    the errors iter_rows raises before reading anything)."""
    path = os.fspath(path)
    fmt = file_format(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path}")
    return fmt


def iter_rows(path: str | os.PathLike) -> Iterator[tuple[int, int | None, Any]]:
    """Yield ``(row_number, line_number, row)`` for each data row of a jsonl or parquet file.

    Raises FileNotFoundError for a missing file and ValueError naming the file and line for invalid JSON, bytes that
    are not UTF-8 and absurdly deep nesting. Blank
    jsonl lines are skipped. The row is returned as parsed (validation is the caller's job).
    """
    path = os.fspath(path)
    fmt = check_data_file(path)
    if fmt == "jsonl":
        yield from _iter_jsonl(path)
    else:
        yield from _iter_parquet(path)


def _iter_jsonl(path: str) -> Iterator[tuple[int, int | None, Any]]:
    row_number = 0
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path} line {line_number}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {line_number}: invalid JSON ({e.msg} at column {e.colno})") from None
            except RecursionError:
                raise ValueError(f"{path} line {line_number}: JSON nested too deeply to be a data row") from None
            yield row_number, line_number, row
            row_number += 1


def _iter_parquet(path: str) -> Iterator[tuple[int, int | None, Any]]:
    import pyarrow.parquet as pq

    # In record batches: a 1.79 M-row file is never held as Python objects at once (DAPO-Math-17k as published)
    row_number = 0
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=_PARQUET_BATCH_ROWS)
        for batch in batches:
            for row in batch.to_pylist():
                yield row_number, None, row
                row_number += 1
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise ValueError(f"{path}: cannot read parquet file ({type(e).__name__}: {e})") from None


def write_rows(rows: Sequence[dict[str, Any]], path: str | os.PathLike, fmt: str | None = None) -> str:
    """Write ``rows`` (dicts with the same nested structure) to ``path`` as jsonl or parquet; returns the path.

    ``fmt`` defaults to the extension's format. Output is byte-identical for identical rows (no timestamps; keys
    keep insertion order).
    """
    path = os.fspath(path)
    fmt = fmt or file_format(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    if fmt == "jsonl":
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not rows:
            raise ValueError(f"{path}: refusing to write an empty parquet file (no schema)")
        pq.write_table(pa.Table.from_pylist(list(rows)), path)
    return path
