"""Training-loop client for the bso service."""
