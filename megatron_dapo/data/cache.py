"""The prompt cache: a set of data files parsed, validated, de-duplicated, chat-templated and length-checked once per
dataset version, then memory-mapped by every rank of every later start.

Without it each rank of each start parses and tokenises the whole file: DAPO-Math-17k as published has 1.79 M rows,
minutes per rank and GBs of Python objects each (README.md, "Data at scale", has the measurement).

Key: sha256 over the cache format version, each file's path, size and content sha256 (in order), the tokenizer's
fingerprint (its class, the serialised fast tokenizer or the vocabulary, the special tokens and the chat template),
the prompt field, the prompt limit, filter_overlong and drop_duplicates. Any change gives a new entry; entries are
never updated in place. Entry ``<cache_dir>/<key>/``:

    examples.bin  examples.idx   the kept examples as JSON lines; int64 offsets [N + 1]
    tokens.bin    tokens.idx     int32 prompt token ids (chat template applied), concatenated; int64 offsets [N + 1]
    indices.npy                  int64 [N]: each kept example's index (its row's position in the files), increasing
    meta.json                    identity (identity.py), longest prompt, notes to log, counts, and the size and
                                 sha256 of each file above (hashed once, when written); sealed by its own sha256
                                 ("checksum", over the rest of it); written last

The first process to take ``<key>.lock`` (fcntl, so every rank of a node, and of other nodes where the file system
honours it) builds the entry in a temporary folder and renames it into place; the others wait on the lock, then read.
Readers map the files: the pages are shared through the page cache by every process of the node, and an example is
decoded only when it is used.

Every open checks the entry against meta.json before any of it is used: meta.json's checksum, then each file's size
and sha256 (one read of the entry per process: DAPO-Math-17k's de-duplicated entry is 27 MiB, hashed in 41 ms on this
2-core machine under load, next to the 0.26 s a warm open took; the 1.79 M rows kept with data.drop_duplicates=false
make an entry ~100x that, a few seconds). A damaged or edited entry (a torn write, a same-size edit of a ground truth,
a changed note, a file removed) is rebuilt from the data files, with one log line.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megatron_dapo.data.dataset import Example
from megatron_dapo.data.dataset import PromptLimit
from megatron_dapo.data.dataset import filter_prompt_lengths
from megatron_dapo.data.dataset import prompt_token_ids
from megatron_dapo.data.dataset import read_examples
from megatron_dapo.data.identity import data_identity

__all__ = ["CACHE_VERSION", "CachedExamples", "PromptCache", "cache_key", "file_sha256", "tokenizer_fingerprint"]

CACHE_VERSION = 3
"""Bumped when the entry's layout or what goes into it changes (old entries are then never read)."""
_CHUNK = 1 << 23
_CONTENTS = ("examples.bin", "examples.idx", "tokens.bin", "tokens.idx", "indices.npy")
"""The entry's files whose size and sha256 meta.json holds."""


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 over what decides a prompt's token ids: the tokenizer's class, its serialised fast tokenizer (vocabulary,
    merges, normaliser, added tokens) or else its vocabulary, its special tokens and its chat template."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True, default=str).encode())
    h.update((getattr(tokenizer, "chat_template", None) or "").encode())
    return h.hexdigest()


def cache_key(
    files: Sequence[str], tokenizer: Any, limit: PromptLimit, *, prompt_key: str, filter_overlong: bool,
    drop_duplicates: bool,
) -> str:  # fmt: skip
    """The entry name of this data under this tokenizer and these settings (sha256 hex)."""
    described = {
        "version": CACHE_VERSION,
        # the path too: examples, notes and the identity name their file as given (a moved file is read again)
        "files": [
            {"path": p, "abspath": os.path.abspath(p), "bytes": os.path.getsize(p), "sha256": file_sha256(p)}
            for p in files
        ],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "prompt_key": prompt_key,
        "limit": [limit.tokens, limit.rule],
        "filter_overlong": filter_overlong,
        "drop_duplicates": drop_duplicates,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


class _Ragged:
    """Rows of a flat memory-mapped array by int64 offsets [N + 1]."""

    def __init__(self, data_path: Path, index_path: Path, dtype: Any):
        self.offsets = np.load(index_path, mmap_mode="r")
        size = os.path.getsize(data_path)
        if self.offsets.ndim != 1 or len(self.offsets) < 1 or int(self.offsets[-1]) * np.dtype(dtype).itemsize != size:
            raise ValueError(f"{data_path}: {size} bytes, its offsets say {int(self.offsets[-1])} items")
        self.data = np.memmap(data_path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> np.ndarray:
        return self.data[int(self.offsets[i]) : int(self.offsets[i + 1])]


class CachedExamples(Sequence[Example]):
    """The kept examples of a cache entry, decoded one by one from the mapped file when indexed (a slice gives a
    list)."""

    def __init__(self, rows: _Ragged):
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        messages, ground_truth, data_source, index, extra_info, source = json.loads(self._rows.row(i).tobytes())
        return Example(messages, ground_truth, data_source, index, extra_info, source)


class PromptCache:
    """One entry of the prompt cache, loaded (or built first): ``examples``, ``prompt_ids(i)``, ``identity``,
    ``longest_prompt`` and ``notes`` (what loading the data said: duplicates and over-long prompts dropped)."""

    def __init__(self, entry: Path):
        meta = _checked_meta(entry)
        self.entry = entry
        self.identity: dict[str, Any] = meta["identity"]
        self.longest_prompt: int = meta["longest_prompt"]
        self.notes: list[str] = meta["notes"]
        self.meta = meta
        self._tokens = _Ragged(entry / "tokens.bin", entry / "tokens.idx", np.int32)
        self.examples = CachedExamples(_Ragged(entry / "examples.bin", entry / "examples.idx", np.uint8))
        self._indices = np.load(entry / "indices.npy", mmap_mode="r")
        if not len(self.examples) == len(self._tokens) == len(self._indices) == meta["num_examples"]:
            raise ValueError(f"{entry}: {len(self.examples)} examples, {len(self._tokens)} token rows")

    def prompt_ids(self, i: int) -> list[int]:
        """Token ids of the i-th kept example's prompt (chat template with the generation prompt)."""
        return self._tokens.row(i).tolist()

    def prompt_ids_of_index(self, index: int) -> list[int]:
        """prompt_ids of the kept example whose ``Example.index`` is index (KeyError when none is)."""
        i = int(np.searchsorted(self._indices, index))
        if i == len(self._indices) or int(self._indices[i]) != index:
            raise KeyError(f"no kept example has index {index}")
        return self.prompt_ids(i)

    @classmethod
    def open(
        cls, cache_dir: str | os.PathLike, files: Sequence[str], tokenizer: Any, limit: PromptLimit, *,
        prompt_key: str = "prompt", filter_overlong: bool = False, drop_duplicates: bool = True,
        log: Callable[[str], None] = print,
    ) -> PromptCache:  # fmt: skip
        """The entry of this data, built under the entry's lock when absent or damaged. Errors in the data are the
        same one-line ValueErrors as without the cache (raised by every process that tries)."""
        root = Path(cache_dir)
        key = cache_key(files, tokenizer, limit, prompt_key=prompt_key, filter_overlong=filter_overlong,
                        drop_duplicates=drop_duplicates)  # fmt: skip
        entry = root / key
        try:
            root.mkdir(parents=True, exist_ok=True)
            lock = open(root / f"{key}.lock", "w")  # closed by the with below
        except OSError as err:
            raise OSError(
                f"data.cache_dir={root}: cannot write there ({err.strerror or err}); set it to a writable folder, or "
                '"" to read the data files at every start'
            ) from None
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if entry.exists():
                    try:
                        return cls(entry)
                    except (ValueError, KeyError, TypeError, OSError) as err:
                        why = str(err).splitlines()[0] if str(err) else type(err).__name__
                        log(f"prompt cache entry {entry} is damaged ({why}); rebuilding it")
                        shutil.rmtree(entry, ignore_errors=True)
                _build(entry, files, tokenizer, limit, prompt_key, filter_overlong, drop_duplicates, log)
                return cls(entry)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _build(
    entry: Path, files: Sequence[str], tokenizer: Any, limit: PromptLimit, prompt_key: str, filter_overlong: bool,
    drop_duplicates: bool, log: Callable[[str], None],
) -> None:  # fmt: skip
    start = time.monotonic()
    log(f"prompt cache: reading {len(files)} data file(s) once into {entry} (data.cache_dir)")
    read = read_examples(list(files), prompt_key, drop_duplicates)
    ids = [prompt_token_ids(tokenizer, ex.prompt_messages) for ex in read.examples]
    kept, longest, length_notes = filter_prompt_lengths(
        read.examples, [len(x) for x in ids], limit, filter_overlong=filter_overlong
    )
    kept_at = {id(ex) for ex in kept}
    kept_ids = [x for ex, x in zip(read.examples, ids, strict=True) if id(ex) in kept_at]
    tmp = entry.with_name(f".{entry.name}.tmp-{socket.gethostname()}-{os.getpid()}")  # unique on a shared disk
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        lines = [
            json.dumps([e.prompt_messages, e.ground_truth, e.data_source, e.index, e.extra_info, e.source],
                       ensure_ascii=False, default=str).encode()
            for e in kept
        ]  # fmt: skip
        _write_ragged(tmp / "examples.bin", tmp / "examples.idx", lines, lambda b: b, len)
        _write_ragged(tmp / "tokens.bin", tmp / "tokens.idx", kept_ids, lambda x: np.asarray(x, np.int32).tobytes(),
                      len)  # fmt: skip
        meta = {
            "version": CACHE_VERSION,
            "identity": data_identity(read.files, kept),
            "num_examples": len(kept),
            "rows": sum(f["rows"] for f in read.files),
            "longest_prompt": longest,
            "notes": read.notes + length_notes,
            "build_s": round(time.monotonic() - start, 3),
        }
        np.save(tmp / "indices.npy", np.asarray([e.index for e in kept], np.int64))
        meta["contents"] = {name: {"bytes": (tmp / name).stat().st_size, "sha256": file_sha256(str(tmp / name))}
                            for name in _CONTENTS}  # fmt: skip
        meta["checksum"] = _meta_checksum(meta)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, entry)
        except OSError:  # another node built it meanwhile (a file system without working locks): keep theirs
            if not (entry / "meta.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _meta_checksum(meta: dict[str, Any]) -> str:
    """sha256 of meta.json's content other than the checksum itself (canonical JSON)."""
    rest = {k: v for k, v in meta.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _checked_meta(entry: Path) -> dict[str, Any]:
    """meta.json of an entry, after checking it against its checksum and every file of the entry against it;
    ValueError (one line, naming the file) on the first mismatch."""
    meta = json.loads((entry / "meta.json").read_text())
    if not isinstance(meta, dict) or meta.get("checksum") != _meta_checksum(meta):
        raise ValueError("meta.json does not match its checksum")
    if meta.get("version") != CACHE_VERSION:
        raise ValueError(f"meta.json is of cache format {meta.get('version')!r}, not {CACHE_VERSION}")
    for name in _CONTENTS:
        want, path = meta["contents"][name], entry / name
        if path.stat().st_size != want["bytes"]:
            raise ValueError(f"{name} has {path.stat().st_size} bytes, meta.json says {want['bytes']}")
        if file_sha256(str(path)) != want["sha256"]:
            raise ValueError(f"{name} fails its sha256 check")
    return meta


def _write_ragged(data_path: Path, index_path: Path, rows: Sequence[Any], to_bytes: Callable, size: Callable) -> None:
    offsets = np.zeros(len(rows) + 1, np.int64)
    with open(data_path, "wb") as f:
        for i, row in enumerate(rows):
            f.write(to_bytes(row))
            offsets[i + 1] = offsets[i] + size(row)
        f.flush()
        os.fsync(f.fileno())
    with open(index_path, "wb") as f:
        np.save(f, offsets)
