"""No code from checkpoint files, with or without a manifest (issue 20).

A resume unpickles three kinds of file in the actor's directory (megatron_dapo/actor/safe_unpickle.py): `.metadata`
(torch distributed-checkpoint metadata, a plain pickle.load), megatron's `common.pt` (torch.load, weights-only only by
default) and the byte items inside the `.distcp` shards (torch.load(weights_only=False)). Each crafted payload below
is first shown to run through the unguarded torch / megatron call, then the guarded resume refuses it by file name,
with the manifest forged (re-hashed) or deleted with checkpoint.allow_unverified, and the payload stays unrun. Real
checkpoints, plain and distributed optimizer, written and resumed on one gloo rank, still load.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.metadata import Metadata

from megatron_dapo.actor.safe_unpickle import ALLOWED_GLOBALS
from megatron_dapo.actor.safe_unpickle import check_dist_checkpoint
from megatron_dapo.actor.safe_unpickle import load_dcp_metadata
from megatron_dapo.checkpoint import MANIFEST
from megatron_dapo.checkpoint import CheckpointError
from megatron_dapo.checkpoint import CheckpointManager
from megatron_dapo.checkpoint import checkpoint_files
from megatron_dapo.checkpoint import hash_files
from megatron_dapo.dev.tiny import make_tiny_run
from megatron_dapo.launch import StartupError
from tests.actor._dist import run_distributed
from tests.actor._tiny_models import make_tiny_qwen2
from tests.reliability.test_actor_faults import _batch
from tests.reliability.test_actor_faults import _config
from tests.reliability.test_actor_faults import _Evil
from tests.reliability.test_actor_faults import _weights
from tests.reliability.test_data_identity import Startup
from tests.reliability.test_data_identity import tiny_config

STEP = "step_00000001"


def _cfg(hf_dir: str) -> dict:
    return {"actor": {"model_path": hf_dir}}


def _resume_worker(hf_dir: str, work: str) -> dict:
    """Save a real checkpoint (plain and distributed optimizer) the trainer's way and resume it into a fresh actor;
    then load a copy with a crafted .metadata through MegatronActor.load_checkpoint itself."""
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.distributed import init_distributed

    groups = init_distributed(1, 1)
    out: dict = {}
    for dist_opt in (False, True):
        actor = MegatronActor(_config(hf_dir, dist_opt=dist_opt), groups, hf_dir=hf_dir)
        batch = _batch()
        batch.old_logp, _ = actor.compute_logprobs(batch)
        actor.update(batch)
        mgr = CheckpointManager(
            f"{work}/ck_{dist_opt}",
            keep_last=1,
            check_pickles=lambda p: MegatronActor.check_checkpoint(p / "actor"),
            layout=lambda p: {f"actor/{k}": v for k, v in MegatronActor.checkpoint_items(p / "actor").items()},
        )
        mgr.save(1, {"step": 1}, _cfg(hf_dir), lambda d: actor.save_checkpoint(str(d)))  # noqa: B023
        resumed = MegatronActor(_config(hf_dir, dist_opt=dist_opt), groups)  # random init, then the checkpoint

        def load(d, items, into=resumed):  # the items' bytes are checked as they load
            assert items, "the manifest has no item hashes"
            into.load_checkpoint(str(d), items=items)

        state = mgr.load(mgr.find_resumable(), _cfg(hf_dir), load)
        out[f"identical_{dist_opt}"] = all(torch.equal(a, b) for a, b in zip(_weights(actor), _weights(resumed)))
        out[f"steps_{dist_opt}"] = (state["step"], resumed.steps.num_steps)

    crafted = Path(work) / "crafted_actor"
    shutil.copytree(Path(work) / "ck_True" / STEP / "actor", crafted)
    marker = Path(work) / "pwned_by_actor_load"
    (crafted / ".metadata").write_bytes(pickle.dumps(_Evil(str(marker))))
    try:
        resumed.load_checkpoint(str(crafted))
        out["actor_error"] = None
    except BaseException as err:  # unguarded, torch's CheckpointException (a BaseException) follows
        out["actor_error"] = f"{type(err).__name__}: {err}"
    out["actor_ran"] = marker.exists()
    return out


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> tuple[Path, dict]:
    """(work dir holding ck_False/ and ck_True/, the worker's results)."""
    root = tmp_path_factory.mktemp("pickles")
    hf_dir = str(make_tiny_qwen2(root / "qwen2"))
    (out,) = run_distributed(_resume_worker, 1, hf_dir, str(root), timeout_s=300)
    return root, out


def _copy(real: tuple[Path, dict], dest: Path, dist_opt: bool = True) -> Path:
    """A copy of the real checkpoint (distributed optimizer by default) as dest/ck/step_00000001; returns it."""
    src = real[0] / f"ck_{dist_opt}" / STEP
    shutil.copytree(src, dest / "ck" / STEP)
    return dest / "ck" / STEP


def _forge_manifest(step_dir: Path) -> None:
    """What an attacker does after editing a file: re-hash everything (the manifest is no signature)."""
    files = hash_files(step_dir, checkpoint_files(step_dir))
    (step_dir / MANIFEST).write_text(json.dumps({"version": 1, "algorithm": "sha256", "files": files}))


def _manager(step_dir: Path, allow_unverified: bool = False, lines: list[str] | None = None) -> CheckpointManager:
    """A manager wired as DAPOTrainer wires it: verify() ends with the actor's pickle check."""
    return CheckpointManager(
        step_dir.parent,
        keep_last=1,
        log=(lines if lines is not None else []).append,
        allow_unverified=allow_unverified,
        check_pickles=lambda p: check_dist_checkpoint(p / "actor"),
    )


def _live(run, marker: Path) -> None:
    """The crafted payload really runs through the unguarded call (so the guarded path has something to stop)."""
    try:
        run()
    except Exception:  # the payload ran while unpickling; what follows may fail
        pass
    assert marker.exists(), "the crafted payload did not run unguarded: the test proves nothing"
    marker.rmdir()


def _refused(mgr: CheckpointManager, marker: Path, *names: str) -> str:
    """resume=auto on `mgr` stops (no fallback) with one line naming every one of `names`; nothing ran."""
    with pytest.raises(CheckpointError) as err:
        mgr.find_resumable()
    message = str(err.value)
    assert "\n" not in message and all(n in message for n in names), message
    assert not marker.exists(), "unpickling the checkpoint ran code"
    return message


# ------------------------------------------------------------------------------------------ real checkpoints


@pytest.mark.parametrize("dist_opt", [False, True], ids=["plain_optimizer", "distributed_optimizer"])
def test_real_checkpoints_still_resume(real, dist_opt):
    _, out = real
    assert out[f"steps_{dist_opt}"] == (1, 1)
    assert out[f"identical_{dist_opt}"], "the resumed weights differ from the saved ones"


def test_real_metadata_needs_nothing_outside_the_allowlist(real, tmp_path):
    for dist_opt in (False, True):
        actor = real[0] / f"ck_{dist_opt}" / STEP / "actor"
        with open(actor / ".metadata", "rb") as f:
            assert load_dcp_metadata(actor / ".metadata") == pickle.load(f)
        check_dist_checkpoint(actor)
        assert any(
            isinstance(v, BytesStorageMetadata)
            for v in load_dcp_metadata(actor / ".metadata").state_dict_metadata.values()
        )
    assert ("builtins", "eval") not in ALLOWED_GLOBALS and ("os", "system") not in ALLOWED_GLOBALS


# ------------------------------------------------------------------------------------------ crafted .metadata


def test_crafted_metadata_with_a_forged_manifest_runs_nothing(real, tmp_path):
    step_dir = _copy(real, tmp_path)
    marker = tmp_path / "pwned"
    (step_dir / "actor" / ".metadata").write_bytes(pickle.dumps(_Evil(str(marker))))
    _live(lambda: FileSystemReader(str(step_dir / "actor")).read_metadata(), marker)  # what megatron's load calls
    _forge_manifest(step_dir)
    message = _refused(_manager(step_dir), marker, f"{STEP}/actor/.metadata", "refused to unpickle 'os.makedirs'")
    assert message.startswith("checkpoint ") and "not a checkpoint metadata class" in message
    # MegatronActor.load_checkpoint runs the same check itself, before megatron reads anything.
    _, out = real
    assert not out["actor_ran"], "MegatronActor.load_checkpoint ran code from the checkpoint"
    assert str(out["actor_error"]).startswith("CheckpointError: checkpoint "), out["actor_error"]
    assert "crafted_actor/.metadata: refused to unpickle 'os.makedirs'" in out["actor_error"]


def test_crafted_metadata_without_a_manifest_runs_nothing_even_when_allowed(real, tmp_path):
    step_dir = _copy(real, tmp_path)
    marker = tmp_path / "pwned"
    (step_dir / "actor" / ".metadata").write_bytes(pickle.dumps(_Evil(str(marker))))
    (step_dir / MANIFEST).unlink()
    lines: list[str] = []
    _refused(_manager(step_dir, allow_unverified=True, lines=lines), marker, "actor/.metadata", "'os.makedirs'")
    assert len(lines) == 1 and "loading it unverified" in lines[0], lines
    # Without the opt-in the checkpoint is not used at all: nothing of it is unpickled.
    with pytest.raises(CheckpointError, match="checkpoint.allow_unverified=true"):
        _manager(step_dir).find_resumable()
    assert not marker.exists()


def test_crafted_metadata_inside_a_real_record_runs_nothing(real, tmp_path):
    step_dir = _copy(real, tmp_path)
    marker = tmp_path / "pwned"
    with open(step_dir / "actor" / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the real file: trusted here
    metadata.planner_data = {"hint": _Evil(str(marker))}
    (step_dir / "actor" / ".metadata").write_bytes(pickle.dumps(metadata))
    _forge_manifest(step_dir)
    _refused(_manager(step_dir), marker, "actor/.metadata", "'os.makedirs'")


def test_start_up_refuses_a_crafted_metadata_in_one_line(real, tmp_path):
    """The trainer's resume (checkpoint.resume=auto, inside its start-up step): one line on every rank, exit 2 under
    the CLI; the manager is wired as the trainer wires it."""
    from megatron_dapo.actor.actor import MegatronActor

    tiny = make_tiny_run(tmp_path / "tiny", num_train=8, num_test=2)
    config = tiny_config(tiny, tmp_path / "run")
    marker = tmp_path / "pwned"

    def crafted_actor(d: Path) -> None:
        shutil.copytree(real[0] / "ck_True" / STEP / "actor", d)
        (d / ".metadata").write_bytes(pickle.dumps(_Evil(str(marker))))

    first = Startup(config)
    first.step = 1
    first.ckpt.save(1, first.trainer_state(), config.to_dict(), crafted_actor)  # a manifest over the crafted file
    ckpt = CheckpointManager(first.ckpt.root, 2, check_pickles=lambda p: MegatronActor.check_checkpoint(p / "actor"))
    with pytest.raises(StartupError) as err:
        Startup(config, ckpt).find()
    assert "\n" not in str(err.value) and str(err.value).startswith("checkpoint "), str(err.value)
    assert f"{STEP}/actor/.metadata: refused to unpickle 'os.makedirs'" in str(err.value)
    assert not marker.exists()


# ------------------------------------------------------------------------------------------ the other pickles


@pytest.mark.filterwarnings("ignore:Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
def test_crafted_common_state_runs_nothing_even_with_weights_only_forced_off(real, tmp_path, monkeypatch):
    step_dir = _copy(real, tmp_path, dist_opt=False)
    marker = tmp_path / "pwned"
    common = step_dir / "actor" / "common.pt"
    state = torch.load(common, weights_only=True)
    state["optimizer"]["param_groups"][0]["lr"] = _Evil(str(marker))
    torch.save(state, common)
    # megatron loads it with torch.load(path, map_location='cpu') (strategies/common.py): weights-only by default,
    # a full pickle when this variable is set (some users set it for older checkpoints of other tools).
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    _live(lambda: torch.load(common, map_location="cpu"), marker)
    _forge_manifest(step_dir)
    _refused(_manager(step_dir), marker, f"{STEP}/actor/common.pt", "refused to unpickle 'os.makedirs'")


def test_crafted_byte_item_in_a_shard_runs_nothing(real, tmp_path):
    """torch's planner unpickles ShardedObjects (here the distributed optimizer's param groups and each layer's
    _extra_state) with torch.load(weights_only=False) (default_planner.py, load_bytes)."""
    step_dir = _copy(real, tmp_path)
    marker = tmp_path / "pwned"
    actor = step_dir / "actor"
    with open(actor / ".metadata", "rb") as f:
        metadata: Metadata = pickle.load(f)
    index = next(
        i for i in metadata.storage_data if isinstance(metadata.state_dict_metadata[i.fqn], BytesStorageMetadata)
    )
    payload = io.BytesIO()
    torch.save([_Evil(str(marker))], payload)
    _live(lambda: torch.load(io.BytesIO(payload.getvalue()), weights_only=False), marker)
    shard = actor / metadata.storage_data[index].relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    metadata.storage_data[index] = _StorageInfo(shard.name, offset, len(payload.getvalue()))
    (actor / ".metadata").write_bytes(pickle.dumps(metadata))  # only metadata classes: passes the first check
    _forge_manifest(step_dir)
    _refused(_manager(step_dir), marker, f"actor/{shard.name} (item '{index.fqn}'", "refused to unpickle 'os.makedirs'")


# ------------------------------------------------------------------------------------------ the unpickler itself


def _metadata_file(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / ".metadata"
    path.write_bytes(data)
    return path


def test_unpickler_refuses_setting_attributes_of_a_class(tmp_path):
    # GLOBAL Metadata; state (None, {"__eq__": None}); BUILD: would set Metadata.__eq__ for the whole process.
    data = b"\x80\x04ctorch.distributed.checkpoint.metadata\nMetadata\nN}\x8c\x06__eq__Ns\x86b."
    with pytest.raises(
        CheckpointError, match=r"\.metadata: refused to unpickle: it sets the state of a 'builtins\.type'"
    ):
        load_dcp_metadata(_metadata_file(tmp_path, data))
    assert Metadata.__eq__ is not None


def test_unpickler_refuses_extension_codes_and_persistent_ids(tmp_path):
    with pytest.raises(CheckpointError, match="extension code"):
        load_dcp_metadata(_metadata_file(tmp_path, b"\x80\x04\x82\x01."))  # EXT1 1
    with pytest.raises(CheckpointError, match="not torch distributed-checkpoint metadata"):
        load_dcp_metadata(_metadata_file(tmp_path, b"\x80\x04\x8c\x01xQ."))  # BINPERSID


def test_unreadable_or_foreign_metadata_is_one_line(real, tmp_path):
    data = (real[0] / "ck_True" / STEP / "actor" / ".metadata").read_bytes()
    with pytest.raises(CheckpointError, match=r"not torch distributed-checkpoint metadata \(\w+Error"):
        load_dcp_metadata(_metadata_file(tmp_path, data[: len(data) // 2]))
    with pytest.raises(CheckpointError, match="holds a dict, not torch distributed-checkpoint Metadata"):
        load_dcp_metadata(_metadata_file(tmp_path, pickle.dumps({"state_dict_metadata": {}})))
    os.remove(tmp_path / ".metadata")
    with pytest.raises(CheckpointError, match=r"no \.metadata"):
        check_dist_checkpoint(tmp_path)
