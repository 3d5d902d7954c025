// offtensor's native extension: the schemas of every torch.ops.offtensor op, their registrations
// and the module offtensor._C. Their CPU implementations are parts of this one translation unit,
// a header each by idea: exact-size page-aligned host memory (host_memory.h), the asynchronous
// copy engine (copy_engine.h) and the expert pool's ops (expert_pool_ops.h), on what they share
// (ops_common.h).
//
// CUDA work goes through the C interface in cuda/runtime.h (compiled by nvcc, linked only when
// OFFTENSOR_WITH_CUDA is defined), so this unit needs no CUDA headers and builds against a CPU
// torch. Fake kernels live in offtensor/_ext.py. One translation unit for everything that includes
// ATen: each such unit costs about a minute on a 2-core build machine, so its parts are included
// here rather than compiled apart. The expert policy's inner loops, which need only Python's
// headers, are csrc/policy.cpp and the files it names; the one of their reads that needs a
// tensor's own memory (score_view, below) is here.
#include <ATen/ATen.h>
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include "copy_engine.h"
#include "expert_pool_ops.h"
#include "host_memory.h"
#include "ops_common.h"
#include "score_view.h"

namespace offtensor {
namespace {

bool cuda_compiled() { return kCudaCompiled; }

}  // namespace

// A routing guess's few rows of look-ahead scores read on the host (csrc/guesses.cpp), from the
// tensor's memory: each value as tolist() gives it (a float, half or bfloat16 widened to a double,
// exactly), without a Python float made per value and freed after (a tolist() of a decode step's
// scores and its list's release were a sixth of the guess path's host work), and only the columns
// a read asks for. ``score_view``: 1 with a 1- or 2-D strided CPU tensor of float, double, half or
// bfloat16 (its layout in ``view``; the caller holds the tensor while it reads), 0, no exception
// set, for anything else (the caller reads it through tolist()). Nothing here throws: every ATen
// call it makes is a plain read of the tensor's metadata.
int score_view(PyObject* obj, ScoreView* view) {
  if (!THPVariable_Check(obj)) return 0;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || t.layout() != at::kStrided || !t.device().is_cpu() || t.is_neg() || t.is_conj() ||
      (t.dim() != 1 && t.dim() != 2) || !t.has_storage())
    return 0;
  const at::ScalarType type = t.scalar_type();
  if (type != at::kFloat && type != at::kDouble && type != at::kHalf && type != at::kBFloat16) return 0;
  view->rows = t.dim() == 2 ? t.size(0) : 1;
  view->cols = t.size(-1);
  view->row_stride = t.dim() == 2 ? t.stride(0) : 0;
  view->col_stride = t.stride(-1);
  view->type = type == at::kFloat ? 0 : type == at::kDouble ? 1 : type == at::kHalf ? 2 : 3;
  view->data = view->rows * view->cols != 0 ? t.const_data_ptr() : nullptr;
  return 1;
}

namespace {
template <typename T>
void widen(const ScoreView& view, int64_t row, int64_t lo, int64_t count, double* out) {
  const T* first = static_cast<const T*>(view.data) + row * view.row_stride + lo * view.col_stride;
  for (int64_t c = 0; c < count; ++c) out[c] = static_cast<float>(first[c * view.col_stride]);
}
}  // namespace

// Columns [lo, lo + count) of row ``row`` of a view score_view made, as doubles (double: as they are).
void score_values(const ScoreView& view, int64_t row, int64_t lo, int64_t count, double* out) {
  switch (view.type) {
    case 0: return widen<float>(view, row, lo, count, out);
    case 1: {
      const double* first = static_cast<const double*>(view.data) + row * view.row_stride + lo * view.col_stride;
      for (int64_t c = 0; c < count; ++c) out[c] = first[c * view.col_stride];
      return;
    }
    case 2: return widen<c10::Half>(view, row, lo, count, out);
    default: return widen<c10::BFloat16>(view, row, lo, count, out);
  }
}

}  // namespace offtensor

TORCH_LIBRARY(offtensor, m) {
  m.def("alloc_host(SymInt nbytes, bool pin, bool touch=True) -> Tensor");
  m.def("pin_host(Tensor host) -> bool");
  m.def("copy_async(Tensor(a!) dst, Tensor src, int ticket, int wait_stream) -> ()");
  // Ops without tensor arguments run the same everywhere, so they get one catch-all kernel.
  m.def("copy_query(int ticket) -> bool", &offtensor::copy_query);
  m.def("copy_wait(int ticket) -> ()", &offtensor::copy_wait);
  m.def("copy_stream_wait(int ticket, int stream) -> ()", &offtensor::copy_stream_wait);
  m.def("copy_shutdown() -> ()", &offtensor::copy_shutdown);
  m.def("live_host_bytes() -> int", &offtensor::live_host_bytes);
  m.def("cuda_device_count() -> int", &offtensor::cuda_device_count);
  m.def("cuda_compiled() -> bool", &offtensor::cuda_compiled);
  m.def("masked_row_gather(Tensor(a!) dst, Tensor src, Tensor dest, int stream) -> ()");
  m.def("host_device_address(Tensor host) -> int");
  m.def("pool_admit_cpu(Tensor offs, int rows, Tensor(a!) slot_of, Tensor(b!) expert_in, Tensor(c!) stamp, "
        "Tensor(d!) clock, Tensor(e!) counts, Tensor(f!)[] buffers, Tensor[] hosts, int base, int experts) -> "
        "(Tensor, Tensor)");
  m.def("pool_grouped_mm_cpu(Tensor x, Tensor pool, Tensor group_slot, Tensor group_ends) -> Tensor");
}

// A factory has no tensor argument to dispatch on; CompositeExplicitAutograd (unlike a catch-all
// kernel) still leaves FakeTensorMode to the fake kernel registered in Python.
TORCH_LIBRARY_IMPL(offtensor, CompositeExplicitAutograd, m) { m.impl("alloc_host", &offtensor::alloc_host); }

TORCH_LIBRARY_IMPL(offtensor, CPU, m) {
  m.impl("copy_async", &offtensor::copy_async);
  m.impl("pin_host", &offtensor::pin_host);
  m.impl("masked_row_gather", &offtensor::masked_row_gather_cpu);
  m.impl("host_device_address", &offtensor::host_device_address);
  m.impl("pool_admit_cpu", &offtensor::pool_admit_cpu);
  m.impl("pool_grouped_mm_cpu", &offtensor::pool_grouped_mm_cpu);
}

TORCH_LIBRARY_IMPL(offtensor, CUDA, m) {
  m.impl("copy_async", &offtensor::copy_async);
#ifdef OFFTENSOR_WITH_CUDA
  m.impl("masked_row_gather", &offtensor::masked_row_gather_cuda);
#endif
}

namespace offtensor {
PyMethodDef* policy_methods();  // csrc/policy.cpp
}

// `import offtensor._C` loads this library, whose static initializers register the ops above.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "offtensor's native ops, in torch.ops.offtensor",
                                      -1, offtensor::policy_methods(), nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}
