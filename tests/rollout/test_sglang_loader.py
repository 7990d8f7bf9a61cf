"""The delta loader for SGLang servers (rollout/sglang_loader.py).

Oracle: SGLang 0.5.23's own Qwen2ForCausalLM and its weight path (tools/sglang_cpu/sglang_loader_check.py, in the
environment tools/sglang_cpu/setup_sglang_cpu.sh makes; tools/setup/install.sh makes it, so CI runs these) at TP 1
(tied embeddings) and TP 2 under torchrun --rdzv-backend c10d: deltas through the loader equal full loads bit for
bit. The unit tests below use a small model of our own for what SGLang's models do not show (refusals, the probe's
limits), and check the sender's side: SGLangServerEngine's check of the servers' loaders, ServerPush's deltas. The
whole jobs that send through the loader (CPU stand-in servers): tests/test_async_training.py.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from megatron_dapo.net import free_port
from megatron_dapo.rollout.base import WeightUpdateError
from megatron_dapo.rollout.delta import WeightDelta
from megatron_dapo.rollout.delta import as_plain_tensors
from megatron_dapo.rollout.sglang_loader import LOADER
from megatron_dapo.rollout.sglang_loader import PUSH
from megatron_dapo.rollout.sglang_loader import SHAPE_SUFFIX
from megatron_dapo.rollout.sglang_loader import UntraceableLoad
from megatron_dapo.rollout.sglang_loader import body_bytes
from megatron_dapo.rollout.sglang_loader import load_weights
from megatron_dapo.rollout.sglang_loader import request_body
from megatron_dapo.rollout.sglang_loader import trace_placements

REPO = Path(__file__).resolve().parents[2]
SGLANG_CPU = Path(os.environ.get("SGLANG_CPU_PATH", REPO / ".cache" / "sglang_cpu"))
CHECK = REPO / "tools" / "sglang_cpu" / "sglang_loader_check.py"


class Merged(torch.nn.Module):
    """A rank `rank` of `tp` holding a merged [q; k] parameter sharded by rows, a row-sharded `o` (columns), and an
    embedding padded to 8 rows: the shapes of SGLang's QKV, row-parallel and vocabulary-parallel loaders."""

    def __init__(self, rank: int = 0, tp: int = 2, scale: float | None = None) -> None:
        super().__init__()
        self.rank, self.tp, self.scale = rank, tp, scale
        self.qk = torch.nn.Parameter(torch.zeros(2 * 4 // tp, 6, dtype=torch.bfloat16), requires_grad=False)
        self.o = torch.nn.Parameter(torch.zeros(6, 4 // tp, dtype=torch.bfloat16), requires_grad=False)
        self.emb = torch.nn.Parameter(torch.full((8, 6), 7.0, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        rows = 4 // self.tp
        for name, w in weights:
            if name in ("q", "k"):
                start = 0 if name == "q" else rows
                src = w.narrow(0, self.rank * rows, rows)
                self.qk.data[start : start + rows].copy_(src if self.scale is None else src * self.scale)
            elif name == "o":
                self.o.data.copy_(w.narrow(1, self.rank * rows, rows))
            elif name == "emb":
                self.emb.data[: w.shape[0]].copy_(w)
                self.emb.data[w.shape[0] :].fill_(0)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (4, 6), "k": (4, 6), "o": (6, 4), "emb": (5, 6)}
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}


def _delta_entries(old: dict, new: dict, version: int, base: int, shuffled: bool = False) -> list:
    """The changed elements as a push carries them: sorted (DeltaEncoder's nonzero order) or in any order (an engine
    rank forwarding the pieces' changes, each piece's positions in turn: rollout.delta.forward_unit)."""
    entries = []
    for name, t in new.items():
        index = torch.nonzero(t.view(-1).view(torch.int16) != old[name].view(-1).view(torch.int16)).view(-1)
        if shuffled:
            index = index[torch.randperm(index.numel(), generator=torch.Generator().manual_seed(7))]
        delta = WeightDelta(version, base, index.to(torch.int32), t.view(-1)[index])
        entries += [(name + SHAPE_SUFFIX, torch.tensor(list(t.shape))), *as_plain_tensors([(name, delta)])]
    return entries


@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("rank", [0, 1])
def test_deltas_through_the_loader_equal_a_full_load_on_each_rank(rank, shuffled):
    w0, w1 = _weights(0), _weights(1)
    w1["k"] = w0["k"].clone()  # an unchanged tensor: an empty delta
    live, want = Merged(rank), Merged(rank)
    load_weights(live, [(PUSH, torch.tensor([0, -1, 1, 0])), *w0.items()])  # full tensors through the loader
    emb_before = live.emb.clone()
    load_weights(live, [(PUSH, torch.tensor([1, 0, 1, 0])), *_delta_entries(w0, w1, 1, 0, shuffled)])
    want.load_weights(list(w1.items()))
    for (n, p), q in zip(live.named_parameters(), want.parameters()):
        assert torch.equal(p, q), n
    assert torch.equal(live.emb[5:], emb_before[5:]) and not live.emb[5:].any()  # the padding, as a full load


def test_a_placement_is_runs_and_tracing_leaves_the_model_untouched():
    m = Merged(rank=1)
    before = [p.clone() for p in m.parameters()]
    (o,) = trace_placements(m, "o", (6, 4))
    assert o.param == "o" and o.length.tolist() == [2] * 6  # a column shard: one run per row
    assert o.hf_start.tolist() == [2, 6, 10, 14, 18, 22] and o.local_start.tolist() == [0, 2, 4, 6, 8, 10]
    (q,) = trace_placements(m, "q", (4, 6))
    assert (q.hf_start.tolist(), q.local_start.tolist(), q.length.tolist()) == ([12], [0], [12])  # rows 2-3
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before))


def test_a_load_that_computes_instead_of_copying_is_refused_in_one_line():
    with pytest.raises(UntraceableLoad, match=r"^sglang loader: q: qk is computed from the tensor, not copied$"):
        trace_placements(Merged(scale=2.0), "q", (4, 6))


def test_a_delta_against_a_version_the_rank_does_not_hold_is_refused_and_writes_nothing():
    w0, w1 = _weights(0), _weights(1)
    live = Merged()
    with pytest.raises(ValueError, match=r"push 1 is a delta against version 0 but this server holds no version"):
        load_weights(live, [(PUSH, torch.tensor([1, 0, 1, 0])), *_delta_entries(w0, w1, 1, 0)])
    load_weights(live, [(PUSH, torch.tensor([0, -1, 0, 0])), *w0.items()])  # a push that never ended
    snapshot = [p.clone() for p in live.parameters()]
    with pytest.raises(ValueError, match=r"push 1 is a delta against version 0 but this server holds no version"):
        load_weights(live, [(PUSH, torch.tensor([1, 0, 1, 0])), *_delta_entries(w0, w1, 1, 0)])
    assert all(torch.equal(p, s) for p, s in zip(live.parameters(), snapshot))
    with pytest.raises(ValueError, match=f"does not start with {PUSH}"):
        load_weights(live, list(w0.items()))


def test_request_body_pickles_the_tensors_by_value_once_for_tp_rank_0():
    """TP rank 0's payload holds the entries (rank 0 broadcasts them to the others over SGLang's TP group: the check
    against SGLang's own model at TP 2 below runs that); the other ranks' hold the PUSH entry alone."""
    big = torch.arange(1000, dtype=torch.float32)
    body = request_body([("w", big[10:14])], version=3, base=2, end=True, server_tp=2)
    assert body["load_format"] == LOADER and len(body["serialized_named_tensors"]) == 2
    leader, other = (pickle.loads(base64.b64decode(b)) for b in body["serialized_named_tensors"])
    assert len(base64.b64decode(body["serialized_named_tensors"][0])) < 2000  # the view's 4 elements, not its base
    (push_name, push), (name, t) = leader
    assert (push_name, push.tolist(), name, t.tolist()) == (PUSH, [3, 2, 1, 1], "w", [10.0, 11.0, 12.0, 13.0])
    assert [(n, p.tolist()) for n, p in other] == [(PUSH, [3, 2, 1, 1])]
    blobs = [b.decode() for b in body["serialized_named_tensors"]]
    assert json.loads(body_bytes(body)) == {**body, "serialized_named_tensors": blobs}
    assert json.loads(body_bytes({"serialized_named_tensors": [b"QQ=="]})) == {"serialized_named_tensors": ["QQ=="]}
    alone = request_body([("w", big[:2])], version=3, base=2, end=False, server_tp=1)
    assert pickle.loads(base64.b64decode(alone["serialized_named_tensors"][0]))[0][1].tolist() == [3, 2, 0, 0]


def _run_check(cmd: list[str], out: Path) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SGLANG_CPU), str(CHECK.parent / "stubs"), str(REPO)])}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    done = subprocess.run([*cmd, "--out", str(out)], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


@pytest.mark.skipif(not SGLANG_CPU.is_dir(), reason=f"{SGLANG_CPU} missing: bash tools/sglang_cpu/setup_sglang_cpu.sh")
@pytest.mark.parametrize(("tp", "fp8"), [(1, False), (2, False), (2, True)], ids=["tp1-tied", "tp2", "tp2-fp8"])
def test_deltas_into_sglangs_own_qwen2_equal_its_full_load(tp, fp8, tmp_path):
    """fp8: SGLang's Qwen2 built with the block-FP8 quantization config rollout.weight_dtype "fp8" serves (its
    Fp8LinearMethod's float8_e4m3fn weights and fp32 weight_scale_inv, sharded per TP rank in whole blocks), fed
    rollout/fp8.py's quantized stream: the deltas of the FP8 weights and of their scales."""
    if tp == 1:
        cmd = [sys.executable, str(CHECK), "--tied"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(CHECK)]  # fmt: skip
    reports = _run_check(cmd + (["--fp8", "--fraction", "0.05"] if fp8 else []), tmp_path)
    assert sorted(r["rank"] for r in reports) == list(range(tp))
    for r in reports:
        assert r["tp"] == tp and r["steps"] == 3 and r["equal"] is True
        assert all(0.1 < f < 0.6 for f in r["changed_fraction"])  # deltas, and a sizeable share of elements
        assert ("float8_e4m3fn" in r["dtypes"]) == fp8
        if fp8:  # every FP8 weight and scale took a delta through the loader
            projections = [n for n in r["placements"] if n.endswith("proj.weight")]
            assert len(projections) == 14 and all(n + "_scale_inv" in r["placements"] for n in projections)
        assert r["refused"] == "sglang loader: push 4 is a delta against version 2 but this server holds version 3"
        assert r["unchanged_after_refusal"] is True
        assert "model.layers.1.self_attn.q_proj.weight" in r["placements"]


class _InfoHandler(BaseHTTPRequestHandler):
    """A server's /get_server_info without the delta loader among its custom weight loaders, serving bf16 (SGLang's
    default json_model_override_args)."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        assert self.path == "/get_server_info", self.path
        info = {"internal_states": [{}], "custom_weight_loader": [], "json_model_override_args": "{}"}
        data = json.dumps(info).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_a_server_without_the_delta_loader_is_one_line_before_anything_is_sent():
    """SGLang ends a server asked for a load_format it does not list (a NotImplementedError in its scheduler): the
    sender checks the servers' custom_weight_loader at its first update."""
    from megatron_dapo.rollout.sglang_engine import SGLangServerEngine

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _InfoHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        engine = SGLangServerEngine([url], master_port=free_port(), backend="gloo", timeout_s=30, delta_loader=True)
        with pytest.raises(WeightUpdateError, match=rf"^sglang server {url}: started without --custom-weight-loader "
                           rf"{LOADER}, which rollout.weight_sync_delta needs") as err:  # fmt: skip
            engine.begin_weight_update()
        assert "\n" not in str(err.value) and engine._group is None  # refused before joining the weight group
        plain = SGLangServerEngine([url], master_port=free_port(), backend="gloo", timeout_s=30)
        delta = WeightDelta(2, 1, torch.tensor([0], dtype=torch.int32), torch.ones(1), (3,))
        with pytest.raises(WeightUpdateError, match=r"tensor 'w' is a delta but this engine was not built"):
            plain.update_weights([("w", delta)])
        # rollout.weight_dtype fp8 into a server serving bf16: its projections would take the float8 values without
        # their scales; refused before anything is sent, naming the override that makes it serve block FP8.
        fp8 = SGLangServerEngine([url], master_port=free_port(), backend="gloo", timeout_s=30, fp8=True)
        with pytest.raises(WeightUpdateError) as err:
            fp8.begin_weight_update()
        assert str(err.value).startswith(
            f"sglang server {url}: serves quantization_config none, but "
            "rollout.weight_dtype fp8 sends block-FP8 weights; start it with "
            '--json-model-override-args \'{"quantization_config": {"quant_method": "fp8"'
        )
        assert "\n" not in str(err.value) and fp8._group is None
    finally:
        httpd.shutdown()


class _Servers:
    """ServerPush's updater: records the buckets; fails the update of version `fail`."""

    def __init__(self, fail: int) -> None:
        self.fail, self.pushes = fail, []

    @contextmanager
    def paused_update(self, version: int):
        self.version = version
        yield

    def begin_weight_update(self) -> None:
        self.pushes.append([])

    def update_weights(self, bucket) -> None:
        if self.version == self.fail:
            raise WeightUpdateError("sglang update_weights_from_tensor failed: boom")
        self.pushes[-1] += bucket

    def end_weight_update(self) -> None:
        pass


def test_server_push_sends_deltas_as_they_are_and_a_failed_push_makes_the_next_one_full():
    from megatron_dapo.placement import ServerPush
    from megatron_dapo.rollout.delta import DeltaEncoder

    store = torch.distributed.HashStore()
    servers, encoder = _Servers(fail=2), DeltaEncoder()
    push = ServerPush(servers, store)
    w = {"a": torch.zeros(64, dtype=torch.bfloat16), "b": torch.ones(8, 8, dtype=torch.bfloat16)}
    push.push(0, iter(w.items()), 1 << 20, encoder=encoder)
    w["a"] = w["a"].clone()
    w["a"][3] = 1.0
    metrics = push.push(1, iter(w.items()), 1 << 20, encoder=encoder)
    (name, d), (_, b) = servers.pushes[-1]
    assert (name, d.base, d.index.tolist(), d.shape) == ("a", 0, [3], (64,)) and b.index is not None
    assert metrics["weight_sync/changed_fraction"] == 1 / 128
    with pytest.raises(WeightUpdateError, match="boom"):
        push.push(2, iter(w.items()), 1 << 20, encoder=encoder)
    push.push(3, iter(w.items()), 1 << 20, encoder=encoder)  # the servers may hold a mix of 1 and 2: all full
    assert all(d.index is None and d.version == 3 for _, d in servers.pushes[-1])
