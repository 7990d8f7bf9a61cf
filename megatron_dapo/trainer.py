"""The DAPO loop: the trainer wires the parts and runs each step top to bottom. docs/architecture.md has the picture.

One step (`train_step`), each phase inside the memory choreographer's slot for it (memory.py):
    generation   the rollout stream: one prompt queue for every engine; each finished group verified + overlong-shaped
                 and decided by dynamic sampling in queue order, until prompts_per_step groups are kept
    log-probs    the kept rows routed to the DP ranks that train them; old (and reference) log-probs; batch metrics
    update       the mini-batch updates (the step's generation becomes the run's state at the first one); with
                 actor.offload, a checkpoint's actor files (the state is on the device here: `save`)
    sync         the updated weights into the engines
then, at the step boundary (`fit`): evaluation, the metrics row, the preemption agreement, the checkpoint.

Generation is one interface (generation.py): LocalGeneration on a colocated launch, RemoteGeneration on the actor
ranks of a split one, whose engine ranks run their own program (engine_rank.py). Rollout data flow (docs/rollout.md):
each engine rank keeps the token rows of the groups it generated and every rank gets only each group's GroupSummary;
dynamic sampling, advantages and the row plan (packing.RowPlan, from lengths) run on the summaries, identically on
every rank; then each row goes to the ranks of the DP rank that trains on it and nowhere else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from dataclasses import field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.actor.packing import RowPlan
from megatron_dapo.algorithms.loss_configs import uses_reference
from megatron_dapo.batch import ActorBatch
from megatron_dapo.checkpoint import PreemptionFlag
from megatron_dapo.checkpoint import write_failure_ends_job
from megatron_dapo.config import RunConfig
from megatron_dapo.errors import JobError
from megatron_dapo.errors import rank_notice
from megatron_dapo.evaluate import score_groups
from megatron_dapo.experience import batch_advantages
from megatron_dapo.experience import engine_old_logp
from megatron_dapo.experience import gathered_batch_stats
from megatron_dapo.experience import rollout_correction_parts
from megatron_dapo.experience import row_index
from megatron_dapo.experience import row_lengths
from megatron_dapo.experience import rows_to_batch
from megatron_dapo.experience import sampled_response_metrics
from megatron_dapo.generation import RolloutContext
from megatron_dapo.generation import RowRequest
from megatron_dapo.generation import make_generation
from megatron_dapo.inputs import RunInputs
from megatron_dapo.inputs import agree_at_startup
from megatron_dapo.launch import RunDirLock
from megatron_dapo.memory import MemoryChoreographer
from megatron_dapo.metrics import MetricsLogger
from megatron_dapo.metrics import PhaseTimer
from megatron_dapo.metrics import drop_unsaved_metrics
from megatron_dapo.metrics import metrics_row
from megatron_dapo.metrics import plot_run
from megatron_dapo.metrics import truncate_metrics
from megatron_dapo.resume import Resume
from megatron_dapo.resume import run_checkpoints
from megatron_dapo.resume import trainer_state
from megatron_dapo.rollout.exchange import RolloutExchange
from megatron_dapo.rollout.types import GroupSummary
from megatron_dapo.trajectories import gather_samples
from megatron_dapo.trajectories import write_samples


@dataclass
class StepState:
    """What one step's phases hand each other: its metrics, this DP rank's batch and the row plan (None when no group
    was kept), and whether a preemption signal dropped the step before its first optimizer step."""

    metrics: dict[str, float] = field(default_factory=dict)
    batch: ActorBatch | None = None
    plan: RowPlan | None = None
    interrupted: bool = False


class DAPOTrainer:
    """The actor's program: every rank of a colocated launch, the actor ranks of a split one (placement and store:
    placement.init_role's, None when colocated). Owns the actor, generation, data, checkpoints and logging."""

    def __init__(self, config: RunConfig, placement: Any = None, store: Any = None) -> None:
        from megatron_dapo.actor.actor import MegatronActor
        from megatron_dapo.actor.distributed import init_distributed
        from megatron_dapo.actor.reference import WithReference
        from megatron_dapo.actor.reference import reference_model

        self.cfg = c = config
        self.remote = None
        if placement is not None:  # a split launch: messages to the engine ranks, every rank's heartbeat
            from megatron_dapo.placement import Mailbox
            from megatron_dapo.placement import launch_watch

            self.remote = Mailbox(store), launch_watch(placement, store, c.distributed.timeout_s)
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
        self.lock = RunDirLock(self.run_dir, self.notice) if self.rank == 0 else None
        self.inputs: RunInputs = self._startup(self._load_inputs)
        self.ckpt = run_checkpoints(
            c, self.rank, self.world, barrier=self.barrier, log=self.notice,
            gather=lambda obj: self.exchange.all_gather([obj], "checkpoint"),
        )  # fmt: skip
        self.resume = Resume(self.ckpt, c, self.rank, self.world, self.notice)
        resume_from = self._startup(lambda: self.resume.find(self.inputs))
        self.actor = MegatronActor(c, self.groups, hf_dir=None if resume_from else c.actor.model_path)
        replay = self.actor.routing if c.actor.routing_replay == "r3" else None
        layers = (replay.first_layer, replay.num_layers) if replay is not None else None
        self.routing_layers_of_rank: list[tuple[int, int] | None] = self.exchange.all_gather([layers], "MoE layers")
        """R3: the (first MoE layer, count) whose engine routing each global rank replays (its pipeline stage's);
        None: it needs none. The rollout rows carry only that slice to each rank."""
        # A loss with a KL term (GRPO, loss.kl_coef > 0) needs the frozen reference (actor/reference.py).
        self.reference = reference_model(c, self.groups) if uses_reference(c.loss) else None
        # The one owner of device memory moves per step (megatron_dapo/memory.py, docs/rollout.md). A colocated
        # SGLang / vLLM engine starts with the actor offloaded, so its KV pool is sized from the GPU without it.
        models = self.actor if self.reference is None else WithReference(self.actor, self.reference)
        self.memory = MemoryChoreographer(None, models, offload=c.actor.offload, barrier=self.exchange.barrier)
        self.generation = self._generation(placement, store)
        self.step = 0
        self.run_updates: int | None = 0
        """Optimizer updates applied by the run since step 1, every attempt (checkpointed; None: resumed from a
        checkpoint that predates the count, so unknown). The no-update rule of `fit` reads it."""
        self.last_row: dict[str, Any] | None = None
        """The metrics row of the last logged step (checkpointed with it: a torn metrics.jsonl loses no row)."""
        if resume_from is not None:
            resume_from = self._load(resume_from)
            self.notice(f"resumed from {resume_from} (step {self.step} of {c.trainer.total_steps})")
        elif self.rank == 0:  # rows of an earlier start that saved no checkpoint: this start logs them again
            drop_unsaved_metrics(self.run_dir / "metrics.jsonl", self.notice)
        self.generation.start(self.step, self.inputs.train_data.state_dict(), resumed=resume_from is not None)
        self.logger = MetricsLogger.for_run(c, self.run_dir) if self.rank == 0 else None

    def _generation(self, placement: Any, store: Any) -> Any:
        """The step's generation (generation.make_generation: local, or remote on a split launch) over this rank's
        rollout context (RolloutContext.for_run: data, sampler, scorer, preemption flag)."""
        ctx = RolloutContext.for_run(
            self.cfg, self.rank, self.world, self.exchange, self.inputs, stop=lambda: self.preempt.flag,
            hook=self.test_hook, log=rank_notice,
        )  # fmt: skip
        return make_generation(
            ctx, export=lambda: self.actor.export_hf_weights(),  # resolved per call (tests wrap the actor's)
            shards=lambda: self.actor.owned_shards(),
            memory=self.memory, placement=placement, store=store, remote=self.remote, eval_exchange=self.eval_exchange,
            local_rank=self.groups.local_rank, wait_saved=self.ckpt.wait_written,
        )  # fmt: skip

    def _load_inputs(self) -> RunInputs:
        """Run-dir lock (rank 0), tokenizer and data: the user-input part of start-up."""
        if self.lock is not None:
            self.lock.acquire()
        return RunInputs(self.cfg, self.notice, self.test_hook)

    def _startup(self, fn: Any) -> Any:
        """A start-up step on every rank; a user error on any rank is the same StartupError on every rank."""
        return agree_at_startup(self.exchange, fn, self.lock.release if self.lock is not None else lambda: None)

    # ------------------------------------------------------------------------------------------------- the loop
    def fit(self) -> dict[str, float]:
        """Train to trainer.total_steps (or a preemption). Raises JobError when the run, over every attempt since
        step 1, has applied no optimizer update (every update skipped, or no group kept): such a run must not exit 0
        as if it trained. A resumed attempt whose own steps apply none is fine when the run trained before (those
        steps were counted in the checkpoint); skipped steps in a row are bounded by trainer.max_skipped_steps."""
        last: dict[str, float] = {}
        session_steps = 0
        if self.step == 0 and self.cfg.trainer.eval_every:
            self._log(0, self.evaluate())
        while self.step < self.cfg.trainer.total_steps:
            self.step += 1
            metrics = self.train_step()
            self._finish_save()  # the previous step's background save, written while this step ran
            self.test_hook("step_end")
            if metrics is None:  # a preemption signal before the step's first optimizer step: it never happened
                self._drop_step()
                break
            last = metrics
            applied = int(metrics.get("actor/num_updates", 0.0) - metrics.get("actor/skipped_steps", 0.0))
            session_steps += 1
            self.run_updates = None if self.run_updates is None else self.run_updates + applied
            if self.cfg.trainer.eval_every and self.step % self.cfg.trainer.eval_every == 0:
                last.update(self.evaluate())
            self._log(self.step, last)
            preempted = self.preempt.requested(self.groups.max_over_job)
            if preempted:
                self.notice(f"step {self.step}: {self.preempt.notice(self.cfg.checkpoint.preempt_grace_s)}")
            last_step = self.step == self.cfg.trainer.total_steps
            if preempted or self.cfg.checkpoint.periodic(self.step) or last_step:
                self.save(background=self.cfg.checkpoint.async_save and not (preempted or last_step),
                          final=preempted or last_step)  # fmt: skip
            self.test_hook("after_step")
            if preempted:
                break
        self.close()
        if session_steps and self.run_updates == 0:
            raise JobError(
                f"no optimizer update was applied in this run's {self.step} steps (each skipped for a non-finite "
                "loss or gradient, or no prompt group kept): nothing was trained; see actor/skipped_steps and "
                "sampling/prompts_kept in metrics.jsonl"
            )
        return last

    def _drop_step(self) -> None:
        """A preemption signal came before the step's first update: the step never happened; the last one is saved
        (one decision on every rank) and the run ends."""
        self.step -= 1
        self.notice(
            f"step {self.step}: a preemption signal came before step {self.step + 1}'s update; the step is dropped, "
            "the last one saved, exiting"
        )
        unsaved = self.step > 0 and not self.ckpt.holds(self.step)
        if self.groups.max_over_job(torch.tensor([int(unsaved)])).item():
            self.save()

    def train_step(self) -> dict[str, float] | None:
        """One step (collective): its metrics, or None when a preemption signal came before the step's first
        optimizer step (in generation, which stops at once, or by the end of the log-probs pass): nothing trained, and
        the data position and the carry are those before the step. A signal during the update lets the step finish
        (docs/reliability.md, "Preemption: giving the save time")."""
        timer, start, state = PhaseTimer(), time.perf_counter(), StepState()
        with self.memory.phase("generation"):
            with timer("generate"):
                result = self.generation.generate(self.step)
            state.interrupted = result.interrupted
            if not state.interrupted:
                state.metrics.update(result.metrics)
                state.metrics.update(sampled_response_metrics(result.decided))
                if samples := self.cfg.logging.trajectory_samples:  # collective
                    if result.samples is not None:  # chosen where the groups are (a split launch's engine rank 0)
                        if self.rank == 0:
                            write_samples(self.run_dir, self.step, result.samples)
                    else:
                        gather_samples(self.exchange, self.rank, self.run_dir, self.step, result.groups.values(),
                                       self.inputs.tokenizer, samples)  # fmt: skip
                if result.kept:
                    with timer("rows"):
                        routed = self.route(result.kept)
                    if routed is not None:  # None: a preemption signal came while the rows were on their way
                        state.batch, state.plan = routed
        with self.memory.phase("log-probs"):
            if not self._abandoned(state) and state.batch is not None:
                self._log_probs(state, timer)
            self.test_hook("logprobs_end")
            self._abandoned(state)
        with self.memory.phase("update"):
            if not state.interrupted:
                self.generation.commit()
                if state.batch is not None:
                    self._update(state, timer)
                c = self.cfg
                if c.actor.offload != "none" and c.checkpoint.periodic(self.step) and self.step < c.trainer.total_steps:
                    self._begin_save(c.checkpoint.async_save)  # a save before the end, where the state is (`save`)
        with self.memory.phase("sync"):
            if not state.interrupted:
                with timer("weight_sync"):
                    state.metrics.update(self.generation.push_weights(self.step))
        self.memory.end_step()
        if state.interrupted:
            self.generation.drop()
            return None
        timer.seconds["step"] = time.perf_counter() - start
        generated = state.metrics.get("stream/tokens_generated", 0.0)
        state.metrics["perf/tokens_per_s"] = generated / max(timer.seconds["step"], 1e-9)
        state.metrics["perf/gen_tokens_per_s"] = generated / max(timer.seconds["generate"], 1e-9)
        return {**state.metrics, **timer.metrics()}

    def _abandoned(self, state: StepState) -> bool:
        """Whether a preemption signal reached any rank (collective: every rank asks at the same points)."""
        if not state.interrupted and self.preempt.requested(self.groups.max_over_job):
            state.interrupted = True
        return state.interrupted

    def _log_probs(self, state: StepState, timer: PhaseTimer) -> None:
        """Old log-probs (the actor's, or the engine's with algorithm.old_logp_source engine), the reference's when
        the loss has a KL term, the rollout correction's per-row weights and the batch metrics."""
        batch, plan, metrics = state.batch, state.plan, state.metrics
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
        first = self.rank == min(self.groups.mp_ranks)  # one rank of each model-parallel group contributes
        gather = partial(self.exchange.all_gather, what="batch metrics")
        metrics.update(gathered_batch_stats(gather, batch, entropy, correction, contributes=first,
                                            mismatch=not from_engine))  # fmt: skip

    def _update(self, state: StepState, timer: PhaseTimer) -> None:
        batch, plan, metrics = state.batch, state.plan, state.metrics
        with timer("update"):
            metrics.update(self.actor.update(batch, plan=plan))
        metrics["train/responses"] = float(plan.num_rows)
        tokens = self.actor.pop_token_stats()
        metrics["train/pad_fraction"] = tokens["pad_fraction"]
        metrics["train/computed_tokens"] = tokens["computed_tokens"]
        metrics["train/shared_fraction"] = tokens["shared_fraction"]
        actor_s = timer.seconds["logprobs"] + timer.seconds["update"]
        metrics["perf/actor_tokens_per_s"] = tokens["real_tokens"] / max(actor_s, 1e-9)

    # ------------------------------------------------------------------------------------------------ rollout rows
    def route(self, kept: list[GroupSummary]) -> tuple[ActorBatch, RowPlan] | None:
        """This DP rank's rows of the training batch made of `kept` (group summaries, same on every rank).

        Every rank builds the same RowPlan from the summaries' lengths; generation hands each rank the rows of its DP
        rank (generation.rows). Returns (local batch: plan.rows_of(dp_rank) in that order, plan), or None when the
        rows were given up for a preemption signal (the step's next preemption check drops it on every rank).
        """
        c = self.cfg
        index = row_index(kept)
        plan = RowPlan.build(row_lengths(kept), self.groups.dp_size, c.mini_batch_rows)
        mine = plan.rows_of(self.groups.dp_rank)
        wanted = [plan.rows_of(d) for d in range(self.groups.dp_size)]
        received = self.generation.rows(RowRequest(kept, index, wanted, self.dp_of_rank, self.routing_layers_of_rank))
        if received is None:
            return None
        missing = [r for r in mine if r not in received]
        if missing:
            raise RuntimeError(f"rollout routing: rank {self.rank} did not receive rows {missing[:5]} of its plan")
        advantages, keep = batch_advantages(kept, c.algorithm, c.loss.std_normalize)
        rows = torch.tensor(mine, dtype=torch.int64)
        batch = rows_to_batch(
            [(received[r], index[r][0]) for r in mine], advantages[rows], keep[rows], self.inputs.pad_id
        )
        self.routed_rows = mine
        """Global row ids this rank received in the last step (tests read it)."""
        return batch, plan

    def evaluate(self) -> dict[str, float]:
        t = self.cfg.trainer
        examples = self.inputs.eval_examples[: t.eval_max_prompts or None]
        if not examples:
            return {}
        start = time.perf_counter()
        scores = self.generation.eval_scores(self.step, examples)
        if scores is None:  # a split launch's actor, signalled while the engine ranks scored: the save comes first
            self.notice(f"step {self.step}: a preemption signal came while the engine ranks scored the evaluation; "
                        "it is given up (no eval/* metrics for this step)")  # fmt: skip
            return {}
        metrics = score_groups(scores, t.eval_samples)
        metrics["time/eval"] = time.perf_counter() - start
        return metrics

    # ------------------------------------------------------------------------------------------------ state
    def trainer_state(self) -> dict[str, Any]:
        """What a resume needs besides the actor (resume.trainer_state; collective: the carry is gathered)."""
        row = self.last_row if self.last_row is not None and self.last_row["step"] == self.step else None
        data, carry = self.inputs.train_data.state_dict(), self.generation.carry_state()
        return trainer_state(self.step, data, carry, row, self.inputs.architecture, self.run_updates)

    def save(self, background: bool = False, *, final: bool = True) -> Path:
        """Checkpoint this step (collective): the actor's files, unless the step's update phase wrote them
        (`_begin_save`), then the trainer state. final: the run ends after it (the last step, a preemption). With
        actor.offload the actor's files of a save before the end are written in the update phase, where its state is
        on the device; a final save comes after the engine is released for good (memory.finish): no save moves the
        engine's memory or rewrites its weights. A write that fails on any rank (a full disk) ends the job with one
        line on every rank (JobError); the previous checkpoint stays the one to resume from. background: the actor's
        files are written while training goes on; `_finish_save` completes the checkpoint at the next boundary."""
        if self.ckpt.has_begun(self.step):
            self._check_lock()  # again: the files were written in the update phase
        else:
            if self.cfg.actor.offload != "none":
                if not final:
                    raise RuntimeError("DAPOTrainer.save: with actor.offload, a save before the run's end is begun in "
                                       "the step's update phase")  # fmt: skip
                self.memory.finish()
            self._begin_save(background)
        if self.logger is not None:
            self.logger.sync()  # the step's metrics row is on disk before its checkpoint says the step is done
        with write_failure_ends_job():
            return self.ckpt.complete(self.step, self.trainer_state(), self.cfg.to_dict())

    def _begin_save(self, background: bool) -> None:
        """The run dir still this job's, then this step's checkpoint directory and the actor's files (collective)."""
        self._check_lock()
        with write_failure_ends_job():
            self.ckpt.begin(
                self.step, lambda d, background=False: self.actor.save_checkpoint(str(d), background=background),
                test_hook=self.test_hook, background=background,
            )  # fmt: skip

    def _check_lock(self) -> None:
        problem = self.lock.check() if self.lock is not None else None  # the run dir is still this job's
        if self.groups.max_over_job(torch.tensor([int(problem is not None)])).item():
            raise JobError(problem or "the run-dir lock is no longer this job's (rank 0 says why)")

    def _finish_save(self) -> None:
        """Complete a background save (collective; nothing when none is pending): the run dir still this job's (the
        lock was checked when the save began; the write ran for a step since), then its manifest and COMPLETE."""
        if self.ckpt.pending is not None:  # the same on every rank: every rank began the save
            self._check_lock()
        with write_failure_ends_job():
            self.ckpt.finish_pending()

    def _load(self, path: Path) -> Path:
        """Resume from `path` (or an earlier checkpoint when its bytes fail their hashes: Resume.load); returns the
        one loaded."""
        path, state = self.resume.load(
            path, lambda d, items: self.actor.load_checkpoint(str(d), items=items), self.inputs
        )
        self.step = int(state["step"])
        self.run_updates = state.get("run_updates")
        self.inputs.train_data.load_state_dict(state["data"])
        self.generation.load_carry(state.get("carry", []))
        if self.rank == 0:
            truncate_metrics(self.run_dir / "metrics.jsonl", self.step, self.notice, restore=state.get("metrics"))
        self.barrier()
        return path

    def close(self) -> None:
        self._finish_save()  # a background save still pending (collective)
        self.memory.finish()  # engine released, actor parameters on the device for the export
        # The final weights and tokenizer as a Hugging Face checkpoint (MegatronActor.save_hf: rank 0 receives and
        # writes, no other rank holds a full-model copy).
        self.actor.save_hf(str(self.run_dir / "hf_final"), tokenizer=self.inputs.tokenizer)
        if self.logger is not None:
            self.logger.close()
            if self.cfg.logging.plots and self.cfg.logging.jsonl:
                plot_run(self.run_dir)
        self.generation.close()
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

    def notice(self, line: str) -> None:
        """A one-line notice on rank 0's stderr (start-up, resume and preemption decisions)."""
        if self.rank == 0:
            rank_notice(line)

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        self.last_row = metrics_row(step, metrics)
        if self.logger is not None:
            self.logger.log(step, metrics)

    def barrier(self) -> None:
        """A barrier over every rank of the job (checkpoints, the testing hook)."""
        self.groups.world_barrier()
