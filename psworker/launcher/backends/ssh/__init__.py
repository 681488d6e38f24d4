"""The ssh backend, all of it: `remote` (the one quoted remote command and the `ssh` argv, and why `-tt`), `hosts`
(every host at once: the reachability check, one command on each), and `backend` (`SshBackend`)."""
