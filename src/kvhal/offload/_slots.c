/*
 * kvhal.offload._keyindex, the slots' part: the LRU policy's links and the manager's per-slot
 * states, one C call a pass over a request's blocks instead of a Python loop a block.
 *
 * ``LRU(num_slots)``: a doubly linked list over slots in two int32 arrays (8 bytes a slot),
 * the same order as kvhal.offload.eviction's Python LRUPolicy: insert, touch (the first slot
 * most recent), remove, evict (least recent unpinned first). Every call checks its slots (in
 * range; linked or not, as the call needs; no slot twice where that would break the list)
 * before it changes anything, and raises: a bad call never corrupts the links.
 *
 * ``add_refs(refs, slots, delta, lowest, highest)``: the manager's states (an exact list of
 * ints, one a slot) of ``slots`` moved by ``delta``, each state before its move checked to lie
 * in [lowest, highest] (a slot listed twice is checked at its second move); all or nothing.
 *
 * Python code may run only while arguments are converted (a sequence's iterator, an int's
 * __index__), before any state is read or changed; the one exception, evict() reading a
 * pinned sequence that is not a list of ints, marks the LRU busy so that the code it runs
 * cannot change the links under it (every call on a busy LRU raises RuntimeError).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>

#include "_slots.h"

typedef struct {
    PyObject_HEAD
    Py_ssize_t num_slots; /* the sentinel's index: its next is the least recent slot */
    int32_t *prev;        /* num_slots + 1 entries; -1: the slot is not in the list */
    int32_t *next;
    Py_ssize_t count; /* slots in the list */
    int busy;         /* evict() is running a pinned sequence's Python code */
} LRU;

static int lru_ready(LRU *self) {
    if (self->prev == NULL || self->next == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "LRU is not initialized: create it as LRU(num_slots)");
        return 0;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "LRU is busy: its evict() is reading the pinned sequence");
        return 0;
    }
    return 1;
}

/* ``obj`` (an iterable of ints) as C ints in [0, limit), into a PyMem block the caller frees;
 * *n its length. An exact list or tuple of exact ints is read in place (no Python code runs);
 * anything else is copied into a tuple first. NULL with an exception set. */
int32_t *kvhal_slot_ints(PyObject *obj, Py_ssize_t limit, Py_ssize_t *n, int none_ok) {
    PyObject *seq = NULL;
    if (PyList_CheckExact(obj) || PyTuple_CheckExact(obj)) {
        seq = Py_NewRef(obj);
        Py_ssize_t size = PySequence_Fast_GET_SIZE(seq);
        PyObject **items = PySequence_Fast_ITEMS(seq);
        for (Py_ssize_t i = 0; i < size; i++) {
            if (!PyLong_CheckExact(items[i]) && !(none_ok && items[i] == Py_None)) {
                Py_SETREF(seq, PySequence_Tuple(obj)); /* __index__ may run: a tuple cannot change */
                break;
            }
        }
    } else {
        seq = PySequence_Tuple(obj);
    }
    if (seq == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "slots must be an iterable of ints, got %.60s", Py_TYPE(obj)->tp_name);
        }
        return NULL;
    }
    Py_ssize_t size = PySequence_Fast_GET_SIZE(seq);
    int32_t *out = PyMem_Malloc((size_t)(size ? size : 1) * sizeof(int32_t));
    if (out == NULL) {
        Py_DECREF(seq);
        return (int32_t *)PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i); /* a tuple here, or a list of exact ints */
        if (none_ok && item == Py_None) {
            out[i] = -1;
            continue;
        }
        PyObject *index = PyNumber_Index(item); /* a tuple's item may run __index__ */
        Py_ssize_t v = index == NULL ? -1 : PyLong_AsSsize_t(index);
        Py_XDECREF(index);
        if (v == -1 && PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_TypeError, "a slot is an int, got %.60s", Py_TYPE(item)->tp_name);
                goto fail;
            }
            if (!PyErr_ExceptionMatches(PyExc_OverflowError)) goto fail;
            PyErr_Clear();
            v = -1; /* beyond any C int: out of range */
        }
        if (v < 0 || v >= limit) {
            PyErr_Format(PyExc_ValueError, "slot %R is not in [0, %zd)", item, limit);
            goto fail;
        }
        out[i] = (int32_t)v;
    }
    *n = PySequence_Fast_GET_SIZE(seq);
    Py_DECREF(seq);
    return out;
fail:
    PyMem_Free(out);
    Py_DECREF(seq);
    return NULL;
}

/* -- LRU ------------------------------------------------------------------------------------ */

static int LRU_init(LRU *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"num_slots", NULL};
    Py_ssize_t n;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n", kwlist, &n)) return -1;
    if (n <= 0 || n >= INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "num_slots must be in [1, %d), got %zd", INT32_MAX, n);
        return -1;
    }
    if (self->prev != NULL || self->next != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "LRU is already initialized");
        return -1;
    }
    int32_t *prev = PyMem_Malloc((size_t)(n + 1) * sizeof(int32_t));
    int32_t *next = PyMem_Malloc((size_t)(n + 1) * sizeof(int32_t));
    if (prev == NULL || next == NULL) {
        PyMem_Free(prev);
        PyMem_Free(next);
        PyErr_NoMemory();
        return -1;
    }
    memset(prev, 0xff, (size_t)n * sizeof(int32_t)); /* -1: not in the list */
    memset(next, 0xff, (size_t)n * sizeof(int32_t));
    prev[n] = next[n] = (int32_t)n;
    self->num_slots = n;
    self->count = 0;
    self->prev = prev;
    self->next = next;
    return 0;
}

static void LRU_dealloc(LRU *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyMem_Free(self->prev);
    PyMem_Free(self->next);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static void unlink_slot(LRU *self, int32_t s) {
    int32_t before = self->prev[s], after = self->next[s];
    self->next[before] = after;
    self->prev[after] = before;
}

static int cmp_int32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* The slots of ``obj``, each in the list (``linked``) or not; ``distinct``: none twice. */
static int32_t *checked_slots(LRU *self, PyObject *obj, Py_ssize_t *n, int linked, int distinct) {
    int32_t *ss = kvhal_slot_ints(obj, self->num_slots, n, 0);
    if (ss == NULL) return NULL;
    if (!lru_ready(self)) goto fail; /* converting may have run Python code: an evict() */
    for (Py_ssize_t i = 0; i < *n; i++) {
        if ((self->prev[ss[i]] >= 0) != linked) {
            PyErr_Format(PyExc_ValueError, linked ? "slot %d is not in the LRU" : "slot %d is in the LRU already",
                         (int)ss[i]);
            goto fail;
        }
    }
    if (distinct && *n > 1) { /* a sorted copy: a slot twice would break the links */
        int32_t *sorted = PyMem_Malloc((size_t)*n * sizeof(int32_t));
        if (sorted == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        memcpy(sorted, ss, (size_t)*n * sizeof(int32_t));
        qsort(sorted, (size_t)*n, sizeof(int32_t), cmp_int32);
        for (Py_ssize_t i = 1; i < *n; i++) {
            if (sorted[i] == sorted[i - 1]) {
                PyErr_Format(PyExc_ValueError, "slot %d is listed twice", (int)sorted[i]);
                PyMem_Free(sorted);
                goto fail;
            }
        }
        PyMem_Free(sorted);
    }
    return ss;
fail:
    PyMem_Free(ss);
    return NULL;
}

static PyObject *LRU_insert(LRU *self, PyObject *args) {
    PyObject *slots, *keys = Py_None;
    if (!PyArg_ParseTuple(args, "O|O", &slots, &keys)) return NULL;
    if (!lru_ready(self)) return NULL;
    Py_ssize_t n;
    int32_t *ss = checked_slots(self, slots, &n, 0, 1);
    if (ss == NULL) return NULL;
    int32_t nil = (int32_t)self->num_slots, last = self->prev[nil];
    for (Py_ssize_t i = 0; i < n; i++) {
        self->prev[ss[i]] = last;
        self->next[last] = ss[i];
        last = ss[i];
    }
    self->next[last] = nil;
    self->prev[nil] = last;
    self->count += n;
    PyMem_Free(ss);
    Py_RETURN_NONE;
}

static PyObject *LRU_touch(LRU *self, PyObject *slots) {
    if (!lru_ready(self)) return NULL;
    Py_ssize_t n;
    int32_t *ss = checked_slots(self, slots, &n, 1, 0);
    if (ss == NULL) return NULL;
    int32_t nil = (int32_t)self->num_slots, last = self->prev[nil];
    for (Py_ssize_t i = n - 1; i >= 0; i--) { /* the first slot ends most recent */
        int32_t s = ss[i];
        if (s == last) continue;
        unlink_slot(self, s);
        self->prev[s] = last;
        self->next[last] = s;
        last = s;
    }
    self->next[last] = nil;
    self->prev[nil] = last;
    PyMem_Free(ss);
    Py_RETURN_NONE;
}

static PyObject *LRU_remove(LRU *self, PyObject *slots) {
    if (!lru_ready(self)) return NULL;
    Py_ssize_t n;
    int32_t *ss = checked_slots(self, slots, &n, 1, 1);
    if (ss == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        unlink_slot(self, ss[i]);
        self->prev[ss[i]] = self->next[ss[i]] = -1;
    }
    self->count -= n;
    PyMem_Free(ss);
    Py_RETURN_NONE;
}

/* Whether ``pinned[s]`` is true: 1, 0, or -1 with an exception set. */
static int is_pinned(LRU *self, PyObject *pinned, int32_t s) {
    if (PyList_CheckExact(pinned) && s < PyList_GET_SIZE(pinned)) {
        PyObject *item = PyList_GET_ITEM(pinned, s);
        if (PyLong_CheckExact(item) || PyBool_Check(item)) return PyObject_IsTrue(item); /* runs no Python */
    }
    self->busy = 1; /* another sequence, or other items: their code may run */
    PyObject *item = PySequence_GetItem(pinned, s);
    int truth = item == NULL ? -1 : PyObject_IsTrue(item);
    Py_XDECREF(item);
    self->busy = 0;
    return truth;
}

static PyObject *LRU_evict(LRU *self, PyObject *args) {
    Py_ssize_t n;
    PyObject *pinned;
    if (!PyArg_ParseTuple(args, "nO", &n, &pinned)) return NULL;
    if (!lru_ready(self)) return NULL;
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "n must be >= 0, got %zd", n);
        return NULL;
    }
    if (!PySequence_Check(pinned)) {
        PyErr_Format(PyExc_TypeError, "pinned must be a sequence, got %.60s", Py_TYPE(pinned)->tp_name);
        return NULL;
    }
    Py_ssize_t cap = n < self->count ? n : self->count, found = 0;
    int32_t *victims = PyMem_Malloc((size_t)(cap ? cap : 1) * sizeof(int32_t));
    if (victims == NULL) return PyErr_NoMemory();
    int32_t nil = (int32_t)self->num_slots;
    /* The walk reads the links only; they change after it, all at once (nothing on an error). */
    for (int32_t s = self->next[nil]; s != nil && found < cap; s = self->next[s]) {
        int p = is_pinned(self, pinned, s);
        if (p < 0) {
            PyMem_Free(victims);
            return NULL;
        }
        if (!p) victims[found++] = s;
    }
    PyObject *out = PyList_New(found);
    if (out == NULL) goto fail;
    for (Py_ssize_t i = 0; i < found; i++) {
        PyObject *v = PyLong_FromLong(victims[i]);
        if (v == NULL) goto fail;
        PyList_SET_ITEM(out, i, v);
    }
    if (found == n) { /* short of n: nothing evicted, the caller raises */
        for (Py_ssize_t i = 0; i < found; i++) {
            unlink_slot(self, victims[i]);
            self->prev[victims[i]] = self->next[victims[i]] = -1;
        }
        self->count -= found;
    }
    PyMem_Free(victims);
    return out;
fail:
    Py_XDECREF(out);
    PyMem_Free(victims);
    return NULL;
}

static PyObject *LRU_order(LRU *self, PyObject *Py_UNUSED(arg)) {
    if (!lru_ready(self)) return NULL;
    PyObject *out = PyList_New(self->count);
    if (out == NULL) return NULL;
    int32_t nil = (int32_t)self->num_slots, s = self->next[nil];
    for (Py_ssize_t i = 0; i < self->count; i++, s = self->next[s]) {
        PyObject *v = PyLong_FromLong(s);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

static PyObject *LRU_num_slots(LRU *self, void *Py_UNUSED(closure)) { return PyLong_FromSsize_t(self->num_slots); }

static Py_ssize_t LRU_len(LRU *self) { return self->count; }

static PyMethodDef LRU_methods[] = {
    {"insert", (PyCFunction)LRU_insert, METH_VARARGS, "insert(slots, keys=None): slots enter, the last most recent"},
    {"touch", (PyCFunction)LRU_touch, METH_O, "touch(slots): slots used, the first most recent"},
    {"remove", (PyCFunction)LRU_remove, METH_O, "remove(slots): slots leave"},
    {"evict", (PyCFunction)LRU_evict, METH_VARARGS,
     "evict(n, pinned) -> the n least recent slots with pinned[slot] false, taken out; fewer: none taken"},
    {"order", (PyCFunction)LRU_order, METH_NOARGS, "order() -> the slots, least recent first"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef LRU_getset[] = {
    {"num_slots", (getter)LRU_num_slots, NULL, "slot count", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot LRU_slots_spec[] = {
    {Py_tp_doc, "LRU(num_slots): least recently used order over slots, in C (kvhal.offload.eviction)."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, LRU_init},
    {Py_tp_dealloc, LRU_dealloc},
    {Py_tp_methods, LRU_methods},
    {Py_tp_getset, LRU_getset},
    {Py_sq_length, LRU_len},
    {0, NULL},
};

static PyType_Spec LRU_spec = {
    "kvhal.offload._keyindex.LRU", sizeof(LRU), 0, Py_TPFLAGS_DEFAULT, LRU_slots_spec,
};

/* -- the manager's states ------------------------------------------------------------------- */

static PyObject *add_refs(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *refs, *slots;
    long long delta, lowest, highest;
    if (!PyArg_ParseTuple(args, "O!OLLL", &PyList_Type, &refs, &slots, &delta, &lowest, &highest)) return NULL;
    if (!PyList_CheckExact(refs)) {
        PyErr_SetString(PyExc_TypeError, "refs must be a list (not a subclass)");
        return NULL;
    }
    if (delta < -1000000 || delta > 1000000) {
        PyErr_SetString(PyExc_ValueError, "delta must be in [-1000000, 1000000]");
        return NULL;
    }
    Py_ssize_t n;
    /* None (a key without a slot) is a failed check, not an error: as -1 here */
    int32_t *ss = kvhal_slot_ints(slots, PyList_GET_SIZE(refs), &n, 1);
    if (ss == NULL) return NULL;
    /* From here no Python code runs (exact ints only; their deallocation runs none), so the list
     * keeps its size; each slot is checked against it again all the same. */
    PyObject **olds = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(PyObject *));
    if (olds == NULL) {
        PyMem_Free(ss);
        return PyErr_NoMemory();
    }
    Py_ssize_t i = 0, crossed = 0, bad = -1;
    int32_t bad_slot = -1;
    PyObject *error = NULL;
    for (; i < n; i++) {
        int32_t s = ss[i];
        if (s < 0 || s >= PyList_GET_SIZE(refs)) {
            bad = i;
            break;
        }
        PyObject *item = PyList_GET_ITEM(refs, s);
        if (!PyLong_CheckExact(item)) {
            error = PyExc_TypeError;
            bad_slot = s;
            break;
        }
        int overflow;
        long long pre = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow || (pre == -1 && PyErr_Occurred()) || pre < lowest || pre > highest) {
            PyErr_Clear();
            bad = i;
            break;
        }
        if ((delta > 0 && pre > LLONG_MAX - delta) || (delta < 0 && pre < LLONG_MIN - delta)) {
            bad = i; /* the move would leave a C long long: refused as out of bounds */
            break;
        }
        long long now = pre + delta;
        PyObject *value = PyLong_FromLongLong(now);
        if (value == NULL) {
            error = PyExc_MemoryError;
            break;
        }
        olds[i] = item; /* the list's reference, kept until the end */
        PyList_SET_ITEM(refs, s, value);
        crossed += delta > 0 ? pre == 0 : now == 0;
    }
    if (i < n) { /* undo, last first (a slot listed twice returns to its first state) */
        for (Py_ssize_t j = i - 1; j >= 0; j--) {
            PyObject *now = PyList_GET_ITEM(refs, ss[j]);
            PyList_SET_ITEM(refs, ss[j], olds[j]);
            Py_DECREF(now);
        }
    } else {
        for (Py_ssize_t j = 0; j < n; j++) Py_DECREF(olds[j]);
    }
    PyMem_Free(olds);
    PyMem_Free(ss);
    if (error == PyExc_TypeError) return PyErr_Format(PyExc_TypeError, "refs[%d] is not an int", (int)bad_slot);
    if (error != NULL) return PyErr_NoMemory();
    return PyLong_FromSsize_t(bad >= 0 ? -1 - bad : crossed);
}

PyMethodDef kvhal_slot_functions[] = {
    {"add_refs", (PyCFunction)add_refs, METH_VARARGS,
     "add_refs(refs, slots, delta, lowest, highest) -> how many states left (delta > 0) or reached "
     "(delta < 0) 0; or -1 - i: slots[i] is None or its state outside [lowest, highest], nothing changed"},
    {NULL, NULL, 0, NULL},
};

int kvhal_add_slot_types(PyObject *module) {
    PyObject *type = PyType_FromModuleAndSpec(module, &LRU_spec, NULL);
    if (type == NULL) return -1;
    if (PyModule_AddObject(module, "LRU", type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return 0;
}
