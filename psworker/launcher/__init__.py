"""Start and watch the tasks of a cluster.

`config` (one `LaunchConfig`) -> `launch` (the one skeleton: run dir, placement, plan, supervise, report) ->
`supervisor` (the run loop: it carries out what the pure `run_policy` decides, through `attempts`, over `slot`s; with
`policy`, `watch`, `inject`, `stacks`, `progress` (in the states of `psworker.states`), `output`, `console`,
`logtail`) over a backend of `backends/` (local, ssh, slurm: only what differs); `report` and `status` for people.
"""
