"""One task process: its entry and exit codes (`main`), its TensorFlow server (`server`), and how it ends
(`shutdown`: done tokens, the peer-gone watcher, `poll_until`)."""
