"""Changed-weights (delta) weight sync (rollout/delta.py): an engine updated by deltas holds, bit for bit, what an
engine updated by full syncs of the same weights holds, step after step; a delta never applies to another base."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.config import ConfigError
from megatron_dapo.config import load_config
from megatron_dapo.rollout import TransformersEngine
from megatron_dapo.rollout import WeightSync
from megatron_dapo.rollout import WeightUpdateError
from megatron_dapo.rollout.delta import WeightDelta
from megatron_dapo.rollout.delta import same_bits
from tests.actor._tiny_models import make_tiny_qwen3_moe
from tests.rollout.conftest import tiny_model


def _exported(engine: TransformersEngine, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Every name the engine takes (per-expert names of fused MoE experts included), as an export in `dtype` sends
    them."""
    return {n: engine.weights.target(n).detach().to(dtype).clone() for n in sorted(engine.weights.parameter_names)}


def _update(named: dict[str, torch.Tensor], step: int, scale: float = 5e-4) -> dict[str, torch.Tensor]:
    """An optimizer-like step: every element moves by ~scale of its size; in bf16 most round to the same value."""
    gen = torch.Generator().manual_seed(step)
    out = {}
    for name, t in named.items():
        x = t.float()
        out[name] = (x + scale * x.abs().clamp_min(1e-2) * torch.randn(x.shape, generator=gen)).to(t.dtype)
    return out


SERVERS = {"engine": "sglang", "mode": "server", "server_urls": "http://127.0.0.1:30000", "engine_ranks": 1}
"""A split launch whose engine rank drives an SGLang server."""


def _same_weights(a: TransformersEngine, b: TransformersEngine) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("model", ["qwen2", "llama_tied", "qwen3_moe"])
def test_delta_synced_engine_equals_full_synced_engine_every_step(model, tmp_path):
    if model == "qwen3_moe":  # fused experts: per-expert names write into views of [E, 2I, H] / [E, H, I]
        path = make_tiny_qwen3_moe(tmp_path / "moe", num_layers=2)
        by_delta, by_full = TransformersEngine(path), TransformersEngine(path)
    else:
        kind, tied = model.split("_")[0], "tied" in model
        by_delta, by_full = (TransformersEngine(tiny_model(kind, tied, seed=0)) for _ in range(2))
    delta_sync = WeightSync(by_delta, bucket_bytes=4096, delta=True)
    full_sync = WeightSync(by_full, bucket_bytes=4096)
    named = _exported(by_full)
    full_bytes = sum(t.numel() * t.element_size() for t in named.values())
    for step in range(1, 7):
        named = _update(named, step) if step > 1 else named
        metrics = delta_sync.sync(iter(named.items()))
        full_sync.sync(iter(named.items()))
        assert _same_weights(by_delta, by_full), f"step {step}"
        if step == 1:  # nothing held yet: every tensor in full
            assert metrics["weight_sync/changed_fraction"] == 1.0
            assert metrics["weight_sync/bytes"] == full_bytes
        else:
            assert 0.0 < metrics["weight_sync/changed_fraction"] < 0.3, metrics
            assert metrics["weight_sync/bytes"] < 0.8 * full_bytes, metrics
        assert by_delta.weights.version == step


def test_an_unchanged_step_sends_only_empty_deltas_and_full_every_sends_everything():
    engine = TransformersEngine(tiny_model(seed=0))
    sync = WeightSync(engine, delta=True, full_every=3)
    named = _exported(engine)
    fractions = [sync.sync(iter(named.items()))["weight_sync/changed_fraction"] for _ in range(4)]
    assert fractions == [1.0, 0.0, 1.0, 0.0]  # syncs 1 and 3 full (first, full_every), 2 and 4 nothing changed


def test_a_delta_against_another_version_is_refused_naming_the_tensor():
    engine = TransformersEngine(tiny_model(seed=0))
    named = _exported(engine)
    WeightSync(engine, delta=True).sync(iter(named.items()))  # the engine holds version 1
    name = "model.norm.weight"
    stale = WeightDelta(version=9, base=7, index=torch.tensor([0], dtype=torch.int32), values=named[name][:1])
    engine.begin_weight_update()
    with pytest.raises(WeightUpdateError, match=r"'model\.norm\.weight' is a delta against weight version 7 but the "
                       r"engine holds version 1: a full sync is needed") as err:  # fmt: skip
        engine.update_weights([(name, stale)])
    assert "\n" not in str(err.value)


def test_an_interrupted_sync_leaves_no_base_and_the_next_sync_is_full_and_exact():
    """A sync that fails midway (a bad tensor in its last bucket) leaves the engine holding no version: a delta
    computed by another sender is refused, and this sender's next sync is full, after which both engines agree."""
    by_delta, by_full = TransformersEngine(tiny_model(seed=0)), TransformersEngine(tiny_model(seed=0))
    sync, full = WeightSync(by_delta, bucket_bytes=4096, delta=True), WeightSync(by_full)
    named = _exported(by_full)
    sync.sync(iter(named.items()))
    moved = _update(named, 2)
    broken = {**moved, "model.norm.weight": moved["model.norm.weight"][:-1]}  # misshaped, sent last (sorted names)
    with pytest.raises(WeightUpdateError, match="has shape"):
        sync.sync(iter(broken.items()))
    assert by_delta.weights.version is None and sync.encoder.version is None
    name = "model.norm.weight"
    delta = WeightDelta(version=2, base=1, index=torch.tensor([0], dtype=torch.int32), values=moved[name][:1])
    by_delta.begin_weight_update()
    with pytest.raises(WeightUpdateError, match="engine holds no version"):
        by_delta.update_weights([(name, delta)])
    metrics = sync.sync(iter(moved.items()))
    full.sync(iter(moved.items()))
    assert metrics["weight_sync/changed_fraction"] == 1.0 and _same_weights(by_delta, by_full)


def test_a_restarted_engine_gets_a_full_sync_after_reset():
    """LocalGeneration._resync: the restarted engine is loaded by a plain full sync and the stream's sync is reset,
    so its next sync is full (a delta to the new engine would be refused)."""
    old = TransformersEngine(tiny_model(seed=0))
    sync = WeightSync(old, delta=True)
    named = _exported(old)
    sync.sync(iter(named.items()))
    new = TransformersEngine(tiny_model(seed=5))
    WeightSync(new).sync(iter(named.items()))  # the resync: plain tensors, no version held
    sync.engine = new
    moved = _update(named, 3)
    with pytest.raises(WeightUpdateError, match="engine holds no version"):
        sync.sync(iter(moved.items()))  # without the reset: refused, never a mix
    sync.reset()
    reference = TransformersEngine(tiny_model(seed=1))
    WeightSync(reference).sync(iter(moved.items()))
    assert sync.sync(iter(moved.items()))["weight_sync/changed_fraction"] == 1.0
    assert _same_weights(new, reference)


@pytest.mark.parametrize(
    "overrides",
    [
        {"engine": "sglang"},
        {"engine": "transformers", "weight_dtype": "fp8"},  # colocated: the engine keeps no FP8 base
    ],
)
def test_delta_sync_where_it_is_not_implemented_is_one_config_line(overrides):
    with pytest.raises(ConfigError, match=r"rollout\.weight_sync_delta: implemented for engines \"transformers\"") as e:
        load_config(None, ["--rollout.weight_sync_delta=true", *(f"--rollout.{k}={v}" for k, v in overrides.items())])
    assert "\n" not in str(e.value)


def test_fp8_deltas_go_into_sglang_servers_from_actor_rank_0_and_not_by_the_relay():
    """The servers' loader applies FP8 changes (their float8 weights and scales are what a delta's base is), so actor
    rank 0 sends them, colocated or on the split launch's rank-0 route; an engine rank relaying keeps no base to
    quantize a change against (placement.DirectChannel refuses forward with fp8): one config line."""
    from megatron_dapo.rollout.factory import server_stream

    fp8 = ["--rollout.weight_sync_delta=true", "--rollout.weight_dtype=fp8", "--trainer.max_staleness=0"]
    split = [f"--rollout.{k}={v}" for k, v in SERVERS.items()]
    colocated = ["--rollout.engine=sglang", "--rollout.mode=server", "--rollout.server_urls=[http://h:1]"]
    for overrides in (colocated, [*split, "--rollout.weight_sync_route=rank0"]):
        engine = server_stream(load_config(None, [*overrides, *fp8]).rollout, "unused", ["http://h:1"])
        assert engine.fp8 and engine.delta_loader
    with pytest.raises(ConfigError) as e:
        load_config(None, [*split, "--rollout.weight_sync_route=direct", *fp8])
    assert str(e.value).endswith('not sglang server with weight_dtype "fp8" and weight_sync_route direct')
    relay = load_config(None, [*split, "--rollout.weight_sync_route=direct", *fp8[1:]]).rollout  # full: quantized
    assert relay.direct_weight_sync and server_stream(relay, "unused", ["http://h:1"]).fp8  # by the engine rank


@pytest.mark.parametrize("route", ["direct", "rank0", "auto"])
def test_delta_sync_to_sglang_servers_is_loaded_by_the_servers_on_every_route(route):
    """On the direct route the engine ranks forward the deltas (placement.DirectChannel's forward), on the rank-0
    route actor rank 0 sends them, in a colocated launch rank 0: in every case the servers' delta loader applies
    them, so SGLangServerEngine is built to send them (and checks the servers' loader at its first update)."""
    from megatron_dapo.rollout.factory import server_stream

    overrides = [f"--rollout.{k}={v}" for k, v in SERVERS.items()]
    overrides += ["--rollout.weight_sync_delta=true", f"--rollout.weight_sync_route={route}"]
    rollout = load_config(None, [*overrides, "--trainer.max_staleness=0"]).rollout
    assert rollout.weight_sync_delta and rollout.direct_weight_sync == (route == "direct")
    assert server_stream(rollout, "unused", ["http://h:1"]).delta_loader
    colocated = load_config(None, ["--rollout.engine=sglang", "--rollout.mode=server", "--rollout.server_urls=[http://h:1]",
                                   "--rollout.weight_sync_delta=true"]).rollout  # fmt: skip
    assert server_stream(colocated, "unused", ["http://h:1"]).delta_loader


@pytest.mark.parametrize("weight_dtype", ["bf16", "fp8"])
def test_the_split_launchs_wire_carries_deltas_and_the_engine_rank_rebuilds_full_tensors(weight_dtype):
    """WeightChannel's path without the processes: the actor's encoder, the plain (name, tensor) pairs of the wire
    (a delta as its index and values, split across small buckets), each bucket's bytes and header, the engine rank's
    DeltaDecoder: the full tensors it rebuilds equal the export bit for bit, push after push, and an engine loaded
    from them holds what an engine given every push in full holds; a push against a version the engine rank does not
    hold is refused. fp8 (rollout.weight_dtype, issue 39 item 1): the pushes are the block-FP8 stream (e4m3 weights and
    their fp32 scale_inv blocks), whose deltas are bitwise in those dtypes like bf16's."""
    from megatron_dapo.placement import _as_bytes
    from megatron_dapo.placement import _from_bytes
    from megatron_dapo.rollout import bucket_named_tensors
    from megatron_dapo.rollout.delta import DeltaDecoder
    from megatron_dapo.rollout.delta import DeltaEncoder
    from megatron_dapo.rollout.delta import as_plain_tensors
    from megatron_dapo.rollout.fp8 import quantize_named_tensors

    exported = _exported(TransformersEngine(tiny_model(seed=0)))
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    by_delta, by_full = TransformersEngine(tiny_model(seed=1)), TransformersEngine(tiny_model(seed=2))
    sent = []
    for version in range(1, 6):
        exported = _update(exported, version) if version > 1 else exported
        named = dict(quantize_named_tensors(exported.items())) if weight_dtype == "fp8" else exported
        encoder.start()
        base = encoder.version
        wire = as_plain_tensors((n, encoder.encode(n, t, version)) for n, t in named.items())
        decoder.begin(version, base)
        rebuilt = {}
        for bucket in bucket_named_tensors(wire, 700):  # small: an index and its values land in different buckets
            header = [(n, t.dtype, tuple(t.shape)) for n, t in bucket]
            received = _from_bytes(torch.cat([_as_bytes(t) for _, t in bucket]), header)
            rebuilt.update(decoder.decode(received))
            sent.append(sum(t.numel() * t.element_size() for _, t in bucket))
        decoder.end()
        encoder.version = version
        assert rebuilt.keys() == named.keys() and all(same_bits(rebuilt[n], named[n]) for n in named), version
        WeightSync(by_delta).sync(iter(rebuilt.items()))
        WeightSync(by_full).sync(iter(named.items()))
        assert _same_weights(by_delta, by_full), version
    if weight_dtype == "fp8":
        assert sum(t.dtype == torch.float8_e4m3fn for t in named.values()) >= 4  # the projections went as FP8
    full = sum(t.numel() * t.element_size() for t in named.values())
    assert sum(sent) < 1.5 * full  # five pushes in the bytes of one and a half full ones
    with pytest.raises(ValueError, match="push 9 is a delta against version 7 but this rank holds version 5"):
        decoder.begin(9, 7)


@pytest.mark.parametrize(
    ("dtype", "changed", "encoding"),
    [
        (torch.bfloat16, 0.01, "index"),  # k x 4 < n / 8 below 1/32 of the elements changed
        (torch.bfloat16, 0.10, "mask"),
        (torch.bfloat16, 0.60, "mask"),  # 0.125 + 0.6 x 2 < 2 bytes per element: still a delta
        (torch.bfloat16, 0.95, "full"),
        (torch.float8_e4m3fn, 0.30, "mask"),  # 0.125 + 0.3 < 1
        (torch.float8_e4m3fn, 0.90, "full"),
    ],
)
def test_each_tensor_goes_in_the_encoding_with_the_fewest_bytes_and_the_wire_gives_it_back(dtype, changed, encoding):
    """DeltaEncoder sends a tensor's changes as indices, as a bitmap, or the tensor in full, whichever is smallest
    (the bytes counted are the wire's); through the wire (as_plain_tensors, DeltaDecoder) the engine side rebuilds the
    new tensor bit for bit. The tensor's size is not a multiple of 8 (the bitmap's last byte is partial)."""
    from megatron_dapo.rollout.delta import DeltaDecoder
    from megatron_dapo.rollout.delta import DeltaEncoder
    from megatron_dapo.rollout.delta import as_plain_tensors

    gen = torch.Generator().manual_seed(0)
    old = (torch.randn(37, 53, generator=gen) * 0.1).to(dtype)
    moved = torch.rand(old.shape, generator=gen) < changed
    new = torch.where(moved, (old.float() * 1.5 + 0.01).to(dtype), old)
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    for version, t in ((1, old), (2, new)):
        encoder.start()
        delta = encoder.encode("w", t, version)
        decoder.begin(version, delta.base)
        wire = list(as_plain_tensors([("w", delta)]))
        (name, rebuilt), *_ = decoder.decode(wire)
        decoder.end()
        encoder.version = version
        assert name == "w" and same_bits(rebuilt.view(t.shape), t)
    got = "full" if delta.index is None else "mask" if delta.as_mask else "index"
    assert got == encoding
    ints = {1: torch.uint8, 2: torch.int16}[old.element_size()]
    k, n, v = int((new.view(ints) != old.view(ints)).sum()), old.numel(), old.element_size()
    sizes = {"index": k * (4 + v), "mask": (n + 7) // 8 + k * v, "full": n * v}
    assert delta.nbytes == sizes[encoding] == min(sizes.values())
    assert sum(t.nbytes for _, t in wire) == delta.nbytes  # what the wire carries is what was counted


def test_a_bitmap_carries_forwarded_positions_in_any_order():
    """A relay's forwarded delta (rollout.delta.forward_unit) lists positions piece by piece, not sorted: as a bitmap
    its values go in position order, so a receiver writing them at the unpacked positions gets the new tensor."""
    from megatron_dapo.rollout.delta import apply_delta
    from megatron_dapo.rollout.delta import as_plain_tensors
    from megatron_dapo.rollout.delta import pack_mask
    from megatron_dapo.rollout.delta import wire_positions

    old = torch.zeros(10, 10)
    index = torch.tensor([55, 3, 97, 10, 11, 12, 64, 0, 99, 42, 41, 40, 39], dtype=torch.int32)
    delta = WeightDelta(2, 1, index, index.float() + 0.5, (10, 10))
    assert delta.as_mask  # 13 bytes of bitmap against 52 of indices
    (mask_name, mask), (values_name, values) = as_plain_tensors([("w", delta)])
    name, positions = wire_positions(mask_name, mask)
    assert (name, values_name) == ("w", "w.__delta_values__")
    rebuilt = old.clone()
    apply_delta(rebuilt, WeightDelta(2, 1, positions, values, (10, 10)))
    expected = old.clone()
    apply_delta(expected, delta)
    assert torch.equal(rebuilt, expected) and torch.equal(positions, torch.sort(index.long()).values)
    assert pack_mask(torch.tensor([0, 9, 15]), (16,)).tolist() == [1, 2 + 128]  # element 8 i + j: bit j of byte i
