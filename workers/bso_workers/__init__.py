"""Celery shell around the bso decision core."""
