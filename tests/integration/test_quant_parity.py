"""End-to-end parity of quantized serving on tiny checkpoints. The reference is the same model with every
quantized linear replaced by a float32 nn.Linear holding the weight the kernel multiplies by (the same quantized
weights, dequantized: the same math), run without a KV cache. Greedy ids must be equal except at near-ties, and
logits agree within LOGIT_TOL: the compiled kernel quantizes activations to int8 per block of 32 (as llama.cpp's
Q8 activations; a step of max|x|/127 per block), torch's kernels round them to bfloat16 (2^-8 relative); on these
random tiny models (logits of magnitude ~1-3) both stay within 0.15 of the float reference."""
import copy

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from tests.checkpoints import write_checkpoint
from warmstart import LLM, SamplingParams
from warmstart.config import EngineConfig
from warmstart.keys import plan_key
from warmstart.models import quant
from warmstart.models.spec import ModelSpec
from warmstart.runner.attention import AttentionMeta, PagedAttentionBackend, SeqSlice
from warmstart.startup.device import get_device

LOGIT_TOL = 0.15
QUANT_MODULES = (quant.Int8Linear, quant.Int4Linear, quant.NativeQuantLinear)
PROMPTS = [[5, 17, 33, 100, 7], list(range(3, 40)), [42]]


def dequantized_twin(model: nn.Module) -> nn.Module:
    twin = copy.deepcopy(model)
    for name, module in list(twin.named_modules()):
        if isinstance(module, QUANT_MODULES):
            lin = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            lin.weight = nn.Parameter(module.dequantized(), requires_grad=False)
            if module.bias is not None:
                lin.bias = nn.Parameter(module.bias.float(), requires_grad=False)
            quant._set_module(twin, name, lin)
        elif isinstance(module, quant.QuantEmbedding):
            emb = nn.Embedding(module.table.out_features, module.table.in_features)
            emb.weight = nn.Parameter(module.table.dequantized(), requires_grad=False)
            quant._set_module(twin, name, emb)
    return twin


@torch.inference_mode()
def full_logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    """Logits at every position, no KV cache (the profiling path of the attention backend)."""
    n = len(ids)
    attn = PagedAttentionBackend(None, 0)
    attn.meta = AttentionMeta(torch.empty(0), [SeqSlice(0, n, n, torch.empty(0))])
    hidden = model(torch.tensor(ids), torch.arange(n), attn)
    return model.compute_logits(hidden).float()


def greedy_reference(model: nn.Module, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    ids, rows = list(prompt), []
    for _ in range(steps):
        row = full_logits(model, ids)[-1]
        rows.append(row)
        ids.append(int(row.argmax()))
    return ids[len(prompt):], rows


def check_parity(llm: LLM, steps: int = 12) -> None:
    model = llm.booted.runner.model
    twin = dequantized_twin(model)
    assert any(isinstance(m, QUANT_MODULES) for m in model.modules())
    for prompt in PROMPTS:
        ours, ref = full_logits(model, prompt), full_logits(twin, prompt)
        assert (ours - ref).abs().max() <= LOGIT_TOL, (ours - ref).abs().max()
    outs = llm.generate_ids(PROMPTS, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ref_ids, rows = greedy_reference(twin, prompt, steps)
        for i, (a, b) in enumerate(zip(out.output_token_ids, ref_ids)):
            if a != b:   # allowed only where the reference's top two are within the tolerance: a near-tie
                top2 = rows[i].topk(2).values
                assert top2[0] - top2[1] <= 2 * LOGIT_TOL, (prompt, i, a, b, top2)
                break


@pytest.mark.parametrize("family", ["llama", "llama-untied-hd", "qwen2"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_checkpoint_matches_its_dequantized_reference(family, quantization, tmp_path):
    d = write_checkpoint(tmp_path / family, family, layers=2)
    llm = LLM(str(d), kv_cache_memory=16 * 2**20, max_model_len=256, dtype="float32", startup_plan="off",
              quantization=quantization)
    check_parity(llm)
    float_llm = LLM(str(d), kv_cache_memory=16 * 2**20, max_model_len=256, dtype="float32", startup_plan="off")
    assert llm.booted.ledger.weights_bytes < float_llm.booted.ledger.weights_bytes


class QuantizingWriter(gguf.GGUFWriter):
    """test_gguf's writer, but every linear goes in as QTYPE and the embedding as Q8_0, quantized by the gguf
    package itself (as llama.cpp's quantize tool would)."""
    QTYPE = gguf.GGMLQuantizationType.Q4_0

    def add_tensor(self, name, a, **kw):
        if a.ndim == 2:
            qt = gguf.GGMLQuantizationType.Q8_0 if name.startswith("token_embd") else self.QTYPE
            return super().add_tensor(name, gguf.quants.quantize(a.astype(np.float32), qt),
                                      raw_dtype=qt)
        return super().add_tensor(name, a, **kw)


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1])
def test_gguf_keeps_its_quantization_end_to_end(qtype, tmp_path, monkeypatch):
    from tests.integration import test_gguf as tg
    tok = tg.tiny_tokenizer()
    src = tmp_path / "tiny.gguf"
    monkeypatch.setattr(QuantizingWriter, "QTYPE", qtype)
    monkeypatch.setattr(gguf, "GGUFWriter", QuantizingWriter)
    tg.write_gguf(src, tg.tiny_model("llama", tok.get_vocab_size()), "llama", tok)
    monkeypatch.undo()
    common = dict(kv_cache_memory=16 * 2**20, max_model_len=256, dtype="float32", startup_plan="off",
                  cache_dir=tmp_path / "cache")
    native = LLM(str(src), **common)
    check_parity(native)
    reader = gguf.GGUFReader(str(src))
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    assert native.booted.ledger.weights_bytes <= 1.25 * file_bytes
    # 2 layers of q/k/v/o/gate/up/down, all int4; the compiled kernel's form fuses q/k/v and gate/up at load.
    fused = quant.native_kernel()
    assert native.booted.report.to_dict()["quantization"]["linears"]["int4"] == 2 * (4 if fused else 7)
    dense = LLM(str(src), quantization="none", **common)
    assert dense.booted.ledger.weights_bytes > 3 * native.booted.ledger.weights_bytes


def test_plan_key_names_quantization(tmp_path):
    d = write_checkpoint(tmp_path / "m", "llama")
    facts = get_device("cpu").facts()
    spec = ModelSpec.from_dir(d)
    a = plan_key(EngineConfig(model=str(d)), d, spec, facts)
    b = plan_key(EngineConfig(model=str(d), quantization="int4"), d, spec, facts)
    assert b.diff(a.components) == ["quantization auto -> int4"]


def test_torch_kernels_where_the_compiled_one_is_missing(tmp_path, monkeypatch):
    """Hosts without the compiled kernel serve the same checkpoint on torch's int4/int8 kernels (bfloat16
    activations, ISA-specific int4 packing, no fusion), within the same tolerance of the same reference."""
    monkeypatch.setattr(quant, "native_kernel", lambda: False)
    d = write_checkpoint(tmp_path / "m", "qwen2", layers=2)
    llm = LLM(str(d), kv_cache_memory=16 * 2**20, max_model_len=256, dtype="float32", startup_plan="off",
              quantization="int4")
    assert any(isinstance(m, quant.Int4Linear) for m in llm.booted.runner.model.modules())
    assert not any(isinstance(m, quant.NativeQuantLinear) for m in llm.booted.runner.model.modules())
    check_parity(llm)


def test_a_gpu_load_serves_a_quantized_checkpoint_dequantized(tmp_path):
    """The integer kernels are CPU code: on any other device (meta stands in for a GPU here; tests/gpu boots it on
    CUDA) auto dequantizes a quantized checkpoint once at load, to the same values quantization none gives, and an
    explicit int8/int4 is refused with the fix in the message."""
    from tests.checkpoints import write_quantized_checkpoint
    from warmstart.errors import UserError
    from warmstart.weights.loader import load_tensors
    d = write_checkpoint(tmp_path / "m", "llama", layers=1)
    q = write_quantized_checkpoint(d, tmp_path / "q", "int4")
    on_cpu = load_tensors(q, torch.float32, "cpu", progress=False)
    assert any(n.endswith(".qweight") for n in on_cpu)              # the CPU keeps the quantized form
    auto = load_tensors(q, torch.float32, "meta", progress=False)
    none = load_tensors(q, torch.float32, "cpu", progress=False, quantization="none")
    assert not any(n.endswith((".qweight", ".scales", ".mins")) for n in auto)
    assert {n: (t.shape, t.dtype) for n, t in auto.items()} == {n: (t.shape, t.dtype) for n, t in none.items()}
    assert all(t.device.type == "meta" for t in auto.values())
    with pytest.raises(UserError, match="CPU kernels only.*--quantization auto or none"):
        load_tensors(d, torch.float32, "meta", progress=False, quantization="int8")
