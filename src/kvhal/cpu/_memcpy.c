/*
 * kvhal.cpu._memcpy: execute a batch of (src, dst, size) byte copies with the
 * GIL released. Large copies use non-temporal stores: offloaded KV is not read
 * again soon, and bypassing the cache avoids the read-for-ownership traffic
 * that holds plain memcpy of 64 KiB-1 MiB chunks to about 60% of bandwidth
 * (measured: BENCHMARKS.md). Optional: kvhal falls back to ctypes.memmove.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define KVHAL_HAVE_NT 1
#else
#define KVHAL_HAVE_NT 0
#endif

static void copy_streaming(char *dst, const char *src, size_t n) {
#if KVHAL_HAVE_NT
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head; src += head; n -= head;
    size_t blocks = n / 64;
    for (size_t i = 0; i < blocks; i++) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + 0));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)(dst + 0), a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
        src += 64; dst += 64;
    }
    memcpy(dst, src, n - blocks * 64);
#else
    memcpy(dst, src, n);
#endif
}

/* An 8-byte integer format in native order: a float64 buffer has the item size too. */
static int is_int64_format(const char *format) {
    if (format == NULL) return 0; /* NULL means "B" */
    if (*format == '@' || *format == '=' || (*format == '<' && PY_LITTLE_ENDIAN) || (*format == '>' && PY_BIG_ENDIAN))
        format++;
    return (format[0] == 'q' || format[0] == 'Q' || format[0] == 'l' || format[0] == 'L') && format[1] == '\0';
}

/* The most parts a batch is shared into: keeps (total % parts) * part within 64 bits. */
#define MAX_PARTS 65536

static int get_int64_buffer(PyObject *obj, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (view->itemsize != 8 || !is_int64_format(view->format)) {
        PyErr_Format(PyExc_TypeError, "%s must hold 64-bit integers", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *copy_batch(PyObject *self, PyObject *args) {
    PyObject *src_obj, *dst_obj, *size_obj;
    Py_ssize_t nt_threshold, part = 0, parts = 1;
    if (!PyArg_ParseTuple(args, "OOOn|nn", &src_obj, &dst_obj, &size_obj, &nt_threshold, &part, &parts)) return NULL;
    if (parts < 1 || parts > MAX_PARTS || part < 0 || part >= parts) {
        PyErr_SetString(PyExc_ValueError, "part must lie in [0, parts), parts in [1, 65536]");
        return NULL;
    }
    Py_buffer src, dst, sizes;
    if (get_int64_buffer(src_obj, &src, "src") < 0) return NULL;
    if (get_int64_buffer(dst_obj, &dst, "dst") < 0) { PyBuffer_Release(&src); return NULL; }
    if (get_int64_buffer(size_obj, &sizes, "sizes") < 0) {
        PyBuffer_Release(&src); PyBuffer_Release(&dst); return NULL;
    }
    Py_ssize_t n = sizes.len / 8;
    if (src.len / 8 != n || dst.len / 8 != n) {
        PyBuffer_Release(&src); PyBuffer_Release(&dst); PyBuffer_Release(&sizes);
        PyErr_SetString(PyExc_ValueError, "src, dst and sizes must have equal lengths");
        return NULL;
    }
    const int64_t *s = (const int64_t *)src.buf, *d = (const int64_t *)dst.buf, *z = (const int64_t *)sizes.buf;
    unsigned long long total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* refuse the whole batch before any byte moves; a total past 64 bits would wrap the
           shares' arithmetic into a negative length */
        if (z[i] < 0 || (unsigned long long)z[i] > ULLONG_MAX - total) {
            PyBuffer_Release(&src); PyBuffer_Release(&dst); PyBuffer_Release(&sizes);
            PyErr_SetString(PyExc_ValueError, z[i] < 0 ? "negative copy size" : "copy sizes overflow 64 bits");
            return NULL;
        }
        total += (unsigned long long)z[i];
    }
    /* this call's share of the batch's bytes: [lo, hi) of the descriptors laid end to end
       (a descriptor across a cut is split), so that threads share one batch with no planning */
    unsigned long long lo = total / parts * part + total % parts * part / parts;
    unsigned long long hi = total / parts * (part + 1) + total % parts * (part + 1) / parts;
    Py_BEGIN_ALLOW_THREADS
    int streamed = 0;
    unsigned long long at = 0;
    for (Py_ssize_t i = 0; i < n && at < hi; i++) {
        unsigned long long start = at, end = at + (unsigned long long)z[i];
        at = end;
        if (end <= lo) continue;
        size_t skip = start < lo ? (size_t)(lo - start) : 0;
        size_t len = (size_t)((end < hi ? end : hi) - start) - skip;
        char *dp = (char *)(intptr_t)d[i] + skip;
        const char *sp = (const char *)(intptr_t)s[i] + skip;
        if (nt_threshold >= 0 && z[i] >= nt_threshold) {
            copy_streaming(dp, sp, len);
            streamed = 1;
        } else {
            memcpy(dp, sp, len);
        }
    }
#if KVHAL_HAVE_NT
    if (streamed) _mm_sfence();  /* make streamed stores visible before completion is signalled */
#else
    (void)streamed;
#endif
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src); PyBuffer_Release(&dst); PyBuffer_Release(&sizes);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_batch", copy_batch, METH_VARARGS,
     "copy_batch(src_ptrs, dst_ptrs, sizes, nt_threshold, part=0, parts=1): copy each size bytes "
     "from src to dst (int64 buffers), non-temporal stores for sizes >= nt_threshold (-1: never); "
     "only share `part` of `parts` equal byte shares of the batch; GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_memcpy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__memcpy(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL) PyModule_AddIntConstant(m, "HAVE_NON_TEMPORAL", KVHAL_HAVE_NT);
    return m;
}
