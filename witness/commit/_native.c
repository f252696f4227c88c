/* Batched SHA-256 for the data commitments and the parameter chunks of online runs: many small
 * messages hashed in one call, on several threads, with the GIL released.
 *
 * Committing a dataset hashes every sample, then builds an RFC 6962 tree over them. In Python each
 * of those hashes costs a call; here a call hashes a whole chunk of samples. The SHA-256 itself is
 * OpenSSL's (libcrypto, with its SHA-NI and AVX2 code paths): this file only loops and splits the
 * loop over threads. Every function has a pure-Python twin in witness/commit/batch.py that gives
 * the same bytes; tests compare the two.
 */
#define PY_SSIZE_T_CLEAN
#define OPENSSL_SUPPRESS_DEPRECATED /* SHA256_Init & co: the one-call-per-block API, no EVP lookups */
#include <Python.h>
#include <openssl/sha.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define MAX_THREADS 64
#define MAX_TAG 256
/* below this many messages a call stays on one thread: starting threads costs more */
#define MIN_PER_THREAD 2048

typedef struct {
    /* shared inputs */
    const unsigned char *data;
    const uint64_t *offsets; /* n + 1 offsets into data (message i between i and i + 1), or */
    const uint64_t *spans;   /* 2n: message i from spans[2i] to spans[2i + 1], or NULL for both: */

    Py_ssize_t width;
    const unsigned char *prefix; /* hashed before every message */
    Py_ssize_t prefix_len;
    int length_prefix; /* 1: the message's length as 8 big-endian bytes after the prefix */
    /* windows mode (keys != NULL): message i is keys[i] (32 bytes) || the 8 big-endian bytes of
     * first + i * stride (a position, in tokens) || data[i * stride * token : ... + width] */
    const unsigned char *keys;
    uint64_t first, stride, token;
    unsigned char *out;
    /* this thread's range of messages */
    Py_ssize_t lo, hi;
} Job;

static void hash_range(const Job *j) {
    SHA256_CTX base, ctx;
    SHA256_Init(&base);
    SHA256_Update(&base, j->prefix, (size_t)j->prefix_len);
    for (Py_ssize_t i = j->lo; i < j->hi; i++) {
        const unsigned char *msg;
        uint64_t len;
        if (j->keys) {
            uint64_t pos = j->first + (uint64_t)i * j->stride;
            unsigned char head[40];
            memcpy(head, j->keys + (size_t)i * 32, 32);
            for (int b = 0; b < 8; b++) head[32 + b] = (unsigned char)(pos >> (56 - 8 * b));
            uint64_t total = 40 + (uint64_t)j->width;
            unsigned char be[8];
            for (int b = 0; b < 8; b++) be[b] = (unsigned char)(total >> (56 - 8 * b));
            ctx = base;
            SHA256_Update(&ctx, be, 8);
            SHA256_Update(&ctx, head, 40);
            SHA256_Update(&ctx, j->data + (size_t)i * j->stride * j->token, (size_t)j->width);
            unsigned char *out = j->out + (size_t)i * 64;
            SHA256_Final(out, &ctx);
            /* and its dataset leaf, SHA-256(0x00 || sample hash || key), while both are at hand */
            static const unsigned char zero = 0;
            SHA256_Init(&ctx);
            SHA256_Update(&ctx, &zero, 1);
            SHA256_Update(&ctx, out, 32);
            SHA256_Update(&ctx, j->keys + (size_t)i * 32, 32);
            SHA256_Final(out + 32, &ctx);
            continue;
        }
        if (j->offsets) {
            msg = j->data + j->offsets[i];
            len = j->offsets[i + 1] - j->offsets[i];
        } else if (j->spans) {
            msg = j->data + j->spans[2 * i];
            len = j->spans[2 * i + 1] - j->spans[2 * i];
        } else { /* a fixed width */
            msg = j->data + (size_t)i * (size_t)j->width;
            len = (uint64_t)j->width;
        }
        ctx = base;
        if (j->length_prefix) {
            unsigned char be[8];
            for (int b = 0; b < 8; b++) be[b] = (unsigned char)(len >> (56 - 8 * b));
            SHA256_Update(&ctx, be, 8);
        }
        SHA256_Update(&ctx, msg, (size_t)len);
        SHA256_Final(j->out + (size_t)i * 32, &ctx);
    }
}

static void *hash_thread(void *arg) {
    hash_range((const Job *)arg);
    return NULL;
}

/* Hash messages [0, n) of `proto`, split into contiguous ranges over up to `threads` threads. */
static void run_jobs(const Job *proto, Py_ssize_t n, int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if ((Py_ssize_t)threads * MIN_PER_THREAD > n) threads = (int)(n / MIN_PER_THREAD) + 1;
    Job jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < threads; t++) {
        jobs[t] = *proto;
        jobs[t].lo = n * t / threads;
        jobs[t].hi = n * (t + 1) / threads;
    }
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, hash_thread, &jobs[t]) == 0;
    hash_range(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            hash_range(&jobs[t]); /* no thread to be had: this one does the share */
    }
}

/* tagged(tag, data, cut, threads, spans) -> bytes
 * SHA-256(tag || 0x00 || len as 8 big-endian bytes || message) for each message (tagged_hash of one
 * part). Messages are data cut into `cut`-byte pieces (an int), or, with `cut` a buffer of
 * little-endian uint64: between consecutive offsets (n + 1 of them), or with spans = 1 from
 * cut[2i] to cut[2i + 1] (2n of them). */
static PyObject *py_tagged(PyObject *self, PyObject *args) {
    Py_buffer tag, data, offs = {0};
    PyObject *cut;
    int threads, spans = 0;
    if (!PyArg_ParseTuple(args, "y*y*Oi|p", &tag, &data, &cut, &threads, &spans)) return NULL;
    PyObject *result = NULL;
    Job job = {0};
    unsigned char prefix[MAX_TAG + 1];
    Py_ssize_t n;
    if (tag.len > MAX_TAG) {
        PyErr_SetString(PyExc_ValueError, "tag too long");
        goto done;
    }
    memcpy(prefix, tag.buf, (size_t)tag.len);
    prefix[tag.len] = 0;
    job.prefix = prefix;
    job.prefix_len = tag.len + 1;
    job.length_prefix = 1;
    job.data = data.buf;
    if (PyLong_Check(cut)) {
        job.width = PyLong_AsSsize_t(cut);
        if (job.width < 0 || (job.width == 0 && data.len) || (job.width && data.len % job.width)) {
            PyErr_SetString(PyExc_ValueError, "data is not a whole number of messages of that width");
            goto done;
        }
        n = job.width ? data.len / job.width : 0;
    } else {
        if (PyObject_GetBuffer(cut, &offs, PyBUF_SIMPLE) < 0) goto done;
        const uint64_t *o = offs.buf;
        if (spans) {
            if (offs.len % 16) {
                PyErr_SetString(PyExc_ValueError, "spans must be pairs of uint64 values");
                goto done;
            }
            n = offs.len / 16;
            for (Py_ssize_t i = 0; i < n; i++) {
                if (o[2 * i] > o[2 * i + 1] || o[2 * i + 1] > (uint64_t)data.len) {
                    PyErr_SetString(PyExc_ValueError, "a span must lie within the data");
                    goto done;
                }
            }
            job.spans = o;
        } else {
            if (offs.len % 8 || offs.len < 8) {
                PyErr_SetString(PyExc_ValueError, "offsets must be n + 1 uint64 values");
                goto done;
            }
            n = offs.len / 8 - 1;
            for (Py_ssize_t i = 0; i < n; i++) {
                if (o[i] > o[i + 1] || o[i + 1] > (uint64_t)data.len) {
                    PyErr_SetString(PyExc_ValueError, "offsets must ascend within the data");
                    goto done;
                }
            }
            job.offsets = o;
        }
    }
    result = PyBytes_FromStringAndSize(NULL, n * 32);
    if (!result) goto done;
    job.out = (unsigned char *)PyBytes_AS_STRING(result);
    Py_BEGIN_ALLOW_THREADS
    run_jobs(&job, n, threads);
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&tag);
    PyBuffer_Release(&data);
    if (offs.obj) PyBuffer_Release(&offs);
    return result;
}

/* windows(tag, keys, tokens, first, stride, token, width, threads) -> bytes
 * The tagged hash of each packed window's canonical bytes, without assembling them, followed by
 * its dataset leaf SHA-256(0x00 || that hash || keys[i]): 64 bytes a window. Window i is
 * keys[i] || first + i * stride as 8 big-endian bytes || `width` bytes of `tokens` from
 * i * stride tokens of `token` bytes each (n = len(keys) / 32 windows; they may overlap). */
static PyObject *py_windows(PyObject *self, PyObject *args) {
    Py_buffer tag, keys, tokens;
    unsigned long long first, stride, token;
    Py_ssize_t width;
    int threads;
    if (!PyArg_ParseTuple(args, "y*y*y*KKKni", &tag, &keys, &tokens, &first, &stride, &token, &width, &threads))
        return NULL;
    PyObject *result = NULL;
    unsigned char prefix[MAX_TAG + 1];
    Py_ssize_t n = keys.len / 32;
    if (tag.len > MAX_TAG || keys.len % 32 || width < 0 || token == 0 ||
        (n && (uint64_t)(n - 1) * stride * token + (uint64_t)width > (uint64_t)tokens.len)) {
        PyErr_SetString(PyExc_ValueError, "windows must lie within the tokens, keys be 32-byte hashes");
        goto done;
    }
    memcpy(prefix, tag.buf, (size_t)tag.len);
    prefix[tag.len] = 0;
    result = PyBytes_FromStringAndSize(NULL, n * 64);
    if (!result) goto done;
    Job job = {.data = tokens.buf, .width = width, .prefix = prefix, .prefix_len = tag.len + 1, .keys = keys.buf,
               .first = first, .stride = stride, .token = token, .out = (unsigned char *)PyBytes_AS_STRING(result)};
    Py_BEGIN_ALLOW_THREADS
    run_jobs(&job, n, threads);
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&tag);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&tokens);
    return result;
}

/* SHA-256(prefix || record) of every `width`-byte record of `data` (parsed from "y*ni"). */
static PyObject *prefixed(PyObject *args, const unsigned char *prefix) {
    Py_buffer data;
    Py_ssize_t width;
    int threads;
    if (!PyArg_ParseTuple(args, "y*ni", &data, &width, &threads)) return NULL;
    PyObject *result = NULL;
    if (width <= 0 || data.len % width) {
        PyErr_SetString(PyExc_ValueError, "data is not a whole number of records of that width");
        goto done;
    }
    Py_ssize_t n = data.len / width;
    result = PyBytes_FromStringAndSize(NULL, n * 32);
    if (!result) goto done;
    Job job = {.data = data.buf, .width = width, .prefix = prefix, .prefix_len = 1,
               .out = (unsigned char *)PyBytes_AS_STRING(result)};
    Py_BEGIN_ALLOW_THREADS
    run_jobs(&job, n, threads);
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&data);
    return result;
}

/* leaves(data, width, threads) -> bytes: the RFC 6962 leaf hash SHA-256(0x00 || record) of every
 * `width`-byte record of data. */
static PyObject *py_leaves(PyObject *self, PyObject *args) {
    static const unsigned char zero = 0;
    return prefixed(args, &zero);
}

/* nodes(pairs, 64, threads) -> bytes: the RFC 6962 node hash SHA-256(0x01 || left || right) of every
 * 64-byte pair of child hashes (many Merkle paths checked level by level in one call). */
static PyObject *py_nodes(PyObject *self, PyObject *args) {
    static const unsigned char one = 1;
    return prefixed(args, &one);
}

/* One level of an RFC 6962 tree: the node hash SHA-256(0x01 || left || right) of each pair, the
 * last node promoted unchanged when the level is odd. `out` may be `in` (the write at i reads
 * 2i and 2i + 1, which no earlier write touched) only on one thread; else it is separate. */
static void level_up(const unsigned char *in, Py_ssize_t n, unsigned char *out, int threads) {
    static const unsigned char one = 1;
    Job job = {.data = in, .width = 64, .prefix = &one, .prefix_len = 1, .out = out};
    run_jobs(&job, n / 2, threads);
    if (n % 2) memmove(out + (n / 2) * 32, in + (n - 1) * 32, 32);
}

/* root(leaf_hashes, threads) -> bytes: the RFC 6962 root of the given leaf hashes (a whole number
 * of 32-byte hashes, at least one), level by level with the odd node promoted, as MTH is. */
static PyObject *py_root(PyObject *self, PyObject *args) {
    Py_buffer data;
    int threads;
    if (!PyArg_ParseTuple(args, "y*i", &data, &threads)) return NULL;
    PyObject *result = NULL;
    if (data.len % 32 || data.len == 0) {
        PyErr_SetString(PyExc_ValueError, "leaf hashes must be a non-empty whole number of 32-byte hashes");
        PyBuffer_Release(&data);
        return NULL;
    }
    Py_ssize_t n = data.len / 32;
    unsigned char *a = PyMem_RawMalloc((size_t)((n + 1) / 2) * 32 + 32);
    unsigned char *b = PyMem_RawMalloc((size_t)((n + 3) / 4) * 32 + 32);
    if (!a || !b) {
        PyMem_RawFree(a);
        PyMem_RawFree(b);
        PyBuffer_Release(&data);
        return PyErr_NoMemory();
    }
    unsigned char top[32];
    Py_BEGIN_ALLOW_THREADS
    if (n == 1) {
        memcpy(top, data.buf, 32);
    } else {
        /* two scratch buffers, used in turn (a level is never hashed in place: its threads would
         * overwrite nodes another thread still reads); each level is at most half the last */
        const unsigned char *cur = data.buf;
        unsigned char *bufs[2] = {a, b};
        int which = 0;
        while (n > 1) {
            unsigned char *next = bufs[which];
            level_up(cur, n, next, threads);
            cur = next;
            n = (n + 1) / 2;
            which ^= 1;
        }
        memcpy(top, cur, 32);
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(a);
    PyMem_RawFree(b);
    PyBuffer_Release(&data);
    result = PyBytes_FromStringAndSize((const char *)top, 32);
    return result;
}

/* levels(leaf_hashes, threads) -> bytes: every level of the RFC 6962 tree over the leaf hashes,
 * concatenated from the leaves themselves (level 0) up to the root (the last 32 bytes), each level
 * built as root() builds it (the odd node promoted). What a Merkle path is read from. */
static PyObject *py_levels(PyObject *self, PyObject *args) {
    Py_buffer data;
    int threads;
    if (!PyArg_ParseTuple(args, "y*i", &data, &threads)) return NULL;
    if (data.len % 32 || data.len == 0) {
        PyErr_SetString(PyExc_ValueError, "leaf hashes must be a non-empty whole number of 32-byte hashes");
        PyBuffer_Release(&data);
        return NULL;
    }
    Py_ssize_t n = data.len / 32, total = n;
    for (Py_ssize_t m = n; m > 1; m = (m + 1) / 2) total += (m + 1) / 2;
    PyObject *result = PyBytes_FromStringAndSize(NULL, total * 32);
    if (result) {
        unsigned char *out = (unsigned char *)PyBytes_AS_STRING(result);
        memcpy(out, data.buf, (size_t)n * 32);
        Py_BEGIN_ALLOW_THREADS
        /* each level is written past the one it is built from: no thread overwrites what another reads */
        unsigned char *cur = out, *next = out + (size_t)n * 32;
        for (Py_ssize_t m = n; m > 1; m = (m + 1) / 2) {
            level_up(cur, m, next, threads);
            cur = next;
            next += (size_t)((m + 1) / 2) * 32;
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&data);
    return result;
}

static PyMethodDef methods[] = {
    {"tagged", py_tagged, METH_VARARGS, "Tagged SHA-256 of many messages."},
    {"windows", py_windows, METH_VARARGS, "Tagged SHA-256 of packed token windows."},
    {"leaves", py_leaves, METH_VARARGS, "RFC 6962 leaf hashes of many fixed-width records."},
    {"root", py_root, METH_VARARGS, "RFC 6962 root of a list of leaf hashes."},
    {"nodes", py_nodes, METH_VARARGS, "RFC 6962 node hashes of many pairs of child hashes."},
    {"levels", py_levels, METH_VARARGS, "Every level of an RFC 6962 tree, leaves to root."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "Batched SHA-256 (OpenSSL).", -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
