"""What a person sees of a run: the console copy and its folds, the live progress, `psworker status`, the report and
the last line."""
