"""Input pipelines and dataset tools (download, synthetic data) for the built-in models."""
