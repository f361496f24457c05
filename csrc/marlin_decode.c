/* The inverse of Marlin's NVFP4 weight layout, in C: what verify and serving's CPU kernels read a stored
   Marlin weight back with (mocli/targets/marlin_decode.py; its numpy passes write the same bytes).
   Written from SEMANTICS §13.5's description, apart from the repack (csrc/marlin_repack.c): the tests hold
   each to vLLM's python reference on its own, so a fault they shared could not cancel out.

   Code (k, n), k = 16 kt + 8 h + 2 b + l and n = 64 c + 16 j + 8 blk + a, is nibble 4 l + 2 blk + h of
   word (c, a, b, j) of row kt, and goes to nibble l of byte 8 kt + 4 h + b of row n. So byte 2 l + blk of
   word (c, a, b, j) holds the codes (h = 0 low, h = 1 high) of row (c, j, blk, a), and the two nibbles of
   each destination byte come from bytes blk (l = 0) and 2 + blk (l = 1) of one word. One (c, a, kt) reads
   the 64 bytes of words (b, j), the four j as the lanes of a vector (GCC/Clang vector extensions), and
   writes 8 bytes to each of the 8 rows (j, blk). matches() decodes a group at a time into a scratch that
   stays in cache and compares it with the rows the caller expects: verify's byte check without writing the
   decoded weight (on the 2-core VM 2.0 ms for a 6 MiB expert w13 against 2.4 ms decoded and compared; on the
   16-core H200 host it is still a third of a Marlin verify's CPU time). A little-endian host is assumed. No Python object is touched while the GIL is released; the caller checks every shape, stride
   and bound before passing raw addresses. */

#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "mocli's byte moves assume a little-endian host: the numpy passes serve elsewhere"
#endif

/* Rows of words read ahead: a line's row is 8 Np bytes from the next, a stride the hardware prefetchers do
   not follow across pages. 16 ahead took a 2-core verify's decode from 2.4-2.8 to 1.6-1.8 CPU-s (3.9 GB). */
#ifndef AHEAD
#define AHEAD 16
#endif

typedef uint32_t lanes4 __attribute__((vector_size(16))); /* lane j: word (b, j) of one line */

static inline void store_word(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }

/* The 64 rows of group c, written to rows 0..63 of dst. */
static void decode_group(const uint8_t *src, Py_ssize_t src_stride, Py_ssize_t kp, uint8_t *dst,
                         Py_ssize_t dst_stride, Py_ssize_t c) {
    for (int a = 0; a < 8; a++) {
        for (Py_ssize_t kt = 0; kt < kp / 16; kt++) {
            lanes4 word[4]; /* [b], lanes j */
            const uint8_t *line = src + kt * src_stride + 512 * c + 64 * a;
            if (kt + AHEAD < kp / 16)
                __builtin_prefetch(line + AHEAD * src_stride);
            memcpy(word, line, 64);
            for (int blk = 0; blk < 2; blk++) {
                lanes4 low = {0, 0, 0, 0}, high = {0, 0, 0, 0}; /* bytes b of h = 0 and of h = 1 */
                for (int b = 0; b < 4; b++) {
                    /* byte blk (codes l = 0) at bits 0-7, byte 2 + blk (l = 1) at bits 16-23 */
                    lanes4 pair = (word[b] >> (8 * blk)) & 0x00FF00FFu;
                    lanes4 h0 = (pair & 0x0Fu) | ((pair >> 12) & 0xF0u);
                    lanes4 h1 = ((pair >> 4) & 0x0Fu) | ((pair >> 16) & 0xF0u);
                    low |= h0 << (8 * b);
                    high |= h1 << (8 * b);
                }
                for (int j = 0; j < 4; j++) {
                    uint8_t *row = dst + (16 * j + 8 * blk + a) * dst_stride + 8 * kt;
                    store_word(row, low[j]);
                    store_word(row + 4, high[j]);
                }
            }
        }
    }
}

static void decode(const uint8_t *src, Py_ssize_t src_stride, Py_ssize_t kp, uint8_t *dst,
                   Py_ssize_t dst_stride, Py_ssize_t c0, Py_ssize_t c1) {
    for (Py_ssize_t c = c0; c < c1; c++)
        decode_group(src, src_stride, kp, dst + 64 * c * dst_stride, dst_stride, c);
}

static int zero(const uint8_t *p, Py_ssize_t n) {
    uint8_t any = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        any |= p[i];
    return !any;
}

/* Whether the groups' decoded rows are what the caller expects, without writing them anywhere but a
   group's scratch: row r of the groups' rows (64 each) holds the row_bytes bytes at want[r], then zeros, or
   zeros alone where want[r] is 0 (Marlin's padding). -1: no memory for the scratch. */
static int matches(const uint8_t *src, Py_ssize_t src_stride, Py_ssize_t kp, Py_ssize_t groups,
                   const uint64_t *want, Py_ssize_t row_bytes) {
    Py_ssize_t width = kp / 2;
    uint8_t *scratch = malloc((size_t)(64 * width));
    int same = 1;
    if (scratch == NULL)
        return -1;
    for (Py_ssize_t c = 0; c < groups && same; c++) {
        decode_group(src, src_stride, kp, scratch, width, c);
        for (int r = 0; r < 64 && same; r++) {
            const uint8_t *got = scratch + r * width;
            const uint8_t *row = (const uint8_t *)(uintptr_t)want[64 * c + r];
            same = row == NULL ? zero(got, width)
                               : memcmp(got, row, (size_t)row_bytes) == 0 && zero(got + row_bytes, width - row_bytes);
        }
    }
    free(scratch);
    return same;
}

/* Block scales [rows_k, np_] (Marlin's: each run of 64 along Np permuted; the stored column of natural n
   is 64 (n / 64) + slot[n % 64]) back to out [n_rows, kb] through a 256-entry table, out[n][k] =
   table[raw[k][col(n)]], in 64 x 64 tiles so the column reads hit the cache. Every other stored byte (n or
   k past the source's, Marlin's padding) must be fill: 0 is returned where one is not. */
static int scales(const uint8_t *raw, Py_ssize_t raw_stride, Py_ssize_t rows_k, Py_ssize_t np_, const uint8_t *slot,
                  const uint8_t *table, uint8_t *out, Py_ssize_t out_stride, Py_ssize_t n_rows, Py_ssize_t kb,
                  uint8_t fill) {
    uint8_t tile[64][64]; /* [k - k0][the run's stored column] */
    int bad = 0;
    for (Py_ssize_t c = 0; c < np_ / 64; c++) {
        for (Py_ssize_t k0 = 0; k0 < rows_k; k0 += 64) {
            int rows = rows_k - k0 < 64 ? (int)(rows_k - k0) : 64;
            int kin = kb - k0 < 0 ? 0 : kb - k0 < rows ? (int)(kb - k0) : rows; /* the tile's rows below kb */
            for (int r = 0; r < rows; r++)
                memcpy(tile[r], raw + (k0 + r) * raw_stride + 64 * c, 64);
            for (int i = 0; i < 64; i++) {
                Py_ssize_t n = 64 * c + i;
                int p = slot[i], r = 0;
                if (n < n_rows) {
                    uint8_t *restrict row = out + n * out_stride + k0;
                    for (; r < kin; r++)
                        row[r] = table[tile[r][p]];
                }
                for (; r < rows; r++)
                    bad |= tile[r][p] != fill;
            }
        }
    }
    return !bad;
}

static PyObject *py_scales(PyObject *self, PyObject *args) {
    unsigned long long raw, slot, table, out;
    Py_ssize_t raw_stride, rows_k, np_, out_stride, n_rows, kb;
    unsigned char fill;
    int ok;
    (void)self;
    if (!PyArg_ParseTuple(args, "KnnnKKKnnnb", &raw, &raw_stride, &rows_k, &np_, &slot, &table, &out, &out_stride,
                          &n_rows, &kb, &fill))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    ok = scales((const uint8_t *)(uintptr_t)raw, raw_stride, rows_k, np_, (const uint8_t *)(uintptr_t)slot,
                (const uint8_t *)(uintptr_t)table, (uint8_t *)(uintptr_t)out, out_stride, n_rows, kb, fill);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

static PyObject *py_decode(PyObject *self, PyObject *args) {
    unsigned long long src, dst;
    Py_ssize_t src_stride, kp, dst_stride, c0, c1;
    (void)self;
    if (!PyArg_ParseTuple(args, "KnnKnnn", &src, &src_stride, &kp, &dst, &dst_stride, &c0, &c1))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    decode((const uint8_t *)(uintptr_t)src, src_stride, kp, (uint8_t *)(uintptr_t)dst, dst_stride, c0, c1);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_matches(PyObject *self, PyObject *args) {
    unsigned long long src, want;
    Py_ssize_t src_stride, kp, groups, row_bytes;
    int same;
    (void)self;
    if (!PyArg_ParseTuple(args, "KnnnKn", &src, &src_stride, &kp, &groups, &want, &row_bytes))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    same = matches((const uint8_t *)(uintptr_t)src, src_stride, kp, groups, (const uint64_t *)(uintptr_t)want,
                   row_bytes);
    Py_END_ALLOW_THREADS
    if (same < 0)
        return PyErr_NoMemory();
    return PyBool_FromLong(same);
}

static PyMethodDef methods[] = {
    {"decode", py_decode, METH_VARARGS, "decode(src, src_stride, kp, dst, dst_stride, c0, c1)"},
    {"matches", py_matches, METH_VARARGS,
     "matches(src, src_stride, kp, groups, want, row_bytes) -> the groups' rows are want's rows, then zeros"},
    {"scales", py_scales, METH_VARARGS,
     "scales(raw, raw_stride, rows_k, np_, slot, table, out, out_stride, n_rows, kb, fill) -> padding is fill"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_marlin_decode", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__marlin_decode(void) { return PyModule_Create(&module); }
