"""Pure pieces of the batch-scheduler and remote-shell backends: Slurm (`slurm`) and SSH (`ssh`).

They build argv lists, scripts and layouts and check hosts; starting, watching and restarting the processes is
the launcher's job (a ProcessBackend per scheduler).
"""
