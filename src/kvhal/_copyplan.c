/*
 * kvhal._copyplan: a block copy's checks, runs and descriptors in one native call each.
 *
 * Why native: a plan is made on the engine's thread right after the forward, whose weights
 * and KV have pushed everything else out of the caches. There the dozen small numpy calls
 * of kvhal.copyplan's own path took 0.3-0.6 ms a plan (measured in a vLLM engine; 0.04 ms
 * warm), and a step makes one per load and per store. The numpy path stays: it is the
 * reference these functions are tested against, the fallback without a compiler, and
 * the one that words the error for a refused mapping.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    int64_t src, dst, order;
} pair_t;

static int by_src_then_order(const void *a, const void *b) {
    const pair_t *x = a, *y = b;
    if (x->src != y->src) return x->src < y->src ? -1 : 1;
    return x->order < y->order ? -1 : (x->order > y->order);
}

static int by_value(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : (x > y);
}

/* An 8-byte integer format in native order ("q", "l", "<q", ...): a float64 or big-endian
 * buffer has the right item size too, and would be read as other numbers. */
static int is_int64_format(const char *format) {
    if (format == NULL) return 0; /* NULL means "B" */
    if (*format == '@' || *format == '=' || (*format == '<' && PY_LITTLE_ENDIAN) || (*format == '>' && PY_BIG_ENDIAN))
        format++;
    return (format[0] == 'q' || format[0] == 'Q' || format[0] == 'l' || format[0] == 'L') && format[1] == '\0';
}

static int int64_view(PyObject *obj, Py_buffer *view, int writable, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    if (view->itemsize != 8 || !is_int64_format(view->format)) {
        PyErr_Format(PyExc_TypeError, "%s must hold 64-bit integers", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* plan_runs(pairs, runs, src_limit, dst_limit) -> int
 *
 * pairs: n (src, dst) int64 pairs, sorted here in place by src (stably) when they are valid;
 * runs: room for n (src, dst, count) rows. Returns the number of runs written, or -1 (pairs
 * untouched) when an id is out of range or a destination repeats: the caller's numpy path
 * then says which. */
static PyObject *plan_runs(PyObject *self, PyObject *args) {
    PyObject *pairs_obj, *runs_obj;
    long long src_limit, dst_limit;
    if (!PyArg_ParseTuple(args, "OOLL", &pairs_obj, &runs_obj, &src_limit, &dst_limit)) return NULL;
    Py_buffer pv, rv;
    if (int64_view(pairs_obj, &pv, 1, "pairs") < 0) return NULL;
    if (int64_view(runs_obj, &rv, 1, "runs") < 0) { PyBuffer_Release(&pv); return NULL; }
    Py_ssize_t n = pv.len / 16;
    if (pv.len % 16 || rv.len / 24 < n) {
        PyBuffer_Release(&pv); PyBuffer_Release(&rv);
        PyErr_SetString(PyExc_ValueError, "pairs must be (n, 2) and runs hold at least (n, 3) int64");
        return NULL;
    }
    int64_t *p = pv.buf, *r = rv.buf;
    long long count = -1;
    pair_t *sorted = NULL;
    int64_t *dsts = NULL;
    if (n <= 0) { count = 0; goto done; }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (p[2 * i] < 0 || p[2 * i] >= src_limit || p[2 * i + 1] < 0 || p[2 * i + 1] >= dst_limit) goto done;
    }
    sorted = malloc(sizeof(pair_t) * n);
    dsts = malloc(sizeof(int64_t) * n);
    if (!sorted || !dsts) { PyErr_NoMemory(); goto fail; }
    for (Py_ssize_t i = 0; i < n; i++) {
        sorted[i].src = p[2 * i]; sorted[i].dst = p[2 * i + 1]; sorted[i].order = i;
        dsts[i] = p[2 * i + 1];
    }
    qsort(dsts, n, sizeof(int64_t), by_value);
    for (Py_ssize_t i = 1; i < n; i++) {
        if (dsts[i] == dsts[i - 1]) goto done;  /* a destination written twice */
    }
    qsort(sorted, n, sizeof(pair_t), by_src_then_order);
    count = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        p[2 * i] = sorted[i].src; p[2 * i + 1] = sorted[i].dst;
        if (i > 0 && sorted[i].src == sorted[i - 1].src + 1 && sorted[i].dst == sorted[i - 1].dst + 1) {
            r[3 * (count - 1) + 2] += 1;  /* the block extends the current run */
        } else {
            r[3 * count] = sorted[i].src; r[3 * count + 1] = sorted[i].dst; r[3 * count + 2] = 1;
            count++;
        }
    }
done:
    free(sorted); free(dsts);
    PyBuffer_Release(&pv); PyBuffer_Release(&rv);
    return PyLong_FromLongLong(count);
fail:
    free(sorted); free(dsts);
    PyBuffer_Release(&pv); PyBuffer_Release(&rv);
    return NULL;
}

/* base + index * stride in two's complement, as numpy's int64 arithmetic wraps: a caller's
 * values that overflow give a wrong number, never undefined behaviour */
static inline int64_t affine(int64_t base, int64_t index, int64_t stride) {
    return (int64_t)((uint64_t)base + (uint64_t)index * (uint64_t)stride);
}

/* descriptors(table, runs, pairs, out_src, out_dst, out_size) -> int
 *
 * table: k rows (src address, src block stride, dst address, dst block stride, length, dense),
 * one per paired segment family. Dense families (both sides' runs of consecutive blocks
 * touch) get one descriptor per run, the others one per block; dense families first, each
 * family's descriptors together (family-major), as kvhal.copyplan's numpy path orders them.
 * The outputs hold room for every descriptor; returns how many were written. */
static PyObject *descriptors(PyObject *self, PyObject *args) {
    PyObject *objs[6];
    if (!PyArg_ParseTuple(args, "OOOOOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5])) return NULL;
    static const char *names[6] = {"table", "runs", "pairs", "out_src", "out_dst", "out_size"};
    Py_buffer v[6];
    int got = 0;
    for (; got < 6; got++) {
        if (int64_view(objs[got], &v[got], got >= 3, names[got]) < 0) break;
    }
    PyObject *result = NULL;
    if (got < 6) goto release;
    Py_ssize_t k = v[0].len / 48, nruns = v[1].len / 24, n = v[2].len / 16, room = v[3].len / 8;
    if (v[0].len % 48 || v[1].len % 24 || v[2].len % 16 || v[4].len / 8 < room || v[5].len / 8 < room) {
        PyErr_SetString(PyExc_ValueError, "table (k, 6), runs (r, 3), pairs (n, 2); outputs of equal room");
        goto release;
    }
    const int64_t *t = v[0].buf, *runs = v[1].buf, *pairs = v[2].buf;
    int64_t *os = v[3].buf, *od = v[4].buf, *oz = v[5].buf;
    Py_ssize_t need = 0;
    for (Py_ssize_t f = 0; f < k && need <= room; f++) need += t[6 * f + 5] ? nruns : n; /* no overflow */
    if (need > room) {
        PyErr_Format(PyExc_ValueError, "the outputs hold %zd descriptors, %zd needed", room, need);
        goto release;
    }
    Py_ssize_t w = 0;
    for (int dense = 1; dense >= 0; dense--) {
        for (Py_ssize_t f = 0; f < k; f++) {
            const int64_t *row = t + 6 * f;
            if ((row[5] != 0) != dense) continue;
            if (dense) {
                for (Py_ssize_t i = 0; i < nruns; i++, w++) {
                    os[w] = affine(row[0], runs[3 * i], row[1]);
                    od[w] = affine(row[2], runs[3 * i + 1], row[3]);
                    oz[w] = affine(0, row[4], runs[3 * i + 2]);
                }
            } else {
                for (Py_ssize_t i = 0; i < n; i++, w++) {
                    os[w] = affine(row[0], pairs[2 * i], row[1]);
                    od[w] = affine(row[2], pairs[2 * i + 1], row[3]);
                    oz[w] = row[4];
                }
            }
        }
    }
    result = PyLong_FromSsize_t(w);
release:
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"plan_runs", plan_runs, METH_VARARGS,
     "plan_runs(pairs, runs, src_limit, dst_limit): check (src, dst) block pairs, sort them by "
     "src in place and write their runs; the number of runs, or -1 for a refused mapping."},
    {"descriptors", descriptors, METH_VARARGS,
     "descriptors(table, runs, pairs, out_src, out_dst, out_size): a plan's byte descriptors; "
     "how many were written."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copyplan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copyplan(void) { return PyModule_Create(&module); }
