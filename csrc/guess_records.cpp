// The records of a router's routing guesses (offtensor/moe/guesses.py: Router): which confidence
// bins pay for a copy, which experts of a guess are worth one, and the scoring of its open guesses
// against the experts its layer paged at a pass's end. Each is the interpreter's code step by step on
// the router's own attributes (its __slots__, csrc/slots.h) and lists, in the same double arithmetic
// and order, so the records are the same bit for bit with or without this extension; each in one
// call, where the interpreter took hundreds of steps a layer (every MoE layer of every decode step),
// so a Ctrl-C lands before or after it, never inside.
#include <Python.h>

#include <cstdint>

#include "pyref.h"
#include "slots.h"

namespace offtensor {
namespace {

// `item in container` (a set, a dict's keys, or any container): 1, 0, or -1 with an exception set.
int contains(PyObject* container, PyObject* item) {
  if (PyAnySet_Check(container)) return PySet_Contains(container, item);
  if (PyDict_Check(container)) return PyDict_Contains(container, item);
  return PySequence_Contains(container, item);
}

// `f(item)` for each item of a set, a dict (its keys) or any iterable, in its iteration order; f
// returns false with an exception set to stop. The set or dict is not changed meanwhile (f only
// reads it and others), so its items are borrowed.
template <typename F>
bool each(PyObject* items, F&& f) {
#if PY_VERSION_HEX < 0x030D0000
  if (PyAnySet_Check(items)) {
    Py_ssize_t pos = 0;
    PyObject* item;
    Py_hash_t hash;
    while (_PySet_NextEntry(items, &pos, &item, &hash))
      if (!f(item)) return false;
    return true;
  }
#endif
  if (PyDict_Check(items)) {
    Py_ssize_t pos = 0;
    PyObject *item, *value;
    while (PyDict_Next(items, &pos, &item, &value))
      if (!f(item)) return false;
    return true;
  }
  PyRef it(PyObject_GetIter(items));
  if (!it.p) return false;
  while (PyObject* item = PyIter_Next(it.p)) {
    const bool go_on = f(item);
    Py_DECREF(item);
    if (!go_on) return false;
  }
  return !PyErr_Occurred();
}

// How many of ``items`` are in ``container`` (-1 with an exception set).
Py_ssize_t count_in(PyObject* items, PyObject* container) {
  Py_ssize_t n = 0;
  const bool done = each(items, [&](PyObject* item) {
    const int found = contains(container, item);
    n += found > 0;
    return found >= 0;
  });
  return done ? n : -1;
}

// ``record[i]`` of a list or tuple of numbers as a double (false with an exception set).
bool item_double(PyObject* record, Py_ssize_t i, double* out) {
  PyObject* item;
  if (PyList_Check(record) && i < PyList_GET_SIZE(record)) {
    item = PyList_GET_ITEM(record, i);
  } else if (PyTuple_Check(record) && i < PyTuple_GET_SIZE(record)) {
    item = PyTuple_GET_ITEM(record, i);
  } else {
    PyRef held(PySequence_GetItem(record, i));
    if (!held.p) return false;
    *out = PyFloat_AsDouble(held.p);
    return !(*out == -1.0 && PyErr_Occurred());
  }
  *out = PyFloat_CheckExact(item) ? PyFloat_AS_DOUBLE(item) : PyFloat_AsDouble(item);
  return !(*out == -1.0 && PyErr_Occurred());
}

// ``pool[i]`` (the shared records: a tuple of four lists) as a new reference.
PyObject* pool_item(PyObject* pool, Py_ssize_t i) {
  if (PyTuple_CheckExact(pool) && i < PyTuple_GET_SIZE(pool)) return Py_NewRef(PyTuple_GET_ITEM(pool, i));
  return PySequence_GetItem(pool, i);
}

// A router's attributes (guesses.Router's __slots__) and a stack's (moe.stack.Stack's), each read
// and written at its slot: one reader per class (a reader learns one class at a time).
struct Slots {
  Slot bin_correct{"bin_correct"}, bin_guessed{"bin_guessed"}, bin2_correct{"bin2_correct"},
      bin2_guessed{"bin2_guessed"}, evidence{"evidence"}, copied{"copied"}, guess{"guess"}, guess2{"guess2"},
      cached{"cached"}, cached2{"cached2"}, misses{"misses"}, routed{"routed"}, guessed{"guessed"},
      correct{"correct"}, copied2{"copied2"}, copied2_experts{"copied2_experts"},
      copied2_correct{"copied2_correct"}, copied_experts{"copied_experts"}, copied_correct{"copied_correct"},
      wasted_bytes{"wasted_bytes"}, guess_tokens{"guess_tokens"}, top_k{"top_k"},
      uncached_guessed{"uncached_guessed"}, uncached_correct{"uncached_correct"}, stacks{"stacks"},
      tokens{"tokens"}, next_pass{"next_pass"}, missed{"missed"}, misses_seen{"misses_seen"};
  Slot stack_used{"used"}, stack_misses{"misses"};
};

Slots& slots() {
  static Slots* made = new Slots();  // (at the first call, under the GIL; kept for the process)
  return *made;
}

// ``obj == 1`` for a count (an int, or anything): 1, 0, or -1 with an exception set.
int is_one(PyObject* obj) {
  if (PyLong_CheckExact(obj)) {
    int overflow = 0;
    const long value = PyLong_AsLongAndOverflow(obj, &overflow);
    if (value == -1 && PyErr_Occurred()) return -1;
    return !overflow && value == 1;
  }
  PyRef one(PyLong_FromLong(1));
  return one.p ? PyObject_RichCompareBool(obj, one.p, Py_EQ) : -1;
}

// The confidence bins of ``router``'s guesses made ``ahead`` layers ahead that pay for a copy under
// a fixed ``gate``, as a bit mask (bin b: bit b; false with an exception set), from its decayed
// counts (bin_correct, bin_guessed; two ahead bin2_correct, bin2_guessed) and, for a bin short of
// its ``evidence`` guesses, the shared ones (``pool``: every router's, ((correct, guessed) one
// ahead, then two ahead); None: none): guessed >= evidence and correct >= gate * guessed, over the
// bins of the shortest record (guesses.Router.paying: zip's).
bool paying_mask(PyObject* router, PyObject* pool, int ahead, double gate, uint64_t* mask) {
  Slots& at = slots();
  PyRef lists[4];
  lists[0].p = (ahead == 1 ? at.bin_correct : at.bin2_correct)(router);
  lists[1].p = lists[0].p ? (ahead == 1 ? at.bin_guessed : at.bin2_guessed)(router) : nullptr;
  if (!lists[1].p) return false;
  for (int i = 0; i < 2; ++i) {
    lists[2 + i].p = pool_item(pool, 2 * (ahead == 1 ? 0 : 1) + i);
    if (!lists[2 + i].p) return false;
  }
  PyRef evidence_obj(at.evidence(router));
  if (!evidence_obj.p) return false;
  const double evidence = PyFloat_AsDouble(evidence_obj.p);
  if (evidence == -1.0 && PyErr_Occurred()) return false;
  Py_ssize_t n = PY_SSIZE_T_MAX;
  for (int i = 0; i < 4; ++i) {
    const Py_ssize_t size = PyObject_Length(lists[i].p);
    if (size < 0) return false;
    n = size < n ? size : n;
  }
  if (n > 64) {
    PyErr_SetString(PyExc_ValueError, "offtensor: at most 64 confidence bins");
    return false;
  }
  *mask = 0;
  for (Py_ssize_t b = 0; b < n; ++b) {
    double correct, guessed;
    if (!item_double(lists[0].p, b, &correct) || !item_double(lists[1].p, b, &guessed)) return false;
    if (guessed < evidence &&  // (the pool's until it has evidence)
        (!item_double(lists[2].p, b, &correct) || !item_double(lists[3].p, b, &guessed)))
      return false;
    if (guessed >= evidence && correct >= gate * guessed) *mask |= uint64_t{1} << b;
  }
  return true;
}

// The router, pool, ahead and gate of paying_bins and worth_copies (false with an exception set).
bool gate_args(PyObject* const* args, int* ahead, double* gate) {
  const long value = PyLong_AsLong(args[2]);
  if (value == -1 && PyErr_Occurred()) return false;
  *ahead = value == 1 ? 1 : 2;
  *gate = PyFloat_AsDouble(args[3]);
  return !(*gate == -1.0 && PyErr_Occurred());
}

// paying_bins(router, pool, ahead, gate): the paying bins' mask (guesses.Router.paying).
PyObject* paying_bins(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "offtensor: paying_bins(router, pool, ahead, gate)");
    return nullptr;
  }
  int ahead;
  double gate;
  uint64_t mask;
  if (!gate_args(args, &ahead, &gate) || !paying_mask(args[0], args[1], ahead, gate, &mask)) return nullptr;
  return PyLong_FromUnsignedLongLong(mask);
}

// The experts of a guess (``bins``: a dict of expert -> its bin, the most confident first) worth a
// copy, in that order: not ``cached``, not copied by the router's open guesses yet (router.copied),
// and in a bin that pays (guesses.Router.worth); a new list, or nullptr with an exception set.
PyObject* worth_list(PyObject* router, PyObject* pool, int ahead, double gate, PyObject* bins_dict, PyObject* cached) {
  uint64_t mask;
  if (!paying_mask(router, pool, ahead, gate, &mask)) return nullptr;
  PyRef out(PyList_New(0));
  if (!out.p || mask == 0) return out.release();
  PyRef copied(slots().copied(router));
  if (!copied.p) return nullptr;
  PyRef bins(Py_NewRef(bins_dict));
  Py_ssize_t pos = 0;
  PyObject *expert, *bin;
  while (PyDict_Next(bins.p, &pos, &expert, &bin)) {
    const Py_ssize_t b = PyNumber_AsSsize_t(bin, PyExc_OverflowError);
    if (b == -1 && PyErr_Occurred()) return nullptr;
    if (b < 0) {
      PyErr_SetString(PyExc_ValueError, "negative shift count");  // (as the interpreter's mask >> b)
      return nullptr;
    }
    if (b >= 64 || !(mask >> b & 1)) continue;
    const int is_cached = contains(cached, expert);
    if (is_cached < 0) return nullptr;
    if (is_cached) continue;
    const int is_copied = contains(copied.p, expert);
    if (is_copied < 0) return nullptr;
    if (!is_copied && PyList_Append(out.p, expert) < 0) return nullptr;
  }
  return out.release();
}

// worth_copies(router, pool, ahead, gate, bins, cached): worth_list (guesses.Router.worth).
PyObject* worth_copies(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6 || !PyDict_Check(args[4])) {
    PyErr_SetString(PyExc_TypeError, "offtensor: worth_copies(router, pool, ahead, gate, bins, cached)");
    return nullptr;
  }
  int ahead;
  double gate;
  if (!gate_args(args, &ahead, &gate)) return nullptr;
  return worth_list(args[0], args[1], ahead, gate, args[4], args[5]);
}

// open_guess(router, bins, cached, tokens, ahead, pool, gate): guesses.open_guess, a guess of
// ``router``'s layer made ``ahead`` layers before it opened on its records (bins, the experts
// ``cached`` then, and with it the copies it may make), and the experts worth a copy (worth_list;
// an empty list with ``gate`` None: nothing is copied). None, with nothing changed, where an open
// guess must be scored first (one left open by a pass that did not end). Everything that can fail
// (the new dict and set) is made before the first store; the stores cannot.
PyObject* open_guess(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 7 || !PyDict_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "offtensor: open_guess(router, bins, cached, tokens, ahead, pool, gate)");
    return nullptr;
  }
  PyObject *router = args[0], *bins = args[1], *cached = args[2], *tokens = args[3], *pool = args[5];
  const long ahead_value = PyLong_AsLong(args[4]);
  if (ahead_value == -1 && PyErr_Occurred()) return nullptr;
  const int ahead = ahead_value == 1 ? 1 : 2;
  double gate = 0.0;
  if (args[6] != Py_None) {
    gate = PyFloat_AsDouble(args[6]);
    if (gate == -1.0 && PyErr_Occurred()) return nullptr;
  }
  Slots& at = slots();
  PyRef first(at.guess(router));
  PyRef second(first.p ? at.guess2(router) : nullptr);
  if (!second.p) return nullptr;
  if (first.p != Py_None || (ahead == 2 && second.p != Py_None)) Py_RETURN_NONE;  // (scored first)
  PyRef fresh(ahead == 2 || second.p == Py_None ? PyDict_New() : Py_NewRef(Py_None));
  PyRef fresh2(ahead == 2 ? PySet_New(nullptr) : Py_NewRef(Py_None));
  if (!fresh.p || !fresh2.p) return nullptr;
  if (ahead == 1) {
    if (!at.guess.set(router, bins) || !at.cached.set(router, cached) || !at.guess_tokens.set(router, tokens))
      return nullptr;
    if (second.p == Py_None && !at.copied.set(router, fresh.p)) return nullptr;
  } else if (!at.guess2.set(router, bins) || !at.cached2.set(router, cached) || !at.copied.set(router, fresh.p) ||
             !at.copied2.set(router, fresh2.p)) {
    return nullptr;
  }
  if (args[6] == Py_None) return PyList_New(0);
  return worth_list(router, pool, ahead, gate, bins, cached);
}

// ---------------------------------------------------------------------------------------------
// A router's open guesses scored against the experts its layer paged (guesses.score, after its
// ``used`` is known): its counts, its bins' decayed records and the shared pool's, the guessed
// experts' copies; returns the experts copied that its layer did not page.

// ``obj.<slot> += delta`` (Python's addition: the counters stay what they are, ints).
bool add_count(Slot& slot, PyObject* obj, Py_ssize_t delta) {
  PyRef value(slot(obj));
  if (!value.p) return false;
  PyRef step(PyLong_FromSsize_t(delta));
  if (!step.p) return false;
  PyRef sum(PyNumber_InPlaceAdd(value.p, step.p));
  return sum.p && slot.set(obj, sum.p);
}

// ``record[b] = decay * record[b] + add`` on a list of floats (b as Python indexes a list).
bool decay_into(PyObject* record, Py_ssize_t b, double decay, double add) {
  if (!PyList_Check(record)) {
    PyErr_SetString(PyExc_TypeError, "offtensor: a bin record is a list of numbers");
    return false;
  }
  const Py_ssize_t i = b < 0 ? b + PyList_GET_SIZE(record) : b;
  if (i < 0 || i >= PyList_GET_SIZE(record)) {
    PyErr_SetString(PyExc_IndexError, "list index out of range");
    return false;
  }
  const double old = PyFloat_AsDouble(PyList_GET_ITEM(record, i));
  if (old == -1.0 && PyErr_Occurred()) return false;
  PyObject* now = PyFloat_FromDouble(decay * old + add);
  return now != nullptr && PyList_SetItem(record, i, now) == 0;
}

// Router.record: one uncached guess in bin ``b``, right or not, made ``ahead`` layers before.
bool record(PyObject* router, PyObject* bin, bool right, int ahead, PyObject* pool, double decay) {
  Slots& at = slots();
  if (ahead == 1 && (!add_count(at.uncached_guessed, router, 1) || !add_count(at.uncached_correct, router, right)))
    return false;
  const Py_ssize_t b = PyNumber_AsSsize_t(bin, PyExc_IndexError);
  if (b == -1 && PyErr_Occurred()) return false;
  PyRef correct((ahead == 1 ? at.bin_correct : at.bin2_correct)(router));
  PyRef guessed(correct.p ? (ahead == 1 ? at.bin_guessed : at.bin2_guessed)(router) : nullptr);
  PyRef pool_correct(guessed.p ? pool_item(pool, ahead == 1 ? 0 : 2) : nullptr);
  PyRef pool_guessed(pool_correct.p ? pool_item(pool, ahead == 1 ? 1 : 3) : nullptr);
  const double hit = right ? 1.0 : 0.0;
  return pool_guessed.p && decay_into(correct.p, b, decay, hit) && decay_into(guessed.p, b, decay, 1.0) &&
         decay_into(pool_correct.p, b, decay, hit) && decay_into(pool_guessed.p, b, decay, 1.0);
}

// One open guess (expert -> bin) of ``ahead``: each guess of an expert not ``cached`` recorded.
bool record_guess(PyObject* router, PyObject* guess, PyObject* cached, PyObject* used, int ahead, PyObject* pool,
                  double decay) {
  if (!PyDict_Check(guess)) {
    PyErr_SetString(PyExc_TypeError, "offtensor: an open guess is a dict of expert -> bin");
    return false;
  }
  Py_ssize_t pos = 0;
  PyObject *expert, *bin;
  while (PyDict_Next(guess, &pos, &expert, &bin)) {
    const int was_cached = contains(cached, expert);
    if (was_cached < 0) return false;
    if (was_cached) continue;  // (a guess of a cached expert costs nothing and saves nothing)
    const int right = contains(used, expert);
    if (right < 0 || !record(router, bin, right, ahead, pool, decay)) return false;
  }
  return true;
}

// guesses.score with ``used`` (a set) given: the wrong copies (a new list), or nullptr with an
// exception set.
PyObject* score_open(PyObject* router, PyObject* pool, PyObject* used, double decay) {
  Slots& at = slots();
  PyRef first(at.guess(router));
  PyRef second(first.p ? at.guess2(router) : nullptr);
  if (!second.p) return nullptr;
  if (first.p == Py_None && second.p == Py_None) return PyList_New(0);
  if (!at.guess.set(router, Py_None) || !at.guess2.set(router, Py_None)) return nullptr;
  const Py_ssize_t n_used = PyObject_Size(used);
  if (n_used < 0) return nullptr;
  if (n_used == 0) return PyList_New(0);  // its layer has not run yet: nothing to score against
  // The misses a guess could cover: routed experts not cached when the first guess was made.
  {
    PyRef cached_first((second.p != Py_None ? at.cached2 : at.cached)(router));
    const Py_ssize_t inside = cached_first.p ? count_in(used, cached_first.p) : -1;
    if (inside < 0 || !add_count(at.misses, router, n_used - inside) || !add_count(at.routed, router, n_used))
      return nullptr;
  }
  for (int ahead = 1; ahead <= 2; ++ahead) {
    PyObject* open = ahead == 1 ? first.p : second.p;
    if (open == Py_None) continue;
    PyRef was_cached((ahead == 1 ? at.cached : at.cached2)(router));
    if (!was_cached.p) return nullptr;
    if (ahead == 1) {
      const Py_ssize_t n = PyObject_Size(open), right = count_in(open, used);
      if (n < 0 || right < 0 || !add_count(at.guessed, router, n) || !add_count(at.correct, router, right))
        return nullptr;
    }
    if (!record_guess(router, open, was_cached.p, used, ahead, pool, decay)) return nullptr;
    if (ahead == 2) {
      PyRef copies(at.copied2(router));
      if (!copies.p) return nullptr;
      const Py_ssize_t n = PyObject_Size(copies.p), right = count_in(copies.p, used);
      if (n < 0 || right < 0 || !add_count(at.copied2_experts, router, n) || !add_count(at.copied2_correct, router, right))
        return nullptr;
    }
  }
  PyRef copies(at.copied(router));
  if (!copies.p) return nullptr;
  if (!PyDict_Check(copies.p)) {
    PyErr_SetString(PyExc_TypeError, "offtensor: a router's copies are a dict of expert -> bytes");
    return nullptr;
  }
  const Py_ssize_t n_copied = PyDict_GET_SIZE(copies.p), right = count_in(copies.p, used);
  if (right < 0 || !add_count(at.copied_experts, router, n_copied) || !add_count(at.copied_correct, router, right))
    return nullptr;
  PyRef wrong(PyList_New(0)), wasted(PyLong_FromLong(0));
  if (!wrong.p || !wasted.p) return nullptr;
  Py_ssize_t pos = 0;
  PyObject *expert, *nbytes;
  while (PyDict_Next(copies.p, &pos, &expert, &nbytes)) {
    const int found = contains(used, expert);
    if (found < 0) return nullptr;
    if (found) continue;
    if (PyList_Append(wrong.p, expert) < 0) return nullptr;
    PyObject* sum = PyNumber_Add(wasted.p, nbytes);  // (sum()'s order: 0, then each wrong copy's bytes)
    if (sum == nullptr) return nullptr;
    Py_SETREF(wasted.p, sum);
  }
  {
    PyRef before(at.wasted_bytes(router));
    PyRef after(before.p ? PyNumber_InPlaceAdd(before.p, wasted.p) : nullptr);
    PyRef fresh(after.p ? PyDict_New() : nullptr);
    if (!fresh.p || !at.wasted_bytes.set(router, after.p) || !at.copied.set(router, fresh.p)) return nullptr;
  }
  PyRef tokens(at.guess_tokens(router));
  const int one_token = tokens.p ? is_one(tokens.p) : -1;
  if (one_token < 0) return nullptr;
  PyRef k(one_token ? at.top_k(router) : Py_NewRef(Py_None));
  if (!k.p) return nullptr;
  if (one_token && k.p == Py_None) {  // (one token picks exactly top_k experts)
    PyRef count(PyLong_FromSsize_t(n_used));
    if (!count.p || !at.top_k.set(router, count.p)) return nullptr;
  }
  return wrong.release();
}

// score_guess(router, pool, used, decay): guesses.score with ``used`` given.
PyObject* score_guess(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "offtensor: score_guess(router, pool, used, decay)");
    return nullptr;
  }
  const double decay = PyFloat_AsDouble(args[3]);
  if (decay == -1.0 && PyErr_Occurred()) return nullptr;
  return score_open(args[0], args[1], args[2], decay);
}

// close_step(router, pool, decay): guesses.close_step, a pass's end for one router: the experts its
// stacks paged this pass (one token picks exactly top_k of them), its open guesses scored unless
// made for the pass to come, whether its stacks missed since the last; returns its wrong copies.
PyObject* close_step(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "offtensor: close_step(router, pool, decay)");
    return nullptr;
  }
  PyObject *router = args[0], *pool = args[1];
  const double decay = PyFloat_AsDouble(args[2]);
  if (decay == -1.0 && PyErr_Occurred()) return nullptr;
  Slots& at = slots();
  PyRef stack_list(at.stacks(router));
  if (!stack_list.p) return nullptr;
  PyRef fast(PySequence_Fast(stack_list.p, "offtensor: a router's stacks are a list"));
  if (!fast.p) return nullptr;
  const Py_ssize_t n_stacks = PySequence_Fast_GET_SIZE(fast.p);
  PyRef paged(PySet_New(nullptr));  // (its layer's experts paged this pass: read once, for top_k and the score)
  if (!paged.p) return nullptr;
  for (Py_ssize_t i = 0; i < n_stacks; ++i) {
    PyRef of_stack(at.stack_used(PySequence_Fast_GET_ITEM(fast.p, i)));
    PyObject* merged = of_stack.p ? PyNumber_InPlaceOr(paged.p, of_stack.p) : nullptr;  // (used |= stack.used)
    if (merged == nullptr) return nullptr;
    Py_SETREF(paged.p, merged);
  }
  const Py_ssize_t n_used = PyObject_Size(paged.p);
  PyRef n_tokens(at.tokens(router));
  if (n_used < 0 || !n_tokens.p) return nullptr;
  const int one_token = is_one(n_tokens.p);
  if (one_token < 0) return nullptr;
  if (one_token && n_used) {
    PyRef count(PyLong_FromSsize_t(n_used));
    if (!count.p || !at.top_k.set(router, count.p)) return nullptr;
  }
  PyRef next(at.next_pass(router));
  const int for_next = next.p ? PyObject_IsTrue(next.p) : -1;
  if (for_next < 0) return nullptr;
  PyRef wrong(for_next ? PyList_New(0) : score_open(router, pool, paged.p, decay));
  if (!wrong.p) return nullptr;
  if (for_next && !at.next_pass.set(router, Py_False)) return nullptr;  // (scored once that pass has run)
  PyRef total(PyLong_FromLong(0));  // (sum()'s order: 0, then each stack's)
  if (!total.p) return nullptr;
  for (Py_ssize_t i = 0; i < n_stacks; ++i) {
    PyRef count(at.stack_misses(PySequence_Fast_GET_ITEM(fast.p, i)));
    PyObject* sum = count.p ? PyNumber_Add(total.p, count.p) : nullptr;
    if (sum == nullptr) return nullptr;
    Py_SETREF(total.p, sum);
  }
  PyRef seen(at.misses_seen(router));
  PyRef changed(seen.p ? PyObject_RichCompare(total.p, seen.p, Py_NE) : nullptr);  // (a reset reads as a miss)
  if (!changed.p || !at.missed.set(router, changed.p) || !at.misses_seen.set(router, total.p)) return nullptr;
  return wrong.release();
}

PyMethodDef kMethods[] = {
    {"paying_bins", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(paying_bins)), METH_FASTCALL,
     "The confidence bins that pay for a copy (offtensor/moe/guesses.py: Router.paying)."},
    {"worth_copies", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(worth_copies)), METH_FASTCALL,
     "A guess's experts worth a copy (offtensor/moe/guesses.py: Router.worth)."},
    {"open_guess", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(open_guess)), METH_FASTCALL,
     "A guess opened on its router's records, and its experts worth a copy (offtensor/moe/guesses.py: open_guess)."},
    {"score_guess", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(score_guess)), METH_FASTCALL,
     "A router's open guesses scored against its layer's experts (offtensor/moe/guesses.py: score)."},
    {"close_step", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(close_step)), METH_FASTCALL,
     "A pass's end for one router: its guesses scored, its misses (offtensor/moe/guesses.py: close_step)."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

// This file's entries of the module's method table (policy_methods in csrc/policy.cpp).
PyMethodDef* record_methods() { return kMethods; }

}  // namespace offtensor
