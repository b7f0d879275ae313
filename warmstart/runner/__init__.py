"""The model runner: binds weights, owns the KV tensors, executes batches. Imports models (never engine/server)."""
