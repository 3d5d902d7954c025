// The victim search's reads of the interpreter's objects (csrc/eviction.cpp): a read-only view's
// dict, slot attributes at their offsets (csrc/slots.h, which the guesses' loops read and write
// through too), dict look-ups with one hash per key, and heapq's own
// steps on a list of records, each the same read the interpreter makes, without its generic path
// (an attribute through its class, a method call, tuples compared through the interpreter: 150 to
// 2,000 instructions each). Included by eviction.cpp and bookkeeping.cpp (its heap push): each gets its own copy.
#pragma once

#include <Python.h>
#include <structmember.h>

#include <utility>
#include <vector>

#include "pyref.h"
#include "slots.h"

namespace offtensor {
namespace {

// ---------------------------------------------------------------------------------------------
// Reading the policy's objects

// The mapping's dict a read-only view shows (types.MappingProxyType: the pager's copies and its
// copies by master) is the view's one referent, found through the view's traverse slot (its layout
// is the interpreter's own).
int take_referent(PyObject* referent, void* out) {
  *static_cast<PyObject**>(out) = referent;
  return 1;  // (the first is the only one)
}

bool plain_dict(PyObject* o) { return PyDict_CheckExact(o) || PyODict_CheckExact(o); }

// `mapping.get(key)`, key after key: a dict or OrderedDict (whose get is dict's) and the dict a
// read-only view shows read directly (a hash and a probe), any other mapping through its own get.
struct Lookup {
  PyObject* dict = nullptr;  // borrowed: the caller's argument holds it
  PyRef get;

  bool init(PyObject* mapping) {
    if (plain_dict(mapping)) {
      dict = mapping;
      return true;
    }
    if (Py_IS_TYPE(mapping, &PyDictProxy_Type)) {
      PyObject* shown = nullptr;
      Py_TYPE(mapping)->tp_traverse(mapping, take_referent, &shown);
      if (shown != nullptr && plain_dict(shown)) {
        dict = shown;
        return true;
      }
    }
    static PyObject* get_name = PyUnicode_InternFromString("get");
    get.p = PyObject_GetAttr(mapping, get_name);
    return get.p != nullptr;
  }

  // The value under `key` (whose hash is `hash`), or None: a new reference, or nullptr with an
  // exception set.
  PyObject* operator()(PyObject* key, Py_hash_t hash) const {
    if (dict == nullptr) return PyObject_CallOneArg(get.p, key);
    PyObject* value = _PyDict_GetItem_KnownHash(dict, key, hash);
    if (value != nullptr) return Py_NewRef(value);
    return PyErr_Occurred() ? nullptr : Py_NewRef(Py_None);
  }
};

// `obj.name` is truthy: 1, 0, or -1 with an exception set.
int slot_true(Slot& slot, PyObject* obj) {
  PyRef value(slot(obj));
  if (!value.p) return -1;
  if (value.p == Py_False || value.p == Py_None) return 0;
  return value.p == Py_True ? 1 : PyObject_IsTrue(value.p);
}

// A key is looked up in several dicts (the cache, last uses, use counts): hashed once (a cache key is
// a tuple of four, hashed item by item at every look-up), each dict probed with that hash.

// `mapping.get(key, fallback)` of a dict, as a double; -1 with an exception set on failure.
int get_double(PyObject* mapping, PyObject* key, Py_hash_t hash, double fallback, double* out) {
  PyObject* value = _PyDict_GetItem_KnownHash(mapping, key, hash);  // borrowed
  if (value == nullptr) {
    if (PyErr_Occurred()) return -1;
    *out = fallback;
    return 0;
  }
  *out = PyFloat_AsDouble(value);
  return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

// `last.get(key, -1)` as a new reference.
PyObject* tick_of(PyObject* last, PyObject* key, Py_hash_t hash) {
  PyObject* value = _PyDict_GetItem_KnownHash(last, key, hash);
  if (value != nullptr) return Py_NewRef(value);
  return PyErr_Occurred() ? nullptr : PyLong_FromLong(-1);
}

// `item in collection` (a set of keys or experts, where it is one): 1, 0 or -1.
int contains(PyObject* collection, PyObject* item) {
  return PyAnySet_Check(collection) ? PySet_Contains(collection, item) : PySequence_Contains(collection, item);
}

// An entry may be evicted here: no users, not an unused prefetch, not among `needed`. 1, 0 or -1.
int evictable(PyObject* entry, PyObject* key, PyObject* needed) {
  static Slot users("users"), prefetched("prefetched");
  int in_use = slot_true(users, entry);
  if (in_use != 0) return in_use < 0 ? -1 : 0;
  int unused = slot_true(prefetched, entry);
  if (unused != 0) return unused < 0 ? -1 : 0;
  if (needed != Py_None) {
    int kept = contains(needed, key);
    if (kept != 0) return kept < 0 ? -1 : 0;
  }
  return 1;
}

// `chances[e]` as a double (a list of chances, or any sequence); false with an exception set.
bool chance_at(PyObject* chances, Py_ssize_t e, double* out) {
  if (PyList_CheckExact(chances) && e >= 0 && e < PyList_GET_SIZE(chances)) {
    *out = PyFloat_AsDouble(PyList_GET_ITEM(chances, e));
  } else {
    PyRef chance(PySequence_GetItem(chances, e));
    if (!chance.p) return false;
    *out = PyFloat_AsDouble(chance.p);
  }
  return !(*out == -1.0 && PyErr_Occurred());
}

// ---------------------------------------------------------------------------------------------
// A stack's heap of use records (ColdHeaps: a list of (value, tick, expert[, key]) tuples, the
// coldest first), popped and pushed as the _heapq module pops and pushes, step for step (the list
// is arranged the same after each: Python's heappush adds to it), with records compared here where
// they hold what ColdHeaps puts in them (a float, then ints), as Python compares tuples: item by
// item, the first unequal pair decides (an item is equal to itself). Anything else, through the
// interpreter's comparison.

// `a < b`: 1, 0, or -1 with an exception set.
int record_less(PyObject* a, PyObject* b) {
  if (!PyTuple_CheckExact(a) || !PyTuple_CheckExact(b)) return PyObject_RichCompareBool(a, b, Py_LT);
  const Py_ssize_t na = PyTuple_GET_SIZE(a), nb = PyTuple_GET_SIZE(b);
  for (Py_ssize_t i = 0; i < na && i < nb; ++i) {
    PyObject *x = PyTuple_GET_ITEM(a, i), *y = PyTuple_GET_ITEM(b, i);
    if (x == y) continue;
    if (PyFloat_CheckExact(x) && PyFloat_CheckExact(y)) {
      const double dx = PyFloat_AS_DOUBLE(x), dy = PyFloat_AS_DOUBLE(y);
      if (dx == dy) continue;
      return dx < dy;  // (a NaN: unequal and not less, as Python's)
    }
    if (PyLong_CheckExact(x) && PyLong_CheckExact(y)) {
      int x_over = 0, y_over = 0;
      const long long lx = PyLong_AsLongLongAndOverflow(x, &x_over), ly = PyLong_AsLongLongAndOverflow(y, &y_over);
      if (!x_over && !y_over) {
        if (lx == ly) continue;
        return lx < ly;
      }
    }
    const int equal = PyObject_RichCompareBool(x, y, Py_EQ);
    if (equal != 0) {
      if (equal < 0) return -1;
      continue;
    }
    return PyObject_RichCompareBool(x, y, Py_LT);
  }
  return na < nb;
}

// A comparison through the interpreter may have changed the list: as _heapq, refuse to go on.
bool same_size(PyObject* heap, Py_ssize_t size) {
  if (PyList_GET_SIZE(heap) == size) return true;
  PyErr_SetString(PyExc_RuntimeError, "list changed size during iteration");
  return false;
}

// _heapq's siftdown: the item at `pos` moved towards `start` while it is less than its parent.
bool sift_down(PyObject* heap, Py_ssize_t start, Py_ssize_t pos) {
  const Py_ssize_t size = PyList_GET_SIZE(heap);
  while (pos > start) {
    const Py_ssize_t parent = (pos - 1) >> 1;
    PyObject **items = &PyList_GET_ITEM(heap, 0), *item = items[pos], *above = items[parent];
    Py_INCREF(item);
    Py_INCREF(above);
    const int less = record_less(item, above);
    Py_DECREF(above);
    Py_DECREF(item);
    if (less < 0 || !same_size(heap, size)) return false;
    if (!less) break;
    items = &PyList_GET_ITEM(heap, 0);
    std::swap(items[parent], items[pos]);
    pos = parent;
  }
  return true;
}

// _heapq's siftup: the smaller child moved up from `pos` to a leaf, then the item sifted down.
bool sift_up(PyObject* heap, Py_ssize_t pos) {
  const Py_ssize_t size = PyList_GET_SIZE(heap), start = pos, limit = size >> 1;
  while (pos < limit) {
    Py_ssize_t child = 2 * pos + 1;
    if (child + 1 < size) {
      PyObject *left = PyList_GET_ITEM(heap, child), *right = PyList_GET_ITEM(heap, child + 1);
      Py_INCREF(left);
      Py_INCREF(right);
      const int less = record_less(left, right);
      Py_DECREF(right);
      Py_DECREF(left);
      if (less < 0 || !same_size(heap, size)) return false;
      child += less ? 0 : 1;
    }
    PyObject** items = &PyList_GET_ITEM(heap, 0);
    std::swap(items[child], items[pos]);
    pos = child;
  }
  return sift_down(heap, start, pos);
}

// heapq.heappop(heap): a new reference, or nullptr with an exception set.
PyObject* heap_pop(PyObject* heap) {
  const Py_ssize_t size = PyList_GET_SIZE(heap);
  if (size == 0) {
    PyErr_SetString(PyExc_IndexError, "index out of range");
    return nullptr;
  }
  PyObject* last = Py_NewRef(PyList_GET_ITEM(heap, size - 1));
  if (PyList_SetSlice(heap, size - 1, size, nullptr) < 0) {
    Py_DECREF(last);
    return nullptr;
  }
  if (size == 1) return last;
  PyObject* first = PyList_GET_ITEM(heap, 0);  // (the list's reference, now ours)
  PyList_SET_ITEM(heap, 0, last);
  if (!sift_up(heap, 0)) {
    Py_DECREF(first);
    return nullptr;
  }
  return first;
}

// heapq.heappush(heap, item); false with an exception set.
bool heap_push(PyObject* heap, PyObject* item) {
  return PyList_Append(heap, item) == 0 && sift_down(heap, 0, PyList_GET_SIZE(heap) - 1);
}

}  // namespace
}  // namespace offtensor
