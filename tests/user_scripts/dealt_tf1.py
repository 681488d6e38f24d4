"""A classic TF1 between-graph script that reads its data through psworker's dealt shards
(`psworker.task.script_dealing.ScriptDealing`): 300 examples, each step's positions appended to
`<positions_dir>/worker<i>.txt` after the step that trained them; the chief prints the dealer's report."""
import argparse
from pathlib import Path

import numpy as np
import tensorflow as tf

from psworker.task.script_dealing import ScriptDealing
from tests.user_scripts.classic_tf1 import poll_every

tf1 = tf.compat.v1
NUM_EXAMPLES, BATCH = 300, 10


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ps_hosts", required=True)
    parser.add_argument("--worker_hosts", required=True)
    parser.add_argument("--job_name", required=True)
    parser.add_argument("--task_index", type=int, required=True)
    parser.add_argument("--train_dir", required=True)
    parser.add_argument("--positions_dir", required=True)
    parser.add_argument("--num_epochs", type=int, default=2)
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
        dealing = ScriptDealing(NUM_EXAMPLES, BATCH, target=server.target, num_epochs=args.num_epochs,
                                shard_examples=30)
        positions = dealing.iterator(dealing.positions().batch(BATCH))
        x = tf.gather(tf.constant(np.linspace(-1, 1, NUM_EXAMPLES), tf.float32), positions)[:, None]
        w = tf1.get_variable("w", [1, 1])
        b = tf1.get_variable("b", [1], initializer=tf1.zeros_initializer())
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - (3 * x + 1)))
        global_step = tf1.train.get_or_create_global_step()
        train_op = dealing.count(tf1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=global_step),
                                 tf.size(positions))

    log = Path(args.positions_dir) / f"worker{args.task_index}.txt"
    with tf1.train.MonitoredTrainingSession(master=server.target, is_chief=dealing.is_chief,
                                            checkpoint_dir=args.train_dir if dealing.is_chief else None,
                                            config=dealing.session_config) as sess:
        local = 0
        while not sess.should_stop():
            _, read, value, step = sess.run([train_op, positions, loss, global_step])
            with open(log, "a") as f:
                f.write(" ".join(str(p) for p in read) + "\n")
            local += 1
            if local % 5 == 0:
                print(f"step {step}, loss = {value:.4f}", flush=True)
    if dealing.is_chief:
        print(dealing.report(), flush=True)
    print(f"worker {args.task_index} done (deal over: {dealing.exhausted})", flush=True)


if __name__ == "__main__":
    main()
