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
#include "slots.h"

namespace offtensor {

// The expert eviction's victim search (csrc/eviction.cpp).
PyObject* stack_best(PyObject*, PyObject* args);
PyObject* victim_search(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// The host side of a routing guess (csrc/guesses.cpp) and the guesses' records (csrc/guess_records.cpp).
PyMethodDef* guess_methods();
PyMethodDef* record_methods();
PyMethodDef* bookkeeping_methods();  // The bookkeeping of every expert paged, copied or evicted (csrc/bookkeeping.cpp).

namespace {

// ---------------------------------------------------------------------------------------------
// The experts of a layer with a whole copy cached in every one of its stacks (offtensor/moe/
// speculation.py: _cached_experts), read at every guess. Per stack, its cached copies, read from
// the pager's copies by master (a read-only mapping: master id -> that master's cached copies, each
// with its key, CacheKey: master, dtype, lo, hi), without a list of their keys made first; a key
// is expert e's where it equals the key the stack made for it (Stack.keys[e]: master, dtype,
// base + e * step, base + (e + 1) * step, all read off its first key): found by arithmetic rather
// than a look-up of the key (hashing a 4-tuple per cached copy was most of a guess's time at 256
// experts). A copy of part of an expert, or of another dtype, is none.

// The dict a read-only view shows (types.MappingProxyType, the pager's copies by master: its one
// referent, found through its traverse slot, as csrc/policy_objects.h finds it), the mapping itself
// where it is a dict, or nullptr (borrowed).
int take_referent(PyObject* referent, void* out) {
  *static_cast<PyObject**>(out) = referent;
  return 1;  // (the first is the only one)
}

PyObject* dict_of(PyObject* mapping) {
  if (PyDict_Check(mapping)) return mapping;
  if (!Py_IS_TYPE(mapping, &PyDictProxy_Type)) return nullptr;
  PyObject* shown = nullptr;
  Py_TYPE(mapping)->tp_traverse(mapping, take_referent, &shown);
  return shown != nullptr && PyDict_Check(shown) ? shown : nullptr;
}

// ``mapping.get(key)``: a new reference (None where missing), or nullptr with an exception set.
PyObject* get_or_none(PyObject* mapping, PyObject* key) {
  if (PyObject* dict = dict_of(mapping)) {
    PyObject* value = PyDict_GetItemWithError(dict, key);
    return value != nullptr ? Py_NewRef(value) : PyErr_Occurred() ? nullptr : Py_NewRef(Py_None);
  }
  PyObject* value = PyObject_GetItem(mapping, key);
  if (value != nullptr || !PyErr_ExceptionMatches(PyExc_KeyError)) return value;
  PyErr_Clear();
  return Py_NewRef(Py_None);
}

// A key's int field as a C integer (false with an exception set).
bool key_long(PyObject* key, Py_ssize_t i, long long* out) {
  *out = PyLong_AsLongLong(PyTuple_GET_ITEM(key, i));
  return !(*out == -1 && PyErr_Occurred());
}

PyObject* cached_experts(PyObject*, PyObject* args) {
  PyObject *by_master, *stacks;
  if (!PyArg_ParseTuple(args, "OO!", &by_master, &PyList_Type, &stacks)) return nullptr;
  static Slot* keys_of = new Slot("keys");  // (Stack.keys: every expert's key)
  static Slot* key_of = new Slot("key");  // (a cached copy's key)
  const Py_ssize_t n_stacks = PyList_GET_SIZE(stacks);
  std::vector<Py_ssize_t> seen;  // per expert: how many stacks so far have it cached (each counts once)
  for (Py_ssize_t s = 0; s < n_stacks; ++s) {
    PyRef keys((*keys_of)(PyList_GET_ITEM(stacks, s)));
    if (!keys.p) return nullptr;
    if (!PyTuple_Check(keys.p) || PyTuple_GET_SIZE(keys.p) == 0 || !PyTuple_Check(PyTuple_GET_ITEM(keys.p, 0)) ||
        PyTuple_GET_SIZE(PyTuple_GET_ITEM(keys.p, 0)) != 4) {
      PyErr_SetString(PyExc_TypeError, "offtensor: cached_experts takes stacks with their experts' cache keys");
      return nullptr;
    }
    PyObject* first = PyTuple_GET_ITEM(keys.p, 0);  // expert 0's: (master, dtype, base, base + step)
    PyObject* dtype = PyTuple_GET_ITEM(first, 1);
    long long master, base, end;
    if (!key_long(first, 0, &master) || !key_long(first, 2, &base) || !key_long(first, 3, &end)) return nullptr;
    const long long step = end - base, experts = PyTuple_GET_SIZE(keys.p);
    if (s == 0) seen.assign(static_cast<size_t>(experts), 0);
    PyRef copies(get_or_none(by_master, PyTuple_GET_ITEM(first, 0)));
    if (!copies.p) return nullptr;
    if (copies.p == Py_None) continue;
    PyRef fast(PySequence_Fast(copies.p, "offtensor: cached_experts takes a mapping of master id -> cached copies"));
    if (!fast.p) return nullptr;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast.p); ++i) {
      PyRef owned((*key_of)(PySequence_Fast_GET_ITEM(fast.p, i)));
      if (!owned.p) return nullptr;
      PyObject* key = owned.p;
      if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 4) continue;  // (no CacheKey: no expert's)
      const int same_dtype = PyObject_RichCompareBool(PyTuple_GET_ITEM(key, 1), dtype, Py_EQ);
      if (same_dtype < 0) return nullptr;
      if (!same_dtype || step <= 0) continue;
      long long of, lo, hi;
      if (!key_long(key, 0, &of) || !key_long(key, 2, &lo) || !key_long(key, 3, &hi)) return nullptr;
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

// ``{stack.keys[e] for stack in stacks for e in experts}`` (offtensor/moe/eviction.py:
// ExpertEviction.guard): the cache keys of a guess's experts in every stack of its layer, at every
// layer of every decode step; a new set.
PyObject* expert_keys(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyList_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "offtensor: expert_keys(stacks, experts)");
    return nullptr;
  }
  static Slot* keys_of = new Slot("keys");
  PyRef stacks(PyList_GetSlice(args[0], 0, PY_SSIZE_T_MAX));  // (held while set insertions hash keys)
  PyRef experts(PySequence_List(args[1]));  // (a guess's experts, in its order: a dict's keys)
  PyRef out(stacks.p && experts.p ? PySet_New(nullptr) : nullptr);
  if (!out.p) return nullptr;
  for (Py_ssize_t s = 0; s < PyList_GET_SIZE(stacks.p); ++s) {
    PyRef keys((*keys_of)(PyList_GET_ITEM(stacks.p, s)));
    if (!keys.p) return nullptr;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(experts.p); ++i) {
      PyRef key(PyObject_GetItem(keys.p, PyList_GET_ITEM(experts.p, i)));  // (keys[e], as the interpreter indexes)
      if (!key.p || PySet_Add(out.p, key.p) < 0) return nullptr;
    }
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
    {"stack_best", stack_best, METH_VARARGS,
     "The expert eviction's ranking of one stack (offtensor/moe/eviction.py: ExpertEviction._stack_best)."},
    {"victim_search", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(victim_search)), METH_FASTCALL,
     "The victim search's loop over the layers (offtensor/moe/eviction.py: ExpertEviction.victim)."},
    {"cached_experts", cached_experts, METH_VARARGS,
     "A layer's experts cached whole in every stack (offtensor/moe/speculation.py: _cached_experts)."},
    {"expert_keys", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(expert_keys)), METH_FASTCALL,
     "The cache keys of experts in every stack of a layer (offtensor/moe/eviction.py: ExpertEviction.guard)."},
    {"decay_counts", decay_counts, METH_VARARGS,
     "Use counts decayed and the smallest dropped (offtensor/moe/eviction.py: ExpertEviction.decay)."},
    {"decay_counts_in_place", decay_counts_in_place, METH_VARARGS,
     "decay_counts, changing in place the floats only the dict holds (offtensor/moe/eviction.py: ExpertEviction.decay)."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

// The module's method table (PyInit__C in offtensor.cpp): this file's functions, then the guesses'.
PyMethodDef* policy_methods() {
  static std::vector<PyMethodDef> table = [] {
    std::vector<PyMethodDef> all;
    for (PyMethodDef* part : {kMethods, guess_methods(), record_methods(), bookkeeping_methods()})
      for (PyMethodDef* method = part; method->ml_name != nullptr; ++method) all.push_back(*method);
    all.push_back({nullptr, nullptr, 0, nullptr});
    return all;
  }();
  return table.data();
}

}  // namespace offtensor
