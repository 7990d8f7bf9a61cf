"""The SGLang adapters' streaming calls (submit / step / abort) against stand-ins that behave as SGLang 0.5.23's
source says (docs in megatron_dapo/rollout/sglang_stream.py): async_generate on the Engine's own loop returning
output dicts, abort_all making every in-flight call return its tokens so far with finish_reason "abort", and the
same over HTTP (/generate, /abort_request, /get_server_info) for server mode. The names themselves are checked
against the installed source in test_sglang_adapter.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import types
from http.server import BaseHTTPRequestHandler
from http.server import ThreadingHTTPServer

import pytest

from megatron_dapo.rollout import FinishReason
from megatron_dapo.rollout import GenerationRequest
from megatron_dapo.rollout import Rollout
from megatron_dapo.rollout import SamplingParams
from megatron_dapo.rollout.sglang_api import MAX_RUNNING_KEY
from megatron_dapo.rollout.sglang_engine import SGLangEngine
from megatron_dapo.rollout.sglang_engine import SGLangServerEngine

PARAMS = SamplingParams(max_new_tokens=6)


class Generator:
    """What one SGLang scheduler does, in model-free form: row i generates tokens 10+i, 11+i, ... one per tick (one
    per 25 ticks when slow; log-prob -0.5 each) up to its max_new_tokens (finish "length"); abort_all stops every
    running row and its call returns what it has (finish "abort"); requests submitted after it are not affected."""

    TICK_S = 0.004

    def __init__(self, stop_after: int = 0) -> None:
        self.epoch = 0  # calls are numbered 1, 2, ...
        self.aborted_upto = 0  # every call numbered up to this one was aborted
        self.seen: list[dict] = []
        self.stop_after = stop_after  # > 0: a row's token number stop_after is EOS (2), finish "stop" (as no_stop_trim)

    def abort_all(self) -> None:
        self.aborted_upto = self.epoch

    def rows(self, body: dict, slow: bool):
        """Yields after each tick; returns the outputs (a generator protocol shared by the async and HTTP fakes)."""
        self.epoch += 1
        epoch = self.epoch
        self.seen.append(body)
        caps = [sp["max_new_tokens"] for sp in body["sampling_params"]]
        toks: list[list[int]] = [[] for _ in caps]
        every = 25 if slow else 1  # ticks per token
        for tick in range(max(caps) * every):
            if epoch <= self.aborted_upto:
                break
            if tick % every == every - 1:
                for i, cap in enumerate(caps):
                    if len(toks[i]) < cap and not self._stopped(toks[i]):
                        toks[i].append(2 if len(toks[i]) + 1 == self.stop_after else 10 + i + len(toks[i]))
            yield
            if all(len(t) >= c or self._stopped(t) for t, c in zip(toks, caps)):
                break
        outs = []
        for t, cap in zip(toks, caps):
            kind = {"type": "length", "length": cap} if len(t) >= cap else {"type": "abort", "message": "Aborted"}
            if self._stopped(t):
                kind = {"type": "stop", "matched": 2}
            meta = {"finish_reason": kind, "output_token_logprobs": [[-0.5, x, None] for x in t]}
            outs.append({"output_ids": t, "meta_info": meta})
        return outs

    def _stopped(self, toks: list[int]) -> bool:
        return self.stop_after > 0 and len(toks) == self.stop_after and toks[-1] == 2


class FakeEngine:
    """sglang.Engine's surface the colocated stream uses: loop, async_generate, tokenizer_manager.abort_request."""

    def __init__(self, gen: Generator, slow: bool = False) -> None:
        self.loop = asyncio.new_event_loop()
        self.gen, self.slow = gen, slow
        self.tokenizer_manager = types.SimpleNamespace(abort_request=self._abort_request)

    def _abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        assert abort_all
        self.gen.abort_all()

    async def async_generate(self, input_ids, sampling_params, return_logprob, rid):
        assert return_logprob and len(rid) == len(input_ids) == len(sampling_params)
        body = {"input_ids": input_ids, "sampling_params": sampling_params}
        it = self.gen.rows(body, self.slow)
        while True:
            try:
                next(it)
            except StopIteration as done:
                return done.value
            await asyncio.sleep(Generator.TICK_S)


def colocated(gen: Generator, slow: bool = False, max_running: int = 8) -> SGLangEngine:
    eng = object.__new__(SGLangEngine)
    eng._engine = FakeEngine(gen, slow)
    eng._init_stream(max_running)
    return eng


def requests(n: int, key: str = "g", prefix: Rollout | None = None) -> list[GenerationRequest]:
    return [GenerationRequest((key, k), [1, 2, 3], 100 + k, prefix) for k in range(n)]


def drain(engine) -> dict:
    out = {}
    deadline = time.monotonic() + 20
    while engine.num_unfinished() and time.monotonic() < deadline:
        out.update(engine.step())
    assert engine.num_unfinished() == 0
    return out


class Handler(BaseHTTPRequestHandler):
    gen: Generator
    slow = False

    def log_message(self, *args) -> None:
        pass

    def _reply(self, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        assert self.path == "/get_server_info"
        self._reply({"internal_states": [{MAX_RUNNING_KEY: 4}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/abort_request":
            assert body == {"abort_all": True}
            self.gen.abort_all()
            return self._reply(None)
        assert self.path == "/generate" and body["return_logprob"] is True
        assert len(body["rid"]) == len(body["input_ids"])
        it = self.gen.rows(body, self.slow)
        while True:
            try:
                next(it)
            except StopIteration as done:
                return self._reply(done.value)
            time.sleep(Generator.TICK_S)


@pytest.fixture
def server():
    gen = Generator()
    handler = type("H", (Handler,), {"gen": gen})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd, handler
    httpd.shutdown()


def server_engine(httpd) -> SGLangServerEngine:
    return SGLangServerEngine([f"http://127.0.0.1:{httpd.server_address[1]}"], timeout_s=30)


@pytest.mark.parametrize("mode", ["colocated", "server"])
def test_groups_stream_back_as_they_finish(mode, request):
    if mode == "colocated":
        gen = Generator()
        engine = colocated(gen)
    else:
        httpd, handler = request.getfixturevalue("server")
        gen, engine = handler.gen, server_engine(httpd)
        assert engine.max_running == 0 and engine.free_slots() == 4  # read from /get_server_info when first needed
    engine.weight_version = 2
    engine.submit(requests(2, "a"), PARAMS)
    engine.submit(requests(2, "b"), SamplingParams(max_new_tokens=2))
    assert engine.num_unfinished() == 4 and engine.free_slots() == engine.max_running - 4
    order = []
    out = {}
    while engine.num_unfinished():
        got = engine.step()
        order += [k[0] for k, _ in got]
        out.update(got)
    assert order.index("b") < order.index("a")  # the short group came back first, without waiting for the other
    r = out[("a", 1)]
    assert r.response_ids.tolist() == [11, 12, 13, 14, 15, 16] and r.finish is FinishReason.LENGTH
    assert r.segments == ((0, 2),) and r.engine_logp.tolist() == [-0.5] * 6
    assert [b["sampling_params"][0]["sampling_seed"] for b in gen.seen] == [100, 100]


@pytest.mark.parametrize("mode", ["colocated", "server"])
def test_abort_returns_tokens_so_far_and_a_continuation_keeps_them(mode, request):
    if mode == "colocated":
        gen = Generator()
        engine = colocated(gen, slow=True)
    else:
        httpd, handler = request.getfixturevalue("server")
        handler.slow = True
        gen, engine = handler.gen, server_engine(httpd)
    engine.submit(requests(3), PARAMS)
    time.sleep(0.05)
    for _ in range(3):
        engine.step()
    aborted = dict(engine.abort())
    assert engine.num_unfinished() == 0 and engine.free_slots() == engine.max_running
    assert set(aborted) == {("g", 0), ("g", 1), ("g", 2)}
    part = aborted[("g", 0)]
    assert part.finish is FinishReason.ABORT and 1 <= len(part) < 6
    # Continue it under a new version: SGLang gets prompt + tokens so far and the rest of the cap.
    engine.weight_version = 5
    gen.seen.clear()
    if mode == "server":
        handler.slow = False
    else:
        engine._engine.slow = False
    engine.submit([GenerationRequest(("g", 0), [1, 2, 3], 100, prefix=part)], PARAMS)
    done = drain(engine)[("g", 0)]
    n = len(part)
    assert gen.seen[0]["input_ids"] == [[1, 2, 3, *part.response_ids.tolist()]]
    assert gen.seen[0]["sampling_params"][0]["max_new_tokens"] == 6 - n
    assert done.response_ids.tolist()[:n] == part.response_ids.tolist() and len(done) == 6
    assert done.segments == ((0, 0), (n, 5)) and done.finish is FinishReason.LENGTH


def test_a_blocking_generate_is_the_stream_run_to_the_end():
    engine = colocated(Generator())
    out = engine.generate([[1, 2], [3]], SamplingParams(n=2, max_new_tokens=3, seed=0))
    assert len(out) == 4 and all(r.finish is FinishReason.LENGTH and len(r) == 3 for r in out)
    assert out[0].prompt_ids.tolist() == [1, 2] and out[2].prompt_ids.tolist() == [3]


def test_a_sigquit_from_a_failed_child_ends_the_stream_calls_with_engine_died():
    """As SGLang 0.5.23 runs it: the TokenizerManager adds its running-phase handler to the Engine's loop
    (loop.add_signal_handler(SIGQUIT, signal_handler_class(tm).running_phase_sigquit_handler)) and a dead child's
    watchdog sends SIGQUIT to this process; the adapter's handler marks the engine dead, calls in flight never return,
    and step() / abort() raise EngineDied instead of waiting forever."""
    import os
    import signal

    from megatron_dapo.rollout import EngineDied
    from megatron_dapo.rollout.sglang_engine import mark_dead_on_sigquit

    class SGLangSignalHandler:  # SGLang's SignalHandler: its running-phase handler kills the process tree
        def __init__(self, tokenizer_manager) -> None:
            self.tokenizer_manager = tokenizer_manager

        def running_phase_sigquit_handler(self, signum=None, frame=None):
            raise AssertionError("SGLang's handler ran: it would have killed the trainer")

    gen = Generator()
    engine = colocated(gen, slow=True)
    tm = engine._engine.tokenizer_manager
    tm.signal_handler_class = SGLangSignalHandler
    mark_dead_on_sigquit(tm, engine._child_died)
    loop = engine._engine.loop
    loop.add_signal_handler(signal.SIGQUIT, tm.signal_handler_class(tm).running_phase_sigquit_handler)
    try:
        engine.submit(requests(2), PARAMS)
        engine.step()
        os.kill(os.getpid(), signal.SIGQUIT)  # the watchdog's signal
        with pytest.raises(EngineDied, match="a child process of SGLang failed"):
            for _ in range(100):
                engine.step()
        with pytest.raises(EngineDied):
            engine.abort()
    finally:
        loop.remove_signal_handler(signal.SIGQUIT)


# ------------------------------------------------------------------------------------- updates while generating
def _spans(events: list[tuple[str, int]], current: str, n: int) -> list[dict]:
    """SGLang's compute_weight_version_spans (srt/utils/weight_versions.py), as meta_info.weight_versions."""
    spans: list[dict] = []
    for version, end in [*events, (current, n)]:
        end = min(end, n)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans


class VersionedGenerator(Generator):
    """Generator plus what SGLang 0.5.23's scheduler does around an update (scheduler.py pause_generation /
    continue_generation / record_weight_version_change / flush_cache): while paused no row advances; a new
    weight_version records (old version, tokens so far) for every live row that has tokens; a flush is refused
    unless paused (retract) or idle. `log` holds the control calls in order."""

    def __init__(self) -> None:
        super().__init__()
        self.version, self.paused, self.log = "default", False, []
        self.live: list[tuple[list[list[int]], list[list[tuple[str, int]]]]] = []  # per call: (rows' tokens, events)

    def set_version(self, version: str) -> None:
        if version != self.version:
            for toks, events in self.live:
                for t, ev in zip(toks, events):
                    if t:
                        ev.append((self.version, len(t)))
            self.version = version

    def rows(self, body: dict, slow: bool):
        self.epoch += 1
        caps = [sp["max_new_tokens"] for sp in body["sampling_params"]]
        toks: list[list[int]] = [[] for _ in caps]
        events: list[list[tuple[str, int]]] = [[] for _ in caps]
        self.live.append((toks, events))
        every, tick = (25 if slow else 1), 0
        while not all(len(t) >= c for t, c in zip(toks, caps)):
            yield
            if self.paused:
                continue
            tick += 1
            if tick % every == 0:
                for i, cap in enumerate(caps):
                    if len(toks[i]) < cap:
                        toks[i].append(10 + i + len(toks[i]))
        self.live.remove((toks, events))
        outs = []
        for t, ev in zip(toks, events):
            meta = {"finish_reason": {"type": "length", "length": len(t)},
                    "output_token_logprobs": [[-0.5, x, None] for x in t],
                    "weight_versions": _spans(ev, self.version, len(t)), "weight_version": self.version}  # fmt: skip
            outs.append({"output_ids": t, "meta_info": meta})
        return outs


class UpdatingHandler(Handler):
    def do_POST(self) -> None:
        gen: VersionedGenerator = self.gen
        if self.path in ("/pause_generation", "/continue_generation", "/begin_weight_update", "/end_weight_update",
                         "/update_weights_from_distributed", "/flush_cache"):  # fmt: skip
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            gen.log.append((self.path, body))
            if self.path == "/pause_generation":
                gen.paused = True
            elif self.path == "/continue_generation":
                gen.paused = False
            elif self.path == "/update_weights_from_distributed" and "weight_version" in body:
                gen.set_version(body["weight_version"])
            elif self.path == "/flush_cache":
                assert gen.paused or not gen.live, "flush refused: requests running and the scheduler not paused"
            return self._reply({"success": True, "message": ""})
        return super().do_POST()


def test_an_update_while_generating_pauses_stamps_flushes_and_continues(tmp_path):
    """SGLangServerEngine.paused_update (asynchronous training's update in flight): pause in retract mode, the
    update sets weight_version, the flush runs under the pause, then continue; a response in flight comes back with
    its tokens before the update stamped with the old version and the rest with the new one (meta_info
    weight_versions), a response started after it with the new one."""
    import torch
    import torch.distributed as dist

    from megatron_dapo.net import free_port
    from megatron_dapo.rollout.sglang_engine import init_weight_update_group

    gen = VersionedGenerator()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), type("H", (UpdatingHandler,), {"gen": gen, "slow": True}))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    group = init_weight_update_group("127.0.0.1", free_port(), 1, "test_in_flight", backend="gloo")
    try:
        engine = server_engine(httpd)
        engine._group = group  # the servers' side of the broadcast is not modelled (one-rank group)
        bucket = [("w", torch.ones(2))]

        def update(version: int) -> None:
            with engine.paused_update(version):
                engine.begin_weight_update()
                engine.update_weights(bucket)
                engine.end_weight_update()

        update(2)  # the first push, before any generation
        assert engine.weight_version == 2 and gen.version == "2"
        engine.submit(requests(2, "a"), PARAMS)
        deadline = time.monotonic() + 20
        while not (gen.live and all(len(t) >= 2 for t in gen.live[0][0])) and time.monotonic() < deadline:
            engine.step()
        gen.log.clear()
        update(3)
        routes = [(path, body.get("mode"), body.get("weight_version")) for path, body in gen.log]
        assert routes == [("/pause_generation", "retract", None), ("/begin_weight_update", None, None),
                          ("/update_weights_from_distributed", None, "3"), ("/end_weight_update", None, None),
                          ("/flush_cache", None, None), ("/continue_generation", None, None)]  # fmt: skip
        engine.submit(requests(1, "b"), PARAMS)
        out = drain(engine)
    finally:
        httpd.shutdown()
        dist.destroy_process_group(group)
    for k in (0, 1):
        r = out[("a", k)]
        assert len(r) == 6 and r.segments[0] == (0, 2) and r.segments[1][1] == 3, r.segments
        assert 2 <= r.segments[1][0] < 6
    assert out[("b", 0)].segments == ((0, 3),)


@pytest.mark.parametrize(
    "spans, expected",
    [
        (None, ((0, 7),)),  # older servers: the engine's version
        ([{"version": "default", "start": 0, "end": 3}], ((0, 7),)),  # no update of ours yet: the engine's
        ([{"version": "4", "start": 0, "end": 3}], ((0, 4),)),  # the server's stamp wins over the engine's view
        ([{"version": "4", "start": 0, "end": 1}, {"version": "5", "start": 1, "end": 3}], ((0, 4), (1, 5))),
        ([{"version": "default", "start": 0, "end": 1}, {"version": "5", "start": 1, "end": 3}], "mix ours"),
        ([{"version": "a", "start": 0, "end": 1}, {"version": "b", "start": 1, "end": 3}], "none of which"),
    ],
)
def test_weight_version_spans_become_the_segments(spans, expected):
    from megatron_dapo.rollout.sglang_api import parse_sglang_output

    meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, t, None] for t in (5, 6, 7)]}
    if spans is not None:
        meta["weight_versions"] = spans
    req = GenerationRequest("k", [1, 2], 0)
    if isinstance(expected, str):
        with pytest.raises(RuntimeError, match=expected):
            parse_sglang_output({"meta_info": meta}, req, True, 7)
        return
    r = parse_sglang_output({"meta_info": meta}, req, True, 7)
    assert r.segments == expected and r.response_ids.tolist() == [5, 6, 7]


@pytest.mark.parametrize("mode", ["colocated", "server"])
def test_multi_turn_trajectories_go_to_sglang_as_token_ids(mode, request):
    """Each next turn of a multi-turn trajectory is a continuation: SGLang gets input_ids = prompt + the trajectory
    so far (the sampled ids and the observation ids, never text) and max_new_tokens = the cap it leaves; the result
    keeps the observation spans, engine log-prob 0 on them and SGLang's per token on the model's turns."""
    from megatron_dapo.config import AlgorithmConfig
    from megatron_dapo.experience import GroupScorer
    from tests.envs.test_multi_turn import ThreeTurns
    from tests.envs.test_multi_turn import assert_trained_as_sampled
    from tests.envs.test_multi_turn import run_stream

    if mode == "colocated":
        gen = Generator(stop_after=3)
        engine = colocated(gen)
    else:
        httpd, handler = request.getfixturevalue("server")
        handler.gen = gen = Generator(stop_after=3)
        engine = server_engine(httpd)
    env = ThreeTurns()
    scorer = GroupScorer(None, None, AlgorithmConfig(overlong_penalty=False), 30, env)
    params = SamplingParams(max_new_tokens=30)
    result = run_stream(engine, env.episode, scorer, params, prompts=[(5, "0", [1, 2, 3])], group_size=2, target=1)
    group = result.groups[result.decided[0].key]
    turn = lambda i: [10 + i, 11 + i, 2]  # row i of an SGLang call: two tokens, then its stop token
    expected = []
    for r in group.rollouts:
        assert r.finish is FinishReason.STOP and r.observations == ((3, 6), (9, 12))
        turns = [r.response_ids[a:b].tolist() for a, b in ((0, 3), (6, 9), (12, 15))]
        assert r.response_ids[3:6].tolist() == [61, 61, 62] and r.response_ids[9:12].tolist() == [62, 61, 62]
        assert r.engine_logp.tolist() == [-0.5] * 3 + [0.0] * 3 + [-0.5] * 3 + [0.0] * 3 + [-0.5] * 3
        assert all(t in (turn(0), turn(1)) for t in turns)
        ids = turns[0] + [61, 61, 62] + turns[1] + [62, 61, 62] + turns[2]  # what SGLang sampled, what was observed
        expected.append((ids, [True] * 3 + [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3))
    assert_trained_as_sampled(group.rollouts, expected)
    continuations = [b for b in gen.seen if len(b["input_ids"][0]) > 3]
    assert len(continuations) >= 4  # two later turns of each response (more groups started than the one kept)
    for body in continuations:
        ids = body["input_ids"][0]
        assert ids[:3] == [1, 2, 3] and body["sampling_params"][0]["max_new_tokens"] == 30 - (len(ids) - 3)
        assert ids[6:9] == [61, 61, 62] and (len(ids) == 9 or ids[12:15] == [62, 61, 62])


class RefusingHandler(BaseHTTPRequestHandler):
    """A server that already holds the group name it is asked to join: SGLang answers HTTP 400 with torch's reason."""

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/init_weights_update_group", self.path
        reason = "The specified group name has already been created, please use a different group name"
        data = json.dumps({"success": False, "message": f"Failed to initialize custom process group: {reason}."})
        data = data.encode()
        self.send_response(400)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_a_server_refusing_the_weight_group_is_one_line_at_once_and_group_names_are_unique():
    """Servers outlive a job and keep the groups they joined: every engine instance names its group anew (a restarted
    job would otherwise ask for a name the server holds), and a server that refuses to join is one line naming it and
    its reason at once, not a wait for the rendezvous timeout (10 min by default)."""
    from megatron_dapo.net import free_port
    from megatron_dapo.rollout.sglang_engine import GROUP_PREFIX

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), RefusingHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        engines = [SGLangServerEngine([url], master_port=free_port(), backend="gloo", timeout_s=30, group_timeout_s=5)
                   for _ in range(2)]  # fmt: skip
        assert engines[0].group_name != engines[1].group_name
        assert all(e.group_name.startswith(GROUP_PREFIX) for e in engines)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"sglang server {url} did not join weight-update group "
                           rf"{engines[0].group_name}: .*HTTP 400.*already been created") as err:  # fmt: skip
            engines[0].begin_weight_update()
        assert time.monotonic() - start < 10 and "\n" not in str(err.value)
    finally:
        httpd.shutdown()


class SilentHandler(BaseHTTPRequestHandler):
    """A server whose /init_weights_update_group waits for the trainer's side of the rendezvous (as SGLang's does)."""

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        time.sleep(30)


def test_the_trainers_side_failing_to_host_the_weight_group_ends_the_wait_at_once():
    """The trainer's side of the group cannot host its store (the port is taken): its error is raised at once, not
    after the servers' own rendezvous gives up."""
    import socket

    from megatron_dapo.net import free_port

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), SilentHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    taken = socket.socket()
    taken.bind(("127.0.0.1", free_port()))
    taken.listen()
    try:
        engine = SGLangServerEngine([f"http://127.0.0.1:{httpd.server_address[1]}"], backend="gloo", timeout_s=60,
                                    master_port=taken.getsockname()[1], group_timeout_s=5)  # fmt: skip
        start = time.monotonic()
        with pytest.raises(OSError, match="Address already in use"):
            engine.begin_weight_update()
        assert time.monotonic() - start < 20
    finally:
        taken.close()
        httpd.shutdown()
