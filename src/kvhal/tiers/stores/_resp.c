/*
 * kvhal.tiers.stores._resp: read a pipeline's GETRANGE replies from a Redis socket straight
 * into the caller's buffers (host-tier slots), with the GIL released.
 *
 * Through a client library a 192 KiB value is parsed on the library's thread, turned into a
 * Python bytes object and copied again into its slot (BENCHMARKS.md: 148 us of the calling
 * thread and 137 us of glide's per block). Here the payload goes from the socket into the
 * slot by recv, and nothing of it touches the interpreter.
 *
 * Every value read is bounded: a reply longer than its buffers plus one byte (GETRANGE
 * 0..SIZE answers at most SIZE + 1) is a protocol error, as is a malformed header; the
 * caller then drops the connection. One deadline covers the whole call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define BUF_SIZE (64 * 1024)
#define MAX_LINE 4096
/* the longest wait honoured (a year: "never" in practice); inf and anything longer are clamped
 * to it, since a double beyond int64 nanoseconds (~292 years) has no defined conversion */
#define MAX_TIMEOUT_S (365.0 * 24 * 3600)

/* per reply: the value's length, 0 (an empty value: no block), or FAILED (refused, or
 * longer than its buffers) */
#define REPLY_FAILED (-1)

typedef struct {
    int fd;
    int64_t deadline_ns;
    char buf[BUF_SIZE];
    size_t start, end; /* unread bytes: buf[start:end] */
    const char *error; /* why the call failed (static text) */
    int error_errno;
} Reader;

typedef struct {
    char *ptr;
    size_t len;
} Part;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int fail(Reader *r, const char *why, int err) {
    r->error = why;
    r->error_errno = err;
    return -1;
}

/* recv into dst (at most n bytes) once data is there, within the deadline: bytes read, or -1 */
static ssize_t recv_some(Reader *r, char *dst, size_t n) {
    for (;;) {
        ssize_t got = recv(r->fd, dst, n, MSG_DONTWAIT); /* never blocks: the deadline is ours */
        if (got > 0) return got;
        if (got == 0) return fail(r, "the server closed the connection", 0);
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return fail(r, "recv failed", errno);
        int64_t left = r->deadline_ns - now_ns();
        if (left <= 0) return fail(r, "timed out", ETIMEDOUT);
        struct pollfd p = {r->fd, POLLIN, 0};
        int64_t wait_ms = (left + 999999) / 1000000;
        int ms = wait_ms > INT_MAX ? INT_MAX : (int)wait_ms;
        int ready = poll(&p, 1, ms);
        if (ready < 0 && errno != EINTR) return fail(r, "poll failed", errno);
        if (ready == 0 && now_ns() >= r->deadline_ns) return fail(r, "timed out", ETIMEDOUT);
    }
}

static int fill(Reader *r) {
    if (r->start == r->end) r->start = r->end = 0;
    if (r->end == BUF_SIZE) { /* compact */
        memmove(r->buf, r->buf + r->start, r->end - r->start);
        r->end -= r->start;
        r->start = 0;
    }
    ssize_t got = recv_some(r, r->buf + r->end, BUF_SIZE - r->end);
    if (got < 0) return -1;
    r->end += (size_t)got;
    return 0;
}

/* one header line without its CRLF into line (at most MAX_LINE bytes) */
static int read_line(Reader *r, char *line, size_t *len) {
    for (;;) {
        char *lf = memchr(r->buf + r->start, '\n', r->end - r->start);
        if (lf != NULL) {
            size_t n = (size_t)(lf - (r->buf + r->start)) + 1;
            if (n < 2 || lf[-1] != '\r' || n - 2 > MAX_LINE) return fail(r, "malformed reply header", 0);
            memcpy(line, r->buf + r->start, n - 2);
            *len = n - 2;
            r->start += n;
            return 0;
        }
        if (r->end - r->start > MAX_LINE + 2) return fail(r, "reply header too long", 0);
        if (fill(r) < 0) return -1;
    }
}

/* exactly n bytes into dst (NULL: discard them) */
static int read_exact(Reader *r, char *dst, size_t n) {
    size_t have = r->end - r->start;
    size_t take = have < n ? have : n;
    if (take) {
        if (dst) memcpy(dst, r->buf + r->start, take);
        r->start += take;
        n -= take;
        if (dst) dst += take;
    }
    while (n > 0) {
        if (dst == NULL || n < 4096) { /* small or discarded: through the buffer */
            if (fill(r) < 0) return -1;
            have = r->end - r->start;
            take = have < n ? have : n;
            if (dst) memcpy(dst, r->buf + r->start, take);
            r->start += take;
            n -= take;
            if (dst) dst += take;
        } else { /* the payload: straight from the socket into its slot */
            ssize_t got = recv_some(r, dst, n);
            if (got < 0) return -1;
            dst += got;
            n -= (size_t)got;
        }
    }
    return 0;
}

static int parse_length(const char *s, size_t n, long long *out) {
    if (n == 0 || n > 18) return -1;
    int neg = 0;
    size_t i = 0;
    if (s[0] == '-') { neg = 1; i = 1; if (n == 1) return -1; }
    long long v = 0;
    for (; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return -1;
        v = v * 10 + (s[i] - '0');
    }
    *out = neg ? -v : v;
    return 0;
}

/* one reply into parts: its result code, or -2 on an I/O or protocol error */
static long long read_reply(Reader *r, Part *parts, size_t nparts, size_t cap) {
    char line[MAX_LINE];
    size_t n;
    if (read_line(r, line, &n) < 0) return -2;
    if (n == 0) { fail(r, "malformed reply header", 0); return -2; }
    if (line[0] == '-') {
        /* the server cannot serve anything now: the store is unavailable, not this name */
        static const char *const down[] = {"-LOADING", "-NOAUTH", "-MASTERDOWN", "-BUSY", "-TRYAGAIN", "-CLUSTERDOWN"};
        for (size_t k = 0; k < sizeof(down) / sizeof(down[0]); k++) {
            size_t m = strlen(down[k]);
            if (n >= m && memcmp(line, down[k], m) == 0) {
                fail(r, "the server answered that it cannot serve now", 0);
                return -2;
            }
        }
        return REPLY_FAILED; /* this command was refused (e.g. WRONGTYPE) */
    }
    long long len;
    if (line[0] != '$' || parse_length(line + 1, n - 1, &len) < 0) {
        fail(r, "unexpected reply type", 0);
        return -2;
    }
    if (line[1] == '-') { /* RESP has one negative length: $-1, a nil string (nothing there) */
        if (n == 3 && line[2] == '1') return 0;
        fail(r, "a negative length other than $-1", 0); /* $-2, $-0, $-01 */
        return -2;
    }
    if ((unsigned long long)len > (unsigned long long)cap + 1) {
        fail(r, "a reply longer than its GETRANGE asked for", 0);
        return -2;
    }
    long long result = len;
    if ((size_t)len > cap) { /* SIZE + 1 bytes: larger than the buffers, never delivered */
        if (read_exact(r, NULL, (size_t)len) < 0) return -2;
        result = REPLY_FAILED;
    } else {
        size_t left = (size_t)len;
        for (size_t i = 0; i < nparts && left > 0; i++) {
            size_t take = parts[i].len < left ? parts[i].len : left;
            if (read_exact(r, parts[i].ptr, take) < 0) return -2;
            left -= take;
        }
    }
    char crlf[2];
    if (read_exact(r, crlf, 2) < 0) return -2;
    if (crlf[0] != '\r' || crlf[1] != '\n') { fail(r, "malformed reply end", 0); return -2; }
    return result;
}

static PyObject *read_getrange(PyObject *self, PyObject *args) {
    int fd;
    PyObject *buffers;
    double timeout;
    if (!PyArg_ParseTuple(args, "iOd", &fd, &buffers, &timeout)) return NULL;
    if (isnan(timeout)) {
        PyErr_SetString(PyExc_ValueError, "timeout must be a number of seconds, got nan");
        return NULL;
    }
    /* a deadline already past: read what is there; beyond MAX_TIMEOUT_S (inf included): that */
    timeout = timeout < 0 ? 0 : timeout > MAX_TIMEOUT_S ? MAX_TIMEOUT_S : timeout;
    /* tuples: their lengths cannot change between counting the parts and taking them */
    PyObject *seq = PySequence_Tuple(buffers);
    if (seq == NULL) return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(seq);
    PyObject *items = PyTuple_New(count);
    if (items == NULL) { Py_DECREF(seq); return NULL; }
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PySequence_Tuple(PyTuple_GET_ITEM(seq, i));
        if (item == NULL) { Py_DECREF(items); Py_DECREF(seq); return NULL; }
        PyTuple_SET_ITEM(items, i, item);
        total += PyTuple_GET_SIZE(item);
    }
    Py_buffer *views = PyMem_Calloc(total ? total : 1, sizeof(Py_buffer));
    Part *parts = PyMem_Calloc(total ? total : 1, sizeof(Part));
    size_t *first = PyMem_Calloc(count + 1, sizeof(size_t));
    long long *results = PyMem_Calloc(count ? count : 1, sizeof(long long));
    Reader *reader = PyMem_Calloc(1, sizeof(Reader));
    Py_ssize_t taken = 0;
    PyObject *out = NULL;
    if (!views || !parts || !first || !results || !reader) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyTuple_GET_ITEM(items, i);
        first[i] = (size_t)taken;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(item) && taken < total; j++) {
            if (PyObject_GetBuffer(PyTuple_GET_ITEM(item, j), &views[taken], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
                goto done;
            parts[taken].ptr = views[taken].buf;
            parts[taken].len = (size_t)views[taken].len;
            taken++;
        }
    }
    first[count] = (size_t)taken;
    reader->fd = fd;
    reader->deadline_ns = now_ns() + (int64_t)(timeout * 1e9);
    Py_ssize_t i;
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < count; i++) {
        size_t cap = 0;
        for (size_t p = first[i]; p < first[i + 1]; p++) cap += parts[p].len;
        results[i] = read_reply(reader, parts + first[i], first[i + 1] - first[i], cap);
        if (results[i] == -2) break;
    }
    Py_END_ALLOW_THREADS
    if (i < count) {
        errno = reader->error_errno;
        PyErr_Format(PyExc_ConnectionError, "reply %zd of %zd: %s%s%s", i + 1, count, reader->error,
                     reader->error_errno ? ": " : "", reader->error_errno ? strerror(reader->error_errno) : "");
        goto done;
    }
    out = PyList_New(count);
    if (out == NULL) goto done;
    for (i = 0; i < count; i++) {
        PyObject *v = PyLong_FromLongLong(results[i]);
        if (v == NULL) { Py_CLEAR(out); goto done; }
        PyList_SET_ITEM(out, i, v);
    }
done:
    for (Py_ssize_t k = 0; k < taken; k++) PyBuffer_Release(&views[k]);
    PyMem_Free(views);
    PyMem_Free(parts);
    PyMem_Free(first);
    PyMem_Free(results);
    PyMem_Free(reader);
    Py_DECREF(items);
    Py_DECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"read_getrange", read_getrange, METH_VARARGS,
     "read_getrange(fd, buffers, timeout) -> list[int]\n\n"
     "Read len(buffers) GETRANGE replies from the socket fd, each into its buffers (writable,\n"
     "contiguous, in order), within timeout seconds (below 0: 0; above a year, inf included: a\n"
     "year; nan: ValueError), the GIL released. Per reply: the value's\n"
     "length, 0 (empty), or -1 (refused, or longer than its buffers). Raises ConnectionError\n"
     "on a timeout, a closed connection or a malformed or over-long reply (a negative length\n"
     "other than $-1 among them): drop the connection."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_resp", NULL, -1, methods};

PyMODINIT_FUNC PyInit__resp(void) { return PyModule_Create(&module); }
