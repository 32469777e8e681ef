/* cortex.ledger._core.KeyTable: the ingest's key map (cortex.ingest.ledger.Ledger) in C.
 *
 * An ingest maps every engine block hash it hears to a Cortex key, and each key to its parent.
 * Ledger (Python) keeps four dicts: engine hash -> key, key -> parent key, and the extra copies
 * of a hash or of a key beyond the first. KeyTable keeps the same state in two ordered
 * open-addressing tables of uint64 -> (uint64, extra copies), no Python object per block, and
 * applies Ledger.store / Ledger.remove with the same lookups and writes in the same order: each
 * table keeps insertion order exactly as the dict it replaces (an entry deleted and inserted
 * again goes last), so hashes(), items() and a snapshot's pairs come out as the dicts give them.
 * The Python Ledger is the specification (tests/ingest/test_ledger.py drives both with random
 * op streams).
 *
 * A table is an append-only array of entries (key, value, extra copies, live) plus an index of
 * entry positions + 1 (0 = empty), power-of-two sized, at most half full, linear probing from a
 * seeded 64-bit mix (the engine hashes come off the network: a random per-process seed keeps a
 * publisher from choosing colliding hashes), deletion by backward shift (no tombstones in the
 * index). Deleted entries stay in the array until it is full, then it is compacted (order kept)
 * or doubled.
 *
 * Engine hashes: vLLM's are unsigned 64-bit ints, SGLang's signed 64-bit (spec kv-events.md
 * §2); both are kept as their 64 bits. A table learns which reading its hashes need from the
 * first hash outside [0, 2^63) and keeps it. Whatever a table cannot hold exactly -- a bytes
 * hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), an int outside the table's reading, a key
 * outside [0, 2^64), anything that is not an int -- makes store / remove answer NotImplemented
 * before changing anything; the Python Ledger then takes its state over (export()) and goes on
 * in dicts, so every input gives exactly what the specification gives. A lookup of such a value
 * finds nothing, which is what the dicts answer too (it cannot be held).
 *
 * Included by _core.c after _blockkeys.h (store_tokens chains keys with its XXH3).
 */
#ifndef CORTEX_LEDGER_KEYMAP_H
#define CORTEX_LEDGER_KEYMAP_H

#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { KM_ANY = 0, KM_UNSIGNED = 1, KM_SIGNED = 2, KM_CONFLICT = 3 };

/* The reading a hash set needs, merged with another's: KM_CONFLICT when they disagree. */
static inline int km_merge(int a, int b) {
    if (a == KM_ANY) return b;
    if (b == KM_ANY || a == b) return a;
    return KM_CONFLICT;
}

typedef struct {
    uint64_t key, val;
    uint32_t extra; /* copies beyond the first */
    uint32_t live;
} KmEntry;

typedef struct {
    KmEntry *ent;
    Py_ssize_t used, cap, live; /* entries appended, room for, live */
    uint32_t *idx;              /* entry position + 1, 0 = empty */
    size_t mask;                /* index slots - 1 */
} KmTable;

#define KM_MIN_CAP 4
#define KM_MAX_CAP ((Py_ssize_t)1 << 30)

static uint64_t km_seed = 0x243f6a8885a308d3ULL; /* replaced from os.urandom at import */

static inline size_t km_home(const KmTable *t, uint64_t k) {
    uint64_t z = k ^ km_seed; /* splitmix64's finalizer */
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return (size_t)z & t->mask;
}

/* The index slot of k, or the empty slot where it would go; *pos its entry or -1. */
static inline size_t km_probe(const KmTable *t, uint64_t k, Py_ssize_t *pos) {
    size_t i = km_home(t, k);
    for (;;) {
        uint32_t e = t->idx[i];
        if (!e) {
            *pos = -1;
            return i;
        }
        if (t->ent[e - 1].key == k) {
            *pos = (Py_ssize_t)e - 1;
            return i;
        }
        i = (i + 1) & t->mask;
    }
}

static inline KmEntry *km_get(const KmTable *t, uint64_t k) {
    Py_ssize_t pos;
    km_probe(t, k, &pos);
    return pos < 0 ? NULL : &t->ent[pos];
}

/* Room for cap entries, the live ones compacted to the front in order, the index rebuilt.
 * -1 (no exception set) when out of memory; the table is then unchanged. */
static int km_rebuild(KmTable *t, Py_ssize_t cap) {
    size_t slots = 8;
    while (slots < (size_t)cap * 2) slots <<= 1;
    KmEntry *ent = PyMem_Malloc((size_t)cap * sizeof(KmEntry));
    uint32_t *idx = PyMem_Calloc(slots, sizeof(uint32_t));
    if (!ent || !idx) {
        PyMem_Free(ent);
        PyMem_Free(idx);
        return -1;
    }
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < t->used; i++)
        if (t->ent[i].live) ent[n++] = t->ent[i];
    PyMem_Free(t->ent);
    PyMem_Free(t->idx);
    t->ent = ent;
    t->idx = idx;
    t->cap = cap;
    t->used = t->live = n;
    t->mask = slots - 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t pos;
        size_t s = km_probe(t, ent[i].key, &pos);
        idx[s] = (uint32_t)(i + 1);
    }
    return 0;
}

static int km_init(KmTable *t) {
    memset(t, 0, sizeof(*t));
    return km_rebuild(t, KM_MIN_CAP);
}

static void km_free(KmTable *t) {
    PyMem_Free(t->ent);
    PyMem_Free(t->idx);
    memset(t, 0, sizeof(*t));
}

/* Insert k (absent) -> v at the end: 0, or -1 with MemoryError set. */
static int km_insert(KmTable *t, uint64_t k, uint64_t v) {
    if (t->used == t->cap) {
        /* dead entries take at least half the room: compact in place, else double */
        Py_ssize_t cap = (t->live + 1) * 2 <= t->cap ? t->cap : t->cap * 2;
        if (cap > KM_MAX_CAP || km_rebuild(t, cap) < 0) {
            PyErr_NoMemory();
            return -1;
        }
    }
    Py_ssize_t pos;
    size_t s = km_probe(t, k, &pos);
    KmEntry *e = &t->ent[t->used];
    e->key = k;
    e->val = v;
    e->extra = 0;
    e->live = 1;
    t->idx[s] = (uint32_t)(++t->used);
    t->live++;
    return 0;
}

/* Delete k if present (1), else 0. */
static int km_delete(KmTable *t, uint64_t k) {
    Py_ssize_t pos;
    size_t i = km_probe(t, k, &pos);
    if (pos < 0) return 0;
    t->ent[pos].live = 0;
    t->live--;
    if (pos == t->used - 1) t->used--; /* the last one appended: its room is free again */
    size_t j = i, mask = t->mask;
    for (;;) { /* backward shift: pull each follower whose home is not in (i, j] into i */
        j = (j + 1) & mask;
        uint32_t e = t->idx[j];
        if (!e) break;
        size_t h = km_home(t, t->ent[e - 1].key);
        if (((j - h) & mask) >= ((j - i) & mask)) {
            t->idx[i] = e;
            i = j;
        }
    }
    t->idx[i] = 0;
    return 1;
}

static void km_clear(KmTable *t) {
    if (t->cap > 1024) { /* a reset: give a large table's memory back */
        KmTable small;
        if (km_init(&small) == 0) {
            km_free(t);
            *t = small;
            return;
        }
    }
    t->used = t->live = 0;
    memset(t->idx, 0, (t->mask + 1) * sizeof(uint32_t));
}

static int km_copy(KmTable *dst, const KmTable *src) {
    memset(dst, 0, sizeof(*dst));
    dst->ent = PyMem_Malloc((size_t)src->cap * sizeof(KmEntry));
    dst->idx = PyMem_Malloc((src->mask + 1) * sizeof(uint32_t));
    if (!dst->ent || !dst->idx) {
        km_free(dst);
        PyErr_NoMemory();
        return -1;
    }
    memcpy(dst->ent, src->ent, (size_t)src->used * sizeof(KmEntry));
    memcpy(dst->idx, src->idx, (src->mask + 1) * sizeof(uint32_t));
    dst->used = src->used;
    dst->cap = src->cap;
    dst->live = src->live;
    dst->mask = src->mask;
    return 0;
}

/* ---- the Python type ------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    KmTable hashes; /* engine hash -> Cortex key; extra: more copies of the hash */
    KmTable keys;   /* Cortex key -> parent key; extra: more holders of the key */
    int mode;       /* the hashes' reading: KM_ANY (all in [0, 2^63)), KM_UNSIGNED, KM_SIGNED */
} KeyTable;

static PyTypeObject KeyTableType;

/* A Cortex key object: 0 with its value, 1 when it is not an exact int in [0, 2^64), -1 error. */
static int km_key_of(PyObject *o, uint64_t *u) {
    if (!PyLong_CheckExact(o)) return 1;
    unsigned long long w = PyLong_AsUnsignedLongLong(o);
    if (w == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
        PyErr_Clear();
        return 1;
    }
    *u = w;
    return 0;
}

/* An engine hash object: 0 with its bits and the reading it needs, 1 when no table holds it
 * (not an exact int, or outside both readings), -1 on error. */
static int km_hash_of(PyObject *o, uint64_t *u, int *need) {
    if (!PyLong_CheckExact(o)) return 1;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (!overflow) {
        *u = (uint64_t)v;
        *need = v < 0 ? KM_SIGNED : KM_ANY;
        return 0;
    }
    if (overflow < 0) return 1;
    int rc = km_key_of(o, u); /* in [2^63, 2^64): only the unsigned reading holds it */
    if (rc == 0) *need = KM_UNSIGNED;
    return rc;
}

/* A batch of hashes or keys as uint64 words: a buffer of 8-byte ints read in place, or a
 * sequence converted. km_batch_open takes hold of it, km_batch_read reads its first items. */
typedef struct {
    const uint64_t *w;
    Py_ssize_t n, total; /* items read, items in all */
    int need;            /* hashes: the reading the items read need */
    int unheld;          /* an item no table holds (see the top): the specification's */
    int is_signed;       /* a buffer of signed ints */
    uint8_t *needs;      /* a sequence of hashes: each item's reading */
    Py_buffer view;
    int has_view;
    uint64_t *owned;
    PyObject *seq;
} KmBatch;

static void km_batch_release(KmBatch *b) {
    if (b->has_view) PyBuffer_Release(&b->view);
    PyMem_Free(b->owned);
    PyMem_Free(b->needs);
    Py_XDECREF(b->seq);
    memset(b, 0, sizeof(*b));
}

/* 0, or -1 with an error set (not a sequence). A buffer that is not of 8-byte ints in native
 * order is marked unheld (the specification iterates it). */
static int km_batch_open(PyObject *obj, KmBatch *b) {
    memset(b, 0, sizeof(*b));
    if (PyObject_CheckBuffer(obj) && !PyBytes_Check(obj) && !PyByteArray_Check(obj)) {
        if (PyObject_GetBuffer(obj, &b->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            return -1;
        b->has_view = 1;
        const char *fmt = b->view.format ? b->view.format : "B";
        char code = fmt[0] == '@' || fmt[0] == '=' || fmt[0] == '<' ? fmt[1] : fmt[0];
        if (b->view.itemsize != 8 || !code || !strchr("QqLlNn", code) || strlen(fmt) > 2 ||
            (strlen(fmt) == 2 && fmt[1] != code)) {
            b->unheld = 1;
            return 0;
        }
        b->is_signed = code == 'q' || code == 'l' || code == 'n';
        b->w = (const uint64_t *)b->view.buf;
        b->total = b->view.len / 8;
        return 0;
    }
    b->seq = PySequence_Fast(obj, "a sequence or a buffer of 8-byte ints is needed");
    if (!b->seq) return -1;
    b->total = PySequence_Fast_GET_SIZE(b->seq);
    return 0;
}

/* The reading item i (read) needs. */
static inline int km_item_need(const KmBatch *b, Py_ssize_t i) {
    if (b->needs) return b->needs[i];
    if (!(b->w[i] >> 63)) return KM_ANY;
    return b->is_signed ? KM_SIGNED : KM_UNSIGNED;
}

/* Read the first `limit` items (-1: all) as hashes (hashes=1) or keys: 0, or -1 with an
 * error set. */
static int km_batch_read(KmBatch *b, int hashes, Py_ssize_t limit) {
    if (b->unheld) return 0;
    Py_ssize_t n = limit >= 0 && limit < b->total ? limit : b->total;
    b->n = n;
    if (b->has_view) {
        for (Py_ssize_t i = 0; i < n; i++) {
            if (hashes) b->need = km_merge(b->need, km_item_need(b, i));
            else if (b->is_signed && (int64_t)b->w[i] < 0) b->unheld = 1;
        }
        return 0;
    }
    PyObject **items = PySequence_Fast_ITEMS(b->seq);
    uint64_t *w = PyMem_Malloc((size_t)(n ? n : 1) * 8);
    uint8_t *needs = hashes ? PyMem_Malloc((size_t)(n ? n : 1)) : NULL;
    if (!w || (hashes && !needs)) {
        PyMem_Free(w);
        PyMem_Free(needs);
        PyErr_NoMemory();
        return -1;
    }
    b->owned = w;
    b->w = w;
    b->needs = needs;
    for (Py_ssize_t i = 0; i < n; i++) {
        int need = KM_ANY;
        int rc = hashes ? km_hash_of(items[i], &w[i], &need) : km_key_of(items[i], &w[i]);
        if (rc < 0) return -1;
        if (rc > 0) {
            b->unheld = 1;
            return 0;
        }
        if (hashes) {
            needs[i] = (uint8_t)need;
            b->need = km_merge(b->need, need);
        }
    }
    return 0;
}

/* Tables exist from allocation on (a KeyTable is never seen without them, __init__ or not). */
static PyObject *KeyTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    KeyTable *self = (KeyTable *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    if (km_init(&self->hashes) < 0 || km_init(&self->keys) < 0) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static int KeyTable_init(KeyTable *self, PyObject *args, PyObject *kwds) {
    if (!PyArg_ParseTuple(args, ":KeyTable")) return -1;
    km_clear(&self->hashes);
    km_clear(&self->keys);
    self->mode = KM_ANY;
    return 0;
}

static void KeyTable_dealloc(KeyTable *self) {
    km_free(&self->hashes);
    km_free(&self->keys);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* One more copy (saturating: 2^32 - 1 extra copies of one block are never reached by an
 * engine; a publisher sending more only makes the ledger drop the block early). */
static inline void km_more(KmEntry *e) {
    if (e->extra != UINT32_MAX) e->extra++;
}

/* Ledger._hold: key (under parent) gains a copy. */
static int km_hold(KeyTable *self, uint64_t key, uint64_t parent) {
    KmEntry *e = km_get(&self->keys, key);
    if (e) {
        km_more(e);
        return 0;
    }
    return km_insert(&self->keys, key, parent);
}

/* Ledger._forget: drop hash h (present) entirely; 1 with *dead set when its key is no longer
 * held, 0 when another copy keeps it. */
static int km_forget(KeyTable *self, uint64_t h, uint64_t *dead) {
    KmEntry *e = km_get(&self->hashes, h);
    uint64_t key = e->val;
    km_delete(&self->hashes, h);
    KmEntry *k = km_get(&self->keys, key);
    if (!k) return 0; /* not reached: every held hash's key is held */
    if (k->extra) {
        k->extra--;
        return 0;
    }
    km_delete(&self->keys, key);
    *dead = key;
    return 1;
}

/* Ledger.store over words: 0, or -1 with MemoryError (the blocks before it applied). */
static int km_store(KeyTable *self, const uint64_t *hs, const uint64_t *ks, Py_ssize_t n,
                    uint64_t parent) {
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h = hs[i], key = ks[i], dead;
        KmEntry *old = km_get(&self->hashes, h);
        if (!old) {
            if (km_insert(&self->hashes, h, key) < 0 || km_hold(self, key, parent) < 0) return -1;
        } else if (old->val == key) {
            km_more(old);
        } else { /* the engine reused a hash for other tokens: the newest store wins */
            km_forget(self, h, &dead);
            if (km_insert(&self->hashes, h, key) < 0 || km_hold(self, key, parent) < 0) return -1;
        }
        parent = key;
    }
    return 0;
}

/* store(hashes, keys, parent_key) -> None | NotImplemented: Ledger.store (lengths that differ:
 * the common part applied, then ValueError, as zip(strict=True) does). */
static PyObject *KeyTable_store(KeyTable *self, PyObject *args) {
    PyObject *hashes_in, *keys_in, *parent_in;
    if (!PyArg_ParseTuple(args, "OOO:store", &hashes_in, &keys_in, &parent_in)) return NULL;
    KmBatch hb, kb;
    PyObject *out = NULL;
    uint64_t parent;
    memset(&kb, 0, sizeof(kb));
    if (km_batch_open(hashes_in, &hb) < 0 || km_batch_open(keys_in, &kb) < 0) goto done;
    Py_ssize_t n = hb.total < kb.total ? hb.total : kb.total; /* what zip reads */
    if (km_batch_read(&hb, 1, n) < 0 || km_batch_read(&kb, 0, n) < 0) goto done;
    if (hb.unheld || kb.unheld) goto unheld;
    int mode = km_merge(self->mode, hb.need);
    if (mode == KM_CONFLICT) goto unheld;
    int prc = km_key_of(parent_in, &parent);
    if (prc < 0) goto done;
    if (prc > 0) goto unheld;
    self->mode = mode;
    if (km_store(self, hb.w, kb.w, n, parent) < 0) goto done;
    if (hb.total != kb.total) {
        PyErr_Format(PyExc_ValueError, "store: %zd hashes for %zd keys", hb.total, kb.total);
        goto done;
    }
    out = Py_None;
    Py_INCREF(out);
    goto done;
unheld:
    out = Py_NotImplemented;
    Py_INCREF(out);
done:
    km_batch_release(&hb);
    km_batch_release(&kb);
    return out;
}

/* store_tokens(hashes, tokens, block_size, parent_key) -> list[int] | None | NotImplemented:
 * Ledger.store of the keys chained from packed uint32 little-endian tokens (XXH3, as
 * block_keys_packed), which it returns; None (nothing changed) for a block size past 60
 * tokens. ValueError unless the tokens are len(hashes) blocks. */
static PyObject *KeyTable_store_tokens(KeyTable *self, PyObject *args) {
    PyObject *hashes_in, *parent_in;
    Py_buffer tokens;
    Py_ssize_t block_size;
    if (!PyArg_ParseTuple(args, "Oy*nO:store_tokens", &hashes_in, &tokens, &block_size,
                          &parent_in))
        return NULL;
    KmBatch hb;
    PyObject *out = NULL;
    uint64_t *keys = NULL, parent;
    memset(&hb, 0, sizeof(hb));
    if (km_batch_open(hashes_in, &hb) < 0 || km_batch_read(&hb, 1, -1) < 0) goto done;
    if (hb.unheld) goto unheld;
    if (block_size < 1 || block_size > XXH3_MAX_SHORT / 4) {
        out = Py_None;
        Py_INCREF(out);
        goto done;
    }
    size_t step = (size_t)block_size * 4;
    if ((size_t)tokens.len != step * (size_t)hb.n) {
        PyErr_Format(PyExc_ValueError, "store_tokens: %zd token bytes for %zd blocks of %zd",
                     tokens.len, hb.n, block_size);
        goto done;
    }
    int mode = km_merge(self->mode, hb.need);
    if (mode == KM_CONFLICT) goto unheld;
    int prc = km_key_of(parent_in, &parent);
    if (prc < 0) goto done;
    if (prc > 0) goto unheld;
    keys = PyMem_Malloc((size_t)(hb.n ? hb.n : 1) * 8);
    out = PyList_New(hb.n);
    if (!keys || !out) {
        Py_CLEAR(out);
        if (!keys) PyErr_NoMemory();
        goto done;
    }
    const uint8_t *p = (const uint8_t *)tokens.buf;
    uint64_t key = parent;
    for (Py_ssize_t i = 0; i < hb.n; i++) {
        key = keys[i] = xxh3_64_short(p + (size_t)i * step, step, key);
        PyObject *k = PyLong_FromUnsignedLongLong(key);
        if (!k) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, k);
    }
    self->mode = mode;
    if (km_store(self, hb.w, keys, hb.n, parent) < 0) Py_CLEAR(out);
    goto done;
unheld:
    out = Py_NotImplemented;
    Py_INCREF(out);
done:
    PyMem_Free(keys);
    km_batch_release(&hb);
    PyBuffer_Release(&tokens);
    return out;
}

/* remove(hashes) -> (dead keys, unknown) | NotImplemented: Ledger.remove. */
static PyObject *KeyTable_remove(KeyTable *self, PyObject *hashes_in) {
    KmBatch hb;
    PyObject *dead = NULL, *out = NULL;
    if (km_batch_open(hashes_in, &hb) < 0 || km_batch_read(&hb, 1, -1) < 0) goto done;
    if (hb.unheld) {
        out = Py_NotImplemented;
        Py_INCREF(out);
        goto done;
    }
    dead = PyList_New(0);
    if (!dead) goto done;
    Py_ssize_t unknown = 0;
    for (Py_ssize_t i = 0; i < hb.n; i++) {
        uint64_t h = hb.w[i], key;
        KmEntry *e = km_merge(self->mode, km_item_need(&hb, i)) == KM_CONFLICT ? NULL : km_get(&self->hashes, h);
        if (!e) {
            unknown++;
            continue;
        }
        if (e->extra) {
            e->extra--;
            continue;
        }
        if (km_forget(self, h, &key)) {
            PyObject *k = PyLong_FromUnsignedLongLong(key);
            if (!k || PyList_Append(dead, k) < 0) {
                Py_XDECREF(k);
                goto done;
            }
            Py_DECREF(k);
        }
    }
    out = Py_BuildValue("(On)", dead, unknown);
done:
    Py_XDECREF(dead);
    km_batch_release(&hb);
    return out;
}

static PyObject *km_hash_obj(const KeyTable *self, uint64_t h) {
    return self->mode == KM_SIGNED ? PyLong_FromLongLong((long long)(int64_t)h)
                                   : PyLong_FromUnsignedLongLong(h);
}

/* A lookup argument as a table word: 0 found a word, 1 none can match, -1 error. */
static int km_lookup_arg(const KeyTable *self, PyObject *o, int hashes, uint64_t *u) {
    if (!PyLong_Check(o)) return PyObject_Hash(o) == -1 ? -1 : 1; /* unhashable: TypeError */
    PyObject *exact = PyNumber_Index(o); /* an int subclass (bool) is looked up by value */
    if (!exact) return -1;
    int need = KM_ANY;
    int rc = hashes ? km_hash_of(exact, u, &need) : km_key_of(exact, u);
    Py_DECREF(exact);
    if (rc) return rc;
    return hashes && km_merge(self->mode, need) == KM_CONFLICT ? 1 : 0;
}

/* key_of(hash) -> int | None */
static PyObject *KeyTable_key_of(KeyTable *self, PyObject *o) {
    uint64_t h;
    int rc = km_lookup_arg(self, o, 1, &h);
    if (rc < 0) return NULL;
    KmEntry *e = rc ? NULL : km_get(&self->hashes, h);
    if (!e) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(e->val);
}

/* parent_of(key) -> int | None */
static PyObject *KeyTable_parent_of(KeyTable *self, PyObject *o) {
    uint64_t k;
    int rc = km_lookup_arg(self, o, 0, &k);
    if (rc < 0) return NULL;
    KmEntry *e = rc ? NULL : km_get(&self->keys, k);
    if (!e) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(e->val);
}

static int KeyTable_contains(KeyTable *self, PyObject *o) {
    uint64_t k;
    int rc = km_lookup_arg(self, o, 0, &k);
    if (rc < 0) return -1;
    return !rc && km_get(&self->keys, k) != NULL;
}

static Py_ssize_t KeyTable_len(KeyTable *self) { return self->keys.live; }

/* The live entries' keys (which=0) or values (1) of a table, in insertion order. */
static PyObject *km_list(const KeyTable *self, const KmTable *t, int which, int hashes) {
    PyObject *out = PyList_New(t->live);
    if (!out) return NULL;
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < t->used; i++) {
        const KmEntry *e = &t->ent[i];
        if (!e->live) continue;
        uint64_t w = which ? e->val : e->key;
        PyObject *o = hashes ? km_hash_obj(self, w) : PyLong_FromUnsignedLongLong(w);
        if (!o) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, n++, o);
    }
    return out;
}

/* hashes() -> list: every engine hash held, in insertion order. */
static PyObject *KeyTable_hashes(KeyTable *self, PyObject *unused) {
    return km_list(self, &self->hashes, 0, 1);
}

/* keys() -> list: every key held, in insertion order. */
static PyObject *KeyTable_keys(KeyTable *self, PyObject *unused) {
    return km_list(self, &self->keys, 0, 0);
}

/* items() -> (keys, parent keys), in insertion order. */
static PyObject *KeyTable_items(KeyTable *self, PyObject *unused) {
    PyObject *keys = km_list(self, &self->keys, 0, 0);
    PyObject *parents = keys ? km_list(self, &self->keys, 1, 0) : NULL;
    PyObject *out = parents ? PyTuple_Pack(2, keys, parents) : NULL;
    Py_XDECREF(keys);
    Py_XDECREF(parents);
    return out;
}

/* One table as (map, extra copies) dicts, the map in insertion order. */
static int km_export_one(const KeyTable *self, const KmTable *t, int hashes, PyObject **map,
                         PyObject **extra) {
    *map = PyDict_New();
    *extra = PyDict_New();
    if (!*map || !*extra) return -1;
    for (Py_ssize_t i = 0; i < t->used; i++) {
        const KmEntry *e = &t->ent[i];
        if (!e->live) continue;
        PyObject *k = hashes ? km_hash_obj(self, e->key) : PyLong_FromUnsignedLongLong(e->key);
        PyObject *v = PyLong_FromUnsignedLongLong(e->val);
        PyObject *x = e->extra ? PyLong_FromUnsignedLong(e->extra) : NULL;
        int rc = k && v && (!e->extra || x) ? PyDict_SetItem(*map, k, v) : -1;
        if (rc == 0 && x) rc = PyDict_SetItem(*extra, k, x);
        Py_XDECREF(k);
        Py_XDECREF(v);
        Py_XDECREF(x);
        if (rc < 0) return -1;
    }
    return 0;
}

/* export() -> (key_of, parent_of, dup_hash, dup_key): the Python Ledger's four dicts. */
static PyObject *KeyTable_export(KeyTable *self, PyObject *unused) {
    PyObject *d[4] = {NULL, NULL, NULL, NULL}, *out = NULL;
    if (km_export_one(self, &self->hashes, 1, &d[0], &d[2]) == 0 &&
        km_export_one(self, &self->keys, 0, &d[1], &d[3]) == 0)
        out = PyTuple_Pack(4, d[0], d[1], d[2], d[3]);
    for (int i = 0; i < 4; i++) Py_XDECREF(d[i]);
    return out;
}

static PyObject *KeyTable_clear(KeyTable *self, PyObject *unused) {
    km_clear(&self->hashes);
    km_clear(&self->keys);
    self->mode = KM_ANY;
    Py_RETURN_NONE;
}

static PyObject *KeyTable_copy(KeyTable *self, PyObject *unused) {
    KeyTable *other = (KeyTable *)KeyTableType.tp_alloc(&KeyTableType, 0);
    if (!other) return NULL;
    if (km_copy(&other->hashes, &self->hashes) < 0 || km_copy(&other->keys, &self->keys) < 0) {
        Py_DECREF(other);
        return NULL;
    }
    other->mode = self->mode;
    return (PyObject *)other;
}

static PyObject *KeyTable_get_hash_count(KeyTable *self, void *closure) {
    return PyLong_FromSsize_t(self->hashes.live);
}

static PyObject *KeyTable_get_allocated(KeyTable *self, void *closure) {
    size_t bytes = 0;
    const KmTable *ts[2] = {&self->hashes, &self->keys};
    for (int i = 0; i < 2; i++)
        bytes += (size_t)ts[i]->cap * sizeof(KmEntry) + (ts[i]->mask + 1) * sizeof(uint32_t);
    return PyLong_FromSize_t(bytes);
}

static PyObject *KeyTable_repr(KeyTable *self) {
    return PyUnicode_FromFormat("KeyTable(keys=%zd, engine_hashes=%zd)", self->keys.live,
                                self->hashes.live);
}

static PyGetSetDef KeyTable_getset[] = {
    {"hash_count", (getter)KeyTable_get_hash_count, NULL, "engine hashes held", NULL},
    {"allocated", (getter)KeyTable_get_allocated, NULL, "bytes of both tables", NULL},
    {NULL},
};

static PyMethodDef KeyTable_methods[] = {
    {"store", (PyCFunction)KeyTable_store, METH_VARARGS, NULL},
    {"store_tokens", (PyCFunction)KeyTable_store_tokens, METH_VARARGS, NULL},
    {"remove", (PyCFunction)KeyTable_remove, METH_O, NULL},
    {"key_of", (PyCFunction)KeyTable_key_of, METH_O, NULL},
    {"parent_of", (PyCFunction)KeyTable_parent_of, METH_O, NULL},
    {"hashes", (PyCFunction)KeyTable_hashes, METH_NOARGS, NULL},
    {"keys", (PyCFunction)KeyTable_keys, METH_NOARGS, NULL},
    {"items", (PyCFunction)KeyTable_items, METH_NOARGS, NULL},
    {"export", (PyCFunction)KeyTable_export, METH_NOARGS, NULL},
    {"clear", (PyCFunction)KeyTable_clear, METH_NOARGS, NULL},
    {"copy", (PyCFunction)KeyTable_copy, METH_NOARGS, NULL},
    {NULL},
};

static PySequenceMethods KeyTable_as_sequence = {
    .sq_length = (lenfunc)KeyTable_len,
    .sq_contains = (objobjproc)KeyTable_contains,
};

static PyTypeObject KeyTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cortex.ledger._core.KeyTable",
    .tp_doc = "One ingest source's engine hash -> key -> parent maps (cortex.ingest.ledger).",
    .tp_basicsize = sizeof(KeyTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = KeyTable_new,
    .tp_init = (initproc)KeyTable_init,
    .tp_dealloc = (destructor)KeyTable_dealloc,
    .tp_repr = (reprfunc)KeyTable_repr,
    .tp_methods = KeyTable_methods,
    .tp_getset = KeyTable_getset,
    .tp_as_sequence = &KeyTable_as_sequence,
};

#endif
