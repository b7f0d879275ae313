"""`warmstart serve`: an OpenAI-compatible HTTP server over one engine thread (see launch.py for the shape)."""
