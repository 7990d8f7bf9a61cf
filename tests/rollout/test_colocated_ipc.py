"""Colocated SGLang weight sync: each TP worker reads its bucket from the GPU it shares with its actor rank.

Checked here without a GPU: the per-rank payload list (one entry per SGLang TP rank, entry i from actor rank r+i),
one payload per dtype, flattened-bucket metadata rebuilt by SGLang's own FlattenedTensorBucket (loaded from its
file), the gather / barrier over a 2-rank gloo group, and that SGLang's TP worker picks its entry by tp_rank
(parsed from the installed source)."""

from __future__ import annotations

import ast
import pickle
import time
from pathlib import Path

import torch

from megatron_dapo.rollout.sglang_engine import ColocatedWeightUpdate
from megatron_dapo.rollout.sglang_engine import SGLangEngine
from megatron_dapo.rollout.sglang_engine import local_ipc_payloads
from megatron_dapo.rollout.sglang_engine import split_by_dtype
from tests.actor._dist import run_distributed
from tests.rollout.test_sglang_adapter import ROOT
from tests.rollout.test_sglang_adapter import _load_sglang_tensor_bucket
from tests.rollout.test_sglang_adapter import needs_sglang


def _bucket(rank: int) -> list[tuple[str, torch.Tensor]]:
    """A mixed-dtype bucket whose values say which rank made it."""
    gen = torch.Generator().manual_seed(rank)
    return [
        ("model.embed_tokens.weight", torch.randn(7, 4, generator=gen).bfloat16()),
        ("model.layers.0.input_layernorm.weight", torch.randn(4, generator=gen)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(4, 4, generator=gen).bfloat16()),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(3, generator=gen)),
    ]


def test_split_by_dtype_keeps_order():
    groups = split_by_dtype(_bucket(0))
    assert [[n for n, _ in g] for g in groups] == [
        ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"],
        ["model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.bias"],
    ]
    assert [{t.dtype for _, t in g} for g in groups] == [{torch.bfloat16}, {torch.float32}]


@needs_sglang
def test_payloads_rebuilt_by_sglang_flattened_bucket(monkeypatch):
    tb = _load_sglang_tensor_bucket(monkeypatch)
    bucket = _bucket(0)
    payloads, flats = local_ipc_payloads(bucket, tb.FlattenedTensorMetadata, pickle.dumps)
    assert len(payloads) == len(flats) == 2  # one per dtype
    rebuilt = []
    for payload, flat in zip(payloads, flats, strict=True):
        data = pickle.loads(payload)
        assert set(data) == {"flattened_tensor", "metadata"} and data["flattened_tensor"].dtype == torch.uint8
        assert torch.equal(data["flattened_tensor"], flat)
        assert len({m.dtype for m in data["metadata"]}) == 1  # flattened per dtype
        bucket_obj = tb.FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
        rebuilt += bucket_obj.reconstruct_tensors()
    by_name = dict(rebuilt)
    assert sorted(by_name) == sorted(n for n, _ in bucket)
    for name, t in bucket:
        assert by_name[name].dtype == t.dtype and by_name[name].shape == t.shape and torch.equal(by_name[name], t)


@needs_sglang
def test_sglang_tp_worker_reads_its_own_entry():
    """tp_worker.deserialize_own_rank indexes serialized_named_tensors by its tp_rank: entry i is TP worker i's."""
    tree = ast.parse((ROOT / "srt/managers/tp_worker.py").read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "deserialize_own_rank")
    subs = [
        n for n in ast.walk(fn) if isinstance(n, ast.Subscript) and ast.unparse(n.value) == "serialized_named_tensors"
    ]
    assert subs and "tp_rank" in ast.unparse(subs[0].slice), ast.unparse(fn)
    # and the engine passes flattened_bucket payload lists through unchanged (one per rank, no re-serialization)
    engine = (ROOT / "srt/entrypoints/engine.py").read_text()
    assert 'if load_format == "flattened_bucket":' in engine and "normalize_serialized_named_tensor_payloads" in engine


class _RecordingSGLang:
    """Stands in for sglang.Engine on the leader: records each update call's payload list."""

    def __init__(self, marker: Path) -> None:
        self.calls: list[list[bytes]] = []
        self.marker = marker

    def update_weights_from_tensor(self, **kw):
        time.sleep(0.3)  # a slow load: the peer must still be waiting in the barrier when it ends
        self.calls.append(kw["named_tensors"])
        self.marker.write_text(str(len(self.calls)))
        assert kw["load_format"] == "flattened_bucket" and kw["flush_cache"] is False
        return True, "Success"


def _colocated_worker(marker: str) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group([0, 1], backend="gloo")
    engine = None
    if rank == 0:
        engine = object.__new__(SGLangEngine)
        engine._engine, engine.tp_size, engine._released, engine._session = (
            _RecordingSGLang(Path(marker)),
            2,
            set(),
            False,
        )
    update = ColocatedWeightUpdate(engine, group, metadata_cls=dict, serialize=pickle.dumps)
    update.update_weights(_bucket(rank))
    out = {"marker_after_update": Path(marker).read_text() if Path(marker).exists() else None}
    if rank == 0:
        out["calls"] = [[pickle.loads(p) for p in call] for call in engine._engine.calls]
    dist.destroy_process_group()
    return out


def test_each_tp_worker_gets_the_payload_of_its_own_rank(tmp_path):
    marker = tmp_path / "loaded"
    leader, peer = run_distributed(_colocated_worker, 2, str(marker), timeout_s=120)
    calls = leader["calls"]
    assert len(calls) == 2  # one update_weights_from_tensor per dtype group of the bucket
    for k, call in enumerate(calls):
        assert len(call) == 2  # one payload per SGLang TP rank
        for tp_rank, payload in enumerate(call):
            expected = split_by_dtype(_bucket(tp_rank))[k]  # entry i was flattened on actor rank i
            meta = payload["metadata"]
            assert [m["name"] for m in meta] == [n for n, _ in expected]
            for m, (_, t) in zip(meta, expected, strict=True):
                assert m["shape"] == t.shape and m["dtype"] == t.dtype
                got = payload["flattened_tensor"][m["start_idx"] : m["end_idx"]].view(t.dtype).reshape(t.shape)
                assert torch.equal(got, t)
    # The peer left update_weights only after the leader's last load (it keeps its buffer alive until then).
    assert peer["marker_after_update"] == "2"
