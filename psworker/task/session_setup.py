"""What a worker's training session is made of: its hooks (the one per-step hook, gating the chief's checkpoint
saver; the sync optimizer's; the worker's summaries) and its creator (waiting for the peers or finding training
complete on disk, the chief's first checkpoint, chosen before anything is written, a sync reset on a live ps)."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from psworker import events
from psworker.errors import AlreadyComplete
from psworker.spec import TrainConfig
from psworker.task import server as srv
from psworker.task import shutdown
from psworker.task.replication import Replication
from psworker.train.graph import SYNC_INIT_TOKENS

__all__ = ["DEFAULT_SAVE_CHECKPOINT_SECS", "MAX_CHECKPOINTS", "chief_hooks", "first_choice", "hooks_of",
           "session_creator"]

log = logging.getLogger(__name__)

DEFAULT_SAVE_CHECKPOINT_SECS = 60.0
MAX_CHECKPOINTS = 5


def hooks_of(config: TrainConfig, tg: Any, scaffold: Any, replication: Replication, index: int, name: str,
             emit, kept: tuple = (), extra_steps: Callable[[], int] = lambda: 0) -> tuple[Any, list]:
    """The step loop's hooks: (the one per-step hook, every hook). `extra_steps()`: the steps run beside the loop
    so far (`--concurrent_steps`), counted in its examples/sec."""
    from psworker.train.hooks import TrainLoopHook

    # One hook per step: the chief's savers run inside it, on its check steps only (docs/performance.md).
    progress = TrainLoopHook(tg.loss, tg.global_step, last_step=config.max_steps,
                             every_steps=config.log_every_steps, examples_per_step=replication.examples_per_step,
                             gated=chief_hooks(config, scaffold, name, kept) if replication.is_chief else (),
                             align_steps=(config.log_every_steps, config.save_checkpoint_steps),
                             stride=replication.workers * config.concurrent_steps, emit=emit, name=name,
                             extra_steps=extra_steps, claimed=tg.claimed,
                             epochs=None if tg.dealer is None else (tg.dealer_state.examples_trained,
                                                                    tg.dealer.dealing.plan.num_examples,
                                                                    config.num_epochs))
    hooks = [progress]
    if tg.sync_optimizer is not None:
        hooks.append(tg.sync_optimizer.make_session_run_hook(replication.is_chief, num_tokens=SYNC_INIT_TOKENS))
    if tg.replay is not None:
        hooks.append(tg.replay.hook(tg.train_op))
    if config.train_dir is not None:
        from psworker.train.summaries import WorkerSummaryHook, worker_dir

        hooks.append(WorkerSummaryHook(index, loss=tg.loss, learning_rate=tg.learning_rate,
                                       global_step=tg.global_step, logdir=worker_dir(config.train_dir, index),
                                       every_steps=max(1, config.log_every_steps),
                                       examples_per_step=replication.examples_per_step))
    return progress, hooks


def chief_hooks(config: TrainConfig, scaffold, name: str, kept: tuple = ()) -> list:
    """The chief's checkpoint saver, writing into `config.train_dir` (with the graph, for TensorBoard's Graphs
    dashboard: the train dir's own events file holds no scalars; they are the workers', see `train.summaries`);
    `kept`: the checkpoints there, oldest first, that its rotation goes on from (`checkpoints.Choice.kept`)."""
    from psworker.train.checkpoints import CheckpointKeeper
    from psworker.train.hooks import CheckpointLogger, ChiefCheckpointSaverHook

    every = ({"save_steps": config.save_checkpoint_steps} if config.save_checkpoint_steps
             else {"save_secs": config.save_checkpoint_secs or DEFAULT_SAVE_CHECKPOINT_SECS})
    keeper = CheckpointKeeper(config.train_dir, keep=MAX_CHECKPOINTS, kept=kept)
    return [ChiefCheckpointSaverHook(config.train_dir, scaffold=scaffold, keeper=keeper,
                                     listeners=[CheckpointLogger(name)], **every)]


def session_creator(target: str, config: TrainConfig, tg: Any, scaffold: Any, replication: Replication,
                    name: str, watchdog, first_choice=None) -> Any:
    """The session creator: waits for the peers (or finds training complete on disk), then restores or starts. A
    session re-created inside a step (after a ps failure) gives that step time for the waits that follow."""
    from psworker.train.session import FastSessionCreator

    sessions = 0

    def wait_for_peers() -> None:
        nonlocal sessions
        sessions += 1
        watchdog.extend(2 * config.startup_timeout_secs + config.step_timeout_secs)
        srv.wait_for_tasks(replication.wait_for, timeout_secs=config.startup_timeout_secs, who=name,
                           meanwhile=_CompleteOnDisk(config, name),
                           hint=srv.STARTUP_HINT if sessions == 1 else srv.LOST_HINT)

    on_live_model = (_sync_reset_on_restart(tg.sync_reset, name)
                     if replication.is_chief and tg.sync_reset is not None else None)
    restore = None
    if tg.dealer_state is not None:
        from psworker.train import dealer

        def restore(sess, checkpoint: str) -> None:
            dealer.restore(scaffold.saver, sess, checkpoint, tg.dealer_state, name)

    return FastSessionCreator(
        scaffold, master=target, config=replication.session_config, is_chief=replication.is_chief,
        checkpoint_dir=config.train_dir if replication.is_chief else None,
        max_wait_secs=config.startup_timeout_secs, name=name, before_create=wait_for_peers,
        on_live_model=on_live_model, warm_up=tg.inputs, restore=restore, first_choice=first_choice,
        allow_fresh_start=config.allow_fresh_start,
        on_new_model=tg.sync_reset.run_slots if replication.is_chief and tg.sync_reset is not None else None,
    )


def first_choice(config: TrainConfig):
    """The chief's checkpoint to restore (`train.checkpoints.choose`), chosen before anything is written to the
    train dir: checkpoint files there, none usable, and no `allow_fresh_start` raise `TrainingFailed` (exit 3)."""
    from psworker.train import checkpoints

    if not config.train_dir:
        return None
    choice = checkpoints.choose(config.train_dir, checkpoints.expected_variables())
    if choice.refused and not config.allow_fresh_start:
        raise checkpoints.refusal(config.train_dir, choice)
    return choice


class _CompleteOnDisk:
    """While a worker waits for its ps tasks: raises `AlreadyComplete` once the train_dir's newest checkpoint is at
    `--max_steps` (the ps tasks left after training ended), `task.stop.StoppedBySignal` once a SIGINT or SIGTERM
    came. Reads the train_dir at most every `every_secs`."""

    def __init__(self, config: TrainConfig, name: str, *, every_secs: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self._config, self._name, self._every, self._clock = config, name, every_secs, clock
        self._next = clock()

    def __call__(self) -> None:
        from psworker.task import stop

        stopper = stop.current()
        if stopper.stopping:   # a SIGINT or SIGTERM while the peers are down: no model to save
            raise stopper.stopped("while waiting for its peers (no session: nothing to save)")
        if self._clock() < self._next:
            return
        self._next = self._clock() + self._every
        step = shutdown.checkpoint_at_max_steps(self._config.train_dir, self._config.max_steps)
        if step is not None:
            found = events.FoundComplete(self._name, step, self._config.max_steps, self._config.train_dir)
            raise AlreadyComplete(found.render(), global_step=step)


def _sync_reset_on_restart(sync_reset, name: str):
    """A chief that starts on live ps tasks clears the sync state a dead chief may have left mid-step."""

    def on_live_model(session) -> None:
        done = sync_reset.run(session)
        held = done["gradients_held"]
        log.info("%s: sync state reset on the live ps at global step %d: dropped the gradients the "
                 "accumulators held (%s%s) and %d stale tokens; queued %d tokens for the other workers%s",
                 name, done["global_step"], " ".join(map(str, held)),
                 "; unequal: the previous chief died inside a step" if len(set(held)) > 1 else "",
                 done["tokens_dropped"], done["tokens_queued"],
                 f"; opened {done['slots_queued']} push slots (before: step {done['slots_before'][0]}, "
                 f"{done['slots_before'][1]} left)"
                 if "slots_queued" in done else "")

    return on_live_model
