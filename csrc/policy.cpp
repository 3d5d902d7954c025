// The expert policy's inner loops (offtensor/moe): plain functions of the extension module
// `offtensor._C` on the interpreter's own objects, each the interpreter's code step by step in the
// same double arithmetic and order, so the policy decides the same with or without them; Python
// reaches them through offtensor._ext.native_function. Apart from offtensor.cpp because they need
// only Python's headers, not ATen's: this file compiles in seconds.
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace offtensor {
namespace {

// A Python reference owned here (the plain functions below work on the interpreter's objects).
struct PyRef {
  PyObject* p = nullptr;
  PyRef() = default;
  explicit PyRef(PyObject* o) : p(o) {}
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  ~PyRef() { Py_XDECREF(p); }
  PyObject* release() { PyObject* o = p; p = nullptr; return o; }
};

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
// The expert eviction's ranking of one stack (offtensor/moe/eviction.py: ExpertEviction._stack_best
// with _coldest_of and ColdHeaps.coldest), the victim search's inner step: the interpreter's code
// step by step, in the same double arithmetic and order and with the same heap operations (the
// _heapq module's own), so the same copy is found; without the interpreter's per-step cost, the
// largest part of a victim search. Python objects throughout: a reference owned is a PyRef.

// `obj.name` is truthy: 1, 0, or -1 with an exception set.
int attr_true(PyObject* obj, PyObject* name) {
  PyRef value(PyObject_GetAttr(obj, name));
  return value.p ? PyObject_IsTrue(value.p) : -1;
}

// `mapping.get(key, fallback)` as a double; -1 with an exception set on failure.
int get_double(PyObject* mapping, PyObject* key, double fallback, double* out) {
  PyObject* value = PyDict_GetItemWithError(mapping, key);  // borrowed
  if (value == nullptr) {
    if (PyErr_Occurred()) return -1;
    *out = fallback;
    return 0;
  }
  *out = PyFloat_AsDouble(value);
  return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

// `last.get(key, -1)` as a new reference.
PyObject* tick_of(PyObject* last, PyObject* key) {
  PyObject* value = PyDict_GetItemWithError(last, key);
  if (value != nullptr) return Py_NewRef(value);
  return PyErr_Occurred() ? nullptr : PyLong_FromLong(-1);
}

// An entry may be evicted here: no users, not an unused prefetch, not among `needed`. 1, 0 or -1.
int evictable(PyObject* entry, PyObject* key, PyObject* needed) {
  static PyObject* users = PyUnicode_InternFromString("users");
  static PyObject* prefetched = PyUnicode_InternFromString("prefetched");
  int in_use = attr_true(entry, users);
  if (in_use != 0) return in_use < 0 ? -1 : 0;
  int unused = attr_true(entry, prefetched);
  if (unused != 0) return unused < 0 ? -1 : 0;
  if (needed != Py_None) {
    int kept = PySequence_Contains(needed, key);
    if (kept != 0) return kept < 0 ? -1 : 0;
  }
  return 1;
}

// The pager's copies come as a read-only view of its dict: looked up through its own get.
PyObject* getter_of(PyObject* mapping) {
  static PyObject* get_name = PyUnicode_InternFromString("get");
  return PyObject_GetAttr(mapping, get_name);
}

PyObject* rank_stack(PyObject* heap, PyObject* keys, PyRef& cache_get, PyObject* last, PyObject* frequency,
                     PyObject* needed, PyObject* recent, PyObject* chances, long long count, double reuse,
                     double per_turn, double unseen);

PyObject* stack_best(PyObject*, PyObject* args) {
  PyObject *heap, *keys, *cache, *last, *frequency, *needed, *recent, *chances;
  long long count;
  double reuse, per_turn, unseen;
  if (!PyArg_ParseTuple(args, "OO!OO!O!OOOLddd", &heap, &PyTuple_Type, &keys, &cache, &PyDict_Type, &last,
                        &PyDict_Type, &frequency, &needed, &recent, &chances, &count, &reuse, &per_turn, &unseen))
    return nullptr;
  PyRef cache_get(getter_of(cache));
  if (!cache_get.p) return nullptr;
  return rank_stack(heap, keys, cache_get, last, frequency, needed, recent, chances, count, reuse, per_turn, unseen);
}

PyObject* rank_stack(PyObject* heap, PyObject* keys, PyRef& cache_get, PyObject* last, PyObject* frequency,
                     PyObject* needed, PyObject* recent, PyObject* chances, long long count, double reuse,
                     double per_turn, double unseen) {
  static PyObject* heapq = PyImport_ImportModule("_heapq");
  if (heapq == nullptr) return nullptr;
  static PyObject* heappop = PyObject_GetAttrString(heapq, "heappop");
  static PyObject* heappush = PyObject_GetAttrString(heapq, "heappush");
  if (heappop == nullptr || heappush == nullptr) return nullptr;
  const Py_ssize_t experts = PyTuple_GET_SIZE(keys);
  const bool predicted = chances != Py_None;

  // 1. Of the experts routed at the layer's last turn (or its likeliest next), the least used.
  PyRef routed_ref;  // the least used of them (owned)
  PyObject* routed_key = nullptr;
  long routed_e = -1;
  double routed_rank = 0.0;
  {
    PyRef it(PyObject_GetIter(recent));
    if (!it.p) return nullptr;
    while (PyObject* item = PyIter_Next(it.p)) {
      PyRef e_obj(item);
      const long e = PyLong_AsLong(item);
      if (e == -1 && PyErr_Occurred()) return nullptr;
      if (e < 0 || e >= experts) {
        PyErr_Format(PyExc_IndexError, "offtensor: expert %ld of a stack of %zd", e, experts);
        return nullptr;
      }
      PyObject* key = PyTuple_GET_ITEM(keys, e);
      PyRef found(PyObject_CallOneArg(cache_get.p, key));
      if (!found.p) return nullptr;
      if (found.p == Py_None) continue;
      PyObject* entry = found.p;
      const int ok = evictable(entry, key, needed);
      if (ok < 0) return nullptr;
      if (!ok) continue;
      double rank;
      if (get_double(frequency, key, 0.0, &rank) < 0) return nullptr;
      if (predicted) {
        PyObject* chance_obj = PySequence_GetItem(chances, e);
        if (chance_obj == nullptr) return nullptr;
        const double chance = PyFloat_AsDouble(chance_obj);
        Py_DECREF(chance_obj);
        if (chance == -1.0 && PyErr_Occurred()) return nullptr;
        rank *= per_turn;
        rank = (chance - 1.0) / (rank < unseen ? unseen : rank > 1.0 ? 1.0 : rank);
      }
      bool better = routed_ref.p == nullptr || rank < routed_rank;
      if (!better && rank == routed_rank) {  // ties to the older use
        PyRef mine(tick_of(last, key)), theirs(tick_of(last, routed_key));
        if (!mine.p || !theirs.p) return nullptr;
        const int older = PyObject_RichCompareBool(mine.p, theirs.p, Py_LT);
        if (older < 0) return nullptr;
        better = older;
      }
      if (better) {
        Py_XDECREF(routed_ref.p);
        routed_ref.p = found.release();
        routed_key = key, routed_e = e, routed_rank = rank;
      }
    }
    if (PyErr_Occurred()) return nullptr;
  }

  // 2. The least used evictable copy off the stack's heap of use records (ColdHeaps.coldest).
  PyRef cold_ref, cold_key;
  long cold_e = -1;
  if (heap != Py_None && PyList_Check(heap)) {
    PyRef aside(PyList_New(0));
    if (!aside.p) return nullptr;
    bool failed = false;
    while (PyList_GET_SIZE(heap) > 0) {
      PyObject* record = PyList_GET_ITEM(heap, 0);  // borrowed
      if (!PyTuple_Check(record) || PyTuple_GET_SIZE(record) < 3) {
        PyErr_SetString(PyExc_TypeError, "offtensor: a coldness record is (value, tick, expert[, key])");
        failed = true;
        break;
      }
      const long e = PyLong_AsLong(PyTuple_GET_ITEM(record, 2));
      if (e == -1 && PyErr_Occurred()) { failed = true; break; }
      PyObject* key;
      if (PyTuple_GET_SIZE(record) == 3) {
        if (e < 0 || e >= experts) {
          PyErr_Format(PyExc_IndexError, "offtensor: expert %ld of a stack of %zd", e, experts);
          failed = true;
          break;
        }
        key = PyTuple_GET_ITEM(keys, e);
      } else {
        key = PyTuple_GET_ITEM(record, 3);
      }
      PyRef record_ref(Py_NewRef(record));  // (which holds the key)
      PyRef entry_ref(PyObject_CallOneArg(cache_get.p, key));
      if (!entry_ref.p) { failed = true; break; }
      PyObject* entry = entry_ref.p == Py_None ? nullptr : entry_ref.p;
      int stale = entry == nullptr;
      if (!stale) {
        PyObject* tick = PyDict_GetItemWithError(last, key);
        if (tick == nullptr && PyErr_Occurred()) { failed = true; break; }
        stale = PyObject_RichCompareBool(tick ? tick : Py_None, PyTuple_GET_ITEM(record, 1), Py_NE);
        if (stale < 0) { failed = true; break; }
      }
      PyRef popped(PyObject_CallOneArg(heappop, heap));
      if (!popped.p) { failed = true; break; }
      if (stale) continue;  // evicted, or used or copied again since
      if (PyList_Append(aside.p, record_ref.p) < 0) { failed = true; break; }
      int ok = evictable(entry, key, needed);
      if (ok > 0) {
        const int routed_last = PySequence_Contains(recent, PyTuple_GET_ITEM(record_ref.p, 2));
        ok = routed_last < 0 ? -1 : !routed_last;
      }
      if (ok < 0) { failed = true; break; }
      if (ok) {
        cold_ref.p = entry_ref.release();
        cold_key.p = Py_NewRef(key);
        cold_e = e;
        break;
      }
    }
    // The records looked at go back, whatever happened (an error leaves the heap as whole as it can).
    PyObject *type, *value, *traceback;
    if (failed) PyErr_Fetch(&type, &value, &traceback);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(aside.p); ++i) {
      PyRef pushed(PyObject_CallFunctionObjArgs(heappush, heap, PyList_GET_ITEM(aside.p, i), nullptr));
      if (!pushed.p && !failed) return nullptr;
      if (!pushed.p) PyErr_Clear();
    }
    if (failed) {
      PyErr_Restore(type, value, traceback);
      return nullptr;
    }
  }

  // 3. Of the two, the one whose next use is expected furthest away (ties to the older use).
  PyObject* candidates[2] = {routed_ref.p, cold_ref.p};
  PyObject* candidate_keys[2] = {routed_key, cold_key.p};  // (each its entry's key, as the entry was found by)
  const long indexes[2] = {routed_e, cold_e};
  const bool recents[2] = {!predicted, false};
  PyRef best;
  double best_wait = 0.0;
  PyRef best_tie;
  for (int c = 0; c < 2; ++c) {
    PyObject* entry = candidates[c];
    if (entry == nullptr) continue;
    PyObject* key = candidate_keys[c];
    double frequency_of;
    if (get_double(frequency, key, 0.0, &frequency_of) < 0) return nullptr;
    double q = frequency_of * per_turn;
    q = q < unseen ? unseen : q;  // max(q, unseen)
    q = 1.0 < q ? 1.0 : q;        // min(1.0, q)
    double p;
    if (predicted) {
      PyObject* chance_obj = PySequence_GetItem(chances, indexes[c]);
      if (chance_obj == nullptr) return nullptr;
      p = PyFloat_AsDouble(chance_obj);
      Py_DECREF(chance_obj);
      if (p == -1.0 && PyErr_Occurred()) return nullptr;
    } else {
      p = recents[c] ? (reuse > q ? reuse : q) : q;  // max(q, reuse)
    }
    const double wait = 0.0 + (1.0 - p) * static_cast<double>(count) / q;
    PyRef tick(tick_of(last, key));
    if (!tick.p) return nullptr;
    PyRef tie(PyNumber_Negative(tick.p));
    if (!tie.p) return nullptr;
    bool better = best.p == nullptr || wait > best_wait;
    if (!better && wait == best_wait) {
      const int later = PyObject_RichCompareBool(tie.p, best_tie.p, Py_GT);
      if (later < 0) return nullptr;
      better = later;
    }
    if (better) {
      Py_XDECREF(best.p);
      best.p = Py_NewRef(entry);
      best_wait = wait;
      Py_XDECREF(best_tie.p);
      best_tie.p = tie.release();
    }
  }
  if (best.p == nullptr) Py_RETURN_NONE;
  PyRef wait_obj(PyFloat_FromDouble(best_wait));
  if (!wait_obj.p) return nullptr;
  return PyTuple_Pack(3, wait_obj.p, best_tie.p, best.p);
}

// ---------------------------------------------------------------------------------------------
// The victim search's loop over the layers (offtensor/moe/eviction.py: ExpertEviction.victim, with
// _best_of and _stack_best): each stale layer's best candidate found anew (each changed stack
// ranked by rank_stack, the others' kept bests reused), every layer's best wait compared, and a
// pick no longer cached or evictable sends its layer to be ranked anew, as there, on the policy's
// own objects (KeptBest's lists, sets and dicts are updated in place).

struct VictimSearch {
  PyObject *groups, *stacks_of, *bests, *stale, *dirty, *of_stack, *needed, *chances_of,
      *likely_of, *guarded, *position, *heaps, *last, *frequency, *reuse_of, *ran;
  PyRef cache_get, cached_get;
  long long count, here;
  double reuse_prior, per_turn, unseen;
};

// `(where - here) % count or count`, or 0.5 for a layer not placed (eviction._distance).
bool layer_distance(const VictimSearch& v, PyObject* where, double* out) {
  if (where == nullptr || where == Py_None) {
    *out = 0.5;
    return true;
  }
  const long long w = PyLong_AsLongLong(where);
  if (w == -1 && PyErr_Occurred()) return false;
  if (v.count == 0) {
    PyErr_SetString(PyExc_ZeroDivisionError, "integer modulo by zero");
    return false;
  }
  long long d = (w - v.here) % v.count;
  if (d < 0) d += v.count;  // (Python's modulo takes the divisor's sign)
  *out = static_cast<double>(d ? d : v.count);
  return true;
}

// One stack's best candidate (ExpertEviction._stack_best), a new reference or None.
PyObject* stack_candidate(VictimSearch& v, PyObject* stack, PyObject* keep) {
  static PyObject* master_name = PyUnicode_InternFromString("master_id");
  static PyObject* group_name = PyUnicode_InternFromString("group");
  static PyObject* keys_name = PyUnicode_InternFromString("keys");
  static PyObject* used_name = PyUnicode_InternFromString("used");
  static PyObject* last_used_name = PyUnicode_InternFromString("last_used");
  PyRef master(PyObject_GetAttr(stack, master_name));
  if (!master.p) return nullptr;
  PyRef entries(PyObject_CallOneArg(v.cached_get.p, master.p));
  if (!entries.p) return nullptr;
  const int any = PyObject_IsTrue(entries.p);
  if (any <= 0) return any < 0 ? nullptr : Py_NewRef(Py_None);
  PyRef group(PyObject_GetAttr(stack, group_name));
  if (!group.p) return nullptr;
  PyObject* chances = PyDict_GetItemWithError(v.chances_of, group.p);  // borrowed
  if (chances == nullptr && PyErr_Occurred()) return nullptr;
  PyRef recent;
  if (chances == nullptr) {
    chances = Py_None;
    const int ran = PySet_Contains(v.ran, group.p);
    if (ran < 0) return nullptr;
    recent.p = PyObject_GetAttr(stack, ran ? used_name : last_used_name);
  } else {
    PyObject* likely = PyDict_GetItemWithError(v.likely_of, group.p);
    if (likely == nullptr && PyErr_Occurred()) return nullptr;
    recent.p = Py_NewRef(likely ? likely : Py_None);
  }
  if (!recent.p) return nullptr;
  double reuse = v.reuse_prior;
  if (get_double(v.reuse_of, group.p, v.reuse_prior, &reuse) < 0) return nullptr;
  PyObject* heap = PyDict_GetItemWithError(v.heaps, master.p);
  if (heap == nullptr && PyErr_Occurred()) return nullptr;
  PyRef keys(PyObject_GetAttr(stack, keys_name));
  if (!keys.p) return nullptr;
  if (!PyTuple_Check(keys.p)) {
    PyErr_SetString(PyExc_TypeError, "offtensor: a stack's keys are a tuple");
    return nullptr;
  }
  return rank_stack(heap ? heap : Py_None, keys.p, v.cache_get, v.last, v.frequency, keep, recent.p, chances, v.count,
                    reuse, v.per_turn, v.unseen);
}

// `found[:2] > best[:2]`: 1, 0 or -1.
int ranks_above(PyObject* found, PyObject* best) {
  const int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(found, 0), PyTuple_GET_ITEM(best, 0), Py_EQ);
  if (same < 0) return -1;
  const int i = same ? 1 : 0;
  return PyObject_RichCompareBool(PyTuple_GET_ITEM(found, i), PyTuple_GET_ITEM(best, i), Py_GT);
}

// A layer's best candidate over its stacks (ExpertEviction._best_of), a new reference or None.
PyObject* layer_candidate(VictimSearch& v, PyObject* stacks, PyObject* keep) {
  if (!PyList_Check(stacks)) {
    PyErr_SetString(PyExc_TypeError, "offtensor: a layer's stacks are a list");
    return nullptr;
  }
  PyRef best(Py_NewRef(Py_None));
  for (Py_ssize_t j = 0; j < PyList_GET_SIZE(stacks); ++j) {
    PyObject* stack = PyList_GET_ITEM(stacks, j);
    const int changed = PySet_Contains(v.dirty, stack);
    if (changed < 0) return nullptr;
    PyRef found;
    if (changed) {
      found.p = stack_candidate(v, stack, keep);
      if (!found.p || PyDict_SetItem(v.of_stack, stack, found.p) < 0 || PySet_Discard(v.dirty, stack) < 0)
        return nullptr;
    } else {
      found.p = PyObject_GetItem(v.of_stack, stack);
      if (!found.p) return nullptr;
    }
    if (found.p == Py_None) continue;
    if (!PyTuple_Check(found.p) || PyTuple_GET_SIZE(found.p) < 3) {
      PyErr_SetString(PyExc_TypeError, "offtensor: a kept candidate is (wait, tie-break, copy)");
      return nullptr;
    }
    int above = 1;
    if (best.p != Py_None && (above = ranks_above(found.p, best.p)) < 0) return nullptr;
    if (above) {
      Py_DECREF(best.p);
      best.p = found.release();
    }
  }
  return best.release();
}

// Every stack of the layer at `i` to be ranked anew (KeptBest.dirty).
bool mark_dirty(VictimSearch& v, Py_ssize_t i) {
  PyRef it(PyObject_GetIter(PyList_GET_ITEM(v.stacks_of, i)));
  if (!it.p) return false;
  while (PyObject* stack = PyIter_Next(it.p)) {
    PyRef held(stack);
    if (PySet_Add(v.dirty, stack) < 0) return false;
  }
  return !PyErr_Occurred();
}

// KeptBest.changed of the layer at `i`: stale, every stack of it to be ranked anew.
bool mark_changed(VictimSearch& v, Py_ssize_t i) {
  return PyList_SetItem(v.stale, i, Py_NewRef(Py_True)) == 0 && mark_dirty(v, i);
}

PyObject* victim_search(PyObject*, PyObject* args) {
  VictimSearch v{};
  PyObject *kept, *cache, *cached, *current, *here_obj;
  if (!PyArg_ParseTuple(args, "OOOOOO!O!O!O!OLO!O!O!O!dO!dd", &kept, &cache, &cached, &current, &v.needed,
                        &PyDict_Type, &v.chances_of, &PyDict_Type, &v.likely_of, &PyDict_Type, &v.guarded,
                        &PyDict_Type, &v.position, &here_obj, &v.count, &PyDict_Type, &v.heaps, &PyDict_Type,
                        &v.last, &PyDict_Type, &v.frequency, &PyDict_Type, &v.reuse_of, &v.reuse_prior,
                        &PySet_Type, &v.ran, &v.per_turn, &v.unseen))
    return nullptr;
  static PyObject* groups_name = PyUnicode_InternFromString("groups");
  static PyObject* stacks_name = PyUnicode_InternFromString("stacks");
  static PyObject* best_name = PyUnicode_InternFromString("best");
  static PyObject* stale_name = PyUnicode_InternFromString("stale");
  static PyObject* dirty_name = PyUnicode_InternFromString("dirty");
  static PyObject* of_stack_name = PyUnicode_InternFromString("of_stack");
  static PyObject* current_name = PyUnicode_InternFromString("current");
  static PyObject* key_name = PyUnicode_InternFromString("key");
  PyRef groups(PyObject_GetAttr(kept, groups_name)), stacks_of(PyObject_GetAttr(kept, stacks_name)),
      bests(PyObject_GetAttr(kept, best_name)), stale(PyObject_GetAttr(kept, stale_name)),
      dirty(PyObject_GetAttr(kept, dirty_name)), of_stack(PyObject_GetAttr(kept, of_stack_name));
  if (!groups.p || !stacks_of.p || !bests.p || !stale.p || !dirty.p || !of_stack.p) return nullptr;
  const Py_ssize_t layers = PyList_Check(groups.p) ? PyList_GET_SIZE(groups.p) : -1;
  if (layers < 0 || !PyList_Check(stacks_of.p) || !PyList_Check(bests.p) || !PyList_Check(stale.p) ||
      PyList_GET_SIZE(stacks_of.p) != layers || PyList_GET_SIZE(bests.p) != layers ||
      PyList_GET_SIZE(stale.p) != layers || !PySet_Check(dirty.p) || !PyDict_Check(of_stack.p)) {
    PyErr_SetString(PyExc_TypeError, "offtensor: KeptBest's groups, stacks, best and stale are lists of one length");
    return nullptr;
  }
  v.groups = groups.p, v.stacks_of = stacks_of.p, v.bests = bests.p, v.stale = stale.p;
  v.dirty = dirty.p, v.of_stack = of_stack.p;
  v.here = PyLong_AsLongLong(here_obj);
  if (v.here == -1 && PyErr_Occurred()) return nullptr;
  v.cache_get.p = getter_of(cache);
  v.cached_get.p = getter_of(cached);
  if (!v.cache_get.p || !v.cached_get.p) return nullptr;
  while (true) {
    PyObject* best = nullptr;  // borrowed from its layer's kept best
    PyObject* best_tie = nullptr;
    double best_wait = 0.0;
    Py_ssize_t best_i = -1;
    for (Py_ssize_t i = 0; i < layers; ++i) {
      PyObject* group = PyList_GET_ITEM(v.groups, i);
      const int is_current = PyObject_RichCompareBool(group, current, Py_EQ);
      if (is_current < 0) return nullptr;
      const int stale_now = PyObject_IsTrue(PyList_GET_ITEM(v.stale, i));
      if (stale_now < 0) return nullptr;
      double distance;
      if (is_current) {
        if (v.needed == Py_None) continue;  // the op did not say what it pages: any of the layer's may be next
        PyObject* chances = PyDict_GetItemWithError(v.chances_of, group);
        if (chances == nullptr && PyErr_Occurred()) return nullptr;
        chances = chances ? chances : Py_None;
        PyRef with(PyObject_GetAttr(kept, current_name));
        if (!with.p) return nullptr;
        int ranked_with = 0;
        if (with.p != Py_None && PyTuple_Check(with.p) && PyTuple_GET_SIZE(with.p) == 3) {
          ranked_with = PyObject_RichCompareBool(PyTuple_GET_ITEM(with.p, 0), group, Py_EQ);
          if (ranked_with < 0) return nullptr;
          ranked_with = ranked_with && PyTuple_GET_ITEM(with.p, 1) == v.needed && PyTuple_GET_ITEM(with.p, 2) == chances;
        }
        if (!ranked_with && !mark_dirty(v, i)) return nullptr;  // ranked keeping other keys, or other chances: anew
        if (stale_now || !ranked_with) {
          PyObject* found = layer_candidate(v, PyList_GET_ITEM(v.stacks_of, i), v.needed);
          if (!found || PyList_SetItem(v.bests, i, found) < 0) return nullptr;
          if (PyList_SetItem(v.stale, i, Py_NewRef(Py_False)) < 0) return nullptr;
          PyRef now(PyTuple_Pack(3, group, v.needed, chances));
          if (!now.p || PyObject_SetAttr(kept, current_name, now.p) < 0) return nullptr;
        }
        distance = static_cast<double>(v.count);
      } else {
        if (stale_now) {
          PyObject* keep = PyDict_GetItemWithError(v.guarded, group);
          if (keep == nullptr && PyErr_Occurred()) return nullptr;
          PyObject* found = layer_candidate(v, PyList_GET_ITEM(v.stacks_of, i), keep ? keep : Py_None);
          if (!found || PyList_SetItem(v.bests, i, found) < 0) return nullptr;
          if (PyList_SetItem(v.stale, i, Py_NewRef(Py_False)) < 0) return nullptr;
        }
        PyObject* where = PyDict_GetItemWithError(v.position, group);
        if (where == nullptr && PyErr_Occurred()) return nullptr;
        if (!layer_distance(v, where, &distance)) return nullptr;
      }
      PyObject* found = PyList_GET_ITEM(v.bests, i);
      if (found == Py_None) continue;
      if (!PyTuple_Check(found) || PyTuple_GET_SIZE(found) < 3) {
        PyErr_SetString(PyExc_TypeError, "offtensor: a kept candidate is (wait, tie-break, copy)");
        return nullptr;
      }
      const double own = PyFloat_AsDouble(PyTuple_GET_ITEM(found, 0));
      if (own == -1.0 && PyErr_Occurred()) return nullptr;
      const double wait = distance + own;
      bool better = best == nullptr || wait > best_wait;
      if (!better && wait == best_wait) {
        const int later = PyObject_RichCompareBool(PyTuple_GET_ITEM(found, 1), best_tie, Py_GT);
        if (later < 0) return nullptr;
        better = later;
      }
      if (better) best = PyTuple_GET_ITEM(found, 2), best_tie = PyTuple_GET_ITEM(found, 1), best_wait = wait, best_i = i;
    }
    if (best == nullptr) Py_RETURN_NONE;
    PyRef held(Py_NewRef(best));  // (its layer's kept best may be replaced below)
    PyRef key(PyObject_GetAttr(best, key_name));
    if (!key.p) return nullptr;
    PyRef now(PyObject_CallOneArg(v.cache_get.p, key.p));
    if (!now.p) return nullptr;
    const int usable = now.p == best ? evictable(best, key.p, Py_None) : 0;
    if (usable < 0) return nullptr;
    if (usable) {
      PyRef wait_obj(PyFloat_FromDouble(best_wait));
      if (!wait_obj.p) return nullptr;
      return PyTuple_Pack(2, best, wait_obj.p);
    }
    if (!mark_changed(v, best_i)) return nullptr;  // its kept best left the cache or is in use: rank the layer anew
  }
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
PyObject* decay_counts(PyObject*, PyObject* args) {
  PyObject* counts;
  double factor, floor;
  if (!PyArg_ParseTuple(args, "O!dd", &PyDict_Type, &counts, &factor, &floor)) return nullptr;
  PyRef dropped(PyList_New(0));
  if (!dropped.p) return nullptr;
  Py_ssize_t pos = 0;
  PyObject *key, *value;
  while (PyDict_Next(counts, &pos, &key, &value)) {
    const double old = PyFloat_AsDouble(value);
    if (old == -1.0 && PyErr_Occurred()) return nullptr;
    const double now = old * factor;
    if (now < floor) {
      if (PyList_Append(dropped.p, key) < 0) return nullptr;
      continue;
    }
    PyRef updated(PyFloat_FromDouble(now));
    if (!updated.p || PyDict_SetItem(counts, key, updated.p) < 0) return nullptr;
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(dropped.p); ++i)
    if (PyDict_DelItem(counts, PyList_GET_ITEM(dropped.p, i)) < 0) return nullptr;
  Py_RETURN_NONE;
}

// decay_counts without a new float or a dict store per count: a count's float that only the dict
// holds (the usual case: ExpertEviction.used stores the sum it made) is changed in place, as the
// interpreter's own float arithmetic reuses an operand only it holds; any other value is replaced
// through the dict as decay_counts does. The same values, bit for bit, in the same order; no key's
// hash is computed again. (Free-threaded builds, whose reference counts another thread may change
// under the walk, always replace.)
PyObject* decay_counts_in_place(PyObject*, PyObject* args) {
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
    if (PyFloat_CheckExact(value) && Py_REFCNT(value) == 1) {
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

PyMethodDef kMethods[] = {
    {"guess_rows", guess_rows, METH_VARARGS,
     "The host side of a routing guess on rows of scores (offtensor/moe/guesses.py: host_guess)."},
    {"chance_rows", chance_rows, METH_VARARGS,
     "A next-token map's chances on rows of logits (offtensor/moe/guesses.py: host_chances)."},
    {"stack_best", stack_best, METH_VARARGS,
     "The expert eviction's ranking of one stack (offtensor/moe/eviction.py: ExpertEviction._stack_best)."},
    {"victim_search", victim_search, METH_VARARGS,
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
