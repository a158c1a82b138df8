"""Custom Kedro datasets, one class per module."""
