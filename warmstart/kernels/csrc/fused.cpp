// Python binding of the decode step's fused glue (see fused.h), and the pinning of OpenMP workers (affinity.h).
#include <pybind11/stl.h>

#include "affinity.h"
#include "fused.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &ws::fused::add_rms_norm, py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
        py::call_guard<py::gil_scoped_release>());
  m.def("rotary_", &ws::fused::rotary_, py::arg("x"), py::arg("cos"), py::arg("sin"), py::call_guard<py::gil_scoped_release>());
  m.def("write_kv", &ws::fused::write_kv, py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"),
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &ws::fused::silu_mul, py::arg("x"), py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &ws::fused::argmax_rows, py::arg("x"), py::call_guard<py::gil_scoped_release>());
  m.def("pin_workers", &ws::affinity::pin_workers, py::arg("cpus"));
  m.def("spread_workers", &ws::affinity::spread_workers, py::arg("cpus"));
  m.def("set_pool_cpus", &ws::pool::set_cpus, py::arg("cpus"));
  m.def("set_pool_spread", &ws::pool::set_spread, py::arg("on"));
  m.def("pool_stats", &ws::pool::stats);
  m.def("set_pool_enabled", &ws::pool::set_enabled, py::arg("on"));
  m.attr("openmp") = ws::kOpenMP;
}
