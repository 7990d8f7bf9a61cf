"""A resume that reads each tensor byte once: the actor's torch_dist files are verified item by item as they load.

    save:    MANIFEST.json (checkpoint.py) holds, for each `*.distcp` file, the sha256 of every storage item
             (offset, length) that torch_dist's `.metadata` lays out in it (`storage_items`), hashed in the same read
             as the whole-file hash
    resume:  CheckpointManager.verify checks those files' sizes only; megatron's dist_checkpointing.load runs inside
             `verified_reads`, which gives torch's FileSystemReader a `_slice_file` that reads the item's bytes, hashes
             them and compares them with the manifest before torch.load sees them

Read in the pinned sources: megatron-core 0.16.1 builds its reader in TorchDistLoadShardedStrategy.load through the
module function `strategies.torch._get_filesystem_reader` (so that is the one name patched, for the load's duration);
torch 2.13's FileSystemReader.read_data opens each file once and calls `self._slice_file(stream, storage_info)` per
read item, then torch.load's the slice (tensors) or reads it (byte items). read_data runs inside the distributed
checkpoint's all-gather of read results (`_DistWrapper`), so an item that fails its hash fails the load on every rank
alike (CheckpointException), which `load_verified` turns into one CorruptItem line naming the file and bytes.

What is still read twice: the byte items (a few KB each: the pickle check of actor/safe_unpickle.py reads them first),
`.metadata` and common.pt (small; hashed whole by `verify`, then loaded). Each rank reads only the items it loads; an
item two ranks load (data-parallel replicas) is read, and checked, by both.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from megatron_dapo.actor.safe_unpickle import METADATA_FILE
from megatron_dapo.actor.safe_unpickle import load_dcp_metadata
from megatron_dapo.checkpoint import CheckpointError
from megatron_dapo.checkpoint import ItemHashes


class CorruptItem(CheckpointError):
    """A storage item's bytes do not match their hash in MANIFEST.json (found while loading; one line)."""


def storage_items(ckpt_dir: str | Path) -> dict[str, list[tuple[int, int]]]:
    """{data file relative to ckpt_dir: [(offset, length) of each storage item, by offset]} from torch_dist's
    `.metadata` (read with the restricted unpickler of actor/safe_unpickle.py)."""
    metadata = load_dcp_metadata(Path(ckpt_dir) / METADATA_FILE)
    out: dict[str, set[tuple[int, int]]] = {}
    for info in metadata.storage_data.values():
        out.setdefault(info.relative_path, set()).add((int(info.offset), int(info.length)))
    return {name: sorted(ranges) for name, ranges in sorted(out.items())}


def _verified_slice(root: Path, expected: ItemHashes, read: dict[str, int]) -> Callable[[Any, Any], io.BytesIO]:
    def slice_file(stream: Any, info: Any) -> io.BytesIO:
        name, offset, length = info.relative_path, int(info.offset), int(info.length)
        where = f"{root / name} bytes {offset}..{offset + length}"
        want = expected.get(name, {}).get((offset, length))
        if want is None:
            raise CorruptItem(f"checkpoint {where}: no such item in its MANIFEST.json (the files do not match it)")
        stream.seek(offset)
        data = stream.read(length)
        read[name] = read.get(name, 0) + len(data)
        if len(data) != length:
            raise CorruptItem(f"checkpoint {where}: the file ends after {len(data)} of them")
        if hashlib.sha256(data).hexdigest() != want:
            raise CorruptItem(f"checkpoint {where} fail their sha256 check (read while loading)")
        return io.BytesIO(data)

    return slice_file


@contextmanager
def verified_reads(expected: ItemHashes) -> Iterator[dict[str, int]]:
    """Around megatron's dist_checkpointing.load: every storage item it reads is checked against `expected` (the
    manifest's item hashes for the loaded directory). Yields {file: bytes read} (filled as the load reads)."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    original = mcore_torch._get_filesystem_reader
    read: dict[str, int] = {}

    def reader(checkpoint_dir: Any, cache_metadata: bool = False) -> Any:
        fsr = original(checkpoint_dir, cache_metadata=cache_metadata)
        fsr._slice_file = _verified_slice(Path(checkpoint_dir), expected, read)
        return fsr

    mcore_torch._get_filesystem_reader = reader
    try:
        yield read
    finally:
        mcore_torch._get_filesystem_reader = original


def load_verified(load: Callable[[], Any], expected: ItemHashes | None) -> Any:
    """load() (a dist_checkpointing.load) with its items verified when `expected` is given; a failed item is one
    CorruptItem on every rank (the lowest rank's, from torch's gathered read errors)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if expected is None:
        return load()
    try:
        with verified_reads(expected):
            return load()
    except CheckpointException as err:
        for rank in sorted(err.failures):
            failure = err.failures[rank]  # (exception, traceback) in torch 2.13
            cause = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(cause, CorruptItem):
                raise CorruptItem(f"{cause} (rank {rank})") from None
        raise
