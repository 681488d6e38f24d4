"""A TF2 ParameterServerStrategy script as its tutorial writes it: the cluster comes from TF_CONFIG; ps and
workers run a server until stopped, the chief coordinates training. Nothing here knows about psworker."""
import os

import tensorflow as tf


def main():
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type in ("worker", "ps"):
        os.environ["GRPC_FAIL_FAST"] = "use_caller"
        server = tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                                      task_index=resolver.task_id, protocol=resolver.rpc_layer or "grpc", start=True)
        server.join()
        return

    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        w = tf.Variable(0.0)
        b = tf.Variable(0.0)
        step = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def train_step():
        x = tf.random.normal([32])
        y = 3.0 * x + 1.0
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(w * x + b - y))
        dw, db = tape.gradient(loss, [w, b])
        w.assign_sub(0.1 * dw)
        b.assign_sub(0.1 * db)
        step.assign_add(1)
        return loss

    for _ in range(5):
        losses = [coordinator.schedule(train_step) for _ in range(20)]
        coordinator.join()
        print(f"step {int(step.numpy())}, loss = {float(losses[-1].fetch()):.4f}", flush=True)
    print(f"chief done: w = {float(w.numpy()):.2f}, b = {float(b.numpy()):.2f}", flush=True)


if __name__ == "__main__":
    main()
