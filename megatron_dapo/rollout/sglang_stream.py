"""The streaming half of the engine contract (rollout/base.py) for SGLang, colocated and server mode.

    colocated  submit(requests of one group) -> one Engine.async_generate task (a batch, one rid per row) on the
               Engine's own event loop (engine.loop; SGLang binds its receive loop and locks to it, so nothing runs
               in another thread or loop); step() runs that loop until a task completes or STEP_WAIT_S passes --
               between steps the scheduler processes keep generating and their results queue in zmq
    server     submit -> one POST /generate (a batch) in a thread; step() waits on the futures
    death      colocated: SGLang's SIGQUIT (a child failed) marks the engine dead (sglang_engine.mark_dead_on_sigquit);
               step() and abort() then raise EngineDied and the stream restarts the engine in place
    abort()    TokenizerManager.abort_request(abort_all=True) / POST /abort_request {"abort_all": true}, repeated
               until every call has returned: an aborted request comes back with finish_reason "abort" and every
               token (and log-prob) generated so far (a request that had not reached the scheduler yet would be
               missed by one abort, hence the loop, as SGLang's own pause and slime do)

Read in SGLang 0.5.23's source (names listed in sglang_engine.SGLANG_API, checked by tests): Engine.async_generate
(srt/entrypoints/engine.py) returns the output dicts, also for aborted requests (TokenizerManager raises only for
status codes 400-599, and a user abort has none); Engine has no abort method, the TokenizerManager's
abort_request(rid, abort_all) is synchronous; the scheduler runs an aborted running request one more decode step,
and that token is in the output. A continued request is input_ids = prompt + its tokens so far, max_new_tokens
reduced by their number (slime's partial rollouts do the same).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import Future
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait
from typing import Any

from megatron_dapo.rollout.base import EngineDied
from megatron_dapo.rollout.base import RoutedShape
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.types import GenerationRequest
from megatron_dapo.rollout.types import Rollout

STEP_WAIT_S = 0.05
"""Longest a step() waits for a result (the stream polls the prompt queue in between)."""
ABORT_POLL_S = 0.2
"""How long abort() waits for the aborted calls before aborting again."""
MAX_HTTP_THREADS = 1024
"""Server mode: concurrent /generate calls (one per group in flight)."""

_rids = itertools.count()


def _rid_batch(n: int) -> list[str]:
    return [f"megatron_dapo-{next(_rids)}" for _ in range(n)]


class _Calls:
    """What both streams share: in-flight calls (one per submit: a group's requests) and their parsing."""

    weight_version: int = 0
    max_running: int = 0
    routed_shape: RoutedShape | None = None
    """(MoE layers, top-k, experts) when the engine returns routed experts (actor.routing_replay r3), else None."""

    def _init_stream(self, max_running: int) -> None:
        """max_running: rows per engine (server), 0 = ask SGLang (`_query_max_running`) when first needed."""
        self.max_running = int(max_running)
        self._calls: dict[Any, tuple[list[GenerationRequest], SamplingParams, str | None]] = {}
        """In-flight call (asyncio task / future) -> (its requests, their params, server URL or None)."""

    def _rows_in_flight(self) -> int:
        return sum(len(reqs) for reqs, _, _ in self._calls.values())

    def free_slots(self) -> int:
        """Rows the engine(s) would run now (max_running x servers) minus rows in flight."""
        if not self.max_running:
            self.max_running = self._query_max_running()
        return self.max_running * self._num_servers() - self._rows_in_flight()

    def _query_max_running(self) -> int:
        raise NotImplementedError

    def num_unfinished(self) -> int:
        return self._rows_in_flight()

    def _num_servers(self) -> int:
        return 1

    def _results(self, call: Any, outs: Sequence[dict], *, allow_abort: bool) -> list[tuple[Any, Rollout]]:
        from megatron_dapo.rollout.sglang_api import parse_sglang_output

        requests, params, _ = self._calls.pop(call)
        outs = [outs] if isinstance(outs, dict) else list(outs)
        if len(outs) != len(requests):
            raise RuntimeError(f"sglang: {len(outs)} outputs for a batch of {len(requests)} requests")
        version = self.weight_version
        shape = self.routed_shape if params.return_routed_experts else None
        return [
            (
                r.key,
                parse_sglang_output(o, r, params.return_logprobs, version, allow_abort=allow_abort, routed_shape=shape),
            )  # fmt: skip
            for r, o in zip(requests, outs, strict=True)
        ]

    @staticmethod
    def _payload(requests: Sequence[GenerationRequest], params: SamplingParams) -> dict[str, Any]:
        from megatron_dapo.rollout.sglang_api import request_input_ids
        from megatron_dapo.rollout.sglang_api import sampling_params_dicts

        payload = {
            "input_ids": [request_input_ids(r) for r in requests],
            "sampling_params": sampling_params_dicts(requests, params),
            "return_logprob": True,
            "rid": _rid_batch(len(requests)),
        }
        if params.return_routed_experts:  # actor.routing_replay r3
            payload["return_routed_experts"] = True
        return payload


class EngineStream(_Calls):
    """Streaming over a colocated sglang.Engine (self._engine, self._call) on its own event loop."""

    def submit(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> None:
        if requests:
            task = self._engine.loop.create_task(self._call("async_generate", **self._payload(requests, params)))
            self._calls[task] = (list(requests), params, None)

    _dead: str | None = None
    """Why the engine is dead (its SIGQUIT handler sets it; the handler runs inside the loop, in step or abort)."""

    def _check_alive(self) -> None:
        if self._dead:
            raise EngineDied(self._dead)

    def step(self) -> list[tuple[Any, Rollout]]:
        self._check_alive()
        if not self._calls:
            return []
        done, _ = self._engine.loop.run_until_complete(
            asyncio.wait(list(self._calls), timeout=STEP_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        )
        self._check_alive()
        return [x for task in done for x in self._results(task, task.result(), allow_abort=False)]

    def abort(self) -> list[tuple[Any, Rollout]]:
        out: list[tuple[Any, Rollout]] = []
        while self._calls:
            self._check_alive()  # a dead engine's calls never return
            self._abort_all()
            done, _ = self._engine.loop.run_until_complete(asyncio.wait(list(self._calls), timeout=ABORT_POLL_S))
            out += [x for task in done for x in self._results(task, task.result(), allow_abort=True)]
        return out

    def _abort_all(self) -> None:
        from megatron_dapo.rollout.sglang_api import checked

        self._engine.tokenizer_manager.abort_request(**checked("TokenizerManager.abort_request", {"abort_all": True}))


class ServerStream(_Calls):
    """Streaming over SGLang servers (self.urls, self._post): one /generate call per group, to the server with the
    most free rows."""

    def _num_servers(self) -> int:
        return len(self.urls)

    def _pool(self) -> ThreadPoolExecutor:
        if getattr(self, "_executor", None) is None:
            self._executor = ThreadPoolExecutor(MAX_HTTP_THREADS, thread_name_prefix="sglang-generate")
        return self._executor

    def submit(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> None:
        if not requests:
            return
        load = {u: 0 for u in self.urls}
        for reqs, _, url in self._calls.values():
            load[url] += len(reqs)
        url = min(self.urls, key=lambda u: (load[u], self.urls.index(u)))
        fut: Future = self._pool().submit(self._post, url, "/generate", self._payload(requests, params))
        self._calls[fut] = (list(requests), params, url)

    def step(self) -> list[tuple[Any, Rollout]]:
        if not self._calls:
            return []
        done, _ = wait(list(self._calls), timeout=STEP_WAIT_S, return_when=FIRST_COMPLETED)
        return [x for fut in done for x in self._results(fut, fut.result(), allow_abort=False)]

    def abort(self) -> list[tuple[Any, Rollout]]:
        out: list[tuple[Any, Rollout]] = []
        while self._calls:
            for url in sorted({url for _, _, url in self._calls.values()}):
                self._post(url, "/abort_request", {"abort_all": True})
            done, _ = wait(list(self._calls), timeout=ABORT_POLL_S)
            out += [x for fut in done for x in self._results(fut, fut.result(), allow_abort=True)]
        return out
