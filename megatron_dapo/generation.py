"""The trainer's one generation interface, with a local and a remote implementation.

    LocalGeneration   colocated (one program on every rank): the rollout stream over this launch's engines, weights
                      into them by WeightSync, engines restarted in place, evaluation on them
    RemoteGeneration  the actor ranks of a split launch (rollout.engine_ranks > 0): each step's generation, the
                      evaluation scores and the carry come from the engine ranks (engine_rank.py) through the
                      Mailbox; weights go to them over the weight channel (placement.py)

Both give the trainer (trainer.py) the same calls, collective over its ranks, in its step's order:

    start(step, data, resumed)     weights into the engines (and, remote, the start state) before the first step
    generate(step)                 the step's StreamResult (interrupted on a preemption: nothing decided)
    rows(request)                  this rank's rollouts of the rows its DP rank trains on (a RowRequest)
    commit()                       the generation becomes the run's state (data position, carry) at the first update
    push_weights(version)          the updated weights into the engines (the sync phase)
    eval_scores(step, examples)    the verifier's results of the evaluation, every rank's share gathered
    carry_state() / load_carry()   the carry in checkpoint form (collective) / from a checkpoint
    close()
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import replace
from typing import Any

from megatron_dapo.envs.base import prompt_record
from megatron_dapo.errors import rank_notice
from megatron_dapo.evaluate import sample_scores
from megatron_dapo.experience import GroupScorer
from megatron_dapo.rollout.delta import DeltaEncoder
from megatron_dapo.rollout.factory import engine_ranks
from megatron_dapo.rollout.factory import sampling_params
from megatron_dapo.rollout.stream import CarryEntry
from megatron_dapo.rollout.stream import RolloutStream
from megatron_dapo.rollout.stream import StreamConfig
from megatron_dapo.rollout.stream import StreamHooks
from megatron_dapo.rollout.stream import StreamResult
from megatron_dapo.rollout.stream import job_store
from megatron_dapo.rollout.types import GroupSummary
from megatron_dapo.rollout.types import Rollout
from megatron_dapo.rollout.types import RolloutGroup


@dataclass
class RolloutContext:
    """What both sides of generation read from the run (the trainer builds it once).

    config: the RunConfig; rank / world: this rank in its role's group; exchange: the role's RolloutExchange;
    inputs: RunInputs; sampler: the DynamicSampler; stop: this rank's preemption flag; hook: the testing hook;
    log: one line on this rank's stderr.
    """

    config: Any
    rank: int
    world: int
    exchange: Any
    inputs: Any
    sampler: Any
    scorer: GroupScorer
    stop: Callable[[], bool]
    hook: Callable[[str], None]
    log: Callable[[str], None]

    @classmethod
    def for_run(
        cls, config: Any, rank: int, world: int, exchange: Any, inputs: Any, *, stop: Callable[[], bool],
        hook: Callable[[str], None], log: Callable[[str], None],
    ) -> RolloutContext:  # fmt: skip
        """The context of a run: its dynamic sampler and its group scorer (the reward's verifier, the algorithm's
        overlong shaping) built from the config, as both the trainer and an engine rank use them."""
        from megatron_dapo.algorithms import DynamicSampler
        from megatron_dapo.envs.base import environment_for_run
        from megatron_dapo.reward import Verifier

        sampler = DynamicSampler.from_config(config.algorithm, config.trainer)
        verifier = Verifier.from_config(config.reward)
        cap = config.rollout.max_response_length
        env = environment_for_run(config.reward, tokenizer=inputs.tokenizer, verifier=verifier, max_tokens=cap)
        scorer = GroupScorer(inputs.tokenizer, verifier, config.algorithm, cap, env)
        return cls(config, rank, world, exchange, inputs, sampler, scorer, stop, hook, log)

    @property
    def environment(self) -> Any:
        """The run's environment (reward.environment: GroupScorer.environment), or None for a score hook that has
        none (a test's stand-in scorer): single-turn then."""
        return getattr(self.scorer, "environment", None)

    def params(self):
        """The training SamplingParams (one response per request; G requests per prompt)."""
        c = self.config
        r3 = c.actor.routing_replay == "r3"  # the actor replays the engine's experts
        params = sampling_params(c.rollout, n=1, stop_token_ids=self.inputs.stop_ids, routed_experts=r3)
        env = self.environment
        return replace(params, multi_turn=True) if env is not None and env.multi_turn else params

    def make_stream(self, engine: Any, **hooks: Any) -> RolloutStream:
        """The rollout stream over this role's ranks (collective: the queue's store address is gathered)."""
        c = self.config
        store = job_store(self.rank, self.world, self.exchange, c.distributed.timeout_s)
        config = StreamConfig.from_run(c, self.sampler.max_sampled_prompts, self.world)
        env, episode = self.environment, None
        if env is not None and env.multi_turn:  # each episode starts from its prompt's record
            record = self.inputs.record
            episode = lambda index, truth: env.episode(truth, record(index))
        hooks = StreamHooks(score=self.scorer, episode=episode, **hooks)
        return RolloutStream(engine, self.rank, self.exchange, store, config, hooks)

    def run_stream(self, stream: RolloutStream, step: int, carry: list, carry_rows: dict) -> StreamResult:
        c = self.config
        return stream.run(
            step, self.sampler.start(), self.params(), c.trainer.seed, self.inputs.fresh, carry, carry_rows
        )

    def eval_scores(self, engine: Any, examples: list, engine_ranks: list[int]) -> list[list[dict]]:
        """This rank's share of the evaluation (examples interleaved by engine rank) on `engine`."""
        if engine is None:
            return []
        t = self.config.trainer
        slot = engine_ranks.index(self.rank)
        mine = examples[slot :: len(engine_ranks)]
        params = sampling_params(
            self.config.rollout, t.eval_samples, seed=t.seed + 7 + self.rank, stop_token_ids=self.inputs.stop_ids,
            temperature=t.eval_temperature, top_p=t.eval_top_p, return_logprobs=False,
        )  # fmt: skip
        prompts, truths = [self.inputs.render(ex) for ex in mine], [ex.ground_truth for ex in mine]
        verifier = self.scorer.verifier
        return sample_scores(engine, prompts, truths, verifier, self.inputs.tokenizer, params, self.environment,
                             records=[prompt_record(ex) for ex in mine])  # fmt: skip


def carry_entries(states: list[dict[str, Any]], owners: list[int], rank: int):
    """A checkpoint's carry owned round-robin by the engine ranks `owners` (any rank can continue any group):
    (carry entries in queue order, this rank's rollouts by key)."""
    carry, carry_rows = [], {}
    for k, state in enumerate(states):
        owner, key = owners[k % len(owners)], f"carry:{k}"
        rollouts = [Rollout.from_state(r) for r in state["rollouts"]]
        summary = None
        if state["scores"] is not None:
            x, index, truth = state["scores"], state["index"], state["truth"]
            group = RolloutGroup(index, k, truth, rollouts, x["accs"], x["rewards"], x["penalties"])
            summary = group.summary(owner, key)
        carry.append(CarryEntry(int(state["index"]), str(state["truth"]), owner, key, summary))
        if owner == rank:
            carry_rows[key] = rollouts
    return carry, carry_rows


def carry_state(carry: list[CarryEntry], carry_rows: dict[str, list[Rollout]], exchange: Any) -> list[dict]:
    """The carried groups in full, in queue order (their rollouts gathered from the ranks that own them; plain
    containers and tensors for a weights_only checkpoint); collective over `exchange`."""
    mine = [(k, [r.to_state() for r in rows]) for k, rows in carry_rows.items()]
    rows = dict(exchange.all_gather(mine, "carried rollouts"))
    out = []
    for e in carry:
        state = {"index": e.index, "truth": e.truth, "rollouts": rows[e.key], "scores": None}
        if e.summary is not None:
            x = e.summary
            state["scores"] = {"accs": x.accs, "rewards": x.rewards, "penalties": x.penalties}
        out.append(state)
    return out


@dataclass(frozen=True)
class RowRequest:
    """The rows each rank trains on in a step, as every rank computes them from the kept groups' summaries.

    kept: the step's GroupSummary list (same on every rank); index: global row -> (kept group, response);
    wanted: global rows per DP rank (RowPlan.rows_of); dp_of_rank / layers_of_rank: each global rank's DP rank and
    the (first, last) MoE layers of its pipeline stage (None: a dense model).
    """

    kept: list[GroupSummary]
    index: list[tuple[int, int]]
    wanted: list[list[int]]
    dp_of_rank: list[int]
    layers_of_rank: list[tuple[int, int] | None]

    def rows_of(self, rank: int) -> list[int]:
        """The global rows global rank `rank` trains on (those of its DP rank)."""
        return self.wanted[self.dp_of_rank[rank]]

    def owner(self, row: int) -> int:
        """The rank that generated row `row`'s group (it holds the rollout)."""
        return self.kept[self.index[row][0]].owner

    def rollout(self, groups: dict[str, RolloutGroup], row: int, rank: int) -> Rollout:
        """Row `row` out of the generated `groups` (key -> RolloutGroup), with the MoE routing of `rank`'s stage."""
        g, i = self.index[row]
        return groups[self.kept[g].key].rollouts[i].routing_layers(self.layers_of_rank[rank])


class _StepInFlight:
    """The generation of the step in progress, shared by both implementations: its kept groups (this rank's, by key)
    until rows() hands them out, and its result until commit() makes it the run's state or drop() forgets it."""

    def __init__(self) -> None:
        self.groups: dict[str, RolloutGroup] = {}
        """This rank's kept groups of the step in progress, by key, until routed to the DP ranks that train them."""
        self._pending: Any = None

    def _hold(self, groups: dict[str, RolloutGroup], result: Any) -> None:
        self.groups, self._pending = groups, result

    def _hand_out(self) -> dict[str, RolloutGroup]:
        """The step's groups, no longer held (rows() sends or keeps what it needs of them)."""
        groups, self.groups = self.groups, {}
        return groups

    def _take(self) -> Any:
        """The step's result (None when nothing was generated), no longer pending."""
        result, self._pending, self.groups = self._pending, None, {}
        return result

    def drop(self) -> None:
        """A step dropped before its first update: nothing of its generation stays."""
        self._take()


class LocalGeneration(_StepInFlight):
    """Colocated generation: see the module docstring.

    ctx: RolloutContext. export: () -> the actor's named HF tensors (collective: every rank walks it). memory: the
    MemoryChoreographer (builds the engine in the generation phase's memory, rebuilds a dead one). eval_exchange: the
    evaluation's RolloutExchange (None without evaluation data). wait_saved: waits for a checkpoint being written
    (before an engine restart kills this process's children).
    """

    def __init__(
        self,
        ctx: RolloutContext,
        *,
        export: Callable[[], Iterator],
        memory: Any,
        eval_exchange: Any,
        local_rank: int,
        wait_saved: Callable[[], None],
    ) -> None:
        from megatron_dapo.rollout.factory import restarts_in_place
        from megatron_dapo.rollout.factory import sizes_kv_pool_at_start
        from megatron_dapo.rollout.factory import weight_update_target
        from megatron_dapo.rollout.weight_sync import WeightSync

        super().__init__()
        c = ctx.config
        self.ctx, self.export, self.memory, self.eval_exchange, self.wait_saved = (
            ctx, export, memory, eval_exchange, wait_saved,
        )  # fmt: skip
        self.engine_ranks = engine_ranks(c.rollout, ctx.world)
        # A fixed KV capacity per row keeps the embedded engine batch-invariant across the run (slot_cache.py).
        max_context = max(ctx.inputs.longest_prompt, 1) + c.rollout.max_response_length
        self.engine_args = {
            "base_gpu_id": local_rank,
            "seed": c.trainer.seed,
            "max_context": -(-max_context // 64) * 64,
            "routed_experts": c.actor.routing_replay == "r3",
        }
        self.engine = memory.build_engine(
            lambda: self._make_engine() if ctx.rank in self.engine_ranks else None,
            sized_at_start=sizes_kv_pool_at_start(c.rollout),
        )
        restart = self._restart_engine if restarts_in_place(c.rollout) else None
        self.stream = ctx.make_stream(self.engine, stop=ctx.stop, restart=restart, resync=self._resync, log=ctx.log)
        self.carry: list[CarryEntry] = []
        """Groups carried into the next step (rollout.partial), in queue order; the same on every rank."""
        self.carry_rows: dict[str, list[Rollout]] = {}
        """The rollouts of the carried groups this rank owns, by key."""
        # Colocated SGLang with rollout TP > 1: every rank of an engine's group hands SGLang its own GPU's copy.
        target = weight_update_target(c.rollout, self.engine, ctx.rank, ctx.world)
        r = c.rollout
        self.weight_sync = WeightSync(
            target, bucket_bytes=r.weight_sync_bucket_bytes, weight_dtype=r.weight_dtype,
            delta=r.weight_sync_delta, full_every=r.weight_sync_full_every,
        )  # fmt: skip

    def _make_engine(self) -> Any:
        from megatron_dapo.rollout import make_engine

        c = self.ctx.config
        return make_engine(c.rollout, c.actor.model_path, **self.engine_args)

    def start(self, step: int, data: dict[str, Any], resumed: bool) -> None:
        """After a resume the engines get the checkpoint's weights; on a fresh start they hold the model already,
        unless rollout.weight_dtype is not auto (SGLang starts from dummy weights then: the first rollouts must see
        the weights the sync sends)."""
        if resumed or self.ctx.config.rollout.weight_dtype != "auto":
            self.weight_sync.sync(self.export())

    def generate(self, step: int) -> StreamResult:
        if self.engine is not None:
            self.engine.weight_version = step - 1  # synced at the end of the previous step
        result = self.ctx.run_stream(self.stream, step, self.carry, self.carry_rows)
        if not result.interrupted:
            self._hold(result.groups, result)
        return result

    def rows(self, request: RowRequest) -> dict[int, Rollout]:
        """This rank's rows: every owner (the rank that generated a group) sends each row to the ranks whose DP rank
        trains on it, with the MoE routing slice of that rank's stage (an all_to_all over gloo: a rank receives only
        its DP rank's rows)."""
        ctx, groups = self.ctx, self._hand_out()
        mine = {row for row in range(len(request.index)) if request.owner(row) == ctx.rank}
        outgoing = [[(row, request.rollout(groups, row, dst)) for row in request.rows_of(dst) if row in mine]
                    for dst in range(ctx.world)]  # fmt: skip
        return dict(ctx.exchange.all_to_all(outgoing, "rollout rows"))

    def commit(self) -> None:
        """The data moves past the positions the step consumed; the carry is the unfinished groups it left."""
        result = self._take()
        if result is not None:
            self.ctx.inputs.train_data.skip(result.consumed)
            self.carry, self.carry_rows = result.carry, result.carry_rows

    def push_weights(self, version: int) -> dict[str, float]:
        return self.weight_sync.sync(self.export())

    def eval_scores(self, step: int, examples: list) -> list[list[dict]]:
        self.memory.ensure_engine_resident()
        return self.eval_exchange.all_gather(self.ctx.eval_scores(self.engine, examples, self.engine_ranks), "eval")

    def carry_state(self) -> list[dict[str, Any]]:
        return carry_state(self.carry, self.carry_rows, self.ctx.exchange)

    def load_carry(self, states: list[dict[str, Any]]) -> None:
        self.carry, self.carry_rows = carry_entries(states, self.engine_ranks, self.ctx.rank)

    def close(self) -> None:
        self.stream.close()
        if self.engine is not None and self.ctx.config.rollout.mode == "server":  # its group on the SGLang servers
            self.engine.shutdown()

    # ------------------------------------------------------------------------------------------- engine failures
    def _restart_engine(self) -> Any:
        """This rank's engine died while generating (the stream's restart): shut it down, build it again in the
        generation phase's memory (its KV pool sized as at start), hand it to the weight sync; its weights come in the
        stream's next meeting (`_resync`)."""
        from megatron_dapo.rollout.factory import retarget

        self.wait_saved()  # SGLang's shutdown kills every child of this process, a checkpoint writer's too
        try:
            self.engine.shutdown()
        except Exception as err:  # already gone with its process: the new one must start anyway
            self.ctx.log(f"shutting the dead engine down failed ({type(err).__name__}: {err}); starting anew")
        self.ctx.hook("engine_restart")
        self.engine = self.memory.replace_engine(self._make_engine)
        self.weight_sync.engine = retarget(self.weight_sync.engine, self.engine)
        return self.engine

    def _resync(self, ranks: list[int]) -> None:
        """The stream's meeting after engines on `ranks` restarted (collective): every rank walks the actor's export
        (TP/PP gathers); the restarted engines (with colocated SGLang TP > 1, every rank of their group) load it.
        The other engines keep their requests in flight and are not written."""
        from megatron_dapo.rollout.factory import update_group_size
        from megatron_dapo.rollout.weight_sync import WeightSync

        t = update_group_size(self.ctx.config.rollout)
        mine = any(r // t == self.ctx.rank // t for r in ranks)
        sync = WeightSync(
            self.weight_sync.engine if mine else None,
            bucket_bytes=self.weight_sync.bucket_bytes,
            weight_dtype=self.weight_sync.weight_dtype,
        )
        with self.memory.sync_beside_generation():
            sync.sync(self.export())
        if mine:
            self.weight_sync.reset()  # a restarted engine holds no delta base: the next step's sync is full


class _NoAnswer(Exception):
    """The engine ranks did not answer a stop within placement.STOP_ANSWER_S."""


class _AnswerDeadline:
    """After a preemption signal, how long an actor rank still waits for the engine ranks (placement.STOP_ANSWER_S):
    call it at each look while stopping; it raises _NoAnswer once that time has passed since the first call."""

    def __init__(self) -> None:
        self.since: float | None = None

    def __call__(self) -> None:
        from megatron_dapo.placement import STOP_ANSWER_S

        now = time.monotonic()
        self.since = now if self.since is None else self.since
        if now - self.since > STOP_ANSWER_S:
            raise _NoAnswer


class RemoteGeneration(_StepInFlight):
    """The actor ranks of a split launch: see the module docstring.

    ctx: RolloutContext over the actor ranks. placement / mailbox / beat: placement.py's. channel: actor rank 0's
    weight channel (placement.WeightChannel to the engine ranks, or ServerPush to the SGLang servers they drive),
    None on the other actor ranks. export: the actor's named HF tensors (collective). rows: row_channel.RowClient.
    """

    def __init__(
        self, ctx: RolloutContext, *, placement: Any, mailbox: Any, beat: Any, channel: Any, export: Any,
        rows: Any = None, shards: Any = None,
    ):  # fmt: skip
        super().__init__()
        self.ctx, self.placement, self.mailbox, self.beat, self.channel, self.export = (
            ctx, placement, mailbox, beat, channel, export,
        )  # fmt: skip
        self.shards = shards
        """Direct resharding: () -> this rank's (piece name, shard) pairs (MegatronActor.owned_shards)."""
        self.client = rows
        """This rank's row_channel.RowClient (its rows come from engine rank 0's row server); None in tests of the
        loop alone, where the rows come with the step's message."""
        self.carry: list[dict[str, Any]] = []
        """The carry after the last committed step as the engine ranks sent it (checkpoint form)."""
        r = ctx.config.rollout
        self.encoder = DeltaEncoder(r.weight_sync_full_every) if r.weight_sync_delta and channel is not None else None
        """rollout.weight_sync_delta: actor rank 0's copy of the last push (WeightChannel sends the changes)."""

    def start(self, step: int, data: dict[str, Any], resumed: bool) -> None:
        """Post the start state (step, data position, carry) and push the weights as version `step`; the engine
        ranks generate from them."""
        if self.ctx.rank == 0:
            self.mailbox.post("start", {"step": step, "data": data, "carry": self.carry})
        self.push_weights(step)

    def generate(self, step: int) -> StreamResult:
        """This step's generation from the engine ranks (every actor rank reads it). While waiting: an engine rank
        silent for distributed.timeout_minutes ends the job naming it (placement.launch_watch); a preemption signal
        stops the engine ranks, whose answer (an interrupted step) is awaited for STOP_ANSWER_S at most. The actor
        ranks agree on the outcome (an interrupted step on one is one on all)."""
        c, what, deadline = self.ctx.config, f"step {step}'s generation", _AnswerDeadline()

        def poll() -> None:
            self.beat.check(what)
            if self.ctx.stop():
                if self.ctx.rank == 0 and not self.mailbox.has("stop"):
                    self.mailbox.post("stop", True)  # the engine ranks answer with an interrupted step
                deadline()

        try:
            message = self.mailbox.take(
                f"gen/{step}", c.rollout.generation_timeout_minutes * 60.0, what, "rollout.generation_timeout_minutes",
                poll=poll,
            )  # fmt: skip
        except _NoAnswer:
            message = None
        interrupted = message is None or message.interrupted
        if any(self.ctx.exchange.all_gather([interrupted], "the generation's outcome")):
            return StreamResult([], [], {}, [], {}, 0, interrupted=True)  # the step is dropped as in the colocated job
        self._hold(message.groups, message)
        return StreamResult(message.kept, message.decided, message.groups, [], {}, 0, message.metrics,
                            samples=message.samples)  # fmt: skip

    def rows(self, request: RowRequest) -> dict[int, Rollout] | None:
        """This rank's rows, with its stage's MoE routing slice, from engine rank 0's row server (only those cross
        the wire). While waiting: the engine ranks' liveness; after a preemption signal the rows are awaited
        placement.STOP_ANSWER_S at most, then None (the step is dropped: the trainer's next preemption check)."""
        rank, groups = self.ctx.rank, self._hand_out()
        mine = request.rows_of(rank)
        if self.client is None:  # the rows came with the step's message
            return {row: request.rollout(groups, row, rank) for row in mine}
        step = self._pending.step
        wanted = [(request.kept[g].key, i) for g, i in (request.index[row] for row in mine)]
        what, deadline = f"step {step}'s rows", _AnswerDeadline()

        def poll() -> bool:
            self.beat.check(what)
            if self.ctx.stop():
                try:
                    deadline()
                except _NoAnswer:
                    return False
            return True

        received = self.client.take(step, wanted, request.layers_of_rank[rank], poll)
        return None if received is None else dict(zip(mine, received, strict=True))

    def commit(self) -> None:
        """The engine ranks' data position and carry after this step become the run's."""
        result = self._take()
        if result is not None:
            self.ctx.inputs.train_data.load_state_dict(result.data)
            self.carry = result.carry
            if self.ctx.rank == 0:
                self.mailbox.delete(f"gen/{result.step}")  # every actor rank read it before the update began

    def push_weights(self, version: int) -> dict[str, float]:
        """Push the weights as `version`. Direct resharding (rollout.weight_sync_route): every rank sends its own
        shards to the engine ranks (DirectChannel; they quantize to fp8 themselves with rollout.weight_dtype "fp8").
        Otherwise every rank walks the actor's export and rank 0 sends it to the engine ranks (WeightChannel) or to
        the SGLang servers they drive (ServerPush), fp8-quantized as the colocated sync does."""
        from megatron_dapo.placement import DirectChannel
        from megatron_dapo.placement import PushAbandoned
        from megatron_dapo.placement import WeightChannel

        c = self.ctx.config
        direct = isinstance(self.channel, DirectChannel)
        start, exported = time.perf_counter(), self.shards() if direct else self.export()
        named = exported
        if self.channel is None:
            for _ in named:
                pass
            return {}
        if c.rollout.weight_dtype == "fp8" and not direct:
            from megatron_dapo.rollout.fp8 import quantize_named_tensors

            named = quantize_named_tensors(named)
        extra: dict[str, Any] = {"encoder": self.encoder} if self.encoder is not None else {}
        if isinstance(self.channel, WeightChannel):  # engine ranks join it: wait for them as for their generation
            what = f"the engine ranks to join the weight push of step {version}"

            def poll() -> None:
                self.beat.check(what)
                if self.ctx.stop():  # preempted: the run saves at this step's boundary; the engines need no weights
                    raise PushAbandoned

            timeout = (c.rollout.generation_timeout_minutes + c.trainer.eval_timeout_minutes) * 60.0
            extra.update(poll=poll, timeout_s=timeout)
        if direct:
            extra["gather"] = lambda x: self.ctx.exchange.all_gather([x], f"the weight push of step {version}")
        try:
            metrics = self.channel.push(version, named, c.rollout.weight_sync_bucket_bytes, **extra)
        except PushAbandoned:  # rank 0's (the rank-0 route), every rank's (direct)
            if not direct:
                for _ in exported:  # the other actor ranks walk the export's collectives to its end
                    pass
            if self.ctx.rank == 0:
                rank_notice(f"step {version}: a preemption signal came while an engine rank had not joined the "
                            "weight push; it is given up (the checkpoint holds these weights)")  # fmt: skip
            return {}
        metrics["weight_sync/seconds"] = seconds = time.perf_counter() - start
        metrics["weight_sync/gb_per_s"] = metrics["weight_sync/bytes"] / 1e9 / seconds if seconds > 0 else 0.0
        return metrics

    def eval_scores(self, step: int, examples: list) -> list[list[dict]] | None:
        """The engine ranks scored these weights when they loaded them (each posts its share). While waiting: an engine
        rank silent for distributed.timeout_minutes ends the job naming it; after a preemption signal the scores are
        awaited placement.STOP_ANSWER_S at most (an engine rank cannot stop its evaluation), then None: the evaluation
        is given up so that the step's save fits the signal's grace."""
        timeout = self.ctx.config.trainer.eval_timeout_minutes * 60.0
        what, deadline = f"step {step}'s evaluation", _AnswerDeadline()

        def poll() -> None:
            self.beat.check(what)
            if self.ctx.stop():
                deadline()

        try:
            return [
                x
                for e in range(self.placement.num_engine_ranks)
                for x in self.mailbox.take(f"eval/{step}/{e}", timeout, what, "trainer.eval_timeout_minutes", poll=poll)
            ]
        except _NoAnswer:
            return None

    def carry_state(self) -> list[dict[str, Any]]:
        return self.carry

    def load_carry(self, states: list[dict[str, Any]]) -> None:
        self.carry = states  # for the engine ranks (`start`)

    def close(self) -> None:
        if self.ctx.rank == 0:
            self.mailbox.post("stop", True)  # the engine ranks exit
        if hasattr(self.channel, "close"):  # ServerPush: its group on the SGLang servers
            self.channel.close()
        self.beat.close()


def make_generation(
    ctx: RolloutContext,
    *,
    export: Callable[[], Iterator],
    shards: Callable[[], Iterator] | None = None,
    memory: Any,
    placement: Any = None,
    store: Any = None,
    remote: tuple[Any, Any] | None = None,
    eval_exchange: Any = None,
    local_rank: int = 0,
    wait_saved: Callable[[], None] = lambda: None,
) -> LocalGeneration | RemoteGeneration:
    """The trainer's generation: LocalGeneration on a colocated launch (placement None); RemoteGeneration on the actor
    ranks of a split one, with remote = (mailbox, beat) from placement.py, and no engine in this rank's memory (the
    weight channel: every actor rank's DirectChannel with direct resharding, else actor rank 0's, to the engine
    ranks or to the SGLang servers they drive; shards: MegatronActor.owned_shards, for the direct route)."""
    if placement is None:
        return LocalGeneration(
            ctx, export=export, memory=memory, eval_exchange=eval_exchange, local_rank=local_rank,
            wait_saved=wait_saved,
        )  # fmt: skip
    from megatron_dapo.rollout import make_engine
    from megatron_dapo.rollout.factory import sizes_kv_pool_at_start

    c = ctx.config
    memory.build_engine(lambda: None, sized_at_start=sizes_kv_pool_at_start(c.rollout))  # no engine here
    channel = None
    if c.rollout.direct_weight_sync:  # every actor rank sends its own shards
        from megatron_dapo.placement import DirectChannel

        channel = DirectChannel(placement, store, c.distributed.timeout_s)
    elif placement.channel_rank is not None:
        if c.rollout.mode == "server":  # the servers get the weights, their versions go to the store
            from megatron_dapo.placement import ServerPush

            channel = ServerPush(make_engine(c.rollout, c.actor.model_path), store)
        else:
            from megatron_dapo.placement import WeightChannel

            channel = WeightChannel(placement, store, c.distributed.timeout_s)
    from megatron_dapo.row_channel import RowClient

    rows = RowClient(placement.rank, placement.num_actor_ranks, store, c.distributed.timeout_s)  # after the channel
    mailbox, beat = remote
    return RemoteGeneration(
        ctx, placement=placement, mailbox=mailbox, beat=beat, channel=channel, export=export, rows=rows, shards=shards
    )
