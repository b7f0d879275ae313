"""`warmstart import-gguf FILE [OUT]`: convert a GGUF once into a Hugging Face folder (cached by sha256)."""
from __future__ import annotations

import argparse


def cmd_import_gguf(args: argparse.Namespace) -> int:
    from warmstart.weights.gguf import import_gguf
    print(import_gguf(args.file, args.out, cache_dir=args.cache_dir))
    return 0


def register_cli(sub) -> None:
    p = sub.add_parser("import-gguf", help="convert a .gguf file into a Hugging Face folder (done once, cached)",
                       description="Dequantize a GGUF (llama, qwen2, qwen3) into float32 safetensors plus "
                                   "tokenizer.json and chat template. Without OUT the folder goes to "
                                   "<cache-dir>/models/gguf-<sha256>/ and later imports of the same bytes are "
                                   "instant. Prints the folder.")
    p.add_argument("file", help="the .gguf file")
    p.add_argument("out", nargs="?", default=None, help="output folder (default: in the cache)")
    p.add_argument("--cache-dir", default=None, help="cache root (default $WARMSTART_CACHE_DIR or ~/.cache/warmstart)")
    p.set_defaults(func=cmd_import_gguf)
