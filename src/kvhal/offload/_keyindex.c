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
 * Keys are bytes (their hash is cached in the object, so probing never
 * rehashes). The pure-Python fallback in kvhal/keyindex.py has the same API.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    PyObject_HEAD
    Py_ssize_t num_slots;
    Py_ssize_t count;
    size_t mask;
    int32_t *table; /* bucket -> slot, -1 when empty */
    PyObject **keys; /* slot -> key (strong reference) or NULL */
    PyObject *ids;   /* tuple: ids[slot] is the int object returned for slot */
} KeyIndex;

/* The bucket holding ``key`` (found) or the empty bucket ending its probe. */
static int find(KeyIndex *self, PyObject *key, Py_hash_t hash, size_t *bucket, int32_t *slot) {
    size_t i = (size_t)hash & self->mask;
    for (;;) {
        int32_t s = self->table[i];
        if (s < 0) {
            *bucket = i;
            *slot = -1;
            return 0;
        }
        PyObject *k = self->keys[s];
        if (k == key) goto found;
        if (PyObject_Hash(k) == hash) {
            int eq = PyObject_RichCompareBool(k, key, Py_EQ);
            if (eq < 0) return -1;
            if (eq) goto found;
        }
        i = (i + 1) & self->mask;
        continue;
    found:
        *bucket = i;
        *slot = s;
        return 0;
    }
}

/* Slot of ``key`` or -1; -2 with an exception set. */
static int32_t slot_of(KeyIndex *self, PyObject *key) {
    Py_hash_t hash = PyObject_Hash(key);
    if (hash == -1) return -2;
    size_t bucket;
    int32_t slot;
    if (find(self, key, hash, &bucket, &slot) < 0) return -2;
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
    Py_ssize_t slot = PyLong_AsSsize_t(obj);
    if (slot == -1 && PyErr_Occurred()) return -1;
    if (slot < 0 || slot >= self->num_slots) {
        PyErr_Format(PyExc_ValueError, "slot %zd is not in [0, %zd)", slot, self->num_slots);
        return -1;
    }
    *out = (int32_t)slot;
    return 0;
}

/* Remove the entry in ``slot``; returns its key (new reference) or NULL if empty. */
static PyObject *remove_slot(KeyIndex *self, int32_t slot) {
    PyObject *key = self->keys[slot];
    if (key == NULL) return NULL;
    size_t bucket;
    int32_t found;
    find(self, key, PyObject_Hash(key), &bucket, &found); /* identity match: cannot fail */
    delete_bucket(self, bucket);
    self->keys[slot] = NULL;
    self->count--;
    return key;
}

static int add_one(KeyIndex *self, PyObject *key, int32_t slot) {
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "keys are bytes, got %.60s", Py_TYPE(key)->tp_name);
        return -1;
    }
    if (self->keys[slot] != NULL) {
        PyErr_Format(PyExc_ValueError, "slot %d is taken", (int)slot);
        return -1;
    }
    Py_hash_t hash = PyObject_Hash(key);
    if (hash == -1) return -1;
    size_t bucket;
    int32_t found;
    if (find(self, key, hash, &bucket, &found) < 0) return -1;
    if (found >= 0) {
        PyErr_Format(PyExc_KeyError, "key is already in slot %d", (int)found);
        return -1;
    }
    Py_INCREF(key);
    self->keys[slot] = key;
    self->table[bucket] = slot;
    self->count++;
    return 0;
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
    if (self->table != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "KeyIndex is already initialized");
        return -1;
    }
    size_t size = 8;
    while (size < (size_t)n * 2) size <<= 1;
    self->table = PyMem_Malloc(size * sizeof(int32_t));
    self->keys = PyMem_Calloc((size_t)n, sizeof(PyObject *));
    if (self->table == NULL || self->keys == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(self->table, 0xff, size * sizeof(int32_t)); /* -1 everywhere */
    self->ids = Py_NewRef(ids);
    self->num_slots = n;
    self->mask = size - 1;
    self->count = 0;
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
    PyObject *seq = PySequence_Fast(keys, "keys must be iterable");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(n);
    if (out == NULL) goto fail;
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

static PyObject *KeyIndex_add(KeyIndex *self, PyObject *args) {
    PyObject *keys, *slots;
    if (!PyArg_ParseTuple(args, "OO", &keys, &slots)) return NULL;
    PyObject *kseq = PySequence_Fast(keys, "keys must be iterable");
    if (kseq == NULL) return NULL;
    PyObject *sseq = PySequence_Fast(slots, "slots must be iterable");
    if (sseq == NULL) {
        Py_DECREF(kseq);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(kseq), done = 0;
    PyObject **ks = PySequence_Fast_ITEMS(kseq), **ss = PySequence_Fast_ITEMS(sseq);
    int32_t slot = 0;
    if (PySequence_Fast_GET_SIZE(sseq) != n) {
        PyErr_SetString(PyExc_ValueError, "keys and slots differ in length");
        goto fail;
    }
    for (; done < n; done++) {
        if (check_slot(self, ss[done], &slot) < 0 || add_one(self, ks[done], slot) < 0) goto fail;
    }
    Py_DECREF(kseq);
    Py_DECREF(sseq);
    Py_RETURN_NONE;
fail:
    /* All or nothing: undo the keys added by this call. */
    for (Py_ssize_t i = 0; i < done; i++) {
        check_slot(self, ss[i], &slot);
        Py_XDECREF(remove_slot(self, slot));
    }
    Py_DECREF(kseq);
    Py_DECREF(sseq);
    return NULL;
}

static PyObject *KeyIndex_remove(KeyIndex *self, PyObject *slots) {
    PyObject *seq = PySequence_Fast(slots, "slots must be iterable");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int32_t slot;
    for (Py_ssize_t i = 0; i < n; i++) { /* check all before removing any */
        if (check_slot(self, items[i], &slot) < 0) goto fail;
        if (self->keys[slot] == NULL) {
            PyErr_Format(PyExc_KeyError, "slot %d is empty", (int)slot);
            goto fail;
        }
    }
    PyObject *out = PyList_New(n);
    if (out == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        check_slot(self, items[i], &slot);
        PyObject *key = remove_slot(self, slot);
        if (key == NULL) { /* the same slot listed twice */
            key = Py_NewRef(Py_None);
        }
        PyList_SET_ITEM(out, i, key);
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(seq);
    return NULL;
}

static PyObject *KeyIndex_key(KeyIndex *self, PyObject *arg) {
    int32_t slot;
    if (check_slot(self, arg, &slot) < 0) return NULL;
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
    return 0;
}

static PyModuleDef_Slot module_slots[] = {{Py_mod_exec, exec_module}, {0, NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvhal.offload._keyindex", "The offloading manager's compact key -> slot index.", 0,
    NULL, module_slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__keyindex(void) { return PyModuleDef_Init(&module_def); }
