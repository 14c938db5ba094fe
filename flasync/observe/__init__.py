"""What a run measured: its profile, plots and summary."""
