"""A toy backend, written to check docs/architecture.md's "adding a backend": this folder and one registry line
(`psworker.launcher.backends.register("toy", "tests.toy_backend.backend:ToyBackend")`, as a test does it)."""
