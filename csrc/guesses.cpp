// The host side of a routing guess (offtensor/moe/guesses.py), on the few rows of look-ahead scores
// read back to the host: from the scores' tensor itself (its memory read through csrc/score_view.h),
// or from its rows as Python lists of floats (``tolist()``). Each row's softmax and top-k, a guess's
// ranked confidence bins, a next-token map's chances and its likeliest experts (the guesses'
// records, their gate and their scoring: csrc/guess_records.cpp). Each is what the interpreter's code
// computes, in the same double arithmetic in the same order (libm's exp, sequential sums, stable
// sorts), so that the policy decides the same with or without this extension; without the
// interpreter's cost per element and per step (every MoE layer of every decode step runs them).
// Where the interpreter's own order is not a plain one (a NaN among the values it sorts), a function
// returns None and the caller takes the interpreter's path. Plain functions of the module, not ops:
// an op call costs more than the loop at a few dozen experts.
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "pyref.h"
#include "score_view.h"

namespace offtensor {

// The values of a list or tuple of numbers as doubles (false with an exception set).
bool numbers(PyObject* seq, std::vector<double>* out) {
  PyRef fast(PySequence_Fast(seq, "offtensor: expected a list or tuple of numbers"));
  if (!fast.p) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast.p);
  out->resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    (*out)[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(fast.p, i));
    if ((*out)[i] == -1.0 && PyErr_Occurred()) return false;
  }
  return true;
}

namespace {

// The doubles of ``row[lo:hi]`` (a list of Python numbers, sliced as Python slices it: hi
// PY_SSIZE_T_MAX for none); false with an exception set.
bool row_values(PyObject* row, Py_ssize_t lo, Py_ssize_t hi, std::vector<double>* out) {
  if (!PyList_Check(row)) {
    PyErr_SetString(PyExc_TypeError, "offtensor: a guess's rows are lists of scores");
    return false;
  }
  const Py_ssize_t width = PySlice_AdjustIndices(PyList_GET_SIZE(row), &lo, &hi, 1);
  out->resize(width);
  for (Py_ssize_t e = 0; e < width; ++e) {
    (*out)[e] = PyFloat_AsDouble(PyList_GET_ITEM(row, lo + e));
    if ((*out)[e] == -1.0 && PyErr_Occurred()) return false;
  }
  return true;
}

// An optional column bound (None: the row's end) as a slice index; false with an exception set.
bool column(PyObject* obj, Py_ssize_t* out) {
  if (obj == Py_None) {
    *out = PY_SSIZE_T_MAX;
    return true;
  }
  *out = PyNumber_AsSsize_t(obj, PyExc_OverflowError);
  return !(*out == -1 && PyErr_Occurred());
}

// A guess's few rows of scores: host_rows' lists of floats, or the tensor itself, read from its
// memory (csrc/score_view.h) where it is one read that way, only the columns asked for.
class Scores {
 public:
  // 1 opened, 0 a tensor not read here (no exception: the caller reads it through host_rows), -1
  // with an exception set. ``obj`` is held by the caller while rows are read.
  int open(PyObject* obj) {
    if (PyList_Check(obj)) {
      list_ = obj;
      rows_ = PyList_GET_SIZE(obj);
      return 1;
    }
    if (!score_view(obj, &view_)) return 0;
    rows_ = static_cast<Py_ssize_t>(view_.rows);
    return 1;
  }

  Py_ssize_t rows() const { return rows_; }

  // ``row[lo:hi]`` of row r (lo and hi as Python slices them), into ``out``; false with an exception set.
  bool row(Py_ssize_t r, Py_ssize_t lo, Py_ssize_t hi, std::vector<double>* out) const {
    if (list_ != nullptr) return row_values(PyList_GET_ITEM(list_, r), lo, hi, out);
    const Py_ssize_t width = PySlice_AdjustIndices(static_cast<Py_ssize_t>(view_.cols), &lo, &hi, 1);
    out->resize(width);
    if (width > 0) score_values(view_, r, lo, width, out->data());
    return true;
  }

 private:
  PyObject* list_ = nullptr;  // (borrowed: the caller's argument)
  ScoreView view_;
  Py_ssize_t rows_ = 0;
};

using Pair = std::pair<Py_ssize_t, double>;  // (expert, softmax probability)

// Appends a row's top_k highest scores (has_k false: all; a negative top_k as Python's [:top_k]
// slices) with their softmax probabilities: the highest first, the lower expert first among
// equal scores (``sorted(..., reverse=True)``). False with an exception set.
bool top_pairs(const std::vector<double>& row, bool has_k, Py_ssize_t top_k, std::vector<Py_ssize_t>* order,
               std::vector<Pair>* out) {
  const Py_ssize_t width = static_cast<Py_ssize_t>(row.size());
  if (width == 0) {
    PyErr_SetString(PyExc_ValueError, "max() arg is an empty sequence");  // (as the interpreter's)
    return false;
  }
  double top = row[0];
  for (Py_ssize_t e = 1; e < width; ++e) top = row[e] > top ? row[e] : top;  // Python's max
  double sum = 0.0;
  for (Py_ssize_t e = 0; e < width; ++e) sum += std::exp(row[e] - top);
  const double scale = 1.0 / sum;
  const Py_ssize_t k = !has_k ? width : top_k >= 0 ? std::min(top_k, width) : std::max<Py_ssize_t>(width + top_k, 0);
  const auto before = [&row](Py_ssize_t a, Py_ssize_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); };
  if (k <= 16) {  // (a guess's top-k of a few dozen: kept sorted as the row is read, no heap)
    order->clear();
    for (Py_ssize_t e = 0; e < width; ++e) {
      if (static_cast<Py_ssize_t>(order->size()) == k && (k == 0 || !before(e, order->back()))) continue;
      if (static_cast<Py_ssize_t>(order->size()) == k) order->pop_back();
      order->insert(std::upper_bound(order->begin(), order->end(), e, before), e);
    }
  } else {
    order->resize(width);
    for (Py_ssize_t e = 0; e < width; ++e) (*order)[e] = e;
    std::partial_sort(order->begin(), order->begin() + k, order->end(), before);
  }
  for (Py_ssize_t i = 0; i < k; ++i) out->emplace_back((*order)[i], std::exp(row[(*order)[i]] - top) * scale);
  return true;
}

// top_k: None, or a number (false with an exception set).
bool parse_top_k(PyObject* obj, bool* has_k, Py_ssize_t* top_k) {
  *has_k = obj != Py_None;
  *top_k = *has_k ? PyNumber_AsSsize_t(obj, PyExc_OverflowError) : 0;
  return !(*top_k == -1 && PyErr_Occurred());
}

// [(expert, softmax probability)] of each row's top_k highest scores (None: all), row after row
// (guesses.host_guess).
PyObject* guess_rows(PyObject*, PyObject* args) {
  PyObject *rows, *top_k_obj;
  if (!PyArg_ParseTuple(args, "O!O", &PyList_Type, &rows, &top_k_obj)) return nullptr;
  bool has_k;
  Py_ssize_t top_k;
  if (!parse_top_k(top_k_obj, &has_k, &top_k)) return nullptr;
  std::vector<double> row;
  std::vector<Py_ssize_t> order;
  std::vector<Pair> pairs;
  for (Py_ssize_t r = 0; r < PyList_GET_SIZE(rows); ++r) {
    if (!row_values(PyList_GET_ITEM(rows, r), 0, PY_SSIZE_T_MAX, &row)) return nullptr;
    if (!top_pairs(row, has_k, top_k, &order, &pairs)) return nullptr;
  }
  PyRef out(PyList_New(static_cast<Py_ssize_t>(pairs.size())));
  if (!out.p) return nullptr;
  for (size_t i = 0; i < pairs.size(); ++i) {
    PyObject* pair = Py_BuildValue("(nd)", pairs[i].first, pairs[i].second);
    if (pair == nullptr) return nullptr;
    PyList_SET_ITEM(out.p, static_cast<Py_ssize_t>(i), pair);
  }
  return out.release();
}

// The bins' upper edges but the last (guesses._EDGES, a tuple of floats): read once per tuple, kept
// while it is the one given (a tuple does not change; another is read, into ``scratch``).
const std::vector<double>* edges_of(PyObject* edges, std::vector<double>* scratch) {
  static PyObject* known = nullptr;
  static std::vector<double>* values = new std::vector<double>();
  if (edges == known) return values;
  if (!numbers(edges, scratch)) return nullptr;
  if (!PyTuple_CheckExact(edges)) return scratch;
  Py_XSETREF(known, Py_NewRef(edges));
  *values = *scratch;
  return values;
}

// The confidence bin of a probability: bisect_left over the bins' upper edges but the last.
size_t bin_of(const std::vector<double>& edges, double p) {
  size_t a = 0, b = edges.size();
  while (a < b) {
    const size_t mid = (a + b) / 2;
    if (edges[mid] < p) a = mid + 1;
    else b = mid;
  }
  return a;
}

// ranked_bins of (expert object, probability) pairs: stably sorted by probability, the highest
// first, then each expert's first (its highest) binned, in that order, into a new dict. None where
// a probability is NaN (the interpreter's sort then orders as its comparisons fall).
template <typename Expert>
PyObject* binned(std::vector<std::pair<Expert, double>>* pairs, const std::vector<double>& edges,
                 PyObject* (*as_object)(Expert)) {
  for (const auto& pair : *pairs)
    if (std::isnan(pair.second)) Py_RETURN_NONE;
  const auto more = [](const auto& a, const auto& b) { return a.second > b.second; };
  if (pairs->size() > 32) {
    std::stable_sort(pairs->begin(), pairs->end(), more);
  } else {  // (a decode step's few pairs: a stable insertion sort, no buffer to allocate)
    for (size_t i = 1; i < pairs->size(); ++i)
      for (size_t j = i; j > 0 && more((*pairs)[j], (*pairs)[j - 1]); --j) std::swap((*pairs)[j - 1], (*pairs)[j]);
  }
  PyRef out(PyDict_New());
  if (!out.p) return nullptr;
  for (const auto& pair : *pairs) {
    PyRef expert(as_object(pair.first));
    if (!expert.p) return nullptr;
    const int seen = PyDict_Contains(out.p, expert.p);  // (an expert's highest probability came first)
    if (seen < 0) return nullptr;
    if (seen) continue;
    PyRef bin(PyLong_FromSize_t(bin_of(edges, pair.second)));
    if (!bin.p || PyDict_SetItem(out.p, expert.p, bin.p) < 0) return nullptr;
  }
  return out.release();
}

PyObject* expert_number(Py_ssize_t e) { return PyLong_FromSsize_t(e); }
PyObject* expert_object(PyObject* e) { return Py_NewRef(e); }

// ``ranked_bins(host_guess([r[lo:hi] for r in host_rows(scores)], top_k))`` in one pass
// (guesses.guess_bins): expert -> the confidence bin of its highest probability, the most confident
// first, equal probabilities in the order host_guess gives them; None where a probability is NaN or
// the scores are a tensor not read here.
PyObject* guess_bins(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "offtensor: guess_bins(scores, lo, hi, top_k, edges)");
    return nullptr;
  }
  Scores rows;
  const int opened = rows.open(args[0]);
  if (opened <= 0) {
    if (opened < 0) return nullptr;
    Py_RETURN_NONE;
  }
  Py_ssize_t lo, hi, top_k;
  bool has_k;
  if (!column(args[1], &lo) || !column(args[2], &hi) || !parse_top_k(args[3], &has_k, &top_k)) return nullptr;
  if (args[1] == Py_None) lo = 0;
  std::vector<double> scratch;
  const std::vector<double>* edges = edges_of(args[4], &scratch);
  if (edges == nullptr) return nullptr;
  std::vector<double> row;
  std::vector<Py_ssize_t> order;
  std::vector<Pair> pairs;
  pairs.reserve(has_k && top_k > 0 ? static_cast<size_t>(top_k * rows.rows()) : 0);
  order.reserve(has_k && top_k > 0 && top_k <= 16 ? static_cast<size_t>(top_k + 1) : 0);
  for (Py_ssize_t r = 0; r < rows.rows(); ++r) {
    if (!rows.row(r, lo, hi, &row)) return nullptr;
    if (!top_pairs(row, has_k, top_k, &order, &pairs)) return nullptr;
  }
  return binned(&pairs, *edges, expert_number);
}

// ranked_bins(pairs, edges) of a list of (expert, float) pairs (a token table's guess); None where
// a pair is not a tuple of an object and a float, or a probability is NaN (the interpreter's path).
PyObject* rank_bins(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyList_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "offtensor: rank_bins(pairs, edges)");
    return nullptr;
  }
  std::vector<double> scratch;
  const std::vector<double>* edges = edges_of(args[1], &scratch);
  if (edges == nullptr) return nullptr;
  PyRef held(PyList_GetSlice(args[0], 0, PY_SSIZE_T_MAX));  // (its tuples held while dict look-ups run)
  if (!held.p) return nullptr;
  std::vector<std::pair<PyObject*, double>> pairs;  // (borrowed from the tuples held)
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(held.p); ++i) {
    PyObject* pair = PyList_GET_ITEM(held.p, i);
    if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyFloat_CheckExact(PyTuple_GET_ITEM(pair, 1)))
      Py_RETURN_NONE;
    pairs.emplace_back(PyTuple_GET_ITEM(pair, 0), PyFloat_AS_DOUBLE(PyTuple_GET_ITEM(pair, 1)));
  }
  return binned(&pairs, *edges, expert_object);
}

// Per expert, 1 - prod over the rows of (1 - sigmoid(score)) over ``row[lo:]`` (lo: 0 where not
// given): its chance of use at a layer's next turn from a next-token map's logits, one row a token
// of the turn (guesses.host_chances, on host_rows' lists or the tensor: None for a tensor not read
// here).
PyObject* chance_rows(PyObject*, PyObject* args) {
  PyObject* scores;
  Py_ssize_t lo = 0;
  if (!PyArg_ParseTuple(args, "O|n", &scores, &lo)) return nullptr;
  Scores rows;
  const int opened = rows.open(scores);
  if (opened <= 0) {
    if (opened < 0) return nullptr;
    Py_RETURN_NONE;
  }
  if (rows.rows() == 0) {
    PyErr_SetString(PyExc_IndexError, "list index out of range");  // (as the interpreter's)
    return nullptr;
  }
  std::vector<double> row, miss;
  for (Py_ssize_t r = 0; r < rows.rows(); ++r) {
    if (!rows.row(r, lo, PY_SSIZE_T_MAX, &row)) return nullptr;
    if (r == 0) miss.assign(row.size(), 1.0);
    if (row.size() > miss.size()) {
      PyErr_SetString(PyExc_IndexError, "list index out of range");
      return nullptr;
    }
    for (size_t e = 0; e < row.size(); ++e) miss[e] *= 1.0 - (row[e] > -60.0 ? 1.0 / (1.0 + std::exp(-row[e])) : 0.0);
  }
  PyRef out(PyList_New(static_cast<Py_ssize_t>(miss.size())));
  if (!out.p) return nullptr;
  for (size_t e = 0; e < miss.size(); ++e) {
    PyObject* chance = PyFloat_FromDouble(1.0 - miss[e]);
    if (chance == nullptr) return nullptr;
    PyList_SET_ITEM(out.p, static_cast<Py_ssize_t>(e), chance);
  }
  return out.release();
}

// ``frozenset(sorted(range(len(chances)), key=chances.__getitem__)[-count:])``: the experts of the
// ``count`` highest chances, the higher expert kept among equal chances at the edge (a stable sort,
// ascending); None where a chance is NaN or count is not positive (the interpreter's path).
PyObject* likeliest(PyObject*, PyObject* args) {
  PyObject* chances_obj;
  Py_ssize_t count;
  if (!PyArg_ParseTuple(args, "O!n", &PyList_Type, &chances_obj, &count)) return nullptr;
  std::vector<double> chances;
  if (!row_values(chances_obj, 0, PY_SSIZE_T_MAX, &chances)) return nullptr;
  if (count <= 0) Py_RETURN_NONE;
  for (double c : chances)
    if (std::isnan(c)) Py_RETURN_NONE;
  const Py_ssize_t n = static_cast<Py_ssize_t>(chances.size()), k = std::min(count, n);
  // The last k of the stable ascending sort are the first k by (chance, expert) descending: (chance,
  // expert) orders every expert apart, so the set is the same whichever way it is picked; a few of
  // a few dozen, kept sorted as the chances are read.
  const auto before = [&chances](Py_ssize_t a, Py_ssize_t b) {
    return chances[a] > chances[b] || (chances[a] == chances[b] && a > b);
  };
  std::vector<Py_ssize_t> order;
  order.reserve(k + 1);
  for (Py_ssize_t e = n - 1; e >= 0; --e) {
    if (static_cast<Py_ssize_t>(order.size()) == k && !before(e, order.back())) continue;
    if (static_cast<Py_ssize_t>(order.size()) == k) order.pop_back();
    order.insert(std::upper_bound(order.begin(), order.end(), e, before), e);
  }
  PyRef out(PyFrozenSet_New(nullptr));
  if (!out.p) return nullptr;
  for (Py_ssize_t i = 0; i < k; ++i) {
    PyRef expert(PyLong_FromSsize_t(order[i]));
    if (!expert.p || PySet_Add(out.p, expert.p) < 0) return nullptr;
  }
  return out.release();
}

PyMethodDef kMethods[] = {
    {"guess_rows", guess_rows, METH_VARARGS,
     "The host side of a routing guess on rows of scores (offtensor/moe/guesses.py: host_guess)."},
    {"guess_bins", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(guess_bins)), METH_FASTCALL,
     "A guess's ranked confidence bins from rows of scores (offtensor/moe/guesses.py: guess_bins)."},
    {"rank_bins", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(rank_bins)), METH_FASTCALL,
     "(expert, probability) pairs ranked and binned (offtensor/moe/guesses.py: ranked_bins)."},
    {"chance_rows", chance_rows, METH_VARARGS,
     "A next-token map's chances on rows of logits (offtensor/moe/guesses.py: host_chances)."},
    {"likeliest", likeliest, METH_VARARGS,
     "The experts of the highest chances (offtensor/moe/eviction_index.py: NextTurn.predict)."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

// This file's entries of the module's method table (policy_methods in csrc/policy.cpp).
PyMethodDef* guess_methods() { return kMethods; }

}  // namespace offtensor
