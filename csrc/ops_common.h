// What every part of the extension's ATen code shares: whether the CUDA part is compiled in, the
// device count, CUDA error codes turned into exceptions, and the GIL released while a call blocks.
// A part of offtensor.cpp's one translation unit, included there once: every file that includes ATen
// costs about a minute to compile on a 2-core build machine, so the extension's ATen code stays one
// unit, kept in files by idea. Its functions have internal linkage (an unnamed namespace).
#pragma once

#include <ATen/ATen.h>
#include <Python.h>

#include <cstdint>

#ifdef OFFTENSOR_WITH_CUDA
#include "cuda/runtime.h"
#endif

namespace offtensor {
namespace {

constexpr bool kCudaCompiled =
#ifdef OFFTENSOR_WITH_CUDA
    true;
#else
    false;
#endif

int64_t cuda_device_count() {
#ifdef OFFTENSOR_WITH_CUDA
  // The answer cannot change within a process, and asking the driver costs milliseconds.
  static const int64_t count = ot_cuda_device_count();
  return count;
#else
  return 0;
#endif
}

#ifdef OFFTENSOR_WITH_CUDA
// Turns a negative code from runtime.cu into an exception naming what was being done.
void check_cuda(int64_t result, const char* what) {
  TORCH_CHECK(result >= 0, "offtensor: ", what, " failed: ", ot_cuda_error_string(static_cast<int>(-result)),
              " (CUDA error ", -result, ")");
}
#endif

// Releases the GIL while a C++ call blocks, when the calling thread holds it, so other Python
// threads keep running while we wait for a copy.
class GilRelease {
 public:
  GilRelease() {
    if (Py_IsInitialized() && PyGILState_Check()) state_ = PyEval_SaveThread();
  }
  ~GilRelease() {
    if (state_ != nullptr) PyEval_RestoreThread(state_);
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_ = nullptr;
};

}  // namespace
}  // namespace offtensor
