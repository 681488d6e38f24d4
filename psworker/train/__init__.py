"""Training inside a worker: the graph (`graph`, `ingraph`, `towers`, `placement`), the one session runner
(`runner`, with `session` and `hooks`), the final evaluation (`evaluate`), and the dry-run report (`report`)."""
