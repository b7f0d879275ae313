// Python binding of paged attention (see paged_attention.h).
#include "paged_attention.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &ws::paged::paged_attention, "paged attention over a block-table KV cache (fp32 output)",
        py::call_guard<py::gil_scoped_release>());
  m.attr("simd") = WS_AVX2 ? "avx2+fma+f16c" : "scalar";
  m.def("set_pool_cpus", &ws::pool::set_cpus, py::arg("cpus"));
  m.def("pool_stats", &ws::pool::stats);
  m.def("set_pool_enabled", &ws::pool::set_enabled, py::arg("on"));
  m.attr("openmp") = ws::kOpenMP;
}
