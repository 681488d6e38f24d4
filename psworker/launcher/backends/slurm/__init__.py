"""The slurm backend, all of it: `allocation` (the nodes and task counts Slurm gives, checked against the spec),
`steps` (one `srun` step per task, found in squeue, signalled with scancel), `script` (the sbatch script and its
checked `#SBATCH` values), `job` (`psworker slurm submit`: the run dir, the script, `sbatch`), and `backend`
(`SlurmBackend`, run by `psworker slurm launch` inside the allocation). The task layout is `psworker.spec.plan.layout`.
"""
