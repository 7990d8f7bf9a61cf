"""Atomic, resumable checkpoints: model and optimizer (Megatron dist_checkpointing via the actor), trainer state
(step, data position, carried rollouts), the run's config; keep the newest K; preemption-safe.

    run_dir/checkpoints/
        step_00000004/            complete: has COMPLETE, renamed into place only after every rank wrote
            actor/                MegatronActor.save_checkpoint (sharded model + optimizer + scheduler, and each
                                  rank's RNG states: python, torch, Megatron's tracker, CUDA; the one RNG file)
            trainer_state.pt      step, data iterator, carried rollouts, metrics continuity (weights_only-safe)
            config.yaml
            MANIFEST.json         size and sha256 of every other file, written by rank 0 after every rank wrote
            COMPLETE
        step_00000006.partial/    an interrupted save: ignored by `latest()`, removed by the next save

Integrity: MANIFEST.json holds the size and sha256 of every file, and for the actor's tensor files (torch_dist
`*.distcp`, the `layout` callback) the sha256 of each storage item (offset, length) too. `verify()` checks the sizes
of every file and re-hashes the others (the ranks share the files); the tensor files' bytes are hashed item by item
as the load reads them (actor/verified_load.py), so a resume reads each tensor byte once: a mismatch fails the load
on every rank with one line, and the trainer falls back to the previous checkpoint (`find_resumable(before=)`).
`find_resumable()` walks the complete checkpoints newest first and returns the first that verifies, naming each one
it skips and why. A checkpoint without MANIFEST.json (copied without it, or written before manifests existed) is not
used unless checkpoint.allow_unverified is set; then it loads with a warning. A manifest without item hashes (saved
before them) is verified by re-hashing every file as before. Hashing costs one read of the checkpoint at save (split
over the ranks, whole-file and item hashes in the same pass). The manifest is no signature: the pickles in the
actor's directory are checked by actor/safe_unpickle.py whether a manifest exists or not.

SIGTERM / SIGUSR1 (Slurm preemption) only set a flag; generation stops on it at once (the step is dropped), otherwise
the trainer checks it at step boundaries, agreeing across ranks, saves and exits 0. A step past its generation runs to
its end first, so the launcher must wait long enough before SIGKILL:
checkpoint.preempt_grace_s, which `megatron-dapo launch` passes to torchrun (docs/reliability.md, Preemption).

torch is imported where a checkpoint's state files are written or read: finding, verifying and choosing a
checkpoint (`megatron-dapo status`) needs none.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megatron_dapo.errors import first_line

COMPLETE = "COMPLETE"
MANIFEST = "MANIFEST.json"
PREFIX = "step_"
NO_MANIFEST = f"no {MANIFEST} (copied without it, or saved before manifests existed)"
_HASH_CHUNK = 8 * 2**20

# Fields that may not change when resuming a run (others, e.g. total_steps or logging, may).
INCOMPATIBLE_FIELDS = (
    ("actor", "model_path"),
    ("actor", "dtype"),
    ("actor", "use_distributed_optimizer"),  # the optimizer state's layout on disk differs
    ("algorithm", "group_size"),
    ("trainer", "prompts_per_step"),
    ("trainer", "seed"),
    ("data", "train_files"),
    ("data", "seed"),
    ("data", "shuffle"),
)


def step_dir_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def checkpoint_root(run_dir: str | Path) -> Path:
    """Where a run keeps its checkpoints: RUN_DIR/checkpoints."""
    return Path(run_dir) / "checkpoints"


def step_of(path: str | Path) -> int:
    """The step of a checkpoint directory named by `step_dir_name`."""
    return int(Path(path).name[len(PREFIX) :])


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    done = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(PREFIX) and "." not in p.name and (p / COMPLETE).exists()
    ]
    return sorted(done, key=step_of)


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def check_compatible(
    saved: dict[str, dict[str, Any]], current: dict[str, dict[str, Any]], where: str, *, moe: bool = False
) -> None:
    """Raise CheckpointError (a ValueError) naming every field that changed in a way a resumed run cannot absorb.

    moe: the model is a mixture of experts. Its checkpoint reshards over a changed TP, PP or expert_parallel > 1
    (megatron's distributed checkpoint), but not between expert_parallel 1 and > 1: with expert parallelism megatron
    keeps the experts' optimizer state in a second, chained optimizer, so the saved and the new optimizer state have
    different names (measured: EP 2 -> 4 resumes, EP 2 -> 1 fails in megatron's load)."""
    if not isinstance(saved, dict) or not all(isinstance(v, dict) for v in saved.values()):
        raise CheckpointError(f"{where}: config.yaml is not a run config (sections of fields)")
    changed = [
        f"{s}.{f}: {saved.get(s, {}).get(f)!r} -> {current.get(s, {}).get(f)!r}"
        for s, f in INCOMPATIBLE_FIELDS
        if saved.get(s, {}).get(f) != current.get(s, {}).get(f)
    ]
    was, now = saved.get("actor", {}), current.get("actor", {})
    if moe and (was.get("expert_parallel", 1) > 1) != (now.get("expert_parallel", 1) > 1):

        def layout(a: dict[str, Any]) -> str:
            return f"TP {a.get('tensor_parallel')} x EP {a.get('expert_parallel', 1)} x PP {a.get('pipeline_parallel')}"

        changed.append(
            f"actor.expert_parallel: {was.get('expert_parallel', 1)!r} -> {now.get('expert_parallel', 1)!r} (saved "
            f"{layout(was)}, now {layout(now)}: a mixture-of-experts checkpoint reshards between expert_parallel "
            "values above 1, not between 1 and more, whose optimizer states differ)"
        )
    if changed:
        raise CheckpointError(
            f"{where}: cannot resume, the config changed incompatibly ({'; '.join(changed)}); "
            f"use a new trainer.run_dir or checkpoint.resume=never"
        )


def checkpoint_files(path: str | Path) -> list[str]:
    """Relative paths of every regular file under a checkpoint directory except MANIFEST.json and COMPLETE, sorted."""
    path = Path(path)
    return sorted(
        p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file() and p.name not in (MANIFEST, COMPLETE)
    )


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file (read in 8 MiB chunks; hashlib releases the GIL, so threads hash files in parallel)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_digests(path: str | Path, ranges: list[tuple[int, int]]) -> tuple[str, list[str]]:
    """(hex sha256 of the file, hex sha256 of each byte range (offset, length) in `ranges`' order), in one read."""
    whole = hashlib.sha256()
    order = sorted(range(len(ranges)), key=lambda i: ranges[i])
    parts = [hashlib.sha256() for _ in ranges]
    first, pos = 0, 0  # order[first:] are the ranges not yet read to their end
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            view, end = memoryview(chunk), pos + len(chunk)
            whole.update(view)
            j = first
            while j < len(order) and ranges[order[j]][0] < end:
                offset, length = ranges[order[j]]
                lo, hi = max(offset, pos), min(offset + length, end)
                if hi > lo:
                    parts[order[j]].update(view[lo - pos : hi - pos])
                j += 1
            while first < len(order) and sum(ranges[order[first]]) <= end:
                first += 1
            pos = end
    return whole.hexdigest(), [h.hexdigest() for h in parts]


def hash_files(
    root: Path, names: list[str], items: dict[str, list[tuple[int, int]]] | None = None
) -> dict[str, dict[str, Any]]:
    """{name: {"size": bytes, "sha256": hex}} for files under root (4 threads); a file with storage items
    (`items[name]`: (offset, length) pairs) also gets "items": [[offset, length, sha256], ...], from the same read."""
    items = items or {}

    def one(name: str) -> tuple[str, dict[str, Any]]:
        p = root / name
        ranges = items.get(name)
        if ranges is None:
            return name, {"size": p.stat().st_size, "sha256": file_sha256(p)}
        digest, parts = file_digests(p, ranges)
        entry = {"size": p.stat().st_size, "sha256": digest}
        entry["items"] = [[o, n, h] for (o, n), h in zip(ranges, parts, strict=True)]
        return name, entry

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(pool.map(one, names))


def check_files(
    root: Path, expected: dict[str, dict[str, Any]], names: list[str], *, items_at_load: bool = False
) -> list[str]:
    """Problems (one short text each) of `names` under root against the manifest entries `expected`. With
    items_at_load, a file whose entry has item hashes is checked for its size only (the load hashes its items)."""
    problems = []
    for name in names:
        p, want = root / name, expected[name]
        if not p.is_file():
            problems.append(f"{name} is missing")
        elif p.stat().st_size != want["size"]:
            problems.append(f"{name} has {p.stat().st_size} bytes, the manifest says {want['size']}")
        elif not (items_at_load and "items" in want) and file_sha256(p) != want["sha256"]:
            problems.append(f"{name} fails its sha256 check")
    return problems


TENSOR_FILE_SUFFIX = ".distcp"
"""torch_dist's tensor files: the only files whose bytes a resume reads through the verified reader
(actor/verified_load.py), so the only ones a manifest may give item hashes (which verify then trusts the load with)."""


def manifest_files(manifest: Any) -> dict[str, dict[str, Any]]:
    """The "files" of a MANIFEST.json after checking its whole shape: {"version": 1 or 2, "algorithm": "sha256",
    "files": {relative path: {"size": int >= 0, "sha256": 64 hex digits, "items" (optional, on TENSOR_FILE_SUFFIX
    files only): [[offset, length, sha256], ...] with offset, length ints >= 0}}}, paths relative and inside the
    checkpoint. ValueError naming the first thing that is not so."""

    def digest(value: Any) -> bool:
        return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)

    def natural(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not isinstance(manifest, dict) or set(manifest) != {"version", "algorithm", "files"}:
        raise ValueError("expected the keys version, algorithm and files")
    if manifest["version"] not in (1, 2) or isinstance(manifest["version"], bool):
        raise ValueError(f"version {manifest['version']!r}")
    if manifest["algorithm"] != "sha256":
        raise ValueError(f"algorithm {manifest['algorithm']!r}")
    files = manifest["files"]
    if not isinstance(files, dict):
        raise ValueError("files is not a mapping")
    for name, entry in files.items():
        parts = Path(name).parts if isinstance(name, str) else ()
        if not parts or Path(name).is_absolute() or ".." in parts or name in (MANIFEST, COMPLETE):
            raise ValueError(f"file name {name!r}")
        if not isinstance(entry, dict) or not {"size", "sha256"} <= set(entry) <= {"size", "sha256", "items"}:
            raise ValueError(
                f"the entry of {name} has keys {sorted(entry) if isinstance(entry, dict) else type(entry).__name__}"
            )
        if not natural(entry["size"]) or not digest(entry["sha256"]):
            raise ValueError(f"the size or sha256 of {name}")
        items = entry.get("items", [])
        if not isinstance(items, list) or not all(
            isinstance(x, list) and len(x) == 3 and natural(x[0]) and natural(x[1]) and digest(x[2]) for x in items
        ):
            raise ValueError(f"the items of {name}")
        if "items" in entry and not name.endswith(TENSOR_FILE_SUFFIX):
            raise ValueError(f"the entry of {name} has items (only {TENSOR_FILE_SUFFIX} tensor files have them)")
    return files


ItemHashes = dict[str, dict[tuple[int, int], str]]
"""{file relative to a checkpoint subdirectory: {(offset, length): hex sha256}}: what a verified load compares."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names it."""


@contextmanager
def write_failure_ends_job() -> Iterator[None]:
    """Around the trainer's checkpoint writes: one that failed on any rank (a full disk: CheckpointError, the same
    on every rank) ends the job with its one line, retryable (JobError); the previous checkpoint stays the one to
    resume from."""
    from megatron_dapo.errors import JobError

    try:
        yield
    except CheckpointError as err:
        raise JobError(str(err), retryable=True) from None


class CheckpointManager:
    """Save / find / load checkpoints under `root`. Every rank constructs one; `barrier` synchronises ranks.

    Args:
        root: checkpoint directory (shared filesystem on clusters).
        keep_last: number of complete checkpoints kept.
        rank: global rank; rank 0 owns directory creation, renames and pruning.
        barrier: a callable that blocks until every rank reaches it (torch.distributed.barrier on a group).
        world_size: number of ranks taking part (barrier / gather).
        gather: all-gather of one picklable object per rank, returning the list in rank order (None: one process).
            Hashing at save and verification at load are split over the ranks with it.
        log: receives one-line notices (a skipped checkpoint, a missing manifest); rank 0 should print them.
        allow_unverified: use a checkpoint that has no MANIFEST.json (checkpoint.allow_unverified), with a warning;
            off, such a checkpoint fails verification with a line naming the option.
        check_pickles: `check_pickles(path)` raises CheckpointError when loading a file of checkpoint `path` would
            run code (the trainer passes the actor's check, actor/safe_unpickle.py); `verify` calls it last.
        layout: `layout(path)` -> {file relative to checkpoint `path`: [(offset, length), ...]}, the storage items of
            its tensor files (the trainer passes the actor's, read from torch_dist's .metadata): their hashes go in the
            manifest, and a resume checks those bytes as it loads them, not before.
        deep: `verify` hashes those tensor files whole too, so a checkpoint that verifies is one whose load will not
            fail its item checks (`megatron-dapo status`, which loads nothing, decides "finished" with it).
    """

    def __init__(
        self,
        root: str | Path,
        keep_last: int,
        rank: int = 0,
        barrier: Callable[[], None] = lambda: None,
        *,
        world_size: int = 1,
        gather: Callable[[Any], list[Any]] | None = None,
        log: Callable[[str], None] = lambda _line: None,
        allow_unverified: bool = False,
        check_pickles: Callable[[Path], None] | None = None,
        layout: Callable[[Path], dict[str, list[tuple[int, int]]]] | None = None,
        deep: bool = False,
    ):
        self.root = Path(root)
        self.keep_last = keep_last
        self.rank = rank
        self.barrier = barrier
        self.world_size = world_size
        self.gather = gather or (lambda obj: [obj])
        self.log = log
        self.allow_unverified = allow_unverified
        self.check_pickles = check_pickles
        self.layout = layout
        self.deep = deep
        self.pending: _Pending | None = None
        """A save whose actor files are still being written in the background (`save(..., background=True)`)."""
        self.begun: _Begun | None = None
        """A save whose actor files are written (`begin`) and whose trainer state is not yet (`complete`)."""

    def save(
        self,
        step: int,
        trainer_state: dict[str, Any],
        config: dict[str, Any],
        save_actor: Callable[..., Any] | None = None,
        *,
        test_hook: Callable[[str], None] | None = None,
        background: bool = False,
    ) -> Path:
        """Write checkpoint `step` atomically; returns its final path. `begin` then `complete`.

        `save_actor(dir)` is called on every rank (it may be collective). `test_hook(point)` is the trainer's testing
        hook (DAPOTrainer.test_hook), called at "before_manifest" (actor and trainer files written) and "in_save"
        (manifest written, the checkpoint not yet marked complete).

        background: `save_actor(dir, background=True)` returns a write still in progress (an object with `wait()`,
        the error text or None, and a collective `finalize()`: actor/background_save.py); the checkpoint stays
        `.partial` until `finish_pending()`, which every rank calls later (the trainer: at the next step boundary)
        and which hashes, marks and renames it as a synchronous save does. A save first finishes the one pending.
        """
        self.begin(step, save_actor, test_hook=test_hook, background=background)
        return self.complete(step, trainer_state, config)

    def begin(
        self,
        step: int,
        save_actor: Callable[..., Any] | None = None,
        *,
        test_hook: Callable[[str], None] | None = None,
        background: bool = False,
    ) -> None:
        """The first part of `save` (collective): the pending save finished, checkpoint `step`'s `.partial` directory
        created and the actor's files written (or, background, their write started). The trainer calls it where the
        actor's state is on the device (with actor.offload: in the step's update phase) and `complete` at the step
        boundary, when the trainer state is known; until then the checkpoint is only `.partial`."""
        self.finish_pending()
        partial = self.root / (step_dir_name(step) + ".partial")

        def start() -> None:
            if self.rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
                for stale in self.root.glob(f"{PREFIX}*.partial"):
                    shutil.rmtree(stale, ignore_errors=True)
                partial.mkdir()

        self._agreed(partial, "creating its directory", start)
        write = None
        if save_actor is not None and background:
            write = save_actor(partial / "actor", background=True)
        elif save_actor is not None:  # megatron's collective write: a full disk on any rank fails it on every rank
            self._agreed(partial, "writing the actor's files", lambda: save_actor(partial / "actor"))
        self.begun = _Begun(step, partial, write, test_hook)

    def complete(self, step: int, trainer_state: dict[str, Any], config: dict[str, Any]) -> Path:
        """The second part of `save` (collective): the trainer state and config written into the save `begin` started
        for `step`, then finished (manifest, COMPLETE, rename), or left pending while a background write runs.
        Returns the checkpoint's final path."""
        begun, self.begun = self.begun, None
        if begun is None or begun.step != step:
            raise RuntimeError(f"CheckpointManager.complete: step {step}'s save was not begun")
        final = self.root / step_dir_name(step)
        partial = begun.partial

        def state() -> None:
            if self.rank == 0:
                import torch

                torch.save(trainer_state, partial / "trainer_state.pt")
                (partial / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))

        def mark_complete() -> None:
            if self.rank == 0:
                (partial / COMPLETE).write_text(f"{step}\n")
                _fsync_dir(partial)
                if final.exists():
                    shutil.rmtree(final)
                os.replace(partial, final)
                _fsync_dir(self.root)
                for old in list_checkpoints(self.root)[: -self.keep_last]:
                    shutil.rmtree(old, ignore_errors=True)

        self._agreed(partial, "writing the trainer state", state)
        self.pending = _Pending(partial, mark_complete, begun.write, begun.test_hook)
        if begun.write is None:
            self.finish_pending()
        return final

    def has_begun(self, step: int) -> bool:
        """Whether `begin` started step `step`'s save and `complete` has not finished it yet."""
        return self.begun is not None and self.begun.step == step

    def holds(self, step: int) -> bool:
        """Whether the newest complete checkpoint is step `step`'s."""
        newest = latest_checkpoint(self.root)
        return newest is not None and newest.name == step_dir_name(step)

    def wait_written(self) -> None:
        """Wait for this rank's background write of the pending save, if any (not collective; finish_pending still
        completes it). Before anything that may kill this process's children: the writer runs in them."""
        if self.pending is not None and self.pending.write is not None:
            self.pending.write.wait()

    def finish_pending(self) -> Path | None:
        """Finish the pending save (collective; nothing when none is pending): wait for its background write on every
        rank, agree on its errors (CheckpointError on every rank; the previous checkpoint is intact), finalise it,
        hash it and mark it complete. Returns the checkpoint's final path."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        if pending.write is not None:
            error = pending.write.wait()
            errors = [e for e in self.gather(f"rank {self.rank}: {error}" if error else None) if e]
            if errors:
                self._discard(pending.partial)
                raise CheckpointError(
                    f"checkpoint {pending.partial}: the background write failed ({errors[0]}); the previous "
                    "checkpoint is intact"
                )
            pending.write.finalize()
        if pending.test_hook is not None:
            pending.test_hook("before_manifest")
        self._write_manifest(pending.partial)
        if pending.test_hook is not None:
            pending.test_hook("in_save")
        self._agreed(pending.partial, "marking it complete", pending.complete)
        return pending.partial.with_name(pending.partial.name.removesuffix(".partial"))

    def _agreed(self, partial: Path, what: str, write: Callable[[], None]) -> None:
        """Run this rank's part of a save phase, then agree (collective, and a barrier): an OSError on any rank (a
        full disk, a lost mount) becomes the same CheckpointError on every rank, instead of one rank's traceback
        while the others wait in the next barrier. The previous checkpoint is untouched: only `.partial` was written."""
        error = None
        try:
            write()
        except BaseException as raised:  # torch's CheckpointException is a BaseException wrapping each rank's error
            err = os_error_in(raised)
            if err is None:
                raise
            error = f"{what} failed on rank {self.rank}: {err.strerror or err}" + (
                f" ({err.filename})" if err.filename else ""
            )
        self.barrier()
        errors = [e for e in self.gather(error) if e]
        if errors:
            self._discard(partial)
            raise CheckpointError(
                f"checkpoint {partial}: {errors[0]}; the previous checkpoint is intact (free the space and resume); "
                f"{partial.name} removed"
            )

    def _discard(self, partial: Path) -> None:
        """Remove a save that failed (rank 0, after every rank agreed): a full disk keeps none of its space."""
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)

    def _write_manifest(self, path: Path) -> None:
        """Hash every file of the checkpoint (rank r takes files r, r + world, ...); rank 0 writes MANIFEST.json."""
        names = checkpoint_files(path)
        items = self.layout(path) if self.layout is not None else {}
        parts = self.gather(hash_files(path, names[self.rank :: self.world_size], items))

        def write() -> None:
            if self.rank == 0:
                files: dict[str, dict[str, Any]] = {}
                for part in parts:
                    files.update(part)
                files.update(hash_files(path, [n for n in names if n not in files], items))  # a rank saw fewer files
                version = 2 if items else 1  # 2: tensor files carry item hashes
                manifest = {"version": version, "algorithm": "sha256", "files": dict(sorted(files.items()))}
                tmp = path / (MANIFEST + ".tmp")
                tmp.write_text(json.dumps(manifest, indent=1) + "\n")
                os.replace(tmp, path / MANIFEST)

        self._agreed(path, "writing its manifest", write)

    def verify(self, path: str | Path) -> list[str]:
        """Problems of a checkpoint (empty: usable), the same list on every rank (collective when gather is set).

        Checks the COMPLETE marker and the size and sha256 of every file MANIFEST.json lists (split over the ranks);
        files with item hashes (the actor's tensor files) only by size: their bytes are checked as the load reads them
        (`item_hashes`), and a mismatch there fails the load instead.
        No manifest: one problem naming checkpoint.allow_unverified, or, with it set, none and a warning through `log`.
        A checkpoint without problems then goes through `check_pickles`, whose CheckpointError propagates: a file that
        would run code is no damage to fall back from (someone wrote it; the manifest is no signature), so it stops.
        """
        path = Path(path)
        if not path.is_dir():
            return [f"{path} does not exist"]
        if not (path / COMPLETE).exists():
            return [f"no {COMPLETE} marker (an interrupted save)"]
        if (path / MANIFEST).exists():
            problems = self._check_manifest(path)
        elif self.allow_unverified:
            self.log(f"checkpoint {path}: {NO_MANIFEST}; loading it unverified (checkpoint.allow_unverified)")
            problems = []
        else:
            return [f"{NO_MANIFEST}; set checkpoint.allow_unverified=true to load it unverified"]
        if not problems and self.check_pickles is not None:
            self.check_pickles(path)
        return problems

    def _check_manifest(self, path: Path) -> list[str]:
        """Problems of the checkpoint against MANIFEST.json (rank r re-hashes files r, r + world, ...); collective. A
        manifest of the wrong shape, or one that leaves out a file the checkpoint holds (an empty list verifies
        nothing), is a problem like a damaged file: the checkpoint is corrupt and resume falls back past it."""
        try:
            expected = manifest_files(json.loads((path / MANIFEST).read_text()))
        except (OSError, ValueError) as err:
            return [f"{MANIFEST} is malformed ({first_line(err)})"]
        unlisted = sorted(set(checkpoint_files(path)) - set(expected))
        if unlisted:
            more = f" (+{len(unlisted) - 3} more)" if len(unlisted) > 3 else ""
            return [f"{MANIFEST} does not list {', '.join(unlisted[:3])}{more}"]
        names = sorted(expected)
        mine = names[self.rank :: self.world_size]
        found = self.gather(check_files(path, expected, mine, items_at_load=not self.deep))
        return [p for part in found for p in part]

    def item_hashes(self, path: str | Path, subdir: str) -> ItemHashes | None:
        """The item hashes MANIFEST.json holds for the files under checkpoint `path`'s `subdir`, keyed by their path in
        it (None: the manifest has none, e.g. saved before them; the files were then re-hashed whole by `verify`)."""
        try:
            files = json.loads((Path(path) / MANIFEST).read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        prefix = subdir.rstrip("/") + "/" if subdir else ""
        out: ItemHashes = {}
        for name, entry in files.items():
            if name.startswith(prefix) and isinstance(entry, dict) and "items" in entry:
                out[name[len(prefix) :]] = {(int(o), int(n)): str(h) for o, n, h in entry["items"]}
        return out or None

    def seal(self, path: str | Path) -> None:
        """Make a directory written outside `save` (`megatron-dapo convert --to megatron`'s output) verifiable: its
        MANIFEST.json (every file hashed, tensor files item by item with `layout`) and its COMPLETE marker. Collective
        when gather is set; rank 0 writes."""
        path = Path(path)
        self.barrier()
        self._write_manifest(path)
        if self.rank == 0:
            (path / COMPLETE).write_text("converted\n")
        self.barrier()

    def find_resumable(self, before: int | None = None) -> Path | None:
        """The newest complete checkpoint that verifies (None if there is none at all); each newer one that fails is
        logged by name with its problems. Raises CheckpointError if checkpoints exist but none verifies. before: only
        checkpoints of earlier steps (a fallback after the newest failed while loading)."""
        candidates = [p for p in list_checkpoints(self.root) if before is None or step_of(p) < before]
        if self.root.is_dir() and before is None:
            newest = int(candidates[-1].name[len(PREFIX) :]) if candidates else -1
            for p in sorted(self.root.glob(f"{PREFIX}*")):
                step = p.name[len(PREFIX) :].split(".")[0]
                if p.is_dir() and p not in candidates and step.isdigit() and int(step) > newest:
                    self.log(f"checkpoint {p} is incomplete (no {COMPLETE} marker: an interrupted save); ignored")
        rejected, unverified = [], False
        for path in reversed(candidates):
            problems = self.verify(path)
            if not problems:
                if rejected:
                    self.log(f"resuming from {path}, the newest checkpoint that verifies")
                return path
            rejected.append(path.name)
            more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
            what = "is corrupt"
            if problems[0].startswith(NO_MANIFEST):
                what, unverified = "cannot be verified", True
            self.log(f"checkpoint {path} {what}: {'; '.join(problems[:3])}{more}; trying the previous one")
        if rejected:
            opt_in = "set checkpoint.allow_unverified=true to load one without a manifest, " if unverified else ""
            raise CheckpointError(
                f"{self.root}: no usable checkpoint ({', '.join(rejected)} failed verification); {opt_in}"
                f"set checkpoint.resume=never to start over, or point checkpoint.resume at a checkpoint"
            )
        return None

    def check_config(self, path: str | Path, config: dict[str, Any], *, moe: bool = False) -> None:
        """CheckpointError naming every field of `config` that cannot change when resuming from `path` (moe: see
        check_compatible)."""
        try:
            saved = yaml.safe_load((Path(path) / "config.yaml").read_text())
        except (OSError, yaml.YAMLError) as err:
            raise CheckpointError(f"{path}: config.yaml cannot be read ({str(err).splitlines()[0]})") from None
        check_compatible(saved, config, str(path), moe=moe)

    def load(
        self,
        path: str | Path,
        config: dict[str, Any],
        load_actor: Callable[[Path, ItemHashes | None], None] | None = None,
    ) -> dict[str, Any]:
        """Check config compatibility, restore the actor, this rank's RNG states; return the trainer state.

        load_actor(actor dir, its item hashes or None) loads the actor, checking the items' bytes as it reads them.
        The caller verifies first (`verify` / `find_resumable`); a missing marker is still refused here."""
        path = Path(path)
        if not (path / COMPLETE).exists():
            raise CheckpointError(f"{path}: not a complete checkpoint (no {COMPLETE} marker)")
        self.check_config(path, config)
        if load_actor is not None:
            load_actor(path / "actor", self.item_hashes(path, "actor"))  # restores this rank's RNG states too
        import torch

        return torch.load(path / "trainer_state.pt", weights_only=True)


@dataclass(slots=True)
class _Begun:
    """A save between `begin` (its directory and actor files) and `complete` (its trainer state)."""

    step: int
    partial: Path
    write: Any
    test_hook: Callable[[str], None] | None


@dataclass(slots=True)
class _Pending:
    """A save between its writes and its completion (Checkpointer.finish_pending)."""

    partial: Path
    complete: Callable[[], None]
    write: Any
    """The actor's background write (wait() -> error text or None; finalize(), collective), or None."""
    test_hook: Callable[[str], None] | None


def os_error_in(err: BaseException) -> OSError | None:
    """The file-system OSError behind `err` (itself, its cause or context, or a failure that torch's distributed
    checkpoint gathered from a rank: CheckpointException.failures), or None when there is none: a bug, or a lost peer
    (ConnectionError, TimeoutError), which must end the job as it is rather than wait in the save's next barrier."""
    seen: set[int] = set()
    todo: list[Any] = [err]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, (ConnectionError, TimeoutError)):
            return None
        if isinstance(e, OSError):
            return e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]
    return None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verified_actor_checkpoint(
    path: str | Path, *, allow_unverified: bool, log: Callable[[str], None], check_pickles: Callable[[Path], None]
) -> tuple[Path, ItemHashes | None]:
    """A Megatron checkpoint given by hand (`megatron-dapo convert --to hf --checkpoint`), verified as a resume would:
    a run's step directory (MANIFEST.json beside actor/), its actor/ directory, or a directory `seal`ed by
    `convert --to megatron`. Returns (the directory the actor loads, its item hashes for a verified load);
    CheckpointError (one line) when it does not verify, or has no manifest and allow_unverified is off."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: {'not a directory' if path.exists() else 'does not exist'}")
    if (path / MANIFEST).exists() and (path / "actor").is_dir():
        root, sub = path, "actor"
    elif (path.parent / MANIFEST).exists() and path.parent.name.startswith(PREFIX):
        root, sub = path.parent, path.name
    else:
        root, sub = path, ""
    checker = CheckpointManager(
        root.parent, keep_last=0, log=log, allow_unverified=allow_unverified,
        check_pickles=lambda _: check_pickles(root / sub if sub else root),
    )  # fmt: skip
    if root == path and not (path / COMPLETE).exists() and not (path / MANIFEST).exists():  # never sealed
        if not allow_unverified:
            raise CheckpointError(f"checkpoint {path}: {NO_MANIFEST}; set checkpoint.allow_unverified=true to load it")
        log(f"checkpoint {path}: {NO_MANIFEST}; loading it unverified (checkpoint.allow_unverified)")
        check_pickles(path)
        return path, None
    problems = checker.verify(root)
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"checkpoint {root}: {'; '.join(problems[:3])}{more}")
    return (root / sub if sub else root), checker.item_hashes(root, sub)


def seal_hf_export(path: str | Path) -> None:
    """Seal a Hugging Face export written by this package (the trainer's hf_final, `convert --to hf`): MANIFEST.json
    with every file's size and sha256, and the COMPLETE marker, so that `verified_hf_model` checks it. One process
    (the rank that wrote it)."""
    CheckpointManager(Path(path).parent, keep_last=0).seal(path)


def verified_hf_model(path: str | Path, *, log: Callable[[str], None]) -> Path:
    """A Hugging Face model directory to load (`megatron-dapo eval --model`): an export of this package is verified as
    a checkpoint is (its MANIFEST.json: every file listed, sizes and sha256s; one CheckpointError line naming what
    fails); a directory with neither manifest nor marker is a model from elsewhere (the base model) and loads as it
    is, with a notice. A Megatron checkpoint, a missing path or a file is one line saying so."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model {path}: {'not a directory' if path.exists() else 'does not exist'}")
    if (path / "actor").is_dir() or (path / ".metadata").is_file():
        raise CheckpointError(
            f"model {path}: a Megatron checkpoint, not a Hugging Face model; export it with `megatron-dapo convert "
            "--to hf --checkpoint DIR --out HF_DIR`"
        )
    if not (path / MANIFEST).exists() and not (path / COMPLETE).exists():
        log(f"model {path}: no {MANIFEST} (not an export of this package); loaded as it is")
        return path
    problems = CheckpointManager(path.parent, keep_last=0).verify(path)
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"model {path}: {'; '.join(problems[:3])}{more}")
    return path


class PreemptionFlag:
    """SIGTERM / SIGUSR1 set a flag instead of killing the process; the trainer saves at the next step boundary.

    `install()` must run in the main thread. `requested(all_reduce_max)` combines the flag across ranks so every
    rank stops at the same step (pass a function doing a MAX all-reduce of a 0/1 tensor, or None for one process).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.flag = False
        self.signum: int | None = None
        self.received_at: float | None = None
        """time.monotonic() of the first signal (how much of the grace period a long step used)."""

    def install(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        if not self.flag:
            self.received_at = time.monotonic()
        self.flag = True
        self.signum = signum

    def notice(self, grace_s: float) -> str:
        """The step boundary's line once a preemption is agreed: who got the signal, and how long before the boundary
        against checkpoint.preempt_grace_s (the launcher's SIGTERM -> SIGKILL window)."""
        if self.received_at is None:
            return "a peer rank got a preemption signal; saving at this step boundary"
        waited = time.monotonic() - self.received_at
        name = signal.Signals(self.signum).name if self.signum else "signal"
        late = (
            ""
            if waited < grace_s
            else f" (past checkpoint.preempt_grace_s={grace_s:g}: the launcher may kill the save)"
        )
        return f"{name} came {waited:.1f} s before this step boundary; saving, then exiting{late}"

    def requested(self, all_reduce_max: Callable[[Any], Any] | None = None) -> bool:
        """Whether a preemption signal reached this rank or, with all_reduce_max (a MAX all-reduce of an int64
        tensor over the ranks), any rank (collective)."""
        import torch

        local = torch.tensor([1 if self.flag else 0], dtype=torch.int64)
        if all_reduce_max is not None:
            local = all_reduce_max(local)
        return bool(local.item())
