"""Checking and converting drafter checkpoints for other engines."""
