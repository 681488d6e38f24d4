"""One task process: its entry and exit codes (`main`), its TensorFlow server (`server`), a worker's training session
(`runner`; what differs between the replications, `replication`; the session's hooks and creator, `session_setup`;
`peers`: the sync chief's watch on the other workers; `probe`: which peer stopped answering), the done tokens
(`done_queue`: sent, and read in a
thread), waiting for them and how a task ends (`shutdown`: the peer-gone watcher), and an elastic
job's worker joining and leaving (`leave`)."""
