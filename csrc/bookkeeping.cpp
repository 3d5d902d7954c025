// The expert cache's bookkeeping of every expert the pager pages, copies or evicts
// (offtensor/moe/stacks.py: ExpertStacks.accessed, copied, evicted), one call each: the pager makes
// them some hundred times a decode step, and the interpreter's way through them (six method calls
// and some forty attribute reads per expert paged) cost more than the work itself. Each is the
// interpreter's code step by step on the same objects, in the same order and arithmetic, so the
// policy's state after it is the same, bit for bit: ExpertIssuer.seen, the stack's counters,
// ExpertEviction.used / copied / evicted (its LRU tick, use count, KeptBest.changed_stack and
// ColdHeaps.push, with heapq's heappush step for step, and heapq's own heapify) and the speculator's
// ``used``.
//
// Everything that can fail on the objects read (a missing attribute, a key of another shape, a
// comparison through the interpreter) is done before anything changes; the changes then follow in
// the interpreter's order, so a failure there (memory) leaves a state the interpreter's code could
// have left at that point too. No bytecode runs inside but a stack's expert_of for a key that is
// part of an expert (rare) and the speculator's ``used`` (last: a dict's setdefault, or a no-op).
#include <Python.h>

#include "pyref.h"
#include "slots.h"
// heapq's push, step for step (the victim search's reading of the same heaps): this file takes only
// heap_push of it, the rest is the search's own.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include "policy_objects.h"
#pragma GCC diagnostic pop

namespace offtensor {
namespace {

// The attributes read, each where its class keeps it (csrc/slots.h).
Slot& slot_of(const char* name) { return *new Slot(name); }  // (never freed: read until the process ends)
// (One Slot per class: a Slot remembers the last class it read, so two classes would take turns.)
Slot& kByMaster = slot_of("by_master");  // ExpertStacks
Slot& kIssuer = slot_of("issuer");
Slot& kEviction = slot_of("eviction");
Slot& kLayers = slot_of("layers");
Slot& kSpeculator = slot_of("speculator");
Slot& kIssuedForOp = slot_of("issued_for_op");  // ExpertIssuer
Slot& kShares = slot_of("shares");
Slot& kIssuing = slot_of("issuing");
Slot& kCurrent = slot_of("current");  // LayerOrder
Slot& kNeeded = slot_of("needed");
Slot& kClock = slot_of("_clock");  // ExpertEviction
Slot& kEvictionByMaster = slot_of("by_master");
Slot& kLast = slot_of("_last");
Slot& kFrequency = slot_of("frequency");
Slot& kGuarded = slot_of("_guarded");
Slot& kKept = slot_of("_kept");
Slot& kColdest = slot_of("_coldest");
Slot& kIndex = slot_of("_index");  // KeptBest
Slot& kStale = slot_of("stale");
Slot& kDirty = slot_of("dirty");
Slot& kHeaps = slot_of("_heaps");  // ColdHeaps
Slot& kScale = slot_of("scale");
Slot& kHits = slot_of("hits");  // Stack
Slot& kMisses = slot_of("misses");
Slot& kExperts = slot_of("experts");
Slot& kGroup = slot_of("group");
Slot& kUsed = slot_of("used");
Slot& kLastUsed = slot_of("last_used");
Slot& kMasterId = slot_of("master_id");
Slot& kKeys = slot_of("keys");
Slot& kNumExperts = slot_of("num_experts");
Slot& kBytesH2d = slot_of("bytes_h2d");
Slot& kPrefetchedBytes = slot_of("prefetched_bytes");
Slot& kEvictions = slot_of("evictions");

// heapq's function `name`, the one ColdHeaps calls (the C one where heapq has it).
PyObject* heapq_function(const char* name) {
  PyRef heapq(PyImport_ImportModule("heapq"));
  return heapq.p ? PyObject_GetAttrString(heapq.p, name) : nullptr;
}

// `mapping.get(key, fallback)`: a new reference (fallback nullptr: None), or nullptr with an exception.
// A dict is probed directly, with the key's hash where the caller has it (-1: hashed here): a cache
// key is a tuple of four, hashed item by item at every look-up, and one use looks its key up in
// four dicts.
PyObject* get(PyObject* mapping, PyObject* key, PyObject* fallback = nullptr, Py_hash_t hash = -1) {
  if (fallback == nullptr) fallback = Py_None;
  if (PyDict_CheckExact(mapping)) {
#if PY_VERSION_HEX < 0x030D0000
    PyObject* value = hash != -1 ? _PyDict_GetItem_KnownHash(mapping, key, hash) : PyDict_GetItemWithError(mapping, key);
#else  // (CPython 3.13 made the known-hash probe internal)
    PyObject* value = PyDict_GetItemWithError(mapping, key);
#endif
    return value != nullptr ? Py_NewRef(value) : PyErr_Occurred() ? nullptr : Py_NewRef(fallback);
  }
  static PyObject* get_name = PyUnicode_InternFromString("get");
  PyObject* args[] = {mapping, key, fallback};
  return PyObject_VectorcallMethod(get_name, args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
}

// `mapping[key] = value`, a dict's with the key's hash known (as ``get``): false with an exception.
bool store(PyObject* mapping, PyObject* key, Py_hash_t hash, PyObject* value) {
#if PY_VERSION_HEX < 0x030D0000
  if (PyDict_CheckExact(mapping)) return _PyDict_SetItem_KnownHash(mapping, key, value, hash) == 0;
#endif
  return PyObject_SetItem(mapping, key, value) == 0;
}

// `key[0]`: a cache key's master id (a new reference).
PyObject* master_of(PyObject* key) {
  if (PyTuple_Check(key) && PyTuple_GET_SIZE(key) > 0) return Py_NewRef(PyTuple_GET_ITEM(key, 0));
  return PySequence_GetItem(key, 0);
}

// `a + b` and `a / b`, in double arithmetic where both are floats (as the interpreter's).
PyObject* add(PyObject* a, PyObject* b) {
  if (PyFloat_CheckExact(a) && PyFloat_CheckExact(b)) return PyFloat_FromDouble(PyFloat_AS_DOUBLE(a) + PyFloat_AS_DOUBLE(b));
  return PyNumber_Add(a, b);
}

PyObject* divide(PyObject* a, PyObject* b) {
  if (PyFloat_CheckExact(a) && PyFloat_CheckExact(b) && PyFloat_AS_DOUBLE(b) != 0.0)
    return PyFloat_FromDouble(PyFloat_AS_DOUBLE(a) / PyFloat_AS_DOUBLE(b));
  return PyNumber_TrueDivide(a, b);  // (a zero raises as the interpreter's division does)
}

PyObject* one() {
  static PyObject* value = PyLong_FromLong(1);
  return value;
}

// `a + b` of ints: in C where both fit a long long (a counter, a tick), else the interpreter's addition.
PyObject* sum(PyObject* a, PyObject* b) {
  if (PyLong_CheckExact(a) && PyLong_CheckExact(b)) {
    int a_over = 0, b_over = 0;
    const long long x = PyLong_AsLongLongAndOverflow(a, &a_over), y = PyLong_AsLongLongAndOverflow(b, &b_over);
    long long total;
    if (!a_over && !b_over && !__builtin_add_overflow(x, y, &total)) return PyLong_FromLongLong(total);
  }
  return PyNumber_Add(a, b);
}

// `obj.name + by` as a new reference (the counter's next value), or nullptr.
PyObject* counted(Slot& slot, PyObject* obj, PyObject* by) {
  PyRef now(slot(obj));
  return now.p ? sum(now.p, by) : nullptr;
}

// `collection.add(item)` / `.discard(item)`: a set's own, any other through its method. False on failure.
bool set_add(PyObject* collection, PyObject* item) {
  if (PySet_Check(collection)) return PySet_Add(collection, item) == 0;
  static PyObject* name = PyUnicode_InternFromString("add");
  PyRef done(PyObject_CallMethodOneArg(collection, name, item));
  return done.p != nullptr;
}

bool set_discard(PyObject* collection, PyObject* item) {
  if (PySet_Check(collection)) return PySet_Discard(collection, item) >= 0;
  static PyObject* name = PyUnicode_InternFromString("discard");
  PyRef done(PyObject_CallMethodOneArg(collection, name, item));
  return done.p != nullptr;
}

// `stack.group == layers.current`: 1, 0 or -1.
int is_current(PyObject* stack, PyObject* layers) {
  PyRef group(kGroup(stack)), current(group.p ? kCurrent(layers) : nullptr);
  return current.p ? PyObject_RichCompareBool(group.p, current.p, Py_EQ) : -1;
}

// ExpertEviction._keeps: whether the ranking of `stack`'s layer keeps `key` (1, 0 or -1).
int keeps(PyObject* eviction, PyObject* layers, PyObject* stack, PyObject* key, bool current) {
  if (current) {
    PyRef needed(kNeeded(layers));
    if (!needed.p) return -1;
    return needed.p == Py_None ? 0 : PySequence_Contains(needed.p, key);
  }
  PyRef guarded(kGuarded(eviction)), group(guarded.p ? kGroup(stack) : nullptr);
  PyRef empty(group.p ? PyTuple_New(0) : nullptr);
  PyRef kept(empty.p ? get(guarded.p, group.p, empty.p) : nullptr);
  return kept.p ? PySequence_Contains(kept.p, key) : -1;
}

// KeptBest.changed_stack(stack), found before and done after: `stale[i] = True; dirty.add(stack)`.
struct Stale {
  PyRef stale, i, dirty;  // stale nullptr: nothing to mark (the layer is not tracked)

  bool find(PyObject* kept, PyObject* stack) {
    PyRef index(kIndex(kept)), group(index.p ? kGroup(stack) : nullptr);
    if (!group.p) return false;
    i.p = get(index.p, group.p);
    if (!i.p) return false;
    if (i.p == Py_None) return true;
    stale.p = kStale(kept);
    dirty.p = stale.p ? kDirty(kept) : nullptr;
    return dirty.p != nullptr;
  }

  bool mark(PyObject* stack) const {
    if (stale.p == nullptr) return true;
    const Py_ssize_t at = PyList_CheckExact(stale.p) && PyLong_CheckExact(i.p) ? PyLong_AsSsize_t(i.p) : -1;
    if (at >= 0 && at < PyList_GET_SIZE(stale.p)) {  // (a list's item set as `stale[i] = True` sets it)
      PyObject* old = PyList_GET_ITEM(stale.p, at);
      PyList_SET_ITEM(stale.p, at, Py_NewRef(Py_True));
      Py_DECREF(old);
    } else {
      PyErr_Clear();  // (an index past a long: the interpreter's item assignment says what is wrong)
      if (PyObject_SetItem(stale.p, i.p, Py_True) < 0) return false;
    }
    return set_add(dirty.p, stack);
  }
};

// ExpertEviction.evicted's `KeptBest.changed_stack` where `stack` (maybe None) is found.
bool find_stale(Stale& out, PyObject* eviction, PyObject* stack) {
  if (stack == Py_None) return true;
  PyRef kept(kKept(eviction));
  return kept.p && out.find(kept.p, stack);
}

PyObject* tuple_of(PyObject* a, PyObject* b, PyObject* c, PyObject* d = nullptr) {
  return d ? PyTuple_Pack(4, a, b, c, d) : PyTuple_Pack(3, a, b, c);
}

// ColdHeaps.push's record: `(value, tick, expert)` for a whole expert (`keys[expert] == key`), else
// with the key.
PyObject* heap_record(PyObject* keys, PyObject* key, PyObject* expert, PyObject* value, PyObject* tick) {
  int overflow = 0;
  const long long e = PyLong_Check(expert) ? PyLong_AsLongLongAndOverflow(expert, &overflow) : -1;
  if (e == -1 && PyErr_Occurred()) return nullptr;
  const Py_ssize_t count = PyObject_Size(keys);
  if (count < 0) return nullptr;
  int whole = 0;
  if (PyLong_Check(expert) && !overflow && e >= 0 && e < count) {
    PyRef at(PySequence_GetItem(keys, static_cast<Py_ssize_t>(e)));
    whole = at.p ? PyObject_RichCompareBool(at.p, key, Py_EQ) : -1;
    if (whole < 0) return nullptr;
  }
  return whole ? tuple_of(value, tick, expert) : tuple_of(value, tick, expert, key);
}

// The heap kept to its live records once it grew past 4 records an expert and 64 (ColdHeaps.push):
// `heap[:] = [r for r in heap if last.get(keys[r[2]] if len(r) == 3 else r[3]) == r[1]]`, heapified.
bool compact(PyObject* heap, PyObject* keys, PyObject* last) {
  static PyObject* heapify = heapq_function("heapify");
  PyRef live(PyList_New(0));
  if (!live.p || !heapify) return false;
  for (Py_ssize_t n = 0; n < PyList_GET_SIZE(heap); ++n) {
    PyRef record(Py_NewRef(PyList_GET_ITEM(heap, n)));
    const Py_ssize_t size = PyObject_Size(record.p);
    if (size < 0) return false;
    PyRef expert(PySequence_GetItem(record.p, size == 3 ? 2 : 3));
    PyRef key(!expert.p ? nullptr : size == 3 ? PyObject_GetItem(keys, expert.p) : Py_NewRef(expert.p));
    PyRef tick(key.p ? get(last, key.p) : nullptr), own(tick.p ? PySequence_GetItem(record.p, 1) : nullptr);
    PyRef same(own.p ? PyObject_RichCompare(tick.p, own.p, Py_EQ) : nullptr);
    const int keep = same.p ? PyObject_IsTrue(same.p) : -1;
    if (keep < 0 || (keep && PyList_Append(live.p, record.p) < 0)) return false;
  }
  if (PyList_SetSlice(heap, 0, PyList_GET_SIZE(heap), live.p) < 0) return false;
  PyRef done(PyObject_CallOneArg(heapify, heap));
  return done.p != nullptr;
}

// ExpertEviction.used (a use, `share` of the layer's tokens) or copied (`share` nullptr) of `expert`
// of `stack` (`key`): everything it reads found first (``find``), then its changes made (``commit``):
// the LRU tick, the use count, the layer's kept best marked stale unless it keeps the key, the record
// pushed on the stack's heap.
struct Use {
  PyRef eviction, last, frequency, tick, value, heaps, master_id, heap, record, keys;
  Py_hash_t hash = -1;  // the key's
  bool new_heap = false, counted = false;
  long long limit = 0;
  Stale stale;

  bool find(PyObject* stacks, PyObject* stack, PyObject* key, Py_hash_t key_hash, PyObject* expert, PyObject* share,
            bool current) {
    hash = key_hash;
    eviction.p = kEviction(stacks);
    PyRef layers(eviction.p ? kLayers(stacks) : nullptr), clock(layers.p ? kClock(eviction.p) : nullptr);
    tick.p = clock.p ? sum(clock.p, one()) : nullptr;
    last.p = tick.p ? kLast(eviction.p) : nullptr;
    frequency.p = last.p ? kFrequency(eviction.p) : nullptr;
    if (!frequency.p) return false;
    static PyObject* zero = PyFloat_FromDouble(0.0);
    PyRef old(get(frequency.p, key, zero, hash));
    counted = share != nullptr;
    value.p = !old.p ? nullptr : counted ? add(old.p, share) : old.release();
    const int kept_key = value.p ? keeps(eviction.p, layers.p, stack, key, current) : -1;
    if (kept_key < 0) return false;
    if (!kept_key && !find_stale(stale, eviction.p, stack)) return false;
    return find_record(stack, key, expert);
  }

  bool find_record(PyObject* stack, PyObject* key, PyObject* expert) {
    PyRef coldest(kColdest(eviction.p));
    heaps.p = coldest.p ? kHeaps(coldest.p) : nullptr;
    master_id.p = heaps.p ? kMasterId(stack) : nullptr;
    heap.p = master_id.p ? get(heaps.p, master_id.p) : nullptr;
    if (!heap.p) return false;
    if (heap.p == Py_None) {
      Py_SETREF(heap.p, PyList_New(0));
      new_heap = true;
      if (!heap.p) return false;
    }
    PyRef scale(kScale(coldest.p)), scaled(scale.p ? divide(value.p, scale.p) : nullptr);
    keys.p = scaled.p ? kKeys(stack) : nullptr;
    record.p = keys.p ? heap_record(keys.p, key, expert, scaled.p, tick.p) : nullptr;
    PyRef experts(record.p ? kNumExperts(stack) : nullptr);
    limit = experts.p ? PyLong_AsLongLong(experts.p) : -1;
    if (limit == -1 && PyErr_Occurred()) return false;
    if (!PyList_Check(heap.p)) {
      PyErr_SetString(PyExc_TypeError, "offtensor: an expert's heap of use records is not a list");
      return false;
    }
    limit = 4 * limit + 64;
    return record.p != nullptr;
  }

  bool commit(PyObject* stack, PyObject* key) {
    if (!kClock.set(eviction.p, tick.p) || !store(last.p, key, hash, tick.p)) return false;
    if (counted && !store(frequency.p, key, hash, value.p)) return false;
    if (!stale.mark(stack)) return false;
    if (new_heap && PyObject_SetItem(heaps.p, master_id.p, heap.p) < 0) return false;
    if (!heap_push(heap.p, record.p)) return false;
    return PyList_GET_SIZE(heap.p) <= limit || compact(heap.p, keys.p, last.p);
  }
};

// ExpertEviction.touch(key): a copy that is no expert's (a dense weight's) takes the next tick.
PyObject* touch(PyObject* stacks, PyObject* key) {
  PyRef eviction(kEviction(stacks)), clock(eviction.p ? kClock(eviction.p) : nullptr);
  PyRef tick(clock.p ? sum(clock.p, one()) : nullptr), last(tick.p ? kLast(eviction.p) : nullptr);
  if (!last.p || !kClock.set(eviction.p, tick.p) || PyObject_SetItem(last.p, key, tick.p) < 0) return nullptr;
  Py_RETURN_NONE;
}

// `stack.expert_of(key)`: the experts' dict first (every whole expert), else the stack's own method.
PyObject* expert_of(PyObject* stack, PyObject* key, Py_hash_t hash) {
  PyRef experts(kExperts(stack));
  PyRef expert(experts.p ? get(experts.p, key, nullptr, hash) : nullptr);
  if (!expert.p || expert.p != Py_None) return expert.release();
  static PyObject* name = PyUnicode_InternFromString("expert_of");
  return PyObject_CallMethodOneArg(stack, name, key);  // (one argument, the key: not a tuple of arguments)
}

// The C function behind a dict's bound setdefault (`{}.setdefault`), or nullptr.
PyCFunction dict_setdefault() {
  PyRef dict(PyDict_New());
  PyRef bound(dict.p ? PyObject_GetAttrString(dict.p, "setdefault") : nullptr);
  PyCFunction found = bound.p && PyCFunction_CheckExact(bound.p) ? PyCFunction_GET_FUNCTION(bound.p) : nullptr;
  PyErr_Clear();
  return found;
}

// The speculator's `used(stack, expert)`: once a router fired, the setdefault of its dict of the
// stacks paged (a dict used as an ordered set), which PyDict_SetDefault is; else called. False on failure.
bool learned(PyObject* used, PyObject* stack, PyObject* expert) {
  static PyCFunction setdefault = dict_setdefault();
  if (setdefault != nullptr && PyCFunction_CheckExact(used) && PyCFunction_GET_FUNCTION(used) == setdefault &&
      PyDict_CheckExact(PyCFunction_GET_SELF(used)))
    return PyDict_SetDefault(PyCFunction_GET_SELF(used), stack, expert) != nullptr;
  PyObject* args[] = {stack, expert};
  PyRef done(PyObject_Vectorcall(used, args, 2, nullptr));
  return done.p != nullptr;
}

// ExpertStacks.accessed(key, hit).
PyObject* expert_accessed(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "offtensor: expert_accessed(stacks, key, hit)");
    return nullptr;
  }
  PyObject *stacks = args[0], *key = args[1];
  PyRef by_master(kByMaster(stacks)), master(by_master.p ? master_of(key) : nullptr);
  PyRef stack(master.p ? get(by_master.p, master.p) : nullptr);
  if (!stack.p) return nullptr;
  if (stack.p == Py_None) return touch(stacks, key);
  const Py_hash_t hash = PyObject_Hash(key);
  if (hash == -1) return nullptr;
  PyRef issuer(kIssuer(stacks)), issued(issuer.p ? kIssuedForOp(issuer.p) : nullptr);
  // (ExpertIssuer.seen: a copy announce made for this op is a miss. The set is empty but between an
  // announce and its op's pages: no hash of the key then.)
  const int announced = !issued.p ? -1 : PyAnySet_CheckExact(issued.p) && PySet_GET_SIZE(issued.p) == 0 ? 0
                                                                                  : PySequence_Contains(issued.p, key);
  const int hit = announced != 0 ? (announced < 0 ? -1 : 0) : PyObject_IsTrue(args[2]);
  if (hit < 0) return nullptr;
  Slot& counter = hit ? kHits : kMisses;
  PyRef count(counted(counter, stack.p, one())), expert(count.p ? expert_of(stack.p, key, hash) : nullptr);
  PyRef layers(expert.p ? kLayers(stacks) : nullptr);
  const int current = layers.p ? is_current(stack.p, layers.p) : -1;
  if (current < 0) return nullptr;
  static PyObject* full_share = PyFloat_FromDouble(1.0);  // (the most routed expert's, or the op did not say)
  PyRef shares(current ? kShares(issuer.p) : nullptr);
  PyRef share(current ? (shares.p ? get(shares.p, expert.p, full_share) : nullptr) : Py_NewRef(full_share));
  Use use;
  PyRef used(share.p && use.find(stacks, stack.p, key, hash, expert.p, share.p, current) ? kUsed(stack.p) : nullptr);
  PyRef speculator(used.p ? kSpeculator(stacks) : nullptr);
  if (!speculator.p) return nullptr;
  // Every read made: the changes, in ExpertStacks.accessed's order.
  if (announced && !set_discard(issued.p, key)) return nullptr;
  if (!counter.set(stack.p, count.p) || !use.commit(stack.p, key) || !set_add(used.p, expert.p)) return nullptr;
  if (speculator.p == Py_None) Py_RETURN_NONE;
  static PyObject* used_name = PyUnicode_InternFromString("used");  // (RoutingSpeculator keeps no slots)
  PyRef learn(PyObject_GetAttr(speculator.p, used_name));
  return learn.p && learned(learn.p, stack.p, expert.p) ? Py_NewRef(Py_None) : nullptr;
}

// ExpertStacks.copied(key, nbytes, prefetch).
PyObject* expert_copied(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "offtensor: expert_copied(stacks, key, nbytes, prefetch)");
    return nullptr;
  }
  PyObject *stacks = args[0], *key = args[1], *nbytes = args[2];
  PyRef by_master(kByMaster(stacks)), master(by_master.p ? master_of(key) : nullptr);
  PyRef stack(master.p ? get(by_master.p, master.p) : nullptr);
  if (!stack.p) return nullptr;
  if (stack.p == Py_None) return touch(stacks, key);
  PyRef bytes(counted(kBytesH2d, stack.p, nbytes));
  int ahead = bytes.p ? PyObject_IsTrue(args[3]) : -1;
  if (ahead > 0) {  // (`prefetch and not issuer.issuing`: a copy ahead of use, not the layer's own announce)
    PyRef issuer(kIssuer(stacks)), issuing(issuer.p ? kIssuing(issuer.p) : nullptr);
    const int own = issuing.p ? PyObject_IsTrue(issuing.p) : -1;
    ahead = own < 0 ? -1 : !own;
  }
  PyRef prefetched(ahead > 0 ? counted(kPrefetchedBytes, stack.p, nbytes) : nullptr);
  if (ahead < 0 || (ahead && !prefetched.p)) return nullptr;
  const Py_hash_t hash = PyObject_Hash(key);
  PyRef expert(hash != -1 ? expert_of(stack.p, key, hash) : nullptr), layers(expert.p ? kLayers(stacks) : nullptr);
  const int current = layers.p ? is_current(stack.p, layers.p) : -1;
  Use use;
  if (current < 0 || !use.find(stacks, stack.p, key, hash, expert.p, nullptr, current)) return nullptr;
  if (!kBytesH2d.set(stack.p, bytes.p) || (ahead && !kPrefetchedBytes.set(stack.p, prefetched.p))) return nullptr;
  if (!use.commit(stack.p, key)) return nullptr;
  Py_RETURN_NONE;
}

// ExpertStacks.evicted(key).
PyObject* expert_evicted(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "offtensor: expert_evicted(stacks, key)");
    return nullptr;
  }
  PyObject *stacks = args[0], *key = args[1];
  PyRef eviction(kEviction(stacks)), last(eviction.p ? kLast(eviction.p) : nullptr);
  PyRef known(last.p ? kEvictionByMaster(eviction.p) : nullptr), master(known.p ? master_of(key) : nullptr);
  PyRef stack(master.p ? get(known.p, master.p) : nullptr);  // (ExpertEviction's by_master: ExpertStacks')
  Stale stale;
  if (!stack.p || !find_stale(stale, eviction.p, stack.p)) return nullptr;
  PyRef by_master(kByMaster(stacks));  // (the same dict as the eviction's, as ExpertStacks made it: found once)
  PyRef counted_stack(!by_master.p ? nullptr : by_master.p == known.p ? Py_NewRef(stack.p) : get(by_master.p, master.p));
  if (!counted_stack.p) return nullptr;
  PyRef evictions(counted_stack.p == Py_None ? nullptr : counted(kEvictions, counted_stack.p, one()));
  if (counted_stack.p != Py_None && !evictions.p) return nullptr;
  // `_last.pop(key, None)`, the layer's kept best stale, the stack's count.
  if (PyDict_CheckExact(last.p)) {
    if (PyDict_DelItem(last.p, key) < 0) {
      if (!PyErr_ExceptionMatches(PyExc_KeyError)) return nullptr;
      PyErr_Clear();
    }
  } else {
    PyRef popped(PyObject_CallMethod(last.p, "pop", "OO", key, Py_None));  // (two arguments: the key stays whole)
    if (!popped.p) return nullptr;
  }
  if (!stale.mark(stack.p)) return nullptr;
  if (evictions.p && !kEvictions.set(counted_stack.p, evictions.p)) return nullptr;
  Py_RETURN_NONE;
}

// How many of `used`'s items `last` holds: `len(used & last)` (two sets of experts: the smaller walked,
// as the interpreter's intersection walks it), or -1 with an exception set.
Py_ssize_t common(PyObject* used, PyObject* last) {
  if (!PyAnySet_CheckExact(used) || !PyAnySet_CheckExact(last)) {
    PyRef both(PyNumber_And(used, last));
    return both.p ? PyObject_Size(both.p) : -1;
  }
  PyObject *walked = PySet_GET_SIZE(used) <= PySet_GET_SIZE(last) ? used : last, *other = walked == used ? last : used;
  Py_ssize_t pos = 0, count = 0;
  PyObject* item;
  Py_hash_t hash;
  while (_PySet_NextEntry(walked, &pos, &item, &hash)) {
    const int found = PySet_Contains(other, item);
    if (found < 0) return -1;
    count += found;
  }
  return count;
}

// The reuse rate of `stack`'s layer after the step (ExpertEviction.measure_reuse: the share of its
// last step's experts it routed again, into the average), or None where this stack does not measure
// it (none used, its layer measured by an earlier stack, a step that routed more or fewer); nullptr
// on failure. Its group is added to `seen` where it measures.
PyObject* reuse_after(PyObject* stack, PyObject* reuse, PyObject* seen, double decay, PyObject* prior) {
  PyRef used(kUsed(stack)), group(used.p ? kGroup(stack) : nullptr), last(group.p ? kLastUsed(stack) : nullptr);
  if (!last.p) return nullptr;
  const int any = PyObject_IsTrue(used.p);
  const int measured = any > 0 ? PySet_Contains(seen, group.p) : any;
  if (measured < 0) return nullptr;
  if (!any || measured) return Py_NewRef(Py_None);
  const Py_ssize_t count = PyObject_Size(used.p), before = PyObject_Size(last.p);
  if (count < 0 || before < 0) return nullptr;
  if (count != before) return Py_NewRef(Py_None);
  const Py_ssize_t again = PySet_Add(seen, group.p) < 0 ? -1 : common(used.p, last.p);
  PyRef old(again < 0 ? nullptr : get(reuse, group.p, prior));
  const double rate = old.p ? PyFloat_AsDouble(old.p) : -1.0;
  if (!old.p || (rate == -1.0 && PyErr_Occurred())) return nullptr;
  // `decay * rate + (1 - decay) * share`, each product rounded apart as the interpreter's are (no
  // fused multiply-add, which would round once).
  const double share = static_cast<double>(again) / static_cast<double>(count);
  volatile double kept = decay * rate, added = (1.0 - decay) * share;
  return PyFloat_FromDouble(kept + added);
}

// ExpertEviction.measure_reuse(turn) over `by_master`'s stacks: every layer's reuse rate found, then
// stored; with `turn`, then every stack's experts used this step become its last step's
// (`stack.last_used, stack.used = stack.used, set()`, ExpertStacks.step), the new sets made first.
PyObject* measure_reuse(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5 || !PyDict_Check(args[0]) || !PyFloat_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "offtensor: measure_reuse(by_master, reuse, decay, prior, turn)");
    return nullptr;
  }
  PyObject *reuse = args[1], *prior = args[3];
  const double decay = PyFloat_AS_DOUBLE(args[2]);
  const int turn = PyObject_IsTrue(args[4]);
  PyRef stacks(turn >= 0 ? PyDict_Values(args[0]) : nullptr), seen(stacks.p ? PySet_New(nullptr) : nullptr);
  PyRef rates(seen.p ? PyList_New(0) : nullptr), fresh(rates.p ? PyList_New(0) : nullptr);  // (group, rate) pairs; new sets
  if (!fresh.p) return nullptr;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(stacks.p); ++i) {
    PyObject* stack = PyList_GET_ITEM(stacks.p, i);
    PyRef rate(reuse_after(stack, reuse, seen.p, decay, prior));
    if (!rate.p) return nullptr;
    if (rate.p != Py_None) {
      PyRef group(kGroup(stack)), pair(group.p ? PyTuple_Pack(2, group.p, rate.p) : nullptr);
      if (!pair.p || PyList_Append(rates.p, pair.p) < 0) return nullptr;
    }
    PyRef empty(turn ? PySet_New(nullptr) : nullptr);
    if (turn && (!empty.p || PyList_Append(fresh.p, empty.p) < 0)) return nullptr;
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(rates.p); ++i) {
    PyObject* pair = PyList_GET_ITEM(rates.p, i);
    if (PyObject_SetItem(reuse, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1)) < 0) return nullptr;
  }
  for (Py_ssize_t i = 0; turn && i < PyList_GET_SIZE(stacks.p); ++i) {
    PyObject* stack = PyList_GET_ITEM(stacks.p, i);
    PyRef used(kUsed(stack));
    if (!used.p || !kLastUsed.set(stack, used.p) || !kUsed.set(stack, PyList_GET_ITEM(fresh.p, i))) return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"expert_accessed", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(expert_accessed)), METH_FASTCALL,
     "An op paged an expert (offtensor/moe/stacks.py: ExpertStacks.accessed)."},
    {"expert_copied", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(expert_copied)), METH_FASTCALL,
     "The pager copied an expert (offtensor/moe/stacks.py: ExpertStacks.copied)."},
    {"expert_evicted", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(expert_evicted)), METH_FASTCALL,
     "The pager evicted a cached copy (offtensor/moe/stacks.py: ExpertStacks.evicted)."},
    {"measure_reuse", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(measure_reuse)), METH_FASTCALL,
     "Each layer's reuse rate after a step, and every stack's turn (offtensor/moe/eviction.py: ExpertEviction.measure_reuse)."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

PyMethodDef* bookkeeping_methods() { return kMethods; }

}  // namespace offtensor
