"""Shared records: distilled sequences and their shards, training blocks and labels, benchmark and
training-prompt loaders. Imports only drelay.config and drelay.io."""
