"""Training inside a worker, below the task's runner (`psworker.task.runner`): the graphs (`graph`, `ingraph`,
`towers`, `placement`, `transfer`, `sync_tokens`, `sync_reset`), devices and server configs (`devices`), the learning
rate's scaling (`scaling`), data shards dealt on demand (`dealer`; its pure plan, `shard_plan`), the chief's
checkpoints (`checkpoints`), the session (`session`) and its hooks (`hooks`), the final evaluation (`evaluate`),
summaries and export (`summaries`, `export`), and `plan --model`'s report (`plan_report`, `traffic`)."""
