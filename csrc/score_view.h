// A tensor of a routing guess's look-ahead scores as the host side of the guess reads it: its
// memory's layout (csrc/offtensor.cpp, the one translation unit with ATen, makes it and converts
// its values; csrc/guesses.cpp reads the rows it needs through it, with Python's headers alone).
#pragma once

#include <Python.h>

#include <cstdint>

namespace offtensor {

struct ScoreView {
  const void* data = nullptr;  // (borrowed: the tensor's memory, held by the caller's reference)
  int64_t rows = 0, cols = 0, row_stride = 0, col_stride = 0;  // (strides in elements)
  int type = 0;  // float, double, half, bfloat16
};

// 1 with a tensor read this way (its layout in ``view``), 0 (no exception set) for anything else.
int score_view(PyObject* obj, ScoreView* view);

// Columns [lo, lo + count) of row ``row``, widened to doubles exactly as tolist() widens them.
void score_values(const ScoreView& view, int64_t row, int64_t lo, int64_t count, double* out);

}  // namespace offtensor
