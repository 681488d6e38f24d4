"""What differs between the two replications of a worker's training, as one `Replication` the runner
(`psworker.task.runner`) takes: `between_graph` for every between-graph worker (with dealt shards: `_dealing`),
`in_graph` for the in-graph client."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

from psworker.models.base import Model
from psworker.spec import ClusterSpec, TrainConfig
from psworker.task import server as srv
from psworker.task import shutdown
from psworker.task.leave import Member
from psworker.train import graph
from psworker.train.graph import TrainGraph
from psworker.train.ingraph import CLIENT_INDEX, build_in_graph_train_graph

__all__ = ["Replication", "between_graph", "in_graph"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replication:
    """What one replication tells the runner.

    Attributes:
        build: builds the training graph in the default graph: `(model, config) -> TrainGraph`.
        is_chief: initialises or restores the model, writes checkpoints and summaries, evaluates at the end.
        examples_per_step: examples one run of the train op consumes (for the progress line).
        session_config: the `ConfigProto` of the training session.
        wait_for: `{name: "host:port"}` of the tasks that must answer before each session is created.
        hint: what a slow step may be waiting for (the watchdog's message).
        timeout_message: the `StepTimeout` message when a step exceeds `--step_timeout_secs`.
        release: `release(target)` once training is over, before the final evaluation (in-graph: frees the
            serving workers).
        workers: the between-graph workers (each moves the global step); 1 for the in-graph client.
        peers: the sync between-graph chief: `{index: "host:port"}` of the other workers, watched while
            training (`SyncPeerWatch`); None otherwise.
        needed: sync: the workers each step needs gradients from.
        membership: an elastic job's non-chief worker: tells the ps tasks when it joins and leaves.
        dealing: makes what the graph needs to deal shards to this worker (`train.dealer`); None: static slices.
    """

    build: Callable[[Model, TrainConfig], TrainGraph]
    is_chief: bool
    examples_per_step: int
    session_config: object
    wait_for: dict
    hint: str
    timeout_message: str
    release: Optional[Callable[[str], None]] = None
    workers: int = 1   # the most the global step advances per step of this runner (async: one per worker)
    peers: Optional[dict] = None
    needed: int = 0
    membership: Optional[Member] = None       # an elastic job's non-chief: joins, and leaves on a signal
    # dealt shards: `(target, model, config) -> train.dealer.Dealing` (None: the static slices)
    dealing: Optional[Callable[[str, Model, TrainConfig], Any]] = None


def between_graph(spec: ClusterSpec, index: int, config: TrainConfig, membership: Optional[Member] = None
                  ) -> Replication:
    """What the runner needs to train worker `index` of a between-graph cluster (`membership`: an elastic job's
    non-chief worker's)."""
    name = f"worker:{index}"
    if config.mode == "sync":
        needed = config.replicas_to_aggregate or len(spec.worker)
        hint = (f"a sync step waits for gradients from {needed} of {len(spec.worker)} workers: is one down or slow? "
                f"(gives up after --step_timeout_secs {config.step_timeout_secs:g})")
        timeout = (f"{name}: a sync training step did not finish within {config.step_timeout_secs:g} s "
                   f"(--step_timeout_secs): each step needs gradients from "
                   f"{config.replicas_to_aggregate or 'all'} workers; is a worker down? Start it again (it rejoins), "
                   "or run with fewer --replicas_to_aggregate than workers so that the others can go on without it")
    else:
        hint = "is a ps task overloaded or unreachable?"
        timeout = (f"{name}: a training step did not finish within {config.step_timeout_secs:g} s "
                   "(--step_timeout_secs): is a ps task overloaded or unreachable?")
    cluster = spec.as_dict()
    # Only the chief watches (N-1 probes per interval, not N^2 across the cluster): it makes the tokens, so when it
    # stops the others' next steps time out.
    peers = ({i: str(a) for i, a in enumerate(spec.worker) if i != index}
             if config.mode == "sync" and index == 0 else None)
    return Replication(
        build=lambda model, cfg, dealing=None: graph.build_train_graph(model, cfg, cluster=cluster, task_index=index,
                                                                       elastic=spec.elastic is not None,
                                                                       dealing=dealing),
        is_chief=index == 0, examples_per_step=config.batch_size * config.num_devices,
        session_config=srv.session_config("worker", index), wait_for=srv.task_addresses(spec, ("ps",)),
        hint=hint, timeout_message=timeout, workers=len(spec.worker),
        peers=peers, needed=config.replicas_to_aggregate or len(spec.worker),
        membership=membership,
        dealing=(lambda target, model, cfg: _dealing(spec, index, cfg, model, target))
        if config.data_dealing == "dealt" else None,
    )


def _dealing(spec: ClusterSpec, index: int, config: TrainConfig, model: Model, target: str):
    """What worker `index`'s graph needs to take dealt shards. Sync mode: a dropped batch is computed again, and the
    epochs end at a global step (`_epochs_as_steps`) that the deal of `num_epochs` fills exactly when
    `shard_plan.sync_inexact` finds no reason against; else the deal never runs dry. The chief gives back the lease
    of a worker whose port has been closed for `shutdown.VANISHED_GRACE_SECS` when it waits for the last shards."""
    from psworker.train import dealer, shard_plan

    batch = config.batch_size * config.num_devices
    plan = shard_plan.make_plan(model.num_train_examples(config.data_dir), config.shard_examples, config.num_epochs,
                                batch, config.batch_size)
    if config.mode == "sync" and plan.num_epochs is not None:
        why = shard_plan.sync_inexact(plan, batch, config.replicas_to_aggregate or len(spec.worker),
                                      spec.elastic is not None)
        if why:
            log.warning("worker:%d: sync mode: %s, so the deal goes on past %d epochs (the run ends at the global "
                        "step that covers them; some examples are applied once more)", index, why, plan.num_epochs)
            plan = shard_plan.ShardPlan(plan.num_examples, plan.shard_examples, None)
    gone = None
    if index == 0:
        watch = shutdown.GoneWatch({i: str(a) for i, a in enumerate(spec.worker) if i != index})

        def gone(j: int) -> bool:
            watch.update()
            return watch.gone_for(j) >= shutdown.VANISHED_GRACE_SECS

    log.info("worker:%d: dealt shards of %d examples (%d per epoch of %d)%s", index, plan.shard_examples,
             plan.shards_per_epoch, plan.num_examples,
             f", {plan.num_epochs} epochs" if plan.num_epochs else "")
    return dealer.Dealing(plan=plan, index=index, num_workers=len(spec.worker), target=target,
                          session_config=srv.session_config("worker", index), is_chief=index == 0, seed=config.seed,
                          pad_to=batch if config.num_devices > 1 else 1, gone=gone,
                          ps_addresses=tuple(str(a) for a in spec.ps), redeal=config.mode == "sync",
                          last_step=config.max_steps)


def in_graph(spec: ClusterSpec, config: TrainConfig) -> Replication:
    """What the runner needs to train the whole cluster from the client ."""
    name = f"worker:{CLIENT_INDEX}"
    num_workers = len(spec.worker)
    cluster = spec.as_dict()
    examples_per_step = config.batch_size * config.num_devices * num_workers
    log.info("%s: in-graph client for %d workers x %d towers, %d examples per step", name, num_workers,
             config.num_devices, examples_per_step)

    def release(target: str) -> None:   # the serving workers can go; each tells the ps tasks itself that it is done
        shutdown.release_workers(target, spec, CLIENT_INDEX)

    hint = ("each step needs every worker: is one down or slow? "
            f"(gives up after --step_timeout_secs {config.step_timeout_secs:g})")
    return Replication(
        build=lambda model, cfg, dealing=None: build_in_graph_train_graph(model, cfg, cluster=cluster,
                                                                          dealing=dealing),
        is_chief=True, examples_per_step=examples_per_step,
        # No device filters: this client places ops on every worker task.
        session_config=srv.session_config("worker", CLIENT_INDEX, filter_devices=False),
        wait_for=srv.task_addresses(spec, ("ps", "worker")), hint=hint,
        timeout_message=(f"{name}: an in-graph training step did not finish within {config.step_timeout_secs:g} s "
                         "(--step_timeout_secs): each step needs every worker; is one down?"),
        release=release,
        dealing=(lambda target, model, cfg: _in_graph_dealing(cfg, model, target, spec))
        if config.data_dealing == "dealt" else None,
    )


def _in_graph_dealing(config: TrainConfig, model: Model, target: str, spec: ClusterSpec):
    """What the in-graph client needs to deal shards to itself, the one reader of every worker's batch
    (`train.ingraph`): the deal ends with the epochs; the last global batch is filled up to a whole one."""
    from psworker.train import dealer, shard_plan

    num_workers = len(spec.worker)
    batch = config.batch_size * config.num_devices * num_workers
    plan = shard_plan.make_plan(model.num_train_examples(config.data_dir), config.shard_examples, config.num_epochs,
                                batch, config.batch_size)
    log.info("worker:%d: dealt shards of %d examples (%d per epoch of %d)%s, read by the in-graph client for %d "
             "workers", CLIENT_INDEX, plan.shard_examples, plan.shards_per_epoch, plan.num_examples,
             f", {plan.num_epochs} epochs" if plan.num_epochs else "", num_workers)
    return dealer.Dealing(plan=plan, index=CLIENT_INDEX, num_workers=1, target=target,
                          session_config=srv.session_config("worker", CLIENT_INDEX, filter_devices=False),
                          is_chief=True, seed=config.seed, pad_to=batch if batch > config.batch_size else 1,
                          ps_addresses=tuple(str(a) for a in spec.ps))
