"""Direct resharding (actor/reshard.py, placement.DirectChannel): the transfer plan gives every shard to exactly one
of its holders, the engine side rebuilds every family's HF tensors bit for bit from shards cut by the converter's own
loader, and under torchrun --rdzv-backend c10d a Megatron actor at several layouts pushes into engine ranks whose
tensors equal the rank-0 export bit for bit, full and as deltas, with no actor rank carrying the whole model."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from megatron_dapo.actor import reshard
from megatron_dapo.actor.hf_weights import _dims
from megatron_dapo.actor.hf_weights import _shard
from megatron_dapo.net import free_port
from tests.actor._tiny_models import every_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def _layout(tp: int, pp: int, ep: int, dp: int) -> reshard.Layout:
    """megatron's rank order tp-ep-dp-pp (EP carved out of DP): TP adjacent, stages world / pp apart."""
    coords = []
    for p in range(pp):
        for r in range(dp):
            for t in range(tp):
                coords.append((t, p, r % ep))
    return reshard.Layout(tp, pp, ep, tuple(coords))


@pytest.mark.parametrize(
    ("tp", "pp", "ep", "dp"), [(1, 1, 1, 1), (2, 2, 1, 1), (1, 1, 1, 3), (2, 1, 2, 2), (1, 2, 2, 4)]
)
def test_every_shard_goes_once_from_a_rank_that_holds_it_and_replicas_share_the_work(tp, pp, ep, dp):
    config = AutoConfig.from_pretrained(every_tiny_checkpoint()["qwen3_moe"])
    layout = _layout(tp, pp, ep, dp)
    plan = reshard.transfer_plan(config, layout)
    sent = [(u, s) for pieces in plan.pieces for u, s in pieces]
    want = [(i, s) for i, unit in enumerate(plan.units) for s in range(1 if unit.kind == "replicated" else tp)]
    assert sorted(sent) == sorted(want)  # every shard, once
    for rank, pieces in enumerate(plan.pieces):
        t, p, e = layout.coords[rank]
        for index, shard in pieces:
            unit = plan.units[index]
            assert unit.stage == p and unit.ep_owner in (None, e)
            assert unit.kind == "replicated" or shard == t
    # Replicas of the same (tp, pp) coordinates split the dense pieces: nobody sends much more than its share.
    per_stage = {}
    for rank, (_, p, _) in enumerate(layout.coords):
        per_stage.setdefault(p, []).append(plan.numels[rank])
    for loads in per_stage.values():
        assert max(loads) <= 1.6 * sum(loads) / len(loads), loads


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model", sorted(every_tiny_checkpoint()))
def test_the_engine_side_rebuilds_every_familys_tensors_bit_for_bit(model, tp):
    """Pieces cut by the loader's own sharding (`_shard`, what a TP rank holds), in a random order, give back the
    checkpoint's tensors exactly (vocab padding stripped, q/k/v de-interleaved, gate/up split)."""
    path = every_tiny_checkpoint()[model]
    config = AutoConfig.from_pretrained(path)
    tensors = load_file(str(path / "model.safetensors"))
    d = _dims(config)
    plan = reshard.transfer_plan(config, _layout(tp, 1, 1, 1))
    pieces = []
    for unit in plan.units:
        hf = [tensors[n] for n in unit.hf_names]
        for shard in range(1 if unit.kind == "replicated" else tp):
            pieces.append((reshard.piece_name(unit, shard), _shard(unit.kind, hf, d, tp, shard)))
    random.Random(0).shuffle(pieces)
    assembler = reshard.Assembler(config, tp)
    rebuilt = {}
    for name, piece in pieces:
        for hf_name, tensor in assembler.add(name, piece):  # each parameter as soon as its last piece is in
            assert hf_name not in rebuilt
            rebuilt[hf_name] = tensor
        assert not any(key in assembler.done for key, _ in assembler.pieces)  # no piece of a complete one is held
    assembler.finish()
    expected = {k: v for k, v in tensors.items() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    assert rebuilt.keys() == expected.keys()
    assert all(torch.equal(rebuilt[k], expected[k]) for k in expected)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model", sorted(every_tiny_checkpoint()))
def test_every_element_of_every_piece_maps_to_its_own_hf_position(model, tp):
    """Assembler.hf_positions against the converter: HF tensors of distinct values cut by `_shard` (what a TP rank
    holds); every element of every piece maps to the HF position holding its value, and the pieces' elements cover
    each HF tensor exactly once (the vocabulary's padding maps nowhere)."""
    config = AutoConfig.from_pretrained(every_tiny_checkpoint()[model])
    assembler = reshard.Assembler(config, tp)
    d = assembler.d
    for unit in assembler.units.values():
        start, hf = 1, []
        for shape in unit.hf_shapes:
            numel = int(torch.Size(shape).numel())
            hf.append(torch.arange(start, start + numel, dtype=torch.float64).reshape(shape))
            start += numel
        covered = [torch.zeros(t.numel(), dtype=torch.int64) for t in hf]
        for rank in range(1 if unit.kind == "replicated" else tp):
            piece = _shard(unit.kind, hf, d, tp, rank).reshape(-1)
            index = torch.arange(piece.numel())
            mapped = assembler.hf_positions(unit, rank, index)
            assert sum(int(keep.sum()) for keep, _ in mapped) == int((piece != 0).sum())  # all but the padding
            for j, (keep, positions) in enumerate(mapped):
                assert torch.equal(hf[j].reshape(-1)[positions], piece[keep]), (unit.hf_names[j], rank)
                covered[j].index_add_(0, positions, torch.ones_like(positions))
        assert all(bool((c == 1).all()) for c in covered), unit.hf_names


def test_forwarded_pieces_give_each_hf_tensors_changed_elements():
    """Pieces forwarded as WeightDelta entries (a relay to SGLang servers' delta loader keeps no base; reshard.Assembler
    with rollout.delta.forward_unit, as DirectChannel(forward=True) builds it): a parameter
    whose TP-rank-0 piece went full and rank-1 piece as changed elements comes out as each HF tensor's changed
    elements at its own positions (the full piece as all of its elements); written into the old HF tensors they
    give the new ones bit for bit. All pieces full: the full tensors; nothing changed: an empty entry (the servers'
    update names every tensor)."""
    from megatron_dapo.rollout.delta import WeightDelta
    from megatron_dapo.rollout.delta import apply_delta
    from megatron_dapo.rollout.delta import forward_unit

    path = every_tiny_checkpoint()["qwen2"]
    config = AutoConfig.from_pretrained(path)
    old = load_file(str(path / "model.safetensors"))
    new = {n: t.clone() for n, t in old.items()}
    for t in new.values():
        t.view(-1)[::7] += 1.0
    assembler = reshard.Assembler(config, 2, combine=forward_unit)
    d = assembler.d
    out = {}
    for unit in assembler.units.values():
        for rank in range(1 if unit.kind == "replicated" else 2):
            before = _shard(unit.kind, [old[n] for n in unit.hf_names], d, 2, rank)
            after = _shard(unit.kind, [new[n] for n in unit.hf_names], d, 2, rank)
            changed = torch.nonzero(before.reshape(-1) != after.reshape(-1)).reshape(-1).to(torch.int32)
            piece = (
                WeightDelta(5, None, None, after)
                if rank == 0 and unit.kind != "replicated"
                else WeightDelta(5, 4, changed, after.reshape(-1)[changed.long()])
            )
            out.update(assembler.add(reshard.piece_name(unit, rank), piece))
    assembler.finish()
    expected = [n for n in new if not (config.tie_word_embeddings and n == "lm_head.weight")]
    assert sorted(out) == sorted(expected)
    for name, delta in out.items():
        assert isinstance(delta, WeightDelta) and delta.version == 5 and delta.shape == tuple(new[name].shape)
        rebuilt = old[name].clone()
        apply_delta(rebuilt, delta)
        assert torch.equal(rebuilt, new[name]), name
    full = reshard.Assembler(config, 1, combine=forward_unit)
    unit = full.units["model.norm.weight"]
    entry = full.add(reshard.piece_name(unit, 0), WeightDelta(6, None, None, new["model.norm.weight"]))
    assert entry[0][1].index is None and torch.equal(entry[0][1].values, new["model.norm.weight"])
    empty = WeightDelta(6, 5, torch.zeros(0, dtype=torch.int32), torch.zeros(0))
    [(name, entry)] = full.add(reshard.piece_name(full.units["model.embed_tokens.weight"], 0), empty)
    assert name == "model.embed_tokens.weight" and entry.base == 5 and entry.index.numel() == 0


def test_a_missing_an_unknown_or_a_repeated_piece_is_one_line():
    config = AutoConfig.from_pretrained(every_tiny_checkpoint()["llama"])
    assembler = reshard.Assembler(config, 2)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.q_proj.weight@2' that no parameter"):
        assembler.add("model.layers.0.self_attn.q_proj.weight@2", torch.zeros(1))
    with pytest.raises(ValueError, match="'model.nope@0' that no parameter"):
        assembler.add("model.nope@0", torch.zeros(1))
    assembler.add("model.norm.weight@0", torch.zeros(1))
    with pytest.raises(ValueError, match="received twice"):
        assembler.add("model.norm.weight@0", torch.zeros(1))
    assembler.add("model.embed_tokens.weight@1", torch.zeros(1))
    with pytest.raises(ValueError, match=r"no actor rank sent model.embed_tokens.weight@0 \(of 2\)"):
        assembler.finish()


def test_a_layout_that_misses_a_coordinate_is_one_line():
    with pytest.raises(ValueError, match=r"no actor rank holds \(tp, pp, ep\) = \(1, 0, 0\)"):
        reshard.Layout(2, 1, 1, ((0, 0, 0), (0, 0, 0)))


LAUNCHES = [
    pytest.param(6, 2, 2, 2, 1, "qwen3,qwen2", id="actor_tp2xpp2-to-2_engines"),
    pytest.param(4, 1, 1, 1, 1, "llama", id="uneven-3_replicas-to-1_engine"),
    pytest.param(4, 2, 1, 1, 2, "qwen3_moe,mixtral", id="actor_ep2-to-2_engines"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "engines", "tp", "pp", "ep", "models"), LAUNCHES)
def test_engine_ranks_hold_the_rank0_export_bit_for_bit_full_and_as_deltas(
    tmp_path, world, engines, tp, pp, ep, models
):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    endpoint = f"--rdzv-endpoint=127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=c10d", endpoint,
           "--nnodes=1", f"--nproc-per-node={world}", "--max-restarts=0", str(ROOT / "tests" / "_reshard_worker.py"),
           str(tmp_path), str(engines), str(tp), str(pp), str(ep),
           ",".join(f"{m}={every_tiny_checkpoint()[m]}" for m in models.split(","))]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    actors = world - engines
    version = 0
    for model in models.split(","):
        for step in range(3):
            version += 1
            export = torch.load(tmp_path / f"{model}.{version}.export.pt")
            for e in range(engines):
                engine = torch.load(tmp_path / f"{model}.{version}.engine{e}.pt")
                assert list(engine) == list(export), (model, version, e)  # the export's order
                bad = [n for n in export if not torch.equal(engine[n], export[n])]
                assert bad == [], (model, version, e, bad[:3])
            reports = [torch.load(tmp_path / f"{model}.{version}.actor{r}.pt") for r in range(actors)]
            metrics = reports[0]["metrics"]
            assert all(r["metrics"] == metrics for r in reports)  # every actor rank reports the push's totals
            full = sum(t.numel() * t.element_size() for t in export.values())
            fraction = metrics["weight_sync/changed_fraction"]
            if step == 0:  # full: the shards add up to the model (plus megatron's vocab padding), split over the ranks
                assert fraction == 1.0
                assert full <= metrics["weight_sync/bytes"] == 4 * sum(reports[0]["planned"])
                assert metrics["weight_sync/max_sender_bytes"] == 4 * max(reports[0]["planned"])
                if actors > 1:
                    assert metrics["weight_sync/max_sender_bytes"] < 0.75 * full  # no rank carries the model
            elif step == 1:
                assert 0.9 < fraction <= 1.0  # every parameter moved (a few values round back to the same float)
            else:
                assert fraction == 0.0 and metrics["weight_sync/bytes"] == 0.0


def _two_actors_one_engine(hf_dir: str) -> tuple:
    """This process's rank in the three-rank launches below (actor ranks 0-1, engine rank 2), the launch's store and
    placement, the checkpoint's config and tensors."""
    from datetime import timedelta

    from megatron_dapo.launch_env import launch_store
    from megatron_dapo.placement import Placement

    rank = int(os.environ["RANK"])
    store = launch_store("127.0.0.1", int(os.environ["MASTER_PORT"]), rank, 3, timedelta(seconds=60), env={})
    config = AutoConfig.from_pretrained(hf_dir)
    return rank, store, Placement(rank, 3, 1), config, load_file(str(Path(hf_dir) / "model.safetensors"))


def _tp2_actor(placement, store, config, timeout_s: float) -> tuple:
    """An actor rank of the two-actor, one-engine launches below (TP 2 without Megatron: the shards are cut from the
    checkpoint): its group over the actor ranks, its DirectChannel, the transfer plan and the model's dims."""
    from megatron_dapo.actor.hf_weights import _dims
    from megatron_dapo.placement import DirectChannel
    from megatron_dapo.rollout.exchange import RolloutExchange

    torch.distributed.init_process_group("gloo", store=torch.distributed.PrefixStore("actors/", store),
                                         rank=placement.rank, world_size=2)  # fmt: skip
    exchange = RolloutExchange(2, timeout_s=60.0)
    channel = DirectChannel(placement, store, timeout_s)
    plan = reshard.transfer_plan(config, reshard.Layout(2, 1, 1, ((0, 0, 0), (1, 0, 0))))
    return exchange, channel, plan, _dims(config)


def _direct_faults_worker(hf_dir: str) -> dict:
    """Two actor ranks (TP 2, no Megatron: the shards are cut from the checkpoint by the loader's `_shard`) and one
    engine rank over a real DirectChannel (gloo groups on the launch's store, 8 s timeouts). Pushes: 1 full, 2 a
    delta; 3 and 4 never joined, rank 0's wait given up for a preemption (every actor rank: PushAbandoned) and failed
    (rank 1: one line naming actor rank 0); 5 a delta whose sender 1 claims a base the engine does not hold (refused;
    the engine stays on version 2, the sender times out, the other sender is told which rank failed)."""

    from megatron_dapo.errors import JobError
    from megatron_dapo.placement import DirectChannel
    from megatron_dapo.placement import PushAbandoned
    from megatron_dapo.rollout.delta import DeltaEncoder

    rank, store, placement, config, full = _two_actors_one_engine(hf_dir)
    if placement.is_engine:
        channel = DirectChannel(placement, store, 8.0, hf_config=config, actor_tp=2, delta=True)
        out: dict = {}
        for version in (1, 2, 5):
            while channel.pending() != version:
                time.sleep(0.01)
            try:
                got, buckets = channel.receive_buckets()
                tensors = dict(buckets[0])
                out[version] = all(torch.equal(tensors[k], _moved(full, version)[k]) for k in tensors)
            except JobError as err:
                out[version] = str(err)
        out["version"] = channel.version
        store.wait(["actor/done"])
        store.set("engine/done", "1")  # rank 0 hosts the store: it leaves after this
        return out
    exchange, channel, plan, d = _tp2_actor(placement, store, config, 8.0)
    encoder, out = DeltaEncoder(), {}

    def pieces(version: int):
        weights = _moved(full, version)
        for index, shard in plan.pieces[rank]:
            unit = plan.units[index]
            yield reshard.piece_name(unit, shard), _shard(unit.kind, [weights[n] for n in unit.hf_names], d, 2, shard)

    def gather(x):
        return exchange.all_gather([x], "test")

    for version in (1, 2):
        out[version] = channel.push(version, pieces(version), 4096, encoder, gather=gather)["weight_sync/bytes"]
    for name, poll in (("abandoned", lambda: (_ for _ in ()).throw(PushAbandoned())), ("failed", _stalled)):
        try:  # versions 3 and 4: the engine rank waits for 5 and never joins them
            channel.push(channel.version + 1, pieces(3), 4096, encoder, poll=poll, timeout_s=5, gather=gather)
            out[name] = "returned"
        except (PushAbandoned, JobError) as err:
            out[name] = f"{type(err).__name__}: {err}"
        channel.version += 1
    if rank == 1:
        encoder.version = 1  # a base the engine rank does not hold
    try:
        out[5] = channel.push(5, pieces(5), 4096, encoder, gather=gather)
    except JobError as err:
        out[5] = str(err)
    if rank == 0:
        store.set("actor/done", "1")
        store.wait(["engine/done"])
    return out


def _moved(full: dict, version: int) -> dict:
    """The checkpoint's tensors at `version`: from version 2 on, every tenth element of each one moved."""
    if version < 2:
        return full
    moved = {}
    for name, t in full.items():
        t = t.clone()
        t.view(-1)[::10] += 1.0
        moved[name] = t
    return moved


def _stalled() -> None:
    from megatron_dapo.errors import JobError

    raise JobError("engine rank 0 (host h, pid 1) made no progress for 15 s")


def test_direct_pushes_check_versions_on_both_sides_and_a_refused_one_leaves_the_old_weights():
    from tests.actor._dist import run_distributed

    hf_dir = str(every_tiny_checkpoint()["llama"])
    actor0, actor1, engine = run_distributed(_direct_faults_worker, 3, hf_dir, timeout_s=180)
    assert engine[1] is True and engine[2] is True  # full, then a delta: the checkpoint's tensors exactly
    assert actor0[2] < 0.5 * actor0[1]  # the delta sent a tenth of the elements (+ their indices)
    assert actor0["abandoned"] == actor1["abandoned"] == "PushAbandoned: "
    assert actor0["failed"] == "JobError: engine rank 0 (host h, pid 1) made no progress for 15 s"
    assert actor1["failed"] == "JobError: weight push of version 4: given up by actor rank 0 (see its log)"
    assert engine[5] == ("weight channel: push 5 is a delta against version 1 but this rank holds version 2 (actor "
                         "rank 1's shards)")  # fmt: skip
    assert engine["version"] == 2  # the refused push left the engine on its old weights
    assert actor1[5].startswith("weight push of version 5: an engine rank stopped answering in the transfer")
    assert actor0[5] == "weight push of version 5: actor rank 1 failed to send its shards (see its log)"


def _stream_worker(hf_dir: str) -> dict:
    """Two actor ranks (TP 2, shards cut by the loader's `_shard`, 4 KiB buckets) and one engine rank consuming with
    DirectChannel.stream (the relay into SGLang servers), quantizing to block FP8 as a relay to FP8 servers does
    (rollout.weight_dtype "fp8"). Push 1 (full): the engine takes the first rebuilt tensor, then stops reading for
    1 s; push 2 (a delta): the engine closes the stream after the first tensor."""

    from megatron_dapo.placement import DirectChannel
    from megatron_dapo.rollout.delta import DeltaEncoder
    from megatron_dapo.rollout.delta import same_bits
    from megatron_dapo.rollout.fp8 import quantize_named_tensors

    rank, store, placement, config, full = _two_actors_one_engine(hf_dir)
    if placement.is_engine:
        channel = DirectChannel(placement, store, 30.0, hf_config=config, actor_tp=2, delta=True, fp8=True)
        out: dict = {}
        while channel.pending() != 1:
            time.sleep(0.01)
        version, tensors = channel.stream()
        first = next(tensors)
        time.sleep(1.0)
        out["pushed_while_held"] = store.check(["pushed/1"])  # the actor ranks finished while nothing was read
        rebuilt = dict([first, *tensors])
        tied = config.tie_word_embeddings
        expected = dict(quantize_named_tensors((k, v) for k, v in full.items() if not (tied and k == "lm_head.weight")))
        out["exact"] = rebuilt.keys() == expected.keys() and all(same_bits(rebuilt[k], expected[k]) for k in expected)
        out["fp8"] = sum(t.dtype == torch.float8_e4m3fn for t in rebuilt.values())
        out[1] = (version, channel.version)
        while channel.pending() != 2:
            time.sleep(0.01)
        version, tensors = channel.stream()
        next(tensors)
        tensors.close()  # what relay_push does when a server fails: the senders still finish
        out[2] = (version, channel.version)
        store.wait(["pushed/2"])
        store.set("engine/done", "1")  # rank 0 hosts the store: it leaves after this
        return out
    exchange, channel, plan, d = _tp2_actor(placement, store, config, 30.0)
    encoder, out = DeltaEncoder(), {}
    for version in (1, 2):
        weights = _moved(full, version)
        pieces = (
            (reshard.piece_name(plan.units[i], s), _shard(plan.units[i].kind,
                                                          [weights[n] for n in plan.units[i].hf_names], d, 2, s))
            for i, s in plan.pieces[rank]
        )  # fmt: skip
        metrics = channel.push(version, pieces, 4096, encoder, gather=lambda x: exchange.all_gather([x], "test"))
        out[version] = metrics["weight_sync/num_buckets"]
        exchange.barrier()
        if rank == 0:
            store.set(f"pushed/{version}", "1")
    if rank == 0:
        store.wait(["engine/done"])
    return out


def test_a_streamed_direct_push_holds_the_senders_to_the_consumers_pace_and_an_early_close_lets_them_finish():
    """DirectChannel.stream (what RelayReceiver streams into SGLang servers): the first tensor reaches the consumer
    while the senders are still sending, and a consumer that stops reading stops them (the receiving thread holds a
    few buckets, not the push: no model on the engine rank); the engine rank quantizes what it rebuilds, as a relay
    to FP8 servers does, and gets the checkpoint's block-FP8 stream bit for bit. A stream closed after one tensor (a
    failed relay) is drained, so the senders' push completes, and the engine rank stays on its old version (its
    decoders were not advanced: the next delta would be refused, never loaded on a mix)."""
    from tests.actor._dist import run_distributed

    hf_dir = str(every_tiny_checkpoint()["llama"])
    actor0, actor1, engine = run_distributed(_stream_worker, 3, hf_dir, timeout_s=180)
    assert actor0[1] + actor1[1] > 20  # many buckets: far more than the receiving thread may hold
    assert engine["pushed_while_held"] is False
    assert engine["exact"] is True and engine["fp8"] >= 7  # the projections went as float8 (and their scales)
    assert engine[1] == (1, 1)
    assert engine[2] == (2, 1)
