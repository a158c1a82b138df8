"""MLflow logging used by training workers (rank 0 only) and plots for reporting."""
