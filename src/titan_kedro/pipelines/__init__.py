"""Kedro pipelines: thin nodes over the library code in config/, data/, models/ and train/."""
