"""FastSessionCreator against a real in-process `tf.train.Server`: the chief initialises, restores or continues from
a live model; a non-chief waits for it (with its input already running) and gives up on time; and the chief's
checkpoint hook writes the graph files TF's does."""

from __future__ import annotations

import glob
import time

import pytest


def _graph(marker: str):
    """A global step, a variable and an input whose every element writes its index to `marker`."""
    import tensorflow as tf

    v1 = tf.compat.v1
    v1.train.get_or_create_global_step()
    weights = v1.get_variable("weights", initializer=tf.constant([1.0, 2.0, 3.0]))

    def record(i):
        with tf.control_dependencies([tf.io.write_file(marker, tf.strings.as_string(i))]):
            return tf.identity(i)

    batch = v1.data.make_one_shot_iterator(tf.data.Dataset.range(10**6).map(record)).get_next()
    return weights, batch


def _creator(master: str, *, is_chief: bool, batch=None, checkpoint_dir=None, max_wait_secs=30.0, **kwargs):
    import tensorflow as tf

    from psworker.train.session import FastSessionCreator

    return FastSessionCreator(tf.compat.v1.train.Scaffold(), master=master, config=None, is_chief=is_chief,
                              checkpoint_dir=checkpoint_dir, max_wait_secs=max_wait_secs,
                              name="worker:0" if is_chief else "worker:1", warm_up=batch, **kwargs)


def test_a_waiting_worker_starts_its_input_while_it_waits_for_the_chief(tmp_path):
    """The worker's input makes elements while it waits: the chief initialises the model only once one was made."""
    import threading

    import tensorflow as tf

    from tests.fake_tasks.fakes import wait_for

    server = tf.compat.v1.train.Server.create_local_server()
    marker = tmp_path / "element"
    with tf.Graph().as_default() as graph:
        weights, batch = _graph(str(marker))
        worker = _creator(server.target, is_chief=False, batch=batch, max_wait_secs=120)
        chief = _creator(server.target, is_chief=True)
        got: dict = {}

        def wait_as_worker() -> None:
            with graph.as_default():     # the default graph is per thread
                try:
                    got["session"] = worker.create_session()
                except Exception as exc:  # noqa: BLE001 - reported by the asserts below
                    got["error"] = exc

        thread = threading.Thread(target=wait_as_worker, daemon=True)
        thread.start()
        try:
            wait_for(lambda: (marker.exists() and marker.read_text().isdigit()) or not thread.is_alive(), 60,
                     "an input element made while the worker waits")
            assert thread.is_alive(), f"the worker stopped waiting before the chief came: {got}"
            chief.create_session()
        finally:
            thread.join(60)
        assert "session" in got, got
        assert list(got["session"].run(weights)) == [1.0, 2.0, 3.0]


def test_a_waiting_worker_gives_up_after_max_wait():
    import tensorflow as tf

    from psworker.train.session import RECOVERY_WAIT_SECS

    server = tf.compat.v1.train.Server.create_local_server()
    with tf.Graph().as_default():
        _graph("/dev/null")
        creator = _creator(server.target, is_chief=False, max_wait_secs=1.5)
        began = time.monotonic()
        with pytest.raises(tf.errors.DeadlineExceededError, match="the chief's model was not ready after 1.5 s"):
            creator.create_session()
        took = time.monotonic() - began
    # A lower bound only (how soon after max_wait it gives up: benchmarks/response_times.py)
    assert took >= 1.5 - RECOVERY_WAIT_SECS, took


def test_the_chief_initialises_restores_or_continues_and_a_worker_joins_it(tmp_path):
    import numpy as np
    import tensorflow as tf

    v1 = tf.compat.v1
    server = v1.train.Server.create_local_server()
    with tf.Graph().as_default():
        weights, batch = _graph(str(tmp_path / "element"))
        add = v1.assign_add(weights, [10.0, 10.0, 10.0])
        saver = v1.train.Saver()
        seen = []
        chief = _creator(server.target, is_chief=True, batch=batch, checkpoint_dir=str(tmp_path))
        worker = _creator(server.target, is_chief=False, batch=batch, max_wait_secs=5)
        again = _creator(server.target, is_chief=True, checkpoint_dir=str(tmp_path), on_live_model=seen.append)
        fresh = v1.train.Server.create_local_server()   # a restarted ps
        restored = _creator(fresh.target, is_chief=True, checkpoint_dir=str(tmp_path))

        sess = chief.create_session()   # nothing on the server, no checkpoint: initialise
        sess.run(add)
        saver.save(sess, str(tmp_path / "model.ckpt"), global_step=7)
        sess.run(add)

        np.testing.assert_allclose(worker.create_session().run(weights), [21.0, 22.0, 23.0])

        live = again.create_session()   # the server still holds the model: continue from it, not the checkpoint
        np.testing.assert_allclose(live.run(weights), [21.0, 22.0, 23.0])
        assert seen == [live]

        # a restarted ps holds nothing: restore the latest checkpoint
        np.testing.assert_allclose(restored.create_session().run(weights), [11.0, 12.0, 13.0])


def _saver_run(hook_class, train_dir):
    """One step under `hook_class(train_dir)`; returns (node names of the graph, graph.pbtxt as a GraphDef, the
    events file's graphs and meta graphs)."""
    import tensorflow as tf
    from google.protobuf import text_format

    v1 = tf.compat.v1
    with tf.Graph().as_default() as graph:
        step = v1.train.get_or_create_global_step()
        v1.get_variable("weights", initializer=tf.constant([1.0, 2.0]))
        train_op = v1.assign_add(step, 1)
        with v1.train.MonitoredSession(hooks=[hook_class(str(train_dir), save_steps=1000)]) as sess:
            sess.run(train_op)
        nodes = {node.name for node in graph.as_graph_def().node}
    v1.summary.FileWriterCache.clear()
    pbtxt = text_format.Parse((train_dir / "graph.pbtxt").read_text(), v1.GraphDef())
    events = [e for path in glob.glob(str(train_dir / "events.out.tfevents.*")) for e in v1.train.summary_iterator(path)]
    graphs = [v1.GraphDef.FromString(e.graph_def) for e in events if e.graph_def]
    metas = [v1.MetaGraphDef.FromString(e.meta_graph_def) for e in events if e.meta_graph_def]
    return nodes, pbtxt, graphs, metas


def test_the_chief_saver_hook_writes_what_tfs_writes(tmp_path):
    import tensorflow as tf

    from psworker.train.hooks import ChiefCheckpointSaverHook

    nodes, pbtxt, graphs, metas = _saver_run(ChiefCheckpointSaverHook, tmp_path / "ours")
    tf_nodes, tf_pbtxt, tf_graphs, tf_metas = _saver_run(tf.compat.v1.train.CheckpointSaverHook, tmp_path / "tf")

    assert nodes == tf_nodes
    assert {n.name for n in pbtxt.node} == {n.name for n in tf_pbtxt.node} == nodes
    assert [{n.name for n in g.node} for g in graphs] == [{n.name for n in g.node} for g in tf_graphs]
    assert {n.name for n in graphs[-1].node} == nodes
    assert len(metas) == len(tf_metas) >= 1
    assert metas[-1].saver_def == tf_metas[-1].saver_def
    for run in ("ours", "tf"):
        assert tf.train.load_checkpoint(str(tmp_path / run / "model.ckpt-0")).get_tensor("global_step") == 0
        assert (tmp_path / run / "model.ckpt-0.meta").exists()


def test_a_restore_that_fails_names_the_checkpoint_and_the_variable(tmp_path):
    """The checkpoint chosen was whole; its data file is cut before the session restores it (a copy still being
    written, a disk that lost it): one TrainingFailed naming the file and the variable, not TF's traceback."""
    import tensorflow as tf

    from psworker.errors import TrainingFailed
    from psworker.train import checkpoints

    v1 = tf.compat.v1
    server = v1.train.Server.create_local_server()
    with tf.Graph().as_default():
        v1.train.get_or_create_global_step()
        v1.get_variable("weights", initializer=tf.zeros([1000]))
        with v1.Session(server.target) as sess:
            sess.run(v1.global_variables_initializer())
            v1.train.Saver().save(sess, str(tmp_path / "model.ckpt"), global_step=7)
        choice = checkpoints.choose(str(tmp_path), checkpoints.expected_variables())
        assert choice.path == str(tmp_path / "model.ckpt-7") and not choice.rejected
        (data,) = tmp_path.glob("model.ckpt-7.data-*")
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 2)
        fresh = v1.train.Server.create_local_server()   # holds no model: the chief restores
        creator = _creator(fresh.target, is_chief=True, checkpoint_dir=str(tmp_path), first_choice=choice)
        with pytest.raises(TrainingFailed, match=r"^worker:0: restoring the checkpoint \S+/model\.ckpt-7 failed: "
                                                 r"variable weights unreadable \(\.data holds \d+ bytes, its index "
                                                 r"lists 4008\): Read less bytes than requested$"):
            creator.create_session()


def test_a_close_that_does_not_return_is_left_behind_after_its_bound_and_errors_still_reach_the_caller():
    import threading

    from psworker.train.session import _bounded

    release = threading.Event()
    start = time.monotonic()
    assert _bounded(release.wait, 0.3) is False          # still waiting: left running, the caller goes on
    assert 0.3 <= time.monotonic() - start < 5
    release.set()
    assert _bounded(lambda: None, 5) is True

    def fails():
        raise RuntimeError("close failed")

    with pytest.raises(RuntimeError, match="close failed"):
        _bounded(fails, 5)
