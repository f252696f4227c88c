/* BLAKE3 as the tree it is: the digest of a buffer together with the chaining values (CVs) of its
 * 1 KiB chunks and of the parent nodes above them, so that one pass over a tensor's bytes gives both
 * its digest (the state hash's) and every node an opening's path needs.
 *
 * Written from the BLAKE3 specification (Aumasson, Neves, O'Connor, Wilcox-O'Hearn, 2020): chunks of
 * 1024 bytes hashed in blocks of 64 with the chunk's index as the counter, parents over pairs of CVs,
 * the left subtree the largest power of two of chunks below the total (which is the tree built level
 * by level with an odd last node promoted unchanged, as RFC 6962's), and the ROOT flag only on the
 * compression that makes the root. Tests compare every function with the `blake3` package and the
 * published test vectors; blake3tree.py holds a numpy twin that gives the same bytes.
 *
 * Speed: sixteen chunks (or sixteen parents) are compressed at once, one per lane of GCC's portable
 * vector type, which the compiler lowers to AVX-512, AVX2 or SSE2 (the function is cloned per target
 * and the loader picks one); the chunks of a large buffer are split over threads, the GIL released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "BLAKE3's words are little-endian: this file reads them in place"
#endif

#define CHUNK 1024
#define BLOCK 64
#define LANES 16
#define MAX_THREADS 64
#define MIN_CHUNKS_PER_THREAD 1024 /* 1 MiB: below it a thread costs more than it saves */
enum { CHUNK_START = 1, CHUNK_END = 2, PARENT = 4, ROOT = 8 };

static const uint32_t IV[8] = {0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A,
                               0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19};
/* The message word each round reads at each position: round r applies BLAKE3's permutation
 * (2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8) r times. A constant table, so that the
 * unrolled rounds index the message with constants and keep it in registers. */
static const uint8_t SCHEDULE[7][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8},
    {3, 4, 10, 12, 13, 2, 7, 14, 6, 5, 9, 0, 11, 15, 8, 1},
    {10, 7, 12, 9, 14, 3, 13, 15, 4, 0, 11, 2, 5, 8, 1, 6},
    {12, 13, 9, 11, 15, 10, 14, 8, 7, 2, 5, 3, 0, 1, 6, 4},
    {9, 14, 11, 5, 8, 12, 15, 1, 13, 3, 0, 10, 2, 6, 4, 7},
    {11, 15, 5, 0, 1, 9, 8, 6, 14, 10, 2, 12, 3, 4, 7, 13}};

/* ---- one compression at a time (the tail chunk, a lone parent, an opening) ---- */

static inline uint32_t rotr(uint32_t w, int c) { return (w >> c) | (w << (32 - c)); }

#define G(a, b, c, d, x, y)                                                                  \
    do {                                                                                     \
        a = a + b + (x); d = rotr(d ^ a, 16); c = c + d; b = rotr(b ^ c, 12);                \
        a = a + b + (y); d = rotr(d ^ a, 8);  c = c + d; b = rotr(b ^ c, 7);                 \
    } while (0)

/* One round: the columns, then the diagonals, with the message words the round's schedule s names;
 * GF is G (one compression) or VG (sixteen), over state v[16] and message m[16]. */
#define ROUND(GF, v, m, s)                                                                      \
    do {                                                                                        \
        GF(v[0], v[4], v[8], v[12], m[s[0]], m[s[1]]);                                          \
        GF(v[1], v[5], v[9], v[13], m[s[2]], m[s[3]]);                                          \
        GF(v[2], v[6], v[10], v[14], m[s[4]], m[s[5]]);                                         \
        GF(v[3], v[7], v[11], v[15], m[s[6]], m[s[7]]);                                         \
        GF(v[0], v[5], v[10], v[15], m[s[8]], m[s[9]]);                                         \
        GF(v[1], v[6], v[11], v[12], m[s[10]], m[s[11]]);                                       \
        GF(v[2], v[7], v[8], v[13], m[s[12]], m[s[13]]);                                        \
        GF(v[3], v[4], v[9], v[14], m[s[14]], m[s[15]]);                                        \
    } while (0)

/* the first 8 words of the output: a CV, or the digest where flags hold ROOT */
static void compress(const uint32_t cv[8], const uint8_t block[BLOCK], uint64_t counter, uint32_t len,
                     uint32_t flags, uint32_t out[8]) {
    uint32_t m[16], v[16];
    memcpy(m, block, BLOCK);
    memcpy(v, cv, 32);
    memcpy(v + 8, IV, 16);
    v[12] = (uint32_t)counter; v[13] = (uint32_t)(counter >> 32); v[14] = len; v[15] = flags;
    for (int r = 0; r < 7; r++) {
        const uint8_t *s = SCHEDULE[r];
        ROUND(G, v, m, s);
    }
    for (int i = 0; i < 8; i++) out[i] = v[i] ^ v[i + 8];
}

/* A chunk of 0 to 1024 bytes: its CV, or with root its digest (a buffer of one chunk). */
static void chunk_cv(const uint8_t *p, size_t len, uint64_t counter, int root, uint32_t out[8]) {
    uint32_t cv[8];
    memcpy(cv, IV, 32);
    size_t blocks = len ? (len + BLOCK - 1) / BLOCK : 1;
    for (size_t b = 0; b < blocks; b++) {
        uint8_t block[BLOCK] = {0};
        size_t n = len - b * BLOCK < BLOCK ? len - b * BLOCK : BLOCK;
        if (len) memcpy(block, p + b * BLOCK, n);
        uint32_t flags = (b == 0 ? CHUNK_START : 0) | (b + 1 == blocks ? CHUNK_END | (root ? ROOT : 0) : 0);
        compress(cv, block, counter, (uint32_t)(len ? n : 0), flags, cv);
    }
    memcpy(out, cv, 32);
}

static void parent_cv(const uint8_t pair[BLOCK], int root, uint32_t out[8]) {
    compress(IV, pair, 0, BLOCK, PARENT | (root ? ROOT : 0), out);
}

/* ---- sixteen at once ---- */

typedef uint32_t vec __attribute__((vector_size(4 * LANES)));

static inline __attribute__((always_inline)) vec vrotr(vec w, int c) { return (w >> c) | (w << (32 - c)); }

#define VG(a, b, c, d, x, y)                                                                 \
    do {                                                                                     \
        a = a + b + (x); d = vrotr(d ^ a, 16); c = c + d; b = vrotr(b ^ c, 12);              \
        a = a + b + (y); d = vrotr(d ^ a, 8);  c = c + d; b = vrotr(b ^ c, 7);               \
    } while (0)

/* One block of each of 16 lanes: lane l's block at blocks[l]; cv[8] updated in place. Inlined into
 * the two loops below, which are cloned per target: no vector crosses a call between clones. */
static inline __attribute__((always_inline)) void compress16(vec cv[8], const uint8_t *const blocks[LANES], vec lo, vec hi, uint32_t len, uint32_t flags) {
    uint32_t words[LANES][16] __attribute__((aligned(64)));
    vec m[16];
    for (int l = 0; l < LANES; l++) memcpy(words[l], blocks[l], BLOCK);
    for (int w = 0; w < 16; w++)
        for (int l = 0; l < LANES; l++) m[w][l] = words[l][w];
    vec v[16] = {0};
    for (int i = 0; i < 8; i++) v[i] = cv[i];
    v[8] = (vec){0} + IV[0]; v[9] = (vec){0} + IV[1]; v[10] = (vec){0} + IV[2]; v[11] = (vec){0} + IV[3];
    v[12] = lo; v[13] = hi;
    v[14] = (vec){0} + len; v[15] = (vec){0} + flags;
#pragma GCC unroll 7
    for (int r = 0; r < 7; r++) {
        const uint8_t *s = SCHEDULE[r];
        ROUND(VG, v, m, s);
    }
    for (int i = 0; i < 8; i++) cv[i] = v[i] ^ v[i + 8];
}

static inline __attribute__((always_inline)) void store16(const vec cv[8], uint8_t *out /* 16 x 32 bytes */) {
    for (int l = 0; l < LANES; l++) {
        uint32_t w[8];
        for (int i = 0; i < 8; i++) w[i] = cv[i][l];
        memcpy(out + 32 * l, w, 32);
    }
}

/* CVs of the full chunks [lo, hi) of p (chunk i at p + i * CHUNK, counter base + i) into out + 32 i. */
__attribute__((target_clones("avx512f", "avx2", "default")))
static void full_chunks(const uint8_t *p, size_t lo, size_t hi, uint64_t base, uint8_t *out) {
    size_t i = lo;
    for (; i + LANES <= hi; i += LANES) {
        vec cv[8], clo, chi;
        for (int k = 0; k < 8; k++) cv[k] = (vec){0} + IV[k];
        for (int l = 0; l < LANES; l++) {
            uint64_t c = base + i + (uint64_t)l;
            clo[l] = (uint32_t)c; chi[l] = (uint32_t)(c >> 32);
        }
        const uint8_t *blocks[LANES];
        for (int b = 0; b < CHUNK / BLOCK; b++) {
            for (int l = 0; l < LANES; l++) blocks[l] = p + (i + (size_t)l) * CHUNK + (size_t)b * BLOCK;
            uint32_t flags = (b == 0 ? CHUNK_START : 0) | (b == CHUNK / BLOCK - 1 ? CHUNK_END : 0);
            compress16(cv, blocks, clo, chi, BLOCK, flags);
        }
        store16(cv, out + 32 * i);
    }
    for (; i < hi; i++) {
        uint32_t w[8];
        chunk_cv(p + i * CHUNK, CHUNK, base + i, 0, w);
        memcpy(out + 32 * i, w, 32);
    }
}

/* Parents of pairs [lo, hi) of in (pair j at in + 64 j) into out + 32 j; no ROOT flag. */
__attribute__((target_clones("avx512f", "avx2", "default")))
static void parent_range(const uint8_t *in, size_t lo, size_t hi, uint8_t *out) {
    size_t j = lo;
    vec zero = {0};
    for (; j + LANES <= hi; j += LANES) {
        vec cv[8];
        for (int k = 0; k < 8; k++) cv[k] = zero + IV[k];
        const uint8_t *blocks[LANES];
        for (int l = 0; l < LANES; l++) blocks[l] = in + (j + (size_t)l) * BLOCK;
        compress16(cv, blocks, zero, zero, BLOCK, PARENT);
        store16(cv, out + 32 * j);
    }
    for (; j < hi; j++) {
        uint32_t w[8];
        parent_cv(in + j * BLOCK, 0, w);
        memcpy(out + 32 * j, w, 32);
    }
}

/* ---- threads ---- */

typedef struct {
    const uint8_t *p;
    size_t lo, hi;
    uint64_t base;
    uint8_t *out;
    int parents;
} Job;

static void *run_job(void *arg) {
    Job *j = (Job *)arg;
    if (j->parents) parent_range(j->p, j->lo, j->hi, j->out);
    else full_chunks(j->p, j->lo, j->hi, j->base, j->out);
    return NULL;
}

/* full_chunks or parent_range over [0, n), split over up to `threads` threads (ranges of whole
 * 16-lane groups, so each thread but the last takes the vector path throughout). */
static int split(const uint8_t *p, size_t n, uint64_t base, uint8_t *out, int threads, int parents) {
    size_t want = n / MIN_CHUNKS_PER_THREAD;
    int t = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if ((size_t)t > want) t = want ? (int)want : 1;
    Job jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    size_t per = (n / (size_t)t + LANES - 1) / LANES * LANES;
    for (int k = 0; k < t; k++) {
        size_t lo = per * (size_t)k, hi = k + 1 == t ? n : per * (size_t)(k + 1);
        if (lo > n) lo = n;
        if (hi > n) hi = n;
        jobs[k] = (Job){p, lo, hi, base, out, parents};
    }
    int started = 0;
    for (int k = 1; k < t; k++, started++)
        if (pthread_create(&ids[k], NULL, run_job, &jobs[k]) != 0) break;
    run_job(&jobs[0]);
    for (int k = started + 1; k < t; k++) run_job(&jobs[k]); /* those no thread could take */
    for (int k = 1; k <= started; k++) pthread_join(ids[k], NULL);
    return 0;
}

/* Every chunk's CV (non-root) of a buffer of len bytes (len > 0): the full chunks, then the tail. */
static void all_chunks(const uint8_t *p, size_t len, uint64_t base, uint8_t *out, int threads) {
    size_t full = len / CHUNK, n = (len + CHUNK - 1) / CHUNK;
    split(p, full, base, out, threads, 0);
    if (n > full) {
        uint32_t w[8];
        chunk_cv(p + full * CHUNK, len - full * CHUNK, base + full, 0, w);
        memcpy(out + 32 * full, w, 32);
    }
}

/* One level up from m nodes (at in): pairs hashed, an odd last node promoted; returns the count. */
static size_t level_up(const uint8_t *in, size_t m, uint8_t *out, int threads) {
    size_t pairs = m / 2;
    split(in, pairs, 0, out, threads, 1);
    if (m & 1) memcpy(out + 32 * pairs, in + 32 * (m - 1), 32);
    return pairs + (m & 1);
}

/* ---- Python ---- */

static int get_buffer(PyObject *obj, Py_buffer *view) {
    return PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS);
}

/* How many nodes a tree of n chunks keeps from level keep_from up to the one below its root. */
static size_t kept_nodes(size_t n, Py_ssize_t keep_from) {
    size_t kept = 0, m = n;
    for (Py_ssize_t level = 0; m > 1; level++, m = (m + 1) / 2)
        if (level >= keep_from) kept += m;
    return kept;
}

/* The digest of len bytes at p into digest, and the nodes of its levels from keep_from up into dst (room for
 * kept_nodes); a, b: scratch for ceil(len / 1024) and half as many CVs more. No Python: runs without the GIL. */
static void tree_into(const uint8_t *p, size_t len, Py_ssize_t keep_from, int threads, uint8_t *a, uint8_t *b,
                      uint8_t digest[32], uint8_t *dst) {
    size_t n = len ? (len + CHUNK - 1) / CHUNK : 1, m = n;
    uint32_t w[8];
    if (n == 1) {
        chunk_cv(p, len, 0, 1, w);
        memcpy(digest, w, 32);
        return;
    }
    all_chunks(p, len, 0, a, threads);
    for (Py_ssize_t level = 0;; level++) { /* n > 1: the levels end with one of two nodes */
        if (level >= keep_from) { memcpy(dst, a, 32 * m); dst += 32 * m; }
        if (m == 2) break;
        m = level_up(a, m, b, threads);
        uint8_t *t = a; a = b; b = t;
    }
    parent_cv(a, 1, w);
    memcpy(digest, w, 32);
}

/* The digest of a buffer of len bytes into out (32 bytes): tree_into keeping no level. */
static void root_of(const uint8_t *p, size_t len, int threads, uint8_t *a, uint8_t *b, uint8_t out[32]) {
    tree_into(p, len, PY_SSIZE_T_MAX, threads, a, b, out, NULL);
}

/* tree(data, keep_from=0, threads=1) -> (digest, kept): the 32-byte digest of data, and the nodes of
 * every level from keep_from up to the one below the root, level after level (level 0: the chunks'
 * CVs). A buffer of one chunk has no level below its root: kept is empty. */
static PyObject *py_tree(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_ssize_t keep_from = 0;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "O|ni", &obj, &keep_from, &threads)) return NULL;
    if (keep_from < 0) {
        PyErr_SetString(PyExc_ValueError, "keep_from is a level, 0 or more");
        return NULL;
    }
    Py_buffer view;
    if (get_buffer(obj, &view) < 0) return NULL;
    size_t len = (size_t)view.len, n = len ? (len + CHUNK - 1) / CHUNK : 1;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(32 * kept_nodes(n, keep_from)));
    uint8_t *a = malloc(32 * n), *b = malloc(32 * ((n + 1) / 2));
    if (!out || !a || !b) {
        free(a); free(b); Py_XDECREF(out); PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    uint8_t digest[32];
    Py_BEGIN_ALLOW_THREADS
    tree_into((const uint8_t *)view.buf, len, keep_from, threads, a, b, digest, (uint8_t *)PyBytes_AS_STRING(out));
    Py_END_ALLOW_THREADS
    free(a); free(b);
    PyBuffer_Release(&view);
    PyObject *result = Py_BuildValue("(y#O)", (const char *)digest, (Py_ssize_t)32, out);
    Py_DECREF(out);
    return result;
}

/* trees(buffers, keep_froms) -> [(digest, kept), ...]: tree(buffer, keep_from) of many buffers in one call,
 * each with its own keep_from (a large one keeps nothing: a digest alone), on the calling thread. */
static PyObject *py_trees(PyObject *self, PyObject *args) {
    PyObject *seq, *keeps_seq;
    if (!PyArg_ParseTuple(args, "OO", &seq, &keeps_seq)) return NULL;
    PyObject *items = PySequence_Fast(seq, "trees takes a sequence of buffers");
    if (!items) return NULL;
    PyObject *keeps = PySequence_Fast(keeps_seq, "trees takes a sequence of levels");
    if (!keeps) { Py_DECREF(items); return NULL; }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(items), got = 0;
    Py_buffer *views = PyMem_Calloc((size_t)(count ? count : 1), sizeof(Py_buffer));
    PyObject **kept = PyMem_Calloc((size_t)(count ? count : 1), sizeof(PyObject *));
    Py_ssize_t *froms = PyMem_Calloc((size_t)(count ? count : 1), sizeof(Py_ssize_t));
    uint8_t *outs = PyMem_Malloc((size_t)(count ? count : 1) * 32), *a = NULL, *b = NULL;
    PyObject *result = NULL;
    size_t most = 1;
    if (!views || !kept || !froms || !outs) { PyErr_NoMemory(); goto done; }
    if (PySequence_Fast_GET_SIZE(keeps) != count) {
        PyErr_SetString(PyExc_ValueError, "trees takes one keep_from a buffer");
        goto done;
    }
    for (; got < count; got++) {
        froms[got] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(keeps, got));
        if (froms[got] < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "keep_from is a level, 0 or more");
            goto done;
        }
        if (get_buffer(PySequence_Fast_GET_ITEM(items, got), &views[got]) < 0) goto done;
        size_t n = views[got].len ? ((size_t)views[got].len + CHUNK - 1) / CHUNK : 1;
        if (n > most) most = n;
        kept[got] = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(32 * kept_nodes(n, froms[got])));
        if (!kept[got]) { PyBuffer_Release(&views[got]); goto done; }
    }
    a = malloc(32 * most), b = malloc(32 * ((most + 1) / 2 + 1));
    if (!a || !b) { PyErr_NoMemory(); goto done; }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++)
        tree_into((const uint8_t *)views[i].buf, (size_t)views[i].len, froms[i], 1, a, b, outs + 32 * i,
                  (uint8_t *)PyBytes_AS_STRING(kept[i]));
    Py_END_ALLOW_THREADS
    result = PyList_New(count);
    for (Py_ssize_t i = 0; result && i < count; i++) {
        PyObject *pair = Py_BuildValue("(y#O)", (const char *)outs + 32 * i, (Py_ssize_t)32, kept[i]);
        if (!pair) { Py_CLEAR(result); break; }
        PyList_SET_ITEM(result, i, pair);
    }
done:
    free(a); free(b);
    for (Py_ssize_t i = 0; i < got; i++) { PyBuffer_Release(&views[i]); Py_XDECREF(kept[i]); }
    PyMem_Free(views); PyMem_Free(kept); PyMem_Free(froms); PyMem_Free(outs);
    Py_DECREF(items); Py_DECREF(keeps);
    return result;
}

/* chunk_cvs(data, counter=0, threads=1) -> bytes: every chunk's CV (non-root), chunk i with counter
 * counter + i; an empty buffer has none. */
static PyObject *py_chunk_cvs(PyObject *self, PyObject *args) {
    PyObject *obj;
    unsigned long long counter = 0;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "O|Ki", &obj, &counter, &threads)) return NULL;
    Py_buffer view;
    if (get_buffer(obj, &view) < 0) return NULL;
    size_t len = (size_t)view.len, n = (len + CHUNK - 1) / CHUNK;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(32 * n));
    if (!out) { PyBuffer_Release(&view); return NULL; }
    if (n) {
        uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(out);
        Py_BEGIN_ALLOW_THREADS
        all_chunks((const uint8_t *)view.buf, len, counter, dst, threads);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&view);
    return out;
}

/* parents(pairs, roots=None, threads=1) -> bytes: each 64-byte pair's parent CV; where roots (one byte
 * per pair) is non-zero, the root output instead (the ROOT flag). */
static PyObject *py_parents(PyObject *self, PyObject *args) {
    PyObject *obj, *roots_obj = Py_None;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "O|Oi", &obj, &roots_obj, &threads)) return NULL;
    Py_buffer view, roots = {0};
    if (get_buffer(obj, &view) < 0) return NULL;
    if (view.len % BLOCK) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "pairs is not a whole number of 64-byte pairs");
        return NULL;
    }
    size_t m = (size_t)view.len / BLOCK;
    if (roots_obj != Py_None) {
        if (get_buffer(roots_obj, &roots) < 0) { PyBuffer_Release(&view); return NULL; }
        if ((size_t)roots.len != m) {
            PyBuffer_Release(&view); PyBuffer_Release(&roots);
            PyErr_SetString(PyExc_ValueError, "roots must hold one byte per pair");
            return NULL;
        }
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(32 * m));
    if (out) {
        uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(out);
        const uint8_t *p = (const uint8_t *)view.buf, *r = (const uint8_t *)roots.buf;
        Py_BEGIN_ALLOW_THREADS
        split(p, m, 0, dst, threads, 1);
        if (r)
            for (size_t j = 0; j < m; j++)
                if (r[j]) {
                    uint32_t w[8];
                    parent_cv(p + j * BLOCK, 1, w);
                    memcpy(dst + 32 * j, w, 32);
                }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&view);
    if (roots_obj != Py_None) PyBuffer_Release(&roots);
    return out;
}

/* chunks(rows, lengths, counters, roots) -> bytes: R chunks given as rows of 1024 bytes (row i's
 * first lengths[i] bytes; int64 each), each with its counter (uint64) and root flag (a byte): their
 * CVs, or root outputs where the flag is set (R x 32 bytes). What a verifier needs for R openings. */
static PyObject *py_chunks(PyObject *self, PyObject *args) {
    PyObject *objs[4];
    if (!PyArg_ParseTuple(args, "OOOO", &objs[0], &objs[1], &objs[2], &objs[3])) return NULL;
    Py_buffer v[4];
    int got = 0;
    for (; got < 4; got++)
        if (get_buffer(objs[got], &v[got]) < 0) break;
    PyObject *out = NULL;
    if (got == 4) {
        size_t r = (size_t)v[3].len;
        if ((size_t)v[0].len != r * CHUNK || (size_t)v[1].len != 8 * r || (size_t)v[2].len != 8 * r) {
            PyErr_SetString(PyExc_ValueError, "rows, lengths, counters and roots must describe the same chunks");
        } else {
            const int64_t *len = (const int64_t *)v[1].buf;
            int bad = 0;
            for (size_t i = 0; i < r; i++) bad |= len[i] < 0 || len[i] > CHUNK;
            if (bad) PyErr_SetString(PyExc_ValueError, "a chunk holds 0 to 1024 bytes");
            else if ((out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(32 * r)))) {
                uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(out);
                const uint8_t *rows = (const uint8_t *)v[0].buf, *flags = (const uint8_t *)v[3].buf;
                const uint64_t *ctr = (const uint64_t *)v[2].buf;
                Py_BEGIN_ALLOW_THREADS
                for (size_t i = 0; i < r; i++) {
                    uint32_t w[8];
                    chunk_cv(rows + i * CHUNK, (size_t)len[i], ctr[i], flags[i] != 0, w);
                    memcpy(dst + 32 * i, w, 32);
                }
                Py_END_ALLOW_THREADS
            }
        }
    }
    for (int k = 0; k < got; k++) PyBuffer_Release(&v[k]);
    return out;
}

/* digests(buffers, threads=1) -> list of bytes: each buffer's 32-byte digest, in one call (a state's many
 * small tensors cost one call, not one each); the GIL released while hashing. */
static PyObject *py_digests(PyObject *self, PyObject *args) {
    PyObject *seq;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "O|i", &seq, &threads)) return NULL;
    PyObject *items = PySequence_Fast(seq, "digests takes a sequence of buffers");
    if (!items) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(items);
    Py_buffer *views = PyMem_Calloc((size_t)(count ? count : 1), sizeof(Py_buffer));
    uint8_t *outs = PyMem_Malloc((size_t)(count ? count : 1) * 32);
    PyObject *result = NULL;
    Py_ssize_t got = 0;
    size_t most = 1;
    if (!views || !outs) { PyErr_NoMemory(); goto done; }
    for (; got < count; got++) {
        if (get_buffer(PySequence_Fast_GET_ITEM(items, got), &views[got]) < 0) goto done;
        size_t n = views[got].len ? ((size_t)views[got].len + CHUNK - 1) / CHUNK : 1;
        if (n > most) most = n;
    }
    uint8_t *a = malloc(32 * most), *b = malloc(32 * ((most + 1) / 2 + 1));
    if (!a || !b) { free(a); free(b); PyErr_NoMemory(); goto done; }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++)
        root_of((const uint8_t *)views[i].buf, (size_t)views[i].len, threads, a, b, outs + 32 * i);
    Py_END_ALLOW_THREADS
    free(a); free(b);
    result = PyList_New(count);
    for (Py_ssize_t i = 0; result && i < count; i++) {
        PyObject *d = PyBytes_FromStringAndSize((const char *)outs + 32 * i, 32);
        if (!d) { Py_CLEAR(result); break; }
        PyList_SET_ITEM(result, i, d);
    }
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(outs);
    Py_DECREF(items);
    return result;
}

static PyMethodDef methods[] = {
    {"digests", py_digests, METH_VARARGS, "BLAKE3 digests of many buffers in one call."},
    {"tree", py_tree, METH_VARARGS, "BLAKE3 digest of a buffer and the CVs of its tree's levels."},
    {"trees", py_trees, METH_VARARGS, "tree() of many buffers in one call, each with its own keep_from."},
    {"chunk_cvs", py_chunk_cvs, METH_VARARGS, "Chaining values of every 1 KiB chunk of a buffer."},
    {"parents", py_parents, METH_VARARGS, "Parent CVs (or root outputs) of 64-byte pairs of CVs."},
    {"chunks", py_chunks, METH_VARARGS, "CVs (or root outputs) of many chunks with their own counters."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blake3", "BLAKE3 with its chaining values.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__blake3(void) {
    return PyModule_Create(&module);
}
