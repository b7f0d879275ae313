"""ModelSpec: the facts of a Hugging Face checkpoint's config.json that the engine needs, read once and frozen."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from warmstart.errors import UserError

# architecture -> family flags. Gemma3 will add its own row (and norms) without touching these.
FAMILIES = {
    "LlamaForCausalLM": {"qkv_bias": None, "qk_norm": False},     # None: read attention_bias from the config
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": None, "qk_norm": True},
}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    checkpoint_dtype: str           # the dtype config.json declares ("float32", "bfloat16", ...)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer, per token, in elements (multiply by the KV dtype's itemsize)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: Path) -> "ModelSpec":
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise UserError(f"{path} has no config.json, so it is not a Hugging Face model folder. Pass the folder "
                            "that holds config.json and *.safetensors, or a .gguf file to import it first.")
        try:
            cfg = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{cfg_path} is not valid JSON ({e}). The checkpoint is corrupt; download or "
                            "convert it again.") from None
        gen_path = path / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls.from_config(cfg, gen)

    @classmethod
    def from_config(cls, cfg: dict, gen: dict | None = None) -> "ModelSpec":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else "<none>"
        if arch not in FAMILIES:
            raise UserError(f"Architecture {arch} is not supported by warmstart. Supported: "
                            f"{', '.join(FAMILIES)}. Convert the model or pick a supported one.")
        fam = FAMILIES[arch]
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        qkv_bias = fam["qkv_bias"] if fam["qkv_bias"] is not None else bool(cfg.get("attention_bias", False))
        gen = gen or {}
        eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=_rope(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=bool(cfg.get("attention_bias", False)) and arch != "Qwen2ForCausalLM",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=fam["qk_norm"],
            checkpoint_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            eos_token_ids=eos_ids,
            bos_token_id=gen.get("bos_token_id", cfg.get("bos_token_id")),
        )


def _rope(cfg: dict) -> RopeSpec:
    # transformers 5 writes rope_theta inside rope_parameters; older configs keep it at the top level and put
    # scaling in rope_scaling. Reading only the top level would silently fall back to theta=10000.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UserError(f"RoPE scaling type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)}). "
                        "Remove rope_scaling from config.json to run without scaling, or use another model.")
    return RopeSpec(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )
