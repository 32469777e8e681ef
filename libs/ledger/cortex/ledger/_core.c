/* cortex.ledger._core: the radix hash tree's columns and hot loops in C.
 *
 * The compiled twin of cortex/ledger/pytree.py (the executable specification; a differential
 * test drives both). One Tree holds one hash domain's nodes as slots in parallel columns and
 * an open-addressing table of uint64 block keys -> slots. Sources are holder *bits* here; the
 * Python wrapper (cortex/ledger/native.py) maps them to Source values.
 *
 * Every batch argument is a buffer of 8-byte integers (a numpy uint64 array, array('Q'),
 * bytes-like) or a sequence of ints; batch results are bytearrays of native-endian words
 * (np.frombuffer views them without a copy). No numpy headers: the build needs only a C
 * compiler and Python's headers.
 *
 * Columns, per slot:
 *   key       uint64   block key (0 for a free slot)
 *   parent    int32    parent slot; NO_PARENT (-1) for a root, FREE (-2) for a free slot
 *   children  int32    live children (0 = leaf)
 *   recency   uint64   clock tick of the last store / match / touch
 *   holders   uint64[words]  holder bitset (bit b of word w = source bit 64*w+b)
 * The table's entries are (low 32 bits of the key) << 32 | (slot + 1), 0 = empty, linear
 * probing from a Fibonacci hash, deletion by backward shift (no tombstones).
 *
 * Single-threaded like the Python tree: the GIL is held throughout.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "_wire.h"

#define NO_PARENT (-1)
#define FREE (-2)
#define SMALL_BATCH 16

typedef struct {
    PyObject_HEAD
    int64_t cap;      /* slots the columns have room for */
    int64_t high;     /* slots handed out at least once */
    int64_t nodes;    /* live slots */
    int64_t words;    /* holder words per slot */
    int64_t evicted;  /* nodes evicted since creation */
    uint64_t *key;
    int32_t *parent;
    int32_t *children;
    uint64_t *recency;
    uint64_t *holders;
    int32_t *free_;   /* free stack of slots */
    int64_t nfree, free_cap;
    int64_t *held;    /* holdings per source bit, 64 * words */
    uint64_t *table;
    int shift;        /* 64 - log2(table size) */
    uint64_t tmask;
} Tree;

/* ---- batches of keys --------------------------------------------------------------------- */

typedef struct {
    const uint64_t *p;
    Py_ssize_t n;
    Py_buffer view;
    int has_view;
    uint64_t *owned;
} Keys;

static void keys_release(Keys *k) {
    if (k->has_view) PyBuffer_Release(&k->view);
    PyMem_Free(k->owned);
    k->has_view = 0;
    k->owned = NULL;
}

/* An int as uint64; -1 with an exception when it is not one. CPython 3.11's ints are read
 * from their 30-bit digits directly (a key list's conversion was a fifth of a Match). */
static inline int as_u64(PyObject *o, uint64_t *out) {
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30
    if (PyLong_CheckExact(o)) {
        const digit *d = ((PyLongObject *)o)->ob_digit;
        switch (Py_SIZE(o)) {
        case 0: *out = 0; return 0;
        case 1: *out = d[0]; return 0;
        case 2: *out = (uint64_t)d[0] | (uint64_t)d[1] << 30; return 0;
        case 3:
            if (d[2] < 16) {
                *out = (uint64_t)d[0] | (uint64_t)d[1] << 30 | (uint64_t)d[2] << 60;
                return 0;
            }
            break;
        default: break;
        }
    }
#endif
    PyObject *index = PyNumber_Index(o); /* numpy integers, bools, ... */
    if (!index) return -1;
    unsigned long long v = PyLong_AsUnsignedLongLong(index);
    Py_DECREF(index);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

/* A buffer of 8-byte integers is read in place; any other sequence of ints is copied. */
static int keys_get(PyObject *obj, Keys *k) {
    memset(k, 0, sizeof(*k));
    if (PyObject_CheckBuffer(obj) && !PyUnicode_Check(obj) &&
        PyObject_GetBuffer(obj, &k->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0) {
        k->has_view = 1;
        const char *fmt = k->view.format ? k->view.format : "B";
        char code = fmt[strlen(fmt) - 1];
        if (k->view.itemsize != 8 || !strchr("QqLlNn", code)) {
            PyErr_Format(PyExc_TypeError, "keys: a buffer of 8-byte integers is needed, got '%s'",
                         fmt);
            keys_release(k);
            return -1;
        }
        k->p = (const uint64_t *)k->view.buf;
        k->n = k->view.len / 8;
        return 0;
    }
    PyErr_Clear(); /* a strided buffer is read item by item below */
    PyObject *seq = PySequence_Fast(obj, "keys: a sequence of ints or a uint64 buffer is needed");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    k->owned = PyMem_Malloc((size_t)(n ? n : 1) * 8);
    if (!k->owned) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (as_u64(items[i], &k->owned[i]) < 0) {
            Py_DECREF(seq);
            keys_release(k);
            if (PyErr_ExceptionMatches(PyExc_OverflowError) ||
                PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_ValueError, "keys: item %zd is not a uint64", i);
            }
            return -1;
        }
    }
    Py_DECREF(seq);
    k->p = k->owned;
    k->n = n;
    return 0;
}

static PyObject *words_out(const void *src, Py_ssize_t words) {
    PyObject *out = PyByteArray_FromStringAndSize(NULL, words * 8);
    if (out && words) memcpy(PyByteArray_AS_STRING(out), src, (size_t)words * 8);
    return out;
}

/* ---- column memory ---------------------------------------------------------------------- */

/* Column and table memory. A large one is its own anonymous mapping advised to use
 * transparent huge pages: a growing tree faulted its fresh memory in 4 KiB at a time (a third
 * of a store's time went to the kernel), and every probe of a random key into a table of
 * millions missed the TLB. A header before the data says which kind a block is (the mapped
 * size; 0 for malloc). Allocation failures return NULL without an exception. */
#define HUGE_BYTES ((size_t)2 << 20)
#define COL_HEADER ((size_t)64)

static size_t huge_round(size_t n) { return (n + HUGE_BYTES - 1) & ~(HUGE_BYTES - 1); }

static void *col_alloc(size_t n, int zero) {
    size_t total = n + COL_HEADER, mapped = 0;
    char *base;
#if defined(MADV_HUGEPAGE) && defined(MAP_ANONYMOUS)
    if (total >= HUGE_BYTES) {
        mapped = huge_round(total);
        base = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (base == MAP_FAILED) return NULL;
        madvise(base, mapped, MADV_HUGEPAGE); /* advice: no huge pages is no error */
    } else
#endif
    {
        base = zero ? calloc(1, total) : malloc(total);
        if (!base) return NULL;
    }
    *(size_t *)base = mapped;
    return base + COL_HEADER;
}

static void col_free(void *p) {
    if (!p) return;
    char *base = (char *)p - COL_HEADER;
    size_t mapped = *(size_t *)base;
    if (mapped)
        munmap(base, mapped);
    else
        free(base);
}

/* ``p`` (of which the first ``used`` bytes matter) with room for ``n`` bytes. */
static void *col_realloc(void *p, size_t used, size_t n) {
    char *base = (char *)p - COL_HEADER;
    size_t mapped = *(size_t *)base;
    if (!mapped && n + COL_HEADER < HUGE_BYTES) {
        base = realloc(base, n + COL_HEADER);
        return base ? base + COL_HEADER : NULL;
    }
#if defined(MREMAP_MAYMOVE) && defined(MADV_HUGEPAGE)
    if (mapped) { /* the kernel moves the pages: no copy */
        size_t want = huge_round(n + COL_HEADER);
        char *moved = mremap(base, mapped, want, MREMAP_MAYMOVE);
        if (moved == MAP_FAILED) return NULL;
        madvise(moved, want, MADV_HUGEPAGE);
        *(size_t *)moved = want;
        return moved + COL_HEADER;
    }
#endif
    void *q = col_alloc(n, 0);
    if (!q) return NULL;
    memcpy(q, p, used < n ? used : n);
    col_free(p);
    return q;
}

/* ---- the key -> slot table --------------------------------------------------------------- */

static inline uint64_t home(const Tree *t, uint64_t key) {
    return (key * 0x9E3779B97F4A7C15ULL) >> t->shift;
}

static inline int64_t find(const Tree *t, uint64_t key) {
    uint32_t tag = (uint32_t)key;
    for (uint64_t i = home(t, key);; i = (i + 1) & t->tmask) {
        uint64_t e = t->table[i];
        if (!e) return -1;
        if ((uint32_t)(e >> 32) == tag) {
            int64_t slot = (int64_t)(uint32_t)e - 1;
            if (t->key[slot] == key) return slot;
        }
    }
}

/* ``find`` that also says where an absent key goes: ``*hole`` is the empty entry its probe
 * ended on (valid until the table next changes). */
static inline int64_t find_or_hole(const Tree *t, uint64_t key, uint64_t *hole) {
    uint32_t tag = (uint32_t)key;
    for (uint64_t i = home(t, key);; i = (i + 1) & t->tmask) {
        uint64_t e = t->table[i];
        if (!e) {
            *hole = i;
            return -1;
        }
        if ((uint32_t)(e >> 32) == tag) {
            int64_t slot = (int64_t)(uint32_t)e - 1;
            if (t->key[slot] == key) return slot;
        }
    }
}

/* Start loading the table line ``key`` probes first: independent lookups then overlap their
 * cache misses instead of paying them one after another. */
#define PREFETCH_AHEAD 8
static inline void prefetch_key(const Tree *t, uint64_t key) {
    __builtin_prefetch(&t->table[home(t, key)]);
}

static inline void table_put(Tree *t, uint64_t key, int64_t slot) {
    uint64_t i = home(t, key);
    while (t->table[i]) i = (i + 1) & t->tmask;
    t->table[i] = ((uint64_t)(uint32_t)key << 32) | (uint64_t)(slot + 1);
}

static void table_del(Tree *t, uint64_t key) {
    uint32_t tag = (uint32_t)key;
    uint64_t i = home(t, key);
    for (;; i = (i + 1) & t->tmask) {
        uint64_t e = t->table[i];
        if (!e) return;
        if ((uint32_t)(e >> 32) == tag && t->key[(uint32_t)e - 1] == key) break;
    }
    /* backward shift: pull later entries of the run into the hole when their home allows */
    for (uint64_t j = (i + 1) & t->tmask; t->table[j]; j = (j + 1) & t->tmask) {
        uint64_t h = home(t, t->key[(uint32_t)t->table[j] - 1]);
        int movable = (j > i) ? (h <= i || h > j) : (h <= i && h > j);
        if (movable) {
            t->table[i] = t->table[j];
            i = j;
        }
    }
    t->table[i] = 0;
}

/* Room in the table for ``want`` live keys at a load of at most 3/4. */
static int table_reserve(Tree *t, int64_t want) {
    uint64_t size = t->tmask + 1;
    if ((uint64_t)want * 4 <= size * 3) return 0;
    int bits = 64 - t->shift;
    while (((uint64_t)1 << bits) * 3 < (uint64_t)want * 4) bits++;
    uint64_t *fresh = col_alloc(((size_t)1 << bits) * 8, 1);
    if (!fresh) {
        PyErr_NoMemory();
        return -1;
    }
    col_free(t->table);
    t->table = fresh;
    t->shift = 64 - bits;
    t->tmask = ((uint64_t)1 << bits) - 1;
    /* re-insert from the columns in slot order: the keys are read sequentially (walking
     * the old table read each one at a random slot, a cache miss per entry) */
    for (int64_t slot = 0; slot < t->high; slot++) {
        if (slot + PREFETCH_AHEAD < t->high && t->parent[slot + PREFETCH_AHEAD] != FREE)
            prefetch_key(t, t->key[slot + PREFETCH_AHEAD]);
        if (t->parent[slot] != FREE) table_put(t, t->key[slot], slot);
    }
    return 0;
}

/* ---- slots ------------------------------------------------------------------------------- */

static int grow_column(void **col, int64_t old_cap, int64_t cap, size_t item) {
    void *p = col_realloc(*col, (size_t)old_cap * item, (size_t)cap * item);
    if (!p) {
        PyErr_NoMemory();
        return -1;
    }
    *col = p;
    return 0;
}

/* Room for ``extra`` new slots and keys: after this no allocation can fail mid-batch.
 * Grown columns are not zeroed (a slot is initialised when handed out), so their untouched
 * tail costs address space only. */
static int reserve(Tree *t, int64_t extra) {
    if (table_reserve(t, t->nodes + extra) < 0) return -1;
    int64_t need = t->high + extra;
    if (need > INT32_MAX) { /* parent slots are int32 */
        PyErr_SetString(PyExc_MemoryError, "a tree holds at most 2**31 - 1 nodes");
        return -1;
    }
    if (need > t->cap) {
        int64_t cap = t->cap * 2 > need ? t->cap * 2 : need;
        if (cap > INT32_MAX) cap = INT32_MAX;
        int64_t old = t->cap;
        if (grow_column((void **)&t->key, old, cap, 8) < 0 ||
            grow_column((void **)&t->parent, old, cap, 4) < 0 ||
            grow_column((void **)&t->children, old, cap, 4) < 0 ||
            grow_column((void **)&t->recency, old, cap, 8) < 0 ||
            grow_column((void **)&t->holders, old, cap, 8 * (size_t)t->words) < 0 ||
            grow_column((void **)&t->free_, old, cap, 4) < 0)
            return -1;
        t->cap = cap;
        t->free_cap = cap; /* never more free slots than slots: frees need no allocation */
    }
    return 0;
}

static inline int held_any(const Tree *t, int64_t slot) {
    const uint64_t *row = t->holders + slot * t->words;
    for (int64_t w = 0; w < t->words; w++)
        if (row[w]) return 1;
    return 0;
}

/* A node for ``key`` under ``parent`` (a slot or NO_PARENT) at the table's empty entry
 * ``hole`` (from ``find_or_hole``); room was reserved. */
static int64_t new_slot_at(Tree *t, uint64_t key, int32_t parent, uint64_t now, uint64_t hole) {
    int64_t slot = t->nfree ? t->free_[--t->nfree] : t->high++;
    t->key[slot] = key;
    t->parent[slot] = parent;
    t->children[slot] = 0;
    t->recency[slot] = now;
    memset(t->holders + slot * t->words, 0, 8 * (size_t)t->words);
    if (parent >= 0) t->children[parent]++;
    t->table[hole] = ((uint64_t)(uint32_t)key << 32) | (uint64_t)(slot + 1);
    t->nodes++;
    return slot;
}

static void free_slot(Tree *t, int64_t slot) {
    table_del(t, t->key[slot]);
    t->key[slot] = 0;
    t->parent[slot] = FREE;
    t->children[slot] = 0;
    t->recency[slot] = 0;
    memset(t->holders + slot * t->words, 0, 8 * (size_t)t->words);
    t->free_[t->nfree++] = (int32_t)slot;
    t->nodes--;
}

/* Free ``slot`` if it has neither holders nor children, then every ancestor that becomes so. */
static int64_t reclaim(Tree *t, int64_t slot) {
    int64_t freed = 0;
    while (slot >= 0 && t->parent[slot] != FREE && t->children[slot] == 0 && !held_any(t, slot)) {
        int32_t up = t->parent[slot];
        free_slot(t, slot);
        freed++;
        if (up < 0) break;
        t->children[up]--;
        slot = up;
    }
    return freed;
}

/* Give an orphan (a placeholder-rooted node) its now known parent, unless that makes a cycle. */
static void link_orphan(Tree *t, int64_t slot, int64_t parent) {
    if (parent < 0 || parent == slot) return;
    int64_t p = parent;
    for (int64_t steps = 0; steps < t->nodes; steps++) {
        if (p == slot) return; /* bogus input (keys are chained hashes): never create a cycle */
        p = t->parent[p];
        if (p < 0) break;
    }
    t->parent[slot] = (int32_t)parent;
    t->children[parent]++;
}

/* ---- the Tree type ----------------------------------------------------------------------- */

static int Tree_init(Tree *t, PyObject *args, PyObject *kw) {
    static char *names[] = {"capacity", NULL};
    Py_ssize_t cap = 1024;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|n", names, &cap)) return -1;
    if (t->table) {
        PyErr_SetString(PyExc_RuntimeError, "Tree is initialised once");
        return -1;
    }
    if (cap < 16) cap = 16;
    t->cap = cap;
    t->words = 1;
    t->shift = 64 - 4;
    t->tmask = 15;
    t->key = col_alloc((size_t)cap * 8, 0);
    t->parent = col_alloc((size_t)cap * 4, 0);
    t->children = col_alloc((size_t)cap * 4, 0);
    t->recency = col_alloc((size_t)cap * 8, 0);
    t->holders = col_alloc((size_t)cap * 8, 0);
    t->free_ = col_alloc((size_t)cap * 4, 0);
    t->free_cap = cap;
    t->held = PyMem_Calloc(64, 8);
    t->table = col_alloc(16 * 8, 1);
    if (!t->key || !t->parent || !t->children || !t->recency || !t->holders || !t->free_ ||
        !t->held || !t->table) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void Tree_dealloc(Tree *t) {
    col_free(t->key);
    col_free(t->parent);
    col_free(t->children);
    col_free(t->recency);
    col_free(t->holders);
    col_free(t->free_);
    PyMem_Free(t->held);
    col_free(t->table);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static int check_bit(const Tree *t, Py_ssize_t bit) {
    if (bit < 0 || bit >= 64 * t->words) {
        PyErr_Format(PyExc_ValueError, "source bit %zd outside 0..%lld", bit,
                     (long long)(64 * t->words - 1));
        return -1;
    }
    return 0;
}

/* Whether ``parents`` (or the chain parent ``chain``) are listed parents-first against
 * ``keys``: no parent is a key of the batch at its own or a later index. */
static int parents_first(const uint64_t *parents, uint64_t chain, const uint64_t *keys,
                         Py_ssize_t n) {
    if (!parents) {
        for (Py_ssize_t i = 0; i < n; i++)
            if (keys[i] == chain) return 0;
        return 1;
    }
    if (n <= SMALL_BATCH) {
        for (Py_ssize_t i = 0; i < n; i++) {
            for (Py_ssize_t j = 0; j < n; j++) {
                if (keys[j] == parents[i]) {
                    if (j >= i) return 0;
                    break;
                }
            }
        }
        return 1;
    }
    /* first index of every batch key, in a private table of (key, index + 1) */
    uint64_t size = 32;
    while (size < 2 * (uint64_t)n) size <<= 1;
    uint64_t *tab = PyMem_Calloc(size * 2, 8);
    if (!tab) return -1;
    int bits = __builtin_ctzll(size);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h = (keys[i] * 0x9E3779B97F4A7C15ULL) >> (64 - bits);
        while (tab[2 * h + 1] && tab[2 * h] != keys[i]) h = (h + 1) & (size - 1);
        if (!tab[2 * h + 1]) {
            tab[2 * h] = keys[i];
            tab[2 * h + 1] = (uint64_t)i + 1;
        }
    }
    int ok = 1;
    for (Py_ssize_t i = 0; i < n && ok; i++) {
        uint64_t h = (parents[i] * 0x9E3779B97F4A7C15ULL) >> (64 - bits);
        for (; tab[2 * h + 1]; h = (h + 1) & (size - 1)) {
            if (tab[2 * h] == parents[i]) {
                if (tab[2 * h + 1] - 1 >= (uint64_t)i) ok = 0;
                break;
            }
        }
    }
    PyMem_Free(tab);
    return ok;
}

static PyObject *store_batch(Tree *t, Py_ssize_t bit, const uint64_t *parents, uint64_t chain,
                             const uint64_t *keys, Py_ssize_t n, uint64_t now) {
    if (check_bit(t, bit) < 0) return NULL;
    int ok = parents_first(parents, chain, keys, n);
    if (ok < 0) return PyErr_NoMemory();
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, parents ? "blocks not listed parents-first"
                                                  : "blocks not listed parents-first (the "
                                                    "parent key is among the keys)");
        return NULL;
    }
    if (reserve(t, 2 * (int64_t)n) < 0) return NULL;
    int64_t word = bit >> 6;
    uint64_t mask = (uint64_t)1 << (bit & 63);
    int64_t fresh = 0, pslot = -1;
    for (Py_ssize_t i = 0; i < n && i < PREFETCH_AHEAD; i++) prefetch_key(t, keys[i]);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) prefetch_key(t, keys[i + PREFETCH_AHEAD]);
        uint64_t hole = 0;
        if (parents || i == 0) {
            uint64_t pk = parents ? parents[i] : chain;
            pslot = find_or_hole(t, pk, &hole);
            if (pslot < 0) pslot = new_slot_at(t, pk, NO_PARENT, now, hole); /* a placeholder */
        }
        int64_t slot = find_or_hole(t, keys[i], &hole);
        if (slot < 0)
            slot = new_slot_at(t, keys[i], (int32_t)pslot, now, hole);
        else if (t->parent[slot] == NO_PARENT)
            link_orphan(t, slot, pslot);
        uint64_t *cell = t->holders + slot * t->words + word;
        if (!(*cell & mask)) {
            *cell |= mask;
            fresh++;
        }
        t->recency[slot] = now;
        pslot = slot; /* a chain's next parent */
    }
    t->held[bit] += fresh;
    return PyLong_FromLongLong(fresh);
}

static PyObject *Tree_store_pairs(Tree *t, PyObject *args) {
    Py_ssize_t bit;
    PyObject *po, *ko;
    unsigned long long now;
    if (!PyArg_ParseTuple(args, "nOOK", &bit, &po, &ko, &now)) return NULL;
    Keys parents, keys;
    if (keys_get(po, &parents) < 0) return NULL;
    if (keys_get(ko, &keys) < 0) {
        keys_release(&parents);
        return NULL;
    }
    PyObject *out;
    if (parents.n != keys.n)
        out = PyErr_Format(PyExc_ValueError, "%zd parent keys for %zd keys", parents.n, keys.n);
    else
        out = store_batch(t, bit, parents.p, 0, keys.p, keys.n, now);
    keys_release(&parents);
    keys_release(&keys);
    return out;
}

static PyObject *Tree_store_chain(Tree *t, PyObject *args) {
    Py_ssize_t bit;
    unsigned long long parent, now;
    PyObject *ko;
    if (!PyArg_ParseTuple(args, "nKOK", &bit, &parent, &ko, &now)) return NULL;
    Keys keys;
    if (keys_get(ko, &keys) < 0) return NULL;
    PyObject *out = store_batch(t, bit, NULL, parent, keys.p, keys.n, now);
    keys_release(&keys);
    return out;
}

/* Take ``bit`` off ``keys`` (a checked bit); the keys it held go to ``dropped`` (room for
 * ``n``), their count is returned. */
static int64_t remove_keys(Tree *t, Py_ssize_t bit, const uint64_t *keys, Py_ssize_t n,
                           uint64_t *dropped) {
    int64_t word = bit >> 6, out = 0;
    uint64_t mask = (uint64_t)1 << (bit & 63);
    for (Py_ssize_t i = 0; i < n && i < PREFETCH_AHEAD; i++) prefetch_key(t, keys[i]);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) prefetch_key(t, keys[i + PREFETCH_AHEAD]);
        int64_t slot = find(t, keys[i]);
        if (slot < 0) continue;
        uint64_t *cell = t->holders + slot * t->words + word;
        if (!(*cell & mask)) continue;
        *cell &= ~mask;
        dropped[out++] = keys[i];
        /* a held ancestor later in the batch still has its bit: reclaiming stops below it */
        reclaim(t, slot);
    }
    t->held[bit] -= out;
    return out;
}

static PyObject *Tree_remove(Tree *t, PyObject *args) {
    Py_ssize_t bit;
    PyObject *ko;
    if (!PyArg_ParseTuple(args, "nO", &bit, &ko)) return NULL;
    if (check_bit(t, bit) < 0) return NULL;
    Keys keys;
    if (keys_get(ko, &keys) < 0) return NULL;
    uint64_t *dropped = PyMem_Malloc((size_t)(keys.n ? keys.n : 1) * 8);
    if (!dropped) {
        keys_release(&keys);
        return PyErr_NoMemory();
    }
    int64_t n = remove_keys(t, bit, keys.p, keys.n, dropped);
    keys_release(&keys);
    PyObject *out = words_out(dropped, n);
    PyMem_Free(dropped);
    return out;
}

/* Take ``bit`` off the slots [lo, hi) (reclaiming what it leaves dead); returns how many. */
static int64_t clear_slots(Tree *t, Py_ssize_t bit, int64_t lo, int64_t hi) {
    int64_t word = bit >> 6, dropped = 0;
    uint64_t mask = (uint64_t)1 << (bit & 63);
    if (hi > t->high) hi = t->high;
    for (int64_t slot = lo < 0 ? 0 : lo; slot < hi && dropped < t->held[bit]; slot++) {
        uint64_t *cell = t->holders + slot * t->words + word;
        if (*cell & mask) {
            *cell &= ~mask;
            dropped++;
            reclaim(t, slot);
        }
    }
    t->held[bit] -= dropped;
    return dropped;
}

static PyObject *Tree_clear(Tree *t, PyObject *args) {
    Py_ssize_t bit;
    if (!PyArg_ParseTuple(args, "n", &bit)) return NULL;
    if (check_bit(t, bit) < 0) return NULL;
    return PyLong_FromLongLong(clear_slots(t, bit, 0, t->high));
}

/* clear_range(bit, lo, hi): ``clear`` of the slots [lo, hi) only (a removal in steps). */
static PyObject *Tree_clear_range(Tree *t, PyObject *args) {
    Py_ssize_t bit, lo, hi;
    if (!PyArg_ParseTuple(args, "nnn", &bit, &lo, &hi)) return NULL;
    if (check_bit(t, bit) < 0) return NULL;
    return PyLong_FromLongLong(clear_slots(t, bit, lo, hi));
}

/* counts[bit] = the count of consecutive leading keys bit holds (64 * words of them);
 * found nodes get recency ``now``. */
static void match_counts(Tree *t, const Keys *kp, uint64_t now, int64_t *counts) {
    const Keys keys = *kp;
    int64_t words = t->words, nbits = 64 * words;
    uint64_t cum[words];
    for (int64_t w = 0; w < words; w++) cum[w] = ~(uint64_t)0;
    memset(counts, 0, (size_t)nbits * sizeof(int64_t));
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < keys.n && i < PREFETCH_AHEAD; i++) prefetch_key(t, keys.p[i]);
    for (; n < keys.n; n++) {
        if (n + PREFETCH_AHEAD < keys.n) prefetch_key(t, keys.p[n + PREFETCH_AHEAD]);
        int64_t slot = find(t, keys.p[n]);
        if (slot < 0) break;
        t->recency[slot] = now;
        const uint64_t *row = t->holders + slot * words;
        for (int64_t w = 0; w < words; w++) {
            uint64_t lost = cum[w] & ~row[w];
            if (!lost) continue;
            cum[w] &= row[w];
            if (n == 0) continue; /* counts start at 0 */
            while (lost) {
                counts[64 * w + __builtin_ctzll(lost)] = n;
                lost &= lost - 1;
            }
        }
    }
    for (int64_t w = 0; w < words; w++)
        for (uint64_t left = cum[w]; left; left &= left - 1) counts[64 * w + __builtin_ctzll(left)] = n;
}

/* Per source bit, the count of consecutive leading keys held: a list of 64 * words ints. */
static PyObject *Tree_match(Tree *t, PyObject *args) {
    PyObject *ko;
    unsigned long long now;
    if (!PyArg_ParseTuple(args, "OK", &ko, &now)) return NULL;
    Keys keys;
    if (keys_get(ko, &keys) < 0) return NULL;
    int64_t nbits = 64 * t->words;
    int64_t counts[nbits];
    match_counts(t, &keys, now, counts);
    keys_release(&keys);
    PyObject *out = PyList_New(nbits);
    if (!out) return NULL;
    for (int64_t b = 0; b < nbits; b++) {
        PyObject *v = PyLong_FromLongLong(counts[b]);
        if (!v) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, b, v);
    }
    return out;
}

/* A match's answer for a roster of ``(bit, source, state)`` tuples: a list of
 * ``cls(source, count, state)`` (``cls`` a tuple type: what a view returns, its
 * ``SourceMatch``), built here rather than by a Python loop over the sources. */
static PyObject *Tree_match_roster(Tree *t, PyObject *args) {
    PyObject *ko, *roster;
    PyTypeObject *cls = &PyTuple_Type;
    unsigned long long now;
    if (!PyArg_ParseTuple(args, "OKO!|O!", &ko, &now, &PyList_Type, &roster, &PyType_Type, &cls))
        return NULL;
    if (!PyType_IsSubtype(cls, &PyTuple_Type))
        return PyErr_Format(PyExc_TypeError, "match_roster: %s is not a tuple type", cls->tp_name);
    Keys keys;
    if (keys_get(ko, &keys) < 0) return NULL;
    int64_t nbits = 64 * t->words;
    int64_t counts[nbits];
    match_counts(t, &keys, now, counts);
    keys_release(&keys);
    Py_ssize_t n = PyList_GET_SIZE(roster);
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *entry = PyList_GET_ITEM(roster, i);
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 3) {
            Py_DECREF(out);
            return PyErr_Format(PyExc_TypeError, "roster[%zd]: a (bit, source, state) tuple", i);
        }
        Py_ssize_t bit = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 0));
        if (bit < 0 || bit >= nbits) {
            Py_DECREF(out);
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "roster[%zd]: bad bit", i);
            return NULL;
        }
        PyObject *count = PyLong_FromLongLong(counts[bit]);
        if (!count) {
            Py_DECREF(out);
            return NULL;
        }
        /* a tuple subclass is allocated as tuple.__new__ does it (tp_alloc of 3 items) */
        PyObject *item = cls == &PyTuple_Type ? PyTuple_New(3) : cls->tp_alloc(cls, 3);
        if (!item) {
            Py_DECREF(count);
            Py_DECREF(out);
            return NULL;
        }
        PyObject *source = PyTuple_GET_ITEM(entry, 1), *state = PyTuple_GET_ITEM(entry, 2);
        Py_INCREF(source);
        Py_INCREF(state);
        PyTuple_SET_ITEM(item, 0, source);
        PyTuple_SET_ITEM(item, 1, count);  /* stolen */
        PyTuple_SET_ITEM(item, 2, state);
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

static PyObject *Tree_touch(Tree *t, PyObject *args) {
    PyObject *ko;
    unsigned long long now;
    if (!PyArg_ParseTuple(args, "OK", &ko, &now)) return NULL;
    Keys keys;
    if (keys_get(ko, &keys) < 0) return NULL;
    Py_ssize_t found = 0;
    for (Py_ssize_t i = 0; i < keys.n; i++) {
        if (i + PREFETCH_AHEAD < keys.n) prefetch_key(t, keys.p[i + PREFETCH_AHEAD]);
        int64_t slot = find(t, keys.p[i]);
        if (slot >= 0) {
            t->recency[slot] = now;
            found++;
        }
    }
    keys_release(&keys);
    return PyLong_FromSsize_t(found);
}

/* Holder rows of the leading keys the tree has (up to the first absent one). */
static PyObject *Tree_leading_rows(Tree *t, PyObject *ko) {
    Keys keys;
    if (keys_get(ko, &keys) < 0) return NULL;
    Py_ssize_t n = 0;
    while (n < keys.n && find(t, keys.p[n]) >= 0) n++;
    PyObject *out = PyByteArray_FromStringAndSize(NULL, n * t->words * 8);
    if (out) {
        uint64_t *dst = (uint64_t *)PyByteArray_AS_STRING(out);
        for (Py_ssize_t i = 0; i < n; i++)
            memcpy(dst + i * t->words, t->holders + find(t, keys.p[i]) * t->words,
                   8 * (size_t)t->words);
    }
    keys_release(&keys);
    return out;
}

/* ---- eviction ---------------------------------------------------------------------------- */

/* Evict the slots flagged in ``victim`` (over ``high``): returns (keys, holder rows) of the
 * victims in slot order. Kept children of a victim become roots; a parent outside the set
 * that ends with neither holders nor children is reclaimed. */
static PyObject *evict_flagged(Tree *t, uint8_t *victim) {
    int64_t n = 0, words = t->words;
    for (int64_t s = 0; s < t->high; s++) n += victim[s];
    PyObject *keys = PyByteArray_FromStringAndSize(NULL, n * 8);
    PyObject *rows = PyByteArray_FromStringAndSize(NULL, n * words * 8);
    int32_t *outside = PyMem_Malloc((size_t)(n ? n : 1) * 4);
    if (!keys || !rows || !outside) {
        Py_XDECREF(keys);
        Py_XDECREF(rows);
        PyMem_Free(outside);
        return PyErr_NoMemory();
    }
    uint64_t *k = (uint64_t *)PyByteArray_AS_STRING(keys);
    uint64_t *r = (uint64_t *)PyByteArray_AS_STRING(rows);
    for (int64_t s = 0; s < t->high; s++) {
        int32_t p = t->parent[s];
        if (!victim[s] && p >= 0 && victim[p]) t->parent[s] = NO_PARENT;
    }
    int64_t i = 0, nout = 0;
    for (int64_t s = 0; s < t->high; s++) {
        if (!victim[s]) continue;
        const uint64_t *row = t->holders + s * words;
        for (int64_t w = 0; w < words; w++)
            for (uint64_t b = row[w]; b; b &= b - 1) t->held[64 * w + __builtin_ctzll(b)]--;
        memcpy(r + i * words, row, 8 * (size_t)words);
        k[i++] = t->key[s];
        int32_t p = t->parent[s];
        if (p >= 0 && !victim[p]) {
            t->children[p]--;
            outside[nout++] = p;
        }
    }
    for (int64_t s = 0; s < t->high; s++)
        if (victim[s]) free_slot(t, s);
    t->evicted += n;
    for (int64_t j = 0; j < nout; j++) reclaim(t, outside[j]);
    PyMem_Free(outside);
    PyObject *out = PyTuple_Pack(2, keys, rows);
    Py_DECREF(keys);
    Py_DECREF(rows);
    return out;
}

static PyObject *Tree_evict_older_than(Tree *t, PyObject *args) {
    long long cutoff;
    if (!PyArg_ParseTuple(args, "L", &cutoff)) return NULL;
    int64_t hi = t->high;
    uint8_t *guard = PyMem_Calloc((size_t)(hi ? hi : 1), 1);
    if (!guard) return PyErr_NoMemory();
    /* a young node protects its ancestors; protection climbs through old ones only */
    for (int64_t s = 0; s < hi; s++) {
        if (t->parent[s] == FREE || (cutoff >= 0 && t->recency[s] <= (uint64_t)cutoff)) continue;
        for (int32_t p = t->parent[s]; p >= 0 && !guard[p]; p = t->parent[p]) {
            guard[p] = 1;
            if (cutoff < 0 || t->recency[p] > (uint64_t)cutoff) break;
        }
    }
    for (int64_t s = 0; s < hi; s++)
        guard[s] = !guard[s] && t->parent[s] != FREE && cutoff >= 0 &&
                   t->recency[s] <= (uint64_t)cutoff;
    PyObject *out = evict_flagged(t, guard);
    PyMem_Free(guard);
    return out;
}

static PyObject *Tree_evict_keys(Tree *t, PyObject *ko) {
    Keys keys;
    if (keys_get(ko, &keys) < 0) return NULL;
    uint8_t *victim = PyMem_Calloc((size_t)(t->high ? t->high : 1), 1);
    if (!victim) {
        keys_release(&keys);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < keys.n; i++) {
        int64_t slot = find(t, keys.p[i]);
        if (slot >= 0) victim[slot] = 1;
    }
    keys_release(&keys);
    PyObject *out = evict_flagged(t, victim);
    PyMem_Free(victim);
    return out;
}

/* ---- sources, lookups, copies ------------------------------------------------------------ */

static PyObject *Tree_widen(Tree *t, PyObject *noargs) {
    int64_t words = t->words, cap = t->cap;
    uint64_t *holders = col_alloc((size_t)cap * (size_t)(words + 1) * 8, 1);
    int64_t *held = PyMem_Calloc((size_t)(64 * (words + 1)), 8);
    if (!holders || !held) {
        col_free(holders);
        PyMem_Free(held);
        return PyErr_NoMemory();
    }
    for (int64_t s = 0; s < t->high; s++)
        memcpy(holders + s * (words + 1), t->holders + s * words, 8 * (size_t)words);
    memcpy(held, t->held, 8 * 64 * (size_t)words);
    col_free(t->holders);
    PyMem_Free(t->held);
    t->holders = holders;
    t->held = held;
    t->words = words + 1;
    Py_RETURN_NONE;
}

static PyObject *Tree_held(Tree *t, PyObject *args) {
    Py_ssize_t bit;
    if (!PyArg_ParseTuple(args, "n", &bit)) return NULL;
    if (check_bit(t, bit) < 0) return NULL;
    return PyLong_FromLongLong(t->held[bit]);
}

static PyObject *Tree_holds(Tree *t, PyObject *args) {
    Py_ssize_t bit;
    unsigned long long key;
    if (!PyArg_ParseTuple(args, "nK", &bit, &key)) return NULL;
    if (check_bit(t, bit) < 0) return NULL;
    int64_t slot = find(t, key);
    return PyBool_FromLong(slot >= 0 && (t->holders[slot * t->words + (bit >> 6)] >> (bit & 63)) & 1);
}

static PyObject *Tree_slot_of(Tree *t, PyObject *args) {
    unsigned long long key;
    if (!PyArg_ParseTuple(args, "K", &key)) return NULL;
    return PyLong_FromLongLong(find(t, key));
}

/* (recency, parent key or None) of ``key``; None when the tree does not have it. */
static PyObject *Tree_node(Tree *t, PyObject *args) {
    unsigned long long key;
    if (!PyArg_ParseTuple(args, "K", &key)) return NULL;
    int64_t slot = find(t, key);
    if (slot < 0) Py_RETURN_NONE;
    int32_t p = t->parent[slot];
    if (p < 0) return Py_BuildValue("(KO)", (unsigned long long)t->recency[slot], Py_None);
    return Py_BuildValue("(KK)", (unsigned long long)t->recency[slot],
                         (unsigned long long)t->key[p]);
}

static PyObject *Tree_keys_of(Tree *t, PyObject *args) {
    Py_ssize_t bit;
    if (!PyArg_ParseTuple(args, "n", &bit)) return NULL;
    if (check_bit(t, bit) < 0) return NULL;
    PyObject *out = PyByteArray_FromStringAndSize(NULL, t->held[bit] * 8);
    if (!out) return NULL;
    uint64_t *dst = (uint64_t *)PyByteArray_AS_STRING(out);
    int64_t n = 0, word = bit >> 6;
    uint64_t mask = (uint64_t)1 << (bit & 63);
    for (int64_t s = 0; s < t->high && n < t->held[bit]; s++)
        if (t->holders[s * t->words + word] & mask) dst[n++] = t->key[s];
    return out;
}

static PyObject *Tree_live_recency(Tree *t, PyObject *noargs) {
    PyObject *out = PyByteArray_FromStringAndSize(NULL, t->nodes * 8);
    if (!out) return NULL;
    uint64_t *dst = (uint64_t *)PyByteArray_AS_STRING(out);
    int64_t n = 0;
    for (int64_t s = 0; s < t->high; s++)
        if (t->parent[s] != FREE) dst[n++] = t->recency[s];
    return out;
}

/* Every column over the slots handed out, and the free stack: {name: bytearray}. */
static PyObject *Tree_dump(Tree *t, PyObject *noargs) {
    int64_t hi = t->high;
    return Py_BuildValue(
        "{s:N,s:N,s:N,s:N,s:N,s:N,s:N}", "key", words_out(t->key, hi), "parent",
        PyByteArray_FromStringAndSize((const char *)t->parent, hi * 4), "children",
        PyByteArray_FromStringAndSize((const char *)t->children, hi * 4), "recency",
        words_out(t->recency, hi), "holders", words_out(t->holders, hi * t->words), "free",
        PyByteArray_FromStringAndSize((const char *)t->free_, t->nfree * 4), "held",
        words_out(t->held, 64 * t->words));
}

/* Replace the whole tree by validated columns (cortex.ledger.tree.validate_columns): keys
 * (uint64[n]), parents (int32[n]), holders (uint64[n * words]); recency starts at 0. */
static PyObject *Tree_load(Tree *t, PyObject *args) {
    Py_buffer kb, pb, hb;
    Py_ssize_t words;
    if (!PyArg_ParseTuple(args, "y*y*y*n", &kb, &pb, &hb, &words)) return NULL;
    int64_t n = kb.len / 8;
    PyObject *out = NULL;
    if (words < 1 || pb.len != n * 4 || hb.len != n * words * 8) {
        PyErr_SetString(PyExc_ValueError, "tree columns differ in length");
        goto done;
    }
    while (t->words < words) {
        PyObject *widened = Tree_widen(t, NULL);
        if (!widened) goto done;
        Py_DECREF(widened);
    }
    if (t->words != words) {
        PyErr_SetString(PyExc_ValueError, "load into a tree of another holder width");
        goto done;
    }
    if (t->nodes || t->high) {
        PyErr_SetString(PyExc_ValueError, "load into a non-empty tree");
        goto done;
    }
    int64_t live = 0;
    const int32_t *parents = pb.buf;
    for (int64_t s = 0; s < n; s++) live += parents[s] != FREE;
    if (reserve(t, n) < 0) goto done;
    if (table_reserve(t, live) < 0) goto done;
    memcpy(t->key, kb.buf, (size_t)n * 8);
    memcpy(t->parent, pb.buf, (size_t)n * 4);
    memcpy(t->holders, hb.buf, (size_t)(n * words) * 8);
    memset(t->children, 0, (size_t)n * 4);
    memset(t->recency, 0, (size_t)n * 8);
    memset(t->held, 0, 8 * 64 * (size_t)words);
    t->high = n;
    t->nfree = 0;
    for (int64_t s = 0; s < n; s++) {
        if (parents[s] == FREE) {
            t->key[s] = 0;
            memset(t->holders + s * words, 0, 8 * (size_t)words);
            continue;
        }
        if (parents[s] >= 0) t->children[parents[s]]++;
        table_put(t, t->key[s], s);
        t->nodes++;
        const uint64_t *row = t->holders + s * words;
        for (int64_t w = 0; w < words; w++)
            for (uint64_t b = row[w]; b; b &= b - 1) t->held[64 * w + __builtin_ctzll(b)]++;
    }
    for (int64_t s = 0; s < n; s++)
        if (parents[s] == FREE) t->free_[t->nfree++] = (int32_t)s;
    out = Py_None;
    Py_INCREF(out);
done:
    PyBuffer_Release(&kb);
    PyBuffer_Release(&pb);
    PyBuffer_Release(&hb);
    return out;
}

static PyObject *Tree_allocated(Tree *t, void *closure) {
    int64_t bytes = t->cap * (8 + 4 + 4 + 8 + 8 * t->words) + (int64_t)(t->tmask + 1) * 8 +
                    t->free_cap * 4 + 64 * t->words * 8;
    return PyLong_FromLongLong(bytes);
}

#define INT_GETTER(name, expr)                                       \
    static PyObject *Tree_get_##name(Tree *t, void *closure) {       \
        return PyLong_FromLongLong((long long)(expr));               \
    }
INT_GETTER(nodes, t->nodes)
INT_GETTER(high, t->high)
INT_GETTER(capacity, t->cap)
INT_GETTER(words, t->words)
INT_GETTER(evicted, t->evicted)
INT_GETTER(table_size, t->tmask + 1)

static PyObject *Tree_get_holdings(Tree *t, void *closure) {
    int64_t sum = 0;
    for (int64_t b = 0; b < 64 * t->words; b++) sum += t->held[b];
    return PyLong_FromLongLong(sum);
}

static PyGetSetDef Tree_getset[] = {
    {"nodes", (getter)Tree_get_nodes, NULL, "live nodes", NULL},
    {"high", (getter)Tree_get_high, NULL, "slots handed out at least once", NULL},
    {"capacity", (getter)Tree_get_capacity, NULL, "slots the columns have room for", NULL},
    {"words", (getter)Tree_get_words, NULL, "holder words per slot", NULL},
    {"evicted", (getter)Tree_get_evicted, NULL, "nodes evicted since creation", NULL},
    {"holdings", (getter)Tree_get_holdings, NULL, "(node, source bit) pairs", NULL},
    {"table_size", (getter)Tree_get_table_size, NULL, "entries of the key table", NULL},
    {"allocated", (getter)Tree_allocated, NULL, "bytes allocated for columns and table", NULL},
    {NULL},
};

static PyMethodDef Tree_methods[] = {
    {"store_pairs", (PyCFunction)Tree_store_pairs, METH_VARARGS, NULL},
    {"store_chain", (PyCFunction)Tree_store_chain, METH_VARARGS, NULL},
    {"remove", (PyCFunction)Tree_remove, METH_VARARGS, NULL},
    {"clear", (PyCFunction)Tree_clear, METH_VARARGS, NULL},
    {"clear_range", (PyCFunction)Tree_clear_range, METH_VARARGS, NULL},
    {"match", (PyCFunction)Tree_match, METH_VARARGS, NULL},
    {"match_roster", (PyCFunction)Tree_match_roster, METH_VARARGS, NULL},
    {"touch", (PyCFunction)Tree_touch, METH_VARARGS, NULL},
    {"leading_rows", (PyCFunction)Tree_leading_rows, METH_O, NULL},
    {"evict_older_than", (PyCFunction)Tree_evict_older_than, METH_VARARGS, NULL},
    {"evict_keys", (PyCFunction)Tree_evict_keys, METH_O, NULL},
    {"widen", (PyCFunction)Tree_widen, METH_NOARGS, NULL},
    {"held", (PyCFunction)Tree_held, METH_VARARGS, NULL},
    {"holds", (PyCFunction)Tree_holds, METH_VARARGS, NULL},
    {"slot_of", (PyCFunction)Tree_slot_of, METH_VARARGS, NULL},
    {"node", (PyCFunction)Tree_node, METH_VARARGS, NULL},
    {"keys_of", (PyCFunction)Tree_keys_of, METH_VARARGS, NULL},
    {"live_recency", (PyCFunction)Tree_live_recency, METH_NOARGS, NULL},
    {"dump", (PyCFunction)Tree_dump, METH_NOARGS, NULL},
    {"load", (PyCFunction)Tree_load, METH_VARARGS, NULL},
    {NULL},
};

static PyTypeObject TreeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cortex.ledger._core.Tree",
    .tp_doc = "One hash domain's radix hash tree: columns, key table, holder bitsets.",
    .tp_basicsize = sizeof(Tree),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Tree_init,
    .tp_dealloc = (destructor)Tree_dealloc,
    .tp_methods = Tree_methods,
    .tp_getset = Tree_getset,
};

/* ---- a ReplicaBatch's ops, applied from its wire bytes ----------------------------------- */

/* A gateway replica applies every block stored anywhere in the cluster; decoding each op into
 * Python objects cost more than storing its blocks. plan_replica_ops reads a batch's ops into
 * an OpPlan per op (one pass, nothing applied); replay_replica_ops then stores and removes
 * their keys straight from the batch's bytes. Only the canonical encoding of store,
 * store_pairs and remove ops is planned here: any other op, and any op whose encoding is
 * unusual (a repeated or unknown field, a key list that is not whole words, pair lists of
 * two lengths), is OP_PYTHON: the caller applies it through the protobuf runtime and the
 * pure-Python path, which stays the one definition of what such an op means. */

enum { OP_PYTHON = 0, OP_STORE = 1, OP_STORE_PAIRS = 2, OP_REMOVE = 3 };

typedef struct {
    int32_t kind;
    int32_t source; /* index of the op's Source bytes among the batch's distinct ones */
    uint64_t parent; /* OP_STORE: the chain's parent key */
    int64_t keys;    /* byte offset of keys_le in the batch */
    int64_t pkeys;   /* OP_STORE_PAIRS: byte offset of parent_keys_le */
    int64_t n;       /* keys */
} OpPlan;

#define F_REPLICA_OPS 8
#define F_OP_SOURCE 1
#define F_OP_STORE 11
#define F_OP_STORE_PAIRS 12
#define F_OP_REMOVE 13

/* The kind of one ReplicaOp's body (its keys located in ``plan``), OP_PYTHON when unusual. */
static int32_t plan_body(const uint8_t *batch, uint32_t which, const uint8_t *p, size_t len,
                         OpPlan *plan) {
    WireReader r = {p, p + len};
    WireField f;
    int got;
    int seen_parent = 0, seen_keys = 0, seen_pkeys = 0;
    size_t keys_len = 0, pkeys_len = 0;
    plan->parent = 0;
    plan->keys = plan->pkeys = 0;
    while ((got = wire_next(&r, &f)) == 1) {
        if (which == F_OP_STORE && f.number == 1 && f.type == 1 && !seen_parent++) {
            plan->parent = f.value;
        } else if (((which == F_OP_STORE && f.number == 3) ||
                    (which != F_OP_STORE && f.number == 2)) && f.type == 2 && !seen_keys++) {
            plan->keys = f.data - batch;
            keys_len = f.len;
        } else if (which == F_OP_STORE_PAIRS && f.number == 1 && f.type == 2 && !seen_pkeys++) {
            plan->pkeys = f.data - batch;
            pkeys_len = f.len;
        } else {
            return OP_PYTHON;
        }
    }
    if (got < 0 || keys_len % 8) return OP_PYTHON;
    if (which == F_OP_STORE_PAIRS && pkeys_len != keys_len) return OP_PYTHON;
    plan->n = (int64_t)(keys_len / 8);
    return which == F_OP_STORE ? OP_STORE : which == F_OP_STORE_PAIRS ? OP_STORE_PAIRS
                                                                        : OP_REMOVE;
}

/* One ReplicaOp: its kind, and the span of its Source message (NULL when absent). */
static int32_t plan_op(const uint8_t *batch, const uint8_t *p, size_t len, OpPlan *plan,
                       const uint8_t **source, size_t *source_len) {
    WireReader r = {p, p + len};
    WireField f, body = {0};
    int got, sources = 0, bodies = 0;
    *source = NULL;
    *source_len = 0;
    while ((got = wire_next(&r, &f)) == 1) {
        if (f.number == F_OP_SOURCE && f.type == 2) {
            *source = f.data;
            *source_len = f.len;
            sources++;
        } else if ((f.number == F_OP_STORE || f.number == F_OP_STORE_PAIRS ||
                    f.number == F_OP_REMOVE) && f.type == 2) {
            body = f;
            bodies++;
        } else {
            return OP_PYTHON; /* attach, clear, detach, evict, or anything unknown */
        }
    }
    if (got < 0 || sources > 1 || bodies != 1) return OP_PYTHON;
    return plan_body(batch, body.number, body.data, body.len, plan);
}

/* plan_replica_ops(batch) -> (plan, sources): an OpPlan per op of the ReplicaBatch bytes
 * ``batch``, and the distinct Source messages (bytes) its planned ops name,
 * b"" for an op without one. ValueError when the bytes are not a protobuf message. */
static PyObject *plan_replica_ops(PyObject *module, PyObject *data) {
    if (!PyBytes_Check(data))
        return PyErr_Format(PyExc_TypeError, "plan_replica_ops: bytes needed");
    const uint8_t *batch = (const uint8_t *)PyBytes_AS_STRING(data);
    WireReader r = {batch, batch + PyBytes_GET_SIZE(data)};
    WireField f;
    int got;
    Py_ssize_t n = 0, cap = 64;
    OpPlan *plans = PyMem_Malloc((size_t)cap * sizeof(OpPlan));
    PyObject *index = PyDict_New(), *sources = PyList_New(0), *out = NULL;
    if (!plans || !index || !sources) {
        PyErr_NoMemory();
        goto done;
    }
    while ((got = wire_next(&r, &f)) == 1) {
        if (f.number != F_REPLICA_OPS) continue;
        if (f.type != 2) {
            PyErr_SetString(PyExc_ValueError, "replica batch: ops is not a message");
            goto done;
        }
        if (n == cap) {
            OpPlan *more = PyMem_Realloc(plans, (size_t)(cap *= 2) * sizeof(OpPlan));
            if (!more) {
                PyErr_NoMemory();
                goto done;
            }
            plans = more;
        }
        OpPlan *plan = &plans[n++];
        const uint8_t *src;
        size_t src_len;
        plan->kind = plan_op(batch, f.data, f.len, plan, &src, &src_len);
        plan->source = -1;
        if (plan->kind == OP_PYTHON) continue;
        PyObject *key = PyBytes_FromStringAndSize((const char *)src, (Py_ssize_t)src_len);
        if (!key) goto done;
        PyObject *known = PyDict_GetItemWithError(index, key);
        if (known) {
            plan->source = (int32_t)PyLong_AsLong(known);
        } else if (!PyErr_Occurred()) {
            PyObject *at = PyLong_FromSsize_t(PyList_GET_SIZE(sources));
            int failed = !at || PyDict_SetItem(index, key, at) < 0 ||
                         PyList_Append(sources, key) < 0;
            plan->source = (int32_t)(PyList_GET_SIZE(sources) - 1);
            Py_XDECREF(at);
            if (failed) {
                Py_DECREF(key);
                goto done;
            }
        }
        Py_DECREF(key);
        if (PyErr_Occurred()) goto done;
    }
    if (got < 0) {
        PyErr_SetString(PyExc_ValueError, "replica batch: malformed protobuf");
        goto done;
    }
    PyObject *bytes = PyByteArray_FromStringAndSize((const char *)plans,
                                                    n * (Py_ssize_t)sizeof(OpPlan));
    if (bytes) out = PyTuple_Pack(2, bytes, sources);
    Py_XDECREF(bytes);
done:
    PyMem_Free(plans);
    Py_XDECREF(index);
    Py_XDECREF(sources);
    return out;
}

/* Room for ``n`` keys in ``*buf`` (of ``*cap``); the wire's little-endian words copied in. */
static const uint64_t *wire_keys(const uint8_t *batch, int64_t at, int64_t n, uint64_t **buf,
                                 int64_t *cap) {
    if (n > *cap || !*buf) { /* never NULL, even for no keys: NULL is the error return */
        int64_t want = n > 0 ? n : 1;
        uint64_t *more = PyMem_Realloc(*buf, (size_t)want * 8);
        if (!more) {
            PyErr_NoMemory();
            return NULL;
        }
        *buf = more;
        *cap = want;
    }
    const uint8_t *p = batch + at;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(*buf, p, (size_t)n * 8);
#else
    for (int64_t i = 0; i < n; i++) (*buf)[i] = wire_le64(p + 8 * i);
#endif
    return *buf;
}

/* replay_replica_ops(batch, plan, start, targets, tick) -> (stop, removed): apply the planned
 * ops from ``start`` in order, op i at recency tick + i + 1, until one the caller must apply
 * (OP_PYTHON, or a source whose entry in ``targets`` is None; else ``(Tree, bit)``): ``stop``
 * is its index (the plan's length when all were applied). ``removed``: (source index, the
 * keys it no longer holds as a bytearray) per remove op that dropped any. A store refused by
 * its tree raises ValueError, the ops before it applied. */
static PyObject *replay_replica_ops(PyObject *module, PyObject *args) {
    PyObject *data, *targets;
    Py_buffer pv;
    Py_ssize_t start;
    unsigned long long tick;
    if (!PyArg_ParseTuple(args, "O!y*nO!K", &PyBytes_Type, &data, &pv, &start, &PyList_Type,
                          &targets, &tick))
        return NULL;
    const uint8_t *batch = (const uint8_t *)PyBytes_AS_STRING(data);
    int64_t size = PyBytes_GET_SIZE(data);
    const OpPlan *plans = pv.buf;
    Py_ssize_t n = pv.len / (Py_ssize_t)sizeof(OpPlan), i = start < 0 ? 0 : start;
    uint64_t *keys = NULL, *parents = NULL, *dropped = NULL;
    int64_t keys_cap = 0, parents_cap = 0, dropped_cap = 0;
    PyObject *removed = PyList_New(0), *out = NULL;
    if (!removed) goto done;
    for (; i < n; i++) {
        const OpPlan *op = &plans[i];
        if (op->kind == OP_PYTHON) break;
        if (op->source < 0 || op->source >= PyList_GET_SIZE(targets) || op->n < 0 ||
            op->keys < 0 || op->keys > size || op->n > (size - op->keys) / 8 ||
            (op->kind == OP_STORE_PAIRS &&
             (op->pkeys < 0 || op->pkeys > size || op->n > (size - op->pkeys) / 8))) {
            PyErr_SetString(PyExc_ValueError, "replay_replica_ops: the plan is not this batch's");
            goto done;
        }
        PyObject *target = PyList_GET_ITEM(targets, op->source);
        if (target == Py_None) break;
        if (!PyTuple_Check(target) || PyTuple_GET_SIZE(target) != 2 ||
            !PyObject_TypeCheck(PyTuple_GET_ITEM(target, 0), &TreeType)) {
            PyErr_SetString(PyExc_TypeError, "replay_replica_ops: targets are (Tree, bit)");
            goto done;
        }
        Tree *t = (Tree *)PyTuple_GET_ITEM(target, 0);
        Py_ssize_t bit = PyLong_AsSsize_t(PyTuple_GET_ITEM(target, 1));
        if (bit == -1 && PyErr_Occurred()) goto done;
        if (check_bit(t, bit) < 0) goto done;
        const uint64_t *k = wire_keys(batch, op->keys, op->n, &keys, &keys_cap);
        if (!k) goto done;
        uint64_t now = tick + (uint64_t)i + 1;
        if (op->kind == OP_REMOVE) {
            if (op->n > dropped_cap || !dropped) {
                int64_t want = op->n > 0 ? op->n : 1;
                uint64_t *more = PyMem_Realloc(dropped, (size_t)want * 8);
                if (!more) {
                    PyErr_NoMemory();
                    goto done;
                }
                dropped = more;
                dropped_cap = want;
            }
            int64_t gone = remove_keys(t, bit, k, op->n, dropped);
            if (gone) {
                PyObject *item = Py_BuildValue("(iN)", op->source, words_out(dropped, gone));
                if (!item || PyList_Append(removed, item) < 0) {
                    Py_XDECREF(item);
                    goto done;
                }
                Py_DECREF(item);
            }
            continue;
        }
        const uint64_t *pk = NULL;
        if (op->kind == OP_STORE_PAIRS) {
            pk = wire_keys(batch, op->pkeys, op->n, &parents, &parents_cap);
            if (!pk) goto done;
        }
        PyObject *fresh = store_batch(t, bit, pk, op->parent, k, op->n, now);
        if (!fresh) goto done;
        Py_DECREF(fresh);
    }
    out = Py_BuildValue("(nO)", i, removed);
done:
    PyBuffer_Release(&pv);
    PyMem_Free(keys);
    PyMem_Free(parents);
    PyMem_Free(dropped);
    Py_XDECREF(removed);
    return out;
}

#include "_sync.h"
#include "_kvdecode.h"
#include "_blockkeys.h"
#include "_keymap.h"

static PyMethodDef core_functions[] = {
    {"plan_update_batch", (PyCFunction)plan_update_batch, METH_O, NULL},
    {"apply_update_run", (PyCFunction)apply_update_run, METH_VARARGS, NULL},
    {"plan_replica_ops", (PyCFunction)plan_replica_ops, METH_O, NULL},
    {"replay_replica_ops", (PyCFunction)replay_replica_ops, METH_VARARGS, NULL},
    {"decode_kv_events", (PyCFunction)decode_kv_events, METH_VARARGS, NULL},
    {"block_keys_packed", (PyCFunction)block_keys_packed, METH_VARARGS, NULL},
    {"xxh3_64_short", (PyCFunction)xxh3_short, METH_VARARGS, NULL},
    {NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT, "cortex.ledger._core",
    "The radix hash tree's columns and hot loops in C (see cortex.ledger.native).", -1,
    core_functions,
};

/* km_seed from os.urandom (the key table's probe mix; see _keymap.h). */
static int seed_key_tables(void) {
    PyObject *os = PyImport_ImportModule("os");
    PyObject *raw = os ? PyObject_CallMethod(os, "urandom", "i", 8) : NULL;
    Py_XDECREF(os);
    if (!raw) return -1;
    if (PyBytes_Check(raw) && PyBytes_GET_SIZE(raw) == 8)
        memcpy(&km_seed, PyBytes_AS_STRING(raw), 8);
    Py_DECREF(raw);
    return 0;
}

static int add_type(PyObject *m, const char *name, PyTypeObject *type) {
    Py_INCREF(type);
    if (PyModule_AddObject(m, name, (PyObject *)type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return 0;
}

PyMODINIT_FUNC PyInit__core(void) {
    if (PyType_Ready(&TreeType) < 0 || PyType_Ready(&KeyTableType) < 0) return NULL;
    if (seed_key_tables() < 0 || kv_init() < 0) return NULL;
    PyObject *m = PyModule_Create(&core_module);
    if (!m) return NULL;
    if (add_type(m, "Tree", &TreeType) < 0 || add_type(m, "KeyTable", &KeyTableType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
