"""The engine rank of a split launch (rollout.engine_ranks > 0; placement.py): its own program beside the trainer.

    EngineRank(config, placement, store)   data, verifier, sampler, this rank's engine, the rollout stream over the
                                           engine ranks (their own default group), the weight receiver
      .fit()                               take the actor's start state, then generate each step as soon as the
                                           loaded weights are within trainer.max_staleness of it (the one rule:
                                           stream.oldest_version), loading pushes between engine steps, and hand each
                                           step to the actor ranks (engine rank 0 posts it); then load pushes until
                                           the actor says stop

No actor, checkpoint or logger: the actor ranks (trainer.py, RemoteGeneration in generation.py) own those. A version
that the actor evaluates (trainer.eval_every) is scored here when it is loaded, on a second engine over the same
model (requests of the stream may be in flight on the first).
"""

from __future__ import annotations

import time
from typing import Any

from megatron_dapo.checkpoint import PreemptionFlag
from megatron_dapo.config import RunConfig
from megatron_dapo.errors import rank_notice
from megatron_dapo.experience import sampled_response_metrics
from megatron_dapo.generation import RolloutContext
from megatron_dapo.generation import carry_entries
from megatron_dapo.generation import carry_state
from megatron_dapo.inputs import RunInputs
from megatron_dapo.inputs import agree_at_startup
from megatron_dapo.launch_env import local_rank
from megatron_dapo.metrics import Stat
from megatron_dapo.metrics import finalize
from megatron_dapo.metrics import merge_stats
from megatron_dapo.placement import GONE_S
from megatron_dapo.placement import POLL_S
from megatron_dapo.placement import Mailbox
from megatron_dapo.placement import StepGeneration
from megatron_dapo.rollout.exchange import RolloutExchange
from megatron_dapo.rollout.stream import oldest_version
from megatron_dapo.trajectories import first_samples
from megatron_dapo.trajectories import sample_records


class EngineRank:
    """One engine rank of a split launch (see the module docstring). `launch` builds it on an engine rank; the
    constructor takes the parts (tests give it a fake engine and receiver).

    config: the RunConfig. ctx: RolloutContext over the engine ranks. engine: this rank's engine (or the SGLang
    servers it drives). receiver: placement.StagedReceiver (RelayReceiver with SGLang servers on the direct route,
    ServerVersions on the rank-0 route): `apply(engine)`, `loaded`,
    `received_s`, `loaded_s`, `close()`. mailbox / beat: placement.Mailbox and launch_watch on the launch's store.
    preempt: this rank's PreemptionFlag (`flag`). rows: engine rank 0's row_channel.RowServer, or None.
    """

    def __init__(
        self, config: RunConfig, ctx: RolloutContext, engine: Any, receiver: Any, mailbox: Any, beat: Any, preempt: Any,
        rows: Any = None,
    ) -> None:  # fmt: skip
        self.cfg, self.ctx = config, ctx
        self.rows = rows
        """Engine rank 0's row_channel.RowServer (the actor ranks take their rows from it); None on the others, and in
        tests of this loop alone, where the rows go in the step's message."""
        self.rank, self.world, self.exchange, self.inputs = ctx.rank, ctx.world, ctx.exchange, ctx.inputs
        self.inputs.hook = self.test_hook  # the fresh-prompt point of generation
        self.engine, self.receiver, self.mailbox, self.beat, self.preempt = engine, receiver, mailbox, beat, preempt
        self.step = self._start_step = 0
        self.engine_ranks = list(range(self.world))
        self.stream = ctx.make_stream(engine, stop=self.stopping, log=ctx.log, between_steps=self.load_pushed)
        self.carry, self.carry_rows = [], {}
        self._eval_engine: Any = None

    @classmethod
    def launch(cls, config: RunConfig, placement: Any, store: Any) -> EngineRank:
        """On an engine rank of a split launch: data, verifier, sampler, its engine (the embedded one, or its share of
        rollout.server_urls), the weight receiver, the stream over the engine ranks (their own default group)."""
        from megatron_dapo.placement import RelayReceiver
        from megatron_dapo.placement import StagedReceiver
        from megatron_dapo.placement import launch_watch
        from megatron_dapo.rollout import make_engine

        c = config
        rank, world = placement.role_rank, placement.role_size
        beat = launch_watch(placement, store, c.distributed.timeout_s)  # beating from here: the engine's load is slow
        preempt = PreemptionFlag()
        preempt.install()
        exchange = RolloutExchange(world, timeout_s=c.rollout.generation_timeout_minutes * 60.0)
        inputs = agree_at_startup(exchange, lambda: RunInputs(c, rank_notice if rank == 0 else lambda line: None))
        ctx = RolloutContext.for_run(
            c, rank, world, exchange, inputs, stop=lambda: preempt.flag, hook=lambda point: None, log=rank_notice
        )
        routed = c.actor.routing_replay == "r3"
        if c.rollout.mode == "server":  # the servers: this rank drives its share of them over HTTP
            from megatron_dapo.rollout.factory import server_stream

            urls = c.rollout.server_urls[rank::world]
            # The direct route: this rank streams the rebuilt tensors into its servers (it pushes their update group).
            group: dict[str, Any] = {}
            if c.rollout.direct_weight_sync:
                group = relay_group(c.rollout, urls, rank, placement.world_size, local_rank(placement.rank))
            engine = server_stream(c.rollout, c.actor.model_path, urls, routed_experts=routed, **group)
        else:
            max_context = max(inputs.longest_prompt, 1) + c.rollout.max_response_length
            gpu = local_rank(placement.rank)
            engine = make_engine(
                c.rollout, c.actor.model_path, base_gpu_id=gpu, seed=c.trainer.seed,
                max_context=-(-max_context // 64) * 64, routed_experts=routed,
            )  # fmt: skip
        if c.rollout.mode == "server" and not c.rollout.direct_weight_sync:  # actor rank 0 pushes to the servers
            from megatron_dapo.placement import ServerVersions

            receiver: Any = ServerVersions(store)
        elif c.rollout.mode == "server":  # the direct route: this rank streams each push into its servers
            receiver = RelayReceiver(_weight_channel(c, placement, store), engine, c.rollout.weight_sync_bucket_bytes)
        else:
            receiver = StagedReceiver(_weight_channel(c, placement, store))
        rows = None
        if rank == 0:  # after the weight channel's group, as on actor rank 0 (each constructor waits for its members)
            from megatron_dapo.row_channel import RowServer

            rows = RowServer(placement.num_actor_ranks, store, c.distributed.timeout_s)
        return cls(c, ctx, engine, receiver, Mailbox(store), beat, preempt, rows)

    # ---------------------------------------------------------------------------------------------------- the loop
    def fit(self) -> dict[str, float]:
        """This rank's run (module docstring); returns {} (the actor ranks log)."""
        c, box = self.cfg, self.mailbox
        timeout = c.distributed.timeout_s
        try:
            start = box.take("start", timeout, "the actor's start state", "distributed.timeout_minutes",
                             poll=lambda: self._wait_on_actor("the actor's start state"))  # fmt: skip
        except _Signalled:  # a preemption signal before the run began: nothing to hand over
            return self._close()
        self.step = self._start_step = int(start["step"])
        self.inputs.train_data.load_state_dict(start["data"])
        self.carry, self.carry_rows = carry_entries(start["carry"], self.engine_ranks, self.rank)
        while self.step < c.trainer.total_steps:
            step, waited = self.step + 1, time.perf_counter()
            received, loaded = self.receiver.received_s, self.receiver.loaded_s
            oldest = oldest_version(step, c.trainer.max_staleness)  # the oldest weights this step may come from
            while self._behind(oldest) and not self.stopping():
                self.beat.check(f"the weights of step {step}")  # actor rank 0 stopped or dead: one line
                if self.load_pushed() is None:
                    time.sleep(POLL_S)
            waited = time.perf_counter() - waited
            # Every engine rank enters the stream, stopped or not: it agrees on a stop seen by any of them (a rank
            # leaving here alone would leave the others waiting in its collectives).
            result = self.ctx.run_stream(self.stream, step, self.carry, self.carry_rows)
            if result.interrupted:
                if self.rank == 0:
                    box.post(f"gen/{step}", StepGeneration(step, interrupted=True))
                break
            self.inputs.train_data.skip(result.consumed)
            self.carry, self.carry_rows = result.carry, result.carry_rows
            groups = dict(self.exchange.all_gather(list(result.groups.items()), "kept groups"))
            carry = carry_state(self.carry, self.carry_rows, self.exchange)
            received = self.receiver.received_s - received
            local = {"time/engine_wait_for_weights": Stat.max(waited), "time/engine_weight_receive": Stat.max(received),
                     "time/engine_weight_load": Stat.max(self.receiver.loaded_s - loaded)}  # fmt: skip
            metrics = {**result.metrics, **sampled_response_metrics(result.decided)}
            metrics.update(finalize(merge_stats(self.exchange.all_gather([local], "engine metrics"))))
            if self.rank == 0:
                data = self.inputs.train_data.state_dict()
                samples = None
                if count := c.logging.trajectory_samples:  # chosen here, where every kept group is
                    samples = first_samples(sample_records(groups.values(), self.inputs.tokenizer, count), count)
                if self.rows is not None:  # the actor ranks take their rows from the row server, not the store
                    self.rows.hold(step, groups)
                    groups = {}
                box.post(f"gen/{step}", StepGeneration(step, result.kept, result.decided, groups, metrics, data, carry,
                                                       samples=samples))  # fmt: skip
            self.step = step
        self._await_stop()
        return self._close()

    def _await_stop(self) -> None:
        """The end wait: the actor may still push (it waits for every engine rank to join), so load pushes until it
        says stop. Actor rank 0 silent for distributed.timeout_minutes ends the job naming it (a stopped actor is not
        a finished one: leaving here would leave the launcher waiting on it for ever). After a preemption signal the
        actor says stop once it has saved; an actor silent GONE_S by then will not (killed or stopped): leave."""
        while not self.mailbox.has("stop"):
            if self.preempt.flag and self.beat.silent_s(0) > GONE_S:
                return
            self.beat.check("the actor's stop")
            if self.load_pushed() is None:
                time.sleep(POLL_S)

    def _wait_on_actor(self, what: str) -> None:
        """While waiting for the actor: a preemption signal ends the wait (_Signalled), actor rank 0 silent for
        distributed.timeout_minutes ends the job naming it."""
        if self.preempt.flag:
            raise _Signalled
        self.beat.check(what)

    def _close(self) -> dict[str, float]:
        if self.rows is not None:
            self.rows.close()
        self.receiver.close()
        self.stream.close()
        if self.cfg.rollout.mode == "server":  # the relay's group on its SGLang servers (none on the rank-0 route)
            self.engine.shutdown()
        self.beat.close()
        return {}

    def _behind(self, oldest: int | None) -> bool:
        """No weights loaded yet, or older than `oldest` (None: no bound)."""
        loaded = self.receiver.loaded
        return loaded is None or (oldest is not None and loaded < oldest)

    def load_pushed(self) -> int | None:
        """Load the weights the receiver holds (between engine steps); a version that the actor evaluates
        (trainer.eval_every) is scored at once, on a second engine over the same model (requests of the stream may be
        in flight). Returns the version loaded, or None."""
        version = self.receiver.apply(self.engine)
        every, start = self.cfg.trainer.eval_every, self._start_step
        # The actor evaluates step 0 before training and every eval_every-th step after it (not the one it resumed at).
        due = version is not None and every and version % every == 0 and (version > start or version == start == 0)
        if due and self.inputs.eval_examples:
            if self._eval_engine is None:
                self._eval_engine = self.engine.evaluation_clone()
            examples = self.inputs.eval_examples[: self.cfg.trainer.eval_max_prompts or None]
            scores = self.ctx.eval_scores(self._eval_engine, examples, self.engine_ranks)
            self.mailbox.post(f"eval/{version}/{self.rank}", scores)
        return version

    def stopping(self) -> bool:
        """Stop generating: a preemption signal, or the actor ranks have ended the run."""
        return self.preempt.flag or self.mailbox.has("stop")

    # ---------------------------------------------------------------------------------------------- notices, hooks
    def test_hook(self, point: str) -> None:
        """The testing hook, as DAPOTrainer.test_hook (tests/_hooks_driver.py replaces both): a no-op in training."""

    def barrier(self) -> None:
        """A barrier over the engine ranks (the testing hook's)."""
        self.exchange.barrier()

    def notice(self, line: str) -> None:
        """A one-line notice on engine rank 0's stderr."""
        if self.rank == 0:
            rank_notice(line)


def _weight_channel(c: RunConfig, placement: Any, store: Any) -> Any:
    """This engine rank's end of the actor's weight push: DirectChannel (every actor rank sends its shards; the full
    tensors are rebuilt here, decoded against each sender's last push with weight_sync_delta, or with SGLang servers
    forwarded as changed elements to their delta loader) or WeightChannel (actor rank 0 broadcasts the full tensors;
    a DeltaDecoder here with weight_sync_delta)."""
    from megatron_dapo.placement import WeightChannel

    if c.rollout.direct_weight_sync:
        from transformers import AutoConfig

        from megatron_dapo.placement import DirectChannel

        return DirectChannel(
            placement, store, c.distributed.timeout_s, hf_config=AutoConfig.from_pretrained(c.actor.model_path),
            actor_tp=c.actor.tensor_parallel, delta=c.rollout.weight_sync_delta, fp8=c.rollout.weight_dtype == "fp8",
            forward=c.rollout.mode == "server",  # the servers' delta loader holds the base (rollout/sglang_loader.py)
        )  # fmt: skip
    channel = WeightChannel(placement, store, c.distributed.timeout_s)
    if c.rollout.weight_sync_delta:
        from megatron_dapo.rollout.delta import DeltaDecoder

        channel.decoder = DeltaDecoder()
    return channel


def relay_group(rollout: Any, urls: list[str], engine_rank: int, world_size: int, gpu: int) -> dict[str, Any]:
    """SGLangServerEngine's weight-update-group arguments for an engine rank that relays the weights to the servers
    it drives (rollout.weight_sync_route "direct" in mode "server"): it hosts the group's store on its own host, at
    the address the servers route to (detected: rollout.weight_sync_master_address names actor rank 0's host, the
    rank-0 route's pusher) and port rollout.weight_sync_master_port + engine_rank (engine ranks may share a host).
    With GPUs the group is NCCL and this rank sends from GPU `gpu` (its local rank; the receiving thread that
    streams the push, placement.RelayReceiver, names it): one bucket at a time (rollout.weight_sync_bucket_mb),
    beside whatever server shares that GPU."""
    import torch

    from megatron_dapo.launch_env import num_nodes
    from megatron_dapo.launch_env import weight_sync_master_address

    device = gpu % torch.cuda.device_count() if torch.cuda.is_available() else None
    if device is not None:
        torch.cuda.set_device(device)
    return {
        "master_address": weight_sync_master_address("", urls, num_nodes(world_size)),
        "master_port": rollout.weight_sync_master_port + engine_rank,
        "backend": "gloo" if device is None else "nccl",
        "gpu": device,
    }


class _Signalled(Exception):
    """A preemption signal reached an engine rank waiting for the actor."""
