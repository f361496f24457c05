/* A safetensors header read in one pass, for the headers the safetensors library writes: mocli inspect and
   validate parse every shard's header at every start (94,858 tensors in 62 headers: ~5.5 ms a header in
   orjson and Python's column checks on the 2-core build VM).

   parse(raw, data_start, data_size) -> (names, dtypes, shapes, starts, nbytes, metadata), the columns
   mocli/io/header.py builds its entries from, or None for anything else: an escape or a control character
   in a string, a key it does not expect or one named twice, a number that is not a plain non-negative
   integer, a dtype it does not know, sizes or offsets that do not check out, overlapping tensors. The
   Python path then parses the header with orjson and checks it entry by entry, naming the fault. So this
   is stricter than that path, never looser: what it accepts, that path accepts with the same columns
   (tests/test_header_native.py holds the two together). Every read is bounded by the end of ``raw``. */

#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DIMS 64 /* more dimensions than any tensor has: the Python path judges such a header */
#define MAX_DIGITS 17 /* plain integers below 10^17: no overflow in sums and products checked below */

static const struct {
    const char *name;
    int width;
} DTYPES[] = {{"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"F8_E8M0", 1},
              {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},     {"U32", 4},
              {"F32", 4},  {"I64", 8}, {"U64", 8}, {"F64", 8}};
#define N_DTYPES ((int)(sizeof(DTYPES) / sizeof(DTYPES[0])))
static PyObject *dtype_names[N_DTYPES]; /* made once: every entry shares them */

typedef struct {
    const char *p, *end;
} cursor;

typedef struct {
    int64_t begin, end;
} span;

static void skip_ws(cursor *c) {
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r'))
        c->p++;
}

static int take(cursor *c, char ch) {
    skip_ws(c);
    if (c->p < c->end && *c->p == ch) {
        c->p++;
        return 1;
    }
    return 0;
}

/* A string with neither escape nor control character: its bytes [*s, *s + *n). */
static int string(cursor *c, const char **s, Py_ssize_t *n) {
    skip_ws(c);
    if (c->p >= c->end || *c->p != '"')
        return 0;
    const char *start = ++c->p;
    for (; c->p < c->end; c->p++) {
        unsigned char ch = (unsigned char)*c->p;
        if (ch == '"') {
            *s = start;
            *n = c->p - start;
            c->p++;
            return 1;
        }
        if (ch == '\\' || ch < 0x20)
            return 0;
    }
    return 0;
}

static int is(const char *s, Py_ssize_t n, const char *word) {
    return (size_t)n == strlen(word) && memcmp(s, word, (size_t)n) == 0;
}

/* A non-negative integer as JSON writes one: digits, no leading zero, no fraction or exponent. */
static int integer(cursor *c, int64_t *v) {
    skip_ws(c);
    const char *start = c->p;
    int64_t x = 0;
    while (c->p < c->end && *c->p >= '0' && *c->p <= '9') {
        if (c->p - start >= MAX_DIGITS)
            return 0;
        x = x * 10 + (*c->p - '0');
        c->p++;
    }
    Py_ssize_t digits = c->p - start;
    if (digits == 0 || (digits > 1 && *start == '0'))
        return 0;
    if (c->p < c->end && (*c->p == '.' || *c->p == 'e' || *c->p == 'E'))
        return 0;
    *v = x;
    return 1;
}

typedef struct {
    int dtype;
    Py_ssize_t ndim;
    int64_t dims[MAX_DIMS];
    int64_t begin, end;
} entry;

/* {"dtype": ..., "shape": [...], "data_offsets": [b, e]}, the three keys once each, in any order. */
static int parse_entry(cursor *c, entry *e) {
    int seen = 0;
    if (!take(c, '{'))
        return 0;
    for (int i = 0; i < 3; i++) {
        const char *k, *v;
        Py_ssize_t kn, vn;
        if ((i && !take(c, ',')) || !string(c, &k, &kn) || !take(c, ':'))
            return 0;
        if (is(k, kn, "dtype") && !(seen & 1)) {
            seen |= 1;
            if (!string(c, &v, &vn))
                return 0;
            e->dtype = -1;
            for (int d = 0; d < N_DTYPES; d++)
                if (is(v, vn, DTYPES[d].name))
                    e->dtype = d;
            if (e->dtype < 0)
                return 0;
        } else if (is(k, kn, "shape") && !(seen & 2)) {
            seen |= 2;
            e->ndim = 0;
            if (!take(c, '['))
                return 0;
            if (!take(c, ']')) {
                do {
                    if (e->ndim == MAX_DIMS || !integer(c, &e->dims[e->ndim]))
                        return 0;
                    e->ndim++;
                } while (take(c, ','));
                if (!take(c, ']'))
                    return 0;
            }
        } else if (is(k, kn, "data_offsets") && !(seen & 4)) {
            seen |= 4;
            if (!take(c, '[') || !integer(c, &e->begin) || !take(c, ',') || !integer(c, &e->end) ||
                !take(c, ']'))
                return 0;
        } else {
            return 0;
        }
    }
    return take(c, '}');
}

/* The bytes the entry's shape and dtype hold, or -1 where the product overflows. */
static int64_t entry_bytes(const entry *e) {
    int64_t n = DTYPES[e->dtype].width;
    for (Py_ssize_t i = 0; i < e->ndim; i++)
        if (__builtin_mul_overflow(n, e->dims[i], &n))
            return -1;
    return n;
}

/* {"key": "value", ...}: a new dict, or NULL (no Python error set) for anything else. */
static PyObject *parse_metadata(cursor *c) {
    PyObject *d = PyDict_New();
    if (d == NULL || !take(c, '{'))
        goto fail;
    if (take(c, '}'))
        return d;
    do {
        const char *k, *v;
        Py_ssize_t kn, vn;
        if (!string(c, &k, &kn) || !take(c, ':') || !string(c, &v, &vn))
            goto fail;
        PyObject *key = PyUnicode_DecodeUTF8(k, kn, "strict");
        PyObject *value = key ? PyUnicode_DecodeUTF8(v, vn, "strict") : NULL;
        int twice = value ? PyDict_Contains(d, key) : -1;
        int ok = twice == 0 && PyDict_SetItem(d, key, value) == 0;
        Py_XDECREF(key);
        Py_XDECREF(value);
        if (!ok)
            goto fail;
    } while (take(c, ','));
    if (take(c, '}'))
        return d;
fail:
    Py_XDECREF(d);
    PyErr_Clear();
    return NULL;
}

static int by_begin(const void *a, const void *b) {
    const span *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    return (x->end > y->end) - (x->end < y->end);
}

/* The entry's columns appended; 0 where a Python object could not be made (no error kept). */
static int append(PyObject **cols, PyObject *name, const entry *e, int64_t data_start) {
    PyObject *shape = PyTuple_New(e->ndim);
    if (shape == NULL)
        return 0;
    for (Py_ssize_t i = 0; i < e->ndim; i++) {
        PyObject *d = PyLong_FromLongLong(e->dims[i]);
        if (d == NULL || PyTuple_SetItem(shape, i, d) < 0) {
            Py_DECREF(shape);
            return 0;
        }
    }
    PyObject *items[5] = {name, dtype_names[e->dtype], shape, PyLong_FromLongLong(data_start + e->begin),
                          PyLong_FromLongLong(e->end - e->begin)};
    int ok = items[3] != NULL && items[4] != NULL;
    for (int i = 0; ok && i < 5; i++)
        ok = PyList_Append(cols[i], items[i]) == 0;
    Py_DECREF(shape);
    Py_XDECREF(items[3]);
    Py_XDECREF(items[4]);
    return ok;
}

/* Every member of the top-level object; 0 where the header is not one this reads. */
static int parse_members(cursor *c, PyObject **cols, PyObject **metadata, PyObject *names, span **spans,
                         Py_ssize_t *count, int64_t data_start, int64_t data_size) {
    Py_ssize_t room = 0;
    do {
        const char *k;
        Py_ssize_t kn;
        if (!string(c, &k, &kn) || !take(c, ':'))
            return 0;
        if (is(k, kn, "__metadata__")) {
            if (*metadata != NULL || (*metadata = parse_metadata(c)) == NULL)
                return 0;
            continue;
        }
        entry e;
        if (!parse_entry(c, &e))
            return 0;
        int64_t n = entry_bytes(&e);
        if (n < 0 || e.end < e.begin || e.end - e.begin != n || e.end > data_size)
            return 0;
        PyObject *name = PyUnicode_DecodeUTF8(k, kn, "strict");
        int fresh = name ? PySet_Contains(names, name) : -1;
        int ok = fresh == 0 && PySet_Add(names, name) == 0 && append(cols, name, &e, data_start);
        Py_XDECREF(name);
        if (!ok)
            return 0;
        if (*count == room) {
            room = room ? 2 * room : 1024;
            span *grown = realloc(*spans, (size_t)room * sizeof(span));
            if (grown == NULL)
                return 0;
            *spans = grown;
        }
        (*spans)[(*count)++] = (span){e.begin, e.end};
    } while (take(c, ','));
    return 1;
}

static PyObject *parse(PyObject *self, PyObject *args) {
    const char *raw;
    Py_ssize_t n;
    long long data_start, data_size;
    if (!PyArg_ParseTuple(args, "y#LL", &raw, &n, &data_start, &data_size))
        return NULL;
    cursor c = {raw, raw + n};
    PyObject *cols[5] = {PyList_New(0), PyList_New(0), PyList_New(0), PyList_New(0), PyList_New(0)};
    PyObject *names = PySet_New(NULL), *metadata = NULL, *result = NULL;
    span *spans = NULL;
    Py_ssize_t count = 0;
    int ok = names != NULL;
    for (int i = 0; i < 5; i++)
        ok = ok && cols[i] != NULL;
    ok = ok && take(&c, '{');
    if (ok && !take(&c, '}'))
        ok = parse_members(&c, cols, &metadata, names, &spans, &count, data_start, data_size) && take(&c, '}');
    skip_ws(&c);
    ok = ok && c.p == c.end;
    if (ok && count > 1) {
        qsort(spans, (size_t)count, sizeof(span), by_begin);
        for (Py_ssize_t i = 0; ok && i + 1 < count; i++)
            ok = spans[i].end <= spans[i + 1].begin;
    }
    if (ok && metadata == NULL)
        ok = (metadata = PyDict_New()) != NULL;
    if (ok)
        result = Py_BuildValue("(OOOOOO)", cols[0], cols[1], cols[2], cols[3], cols[4], metadata);
    free(spans);
    for (int i = 0; i < 5; i++)
        Py_XDECREF(cols[i]);
    Py_XDECREF(names);
    Py_XDECREF(metadata);
    if (result != NULL)
        return result;
    PyErr_Clear(); /* the Python path reads it and says what is wrong */
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"parse", parse, METH_VARARGS,
     "parse(raw, data_start, data_size) -> (names, dtypes, shapes, starts, nbytes, metadata) or None"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_safetensors_header", NULL, -1, methods};

PyMODINIT_FUNC PyInit__safetensors_header(void) {
    for (int d = 0; d < N_DTYPES; d++) {
        dtype_names[d] = PyUnicode_InternFromString(DTYPES[d].name);
        if (dtype_names[d] == NULL)
            return NULL;
    }
    return PyModule_Create(&module);
}
