// The expert policy's inner loops (offtensor/moe): plain functions of the extension module
// `offtensor._C` on the interpreter's own objects, each the interpreter's code step by step in the
// same double arithmetic and order, so the policy decides the same with or without them; Python
// reaches them through offtensor._ext.native_function. Apart from offtensor.cpp because they need
// only Python's headers, not ATen's: this file compiles in seconds.
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "pyref.h"

namespace offtensor {

// The expert eviction's victim search (csrc/eviction.cpp).
PyObject* stack_best(PyObject*, PyObject* args);
PyObject* victim_search(PyObject*, PyObject* const* args, Py_ssize_t nargs);

namespace {

// The host side of a routing guess (offtensor/moe/guesses.py: host_guess, host_chances), on the few
// rows of look-ahead scores read back to the host, as Python lists of floats (``tolist()``): what the
// interpreter's loops compute, in the same double arithmetic in the same order (libm's exp, a
// sequential sum), so that the guesses are the same with or without this extension; without the
// interpreter's per-element cost (at DeepSeek-V3's 256 experts some 40 us a row). Plain functions of
// the module, not ops: an op call costs more than the loop at a few dozen experts.

// The doubles of one row (a list of Python numbers); false with an exception set.
bool row_values(PyObject* row, std::vector<double>* out) {
  if (!PyList_Check(row)) {
    PyErr_SetString(PyExc_TypeError, "offtensor: a guess's rows are lists of scores");
    return false;
  }
  const Py_ssize_t width = PyList_GET_SIZE(row);
  out->resize(width);
  for (Py_ssize_t e = 0; e < width; ++e) {
    (*out)[e] = PyFloat_AsDouble(PyList_GET_ITEM(row, e));
    if ((*out)[e] == -1.0 && PyErr_Occurred()) return false;
  }
  return true;
}

// [(expert, softmax probability)] of each row's top_k highest scores (None: all), the highest first
// (ties: the lower expert first), row after row.
PyObject* guess_rows(PyObject*, PyObject* args) {
  PyObject *rows, *top_k_obj;
  if (!PyArg_ParseTuple(args, "O!O", &PyList_Type, &rows, &top_k_obj)) return nullptr;
  Py_ssize_t top_k = -1;
  if (top_k_obj != Py_None) {
    top_k = PyNumber_AsSsize_t(top_k_obj, PyExc_OverflowError);
    if (top_k == -1 && PyErr_Occurred()) return nullptr;
  }
  PyRef out(PyList_New(0));
  if (!out.p) return nullptr;
  std::vector<double> row;
  std::vector<Py_ssize_t> order;
  for (Py_ssize_t r = 0; r < PyList_GET_SIZE(rows); ++r) {
    if (!row_values(PyList_GET_ITEM(rows, r), &row)) return nullptr;
    const Py_ssize_t width = static_cast<Py_ssize_t>(row.size());
    if (width == 0) {
      PyErr_SetString(PyExc_ValueError, "max() arg is an empty sequence");  // (as the interpreter's)
      return nullptr;
    }
    double top = row[0];
    for (Py_ssize_t e = 1; e < width; ++e) top = row[e] > top ? row[e] : top;  // Python's max
    double sum = 0.0;
    for (Py_ssize_t e = 0; e < width; ++e) sum += std::exp(row[e] - top);
    const double scale = 1.0 / sum;
    const Py_ssize_t k = top_k < 0 ? width : std::min(top_k, width);
    order.resize(width);
    for (Py_ssize_t e = 0; e < width; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&row](Py_ssize_t a, Py_ssize_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
    for (Py_ssize_t i = 0; i < k; ++i) {
      PyRef pair(Py_BuildValue("(nd)", order[i], std::exp(row[order[i]] - top) * scale));
      if (!pair.p || PyList_Append(out.p, pair.p) < 0) return nullptr;
    }
  }
  return out.release();
}

// Per expert, 1 - prod over the rows of (1 - sigmoid(score)): its chance of use at a layer's next
// turn from a next-token map's logits, one row a token of the turn.
PyObject* chance_rows(PyObject*, PyObject* args) {
  PyObject* rows;
  if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &rows)) return nullptr;
  if (PyList_GET_SIZE(rows) == 0) {
    PyErr_SetString(PyExc_IndexError, "list index out of range");  // (as the interpreter's)
    return nullptr;
  }
  std::vector<double> row, miss;
  for (Py_ssize_t r = 0; r < PyList_GET_SIZE(rows); ++r) {
    if (!row_values(PyList_GET_ITEM(rows, r), &row)) return nullptr;
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

// ---------------------------------------------------------------------------------------------
// The experts of a layer with a whole copy cached in every one of its stacks (offtensor/moe/
// speculation.py: _cached_experts), read at every guess. Per stack, the keys of its cached copies
// (CacheKey: master, dtype, lo, hi, all of that stack's master); a key is expert e's where it equals
// the key the stack made for it, (master, dtype, base + e * step, base + (e + 1) * step): found by
// arithmetic rather than a look-up of the key (hashing a 4-tuple per cached copy was most of a
// guess's time at 256 experts). A copy of part of an expert, or of another dtype, is none.

// A stack's attribute (an interned name) as a C integer; false with an exception set.
bool long_attr(PyObject* obj, PyObject* name, long long* out) {
  PyRef value(PyObject_GetAttr(obj, name));
  if (!value.p) return false;
  *out = PyLong_AsLongLong(value.p);
  return !(*out == -1 && PyErr_Occurred());
}

PyObject* cached_experts(PyObject*, PyObject* args) {
  PyObject *keys_of, *stacks;
  if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &keys_of, &PyList_Type, &stacks)) return nullptr;
  const Py_ssize_t n_stacks = PyList_GET_SIZE(stacks);
  if (PyList_GET_SIZE(keys_of) != n_stacks) {
    PyErr_SetString(PyExc_ValueError, "offtensor: cached_experts takes one list of keys per stack");
    return nullptr;
  }
  static PyObject* master_name = PyUnicode_InternFromString("master_id");
  static PyObject* base_name = PyUnicode_InternFromString("base");
  static PyObject* bytes_name = PyUnicode_InternFromString("expert_bytes");
  static PyObject* experts_name = PyUnicode_InternFromString("num_experts");
  static PyObject* dtype_name = PyUnicode_InternFromString("dtype");
  static PyObject* itemsize_name = PyUnicode_InternFromString("itemsize");
  std::vector<Py_ssize_t> seen;  // per expert: how many stacks so far have it cached (each counts once)
  for (Py_ssize_t s = 0; s < n_stacks; ++s) {
    PyObject* stack = PyList_GET_ITEM(stacks, s);
    long long master, base, expert_bytes, experts;
    if (!long_attr(stack, master_name, &master) || !long_attr(stack, base_name, &base) ||
        !long_attr(stack, bytes_name, &expert_bytes) || !long_attr(stack, experts_name, &experts))
      return nullptr;
    PyRef dtype(PyObject_GetAttr(stack, dtype_name));
    if (!dtype.p) return nullptr;
    PyRef itemsize_obj(PyObject_GetAttr(dtype.p, itemsize_name));
    if (!itemsize_obj.p) return nullptr;
    const long long itemsize = PyLong_AsLongLong(itemsize_obj.p);
    if (itemsize == -1 && PyErr_Occurred()) return nullptr;
    const long long step = itemsize > 0 ? expert_bytes / itemsize : 0;  // (Stack.__init__'s)
    if (s == 0) seen.assign(static_cast<size_t>(experts > 0 ? experts : 0), 0);
    PyObject* keys = PyList_GET_ITEM(keys_of, s);
    if (!PyList_Check(keys)) {
      PyErr_SetString(PyExc_TypeError, "offtensor: cached_experts takes lists of cache keys");
      return nullptr;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); ++i) {
      PyObject* key = PyList_GET_ITEM(keys, i);
      if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 4) continue;  // (no CacheKey: no expert's)
      const int same_dtype = PyObject_RichCompareBool(PyTuple_GET_ITEM(key, 1), dtype.p, Py_EQ);
      if (same_dtype < 0) return nullptr;
      if (!same_dtype || step <= 0) continue;
      const long long of = PyLong_AsLongLong(PyTuple_GET_ITEM(key, 0));
      const long long lo = PyLong_AsLongLong(PyTuple_GET_ITEM(key, 2));
      const long long hi = PyLong_AsLongLong(PyTuple_GET_ITEM(key, 3));
      if (PyErr_Occurred()) return nullptr;
      if (of != master || lo < base || (lo - base) % step != 0 || hi - lo != step) continue;
      const long long e = (lo - base) / step;
      if (e >= experts || e >= static_cast<long long>(seen.size())) continue;
      if (seen[e] == s) seen[e] = s + 1;  // (a key listed twice counts once)
    }
  }
  PyRef out(PyFrozenSet_New(nullptr));
  if (!out.p) return nullptr;
  for (size_t e = 0; e < seen.size(); ++e) {
    if (n_stacks == 0 || seen[e] != n_stacks) continue;
    PyRef expert(PyLong_FromSize_t(e));
    if (!expert.p || PySet_Add(out.p, expert.p) < 0) return nullptr;
  }
  return out.release();
}

// Every use count times `factor`, and those below `floor` dropped (offtensor/moe/eviction.py:
// ExpertEviction.decay), in one pass over the dict: the values are replaced in place, each key's
// slot found again by the key (the set of keys does not change while the dict is walked), and the
// keys dropped after the walk.
// With `in_place`, a float only the dict holds is changed where it lies instead (see below).
PyObject* decay_walk(PyObject* args, bool in_place) {
  PyObject* counts;
  double factor, floor;
  if (!PyArg_ParseTuple(args, "O!dd", &PyDict_Type, &counts, &factor, &floor)) return nullptr;
  PyRef dropped(PyList_New(0));
  if (!dropped.p) return nullptr;
  Py_ssize_t pos = 0;
  PyObject *key, *value;
  while (PyDict_Next(counts, &pos, &key, &value)) {
    double old;
    if (PyFloat_CheckExact(value)) {
      old = PyFloat_AS_DOUBLE(value);
    } else {
      old = PyFloat_AsDouble(value);
      if (old == -1.0 && PyErr_Occurred()) return nullptr;
    }
    const double now = old * factor;
    if (now < floor) {
      if (PyList_Append(dropped.p, key) < 0) return nullptr;
      continue;
    }
#ifndef Py_GIL_DISABLED
    if (in_place && PyFloat_CheckExact(value) && Py_REFCNT(value) == 1) {
      reinterpret_cast<PyFloatObject*>(value)->ob_fval = now;  // (no one else can see it change)
      continue;
    }
#endif
    PyRef updated(PyFloat_FromDouble(now));
    if (!updated.p || PyDict_SetItem(counts, key, updated.p) < 0) return nullptr;
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(dropped.p); ++i)
    if (PyDict_DelItem(counts, PyList_GET_ITEM(dropped.p, i)) < 0) return nullptr;
  Py_RETURN_NONE;
}

PyObject* decay_counts(PyObject*, PyObject* args) { return decay_walk(args, false); }

// decay_counts without a new float or a dict store per count: a count's float that only the dict
// holds (the usual case: ExpertEviction.used stores the sum it made) is changed in place, as the
// interpreter's own float arithmetic reuses an operand only it holds; any other value is replaced
// through the dict as decay_counts does. The same values, bit for bit, in the same order; no key's
// hash is computed again. (Free-threaded builds, whose reference counts another thread may change
// under the walk, always replace.)
PyObject* decay_counts_in_place(PyObject*, PyObject* args) { return decay_walk(args, true); }

PyMethodDef kMethods[] = {
    {"guess_rows", guess_rows, METH_VARARGS,
     "The host side of a routing guess on rows of scores (offtensor/moe/guesses.py: host_guess)."},
    {"chance_rows", chance_rows, METH_VARARGS,
     "A next-token map's chances on rows of logits (offtensor/moe/guesses.py: host_chances)."},
    {"stack_best", stack_best, METH_VARARGS,
     "The expert eviction's ranking of one stack (offtensor/moe/eviction.py: ExpertEviction._stack_best)."},
    {"victim_search", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(victim_search)), METH_FASTCALL,
     "The victim search's loop over the layers (offtensor/moe/eviction.py: ExpertEviction.victim)."},
    {"cached_experts", cached_experts, METH_VARARGS,
     "A layer's experts cached whole in every stack (offtensor/moe/speculation.py: _cached_experts)."},
    {"decay_counts", decay_counts, METH_VARARGS,
     "Use counts decayed and the smallest dropped (offtensor/moe/eviction.py: ExpertEviction.decay)."},
    {"decay_counts_in_place", decay_counts_in_place, METH_VARARGS,
     "decay_counts, changing in place the floats only the dict holds (offtensor/moe/eviction.py: ExpertEviction.decay)."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

// The module's method table (PyInit__C in offtensor.cpp).
PyMethodDef* policy_methods() { return kMethods; }

}  // namespace offtensor
