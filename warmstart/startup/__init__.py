"""Boot machinery: timed steps, device memory facts, the ledger, profiling and startup plans.
Imports neither engine nor server."""
