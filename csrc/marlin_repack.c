/* Marlin's NVFP4 weight layout (SEMANTICS §13.5), the repack vLLM's gptq_marlin_repack does at every
   start, as byte moves in C: what mocli/ops/marlin.py's numpy passes write, in one pass instead of a
   dozen (verify's inverse is csrc/marlin_decode.c, written apart). With k = 16 kt + 8 h + 2 b + l and
   n = 64 c + 16 j + 8 blk + a, nibble 4 l + 2 blk + h of word (c, a, b, j) in row kt of the Marlin tensor
   is code (k, n), which an NVFP4 weight [N, K/2] keeps in nibble l (low first) of byte 8 kt + 4 h + b of
   row n.

   One (c, a, kt) is one 64-byte line of row kt (words b = 0..3 of j = 0..3, at 16 b + 4 j) and 8 bytes of
   each of the 8 rows (j, blk): the source's bytes b = 0..3 of (blk, h) for the four j as one vector of four
   32-bit lanes, the nibbles regrouped into bytes 2 l + blk with masks, then a 4 x 4 transpose of bytes in
   every lane gives the line's four 16-byte parts. GCC/Clang vector extensions (SSE2 or NEON code, no
   intrinsics); a little-endian host is assumed, as everywhere in mocli's byte moves. No Python object is
   touched while the GIL is released; the callers (mocli/ops/marlin_native.py) check every shape, stride
   and bound before passing raw addresses. */

#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "mocli's byte moves assume a little-endian host: the numpy passes serve elsewhere"
#endif

typedef uint32_t u32x4 __attribute__((vector_size(16)));

#define LO 0x0F0F0F0Fu
#define HI 0xF0F0F0F0u

static inline uint32_t load32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline void store32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }

/* In every lane, out[i] byte b = in[b] byte i: a 4 x 4 transpose of bytes (its own inverse). */
static inline void transpose4(const u32x4 in[4], u32x4 out[4]) {
    u32x4 t0 = (in[0] & 0x00FF00FFu) | ((in[1] << 8) & 0xFF00FF00u);
    u32x4 t1 = ((in[0] >> 8) & 0x00FF00FFu) | (in[1] & 0xFF00FF00u);
    u32x4 t2 = (in[2] & 0x00FF00FFu) | ((in[3] << 8) & 0xFF00FF00u);
    u32x4 t3 = ((in[2] >> 8) & 0x00FF00FFu) | (in[3] & 0xFF00FF00u);
    out[0] = (t0 & 0x0000FFFFu) | (t2 << 16);
    out[1] = (t1 & 0x0000FFFFu) | (t3 << 16);
    out[2] = (t0 >> 16) | (t2 & 0xFFFF0000u);
    out[3] = (t1 >> 16) | (t3 & 0xFFFF0000u);
}

/* One line: s[blk][h] (lanes j) -> the four 16-byte parts of the line at o. */
static inline void put_line(uint8_t *o, const u32x4 s[2][2]) {
    /* byte 2 l + blk: code l of (blk, h = 0) low, of (blk, h = 1) high */
    u32x4 x[4] = {
        (s[0][0] & LO) | ((s[0][1] & LO) << 4),
        (s[1][0] & LO) | ((s[1][1] & LO) << 4),
        ((s[0][0] >> 4) & LO) | (s[0][1] & HI),
        ((s[1][0] >> 4) & LO) | (s[1][1] & HI),
    };
    u32x4 w[4];
    transpose4(x, w);
    memcpy(o, w, 64);
}

/* Groups [c0, c1) of 64 rows of src (n_rows rows of k_bytes bytes, row stride src_stride; rows and
   columns past them read as zero: Marlin's padding) into dst (kp / 16 rows of 8 Np bytes, row stride
   dst_stride). k_bytes is a multiple of 8 (K of 16), so a row's 8 bytes of one kt are all in or all out.
   kt innermost: the 8 rows of one (c, a) stream through the cache. */
static void repack(const uint8_t *src, Py_ssize_t src_stride, Py_ssize_t n_rows, Py_ssize_t k_bytes,
                   Py_ssize_t kp, uint8_t *dst, Py_ssize_t dst_stride, Py_ssize_t c0, Py_ssize_t c1) {
    for (Py_ssize_t c = c0; c < c1; c++) {
        for (int a = 0; a < 8; a++) {
            const uint8_t *row[4][2];
            int all = 1; /* the 8 rows are all below n_rows */
            for (int j = 0; j < 4; j++)
                for (int blk = 0; blk < 2; blk++) {
                    Py_ssize_t n = 64 * c + 16 * j + 8 * blk + a;
                    row[j][blk] = n < n_rows ? src + n * src_stride : NULL;
                    all &= n < n_rows;
                }
            for (Py_ssize_t kt = 0; kt < kp / 16; kt++) {
                u32x4 s[2][2] = {{{0}, {0}}, {{0}, {0}}}; /* [blk][h], lanes j: bytes b = 0..3 */
                if (8 * kt < k_bytes) {
                    for (int j = 0; j < 4; j++)
                        for (int blk = 0; blk < 2; blk++)
                            if (all || row[j][blk]) {
                                s[blk][0][j] = load32(row[j][blk] + 8 * kt);
                                s[blk][1][j] = load32(row[j][blk] + 8 * kt + 4);
                            }
                }
                put_line(dst + kt * dst_stride + (Py_ssize_t)512 * c + 64 * a, s);
            }
        }
    }
}

static PyObject *py_repack(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long src, dst;
    Py_ssize_t src_stride, n_rows, k_bytes, kp, dst_stride, c0, c1;
    if (!PyArg_ParseTuple(args, "KnnnnKnnn", &src, &src_stride, &n_rows, &k_bytes, &kp, &dst, &dst_stride,
                          &c0, &c1))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    repack((const uint8_t *)(uintptr_t)src, src_stride, n_rows, k_bytes, kp, (uint8_t *)(uintptr_t)dst,
           dst_stride, c0, c1);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"repack", py_repack, METH_VARARGS, "repack(src, src_stride, n_rows, k_bytes, kp, dst, dst_stride, c0, c1)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_marlin_repack", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__marlin_repack(void) { return PyModule_Create(&module); }
