"""The DAPO loop. Every box of docs/architecture.md is a module; this file only wires them.

One step: the rollout stream (one prompt queue for every engine; each finished group verified + overlong-shaped and
decided by dynamic sampling in queue order, until prompts_per_step groups are kept) -> advantages -> actor log-probs
-> mini-batch updates -> weight sync -> metrics -> periodic eval and checkpoint. All ranks run the same code; rank 0
logs.

Rollout data flow (docs/rollout.md): each engine rank keeps the token rows of the groups it generated and every rank
gets only each group's GroupSummary (accs, rewards, lengths); dynamic sampling, advantages and the row plan
(packing.RowPlan, from lengths) run on the summaries, identically on every rank; then each row goes to the ranks of
the DP rank that trains on it (all TP/PP ranks of that model-parallel group) and nowhere else.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.actor.packing import RowPlan
from megatron_dapo.algorithms import DynamicSampler
from megatron_dapo.algorithms.policy_loss import uses_reference
from megatron_dapo.batch import ActorBatch
from megatron_dapo.checkpoint import CheckpointError
from megatron_dapo.checkpoint import CheckpointManager
from megatron_dapo.checkpoint import PreemptionFlag
from megatron_dapo.checkpoint import checkpoint_root
from megatron_dapo.checkpoint import latest_checkpoint
from megatron_dapo.checkpoint import step_dir_name
from megatron_dapo.checkpoint import step_of
from megatron_dapo.config import RunConfig
from megatron_dapo.errors import JobError
from megatron_dapo.evaluate import score_groups
from megatron_dapo.experience import batch_advantages
from megatron_dapo.experience import engine_old_logp
from megatron_dapo.experience import rollout_correction_parts
from megatron_dapo.experience import row_index
from megatron_dapo.experience import row_lengths
from megatron_dapo.experience import rows_to_batch
from megatron_dapo.experience import sampled_response_metrics
from megatron_dapo.experience import score_group
from megatron_dapo.launch import RunDirLock
from megatron_dapo.launch import StartupError
from megatron_dapo.memory import MemoryChoreographer
from megatron_dapo.metrics import MetricsLogger
from megatron_dapo.metrics import PhaseTimer
from megatron_dapo.metrics import Stat
from megatron_dapo.metrics import Stats
from megatron_dapo.metrics import finalize
from megatron_dapo.metrics import merge_stats
from megatron_dapo.metrics import metrics_row
from megatron_dapo.metrics import mismatch_stats
from megatron_dapo.metrics import plot_run
from megatron_dapo.restarts import attempt_number
from megatron_dapo.rollout.exchange import RolloutExchange
from megatron_dapo.rollout.factory import restarts_in_place
from megatron_dapo.rollout.factory import sampling_params
from megatron_dapo.rollout.stream import CarryEntry
from megatron_dapo.rollout.stream import RolloutStream
from megatron_dapo.rollout.stream import job_store
from megatron_dapo.rollout.types import GroupSummary
from megatron_dapo.rollout.types import Rollout
from megatron_dapo.rollout.types import RolloutGroup


class DAPOTrainer:
    """Owns the actor, the engine, data, sampler, checkpoints and logging for one run (construct on every rank)."""

    placement: Any = None
    """placement.Placement of a split launch (rollout.engine_ranks > 0), else None (colocated)."""

    def __init__(self, config: RunConfig) -> None:
        from megatron_dapo.actor.actor import MegatronActor
        from megatron_dapo.actor.distributed import init_distributed
        from megatron_dapo.actor.reference import WithReference
        from megatron_dapo.actor.reference import reference_model
        from megatron_dapo.reward import Verifier
        from megatron_dapo.rollout import make_engine
        from megatron_dapo.rollout.factory import sizes_kv_pool_at_start
        from megatron_dapo.rollout.factory import weight_update_target
        from megatron_dapo.rollout.weight_sync import WeightSync

        self.cfg = c = config
        if c.rollout.engine_ranks:
            from megatron_dapo.actor.distributed import init_role
            from megatron_dapo.placement import ActorBeat
            from megatron_dapo.placement import Mailbox

            self.placement, store = init_role(c.rollout.engine_ranks, c.distributed.timeout_s)
            self.mailbox = Mailbox(store)
            self.beat = ActorBeat(store, beating=self.placement.rank == 0)
            if self.placement.is_engine:
                self._init_engine_role(store)
                return
        self.groups = init_distributed(
            c.actor.tensor_parallel,
            c.actor.pipeline_parallel,
            expert_parallel=c.actor.expert_parallel,
            seed=c.trainer.seed,
            timeout_s=c.distributed.timeout_s,
        )
        self.rank, self.world = self.groups.rank, self.groups.world_size
        self.preempt = PreemptionFlag()
        """SIGTERM / SIGUSR1 set it; the step boundary saves and exits, and generation stops at once (the stream)."""
        self.preempt.install()
        # Generation waits and rollout objects go over gloo (CPU), bounded by the generation timeout, not NCCL.
        self.exchange = RolloutExchange(self.world, timeout_s=c.rollout.generation_timeout_minutes * 60.0)
        self.eval_exchange = (
            RolloutExchange(self.world, timeout_s=c.trainer.eval_timeout_minutes * 60.0,
                            setting="trainer.eval_timeout_minutes")
            if c.data.eval_files else None
        )  # fmt: skip
        self.dp_of_rank = [int(d) for d in self.exchange.all_gather([self.groups.dp_rank], "dp ranks")]
        """Data-parallel rank of every global rank (destinations of the rollout rows)."""
        self.run_dir = Path(c.trainer.run_dir)
        self.lock = RunDirLock(self.run_dir, self._notice) if self.rank == 0 else None
        self._startup(self._load_inputs)
        self.verifier = Verifier.from_config(c.reward)
        self.sampler = DynamicSampler.from_config(c.algorithm, c.trainer)
        self.ckpt = CheckpointManager(
            checkpoint_root(self.run_dir),
            c.checkpoint.keep_last,
            self.rank,
            self._barrier,
            world_size=self.world,
            gather=lambda obj: self.exchange.all_gather([obj], "checkpoint"),
            log=self._notice,
            allow_unverified=c.checkpoint.allow_unverified,
            check_pickles=lambda path: MegatronActor.check_checkpoint(path / "actor"),
            layout=lambda path: {f"actor/{k}": v for k, v in MegatronActor.checkpoint_items(path / "actor").items()},
        )
        resume_from = self._startup(self._resume_path)
        self.actor = MegatronActor(c, self.groups, hf_dir=None if resume_from else c.actor.model_path)
        replay = self.actor.routing if c.actor.routing_replay == "r3" else None
        layers = (replay.first_layer, replay.num_layers) if replay is not None else None
        self.routing_layers_of_rank: list[tuple[int, int] | None] = self.exchange.all_gather([layers], "MoE layers")
        """R3: the (first MoE layer, count) whose engine routing each global rank replays (its pipeline stage's);
        None: it needs none. The rollout rows carry only that slice to each rank."""
        # A loss with a KL term (GRPO, loss.kl_coef > 0) needs the frozen reference (actor/reference.py).
        self.reference = reference_model(c, self.groups) if uses_reference(c.loss) else None
        self.engine_ranks = rollout_ranks(c.rollout, self.world) if self.placement is None else []
        # The one owner of device memory moves per step (megatron_dapo/memory.py, docs/rollout.md). A colocated
        # SGLang / vLLM engine starts with the actor offloaded, so its KV pool is sized from the GPU without it.
        models = self.actor if self.reference is None else WithReference(self.actor, self.reference)
        self.memory = MemoryChoreographer(None, models, offload=c.actor.offload, barrier=self._host_barrier)
        # A fixed KV capacity per row keeps the embedded engine batch-invariant across the run (slot_cache.py).
        max_context = max(self.longest_prompt, 1) + c.rollout.max_response_length
        self._engine_args = {
            "base_gpu_id": self.groups.local_rank,
            "seed": c.trainer.seed,
            "max_context": -(-max_context // 64) * 64,
            "routed_experts": c.actor.routing_replay == "r3",
        }
        self.engine = self.memory.build_engine(
            lambda: (
                make_engine(c.rollout, c.actor.model_path, **self._engine_args)
                if self.rank in self.engine_ranks
                else None
            ),
            sized_at_start=sizes_kv_pool_at_start(c.rollout),
        )
        self.stream = self._make_stream() if self.placement is None else None
        self.carry: list[CarryEntry] = []
        """Groups carried into the next step (rollout.partial), in queue order; the same on every rank."""
        self.carry_rows: dict[str, list[Rollout]] = {}
        """The rollouts of the carried groups this rank owns, by key."""
        self._pending: Any = None
        """The generation of the step in progress until its update commits it (`_commit_generation`)."""
        self.rows: dict[str, RolloutGroup] = {}
        """This rank's kept groups of the current step, by key, until routed to the DP rank that trains them."""
        # Colocated SGLang with rollout TP > 1: every rank of an engine's group hands SGLang its own GPU's copy.
        target = weight_update_target(c.rollout, self.engine, self.rank, self.world)
        self.weight_sync = WeightSync(
            target, bucket_bytes=c.rollout.weight_sync_bucket_mb * 2**20, weight_dtype=c.rollout.weight_dtype
        )
        self.step = 0
        self.last_row: dict[str, Any] | None = None
        """The metrics row of the last logged step (checkpointed with it: a torn metrics.jsonl loses no row)."""
        self.channel: Any = None
        """Split launch, actor rank 0: the weight channel to the engine ranks (placement.WeightChannel)."""
        self.carry_state: list[dict[str, Any]] = []
        """Split launch: the carry after the last committed step as the engine ranks sent it (checkpoint form)."""
        if self.placement is not None and self.placement.channel_rank is not None:
            if c.rollout.engine == "sglang":  # SGLang servers: the weights go to them, their versions to the store
                from megatron_dapo.placement import ServerPush

                self.channel = ServerPush(make_engine(c.rollout, c.actor.model_path), store)
            else:
                from megatron_dapo.placement import WeightChannel

                self.channel = WeightChannel(self.placement, store, c.distributed.timeout_s)
        if resume_from is not None:
            resume_from = self._load(resume_from)
            self._notice(f"resumed from {resume_from} (step {self.step} of {c.trainer.total_steps})")
        else:
            if self.rank == 0:  # rows of an earlier start that saved no checkpoint: this start logs them again
                _drop_unsaved_metrics(self.run_dir / "metrics.jsonl", self._notice)
            if c.rollout.weight_dtype != "auto" and self.placement is None:
                # The engine starts from the checkpoint in full precision (SGLang from dummy weights): the first
                # rollouts must already see the weights the sync sends.
                self.weight_sync.sync(self.actor.export_hf_weights())
        if self.placement is not None:
            self._start_engines()
        self.logger = (
            MetricsLogger(
                self.run_dir,
                console=c.logging.console,
                jsonl=c.logging.jsonl,
                tensorboard=c.logging.tensorboard,
                total_steps=c.trainer.total_steps,
            )
            if self.rank == 0
            else None
        )

    def _make_stream(self, between_steps: Any = None) -> RolloutStream:
        """The rollout stream over this role's ranks (every rank colocated; the engine ranks of a split launch)."""
        c = self.cfg
        actor = self.placement is None  # the actor is in these processes: engines restart in place, resync from it
        return RolloutStream(
            self.engine,
            self.rank,
            self.exchange,
            job_store(self.rank, self.world, self.exchange, c.distributed.timeout_s),
            group_size=c.algorithm.group_size,
            window=c.rollout.max_inflight_prompts or c.trainer.gen_prompts_per_batch,
            cap=self.sampler.max_sampled_prompts,
            partial=c.rollout.partial,
            max_staleness=c.trainer.max_staleness,
            on_stale=c.trainer.on_stale,
            timeout_s=c.rollout.generation_timeout_minutes * 60.0,
            score=self._score,
            over_sampling=c.rollout.over_sampling,
            expected_keep=c.algorithm.expected_keep_ratio,
            stop=(lambda: self.preempt.flag) if actor else self._engines_stop,
            max_gen_s=c.algorithm.max_gen_minutes * 60.0,
            stall_s=c.distributed.timeout_s if self.world > 1 else 0.0,
            restart=self._restart_engine if actor and restarts_in_place(c.rollout) else None,
            resync=self._resync_engines if actor else None,
            max_restarts=c.rollout.engine_restarts,
            prompt_retries=c.rollout.prompt_retries,
            engine_stall_s=c.rollout.engine_stall_minutes * 60.0,
            log=self._rank_notice,
            between_steps=between_steps,
        )

    # ------------------------------------------------------------------------------------- split launch: engines
    def _init_engine_role(self, store: Any) -> None:
        """An engine rank of a split launch (rollout.engine_ranks): data, verifier, sampler, its engine and the stream
        over the engine ranks (their own default group), the weight receiver. No actor, checkpoint or logger: the
        actor ranks own those (fit runs `_serve`)."""
        from megatron_dapo.placement import StagedReceiver
        from megatron_dapo.placement import WeightChannel
        from megatron_dapo.reward import Verifier
        from megatron_dapo.rollout import make_engine

        c = self.cfg
        self.rank, self.world = self.placement.role_rank, self.placement.role_size
        self.preempt = PreemptionFlag()
        self.preempt.install()
        self.exchange = RolloutExchange(self.world, timeout_s=c.rollout.generation_timeout_minutes * 60.0)
        self.run_dir, self.lock, self.logger, self.step = Path(c.trainer.run_dir), None, None, 0
        self._startup(self._load_inputs)
        self.verifier = Verifier.from_config(c.reward)
        self.sampler = DynamicSampler.from_config(c.algorithm, c.trainer)
        self.engine_ranks = list(range(self.world))
        max_context = max(self.longest_prompt, 1) + c.rollout.max_response_length
        local_rank = int(os.environ.get("LOCAL_RANK", self.placement.rank))
        if c.rollout.engine == "sglang":  # SGLang servers: this rank drives its share of them over HTTP
            from megatron_dapo.placement import ServerVersions
            from megatron_dapo.rollout.factory import server_stream

            self.engine = server_stream(
                c.rollout, c.actor.model_path, c.rollout.server_urls[self.rank :: self.world],
                routed_experts=c.actor.routing_replay == "r3",
            )  # fmt: skip
            self.receiver: Any = ServerVersions(store)
        else:
            self.engine = make_engine(
                c.rollout, c.actor.model_path, base_gpu_id=local_rank, seed=c.trainer.seed,
                max_context=-(-max_context // 64) * 64, routed_experts=c.actor.routing_replay == "r3",
            )  # fmt: skip
            self.receiver = StagedReceiver(WeightChannel(self.placement, store, c.distributed.timeout_s))
        self.stream = self._make_stream(between_steps=self._load_pushed)
        self.carry, self.carry_rows = [], {}
        self._eval_engine: Any = None
        self._start_step = 0

    def _load_pushed(self) -> int | None:
        """Engine ranks: load the weights the receiver holds (between engine steps); a version that the actor
        evaluates (trainer.eval_every) is scored at once, on a second engine over the same model (requests of the
        stream may be in flight). Returns the version loaded, or None."""
        version = self.receiver.apply(self.engine)
        every, start = self.cfg.trainer.eval_every, self._start_step
        # The actor evaluates step 0 before training and every eval_every-th step after it (not the one it resumed at).
        due = version is not None and every and version % every == 0 and (version > start or version == start == 0)
        if due and self.eval_examples:
            if self._eval_engine is None:
                model = self.engine.model
                self._eval_engine = type(self.engine)(
                    model, dtype=next(model.parameters()).dtype, device=self.engine.device,
                    eos_token_ids=self.engine.eos_token_ids, pad_token_id=self.engine.pad_token_id,
                    max_running=self.engine.max_running, max_context=self.engine.max_context,
                )  # fmt: skip
            examples = self.eval_examples[: self.cfg.trainer.eval_max_prompts or None]
            self.mailbox.post(f"eval/{version}/{self.rank}", self._eval_scores(examples, self._eval_engine))
        return version

    def _serve(self) -> dict[str, float]:
        """An engine rank's run: take the actor's start state, then generate each step as soon as the loaded weights
        are at most trainer.max_staleness versions behind its previous step, loading pushes between engine steps,
        and hand each step to the actor ranks (engine rank 0 posts it); then load pushes until the actor says stop."""
        from megatron_dapo.placement import POLL_S
        from megatron_dapo.placement import StepGeneration

        c, box = self.cfg, self.mailbox
        timeout = c.distributed.timeout_s
        start = box.take("start", timeout, "the actor's start state", "distributed.timeout_minutes")
        self.step = self._start_step = int(start["step"])
        self.train_data.load_state_dict(start["data"])
        self._load_carry(start["carry"])
        params = sampling_params(
            c.rollout, n=1, stop_token_ids=self.stop_ids, routed_experts=c.actor.routing_replay == "r3"
        )
        while self.step < c.trainer.total_steps:
            step, waited, received = self.step + 1, time.perf_counter(), self.receiver.received_s
            oldest = step - 1 - c.trainer.max_staleness  # the oldest weights this step may be generated from
            while (self.receiver.loaded is None or self.receiver.loaded < oldest) and not self._engines_stop():
                if self._load_pushed() is None:
                    time.sleep(POLL_S)
            waited = time.perf_counter() - waited
            # Every engine rank enters the stream, stopped or not: it agrees on a stop seen by any of them (a rank
            # leaving here alone would leave the others waiting in its collectives).
            result = self.stream.run(
                step, self.sampler.start(), params, c.trainer.seed, self._fresh, self.carry, self.carry_rows
            )
            if result.interrupted:
                if self.rank == 0:
                    box.post(f"gen/{step}", StepGeneration(step, interrupted=True))
                break
            self.train_data.skip(result.consumed)
            self.carry, self.carry_rows = result.carry, result.carry_rows
            groups = dict(self.exchange.all_gather(list(result.groups.items()), "kept groups"))
            carry = self._carry_state()
            received = self.receiver.received_s - received
            local = {"time/engine_wait_for_weights": Stat.max(waited), "time/engine_weight_receive": Stat.max(received)}
            metrics = {**result.metrics, **sampled_response_metrics(result.decided)}
            metrics.update(finalize(merge_stats(self.exchange.all_gather([local], "engine metrics"))))
            if self.rank == 0:
                box.post(
                    f"gen/{step}",
                    StepGeneration(step, result.kept, result.decided, groups, metrics, self.train_data.state_dict(),
                                   carry),
                )  # fmt: skip
            self.step = step
        # The actor may still push (it waits for every engine to join): load until it says stop, or is gone.
        while not box.has("stop") and not self.beat.gone():
            self._load_pushed()
            time.sleep(POLL_S)
        self.receiver.close()
        self.stream.close()
        return {}

    def _engines_stop(self) -> bool:
        """An engine rank stops generating: a preemption signal, or the actor ranks have ended the run."""
        return self.preempt.flag or self.mailbox.has("stop")

    # --------------------------------------------------------------------------------------- split launch: actor
    def _start_engines(self) -> None:
        """Split launch, actor ranks (collective): post the start state (step, data position, carry) and push the
        weights as version `step`; the engine ranks generate from them."""
        if self.rank == 0:
            self.mailbox.post(
                "start", {"step": self.step, "data": self.train_data.state_dict(), "carry": self.carry_state}
            )
        self._push_weights(self.step)

    def _stop_engines_on_preemption(self) -> None:
        """Split launch, actor rank 0 waiting for a step's generation: a preemption signal here stops the engine
        ranks (they answer with an interrupted step, and the step is dropped as in the colocated job)."""
        if self.preempt.flag and self.rank == 0 and not self.mailbox.has("stop"):
            self.mailbox.post("stop", True)

    def _push_weights(self, version: int) -> dict[str, float]:
        """Split launch (collective over the actor ranks): every rank walks the actor's export; rank 0 sends it as
        `version` to the engine ranks (WeightChannel) or to the SGLang servers they drive (ServerPush), the fp8
        quantization (rollout.weight_dtype) as the colocated sync does it."""
        start, named = time.perf_counter(), self.actor.export_hf_weights()
        if self.channel is None:
            for _ in named:
                pass
            return {}
        if self.cfg.rollout.weight_dtype == "fp8":
            from megatron_dapo.rollout.fp8 import quantize_named_tensors

            named = quantize_named_tensors(named)
        metrics = self.channel.push(version, named, self.cfg.rollout.weight_sync_bucket_mb * 2**20)
        metrics["weight_sync/seconds"] = seconds = time.perf_counter() - start
        metrics["weight_sync/gb_per_s"] = metrics["weight_sync/bytes"] / 1e9 / seconds if seconds > 0 else 0.0
        return metrics

    def _load_inputs(self) -> None:
        """Run-dir lock (rank 0), tokenizer and data: the user-input part of start-up."""
        from transformers import AutoConfig
        from transformers import AutoTokenizer

        from megatron_dapo.data import PromptDataset
        from megatron_dapo.data import PromptIterator

        c = self.cfg
        if self.lock is not None:
            self.lock.acquire()
        self.tokenizer = AutoTokenizer.from_pretrained(c.actor.model_path)
        hf_config = AutoConfig.from_pretrained(c.actor.model_path)
        self.architecture = model_architecture(hf_config)
        self.stop_ids = [self.tokenizer.eos_token_id]
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        prompts = {
            "tokenizer": self.tokenizer,
            "max_prompt_length": c.data.max_prompt_length,
            # A prompt plus a full response must fit the model's positions (PromptLimit.of).
            "max_positions": getattr(hf_config, "max_position_embeddings", None),
            "max_response_length": c.rollout.max_response_length,
            "filter_overlong": c.data.filter_overlong_prompts,
            "drop_duplicates": c.data.drop_duplicates,
            "cache_dir": c.data.cache_dir or None,
            "log": self._notice,
        }
        train = PromptDataset(c.data.train_files, **prompts)
        self.train_data = PromptIterator(
            train.examples, seed=c.data.seed, shuffle=c.data.shuffle, identity=train.identity
        )
        evals = PromptDataset(c.data.eval_files, **prompts) if c.data.eval_files else None
        self.eval_examples = evals.examples if evals is not None else []
        self.longest_prompt = max(train.longest_prompt or 0, (evals.longest_prompt or 0) if evals else 0)
        self._train_prompt_ids: dict[int, list[int]] = {}
        self._cached_prompt_ids = train.cache.prompt_ids_of_index if train.cache is not None else None

    def _startup(self, fn: Any) -> Any:
        """Run a start-up step on every rank; a user error on any rank (a bad input, a held run-dir lock, no usable
        checkpoint) becomes the same StartupError on every rank, so none is left waiting in a collective."""
        error = None
        try:
            result = fn()
        except (StartupError, CheckpointError, ValueError, OSError) as err:
            error, result = str(err).splitlines()[0] if str(err) else type(err).__name__, None
        errors = [e for e in self.exchange.all_gather([error], "start-up") if e is not None]
        if errors:
            if self.lock is not None:
                self.lock.release()
            raise StartupError(errors[0])
        return result

    # ------------------------------------------------------------------------------------------------- the loop
    def fit(self) -> dict[str, float]:
        """Train to trainer.total_steps (or a preemption). Raises JobError when none of this run's steps applied an
        optimizer update (every update skipped, or no group kept): such a run must not exit 0 as if it trained."""
        if self.placement is not None and self.placement.is_engine:
            return self._serve()
        last: dict[str, float] = {}
        self.session_steps = self.session_updates = 0
        if self.step == 0 and self.cfg.trainer.eval_every:
            self._log(0, self.evaluate())
        while self.step < self.cfg.trainer.total_steps:
            self.step += 1
            metrics = self.train_step()
            self._finish_save()  # the previous step's background save, written while this step ran
            self.test_hook("step_end")
            if metrics is None:  # a preemption signal before the step's first optimizer step: it never happened
                self.step -= 1
                self._note(
                    f"a preemption signal came before step {self.step + 1}'s update; the step is dropped, the last "
                    "one saved, exiting"
                )
                newest = latest_checkpoint(self.ckpt.root)
                unsaved = self.step > 0 and (newest is None or newest.name != step_dir_name(self.step))
                if self._all_reduce_max(torch.tensor([int(unsaved)])).item():  # one decision on every rank
                    self.save()
                break
            last = metrics
            applied = metrics.get("actor/num_updates", 0.0) - metrics.get("actor/skipped_steps", 0.0)
            self.session_steps, self.session_updates = self.session_steps + 1, self.session_updates + int(applied)
            if self.cfg.trainer.eval_every and self.step % self.cfg.trainer.eval_every == 0:
                last.update(self.evaluate())
            self._log(self.step, last)
            preempted = self.preempt.requested(self._all_reduce_max)
            if preempted:
                self._preemption_notice()
            every, last_step = self.cfg.checkpoint.save_every, self.step == self.cfg.trainer.total_steps
            if preempted or (every and self.step % every == 0) or last_step:
                self.save(background=self.cfg.checkpoint.async_save and not (preempted or last_step))
            self.test_hook("after_step")
            if preempted:
                break
        self.close()
        if self.session_steps and not self.session_updates:
            raise JobError(
                f"no optimizer update was applied in this run's {self.session_steps} steps (each skipped for a "
                "non-finite loss or gradient, or no prompt group kept): nothing was trained; see actor/skipped_steps "
                "and sampling/prompts_kept in metrics.jsonl"
            )
        return last

    def train_step(self) -> dict[str, float] | None:
        """One step (collective): its metrics, or None when a preemption signal came before the step's first
        optimizer step (in generation, which stops at once, or by the end of the log-probs pass): nothing trained, and
        the data position and the carry are those before the step. A signal during the update lets the step finish
        (docs/reliability.md, "Preemption: giving the save time")."""
        timer, start = PhaseTimer(), time.perf_counter()
        metrics: dict[str, float] = {}
        routed: list = []  # [(this DP rank's rows, RowPlan)] when dynamic sampling kept any group
        interrupted: list[bool] = []

        def generation() -> None:
            with timer("generate"):
                result = self._generate()
            if result.interrupted:
                interrupted.append(True)
                return
            metrics.update(result.metrics)
            metrics.update(sampled_response_metrics(result.decided))
            if result.kept:
                routed.append(self._route(result.kept))

        def abandon() -> bool:
            """Whether a preemption signal reached any rank (collective; every rank calls it at the same points)."""
            if not interrupted and self.preempt.requested(self._all_reduce_max):
                interrupted.append(True)
            return bool(interrupted)

        def log_probs() -> None:
            if abandon():
                return
            if routed:
                batch, plan = routed[0]
                from_engine = self.cfg.algorithm.old_logp_source == "engine"
                with timer("logprobs"):
                    if from_engine:  # pi_old is the engine's: no actor pass (config: no correction, no r2)
                        batch.old_logp, entropy = engine_old_logp(batch), None
                    else:
                        record = self.cfg.actor.routing_replay == "r2"  # the update replays this pass's experts
                        batch.old_logp, entropy = self.actor.compute_logprobs(batch, plan=plan, record_routing=record)
                        metrics.update(self.actor.pop_routing_agreement("rollout"))  # r3: engine vs actor routing
                    if self.reference is not None:
                        batch.ref_logp, _ = self.reference.compute_logprobs(batch, plan=plan, with_entropy=False)
                # Per row, so the local rows get exactly what the whole batch would; MIS changes D, so before update.
                correction = {} if from_engine else rollout_correction_parts(batch, self.cfg.algorithm)
                metrics.update(self._batch_metrics(batch, entropy, correction, mismatch=not from_engine))
            self.test_hook("logprobs_end")
            abandon()

        def update() -> None:
            if interrupted:
                return
            self._commit_generation()
            if routed:
                batch, plan = routed[0]
                with timer("update"):
                    metrics.update(self.actor.update(batch, plan=plan))
                metrics["train/responses"] = float(plan.num_rows)
                tokens = self.actor.pop_token_stats()
                metrics["train/pad_fraction"] = tokens["pad_fraction"]
                metrics["train/computed_tokens"] = tokens["computed_tokens"]
                metrics["train/shared_fraction"] = tokens["shared_fraction"]
                actor_s = timer.seconds["logprobs"] + timer.seconds["update"]
                metrics["perf/actor_tokens_per_s"] = tokens["real_tokens"] / max(actor_s, 1e-9)

        def sync() -> None:
            if interrupted:
                return
            with timer("weight_sync"):
                if self.placement is None:
                    metrics.update(self.weight_sync.sync(self.actor.export_hf_weights()))
                else:
                    metrics.update(self._push_weights(self.step))

        self.memory.run_step({"generation": generation, "log-probs": log_probs, "update": update, "sync": sync})
        self.rows = {}
        if interrupted:
            return None
        timer.seconds["step"] = time.perf_counter() - start
        generated = metrics.get("stream/tokens_generated", 0.0)
        metrics["perf/tokens_per_s"] = generated / max(timer.seconds["step"], 1e-9)
        metrics["perf/gen_tokens_per_s"] = generated / max(timer.seconds["generate"], 1e-9)
        return {**metrics, **timer.metrics()}

    # ------------------------------------------------------------------------------------------------ rollout
    def _render(self, example: Any) -> list[int]:
        """Prompt token ids (lengths were checked when the data loaded)."""
        from megatron_dapo.data.dataset import prompt_token_ids

        return prompt_token_ids(self.tokenizer, example.prompt_messages)

    def _fresh(self, offset: int) -> tuple[int, str, list[int]]:
        """(example index, ground truth, prompt ids) of the data's offset-th next prompt (a fresh queue position);
        the ids come from the prompt cache, or without it are kept by example index once rendered (indices are per
        dataset: eval ones are not here)."""
        self.test_hook("fresh_prompt")
        example = self.train_data.peek(offset)
        if self._cached_prompt_ids is not None:  # the prompt cache's mapped token ids
            return example.index, example.ground_truth, self._cached_prompt_ids(example.index)
        ids = self._train_prompt_ids.get(example.index)
        if ids is None:
            ids = self._train_prompt_ids[example.index] = self._render(example)
        return example.index, example.ground_truth, ids

    def _score(self, position: int, index: int, truth: str, rollouts: list[Rollout]) -> RolloutGroup:
        """A finished group scored on the rank that generated it (verifier + overlong shaping)."""
        c = self.cfg
        texts = self.tokenizer.batch_decode([r.response_ids for r in rollouts], skip_special_tokens=True)
        return score_group(
            position, index, truth, rollouts, texts, self.verifier, c.algorithm, c.rollout.max_response_length
        )

    def _generate(self) -> Any:
        """This step's stream (collective): kept groups, the rows this rank owns, the carry for the next step."""
        c = self.cfg
        if self.placement is not None:  # a split launch: the engine ranks generated it
            return self._received_generation()
        if self.engine is not None:
            self.engine.weight_version = self.step - 1  # synced at the end of the previous step
        r3 = c.actor.routing_replay == "r3"  # the actor replays the engine's experts
        params = sampling_params(c.rollout, n=1, stop_token_ids=self.stop_ids, routed_experts=r3)
        result = self.stream.run(
            self.step, self.sampler.start(), params, c.trainer.seed, self._fresh, self.carry, self.carry_rows
        )
        if result.interrupted:
            return result
        self.rows = result.groups
        self._pending = result
        return result

    def _received_generation(self) -> Any:
        """Split launch, actor ranks: this step's generation from the engine ranks (every actor rank reads it)."""
        from megatron_dapo.rollout.stream import StreamResult

        c = self.cfg
        message = self.mailbox.take(
            f"gen/{self.step}", c.rollout.generation_timeout_minutes * 60.0, f"step {self.step}'s generation",
            "rollout.generation_timeout_minutes", poll=self._stop_engines_on_preemption,
        )  # fmt: skip
        if message.interrupted:  # the engine ranks stopped (a preemption signal, theirs or this rank's)
            return StreamResult([], [], {}, [], {}, 0, interrupted=True)
        self.rows, self._pending = message.groups, message
        return StreamResult(message.kept, message.decided, message.groups, [], {}, 0, message.metrics)

    def _restart_engine(self) -> Any:
        """This rank's engine died while generating (the stream's restart): shut it down, build it again in the
        generation phase's memory (its KV pool sized as at start), hand it to the weight sync; its weights come in the
        stream's next meeting (`_resync_engines`)."""
        from megatron_dapo.rollout import make_engine
        from megatron_dapo.rollout.factory import retarget

        c = self.cfg
        self.ckpt.wait_written()  # SGLang's shutdown kills every child of this process, a checkpoint writer's too
        try:
            self.engine.shutdown()
        except Exception as err:  # already gone with its process: the new one must start anyway
            self._rank_notice(f"shutting the dead engine down failed ({type(err).__name__}: {err}); starting anew")
        self.test_hook("engine_restart")
        self.engine = self.memory.replace_engine(
            lambda: make_engine(c.rollout, c.actor.model_path, **self._engine_args)
        )
        self.weight_sync.engine = retarget(self.weight_sync.engine, self.engine)
        return self.engine

    def _resync_engines(self, ranks: list[int]) -> None:
        """The stream's meeting after engines on `ranks` restarted (collective): every rank walks the actor's export
        (TP/PP gathers); the restarted engines (with colocated SGLang TP > 1, every rank of their group) load it.
        The other engines keep their requests in flight and are not written."""
        from megatron_dapo.rollout.factory import update_group_size
        from megatron_dapo.rollout.weight_sync import WeightSync

        t = update_group_size(self.cfg.rollout)
        mine = any(r // t == self.rank // t for r in ranks)
        sync = WeightSync(
            self.weight_sync.engine if mine else None,
            bucket_bytes=self.weight_sync.bucket_bytes,
            weight_dtype=self.weight_sync.weight_dtype,
        )
        with self.memory.sync_beside_generation():
            sync.sync(self.actor.export_hf_weights())

    def _commit_generation(self) -> None:
        """The step's generation becomes the run's state (at its first optimizer step; a step dropped before it leaves
        the data position and the carry as they were): the data moves past the positions it consumed, the carry is
        the unfinished groups it left."""
        result, self._pending = self._pending, None
        if result is not None and self.placement is not None:  # the engine ranks' state after this step
            self.train_data.load_state_dict(result.data)
            self.carry_state = result.carry
            if self.rank == 0:
                self.mailbox.delete(f"gen/{self.step}")  # every actor rank read it before the update began
        elif result is not None:
            self.train_data.skip(result.consumed)
            self.carry, self.carry_rows = result.carry, result.carry_rows

    def _sample(self, examples: list, n: int, temperature: float, top_p: float, seed: int, engine: Any = None) -> list:
        """Evaluation: n responses for this rank's share of `examples` (interleaved by engine rank); returns
        (example, rollouts) pairs for the local share. engine: the one to sample with (default this rank's)."""
        engine = engine or self.engine
        if engine is None:
            return []
        slot = self.engine_ranks.index(self.rank)
        mine = examples[slot :: len(self.engine_ranks)]
        params = sampling_params(
            self.cfg.rollout, n, seed=seed + self.rank, stop_token_ids=self.stop_ids, temperature=temperature,
            top_p=top_p, return_logprobs=False,
        )  # fmt: skip
        rollouts = engine.generate([self._render(ex) for ex in mine], params) if mine else []
        return [(ex, rollouts[i * n : (i + 1) * n]) for i, ex in enumerate(mine)]

    def _route(self, kept: list[GroupSummary]) -> tuple[ActorBatch, RowPlan]:
        """This DP rank's rows of the training batch made of `kept` (group summaries, same on every rank).

        Every rank builds the same RowPlan from the summaries' lengths; each owner (the rank that generated a group)
        sends each row to the ranks whose DP rank trains on it (an all_to_all over gloo: a rank receives only its
        DP rank's rows). Returns (local batch: plan.rows_of(dp_rank) in that order, plan).
        """
        c = self.cfg
        index = row_index(kept)
        plan = RowPlan.build(row_lengths(kept), self.groups.dp_size, c.mini_batch_rows)
        mine = plan.rows_of(self.groups.dp_rank)
        if self.placement is not None:  # a split launch: every actor rank received every kept group
            layers = self.routing_layers_of_rank[self.rank]
            received = {}
            for row in mine:
                g, i = index[row]
                received[row] = self.rows[kept[g].key].rollouts[i].routing_layers(layers)
        else:
            outgoing: list[list] = [[] for _ in range(self.world)]
            wanted = [plan.rows_of(d) for d in range(self.groups.dp_size)]
            for dst in range(self.world):
                for row in wanted[self.dp_of_rank[dst]]:
                    g, i = index[row]
                    if kept[g].owner == self.rank:
                        rollout = self.rows[kept[g].key].rollouts[i]
                        outgoing[dst].append((row, rollout.routing_layers(self.routing_layers_of_rank[dst])))
            received = dict(self.exchange.all_to_all(outgoing, "rollout rows"))
        missing = [r for r in mine if r not in received]
        if missing:
            raise RuntimeError(f"rollout routing: rank {self.rank} did not receive rows {missing[:5]} of its plan")
        advantages, keep = batch_advantages(kept, c.algorithm, c.loss.std_normalize)
        rows = torch.tensor(mine, dtype=torch.int64)
        batch = rows_to_batch([(received[r], index[r][0]) for r in mine], advantages[rows], keep[rows], self.pad_id)
        self.routed_rows = mine
        """Global row ids this rank received in the last step (tests read it)."""
        return batch, plan

    def _batch_metrics(
        self, batch: ActorBatch, entropy: torch.Tensor | None, correction: Stats, *, mismatch: bool = True
    ) -> dict[str, float]:
        """Entropy, valid-token count (after rollout correction), engine/actor log-prob mismatch (mismatch: False when
        old_logp is the engine's own) and the rollout correction's metrics (`correction`, this rank's Stats) over the
        whole batch: each DP rank's Stats (one rank per model-parallel group contributes) merged over the gloo
        exchange."""
        mask = batch.response_mask
        local: Stats = {"train/valid_tokens": Stat.sum(float(batch.loss_mask.sum()))}
        if entropy is not None:  # None: no old-log-prob pass (old_logp_source engine); the update's entropy stands
            local["actor/entropy"] = Stat.mean(float((entropy * mask).sum()), float(mask.sum()))
        if batch.engine_logp is not None and mismatch:
            local.update(mismatch_stats(batch.old_logp, batch.engine_logp, mask))
        local.update(correction)
        first = self.rank == min(self.groups.mp_ranks)
        return finalize(merge_stats(self.exchange.all_gather([local] if first else [], "batch metrics")))

    def evaluate(self) -> dict[str, float]:
        t = self.cfg.trainer
        examples = self.eval_examples[: t.eval_max_prompts or None]
        if not examples:
            return {}
        start = time.perf_counter()
        if self.placement is not None:  # a split launch: the engine ranks scored these weights when they loaded them
            timeout = t.eval_timeout_minutes * 60.0
            scores = [
                x
                for e in range(self.placement.num_engine_ranks)
                for x in self.mailbox.take(
                    f"eval/{self.step}/{e}", timeout, f"step {self.step}'s evaluation", "trainer.eval_timeout_minutes"
                )  # fmt: skip
            ]
        else:
            self.memory.ensure_engine_resident()
            scores = self.eval_exchange.all_gather(self._eval_scores(examples), "eval")
        metrics = score_groups(scores, t.eval_samples)
        metrics["time/eval"] = time.perf_counter() - start
        return metrics

    def _eval_scores(self, examples: list, engine: Any = None) -> list[list[float]]:
        """This rank's share of the evaluation: the verifier's score of each of its examples' eval_samples
        responses."""
        t = self.cfg.trainer
        local = []
        sampled = self._sample(examples, t.eval_samples, t.eval_temperature, t.eval_top_p, t.seed + 7, engine)
        for ex, rollouts in sampled:
            texts = self.tokenizer.batch_decode([x.response_ids for x in rollouts], skip_special_tokens=True)
            local.append([self.verifier(text, ex.ground_truth) for text in texts])
        return local

    # ------------------------------------------------------------------------------------------------ state
    def _resume_path(self) -> Path | None:
        """The checkpoint to resume from (verified, config compatible) or None; CheckpointError names a bad one."""
        resume = self.cfg.checkpoint.resume
        restarted = attempt_number() > 0 and resume != "auto" and self.ckpt.find_resumable() is not None
        if restarted:  # a restart continues this job from its own last save (megatron_dapo/restarts.py)
            self._notice(f"restart: resuming this job's own last checkpoint (instead of checkpoint.resume={resume})")
            resume = "auto"
        self._fall_back = resume == "auto"  # a checkpoint that fails while loading gives way to the previous one
        if resume == "never":
            return None
        if resume == "auto":
            path = self.ckpt.find_resumable()
        else:
            problems = self.ckpt.verify(resume)
            if problems:
                raise CheckpointError(f"checkpoint.resume={resume}: cannot use it: {'; '.join(problems[:3])}")
            path = Path(resume)
        if path is not None:
            self._check_resumable(path)
        return path

    def _check_resumable(self, path: Path) -> None:
        """What a resume from `path` needs besides its files: the config compatible, the data and the model the same
        (one line each, every rank); _load restores the state."""
        self.ckpt.check_config(path, self.cfg.to_dict())
        saved = check_state_files(path, self.rank, self.world)
        self.train_data.check_state(saved.get("data", {}), where=str(path), log=self._notice)
        check_architecture(saved.get("architecture"), self.architecture, str(path))

    def _preemption_notice(self) -> None:
        flag, grace = self.preempt, self.cfg.checkpoint.preempt_grace_s
        if flag.received_at is None:
            self._note("a peer rank got a preemption signal; saving at this step boundary")
            return
        waited = time.monotonic() - flag.received_at
        name = signal.Signals(flag.signum).name if flag.signum else "signal"
        late = "" if waited < grace else f" (past checkpoint.preempt_grace_s={grace:g}: the launcher may kill the save)"
        self._note(f"{name} came {waited:.1f} s before this step boundary; saving, then exiting{late}")

    def trainer_state(self) -> dict[str, Any]:
        """What a resume needs besides the actor: step, data position, carry, and this step's metrics row (restored
        into metrics.jsonl on resume when the file lost it: a torn last line)."""
        row = self.last_row if self.last_row is not None and self.last_row["step"] == self.step else None
        return {
            "step": self.step,
            "data": self.train_data.state_dict(),
            "carry": self._carry_state(),
            "metrics": row,
            "architecture": self.architecture,
        }

    def _carry_state(self) -> list[dict[str, Any]]:
        """The carried groups in full, in queue order (their rollouts gathered from the ranks that own them; plain
        containers and tensors for a weights_only checkpoint); collective. On the actor ranks of a split launch: the
        engine ranks' carry after the last committed step."""
        if self.placement is not None and not self.placement.is_engine:
            return self.carry_state
        mine = [(e.key, [r.to_state() for r in self.carry_rows[e.key]]) for e in self.carry if e.owner == self.rank]
        rows = dict(self.exchange.all_gather(mine, "carried rollouts"))
        out = []
        for e in self.carry:
            state = {"index": e.index, "truth": e.truth, "rollouts": rows[e.key], "scores": None}
            if e.summary is not None:
                x = e.summary
                state["scores"] = {"accs": x.accs, "rewards": x.rewards, "penalties": x.penalties}
            out.append(state)
        return out

    def _load_carry(self, states: list[dict[str, Any]]) -> None:
        """The carry of a checkpoint, owned round-robin by the engine ranks (any rank can continue any group); the
        actor ranks of a split launch keep it as saved, for the engine ranks (`_start_engines`)."""
        self.carry, self.carry_rows = [], {}
        if self.placement is not None and not self.placement.is_engine:
            self.carry_state = states
            return
        for k, state in enumerate(states):
            owner, key = self.engine_ranks[k % len(self.engine_ranks)], f"carry:{k}"
            rollouts = [Rollout.from_state(r) for r in state["rollouts"]]
            summary = None
            if state["scores"] is not None:
                x, index, truth = state["scores"], state["index"], state["truth"]
                group = RolloutGroup(index, k, truth, rollouts, x["accs"], x["rewards"], x["penalties"])
                summary = group.summary(owner, key)
            self.carry.append(CarryEntry(int(state["index"]), str(state["truth"]), owner, key, summary))
            if owner == self.rank:
                self.carry_rows[key] = rollouts

    def save(self, background: bool = False) -> Path:
        """Checkpoint this step (collective). A write that fails on any rank (a full disk) ends the job with one
        line on every rank (JobError); the previous checkpoint stays the one to resume from. background: the actor's
        files are written while training goes on and the checkpoint is completed by `_finish_save` at the next step
        boundary (checkpoint.async_save)."""
        try:
            return self._save(background)
        except CheckpointError as err:
            raise JobError(str(err), retryable=True) from None

    def _finish_save(self) -> None:
        """Complete a background save (collective; nothing when none is pending)."""
        try:
            self.ckpt.finish_pending()
        except CheckpointError as err:
            raise JobError(str(err), retryable=True) from None

    def _save(self, background: bool = False) -> Path:
        if self.logger is not None:
            self.logger.sync()  # the step's metrics row is on disk before its checkpoint says the step is done

        def write() -> Path:
            return self.ckpt.save(
                self.step,
                self.trainer_state(),
                self.cfg.to_dict(),
                lambda d, background=False: self.actor.save_checkpoint(str(d), background=background),
                test_hook=self.test_hook,
                background=background,
            )

        if self.cfg.actor.offload == "none":
            return write()
        # The actor's offloaded state comes back for the save: in the update's slot of the sequence, with the
        # engine released (its weights are then rewritten by a sync), never on top of a resident engine.
        return self.memory.run_step(
            {"update": write, "sync": lambda: self.weight_sync.sync(self.actor.export_hf_weights())}
        )["update"]

    def _load(self, path: Path) -> Path:
        """Resume from `path` (or, when its tensor bytes fail their hashes while loading and it was found by
        checkpoint.resume=auto, from the newest earlier checkpoint that verifies); returns the one loaded."""
        from megatron_dapo.actor.verified_load import CorruptItem

        while True:
            try:
                state = self.ckpt.load(
                    path, self.cfg.to_dict(), lambda d, items: self.actor.load_checkpoint(str(d), items=items)
                )
                break
            except CorruptItem as err:
                if not self._fall_back:  # checkpoint.resume named this one
                    raise CheckpointError(str(err)) from None
                older = self.ckpt.find_resumable(before=step_of(path))
                if older is None:
                    raise CheckpointError(f"{err}; no earlier checkpoint to fall back to") from None
                self._notice(f"checkpoint {path} is corrupt: {err}; trying the previous one")
                self._check_resumable(older)
                path = older
        self.step = int(state["step"])
        self.train_data.load_state_dict(state["data"])
        if state.get("sampler"):
            raise CheckpointError(
                f"{path}: saved before the rollout stream with dynamic-sampling carry-over (algorithm.keep_surplus); "
                "its carried groups cannot be resumed: start from another checkpoint or checkpoint.resume=never"
            )
        self._load_carry(state.get("carry", []))
        if self.placement is None:  # a split launch pushes them to the engine ranks next (`_start_engines`)
            self.weight_sync.sync(self.actor.export_hf_weights())
        if self.rank == 0:
            _truncate_metrics(self.run_dir / "metrics.jsonl", self.step, self._notice, restore=state.get("metrics"))
        self._barrier()
        return path

    def export_final_hf(self, out_dir: str | Path) -> None:
        """Write the actor's weights and the tokenizer as a Hugging Face checkpoint (`MegatronActor.save_hf`: rank 0
        receives and writes, no other rank holds a full-model copy; every rank must call)."""
        self.actor.save_hf(str(out_dir), tokenizer=self.tokenizer)

    def close(self) -> None:
        self._finish_save()  # a background save still pending (collective)
        self.memory.finish()  # engine released, actor parameters on the device for the export
        self.export_final_hf(self.run_dir / "hf_final")
        if self.logger is not None:
            self.logger.close()
            if self.cfg.logging.plots and self.cfg.logging.jsonl:
                plot_run(self.run_dir)
        if self.stream is not None:
            self.stream.close()
        if self.placement is not None and self.rank == 0:
            self.mailbox.post("stop", True)  # the engine ranks exit
            self.beat.close()
        if self.lock is not None:
            self.lock.release()

    # ------------------------------------------------------------------------------------------------ comms
    def test_hook(self, point: str) -> None:
        """The testing hook: a no-op in training, called at named points so that tests can kill or slow a rank
        there (tests/_hooks_driver.py replaces it; docs/reliability.md, "Testing hooks"). Points, with self.step
        the step in progress: "fresh_prompt" (generation starts a fresh prompt), "step_end" (the step's work is done,
        before its boundary: evaluation, logging, preemption check, save), "before_manifest" (a checkpoint's files
        are written, its manifest not yet), "in_save" (the manifest is written, the checkpoint not yet marked
        complete), "after_step" (after the step's boundary and save)."""

    def _note(self, line: str) -> None:
        """A one-line notice on rank 0's stderr, prefixed with the step (e.g. the preemption decision)."""
        self._notice(f"step {self.step}: {line}")

    def _rank_notice(self, line: str) -> None:
        """A one-line notice on this rank's stderr (what only this rank knows, e.g. its engine died)."""
        import sys

        print(f"[megatron_dapo] {line}", file=sys.stderr, flush=True)

    def _notice(self, line: str) -> None:
        """A one-line notice on rank 0's stderr, no step prefix (start-up and resume decisions)."""
        if self.rank == 0:
            import sys

            print(f"[megatron_dapo] {line}", file=sys.stderr, flush=True)

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        self.last_row = metrics_row(step, metrics)
        if self.logger is not None:
            self.logger.log(step, metrics)

    def _host_barrier(self) -> None:
        """A barrier on the gloo group of the rollout exchange (a CPU wait: no NCCL kernel on the engine's GPUs)."""
        if self.world > 1:
            torch.distributed.barrier(group=self.exchange.group)

    def _barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier(group=self.groups.world_group)

    def _all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.groups.world_group)
        return t


def _load_state_file(file: Path) -> Any:
    """A small pickle of a checkpoint through torch's weights-only loader (tensors and plain containers: a crafted
    file runs nothing); CheckpointError naming the file when it cannot be read."""
    try:
        return torch.load(file, weights_only=True)
    except Exception as err:  # UnpicklingError (a forbidden global), RuntimeError (a damaged archive)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{file}: refused to load it ({first[:200]})") from None


def _is_rng_state(state: Any, keys: tuple[str, ...]) -> bool:
    return (
        isinstance(state, dict)
        and all(k in state for k in keys)
        and isinstance(state["torch"], torch.Tensor)
        and state["torch"].dtype == torch.uint8
        and isinstance(state["python"], tuple)
    )


def check_state_files(path: Path, rank: int, world: int) -> dict[str, Any]:
    """The trainer state of checkpoint `path`, after loading it and this rank's RNG file (the actor's) and checking
    their shape: a crafted, damaged or mismatched file (another step's state, another run's)
    is one CheckpointError naming it, at start-up on every rank, not a traceback in the middle of the actor's load."""
    file = path / "trainer_state.pt"
    state = _load_state_file(file)
    if not (isinstance(state, dict) and isinstance(state.get("step"), int) and isinstance(state.get("data"), dict)):
        raise CheckpointError(f"{file}: not a trainer state (expected a dict with step and data)")
    name = path.name
    if name.startswith("step_") and name[5:].isdigit() and int(name[5:]) != state["step"]:
        raise CheckpointError(f"{file}: holds step {state['step']}, but it sits in {name} (copied from another one?)")
    rng, keys = path / "actor" / f"rng_rank{rank:05d}_of{world}.pt", ("torch", "python", "tracker")
    if rng.exists() and not _is_rng_state(_load_state_file(rng), keys):
        raise CheckpointError(f"{rng}: not an RNG state (expected {', '.join(keys)})")
    return state


ARCHITECTURE_KEYS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
)
"""config.json fields that decide the model's tensors: a checkpoint resumes only onto the same values."""


def model_architecture(hf_config: Any) -> dict[str, Any]:
    """The ARCHITECTURE_KEYS of a Hugging Face config that it has (plain values, for a weights_only checkpoint)."""
    return {k: getattr(hf_config, k) for k in ARCHITECTURE_KEYS if getattr(hf_config, k, None) is not None}


def check_architecture(saved: dict[str, Any] | None, current: dict[str, Any], where: str) -> None:
    """CheckpointError naming every architecture field of actor.model_path that differs from the checkpoint's (the
    model directory was replaced at the same path); None (a checkpoint from before this check): nothing to compare."""
    if saved is None:
        return
    changed = [
        f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in ARCHITECTURE_KEYS if saved.get(k) != current.get(k)
    ]
    if changed:
        raise CheckpointError(
            f"{where}: cannot resume, the model at actor.model_path is not the one this checkpoint was trained from "
            f"({'; '.join(changed)}); point actor.model_path at that model, or use a new trainer.run_dir"
        )


def rollout_ranks(rollout: Any, world_size: int) -> list[int]:
    """Global ranks that host a rollout engine (prompts are sharded over them in this order).

    transformers: every rank (CPU rollout is data-parallel); sglang colocated: one engine per rollout.tensor_parallel
    GPUs (ranks per node must be a multiple of it); sglang server / vllm: rank 0 drives the engine.
    """
    if rollout.engine == "transformers":
        return list(range(world_size))
    if rollout.engine == "sglang" and rollout.mode == "colocated":
        return [r for r in range(world_size) if r % rollout.tensor_parallel == 0]
    return [0]


def _drop_unsaved_metrics(path: Path, log: Any = print) -> None:
    """A start from step 0 in a run dir whose metrics.jsonl has rows (an attempt or run that failed before its first
    checkpoint, then restarted or run again): those steps are trained and logged again, so their old rows go (named
    through `log`) instead of appearing twice."""
    if not path.exists() or not path.read_text(errors="replace").strip():
        return
    lines = len([x for x in path.read_text(errors="replace").splitlines() if x.strip()])
    _truncate_metrics(path, -1, log=lambda _: None)
    log(f"{path}: dropped {lines} row(s) of an earlier start that saved no checkpoint; this run starts at step 0")


def _truncate_metrics(path: Path, step: int, log: Any = print, restore: dict[str, Any] | None = None) -> None:
    """Drop metric rows logged after the checkpoint we resume from (a crash between log and save), and lines that are
    not JSON (a torn last line from a kill in mid-write): each such line is named through `log`. `restore`: the
    checkpoint's own row of `step`, written back when the file no longer has that step (logged)."""
    import json

    if not path.exists() and restore is None:
        return
    kept, steps = [], set()
    text = path.read_text(errors="replace") if path.exists() else ""
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            row_step = int(row["step"])
        except (ValueError, TypeError, KeyError):
            log(f"{path} line {number}: not a metrics row (torn by a kill in mid-write?); dropped: {line[:60]!r}")
            continue
        if row_step <= step:
            kept.append(line)
            steps.add(row_step)
    if restore is not None and int(restore["step"]) == step and step not in steps:
        kept.append(json.dumps(restore))
        log(f"{path}: step {step}'s metrics row was missing; restored it from the checkpoint")
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
