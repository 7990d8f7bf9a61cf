"""A resume reads each tensor byte once (issue 22 item 5): the manifest hashes every storage item of the actor's
torch_dist files, `verify` checks those files by size, and the load hashes each item as it reads it; a changed byte
fails the load on every rank with one line naming the file and bytes."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest

from megatron_dapo import checkpoint as ckpt_module
from megatron_dapo.checkpoint import MANIFEST
from megatron_dapo.checkpoint import CheckpointManager
from megatron_dapo.checkpoint import file_digests
from megatron_dapo.checkpoint import hash_files
from tests.actor._dist import run_distributed
from tests.actor._tiny_models import make_tiny_qwen2
from tests.reliability.test_actor_faults import _batch
from tests.reliability.test_actor_faults import _config
from tests.reliability.test_actor_faults import _weights


@pytest.mark.parametrize("seed", range(5))
def test_item_hashes_equal_the_hashes_of_their_bytes_in_one_read(tmp_path, monkeypatch, seed):
    """Ranges across read-chunk boundaries, with gaps, empty ones and one past the end's neighbour, in any order."""
    monkeypatch.setattr(ckpt_module, "_HASH_CHUNK", 7)
    rng = random.Random(seed)
    data = bytes(rng.randrange(256) for _ in range(rng.randint(50, 200)))
    path = tmp_path / "f.distcp"
    path.write_bytes(data)
    cuts = sorted(rng.sample(range(len(data) + 1), 8))
    ranges = [(a, b - a) for a, b in zip(cuts[::2], cuts[1::2])] + [(cuts[0], 0)]
    rng.shuffle(ranges)
    whole, parts = file_digests(path, ranges)
    assert whole == hashlib.sha256(data).hexdigest()
    assert parts == [hashlib.sha256(data[o : o + n]).hexdigest() for o, n in ranges]
    entry = hash_files(tmp_path, ["f.distcp"], {"f.distcp": ranges})["f.distcp"]
    assert entry["sha256"] == whole and entry["items"] == [[o, n, h] for (o, n), h in zip(ranges, parts)]


def _worker(hf_dir: str, work: str) -> dict:
    """Save a real actor checkpoint the trainer's way (item hashes in the manifest), resume it counting what verify
    hashes and what the load reads, then change one byte of a tensor item and resume again."""
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.distributed import init_distributed
    from megatron_dapo.actor.verified_load import CorruptItem
    from megatron_dapo.actor.verified_load import verified_reads

    groups = init_distributed(1, 1)
    actor = MegatronActor(_config(hf_dir, dist_opt=True), groups, hf_dir=hf_dir)
    batch = _batch()
    batch.old_logp, _ = actor.compute_logprobs(batch)
    actor.update(batch)
    mgr = CheckpointManager(
        f"{work}/ck",
        keep_last=2,
        check_pickles=lambda p: MegatronActor.check_checkpoint(p / "actor"),
        layout=lambda p: {f"actor/{k}": v for k, v in MegatronActor.checkpoint_items(p / "actor").items()},
    )
    cfg = {"actor": {"model_path": hf_dir}}
    mgr.save(1, {"step": 1}, cfg, lambda d: actor.save_checkpoint(str(d)))
    path = mgr.find_resumable()
    out: dict = {"manifest": json.loads((path / MANIFEST).read_text())}
    out["sizes"] = {p.name: p.stat().st_size for p in (path / "actor").glob("*.distcp")}

    hashed: list[str] = []
    plain = ckpt_module.file_sha256
    ckpt_module.file_sha256 = lambda p: hashed.append(Path(p).name) or plain(p)
    try:
        out["verify"] = mgr.verify(path)
    finally:
        ckpt_module.file_sha256 = plain
    out["hashed_by_verify"] = hashed
    resumed = MegatronActor(_config(hf_dir, dist_opt=True), groups)
    items = mgr.item_hashes(path, "actor")
    with verified_reads(items) as read:
        mgr.load(path, cfg, lambda d, _items: resumed.load_checkpoint(str(d)))
    out["read"] = dict(read)
    out["identical"] = all(a.equal(b) for a, b in zip(_weights(actor), _weights(resumed)))

    # One byte in the middle of the largest tensor item: the size is unchanged, so verify passes; the load fails.
    name = max(out["sizes"], key=out["sizes"].get)
    offset, length, _ = max(out["manifest"]["files"][f"actor/{name}"]["items"], key=lambda x: x[1])
    shard = path / "actor" / name
    raw = bytearray(shard.read_bytes())
    raw[offset + length // 2] ^= 0x01
    shard.write_bytes(bytes(raw))
    out["verify_after"] = mgr.verify(path)
    try:
        mgr.load(path, cfg, lambda d, its: resumed.load_checkpoint(str(d), items=its))
        out["error"] = None
    except CorruptItem as err:
        out["error"] = str(err)
    out["corrupted"] = (name, offset, length)
    return out


@pytest.mark.slow
def test_a_resume_reads_each_tensor_byte_once_and_a_changed_byte_fails_the_load_naming_it(tmp_path):
    hf_dir = str(make_tiny_qwen2(tmp_path / "qwen2"))
    (out,) = run_distributed(_worker, 1, hf_dir, str(tmp_path), timeout_s=300)
    files = out["manifest"]["files"]
    assert out["manifest"]["version"] == 2 and out["sizes"]
    for name, size in out["sizes"].items():
        items = files[f"actor/{name}"]["items"]
        assert sum(n for _, n, _ in items) == size  # the items cover the file: every byte has an item hash
        assert name not in out["hashed_by_verify"]  # verify only checked its size ...
        assert out["read"][name] == size  # ... and the load read each byte once, hashing it
    assert out["verify"] == [] and out["identical"]
    assert {"common.pt", ".metadata", "trainer_state.pt"} <= set(out["hashed_by_verify"])  # small files: whole
    name, offset, length = out["corrupted"]
    assert out["verify_after"] == []
    assert out["error"] is not None and "\n" not in out["error"]
    expected = f"actor/{name} bytes {offset}..{offset + length} fail their sha256 check (read while loading)"
    assert expected in out["error"]
