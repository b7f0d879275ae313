// The decoder's layer loop for a step whose every row reads the paged cache (decode, short chunks), in one call.
// At batch 1 a layer's work is ~0.3 ms and the Python around it (module calls, argument checks, views: ~15 calls per
// layer) cost half as much again. This runs exactly the calls the Python decoder makes, in the same order, through
// the same kernels (fused.h, qlinear.h, paged_attention.h; float linears through dense_linear.h as DenseLinear does),
// so its results are bit-identical to the Python path, which stays for every other case (prefill over fresh
// prompts, mixed routes, the memory profile, torch.compile, CUDA, float16). warmstart/models/native.py decides
// when a model is eligible and builds the Stack from its modules.
#include <memory>
#include <mutex>
#include <optional>
#include <pybind11/stl.h>
#include <tuple>
#include <vector>

#include "dense_linear.h"
#include "fused.h"
#include "paged_attention.h"
#include "qlinear.h"

// Internal linkage (pybind11 binds hidden-visibility types without warnings).
namespace {

// One linear: a float weight (DenseLinear), or a quantized one (NativeQuantLinear: int4 with mins, or int8).
struct Linear {
  at::Tensor weight;                     // defined for a float linear
  at::Tensor qweight, scales;            // quantized
  std::optional<at::Tensor> mins, bias;  // mins: int4 only
  int64_t dense_min_rows = 0, panel_min_rows = 0;

  at::Tensor operator()(const at::Tensor& x) const {
    if (weight.defined()) return ws::dense::linear(x, weight, bias);
    at::Tensor y = ws::qlinear::qlinear(x, qweight, scales, mins, dense_min_rows, panel_min_rows);
    return bias ? y.add_(*bias) : y;
  }
};

struct Layer {
  at::Tensor ln1, ln2;          // RMSNorm weights
  double eps;
  std::vector<Linear> qkv;      // fused qkv_proj, or q_proj, k_proj, v_proj
  Linear o;
  std::vector<Linear> gate_up;  // fused gate_up_proj, or gate_proj, up_proj
  Linear down;
};

class Stack {
 public:
  Stack(std::vector<Layer> layers, int64_t heads, int64_t kv_heads, int64_t head_dim)
      : layers_(std::move(layers)), H_(heads), Hkv_(kv_heads), D_(head_dim) {}

  // x [T, hidden] (the embeddings), cos/sin [T, D]; kv [2, layers, blocks, block_size, Hkv, D] (D + 4 for an int8
  // cache); slots int64 [T]; block_tables/seq_idx/ctx_lens as for paged_attention. Returns (x, residual) after the
  // last layer: the hidden state is their sum, as the Python decoder carries it.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                             const at::Tensor& kv, const at::Tensor& slots,
                                             const at::Tensor& block_tables, const at::Tensor& seq_idx,
                                             const at::Tensor& ctx_lens, double scale) const {
    TORCH_CHECK(kv.dim() == 6 && kv.size(1) == int64_t(layers_.size()), "kv must be [2, layers, blocks, bs, Hkv, D]");
    TORCH_CHECK(layers_.empty() || x.scalar_type() == layers_[0].ln1.scalar_type(), "x must be in the model's dtype");
    const int64_t T = x.size(0);
    const std::shared_ptr<const std::vector<CacheViews>> views = cache_views(kv);
    std::optional<at::Tensor> residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& L = layers_[i];
      // attention block
      at::Tensor h = ws::fused::add_rms_norm(x, residual, L.ln1, L.eps);
      if (!residual) residual = x;
      at::Tensor q, k, v;
      if (L.qkv.size() == 1) {
        at::Tensor qkv = L.qkv[0](h);
        q = qkv.narrow(1, 0, H_ * D_).view({T, H_, D_});
        k = qkv.narrow(1, H_ * D_, Hkv_ * D_).view({T, Hkv_, D_});
        v = qkv.narrow(1, (H_ + Hkv_) * D_, Hkv_ * D_).view({T, Hkv_, D_});
      } else {
        q = L.qkv[0](h).view({T, H_, D_});
        k = L.qkv[1](h).view({T, Hkv_, D_});
        v = L.qkv[2](h).view({T, Hkv_, D_});
      }
      ws::fused::rotary_(q, cos, sin);
      ws::fused::rotary_(k, cos, sin);
      const CacheViews& c = (*views)[i];
      ws::fused::write_kv(k, v, c.k, c.v, slots);
      at::Tensor a = ws::paged::paged_attention(q, c.k, c.v, block_tables, seq_idx, ctx_lens, scale);
      if (a.scalar_type() != x.scalar_type()) a = a.to(x.scalar_type());  // float32 out, as kernels.paged_attention
      // MLP block
      h = ws::fused::add_rms_norm(L.o(a.reshape({T, H_ * D_})), residual, L.ln2, L.eps);
      x = L.down(L.gate_up.size() == 1 ? ws::fused::silu_mul(L.gate_up[0](h))
                                        : at::silu(L.gate_up[0](h)) * L.gate_up[1](h));
    }
    return {x, *residual};
  }

 private:
  // Layer i's K and V blocks [blocks, bs, Hkv, row] (row: D, or D + 4 for an int8 cache: codes + scale; strided
  // views of the head-major cache, see kernels.kv_blocks). Made once per KV tensor, as the Python path's backend
  // caches its own (runner/attention.py _layer_views), instead of four tensor views per layer per step.
  struct CacheViews {
    at::Tensor k, v;
  };

  std::shared_ptr<const std::vector<CacheViews>> cache_views(const at::Tensor& kv) const {
    std::lock_guard<std::mutex> lock(views_mu_);
    if (!views_of_.is_same(kv)) {  // (undefined before the first call)
      auto made = std::make_shared<std::vector<CacheViews>>();
      for (int64_t i = 0; i < int64_t(layers_.size()); ++i)
        made->push_back({kv.select(0, 0).select(0, i), kv.select(0, 1).select(0, i)});
      views_ = std::move(made);
      views_of_ = kv;
    }
    return views_;
  }

  std::vector<Layer> layers_;
  int64_t H_, Hkv_, D_;
  mutable std::mutex views_mu_;
  mutable std::shared_ptr<const std::vector<CacheViews>> views_;
  mutable at::Tensor views_of_;  // the KV tensor views_ were made of (held: its storage cannot be reused meanwhile)
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Linear>(m, "Linear")
      .def_static("dense", [](at::Tensor w, std::optional<at::Tensor> b) { return Linear{w, {}, {}, {}, b, 0, 0}; },
                  py::arg("weight"), py::arg("bias") = py::none())
      .def_static("quantized",
                  [](at::Tensor qw, at::Tensor sc, std::optional<at::Tensor> mins, std::optional<at::Tensor> b,
                     int64_t dense_min_rows, int64_t panel_min_rows) {
                    return Linear{{}, qw, sc, mins, b, dense_min_rows, panel_min_rows};
                  },
                  py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("bias"), py::arg("dense_min_rows"),
                  py::arg("panel_min_rows"));
  py::class_<Layer>(m, "Layer")
      .def(py::init([](at::Tensor ln1, at::Tensor ln2, double eps, std::vector<Linear> qkv, Linear o,
                       std::vector<Linear> gate_up, Linear down) {
             TORCH_CHECK(qkv.size() == 1 || qkv.size() == 3, "qkv: one fused linear or q, k, v");
             TORCH_CHECK(gate_up.size() == 1 || gate_up.size() == 2, "gate_up: one fused linear or gate, up");
             return Layer{ln1, ln2, eps, qkv, o, gate_up, down};
           }),
           py::arg("ln1"), py::arg("ln2"), py::arg("eps"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"),
           py::arg("down"));
  py::class_<Stack>(m, "Stack")
      .def(py::init<std::vector<Layer>, int64_t, int64_t, int64_t>(), py::arg("layers"), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"))
      .def("forward", &Stack::forward, py::call_guard<py::gil_scoped_release>());
  m.def("set_pool_cpus", &ws::pool::set_cpus, py::arg("cpus"));
  m.def("set_pool_spread", &ws::pool::set_spread, py::arg("on"));
  m.def("pool_stats", &ws::pool::stats);
  m.def("set_pool_enabled", &ws::pool::set_enabled, py::arg("on"));
  m.attr("openmp") = ws::kOpenMP;
}
