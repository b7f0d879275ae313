// Python binding of quantized linears (see qlinear.h) and few-row float linears (dense_linear.h).
#include "dense_linear.h"
#include "qlinear.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qlinear", &ws::qlinear::qlinear, "int4/int8 weight x int8-quantized activation linear (fp32 output)",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("mins") = py::none(), py::arg("dense_min_rows") = 0,
        py::arg("panel_min_rows") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("dense_linear", &ws::dense::linear,
        "float32 or bfloat16 x @ w.T + b at up to dense_max_rows rows (decode); at::linear otherwise",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.attr("dense_max_rows") = ws::dense::kMaxRows;
  m.attr("simd") = WS_AVX2 ? "avx2+fma" : "scalar";   // what this build was compiled for
  m.def("isa", &ws::qlinear::isa, "the kernels in force: amx-bf16 or avx512-vnni (chosen at run time), avx2 or scalar");
  m.def("set_isa", &ws::qlinear::set_isa, py::arg("name"),
        "hold the kernels at 'avx2' or 'avx512-vnni' or allow 'amx-bf16' (where the CPU has it); "
        "returns the level in force");
  m.def("set_pool_cpus", &ws::pool::set_cpus, py::arg("cpus"));
  m.def("set_pool_spread", &ws::pool::set_spread, py::arg("on"));
  m.def("pool_stats", &ws::pool::stats);
  m.def("set_pool_enabled", &ws::pool::set_enabled, py::arg("on"));
  m.attr("openmp") = ws::kOpenMP;
}
