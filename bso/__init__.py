"""bso: batch size optimizer for recurring training jobs."""
