// Attributes of the policy's objects read and written where their classes keep them, in __slots__
// (csrc/eviction.cpp's victim search, csrc/policy.cpp's and csrc/guess_records.cpp's guess loops):
// without the interpreter's generic path through the class at every access.
#pragma once

#include <Python.h>
#include <structmember.h>

#include "pyref.h"

namespace offtensor {
namespace {

// `obj.name` for objects whose class keeps `name` in a slot (__slots__: a cached copy's users, a
// stack's keys, KeptBest's lists, a router's records): read at the slot's offset, as its member
// descriptor reads it, once the class is known to keep it there (the look-up through the class cost
// more than the rest of the read); any other object through PyObject_GetAttr. The class is
// remembered with its version tag, which the interpreter renews whenever an attribute of the class
// or of a base is set: a class changed since is looked at again. A new reference, or nullptr with
// an exception set. ``set`` writes one likewise (as the member descriptor writes it), where the
// slot is writable; else through PyObject_SetAttr.
class Slot {
 public:
  explicit Slot(const char* name) : name_(PyUnicode_InternFromString(name)) {}

  PyObject* operator()(PyObject* obj) {
    PyTypeObject* type = Py_TYPE(obj);
    if (reinterpret_cast<PyObject*>(type) != type_.p || !current(type)) learn(type);
    if (offset_ >= 0) {
      PyObject* value = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset_);
      if (value != nullptr) return Py_NewRef(value);  // (unset: the attribute read raises, below)
    }
    return name_ ? PyObject_GetAttr(obj, name_) : nullptr;
  }

  // `obj.name = value`: false with an exception set.
  bool set(PyObject* obj, PyObject* value) {
    PyTypeObject* type = Py_TYPE(obj);
    if (reinterpret_cast<PyObject*>(type) != type_.p || !current(type)) learn(type);
    if (offset_ >= 0 && writable_) {
      PyObject** slot = reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset_);
      PyObject* old = *slot;
      *slot = Py_NewRef(value);
      Py_XDECREF(old);
      return true;
    }
    return name_ && PyObject_SetAttr(obj, name_, value) == 0;
  }

 private:
  bool current(PyTypeObject* type) const {
#if PY_VERSION_HEX < 0x030C0000
    if (!(type->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG)) return false;
#endif
    return type->tp_version_tag != 0 && type->tp_version_tag == version_;
  }

  void learn(PyTypeObject* type) {
    PyObject* old = type_.release();
    type_.p = Py_NewRef(reinterpret_cast<PyObject*>(type));  // (held: no other class reuses its address)
    Py_XDECREF(old);
    offset_ = -1;
    version_ = 0;
    writable_ = false;
    if (name_ == nullptr || type->tp_getattro != PyObject_GenericGetAttr) return;
    // The class's own attribute: a slot's member descriptor (a data descriptor: it wins over an
    // instance dict, as the attribute read's own look-up finds).
    PyRef found(PyObject_GetAttr(reinterpret_cast<PyObject*>(type), name_));
    if (!found.p) {
      PyErr_Clear();
      return;
    }
    if (!Py_IS_TYPE(found.p, &PyMemberDescr_Type)) return;
    auto* descr = reinterpret_cast<PyMemberDescrObject*>(found.p);
    const PyMemberDef* member = descr->d_member;
    if (!PyType_IsSubtype(type, PyDescr_TYPE(descr)) || (member->type != T_OBJECT_EX && member->type != T_OBJECT) ||
        (member->flags & READ_RESTRICTED))
      return;
    version_ = type->tp_version_tag;  // (the look-up above gave the class one)
    if (current(type)) offset_ = member->offset;
    writable_ = !(member->flags & READONLY) && type->tp_setattro == PyObject_GenericSetAttr;
  }

  PyObject* name_;
  PyRef type_;  // the class last seen
  unsigned int version_ = 0;
  Py_ssize_t offset_ = -1;  // its slot's offset for `name`, or -1: read through PyObject_GetAttr
  bool writable_ = false;  // whether `set` may write the slot there (else through PyObject_SetAttr)
};

}  // namespace
}  // namespace offtensor
