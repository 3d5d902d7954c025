// A Python reference owned by C++ code (csrc/policy.cpp, csrc/eviction.cpp: plain functions of the
// extension module on the interpreter's own objects): released when it goes out of scope, so every
// early return on an error drops what it held.
#pragma once

#include <Python.h>

namespace offtensor {

struct PyRef {
  PyObject* p = nullptr;
  PyRef() = default;
  explicit PyRef(PyObject* o) : p(o) {}
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  ~PyRef() { Py_XDECREF(p); }
  PyObject* release() { PyObject* o = p; p = nullptr; return o; }
};

}  // namespace offtensor
