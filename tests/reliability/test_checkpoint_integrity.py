"""Checkpoint integrity (issue 12, item 6): per-file sha256 in MANIFEST.json, verified before resuming.

Probe cases: 0x40 bytes written into a shard of the newest checkpoint loaded silently and changed the weights; a
shard missing from it failed deep inside the loader without the checkpoint's name and never fell back. Now each is
reported by name and `find_resumable` (checkpoint.resume=auto) takes the previous checkpoint, logged. The same on a
real 2-rank run is in test_run_faults.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_dapo.checkpoint import MANIFEST
from megatron_dapo.checkpoint import CheckpointError
from megatron_dapo.checkpoint import CheckpointManager

SHARD = "actor/__0_0.distcp"
CFG = {"actor": {"model_path": "m"}}


def _save_actor(step: int):
    def save(d: Path) -> None:
        d.mkdir(parents=True)
        # A .distcp shard holds raw tensor bytes, so bytes written into it change weights without any read error.
        (d / SHARD.split("/")[1]).write_bytes(torch.full((64, 64), float(step)).numpy().tobytes())
        (d / ".metadata").write_bytes(b"meta" * 10)

    return save


@pytest.fixture
def two_checkpoints(tmp_path):
    lines: list[str] = []
    mgr = CheckpointManager(tmp_path / "ck", keep_last=3, log=lines.append)
    for step in (1, 2):
        mgr.save(step, {"step": step}, CFG, _save_actor(step))
    return mgr, lines


def test_manifest_lists_every_file_with_size_and_sha256(two_checkpoints):
    mgr, lines = two_checkpoints
    manifest = json.loads((mgr.root / "step_00000002" / MANIFEST).read_text())
    assert sorted(manifest["files"]) == ["actor/.metadata", SHARD, "config.yaml", "trainer_state.pt"]
    assert all(len(v["sha256"]) == 64 and v["size"] > 0 for v in manifest["files"].values())
    assert mgr.verify(mgr.root / "step_00000002") == [] and lines == []
    assert mgr.find_resumable().name == "step_00000002"


def _corrupt(path: Path, offset: int = 200) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\x40" * 0x40)


def test_bytes_written_into_a_shard_fall_back_to_the_previous_checkpoint_by_name(two_checkpoints):
    mgr, lines = two_checkpoints
    _corrupt(mgr.root / "step_00000002" / SHARD)
    raw = torch.frombuffer(bytearray((mgr.root / "step_00000002" / SHARD).read_bytes()), dtype=torch.float32)
    assert (raw != 2.0).sum() == 16  # the weights changed and nothing else can tell
    assert mgr.find_resumable().name == "step_00000001"
    assert any(f"step_00000002 is corrupt: {SHARD} fails its sha256 check" in x for x in lines), lines
    assert any("resuming from" in x and "step_00000001" in x for x in lines), lines
    assert mgr.load(mgr.find_resumable(), CFG)["step"] == 1


def test_missing_or_truncated_shard_is_reported_by_name(two_checkpoints):
    mgr, lines = two_checkpoints
    (mgr.root / "step_00000002" / SHARD).unlink()
    (mgr.root / "step_00000001" / "actor" / ".metadata").write_bytes(b"meta")
    with pytest.raises(CheckpointError) as err:
        mgr.find_resumable()
    assert "step_00000002, step_00000001 failed verification" in str(err.value)
    assert any(f"step_00000002 is corrupt: {SHARD} is missing" in x for x in lines), lines
    assert any("actor/.metadata has 4 bytes, the manifest says 40" in x for x in lines), lines


def test_interrupted_newer_save_is_named_and_skipped(two_checkpoints):
    mgr, lines = two_checkpoints
    (mgr.root / "step_00000003.partial").mkdir()
    (mgr.root / "step_00000004").mkdir()  # copied without its marker
    assert mgr.find_resumable().name == "step_00000002"
    assert sum("is incomplete" in x for x in lines) == 2 and "step_00000004" in lines[1], lines


def test_checkpoint_without_manifest_is_not_used_unless_allowed(two_checkpoints):
    mgr, lines = two_checkpoints
    (mgr.root / "step_00000002" / MANIFEST).unlink()
    # checkpoint.resume=auto: not usable, the previous (verified) one is taken, and the line names the opt-in.
    assert mgr.find_resumable().name == "step_00000001"
    assert len(lines) == 2 and "step_00000002 cannot be verified: no MANIFEST.json (copied without it" in lines[0]
    assert "set checkpoint.allow_unverified=true to load it unverified; trying the previous one" in lines[0]
    assert "resuming from" in lines[1] and "step_00000001" in lines[1], lines
    # checkpoint.resume=<path> (the trainer joins the problems into one line): the same reason.
    assert mgr.verify(mgr.root / "step_00000002") == [
        "no MANIFEST.json (copied without it, or saved before manifests existed); "
        "set checkpoint.allow_unverified=true to load it unverified"
    ]
    # None left: one line naming the opt-in.
    (mgr.root / "step_00000001" / MANIFEST).unlink()
    with pytest.raises(CheckpointError) as err:
        mgr.find_resumable()
    assert "\n" not in str(err.value) and "step_00000002, step_00000001 failed verification" in str(err.value)
    assert "set checkpoint.allow_unverified=true to load one without a manifest" in str(err.value)


def test_checkpoint_without_manifest_loads_with_a_warning_when_allowed(two_checkpoints):
    mgr, lines = two_checkpoints
    (mgr.root / "step_00000002" / MANIFEST).unlink()
    mgr.allow_unverified = True
    assert mgr.find_resumable().name == "step_00000002"
    assert len(lines) == 1 and "step_00000002: no MANIFEST.json (copied without it" in lines[0], lines
    assert "loading it unverified (checkpoint.allow_unverified)" in lines[0]
    assert mgr.load(mgr.find_resumable(), CFG)["step"] == 2


def test_disk_full_during_a_save_is_one_error_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """A full disk while the trainer state is written (issue 20, item 5): one CheckpointError naming the phase, the
    rank and the file, raised on every rank after they agree (here one); the previous checkpoint still verifies."""
    import errno

    manager = CheckpointManager(tmp_path / "ckpt", keep_last=2)
    manager.save(1, {"step": 1}, {"trainer": {}})
    real = Path.write_text

    def full(self, *args, **kwargs):
        if self.name == "config.yaml":
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(CheckpointError) as err:
        manager.save(2, {"step": 2}, {"trainer": {}})
    monkeypatch.undo()
    assert "step_00000002.partial: writing the trainer state failed on rank 0: No space left on device (" in str(
        err.value
    )
    assert "config.yaml); the previous checkpoint is intact" in str(err.value)
    assert manager.find_resumable() == tmp_path / "ckpt" / "step_00000001"


_FULL_DISK = """
import resource, signal, sys
from pathlib import Path
import torch
import torch.distributed.checkpoint as dcp
from megatron_dapo.checkpoint import CheckpointError, CheckpointManager

root = Path(sys.argv[1])
manager = CheckpointManager(root, keep_last=2)
manager.save(1, {"step": 1}, {"trainer": {}}, lambda d: dcp.save({"w": torch.ones(16)}, checkpoint_id=d))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    manager.save(2, {"step": 2}, {"trainer": {}}, lambda d: dcp.save({"w": torch.ones(1 << 20)}, checkpoint_id=d))
except CheckpointError as err:
    print("ERROR", err)
print("LEFT", sorted(p.name for p in root.iterdir()))
print("RESUMES", manager.find_resumable().name)
"""


def test_a_file_system_error_inside_the_actors_collective_write_is_one_line_and_leaves_nothing(tmp_path):
    """Issue 38 item 4: a full disk inside megatron's own write (torch's distributed checkpoint, which gathers each
    rank's failure into a CheckpointException) was a traceback and left `.partial` behind. Here a real write hits the
    process's file-size limit (EFBIG, as ENOSPC would): one CheckpointError naming the phase and the error, the
    `.partial` removed, the previous checkpoint the one to resume from."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FULL_DISK,
                           str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=120)  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
    error = next(line for line in out.splitlines() if line.startswith("ERROR"))
    assert "step_00000002.partial: writing the actor's files failed on rank 0: File too large" in error, error
    assert "the previous checkpoint is intact" in error and "step_00000002.partial removed" in error
    assert "LEFT ['step_00000001']" in out and "RESUMES step_00000001" in out, out


def test_a_failed_background_write_is_one_line_and_leaves_nothing(tmp_path):
    """checkpoint.async_save: the write's error comes at the next step boundary (finish_pending): one line, and the
    `.partial` removed there too."""

    class FailedWrite:
        def wait(self):
            return "OSError: [Errno 28] No space left on device"

        def finalize(self):
            raise AssertionError("never finalised")

    manager = CheckpointManager(tmp_path / "ckpt", keep_last=2)
    manager.save(1, {"step": 1}, {"trainer": {}})
    manager.save(2, {"step": 2}, {"trainer": {}}, lambda d, background=False: FailedWrite(), background=True)
    with pytest.raises(CheckpointError, match=r"the background write failed \(rank 0: OSError: \[Errno 28\] No space"):
        manager.finish_pending()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000001"]


def test_an_error_that_is_not_the_file_systems_propagates_from_the_save(tmp_path):
    """Only file-system errors become the one-line CheckpointError: a bug in the actor's save, or a lost peer
    (ConnectionError), ends the job as it is."""
    from megatron_dapo.checkpoint import os_error_in

    manager = CheckpointManager(tmp_path / "ckpt", keep_last=2)
    with pytest.raises(ZeroDivisionError):
        manager.save(1, {"step": 1}, {"trainer": {}}, lambda d: 1 / 0)
    with pytest.raises(ConnectionResetError):
        manager.save(1, {"step": 1}, {"trainer": {}}, lambda d: (_ for _ in ()).throw(ConnectionResetError(104, "x")))
    wrapped = RuntimeError("write failed")
    wrapped.__cause__ = OSError(28, "No space left on device")
    assert os_error_in(wrapped).errno == 28 and os_error_in(RuntimeError("x")) is None


def _manifest_variants(good: dict) -> dict[str, object]:
    """A family of wrong manifests (issue 38 item 2): every field with wrong types and values, and lists that leave
    files out. Each must make the checkpoint corrupt (one line) so resume falls back to the previous one."""
    files, name = good["files"], SHARD
    entry = files[name]
    digest = entry["sha256"]
    variants: dict[str, object] = {
        "empty files": {**good, "files": {}},
        "a file left out": {**good, "files": {k: v for k, v in files.items() if k != name}},
        "not a dict": [good],
        "null": None,
        "an extra key": {**good, "signature": "x"},
        "no files key": {k: v for k, v in good.items() if k != "files"},
        "files a list": {**good, "files": list(files)},
        "version 3": {**good, "version": 3},
        "version as text": {**good, "version": "2"},
        "version true": {**good, "version": True},
        "algorithm md5": {**good, "algorithm": "md5"},
        "absolute name": {**good, "files": {**files, "/etc/passwd": entry}},
        "escaping name": {**good, "files": {**files, "../x": entry}},
        "entry a list": {**good, "files": {**files, name: [entry["size"], digest]}},
        "entry without size": {**good, "files": {**files, name: {"sha256": digest}}},
        "entry with an extra key": {**good, "files": {**files, name: {**entry, "owner": 0}}},
        # Item hashes tell verify to leave a file's bytes to the verified load, which reads tensor files only.
        "items on config.yaml": {**good, "files": {**files, "config.yaml": {**files["config.yaml"], "items": []}}},
        "items on the trainer state": {
            **good,
            "files": {**files, "trainer_state.pt": {**files["trainer_state.pt"], "items": [[0, 1, digest]]}},
        },
        "items on .metadata": {
            **good,
            "files": {**files, "actor/.metadata": {**files["actor/.metadata"], "items": []}},
        },
    }
    for field, values in {
        "size": [-1, "64", 1.5, None, True],
        "sha256": ["", "x" * 64, digest.upper(), 5, digest[:63]],
        "items": ["x", [[0, 1]], [[0, -1, digest]], [["0", 1, digest]], [[0, 1, "zz"]]],
    }.items():
        for value in values:
            variants[f"{field}={value!r}"] = {**good, "files": {**files, name: {**entry, field: value}}}
    return variants


def test_every_wrong_manifest_is_corrupt_in_one_line_and_resume_falls_back(two_checkpoints):
    mgr, lines = two_checkpoints
    path = mgr.root / "step_00000002" / MANIFEST
    good = json.loads(path.read_text())
    for what, manifest in _manifest_variants(good).items():
        path.write_text(json.dumps(manifest))
        lines.clear()
        problems = mgr.verify(mgr.root / "step_00000002")
        assert len(problems) == 1 and "\n" not in problems[0] and MANIFEST in problems[0], (what, problems)
        assert mgr.find_resumable().name == "step_00000001", what
        assert any("step_00000002 is corrupt" in x for x in lines), (what, lines)
    path.write_text("{not json")
    assert "MANIFEST.json is malformed" in mgr.verify(mgr.root / "step_00000002")[0]
    path.write_text(json.dumps(good))
    assert mgr.verify(mgr.root / "step_00000002") == []


def test_item_hashes_on_a_file_the_load_does_not_verify_cannot_hide_an_edit(two_checkpoints):
    """The audit's case: a byte of config.yaml flipped and `"items": []` added to its manifest entry verified for
    resume (its bytes left to a load that never reads it through the verified reader) while status's deep check
    refused it. Now both refuse it, and resume falls back."""
    mgr, lines = two_checkpoints
    ckpt = mgr.root / "step_00000002"
    config = ckpt / "config.yaml"
    raw = bytearray(config.read_bytes())
    raw[-2] ^= 1
    config.write_bytes(bytes(raw))
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["files"]["config.yaml"]["items"] = []
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    deep = CheckpointManager(mgr.root, keep_last=3, log=lines.append, deep=True)
    for manager in (mgr, deep):
        problems = manager.verify(ckpt)
        assert problems == [f"{MANIFEST} is malformed (the entry of config.yaml has items (only .distcp tensor files "
                            "have them))"], problems  # fmt: skip
        assert manager.find_resumable().name == "step_00000001"


def test_an_empty_manifest_over_garbage_does_not_verify(two_checkpoints):
    """The probe's case: MANIFEST.json = {"version": 2, "algorithm": "sha256", "files": {}} and garbage in the shard
    verified and trained; now the unlisted files make it corrupt."""
    mgr, lines = two_checkpoints
    ckpt = mgr.root / "step_00000002"
    (ckpt / SHARD).write_bytes(b"\x13" * (ckpt / SHARD).stat().st_size)
    (ckpt / MANIFEST).write_text(json.dumps({"version": 2, "algorithm": "sha256", "files": {}}))
    assert mgr.verify(ckpt)[0].startswith(f"{MANIFEST} does not list {SHARD.split('/')[0]}/")
    assert mgr.find_resumable().name == "step_00000001"
