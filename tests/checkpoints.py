"""Tiny random checkpoints written by transformers' own model classes and save_pretrained, plus a small
BPE tokenizer built here. Shared by unit, integration and benchmark code."""
from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

FAMILIES = {
    # name: (architecture, config overrides)
    "llama": ("LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-untied-hd": ("LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=24,
                                                  tie_word_embeddings=False)),
    "qwen2": ("Qwen2ForCausalLM", dict(num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3": ("Qwen3ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                                       tie_word_embeddings=True)),
}


def build_tokenizer(out: Path, vocab_size: int = 384) -> None:
    """A byte-level BPE trained on a fixed text, with ChatML special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials), special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
            "warmstart restarts fast and counts every byte. Hello world! 0123456789 ") * 20
    tok.train_from_iterator([text], trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None,
        "tokenizer_class": "PreTrainedTokenizerFast"}))


def write_checkpoint(out: Path, family: str = "llama", *, layers: int = 2, hidden: int = 96, seed: int = 0,
                     dtype: str = "float32", vocab_size: int = 384, max_position: int = 512,
                     extra: dict | None = None, intermediate: int | None = None) -> Path:
    """A random-weight model of the given family saved with save_pretrained; returns the folder."""
    import torch
    import transformers
    arch, overrides = FAMILIES[family]
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, vocab_size)
    cfg_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    cfg = cfg_cls(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate or hidden * 2 + 32,
                  num_hidden_layers=layers, max_position_embeddings=max_position, rms_norm_eps=1e-6,
                  bos_token_id=None, eos_token_id=2, pad_token_id=0, **{**overrides, **(extra or {})})
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).to(getattr(torch, dtype))
    with torch.no_grad():   # larger-than-default weights so that random models make non-degenerate choices
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(out)
    return out


def write_quantized_checkpoint(src: Path, out: Path, mode: str = "int4") -> Path:
    """A copy of checkpoint `src` whose linears are stored as canonical quantized tensors (round to nearest, as
    `--quantization int4|int8` makes them), the form `warmstart import-gguf` writes; returns the folder."""
    import torch
    from safetensors.torch import load_file, save_file
    from warmstart.weights.quantize import canonical
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = canonical(load_file(str(src / "model.safetensors")), torch.float32, mode)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out
