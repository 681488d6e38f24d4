"""Training inside a worker, below the task's runner (`psworker.task.runner`): the graphs (`graph`, `ingraph`,
`towers`, `placement`, `transfer`, `sync_tokens`), devices and server configs (`devices`), the learning rate's
scaling (`scaling`), the session (`session`) and its hooks (`hooks`), the final evaluation (`evaluate`), summaries
and export (`summaries`, `export`), and `plan --model`'s report (`plan_report`, `traffic`)."""
