// Python binding of paged attention (see paged_attention.h).
#include "paged_attention.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &ws::paged::paged_attention, "paged attention over a block-table KV cache (fp32 output)",
        py::call_guard<py::gil_scoped_release>());
  m.attr("simd") = WS_AVX2 ? "avx2+fma+f16c" : "scalar";
  m.def("int8_lanes", [](int64_t D) { return ws::paged::int8_wide(D) ? 16 : 8; }, py::arg("head_dim"),
        "lanes of an int8 cache's tile step at this head_dim (16: the AVX-512 VNNI step), under the ISA in force");
  m.def("set_pool_cpus", &ws::pool::set_cpus, py::arg("cpus"));
  m.def("set_pool_spread", &ws::pool::set_spread, py::arg("on"));
  m.def("pool_stats", &ws::pool::stats);
  m.def("set_pool_enabled", &ws::pool::set_enabled, py::arg("on"));
  m.attr("openmp") = ws::kOpenMP;
}
