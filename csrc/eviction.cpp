// The expert eviction's victim search (offtensor/moe/eviction.py: ExpertEviction.victim's loop over
// the layers, _best_of, and _stack_best with _coldest_of and ColdHeaps.coldest): the interpreter's
// code step by step, in the same double arithmetic and order and with the same heap operations, on
// the policy's own objects, so the same copy is found with or without it. Plain functions of the
// extension module (csrc/policy.cpp's method table), apart from policy.cpp's other loops because of
// what a search costs: a few dozen copies looked at, each a handful of reads of the interpreter's
// objects, so most of a search went to generic reads (an attribute through its class, a method
// call, a heap step comparing tuples through the interpreter: 150 to 2,000 instructions each) and
// csrc/policy_objects.h has its own cheaper ways to make them, each the same read.
#include <Python.h>
#include <structmember.h>

#include <initializer_list>
#include <utility>
#include <vector>

#include "policy_objects.h"
#include "pyref.h"

namespace offtensor {
namespace {

// ---------------------------------------------------------------------------------------------
// One stack's ranking (ExpertEviction._stack_best with _coldest_of and ColdHeaps.coldest).

// What every ranking of a search reads alike.
struct Ranking {
  Lookup cache;  // the pager's copies by key
  PyObject *last, *frequency;  // key -> tick of its last use, key -> its decayed use count
  long long count;
  double per_turn, unseen;
};

PyObject* rank_stack(const Ranking& r, PyObject* heap, PyObject* keys, PyObject* needed, PyObject* recent,
                     PyObject* chances, double reuse) {
  const Py_ssize_t experts = PyTuple_GET_SIZE(keys);
  const bool predicted = chances != Py_None;

  // 1. Of the experts routed at the layer's last turn (or its likeliest next), the least used.
  PyRef routed_ref;  // the least used of them (owned)
  PyObject* routed_key = nullptr;
  Py_hash_t routed_hash = -1;
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
      const Py_hash_t hash = PyObject_Hash(key);
      if (hash == -1) return nullptr;
      PyRef found(r.cache(key, hash));
      if (!found.p) return nullptr;
      if (found.p == Py_None) continue;
      const int ok = evictable(found.p, key, needed);
      if (ok < 0) return nullptr;
      if (!ok) continue;
      double rank;
      if (get_double(r.frequency, key, hash, 0.0, &rank) < 0) return nullptr;
      if (predicted) {
        double chance;
        if (!chance_at(chances, e, &chance)) return nullptr;
        rank *= r.per_turn;
        rank = (chance - 1.0) / (rank < r.unseen ? r.unseen : rank > 1.0 ? 1.0 : rank);
      }
      bool better = routed_ref.p == nullptr || rank < routed_rank;
      if (!better && rank == routed_rank) {  // ties to the older use
        PyRef mine(tick_of(r.last, key, hash)), theirs(tick_of(r.last, routed_key, routed_hash));
        if (!mine.p || !theirs.p) return nullptr;
        const int older = PyObject_RichCompareBool(mine.p, theirs.p, Py_LT);
        if (older < 0) return nullptr;
        better = older;
      }
      if (better) {
        Py_XDECREF(routed_ref.p);
        routed_ref.p = found.release();
        routed_key = key, routed_hash = hash, routed_e = e, routed_rank = rank;
      }
    }
    if (PyErr_Occurred()) return nullptr;
  }

  // 2. The least used evictable copy off the stack's heap of use records (ColdHeaps.coldest).
  PyRef cold_ref, cold_key;
  Py_hash_t cold_hash = -1;
  long cold_e = -1;
  if (heap != Py_None && PyList_Check(heap)) {
    std::vector<PyObject*> aside;  // records popped to be pushed back (owned)
    bool failed = false;
    while (PyList_GET_SIZE(heap) > 0) {
      PyRef record(Py_NewRef(PyList_GET_ITEM(heap, 0)));  // (which holds the key)
      if (!PyTuple_Check(record.p) || PyTuple_GET_SIZE(record.p) < 3) {
        PyErr_SetString(PyExc_TypeError, "offtensor: a coldness record is (value, tick, expert[, key])");
        failed = true;
        break;
      }
      const long e = PyLong_AsLong(PyTuple_GET_ITEM(record.p, 2));
      if (e == -1 && PyErr_Occurred()) { failed = true; break; }
      PyObject* key;
      if (PyTuple_GET_SIZE(record.p) == 3) {
        if (e < 0 || e >= experts) {
          PyErr_Format(PyExc_IndexError, "offtensor: expert %ld of a stack of %zd", e, experts);
          failed = true;
          break;
        }
        key = PyTuple_GET_ITEM(keys, e);
      } else {
        key = PyTuple_GET_ITEM(record.p, 3);
      }
      const Py_hash_t hash = PyObject_Hash(key);
      if (hash == -1) { failed = true; break; }
      PyRef entry_ref(r.cache(key, hash));
      if (!entry_ref.p) { failed = true; break; }
      PyObject* entry = entry_ref.p == Py_None ? nullptr : entry_ref.p;
      int stale = entry == nullptr;
      if (!stale) {
        PyObject* tick = _PyDict_GetItem_KnownHash(r.last, key, hash);
        if (tick == nullptr && PyErr_Occurred()) { failed = true; break; }
        stale = PyObject_RichCompareBool(tick ? tick : Py_None, PyTuple_GET_ITEM(record.p, 1), Py_NE);
        if (stale < 0) { failed = true; break; }
      }
      PyRef popped(heap_pop(heap));
      if (!popped.p) { failed = true; break; }
      if (stale) continue;  // evicted, or used or copied again since
      aside.push_back(Py_NewRef(record.p));
      int ok = evictable(entry, key, needed);
      if (ok > 0) {
        const int routed_last = contains(recent, PyTuple_GET_ITEM(record.p, 2));
        ok = routed_last < 0 ? -1 : !routed_last;
      }
      if (ok < 0) { failed = true; break; }
      if (ok) {
        cold_ref.p = entry_ref.release();
        cold_key.p = Py_NewRef(key);
        cold_hash = hash, cold_e = e;
        break;
      }
    }
    // The records looked at go back, whatever happened (an error leaves the heap as whole as it can).
    PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
    if (failed) PyErr_Fetch(&type, &value, &traceback);
    bool stopped = false;  // (by a push that failed, when nothing had)
    for (PyObject* record : aside) {
      if (!stopped && !heap_push(heap, record)) {
        if (failed) PyErr_Clear();
        else stopped = true;
      }
      Py_DECREF(record);
    }
    if (failed) {
      PyErr_Restore(type, value, traceback);
      return nullptr;
    }
    if (stopped) return nullptr;
  }

  // 3. Of the two, the one whose next use is expected furthest away (ties to the older use).
  PyObject* candidates[2] = {routed_ref.p, cold_ref.p};
  PyObject* candidate_keys[2] = {routed_key, cold_key.p};  // (each its entry's key, as the entry was found by)
  const Py_hash_t hashes[2] = {routed_hash, cold_hash};
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
    if (get_double(r.frequency, key, hashes[c], 0.0, &frequency_of) < 0) return nullptr;
    double q = frequency_of * r.per_turn;
    q = q < r.unseen ? r.unseen : q;  // max(q, unseen)
    q = 1.0 < q ? 1.0 : q;            // min(1.0, q)
    double p;
    if (predicted) {
      if (!chance_at(chances, indexes[c], &p)) return nullptr;
    } else {
      p = recents[c] ? (reuse > q ? reuse : q) : q;  // max(q, reuse)
    }
    const double wait = 0.0 + (1.0 - p) * static_cast<double>(r.count) / q;
    PyRef tick(tick_of(r.last, key, hashes[c]));
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

}  // namespace

PyObject* stack_best(PyObject*, PyObject* args) {
  PyObject *heap, *keys, *cache, *needed, *recent, *chances;
  Ranking r{};
  double reuse;
  if (!PyArg_ParseTuple(args, "OO!OO!O!OOOLddd", &heap, &PyTuple_Type, &keys, &cache, &PyDict_Type, &r.last,
                        &PyDict_Type, &r.frequency, &needed, &recent, &chances, &r.count, &reuse, &r.per_turn,
                        &r.unseen))
    return nullptr;
  if (!r.cache.init(cache)) return nullptr;
  return rank_stack(r, heap, keys, needed, recent, chances, reuse);
}

// ---------------------------------------------------------------------------------------------
// The victim search's loop over the layers (ExpertEviction.victim, with _best_of and _stack_best):
// each stale layer's best candidate found anew (each changed stack ranked by rank_stack, the
// others' kept bests reused), every layer's best wait compared, and a pick no longer cached or
// evictable sends its layer to be ranked anew, as there, on the policy's own objects (KeptBest's
// lists, sets and dicts are updated in place).

namespace {

struct VictimSearch {
  Ranking r;
  PyObject *groups, *stacks_of, *bests, *stale, *dirty, *of_stack, *needed, *chances_of, *likely_of, *guarded,
      *position, *heaps, *reuse_of, *ran;
  Lookup cached;  // the pager's copies by master
  long long here;
  double reuse_prior;
};

// `(where - here) % count or count`, or 0.5 for a layer not placed (eviction._distance).
bool layer_distance(const VictimSearch& v, PyObject* where, double* out) {
  if (where == nullptr || where == Py_None) {
    *out = 0.5;
    return true;
  }
  const long long w = PyLong_AsLongLong(where);
  if (w == -1 && PyErr_Occurred()) return false;
  const long long count = v.r.count;
  if (count == 0) {
    PyErr_SetString(PyExc_ZeroDivisionError, "integer modulo by zero");
    return false;
  }
  long long d = (w - v.here) % count;
  if (d < 0) d += count;  // (Python's modulo takes the divisor's sign)
  *out = static_cast<double>(d ? d : count);
  return true;
}

// One stack's best candidate (ExpertEviction._stack_best), a new reference or None.
PyObject* stack_candidate(VictimSearch& v, PyObject* stack, PyObject* keep) {
  static Slot master_id("master_id"), group_of("group"), keys_of("keys"), used("used"), last_used("last_used");
  PyRef master(master_id(stack));
  if (!master.p) return nullptr;
  const Py_hash_t master_hash = PyObject_Hash(master.p);
  if (master_hash == -1) return nullptr;
  PyRef entries(v.cached(master.p, master_hash));
  if (!entries.p) return nullptr;
  const int any = PyObject_IsTrue(entries.p);
  if (any <= 0) return any < 0 ? nullptr : Py_NewRef(Py_None);
  PyRef group(group_of(stack));
  if (!group.p) return nullptr;
  PyObject* chances = PyDict_GetItemWithError(v.chances_of, group.p);  // borrowed
  if (chances == nullptr && PyErr_Occurred()) return nullptr;
  PyRef recent;
  if (chances == nullptr) {
    chances = Py_None;
    const int ran = PySet_Contains(v.ran, group.p);
    if (ran < 0) return nullptr;
    recent.p = ran ? used(stack) : last_used(stack);
  } else {
    PyObject* likely = PyDict_GetItemWithError(v.likely_of, group.p);
    if (likely == nullptr && PyErr_Occurred()) return nullptr;
    recent.p = Py_NewRef(likely ? likely : Py_None);
  }
  if (!recent.p) return nullptr;
  double reuse = v.reuse_prior;
  const Py_hash_t group_hash = PyObject_Hash(group.p);
  if (group_hash == -1 || get_double(v.reuse_of, group.p, group_hash, v.reuse_prior, &reuse) < 0) return nullptr;
  PyObject* heap = _PyDict_GetItem_KnownHash(v.heaps, master.p, master_hash);
  if (heap == nullptr && PyErr_Occurred()) return nullptr;
  PyRef keys(keys_of(stack));
  if (!keys.p) return nullptr;
  if (!PyTuple_Check(keys.p)) {
    PyErr_SetString(PyExc_TypeError, "offtensor: a stack's keys are a tuple");
    return nullptr;
  }
  return rank_stack(v.r, heap ? heap : Py_None, keys.p, keep, recent.p, chances, reuse);
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

// The layer at `i` ranked anew keeping `keep` (KeptBest.best[i], no longer stale).
bool rank_layer(VictimSearch& v, Py_ssize_t i, PyObject* keep) {
  PyObject* found = layer_candidate(v, PyList_GET_ITEM(v.stacks_of, i), keep);
  return found && PyList_SetItem(v.bests, i, found) == 0 && PyList_SetItem(v.stale, i, Py_NewRef(Py_False)) == 0;
}

// KeptBest's lists, set and dict (its slots), held for the search; false with an exception set.
struct KeptLists {
  PyRef groups, stacks_of, bests, stale, dirty, of_stack;

  bool read(PyObject* kept, VictimSearch& v) {
    static Slot groups_of("groups"), stacks_name("stacks"), best_of("best"), stale_of("stale"), dirty_of("dirty"),
        of_stack_of("of_stack");
    groups.p = groups_of(kept), stacks_of.p = stacks_name(kept), bests.p = best_of(kept), stale.p = stale_of(kept);
    dirty.p = dirty_of(kept), of_stack.p = of_stack_of(kept);
    if (!groups.p || !stacks_of.p || !bests.p || !stale.p || !dirty.p || !of_stack.p) return false;
    const Py_ssize_t layers = PyList_Check(groups.p) ? PyList_GET_SIZE(groups.p) : -1;
    if (layers < 0 || !PyList_Check(stacks_of.p) || !PyList_Check(bests.p) || !PyList_Check(stale.p) ||
        PyList_GET_SIZE(stacks_of.p) != layers || PyList_GET_SIZE(bests.p) != layers ||
        PyList_GET_SIZE(stale.p) != layers || !PySet_Check(dirty.p) || !PyDict_Check(of_stack.p)) {
      PyErr_SetString(PyExc_TypeError,
                      "offtensor: KeptBest's groups, stacks, best and stale are lists of one length");
      return false;
    }
    v.groups = groups.p, v.stacks_of = stacks_of.p, v.bests = bests.p, v.stale = stale.p;
    v.dirty = dirty.p, v.of_stack = of_stack.p;
    return true;
  }
};

// The current layer's best, ranked keeping its op's keys (`needed`) and by its chances; ranked anew
// unless KeptBest.current says it was ranked with these very ones (by identity) and it is not stale.
bool rank_current(VictimSearch& v, PyObject* kept, Py_ssize_t i, PyObject* group, bool stale_now) {
  static PyObject* current_name = PyUnicode_InternFromString("current");
  static Slot current_of("current");
  PyObject* chances = PyDict_GetItemWithError(v.chances_of, group);
  if (chances == nullptr && PyErr_Occurred()) return false;
  chances = chances ? chances : Py_None;
  PyRef with(current_of(kept));
  if (!with.p) return false;
  int ranked_with = 0;
  if (with.p != Py_None && PyTuple_Check(with.p) && PyTuple_GET_SIZE(with.p) == 3) {
    ranked_with = PyObject_RichCompareBool(PyTuple_GET_ITEM(with.p, 0), group, Py_EQ);
    if (ranked_with < 0) return false;
    ranked_with = ranked_with && PyTuple_GET_ITEM(with.p, 1) == v.needed && PyTuple_GET_ITEM(with.p, 2) == chances;
  }
  if (!ranked_with && !mark_dirty(v, i)) return false;  // ranked keeping other keys, or other chances: anew
  if (stale_now || !ranked_with) {
    if (!rank_layer(v, i, v.needed)) return false;
    PyRef now(PyTuple_Pack(3, group, v.needed, chances));
    if (!now.p || PyObject_SetAttr(kept, current_name, now.p) < 0) return false;
  }
  return true;
}

}  // namespace

// victim_search's arguments of a type (a dict, a set: subclasses too): false with an exception set.
bool typed(PyObject* const* args, std::initializer_list<int> at, PyTypeObject* type) {
  for (int i : at) {
    if (!PyObject_TypeCheck(args[i], type)) {
      PyErr_Format(PyExc_TypeError, "victim_search() argument %d must be %s, not %.50s", i + 1, type->tp_name,
                   Py_TYPE(args[i])->tp_name);
      return false;
    }
  }
  return true;
}

// Called with its arguments in place (METH_FASTCALL: once per eviction, its nineteen arguments
// parsed by a format string cost more than a kept layer's whole comparison).
PyObject* victim_search(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 19) {
    PyErr_Format(PyExc_TypeError, "victim_search() takes 19 arguments (%zd given)", nargs);
    return nullptr;
  }
  if (!typed(args, {5, 6, 7, 8, 11, 12, 13, 14}, &PyDict_Type) || !typed(args, {16}, &PySet_Type)) return nullptr;
  VictimSearch v{};
  PyObject *kept = args[0], *cache = args[1], *cached = args[2], *current = args[3], *here_obj = args[9];
  v.needed = args[4], v.chances_of = args[5], v.likely_of = args[6], v.guarded = args[7], v.position = args[8];
  v.heaps = args[11], v.r.last = args[12], v.r.frequency = args[13], v.reuse_of = args[14], v.ran = args[16];
  v.r.count = PyLong_AsLongLong(args[10]);
  if (v.r.count == -1 && PyErr_Occurred()) return nullptr;
  for (auto [at, out] : {std::pair{15, &v.reuse_prior}, {17, &v.r.per_turn}, {18, &v.r.unseen}}) {
    *out = PyFloat_AsDouble(args[at]);
    if (*out == -1.0 && PyErr_Occurred()) return nullptr;
  }
  static Slot key_of("key");
  KeptLists lists;
  if (!lists.read(kept, v)) return nullptr;
  const Py_ssize_t layers = PyList_GET_SIZE(v.groups);
  v.here = PyLong_AsLongLong(here_obj);
  if (v.here == -1 && PyErr_Occurred()) return nullptr;
  if (!v.r.cache.init(cache) || !v.cached.init(cached)) return nullptr;
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
        if (!rank_current(v, kept, i, group, stale_now)) return nullptr;
        distance = static_cast<double>(v.r.count);
      } else {
        if (stale_now) {
          PyObject* keep = PyDict_GetItemWithError(v.guarded, group);
          if (keep == nullptr && PyErr_Occurred()) return nullptr;
          if (!rank_layer(v, i, keep ? keep : Py_None)) return nullptr;
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
    PyRef key(key_of(best));
    if (!key.p) return nullptr;
    const Py_hash_t hash = PyObject_Hash(key.p);
    if (hash == -1) return nullptr;
    PyRef now(v.r.cache(key.p, hash));
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

}  // namespace offtensor
