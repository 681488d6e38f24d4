"""Start and watch the tasks of a cluster.

`config` (one `LaunchConfig`) -> `launch` (the one skeleton: run dir, placement, plan, supervise, report) ->
`supervisor` (the run loop; `slot`, `policy`, `watch`, `inject`, `stacks`, `progress`, `output`, `console`) over a
backend of `backends/` (local, ssh, slurm: only what differs); `report` and `status` for people.
"""
