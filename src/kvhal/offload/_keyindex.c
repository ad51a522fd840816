/*
 * kvhal.offload._keyindex: the offloading manager's key -> slot index, compactly.
 *
 * A Python dict costs 54-105 bytes an entry under churn (its table grows to
 * a power of two >= 3x the entries) plus a 28-byte int object per slot value,
 * which alone breaks the manager's 128 bytes per tracked block. Here the
 * number of entries is bounded by the slot count, so the table never grows:
 * open addressing with linear probing over int32 slot ids (a power of two >=
 * 2x the slots: 8-16 bytes a slot), the keys held once, by slot (8 bytes a
 * slot), and deletion by backward shift, so churn leaves no tombstones.
 * Memory comes from PyMem_Calloc, which tracemalloc traces. Slots are
 * returned as the caller's own int objects (``ids``, the slot pool's tuple),
 * so a lookup allocates nothing and every holder shares one int a slot.
 *
 * Keys are exact bytes, never a subclass (their hash is cached in the object,
 * so probing never rehashes, and no caller's __hash__ or __eq__ runs). The
 * pure-Python fallback in kvhal/keyindex.py has the same API.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "_slots.h"

typedef struct {
    PyObject_HEAD
    Py_ssize_t num_slots;
    Py_ssize_t count;
    size_t mask;
    int32_t *table; /* bucket -> slot, -1 when empty */
    PyObject **keys; /* slot -> key (strong reference) or NULL */
    PyObject *ids;   /* tuple: ids[slot] is the int object returned for slot */
} KeyIndex;

/*
 * No Python code runs while the index is probed or changed: keys are exact bytes (their
 * hash is cached and their comparison is bytes_richcompare's, so no __hash__ or __eq__ of a
 * caller's), and every argument that may run Python code (an iterable, a slot's __index__)
 * is turned into a tuple or C ints first, so nothing borrowed can be freed under us.
 */

/* Whether __init__ ran to its end (and tp_clear did not undo it); else a RuntimeError. */
static int ready(KeyIndex *self) {
    if (self->table != NULL && self->keys != NULL && self->ids != NULL) return 1;
    PyErr_SetString(PyExc_RuntimeError, "KeyIndex is not initialized: create it as KeyIndex(ids)");
    return 0;
}

static int check_key(PyObject *key) {
    if (PyBytes_CheckExact(key)) return 0;
    PyErr_Format(PyExc_TypeError, "keys are bytes (not a subclass), got %.60s", Py_TYPE(key)->tp_name);
    return -1;
}

static int same_bytes(PyObject *a, PyObject *b) {
    Py_ssize_t n = PyBytes_GET_SIZE(a);
    return n == PyBytes_GET_SIZE(b) && memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), (size_t)n) == 0;
}

/* The bucket holding ``key`` (an exact bytes; *slot its slot) or the empty bucket ending its
 * probe (*slot -1). Runs no Python code: the stored keys are exact bytes too. */
static size_t find(KeyIndex *self, PyObject *key, Py_hash_t hash, int32_t *slot) {
    size_t i = (size_t)hash & self->mask;
    for (;;) {
        int32_t s = self->table[i];
        if (s < 0) break;
        PyObject *k = self->keys[s];
        if (k == key || (PyObject_Hash(k) == hash && same_bytes(k, key))) {
            *slot = s;
            return i;
        }
        i = (i + 1) & self->mask;
    }
    *slot = -1;
    return i;
}

/* Slot of ``key`` or -1; -2 with an exception set (the index not ready, or not a bytes). */
static int32_t slot_of(KeyIndex *self, PyObject *key) {
    if (!ready(self) || check_key(key) < 0) return -2;
    int32_t slot;
    find(self, key, PyObject_Hash(key), &slot); /* an exact bytes' hash cannot fail */
    return slot;
}

/* Empty ``bucket``, shifting later entries of its probe run back (no tombstones). */
static void delete_bucket(KeyIndex *self, size_t hole) {
    size_t mask = self->mask, j = hole;
    for (;;) {
        j = (j + 1) & mask;
        int32_t s = self->table[j];
        if (s < 0) break;
        size_t home = (size_t)PyObject_Hash(self->keys[s]) & mask; /* cached: cannot fail */
        if (((j - home) & mask) >= ((j - hole) & mask)) {
            self->table[hole] = s;
            hole = j;
        }
    }
    self->table[hole] = -1;
}

static int check_slot(KeyIndex *self, PyObject *obj, int32_t *out) {
    Py_ssize_t slot = PyLong_AsSsize_t(obj); /* may run obj's __index__: call before using anything */
    if (slot == -1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
        PyErr_Clear(); /* beyond any C int: out of range, as the Python index says */
        PyErr_Format(PyExc_ValueError, "slot %R is not in [0, %zd)", obj, self->num_slots);
        return -1;
    }
    if (slot < 0 || slot >= self->num_slots) {
        PyErr_Format(PyExc_ValueError, "slot %zd is not in [0, %zd)", slot, self->num_slots);
        return -1;
    }
    *out = (int32_t)slot;
    return 0;
}

/* Every slot of the tuple ``slots`` as a C int (into a PyMem block the caller frees), before
 * the index is touched: a slot's __index__ may run Python code. NULL with an exception set. */
static int32_t *slot_array(KeyIndex *self, PyObject *slots) {
    Py_ssize_t n = PyTuple_GET_SIZE(slots);
    int32_t *out = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int32_t));
    if (out == NULL) return (int32_t *)PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        if (check_slot(self, PyTuple_GET_ITEM(slots, i), &out[i]) < 0) {
            PyMem_Free(out);
            return NULL;
        }
    }
    return out;
}

/* Remove the entry in ``slot``; returns its key (the index's reference) or NULL if empty. */
static PyObject *remove_slot(KeyIndex *self, int32_t slot) {
    PyObject *key = self->keys[slot];
    if (key == NULL) return NULL;
    int32_t found;
    delete_bucket(self, find(self, key, PyObject_Hash(key), &found)); /* identity match */
    self->keys[slot] = NULL;
    self->count--;
    return key;
}

/* Add an exact bytes ``key`` to the empty ``slot``: 0, else what refused it (no exception set,
 * so that the caller can undo its earlier adds before raising). */
enum { ADDED, SLOT_TAKEN, KEY_PRESENT };
static int add_one(KeyIndex *self, PyObject *key, int32_t slot, int32_t *found) {
    if (self->keys[slot] != NULL) return SLOT_TAKEN;
    size_t bucket = find(self, key, PyObject_Hash(key), found);
    if (*found >= 0) return KEY_PRESENT;
    self->keys[slot] = Py_NewRef(key);
    self->table[bucket] = slot;
    self->count++;
    return ADDED;
}

static int KeyIndex_init(KeyIndex *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ids", NULL};
    PyObject *ids;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!", kwlist, &PyTuple_Type, &ids)) return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(ids);
    if (n <= 0 || n > INT32_MAX / 2) {
        PyErr_Format(PyExc_ValueError, "ids must hold 1 to %d slots, got %zd", INT32_MAX / 2, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *id = PyTuple_GET_ITEM(ids, i);
        if (!PyLong_CheckExact(id) || PyLong_AsSsize_t(id) != i) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "ids[%zd] must be the int %zd", i, i);
            return -1;
        }
    }
    if (self->table != NULL || self->keys != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "KeyIndex is already initialized");
        return -1;
    }
    size_t size = 8;
    while (size < (size_t)n * 2) size <<= 1;
    int32_t *table = PyMem_Malloc(size * sizeof(int32_t));
    PyObject **keys = PyMem_Calloc((size_t)n, sizeof(PyObject *));
    if (table == NULL || keys == NULL) { /* all or nothing: a half-made index stays unready */
        PyMem_Free(table);
        PyMem_Free(keys);
        PyErr_NoMemory();
        return -1;
    }
    memset(table, 0xff, size * sizeof(int32_t)); /* -1 everywhere */
    self->num_slots = n;
    self->mask = size - 1;
    self->count = 0;
    self->table = table;
    self->keys = keys;
    Py_XSETREF(self->ids, Py_NewRef(ids));
    return 0;
}

static int KeyIndex_traverse(KeyIndex *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->ids);
    if (self->keys != NULL)
        for (Py_ssize_t i = 0; i < self->num_slots; i++) Py_VISIT(self->keys[i]);
    return 0;
}

static int KeyIndex_clear(KeyIndex *self) {
    if (self->keys != NULL)
        for (Py_ssize_t i = 0; i < self->num_slots; i++) Py_CLEAR(self->keys[i]);
    if (self->table != NULL) memset(self->table, 0xff, (self->mask + 1) * sizeof(int32_t));
    self->count = 0;
    Py_CLEAR(self->ids);
    return 0;
}

static void KeyIndex_dealloc(KeyIndex *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    KeyIndex_clear(self);
    PyMem_Free(self->table);
    PyMem_Free(self->keys);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *KeyIndex_get(KeyIndex *self, PyObject *key) {
    int32_t slot = slot_of(self, key);
    if (slot == -2) return NULL;
    if (slot < 0) Py_RETURN_NONE;
    return Py_NewRef(PyTuple_GET_ITEM(self->ids, slot));
}

static PyObject *KeyIndex_slots(KeyIndex *self, PyObject *keys) {
    if (!ready(self)) return NULL;
    /* A list is borrowed, not copied (the hot path): its size and items are read after the
     * last call that may run Python code (PyList_New may collect garbage: a __del__), and
     * the loop runs none, so no caller's code can shrink it under us. */
    PyObject *seq = PySequence_Fast(keys, "keys must be iterable");
    if (seq == NULL) return NULL;
    PyObject *out = PyList_New(PySequence_Fast_GET_SIZE(seq));
    if (out == NULL) goto fail;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n != PyList_GET_SIZE(out)) {
        PyErr_SetString(PyExc_RuntimeError, "keys changed size during the call");
        goto fail;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t slot = slot_of(self, items[i]);
        if (slot == -2) goto fail;
        PyList_SET_ITEM(out, i, Py_NewRef(slot < 0 ? Py_None : PyTuple_GET_ITEM(self->ids, slot)));
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

/* prefix(keys, refs): how many keys, from the first, have a slot whose state refs[slot] (an
 * exact list of ints, one a slot) is >= 0 -- the manager's loadable prefix in one call. Every
 * key is checked to be an exact bytes, as slots() does, before the walk. */
static PyObject *KeyIndex_prefix(KeyIndex *self, PyObject *args) {
    PyObject *keys, *refs;
    if (!PyArg_ParseTuple(args, "OO!", &keys, &PyList_Type, &refs)) return NULL;
    if (!ready(self)) return NULL;
    if (!PyList_CheckExact(refs)) {
        PyErr_SetString(PyExc_TypeError, "refs must be a list (not a subclass)");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(keys, "keys must be iterable"); /* may run Python code */
    if (seq == NULL) return NULL;
    /* From here no Python code runs: the list's size and items are read now. */
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), hits = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (PyList_GET_SIZE(refs) != self->num_slots) {
        PyErr_Format(PyExc_ValueError, "refs holds %zd states for %zd slots", PyList_GET_SIZE(refs), self->num_slots);
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (check_key(items[i]) < 0) goto fail;
    for (; hits < n; hits++) {
        int32_t slot;
        find(self, items[hits], PyObject_Hash(items[hits]), &slot);
        if (slot < 0) break;
        PyObject *state = PyList_GET_ITEM(refs, slot);
        if (!PyLong_CheckExact(state)) {
            PyErr_Format(PyExc_TypeError, "refs[%d] is not an int", (int)slot);
            goto fail;
        }
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(state, &overflow);
        if (overflow < 0 || (!overflow && v < 0)) break;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(hits);
fail:
    Py_DECREF(seq);
    return NULL;
}

static PyObject *KeyIndex_add(KeyIndex *self, PyObject *args) {
    PyObject *keys, *slots, *kt = NULL, *st = NULL;
    int32_t *ss = NULL;
    if (!PyArg_ParseTuple(args, "OO", &keys, &slots)) return NULL;
    if (!ready(self)) return NULL;
    /* Python code (iterators, __index__) runs here, before the index is touched. */
    if ((kt = PySequence_Tuple(keys)) == NULL || (st = PySequence_Tuple(slots)) == NULL) goto fail;
    Py_ssize_t n = PyTuple_GET_SIZE(kt), done = 0;
    if (PyTuple_GET_SIZE(st) != n) {
        PyErr_SetString(PyExc_ValueError, "keys and slots differ in length");
        goto fail;
    }
    if ((ss = slot_array(self, st)) == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++)
        if (check_key(PyTuple_GET_ITEM(kt, i)) < 0) goto fail;
    /* From here to the end no Python code runs. */
    int why = ADDED;
    int32_t found = -1;
    for (; done < n; done++) {
        why = add_one(self, PyTuple_GET_ITEM(kt, done), ss[done], &found);
        if (why != ADDED) break;
    }
    if (why != ADDED) {
        /* All or nothing: undo the keys added by this call, then raise. */
        for (Py_ssize_t i = 0; i < done; i++) Py_DECREF(remove_slot(self, ss[i]));
        if (why == SLOT_TAKEN)
            PyErr_Format(PyExc_ValueError, "slot %d is taken", (int)ss[done]);
        else
            PyErr_Format(PyExc_KeyError, "key is already in slot %d", (int)found);
        goto fail;
    }
    PyMem_Free(ss);
    Py_DECREF(kt);
    Py_DECREF(st);
    Py_RETURN_NONE;
fail:
    PyMem_Free(ss);
    Py_XDECREF(kt);
    Py_XDECREF(st);
    return NULL;
}

static PyObject *KeyIndex_remove(KeyIndex *self, PyObject *slots) {
    if (!ready(self)) return NULL;
    PyObject *st = PySequence_Tuple(slots), *out = NULL;
    if (st == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(st);
    int32_t *ss = NULL;
    /* the list first, then the slots as C ints: both may run Python code */
    if ((out = PyList_New(n)) == NULL || (ss = slot_array(self, st)) == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) { /* check all before removing any */
        if (self->keys[ss[i]] == NULL) {
            PyErr_Format(PyExc_KeyError, "slot %d is empty", (int)ss[i]);
            goto fail;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = remove_slot(self, ss[i]);
        PyList_SET_ITEM(out, i, key ? key : Py_NewRef(Py_None)); /* None: the same slot twice */
    }
    PyMem_Free(ss);
    Py_DECREF(st);
    return out;
fail:
    PyMem_Free(ss);
    Py_XDECREF(out);
    Py_DECREF(st);
    return NULL;
}

static PyObject *KeyIndex_key(KeyIndex *self, PyObject *arg) {
    int32_t slot;
    if (!ready(self) || check_slot(self, arg, &slot) < 0) return NULL;
    PyObject *key = self->keys[slot];
    return Py_NewRef(key ? key : Py_None);
}

static Py_ssize_t KeyIndex_len(KeyIndex *self) { return self->count; }

static int KeyIndex_contains(KeyIndex *self, PyObject *key) {
    int32_t slot = slot_of(self, key);
    return slot == -2 ? -1 : slot >= 0;
}

static PyObject *KeyIndex_num_slots(KeyIndex *self, void *Py_UNUSED(closure)) {
    return PyLong_FromSsize_t(self->num_slots);
}

static PyMethodDef KeyIndex_methods[] = {
    {"get", (PyCFunction)KeyIndex_get, METH_O, "get(key) -> slot or None"},
    {"slots", (PyCFunction)KeyIndex_slots, METH_O, "slots(keys) -> [slot or None for each key]"},
    {"add", (PyCFunction)KeyIndex_add, METH_VARARGS,
     "add(keys, slots): map each new key to its empty slot (all or nothing)"},
    {"remove", (PyCFunction)KeyIndex_remove, METH_O, "remove(slots) -> their keys (checked first)"},
    {"key", (PyCFunction)KeyIndex_key, METH_O, "key(slot) -> key or None"},
    {"prefix", (PyCFunction)KeyIndex_prefix, METH_VARARGS,
     "prefix(keys, refs) -> how many keys, from the first, are in a slot whose refs[slot] >= 0"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef KeyIndex_getset[] = {
    {"num_slots", (getter)KeyIndex_num_slots, NULL, "slot count", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot KeyIndex_slots_spec[] = {
    {Py_tp_doc, "KeyIndex(ids): bytes key <-> slot, at most one key a slot; ids[slot] is slot's int."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, KeyIndex_init},
    {Py_tp_dealloc, KeyIndex_dealloc},
    {Py_tp_traverse, KeyIndex_traverse},
    {Py_tp_clear, KeyIndex_clear},
    {Py_tp_methods, KeyIndex_methods},
    {Py_tp_getset, KeyIndex_getset},
    {Py_sq_length, KeyIndex_len},
    {Py_sq_contains, KeyIndex_contains},
    {0, NULL},
};

static PyType_Spec KeyIndex_spec = {
    "kvhal.offload._keyindex.KeyIndex",
    sizeof(KeyIndex),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    KeyIndex_slots_spec,
};

static int exec_module(PyObject *module) {
    PyObject *type = PyType_FromModuleAndSpec(module, &KeyIndex_spec, NULL);
    if (type == NULL) return -1;
    if (PyModule_AddObject(module, "KeyIndex", type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return kvhal_add_slot_types(module); /* _slots.c: the LRU */
}

static PyModuleDef_Slot module_slots[] = {{Py_mod_exec, exec_module}, {0, NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvhal.offload._keyindex",
    "The offloading manager's compact key -> slot index, its slots' states and LRU order.", 0,
    kvhal_slot_functions, module_slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__keyindex(void) { return PyModuleDef_Init(&module_def); }
