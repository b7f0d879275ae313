"""Model definitions. Imports nothing from runner, engine or server."""
