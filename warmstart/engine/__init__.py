"""The engine: sequences, block manager, scheduler and the step loop. Pure Python — no torch here."""
