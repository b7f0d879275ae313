"""Weights: disk loading, the daemon, shared-memory transport and external-memory charges.
Imports models only (never runner, engine or server)."""
