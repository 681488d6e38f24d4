"""A TF1 between-graph training script written the way TensorFlow's "Distributed TensorFlow" tutorial wrote them:
flags, `server.join()` on the ps, `replica_device_setter`, `MonitoredTrainingSession` with a `StopAtStepHook`, and
no device filters, so a non-chief's session needs every task of the cluster, the chief included. Once the chief has
left, a non-chief still creating its session (TF polls for the chief's model every 30 s) never gets one; the ps
never ends by itself. Nothing here knows about psworker (tests/user_scripts/classic_tf1.py has device filters)."""
import argparse
import time

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1
BATCH = 32


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ps_hosts", required=True, help="comma-separated hostname:port pairs")
    parser.add_argument("--worker_hosts", required=True, help="comma-separated hostname:port pairs")
    parser.add_argument("--job_name", required=True, help="one of 'ps', 'worker'")
    parser.add_argument("--task_index", type=int, default=0, help="index of the task within the job")
    parser.add_argument("--train_dir", default="/tmp/train_logs")
    parser.add_argument("--max_steps", type=int, default=300)
    flags = parser.parse_args()

    tf1.disable_eager_execution()
    cluster = tf1.train.ClusterSpec({"ps": flags.ps_hosts.split(","), "worker": flags.worker_hosts.split(",")})
    server = tf1.train.Server(cluster, job_name=flags.job_name, task_index=flags.task_index)
    if flags.job_name == "ps":
        server.join()
        return

    with tf1.device(tf1.train.replica_device_setter(worker_device=f"/job:worker/task:{flags.task_index}",
                                                     cluster=cluster)):
        x = tf1.placeholder(tf.float32, [None, 1])
        y = tf1.placeholder(tf.float32, [None, 1])
        w = tf1.get_variable("w", [1, 1])
        b = tf1.get_variable("b", [1], initializer=tf1.zeros_initializer())
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))
        global_step = tf1.train.get_or_create_global_step()
        train_op = tf1.train.AdagradOptimizer(0.5).minimize(loss, global_step=global_step)

    rng = np.random.default_rng(flags.task_index)
    hooks = [tf1.train.StopAtStepHook(last_step=flags.max_steps)]
    with tf1.train.MonitoredTrainingSession(master=server.target, is_chief=(flags.task_index == 0),
                                            checkpoint_dir=flags.train_dir, hooks=hooks) as mon_sess:
        local_step, start = 0, time.time()
        while not mon_sess.should_stop():
            xs = rng.normal(size=(BATCH, 1)).astype(np.float32)
            _, value, step = mon_sess.run([train_op, loss, global_step], {x: xs, y: 3 * xs + 1})
            local_step += 1
            if local_step % 20 == 0:
                took = (time.time() - start) / 20
                print(f"step {step}, loss = {value:.2f} ({BATCH / took:.1f} examples/sec; {took:.3f} sec/batch)",
                      flush=True)
                start = time.time()
    print(f"worker {flags.task_index} done", flush=True)


if __name__ == "__main__":
    main()
