"""The SGLang adapter against SGLang's real source (parsed with ast, never imported) and its payload format.

CI installs the pinned sglang wheel with --no-deps (it cannot be imported on CPU: no CPU build, missing deps);
importlib.util.find_spec locates it without importing it.
"""

from __future__ import annotations

import ast
import importlib.util
import pickle
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

from megatron_dapo.rollout import FinishReason
from megatron_dapo.rollout import GenerationRequest
from megatron_dapo.rollout import Rollout
from megatron_dapo.rollout import SamplingParams
from megatron_dapo.rollout import TransformersEngine
from megatron_dapo.rollout import bucket_named_tensors
from megatron_dapo.rollout.base import RoutedShape
from megatron_dapo.rollout.base import requests_for
from megatron_dapo.rollout.sglang_api import SGLANG_API
from megatron_dapo.rollout.sglang_api import ApiUse
from megatron_dapo.rollout.sglang_api import checked
from megatron_dapo.rollout.sglang_api import parse_sglang_output
from megatron_dapo.rollout.sglang_api import request_input_ids
from megatron_dapo.rollout.sglang_api import sampling_params_dicts
from megatron_dapo.rollout.sglang_engine import SGLangEngine
from megatron_dapo.rollout.sglang_engine import flatten_bucket
from megatron_dapo.rollout.sglang_engine import flattened_bucket_payloads
from tests.rollout.conftest import tiny_model


def sglang_root() -> Path | None:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


ROOT = sglang_root()
needs_sglang = pytest.mark.skipif(ROOT is None, reason="sglang wheel not installed (pip install --no-deps sglang)")


@cache
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8-sig"), filename=str(path))


def _files(root: Path, globs: tuple[str, ...]) -> list[Path]:
    return sorted({p for g in globs for p in root.glob(g)})


def _classes(trees: list[ast.Module]) -> dict[str, ast.ClassDef]:
    return {n.name: n for t in trees for n in ast.walk(t) if isinstance(n, ast.ClassDef)}


def _fields(cls: ast.ClassDef, classes: dict[str, ast.ClassDef] | None = None) -> set[str]:
    """Annotated fields (and __init__ arguments) of cls and of its base classes found in `classes`."""
    names = {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    for s in cls.body:  # classes with a plain __init__ (older releases)
        if isinstance(s, ast.FunctionDef) and s.name == "__init__":
            names |= {a.arg for a in s.args.args + s.args.kwonlyargs}
    for base in cls.bases:
        if classes and isinstance(base, ast.Name) and base.id in classes and base.id != cls.name:
            names |= _fields(classes[base.id], classes)
    return names


def _params(trees: list[ast.Module], owner: str) -> set[str] | None:
    cls_name, _, fn_name = owner.rpartition(".")
    scopes = [c.body for c in _classes(trees).values() if c.name == cls_name] if cls_name else [t.body for t in trees]
    for body in scopes:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == fn_name:
                return {a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs}
    return None


def _route(trees: list[ast.Module], path: str) -> ast.AsyncFunctionDef | ast.FunctionDef | None:
    for t in trees:
        for node in ast.walk(t):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for dec in node.decorator_list:
                    if isinstance(dec, ast.Call) and dec.args and isinstance(dec.args[0], ast.Constant):
                        if dec.args[0].value == path:
                            return node
    return None


def api_problems(root: Path, uses: tuple[ApiUse, ...] = SGLANG_API) -> list[str]:
    """Every SGLang name in `uses` that the source tree at root lacks (optional owners may be absent)."""
    problems = []
    for use in uses:
        files = _files(root, use.files)
        if not files:
            problems.append(f"{use.owner}: no file matches {use.files}")
            continue
        trees = [_parse(f) for f in files]
        if use.kind == "params":
            found = _params(trees, use.owner)
        elif use.kind == "fields":
            classes = _classes(trees)
            if use.owner == "*":
                found = set().union(*(_fields(c) for c in classes.values()))
            else:
                found = _fields(classes[use.owner], classes) if use.owner in classes else None
        elif use.kind == "attributes":
            cls = _classes(trees).get(use.owner)
            found = None if cls is None else {
                t.attr for n in ast.walk(cls) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
            }  # fmt: skip
        elif use.kind == "route":
            fn = _route(trees, use.owner)
            found = None if fn is None else {ast.unparse(a.annotation) for a in fn.args.args if a.annotation}
            if found is not None and use.names:
                ok = any(use.names[0] in ann for ann in found)
                found = set(use.names) if ok else set()
        else:  # literals: substrings of any string constant
            consts = [n.value for t in trees for n in ast.walk(t) if isinstance(n, ast.Constant)]
            strings = [c for c in consts if isinstance(c, str)]
            found = {name for name in use.names if any(name in s for s in strings)}
        if found is None:
            if not use.optional:
                problems.append(f"{use.owner}: not found in {use.files}")
            continue
        problems += [f"{use.owner}: {name!r} not found in {use.files}" for name in use.names if name not in found]
    return problems


@needs_sglang
def test_every_sglang_name_we_use_exists_in_the_installed_source():
    assert api_problems(ROOT) == []


@needs_sglang
def test_checker_catches_a_renamed_argument():
    fake = (ApiUse("params", ("srt/entrypoints/engine.py",), "Engine.update_weights_from_tensor", ("tensors_x",)),)
    assert api_problems(ROOT, fake) == [
        "Engine.update_weights_from_tensor: 'tensors_x' not found in ('srt/entrypoints/engine.py',)"
    ]
    missing_route = (ApiUse("route", ("srt/entrypoints/http_server.py",), "/no_such_route", ()),)
    assert len(api_problems(ROOT, missing_route)) == 1


def test_adapter_refuses_names_outside_the_list():
    with pytest.raises(KeyError, match="'tensors'"):
        checked("Engine.update_weights_from_tensor", {"tensors": []})
    with pytest.raises(KeyError, match="not listed"):
        checked("Engine.update_weights_from_disk", {})


def _load_sglang_tensor_bucket(monkeypatch):
    """SGLang's own tensor_bucket.py (imports only torch), loaded from its file without importing sglang."""
    spec = importlib.util.spec_from_file_location("_sglang_tensor_bucket", ROOT / "srt/weight_sync/tensor_bucket.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "_sglang_tensor_bucket", mod)  # pickle finds the metadata class here
    spec.loader.exec_module(mod)
    return mod


@needs_sglang
@pytest.mark.parametrize("kind,tied", [("qwen2", False), ("llama", True)])
def test_flattened_payload_rebuilt_by_sglang_reproduces_source_logits(monkeypatch, kind, tied):
    tb = _load_sglang_tensor_bucket(monkeypatch)
    source, engine = tiny_model(kind, tied, seed=4), TransformersEngine(tiny_model(kind, tied, seed=0))
    named = [(n, t) for n, t in source.state_dict().items() if not (tied and n == "lm_head.weight")]
    engine.begin_weight_update()
    for bucket in bucket_named_tensors(named, bucket_bytes=30_000):
        payloads = flattened_bucket_payloads(bucket, 2, tb.FlattenedTensorMetadata, pickle.dumps)
        assert len(payloads) == 2
        for payload in payloads:  # what each SGLang TP rank does with its copy
            data = pickle.loads(payload)
            rebuilt = tb.FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
            tensors = rebuilt.reconstruct_tensors()
            assert [n for n, _ in tensors] == [n for n, _ in bucket]
            engine.update_weights(tensors)
    engine.end_weight_update(full=True)
    got = engine.model.state_dict()
    assert all(torch.equal(got[n], t) for n, t in source.state_dict().items())  # every weight bit for bit


@needs_sglang
def test_mixed_dtype_bucket_is_aligned_and_bit_exact(monkeypatch):
    tb = _load_sglang_tensor_bucket(monkeypatch)
    bucket = [("a", torch.randn(3).bfloat16()), ("b", torch.randn(5, 3)), ("c", torch.arange(7, dtype=torch.int64))]
    flat, meta = flatten_bucket(bucket)
    assert all(m["start_idx"] % 16 == 0 for m in meta) and flat.dtype == torch.uint8
    rebuilt = tb.FlattenedTensorBucket(flattened_tensor=flat, metadata=[tb.FlattenedTensorMetadata(**m) for m in meta])
    for (n0, t0), (n1, t1) in zip(bucket, rebuilt.reconstruct_tensors()):
        assert n0 == n1 and t0.dtype == t1.dtype and torch.equal(t0, t1)


def test_sampling_params_rows():
    reqs = requests_for([[1, 2], [3]], SamplingParams(n=3, max_new_tokens=9, top_k=0, seed=1))
    rows = sampling_params_dicts(reqs, SamplingParams(n=3, max_new_tokens=9, top_k=0, seed=1))
    assert len(rows) == 6 and len({r["sampling_seed"] for r in rows}) == 6
    assert [r["sampling_seed"] for r in rows] == [r.seed for r in reqs]
    assert rows[0]["top_k"] == -1 and rows[0]["max_new_tokens"] == 9 and rows[0]["no_stop_trim"] is True
    again = sampling_params_dicts(reqs, SamplingParams(n=3, top_k=4, seed=1))
    assert [r["sampling_seed"] for r in again] == [r["sampling_seed"] for r in rows] and again[0]["top_k"] == 4
    # A carried response continues: its tokens follow the prompt and count against the cap.
    prefix = Rollout([1, 2], [7, 8, 9], [-0.1, -0.2, -0.3], FinishReason.ABORT, ((0, 3),))
    cont = GenerationRequest("k", [1, 2], 5, prefix=prefix)
    assert request_input_ids(cont) == [1, 2, 7, 8, 9]
    assert sampling_params_dicts([cont], SamplingParams(max_new_tokens=9))[0]["max_new_tokens"] == 6


def _out(ids, kind, logps=None, **extra):
    meta = {"finish_reason": {"type": kind, **extra}}
    if logps is not None:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logps, ids)]
    return {"output_ids": ids, "meta_info": meta}


def test_parse_sglang_output_stop_length_abort():
    req = GenerationRequest("k", [1, 9], 0)
    c = parse_sglang_output(_out([5, 6, 2], "stop", [-0.5, -1.0, -0.1], matched=2), req, True, 4)
    assert c.response_ids.tolist() == [5, 6, 2] and c.finish is FinishReason.STOP and c.segments == ((0, 4),)
    assert c.engine_logp.tolist() == pytest.approx([-0.5, -1.0, -0.1])
    c = parse_sglang_output(_out([5, 6], "length", length=2), GenerationRequest("k", [1], 0), False, 0)
    assert (c.response_ids.tolist(), c.engine_logp, c.finish) == ([5, 6], None, FinishReason.LENGTH)
    with pytest.raises(RuntimeError, match="abort"):
        parse_sglang_output(_out([], "abort", message="oom"), req, True, 0)
    partial = parse_sglang_output(_out([5], "abort", [-0.2], message="Aborted"), req, True, 0, allow_abort=True)
    assert partial.finish is FinishReason.ABORT and partial.response_ids.tolist() == [5]
    with pytest.raises(RuntimeError, match="stop token 2"):
        parse_sglang_output(_out([5, 6], "stop", matched=2), req, False, 0)
    # A continued request: the old segment keeps its tokens, log-probs and version.
    prefix = Rollout([1, 9], [7], [-0.7], FinishReason.ABORT, ((0, 3),))
    cont = parse_sglang_output(
        _out([5, 2], "stop", [-0.5, -0.1], matched=2), GenerationRequest("k", [1, 9], 0, prefix), True, 4
    )
    assert cont.response_ids.tolist() == [7, 5, 2] and cont.segments == ((0, 3), (1, 4))
    assert cont.engine_logp.tolist() == pytest.approx([-0.7, -0.5, -0.1])


class _RecordingEngine:
    """Stands in for sglang.Engine to check the adapter's session logic (not SGLang's behaviour)."""

    def __init__(self, with_session: bool) -> None:
        self.calls: list[tuple[str, dict]] = []
        if with_session:
            self.begin_weight_update = lambda **kw: self._rec("begin_weight_update", kw, (True, "ok"))
            self.end_weight_update = lambda **kw: self._rec("end_weight_update", kw, (True, "ok"))

    def _rec(self, name, kwargs, result=None):
        self.calls.append((name, kwargs))
        return result

    def update_weights_from_tensor(self, **kw):
        return self._rec("update_weights_from_tensor", kw, (True, "Success"))

    def flush_cache(self, **kw):
        return self._rec("flush_cache", kw)

    def release_memory_occupation(self, **kw):
        return self._rec("release_memory_occupation", kw)

    def resume_memory_occupation(self, **kw):
        return self._rec("resume_memory_occupation", kw)


def _adapter(fake) -> SGLangEngine:
    eng = object.__new__(SGLangEngine)
    eng._engine, eng.tp_size, eng._released, eng._session = fake, 2, set(), False
    eng._metadata_cls = dict
    eng._serialize = pickle.dumps
    eng._patch_reductions = lambda: None
    eng._init_stream(8)
    return eng


@pytest.mark.parametrize("with_session", [True, False])
def test_colocated_session_order(with_session):
    """The choreography's calls (memory.py) map onto SGLang's: release all tags, resume the weights, the update
    session (which resumes nothing itself), then the KV cache and graphs; repeated or unreleased tags are not sent
    (SGLang's resume raises KeyError on a tag that is not released)."""
    fake = _RecordingEngine(with_session)
    eng = _adapter(fake)
    eng.release_memory(["weights", "kv_cache", "cuda_graph"])
    eng.release_memory(["kv_cache"])
    eng.resume_memory(["weights"])
    eng.begin_weight_update()
    eng.update_weights([("w", torch.ones(3))])
    eng.end_weight_update()
    eng.resume_memory(["kv_cache", "cuda_graph"])
    eng.resume_memory(["kv_cache", "cuda_graph", "weights"])
    names = [c[0] for c in fake.calls]
    expected = ["release_memory_occupation", "resume_memory_occupation"]
    expected += ["begin_weight_update"] * with_session + ["update_weights_from_tensor"]
    expected += ["end_weight_update"] * with_session + ["flush_cache", "resume_memory_occupation"]
    assert names == expected
    assert fake.calls[0][1] == {"tags": ["weights", "kv_cache", "cuda_graph"]}
    assert fake.calls[1][1] == {"tags": ["weights"]}
    assert fake.calls[-1][1] == {"tags": ["kv_cache", "cuda_graph"]}
    upd = next(kw for n, kw in fake.calls if n == "update_weights_from_tensor")
    assert upd["load_format"] == "flattened_bucket" and upd["flush_cache"] is False
    assert len(upd["named_tensors"]) == 2 and pickle.loads(upd["named_tensors"][0])["metadata"][0]["name"] == "w"


def _stub_sglang(monkeypatch) -> list[dict]:
    """sys.modules entries for the names SGLangEngine.__init__ imports; returns the recorded Engine kwargs."""
    import types

    seen: list[dict] = []
    names = ("sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.utils.common", "sglang.srt.utils.patch_torch")
    mods = {n: types.ModuleType(n) for n in (*names, "sglang.srt.weight_sync", "sglang.srt.weight_sync.tensor_bucket")}
    info = {"internal_states": [{"effective_max_running_requests_per_dp": 48}]}

    def engine(**kw):
        seen.append(kw)
        return types.SimpleNamespace(
            get_server_info=lambda: info, tokenizer_manager=types.SimpleNamespace(signal_handler_class=object)
        )

    mods["sglang"].Engine = engine
    mods["sglang.srt.utils.common"].MultiprocessingSerializer = types.SimpleNamespace(serialize=pickle.dumps)
    mods["sglang.srt.utils.patch_torch"].monkey_patch_torch_reductions = lambda: None
    mods["sglang.srt.weight_sync.tensor_bucket"].FlattenedTensorMetadata = dict
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return seen


def test_deterministic_inference_switch_reaches_sglang(monkeypatch):
    """sampling_seed is honoured by SGLang 0.5.23 only under enable_deterministic_inference (SamplingBatchInfo)."""
    from megatron_dapo.config import RolloutConfig
    from megatron_dapo.rollout.factory import make_engine

    seen = _stub_sglang(monkeypatch)
    first = make_engine(RolloutConfig(engine="sglang"), "/m", device="cuda", seed=5)
    cfg = RolloutConfig(engine="sglang", deterministic_inference=True, max_running_requests=16)
    second = make_engine(cfg, "/m", device="cuda")
    assert "enable_deterministic_inference" not in seen[0] and seen[0]["random_seed"] == 5
    assert seen[1]["enable_deterministic_inference"] is True
    # The stream hands an engine as many rows as SGLang runs: its own effective value, or the configured one.
    assert "max_running_requests" not in seen[0] and first.free_slots() == 48
    assert seen[1]["max_running_requests"] == 16 and second.max_running == 16


def test_a_failed_sglang_child_marks_the_engine_dead_instead_of_killing_the_trainer(monkeypatch):
    """SGLang answers a child's SIGQUIT by killing the whole process tree (its launch- and running-phase handlers);
    the adapter replaces both, so the trainer lives and the stream restarts the engine (EngineDied)."""
    from megatron_dapo.config import RolloutConfig
    from megatron_dapo.rollout import EngineDied
    from megatron_dapo.rollout.factory import make_engine

    seen = _stub_sglang(monkeypatch)
    engine = make_engine(RolloutConfig(engine="sglang"), "/m", device="cuda")
    handler_cls = engine._engine.tokenizer_manager.signal_handler_class
    assert handler_cls is not object and issubclass(handler_cls, object)
    assert seen[0]["custom_sigquit_handler"] == engine._child_died  # the launch phase's
    handler_cls().running_phase_sigquit_handler(3, None)  # what TokenizerManager's loop runs on SIGQUIT
    with pytest.raises(EngineDied, match="a child process of SGLang failed"):
        engine.step()


def test_routed_experts_are_requested_and_decoded_as_sglang_encodes_them():
    """actor.routing_replay r3: the payload asks for them; meta_info.routed_experts is base64 of int32 [prompt +
    output - 1, layers, k] (SGLang 0.5.23 detokenizer_manager._b64_encode_per_request: item.numpy().tobytes(), and
    state_capturer/routed_experts.py reads it back with np.frombuffer(..., np.int32))."""
    import base64

    import numpy as np

    from megatron_dapo.rollout.sglang_stream import _Calls

    params = SamplingParams(max_new_tokens=4, return_routed_experts=True)
    req = GenerationRequest("k", [1, 9, 4], 0)
    assert _Calls._payload([req], params)["return_routed_experts"] is True
    assert "return_routed_experts" not in _Calls._payload([req], SamplingParams(max_new_tokens=4))
    routing = np.random.default_rng(0).integers(0, 300, size=(3 + 2 - 1, 4, 2)).astype(np.int32)
    out = _out([5, 2], "stop", [-0.5, -0.1], matched=2)
    out["meta_info"]["routed_experts"] = base64.b64encode(routing.tobytes()).decode("utf-8")
    c = parse_sglang_output(out, req, True, 0, routed_shape=RoutedShape(4, 2, 300))
    assert c.routed_experts.dtype == torch.int16 and torch.equal(c.routed_experts.long(), torch.from_numpy(routing))
    assert parse_sglang_output(out, req, True, 0).routed_experts is None  # not asked: not decoded
    # GLM-4.5: SGLang's capturer keeps a row per decoder layer; the dense first layers' rows are dropped
    glm = parse_sglang_output(out, req, True, 0, routed_shape=RoutedShape(4, 2, 300, dense_layers=1))
    assert torch.equal(glm.routed_experts.long(), torch.from_numpy(routing)[:, 1:])
    with pytest.raises(RuntimeError, match="holds 32 ids, expected 4 positions x 4 layers x top-3"):
        parse_sglang_output(out, req, True, 0, routed_shape=RoutedShape(4, 3, 300))
    del out["meta_info"]["routed_experts"]
    with pytest.raises(RuntimeError, match="--enable-return-routed-experts"):
        parse_sglang_output(out, req, True, 0, routed_shape=RoutedShape(4, 2, 300))
