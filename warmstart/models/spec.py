"""ModelSpec: the facts of a Hugging Face checkpoint's config.json that the engine needs, read once and frozen."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from warmstart.errors import UserError, reading

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
        gen_path = path / "generation_config.json"
        with reading(gen_path, "generation config", "Fix or delete generation_config.json (it is optional)."):
            gen = _json_object(gen_path) if gen_path.is_file() else {}
        with reading(cfg_path, "model config", "The checkpoint is corrupt or not a supported Hugging Face "
                                               "config.json; download or convert it again."):
            return cls.from_config(_json_object(cfg_path), gen)

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
        )._validated()

    def _validated(self) -> "ModelSpec":
        """Every number the model is built from has the type and range the engine needs, so a config.json that is
        valid JSON but unusable fails here, naming the field, not as a traceback deep in model construction."""
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "max_position_embeddings")
        for name in sizes:
            v = getattr(self, name)
            if type(v) is not int or not 0 < v < 2**31:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads "
                             f"{self.num_kv_heads}")
        if isinstance(self.rms_norm_eps, bool) or not isinstance(self.rms_norm_eps, (int, float)) or \
                not 0 < self.rms_norm_eps < 1:
            raise ValueError(f"rms_norm_eps must be a small positive number, got {self.rms_norm_eps!r}")
        for t in (*self.eos_token_ids, *(() if self.bos_token_id is None else (self.bos_token_id,))):
            if type(t) is not int or t < 0:
                raise ValueError(f"eos/bos token ids must be non-negative integers, got {t!r}")
        return self


def _json_object(path: Path) -> dict:
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object, got a {type(doc).__name__}")
    return doc


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
