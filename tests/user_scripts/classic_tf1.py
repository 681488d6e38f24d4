"""A classic TF1 between-graph training script, as users wrote them: flags, server.join() on the ps,
MonitoredTrainingSession on the workers. Nothing here knows about psworker.

By default each worker's session sees only the ps tasks and itself (device filters). `--no_device_filters` is the
way TensorFlow's "Distributed TensorFlow" tutorial wrote it: without them a non-chief's session needs every task of
the cluster, the chief included, so once the chief has left, a non-chief still creating its session (TF polls for
the chief's model every 30 s) never gets one, and the ps never ends by itself."""
import argparse

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1


def poll_every(secs: float) -> None:
    """A non-chief that asks before the chief has initialised the model sleeps TensorFlow's `recovery_wait_secs`
    (30 s, not a parameter of MonitoredTrainingSession) before it asks again: the tests that are not about that
    wait set it shorter."""
    import inspect

    init = tf1.train.SessionManager.__init__
    names = [p.name for p in inspect.signature(init).parameters.values() if p.default is not inspect.Parameter.empty]
    defaults = list(init.__defaults__)
    defaults[names.index("recovery_wait_secs")] = secs
    init.__defaults__ = tuple(defaults)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ps_hosts", required=True)
    parser.add_argument("--worker_hosts", required=True)
    parser.add_argument("--job_name", required=True)
    parser.add_argument("--task_index", type=int, required=True)
    parser.add_argument("--train_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--no_device_filters", action="store_true", help="the tutorial's sessions (see above)")
    parser.add_argument("--recovery_wait_secs", type=float, default=None,
                        help="how often a non-chief polls for the chief's model (TensorFlow's 30 s by default)")
    args = parser.parse_args()
    if args.recovery_wait_secs is not None:
        poll_every(args.recovery_wait_secs)

    tf1.disable_eager_execution()
    cluster = tf.train.ClusterSpec({"ps": args.ps_hosts.split(","), "worker": args.worker_hosts.split(",")})
    server = tf1.train.Server(cluster, job_name=args.job_name, task_index=args.task_index)
    if args.job_name == "ps":
        server.join()
        return

    with tf1.device(tf1.train.replica_device_setter(
            worker_device=f"/job:worker/task:{args.task_index}", cluster=cluster)):
        x = tf1.placeholder(tf.float32, [None, 1])
        y = tf1.placeholder(tf.float32, [None, 1])
        w = tf1.get_variable("w", [1, 1])
        b = tf1.get_variable("b", [1], initializer=tf1.zeros_initializer())
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))
        global_step = tf1.train.get_or_create_global_step()
        train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=global_step)

    rng = np.random.default_rng(args.task_index)
    filters = [] if args.no_device_filters else ["/job:ps", f"/job:worker/task:{args.task_index}"]
    config = tf1.ConfigProto(device_filters=filters)
    hooks = [tf1.train.StopAtStepHook(last_step=args.max_steps)]
    with tf1.train.MonitoredTrainingSession(master=server.target, is_chief=args.task_index == 0,
                                            checkpoint_dir=args.train_dir if args.task_index == 0 else None,
                                            hooks=hooks, config=config) as sess:
        local = 0
        while not sess.should_stop():
            xs = rng.normal(size=(32, 1)).astype(np.float32)
            _, value, step = sess.run([train_op, loss, global_step], {x: xs, y: 3 * xs + 1})
            local += 1
            if local % 20 == 0:
                print(f"step {step}, loss = {value:.4f}", flush=True)
    print(f"worker {args.task_index} done", flush=True)


if __name__ == "__main__":
    main()
