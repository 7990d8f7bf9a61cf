"""Resume without running code from the checkpoint: every pickle that megatron's load would unpickle is checked first.

megatron-core 0.16.1 `dist_checkpointing.load` (torch_dist / torch backends) reads, on every rank:

    metadata.json   json.load -> CheckpointingConfig(**dict)  (dist_checkpointing/core.py)            no pickle
    common.pt       torch.load(path, map_location='cpu')  (strategies/common.py, TorchCommonLoadStrategy.load_common):
                    weights-only by default since torch 2.6, a full pickle under TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1
    .metadata       pickle.load  (torch filesystem.py, FileSystemReader.read_metadata; megatron's
                    CachedMetadataFileSystemReader calls it)                                       a full pickle
    __R_I.distcp    tensors: torch.load(weights_only=True)  (filesystem.py, FileSystemReader.read_data)
                    byte items (ShardedObjects: every layer's _extra_state, the distributed optimizer's param groups
                    and bucket sizes): torch.load(weights_only=False)  (default_planner.py, load_bytes)  a full pickle

megatron builds its reader and planner inside TorchDistLoadShardedStrategy.load (strategies/torch.py), so the
unpickling cannot be redirected without patching megatron or torch. `check_dist_checkpoint` therefore reads the
same bytes first: `.metadata` through `MetadataUnpickler` (torch distributed-checkpoint metadata classes only), then
common.pt and each byte item with torch's weights-only unpickler. A refusal is one CheckpointError line naming the
file and the global, raised before megatron reads anything.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import planner as dcp_planner

from megatron_dapo.checkpoint import CheckpointError

METADATA_FILE = ".metadata"
COMMON_FILE = "common.pt"

# What torch 2.13 pickles into `.metadata` (filesystem.py `finish`: pickle.dump(metadata)): the Metadata dataclass and
# what its fields hold (metadata.py), the _StorageInfo of every item (filesystem.py), and the per-rank SavePlans that
# megatron's saver keeps in `all_local_plans` (state_dict_saver.py; planner.py classes).
_RECORD_CLASSES = (
    dcp_metadata.Metadata,
    dcp_metadata.MetadataIndex,
    dcp_metadata.StorageMeta,
    dcp_metadata.TensorStorageMetadata,
    dcp_metadata.BytesStorageMetadata,
    dcp_metadata.ChunkStorageMetadata,
    dcp_metadata.TensorProperties,
    dcp_filesystem._StorageInfo,
    dcp_planner.SavePlan,
    dcp_planner.WriteItem,
    dcp_planner.TensorWriteData,
    dcp_planner.BytesIOWriteData,
)
# Immutable values: torch.Size (offsets, sizes), the enums of TensorProperties' memory format and of WriteItem.type,
# every torch dtype (TensorProperties.dtype), and torch.serialization._get_layout (how a torch.layout pickles: a
# lookup of the layout by its name).
_VALUE_CLASSES = (torch.Size, dcp_metadata._MEM_FORMAT_ENCODING, dcp_planner.WriteItemType)
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    **{(c.__module__, c.__qualname__): c for c in _RECORD_CLASSES + _VALUE_CLASSES},
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
}
"""(module, name) -> object: the only globals a `.metadata` file may name."""


class RefusedGlobal(pickle.UnpicklingError):
    """The pickle names something outside ALLOWED_GLOBALS (or would set attributes of a non-record)."""


class MetadataUnpickler(pickle._Unpickler):
    """Unpickles torch distributed-checkpoint metadata and nothing else.

    `find_class` admits ALLOWED_GLOBALS only, so REDUCE / NEWOBJ / INST / OBJ can only construct those classes (or
    look a layout up by name). BUILD (set an object's state) applies only to instances of the metadata record classes,
    never to a class, an enum member or a dtype (which would change them for the whole process). Extension codes
    (EXT1/2/4) are refused; persistent ids are refused by the base class. The pure-Python unpickler is used because
    the C one cannot restrict BUILD: about 1 s per MB of .metadata (2-3x the C unpickler), on every rank.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except (KeyError, TypeError):
            raise RefusedGlobal(f"refused to unpickle '{module}.{name}' (not a checkpoint metadata class)") from None

    def _load_build(self) -> None:
        target = type(self.stack[-2])
        if target not in _RECORD_CLASSES:
            raise RefusedGlobal(
                f"refused to unpickle: it sets the state of a '{target.__module__}.{target.__qualname__}' "
                "(only checkpoint metadata records have state)"
            )
        pickle._Unpickler.load_build(self)

    def _load_ext(self) -> None:
        raise RefusedGlobal("refused to unpickle: it uses a pickle extension code (checkpoint metadata never does)")

    dispatch[pickle.BUILD[0]] = _load_build
    for _op in (pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_op[0]] = _load_ext
    del _op


def load_dcp_metadata(path: str | Path) -> dcp_metadata.Metadata:
    """The torch distributed-checkpoint Metadata in `path` (a `.metadata` file), unpickled by MetadataUnpickler.

    Raises CheckpointError, one line naming the file: a forbidden global, an unreadable pickle, or another type."""
    try:
        with open(path, "rb") as f:
            obj = MetadataUnpickler(f).load()
    except RefusedGlobal as err:
        raise CheckpointError(f"checkpoint {path}: {err}") from None
    except OSError as err:
        raise CheckpointError(f"checkpoint {path}: cannot read it ({err.strerror or type(err).__name__})") from None
    except Exception as err:  # a damaged pickle fails in many ways (EOFError, UnpicklingError, TypeError, ...)
        raise CheckpointError(
            f"checkpoint {path}: not torch distributed-checkpoint metadata ({_first_line(err)})"
        ) from None
    if not isinstance(obj, dcp_metadata.Metadata):
        raise CheckpointError(
            f"checkpoint {path}: holds a {type(obj).__name__}, not torch distributed-checkpoint Metadata"
        )
    return obj


def check_torch_pickle(where: str, data: bytes) -> None:
    """Refuse (CheckpointError naming `where` and the global) a torch.save payload that torch's weights-only
    unpickler would not load: megatron / torch then load the same bytes, some of them with weights_only=False."""
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # UnpicklingError for a forbidden global, RuntimeError for a damaged archive
        text = str(err)
        found = re.search(r"GLOBAL ([\w.]+)", text)
        if found is not None:
            raise CheckpointError(
                f"checkpoint {where}: refused to unpickle '{found.group(1)}' (not allowed by torch's weights-only load)"
            ) from None
        raise CheckpointError(f"checkpoint {where}: not a loadable torch file ({_first_line(err)})") from None


def check_dist_checkpoint(ckpt_dir: str | Path) -> None:
    """Check every pickle that `dist_checkpointing.load(..., ckpt_dir)` would unpickle (module docstring), before it
    runs; CheckpointError (one line, naming the file and the global) on the first refusal. Local and per rank: every
    rank reads the same files and so stops with the same line.

    Cost: one read of `.metadata` and common.pt, and of each byte item (a few KB each), per rank.
    """
    root = Path(ckpt_dir)
    if not (root / METADATA_FILE).is_file():
        raise CheckpointError(f"checkpoint {root}: no {METADATA_FILE} (not a complete torch_dist checkpoint)")
    metadata = load_dcp_metadata(root / METADATA_FILE)
    if (root / COMMON_FILE).is_file():
        check_torch_pickle(str(root / COMMON_FILE), (root / COMMON_FILE).read_bytes())
    for fqn, info in _byte_items(root, metadata):
        where = f"{root / info.relative_path} (item '{fqn}' at byte {info.offset})"
        try:
            with open(root / info.relative_path, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
        except OSError as err:
            raise CheckpointError(
                f"checkpoint {where}: cannot read it ({err.strerror or type(err).__name__})"
            ) from None
        check_torch_pickle(where, data)


def _byte_items(root: Path, metadata: dcp_metadata.Metadata) -> list[tuple[str, dcp_filesystem._StorageInfo]]:
    """(fqn, where its bytes are) of every BytesStorageMetadata item: torch's planner unpickles these with
    weights_only=False. Refuses storage outside the checkpoint directory and transformed (e.g. compressed) items,
    which megatron_dapo never writes and whose bytes on disk are not the bytes unpickled."""
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise CheckpointError(f"checkpoint {root / METADATA_FILE}: its state_dict_metadata or storage_data is no dict")
    items = []
    for index, info in storage.items():
        fqn = getattr(index, "fqn", None)
        if not isinstance(entries.get(fqn), dcp_metadata.BytesStorageMetadata):
            continue
        where = f"checkpoint {root / METADATA_FILE}: item '{fqn}'"
        if not isinstance(info, dcp_filesystem._StorageInfo):
            raise CheckpointError(f"{where} has no storage record")
        name = info.relative_path
        if not isinstance(name, str) or os.path.isabs(name) or ".." in Path(name).parts:
            raise CheckpointError(f"{where} is stored outside the checkpoint ({name!r})")
        if not isinstance(info.offset, int) or not isinstance(info.length, int) or info.offset < 0 or info.length < 0:
            raise CheckpointError(f"{where} has no valid offset and length")
        if info.transform_descriptors:
            raise CheckpointError(f"{where} is stored transformed ({list(info.transform_descriptors)})")
        items.append((str(fqn), info))
    return items


def _first_line(err: BaseException) -> str:
    """`Type: first informative line` of an exception (torch's weights-only errors start with boilerplate)."""
    skip = ("Weights only load failed", "Check the documentation", "Please file an issue", "(1)", "(2)")
    lines = [x.strip() for x in str(err).splitlines() if x.strip() and not x.strip().startswith(skip)]
    return f"{type(err).__name__}: {lines[0][:200]}" if lines else type(err).__name__
