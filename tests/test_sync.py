"""Sync mode: the update rule checked by hand, the exact final global step, backup workers, a dead worker."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from psworker import stackdump
from psworker.errors import EXIT_PEER_GONE
from psworker.testing import STEP_LINE, assert_processes_gone, checkpoint_step


# ------------------------------------------------------------------------------------------ no servers

def test_capped_optimizer_stops_updating_at_the_last_step():
    """The cap that makes sync training end at max_steps exactly: updates past it change nothing."""
    import tensorflow as tf

    from psworker.train.graph import CappedOptimizer

    v1 = tf.compat.v1
    with tf.Graph().as_default():
        step = v1.train.get_or_create_global_step()
        var = v1.get_variable("v", initializer=tf.constant([1.0, 2.0]), use_resource=True)
        opt = CappedOptimizer(v1.train.GradientDescentOptimizer(0.5), last_step=3)
        update = opt.apply_gradients([(tf.constant([1.0, -1.0]), var)], global_step=step)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(5):
                sess.run(update)
            assert sess.run(step) == 3
            np.testing.assert_allclose(sess.run(var), [1.0 - 3 * 0.5, 2.0 + 3 * 0.5])


def test_stale_gradients_are_dropped_by_the_accumulators_sync_mode_uses():
    """SyncReplicasOptimizer's per-variable ConditionalAccumulator: a gradient computed for an older step than the
    accumulator's is dropped (never applied late); take_grad averages the fresh ones."""
    import tensorflow as tf

    v1 = tf.compat.v1
    with tf.Graph().as_default():
        acc = v1.ConditionalAccumulator(tf.float32, shape=[2])
        grad, local_step = v1.placeholder(tf.float32, [2]), v1.placeholder(tf.int64, [])
        push = acc.apply_grad(grad, local_step=local_step)
        with v1.Session() as sess:
            sess.run(acc.set_global_step(5))
            sess.run(push, {grad: [100.0, 100.0], local_step: 4})     # stale: for step 4
            assert sess.run(acc.num_accumulated()) == 0
            sess.run(push, {grad: [1.0, 2.0], local_step: 5})
            sess.run(push, {grad: [3.0, 6.0], local_step: 5})
            np.testing.assert_allclose(sess.run(acc.take_grad(2)), [2.0, 4.0])


def test_sync_restart_reset_unblocks_a_step_the_killed_chief_left_half_aggregated():
    """The state a chief killed inside its aggregation step leaves on the ps, built by hand in one process: the
    accumulator of `a` was taken (its counter one step ahead, the gradients gone), `b` holds one gradient, the global
    step did not move and no token was queued; the other worker waits for a token. Without the reset a step can
    never complete (`a` drops every gradient for the current step). The reset empties both, sets them to the global
    step, and queues one token for the other worker; then a normal step completes."""
    import tensorflow as tf

    from psworker.train.sync_reset import SyncRestartReset

    v1 = tf.compat.v1
    with tf.Graph().as_default():
        step = v1.train.get_or_create_global_step()
        a = v1.get_variable("a", initializer=tf.constant([1.0, 2.0]), use_resource=True)
        b = v1.get_variable("b", initializer=tf.constant([3.0]), use_resource=True)
        sync = v1.train.SyncReplicasOptimizer(v1.train.GradientDescentOptimizer(1.0), replicas_to_aggregate=2,
                                              total_num_replicas=2)
        sync.apply_gradients([(tf.constant([1.0, 1.0]), a), (tf.constant([1.0]), b)], global_step=step)
        reset = SyncRestartReset(sync)
        (acc_a, _), (acc_b, _) = sync._accumulator_list
        local = v1.placeholder(tf.int64, [])
        push_a = acc_a.apply_grad(tf.constant([1.0, 1.0]), local_step=local)
        push_b = acc_b.apply_grad(tf.constant([1.0]), local_step=local)
        sync_op = sync.get_chief_queue_runner().enqueue_ops[0]
        queue = sync._sync_token_queue
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(sync.chief_init_op)
            # step 0: worker:1 pushed a and b, the old chief pushed a; the chief's take of a ran, then it died
            sess.run(push_a, {local: 0})
            sess.run(push_b, {local: 0})
            sess.run(push_a, {local: 0})
            sess.run(acc_a.take_grad(2))
            sess.run(sync.chief_init_op)        # what TF's chief init does on a restart: not enough
            sess.run(push_a, {local: 0})
            assert sess.run(acc_a.num_accumulated()) == 1 and sess.run(acc_b.num_accumulated()) == 1
            # the state TF leaves: the aggregation cannot complete, and the other worker waits for a token
            with pytest.raises(tf.errors.DeadlineExceededError):
                sess.run(sync_op, options=v1.RunOptions(timeout_in_ms=1500))
            done = reset.run(sess)
            assert done == {"global_step": 0, "gradients_held": [1, 1], "tokens_dropped": 0, "tokens_queued": 1}
            assert sess.run(acc_a.num_accumulated()) == 0 and sess.run(acc_b.num_accumulated()) == 0
            assert sess.run(queue.dequeue()) == 0   # the waiting worker's token, for step 0
            # a normal step 0 now completes: two gradients in each accumulator, the chief's aggregation applies them
            for _ in range(2):
                sess.run([push_a, push_b], {local: 0})
            sess.run(sync_op, options=v1.RunOptions(timeout_in_ms=10000))
            assert sess.run(step) == 1
            np.testing.assert_allclose(sess.run(a), [0.0, 1.0])
            assert sess.run(queue.size()) == 2


LAST_STEP = 4


def _demand_graph(v1, tf):
    """One variable under SyncReplicasOptimizer (2 of 4 reserved replicas aggregated) with tokens on demand."""
    from psworker.train.sync_tokens import TokensOnDemand

    step = v1.train.get_or_create_global_step()
    a = v1.get_variable("a", initializer=tf.constant([1.0]), use_resource=True)
    sync = v1.train.SyncReplicasOptimizer(v1.train.GradientDescentOptimizer(1.0), replicas_to_aggregate=2,
                                          total_num_replicas=4)
    demand = TokensOnDemand(sync, step, last_step=LAST_STEP)
    sync.apply_gradients([(tf.constant([1.0]), a)], global_step=step)
    demand.after_apply()
    (acc, _), = sync._accumulator_list
    local = v1.placeholder(tf.int64, [])
    return sync, demand, step, acc.apply_grad(tf.constant([1.0]), local_step=local), local


def test_elastic_sync_queues_one_token_per_demand_not_one_per_reserved_replica():
    """An elastic job running 2 of its 4 workers: TF would queue 4 tokens per step, and the 2 spare ones, left at the
    front of the FIFO queue, make the next steps' gradients stale. With tokens on demand each step queues one token
    per worker step registered, read after the update: demands registered while the chief's step waits for
    gradients are served by that step."""
    import threading

    import tensorflow as tf

    v1 = tf.compat.v1
    with tf.Graph().as_default():
        sync, demand, step, push, local = _demand_graph(v1, tf)
        registers = [demand.register(0), demand.register(1)]
        sync_op = sync.get_chief_queue_runner().enqueue_ops[0]
        queue = sync._sync_token_queue
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(sync.chief_init_op)
            for s in range(LAST_STEP):
                chief = threading.Thread(target=sess.run, args=(sync_op,),
                                         kwargs={"options": v1.RunOptions(timeout_in_ms=20000)})
                chief.start()          # it waits for 2 gradients before it reads the demands
                sess.run(registers)
                for _ in range(2):
                    sess.run(push, {local: s})
                chief.join(30)
                assert not chief.is_alive() and sess.run(step) == s + 1
                # the step that reaches the last step adds a spare per reserved replica: a demand registered just
                # after its count would wait for a step that never comes
                queued = 2 + (4 if s + 1 == LAST_STEP else 0)
                assert sess.run(queue.size()) == queued
                assert list(sess.run(queue.dequeue_many(queued))) == [s + 1] * queued   # fresh: for the next step
            assert sess.run(demand.queue.size()) == 0


def test_elastic_sync_restart_reset_queues_the_stale_tokens_and_the_others_unserved_demands():
    """A chief restarted in an elastic job: one stale token was left for a slow worker and worker:1's demand is not
    served yet; the dead chief's own demand (index 0) is dropped. The reset queues 1 + 1 fresh tokens."""
    import tensorflow as tf

    from psworker.train.sync_reset import SyncRestartReset

    v1 = tf.compat.v1
    with tf.Graph().as_default():
        sync, demand, step, _, _ = _demand_graph(v1, tf)
        reset = SyncRestartReset(sync, demand)
        queue = sync._sync_token_queue
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(sync.chief_init_op)
            sess.run(queue.enqueue(tf.constant(0, tf.int64)))
            sess.run([demand.register(0), demand.register(1)])
            sess.run(v1.assign(step, 7))
            done = reset.run(sess)
            assert done["tokens_dropped"] == 1 and done["tokens_queued"] == 2, done
            assert list(sess.run(queue.dequeue_many(2))) == [7, 7] and sess.run(queue.size()) == 0
            assert sess.run(demand.queue.size()) == 0


def test_step_watchdog_reports_a_long_step_then_every_interval():
    from psworker.train.hooks import StepWatchdog

    now = [0.0]
    dog = StepWatchdog("worker:0", "is one down?", after_secs=10, every_secs=5, clock=lambda: now[0])
    assert dog.check() is None
    dog.step_started()
    now[0] = 9.0
    assert dog.check() is None
    now[0] = 10.5
    assert dog.check() == "worker:0: a training step has been running for 10 s; is one down?"
    now[0] = 12.0
    assert dog.check() is None
    now[0] = 15.6
    assert "running for 16 s" in dog.check()
    dog.step_finished()
    now[0] = 100.0
    assert dog.check() is None


def test_sync_peer_watch_fails_only_when_too_few_workers_have_been_up_long_enough():
    """Real ports (a listening socket is up, a closed one is down), a fake clock: 4 workers, 3 gradients a step."""
    import socket

    from psworker.launcher.ports import pick_free_ports
    from psworker.task.peers import SyncPeerWatch
    from psworker.task.shutdown import GoneWatch

    listeners = []
    for _ in range(3):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        listeners.append(sock)
    up = {i + 1: f"127.0.0.1:{s.getsockname()[1]}" for i, s in enumerate(listeners)}
    now = [0.0]
    watch = GoneWatch(up, every_secs=0.0, clock=lambda: now[0])
    peers = SyncPeerWatch("worker:0", up, needed=3, down_secs=4.0, never_seen_secs=30.0, watch=watch)
    try:
        watch.update()
        assert peers.check() is None
        listeners[0].close()                      # worker:1 down: 3 of 4 up, still enough
        now[0] = 1.0
        watch.update()
        now[0] = 100.0
        watch.update()
        assert peers.check() is None
        listeners[1].close()                      # worker:2 down at 100: 2 up, short since then
        watch.update()
        now[0] = 103.0
        watch.update()
        assert peers.check() is None               # short for 3 s only (worker:1 was down long, but was spare)
        now[0] = 104.5
        watch.update()
        message = peers.check()
        assert message.startswith("worker:0: a sync step needs gradients from 3 of 4 workers, and only 2 have been "
                                  "up for 4 s (--step_timeout_secs 4); down: "), message
        assert f"worker:1 at {up[1]} (104 s), worker:2 at {up[2]} (4 s)" in message
    finally:
        for sock in listeners:
            sock.close()
    # a worker never seen up may still be starting: it gets never_seen_secs
    never = {1: f"127.0.0.1:{pick_free_ports(1)[0]}"}
    now[0] = 0.0
    watch = GoneWatch(never, every_secs=0.0, clock=lambda: now[0])
    peers = SyncPeerWatch("worker:0", never, needed=2, down_secs=4.0, never_seen_secs=30.0, watch=watch)
    now[0] = 29.0
    watch.update()
    assert peers.check() is None
    now[0] = 30.5
    watch.update()
    assert "only 1 have been up for 30 s" in peers.check()


# ----------------------------------------------------------------------------------------- real clusters

def _gradients(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """d(mean softmax cross-entropy)/d(w, b) of the linear model, in float64."""
    logits = x.astype(np.float64) @ w + b
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    return x.T @ p / len(y), p.mean(axis=0)


def _two_batches(model_name: str, batch_size: int, shard_index: int, num_shards: int):
    """Two consecutive training batches `(images, labels)` of a shard, from the model's own input function."""
    import tensorflow as tf

    from psworker import models
    from psworker.models.base import InputSpec

    with tf.Graph().as_default():
        batch = models.get(model_name).train_inputs(InputSpec(None, batch_size, shard_index, num_shards))
        with tf.compat.v1.Session() as sess:
            return sess.run(batch), sess.run(batch)


def _read(checkpoint: Path) -> dict[str, np.ndarray]:
    import tensorflow as tf

    reader = tf.train.load_checkpoint(str(checkpoint))
    return {name: reader.get_tensor(name) for name in ("linear/weights", "linear/biases", "global_step")}


@pytest.mark.slow
def test_one_sync_step_applies_the_learning_rate_times_the_mean_gradient(make_cluster):
    """2 workers, each with a batch that is its whole shard (so its gradient does not depend on the shuffle): the one
    sync step must move the linear model's variables by exactly -lr * (g0 + g1) / 2, computed here in numpy."""
    lr, batch = 0.5, 719
    shards = []
    for i in range(2):
        (images, labels), (again, _) = _two_batches("linear", batch, i, 2)
        assert len(labels) == batch
        # the batch is the whole shard: the next one holds the same examples (reordered), so a worker's gradient at
        # given variables does not depend on its shuffle
        assert sorted(map(tuple, images.tolist())) == sorted(map(tuple, again.tolist()))
        shards.append((images, labels))
    cluster = make_cluster(train=dict(model="linear", mode="sync", max_steps=1, batch_size=batch, learning_rate=lr,
                                      save_checkpoint_steps=1, log_every_steps=1, step_timeout_secs=120.0,
                                      data_dealing="static"))   # each worker's batch: its whole static slice
    train_dir = cluster.train_dir
    assert cluster.wait_exits(240) == {"ps:0": 0, "worker:0": 0, "worker:1": 0}, cluster.tails()

    before, after = _read(train_dir / "model.ckpt-0"), _read(train_dir / "model.ckpt-1")
    assert before["global_step"] == 0 and after["global_step"] == 1 == checkpoint_step(train_dir)
    grads = [_gradients(before["linear/weights"], before["linear/biases"], *shard) for shard in shards]
    for k, name in enumerate(("linear/weights", "linear/biases")):
        expected = before[name] - lr * (grads[0][k] + grads[1][k]) / 2
        np.testing.assert_allclose(after[name], expected, rtol=0, atol=2e-6, err_msg=name)
        for g in grads:   # the check can tell the mean from either worker's gradient alone
            assert np.abs(after[name] - (before[name] - lr * g[k])).max() > 1e-3
    for i in range(2):
        assert re.search(r"done at global step 1 after 1 local steps", cluster.log(f"worker:{i}"))
    assert_processes_gone(cluster.pids)


@pytest.mark.slow
def test_backup_worker_killed_the_others_finish_at_max_steps_exactly(make_cluster):
    """3 workers, 2 gradients per step: worker:2 is killed mid-run; the other two go on to max_steps exactly, and the
    ps exits by itself (it counts the dead worker as gone once the others are done)."""
    max_steps = 240
    cluster = make_cluster(num_workers=3, train=dict(mode="sync", replicas_to_aggregate=2, max_steps=max_steps,
                                                     batch_size=16, log_every_steps=20, save_checkpoint_steps=100,
                                                     step_timeout_secs=60.0),
                           args={"ps:0": ["--rejoin_grace_secs", "2"]})   # worker:2 is not started again
    cluster.wait_for_log("worker:2", STEP_LINE, 180)
    cluster.kill("worker:2")
    codes = cluster.wait_exits(180, ["worker:0", "worker:1", "ps:0"])
    assert all(code == 0 for code in codes.values()), (codes, cluster.tails())
    assert checkpoint_step(cluster.train_dir) == max_steps
    for i in (0, 1):
        assert f"done at global step {max_steps} after" in cluster.log(f"worker:{i}")
    assert "ps:0: worker:2 has gone away after training ended; counting it as done" in cluster.log("ps:0")
    assert_processes_gone(cluster.pids)


@pytest.mark.slow
def test_without_a_backup_a_dead_worker_is_a_clear_error_not_a_hang(make_cluster):
    """2 workers, 2 gradients per step, worker:1 killed: the chief stops with a message that names the dead worker
    (exit code: a peer is gone); it still tells the ps that it is done, so the ps exits by itself too.

    Two ways lead there, by chance: worker:1 died holding a token (the chief's step waits for one and times out),
    or it died waiting for one (the chief takes both tokens and would go on alone at half speed; `SyncPeerWatch`
    stops it once worker:1 has been down for --step_timeout_secs). CI saw both.

    The step timeout is far above what a healthy step takes on a loaded machine, so that it can only fire after the
    kill (10 s: a healthy step takes well under 0.2 s here under a load of 8 on 2 cores, and a session's first step
    is allowed --startup_timeout_secs more); it is also what the chief waits after it, so it sets this test's
    length."""
    timeout = 10
    cluster = make_cluster(train=dict(mode="sync", max_steps=100000, batch_size=16, log_every_steps=20,
                                      step_timeout_secs=float(timeout)),
                           args={"ps:0": ["--rejoin_grace_secs", "2"]})   # worker:1 is not started again
    cluster.wait_for_log("worker:1", STEP_LINE, 180)
    address = cluster.spec.worker[1]
    cluster.kill("worker:1")
    codes = cluster.wait_exits(120, ["worker:0", "ps:0"])
    chief = cluster.log("worker:0")
    assert codes["worker:0"] == EXIT_PEER_GONE, chief[-3000:]
    error = re.search(r"psworker: error: worker:0: .*", chief)
    assert error, chief[-3000:]
    assert f"worker:1 at {address} (" in error.group(0), error.group(0)
    if "did not finish within" in error.group(0):   # the step waited for a token
        assert re.search(rf"a sync training step did not finish within {timeout} s \(--step_timeout_secs\): each step "
                         r"needs gradients from all workers; is a worker down\?", error.group(0)), error.group(0)
        # the wait was not silent: the watchdog said what the step waits for, half way to the timeout
        assert re.search(r"worker:0: a training step has been running for \d+ s; a sync step waits for gradients "
                         r"from 2 of 2 workers: is one down or slow\? "
                         rf"\(gives up after --step_timeout_secs {timeout}\)", chief), chief[-3000:]
    else:   # the chief went on alone until the watch stopped it
        assert re.search(r"a sync step needs gradients from 2 of 2 workers, and only 1 have been up for \d+ s "
                         rf"\(--step_timeout_secs {timeout}\); down: worker:1", error.group(0)), error.group(0)
    # before it raised, the chief wrote every thread's stack into its log: its main thread in the step loop
    dump = stackdump.last_dump(chief[chief.rindex("; every thread's stack follows"):])
    assert dump is not None and dump.is_complete, chief[-3000:]
    assert [f.function for f in dump.main_thread.frames[:2]] == ["_step_timeout", "_run_steps"], dump.render()
    assert codes["ps:0"] == 0
    assert_processes_gone(cluster.pids)


@pytest.mark.parametrize("pack", [True, False])
def test_a_push_slot_is_claimed_only_once_the_gradients_are_on_the_ps_tasks(pack):
    """A ps pulls a worker's tensors. A claim made before the gradients had arrived held its slot while the ps
    waited on the worker: with that worker SIGSTOPped, the step (and the other two workers) waited 60 s, until gRPC
    gave up on it (1 run in 20 of test_sync_epochs' stopped worker). So inside the claim's critical section and in
    the pushes after it, every input comes from a ps task: 2 ps, 2 workers, sync, the real worker graph."""
    import tensorflow as tf

    from psworker.models import registry
    from psworker.spec import TrainConfig
    from psworker.train import graph
    from psworker.train.sync_slots import SCOPE as SLOTS

    config = TrainConfig(model="mlp", mode="sync", replicas_to_aggregate=1, batch_size=8,
                         pack_transfers="true" if pack else "false")
    cluster = {"ps": ["127.0.0.1:1", "127.0.0.1:2"], "worker": ["127.0.0.1:3", "127.0.0.1:4"]}
    with tf.Graph().as_default() as g:
        graph.build_train_graph(registry.get("mlp"), config, cluster=cluster, task_index=1)
        locks = [op for op in g.get_operations() if op.type == "MutexLock" and op.name.startswith(SLOTS)][:1]
        assert locks, "no push slots"   # the claim's lock is the first built
        inside = [op for op in g.get_operations() if locks[0] in op.control_inputs]
        pushes = [op for op in g.get_operations() if "AccumulatorApplyGradient" in op.type   # ours, not TF's unused
                  and any(t.op.name.startswith(SLOTS) for t in op.inputs)]
        assert inside and len(pushes) >= 2 and {p.device for p in pushes} == {"/job:ps/task:0", "/job:ps/task:1"}
        for op in inside + pushes + [locks[0]]:
            for t in list(op.inputs) + list(op.control_inputs):
                src = t if isinstance(t, tf.Operation) else t.op
                assert src.device.startswith("/job:ps/"), f"{op.name} ({op.device}) takes {src.name} ({src.device})"
