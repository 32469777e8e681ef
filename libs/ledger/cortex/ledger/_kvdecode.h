/* decode_kv_events: the common shapes of an engine's KV-event payload (msgpack), decoded in C
 * into columns; included by _core.c.
 *
 * The pure-Python decoder (cortex/kvevents/codec.py::decode_batch) is the specification; this
 * one only *accepts less*. It reads a payload whose every part is a shape it knows and returns
 * None for anything else -- an unusual but valid payload as much as a malformed one -- so the
 * caller decodes that payload in Python, which then raises the same CodecError or returns the
 * same EventBatch it always did. Nothing is decided here that Python would decide otherwise:
 * a differential test over the golden and fuzzed payloads holds the two together
 * (tests/ingest/test_columnar.py).
 *
 * Accepted: a batch [ts, events] or [ts, events, dp_rank] (ts a float or an int, dp_rank nil
 * or a uint32), events as maps (vLLM >= 0.24, SGLang >= 0.5.20) or positional arrays in the
 * engine's field order, with only these values:
 *   BlockStored   block_hashes: array of ints, all int64 or all uint64; parent_block_hash: nil or int; token_ids: array
 *                 of uint32 ints (no bigram pairs); block_size: uint32; group_idx: nil or
 *                 uint32; medium, kv_cache_spec_kind, locality, ownership, session_id: nil or
 *                 str; extra_keys: nil or an array of nils; lora_id, lora_name, cache_salt,
 *                 kv_cache_spec_sliding_window, lookahead_token_ids: nil.
 *   BlockRemoved  block_hashes: array of ints as a store's; medium, locality, ownership: nil or str;
 *                 group_idx: nil or uint32.
 *   AllBlocksCleared (a bare tag).
 * Anything else -- a key it does not know, an extra positional field, an unknown event tag,
 * bin hashes, trailing bytes, invalid UTF-8 -- returns None.
 *
 * Result: (ts, dp_rank | None, events), each event a tuple; its hashes are an array('q') when
 * one is negative (SGLang's int64 hashes), else an array('Q') (vLLM's uint64), no int object
 * per block (cortex.ingest.ledger's KeyTable reads them in place):
 *   (0, hashes, parent | None, tokens (bytes: uint32 little-endian), block_size, medium,
 *    kv_cache_spec_kind, group_idx | None, locality, ownership, session_id, extra_keys_len)
 *      extra_keys_len: -1 for nil, else the length of the array of nils;
 *   (1, hashes, medium, group_idx | None, locality, ownership, sizes)
 *      consecutive removals with the same medium / group_idx / locality / ownership (byte for
 *      byte on the wire) in one tuple: hashes concatenated, sizes (bytes: uint32 native) the
 *      number of hashes of each event, so len(sizes) // 4 events;
 *   (2,) AllBlocksCleared.
 */

enum {
    KV_HASHES, KV_PARENT, KV_TOKENS, KV_BLOCK_SIZE, KV_LORA_ID, KV_MEDIUM, KV_LORA_NAME,
    KV_EXTRA_KEYS, KV_GROUP, KV_SPEC_KIND, KV_WINDOW, KV_LOCALITY, KV_OWNERSHIP, KV_SESSION,
    KV_LOOKAHEAD, KV_CACHE_SALT, KV_TYPE, KV_NFIELDS
};

static const char *const kv_field_names[KV_NFIELDS] = {
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
    "lookahead_token_ids", "cache_salt", "type",
};

/* the engines' positional orders (cortex/kvevents/events.py) */
static const int kv_vllm_stored[] = {
    KV_HASHES, KV_PARENT, KV_TOKENS, KV_BLOCK_SIZE, KV_LORA_ID, KV_MEDIUM, KV_LORA_NAME,
    KV_EXTRA_KEYS, KV_GROUP, KV_SPEC_KIND, KV_WINDOW, KV_LOCALITY, KV_OWNERSHIP, KV_SESSION,
    KV_LOOKAHEAD};
static const int kv_sglang_stored[] = {
    KV_HASHES, KV_PARENT, KV_TOKENS, KV_BLOCK_SIZE, KV_LORA_ID, KV_MEDIUM, KV_CACHE_SALT,
    KV_SESSION, KV_LORA_NAME};
static const int kv_vllm_removed[] = {KV_HASHES, KV_MEDIUM, KV_GROUP, KV_LOCALITY, KV_OWNERSHIP};
static const int kv_sglang_removed[] = {KV_HASHES, KV_MEDIUM};

enum { KV_ABSENT = 0, KV_NIL, KV_INT, KV_STR, KV_ARR };

typedef struct {
    int kind;
    const uint8_t *at;  /* the value's first byte (its header) */
    const uint8_t *end; /* one past its last byte */
    /* KV_INT */
    int neg;
    uint64_t u;
    /* KV_STR: the bytes; KV_ARR: the first element */
    const uint8_t *data;
    uint64_t len;       /* str bytes or array elements */
    /* KV_ARR */
    int all_int, all_nil, all_u32, any_float;
    int any_neg, any_high; /* an int < 0; an int >= 2^63 */
} KvVal;

typedef struct {
    const uint8_t *p, *end;
} KvIn;

static inline int kv_need(KvIn *in, uint64_t n) { return (uint64_t)(in->end - in->p) >= n; }

static inline uint64_t kv_be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* An int at in->p (any msgpack int format): 1 and advanced, 0 if the next value is no int
 * (not advanced), -1 when truncated. */
static inline int kv_int(KvIn *in, int *neg, uint64_t *u) {
    if (in->p >= in->end) return -1;
    uint8_t b = *in->p;
    if (b <= 0x7f) { *neg = 0; *u = b; in->p++; return 1; }
    if (b >= 0xe0) { *neg = 1; *u = (uint64_t)(int64_t)(int8_t)b; in->p++; return 1; }
    int n;
    switch (b) {
    case 0xcc: case 0xd0: n = 1; break;
    case 0xcd: case 0xd1: n = 2; break;
    case 0xce: case 0xd2: n = 4; break;
    case 0xcf: case 0xd3: n = 8; break;
    default: return 0;
    }
    if (!kv_need(in, 1 + (uint64_t)n)) return -1;
    uint64_t v = kv_be(in->p + 1, n);
    if (b >= 0xd0) { /* signed */
        int64_t s;
        if (n == 1) s = (int8_t)v;
        else if (n == 2) s = (int16_t)v;
        else if (n == 4) s = (int32_t)v;
        else s = (int64_t)v;
        *neg = s < 0;
        *u = (uint64_t)s;
    } else {
        *neg = 0;
        *u = v;
    }
    in->p += 1 + n;
    return 1;
}

/* A str / array / map header: its length; -1 when the next value is not one, -2 truncated. */
static inline int64_t kv_str_len(KvIn *in) {
    if (in->p >= in->end) return -2;
    uint8_t b = *in->p;
    int n;
    uint64_t len;
    if ((b & 0xe0) == 0xa0) { in->p++; return b & 0x1f; }
    if (b == 0xd9) n = 1;
    else if (b == 0xda) n = 2;
    else if (b == 0xdb) n = 4;
    else return -1;
    if (!kv_need(in, 1 + (uint64_t)n)) return -2;
    len = kv_be(in->p + 1, n);
    in->p += 1 + n;
    if (!kv_need(in, len)) return -2;
    return (int64_t)len;
}

static inline int64_t kv_container_len(KvIn *in, int map) {
    if (in->p >= in->end) return -2;
    uint8_t b = *in->p;
    int n;
    if (!map && (b & 0xf0) == 0x90) { in->p++; return b & 0x0f; }
    if (map && (b & 0xf0) == 0x80) { in->p++; return b & 0x0f; }
    if (b == (map ? 0xde : 0xdc)) n = 2;
    else if (b == (map ? 0xdf : 0xdd)) n = 4;
    else return -1;
    if (!kv_need(in, 1 + (uint64_t)n)) return -2;
    uint64_t len = kv_be(in->p + 1, n);
    in->p += 1 + n;
    /* every element takes at least a byte (msgpack's own bound is the payload size) */
    if (!kv_need(in, len * (map ? 2 : 1))) return -2;
    return (int64_t)len;
}

static inline int kv_is_container(uint8_t b, int map) {
    if (map) return (b & 0xf0) == 0x80 || b == 0xde || b == 0xdf;
    return (b & 0xf0) == 0x90 || b == 0xdc || b == 0xdd;
}

/* One field value: nil, an int, a str or an array of scalars (ints / nils). 0 ok, -1 a shape
 * this decoder does not take. */
static int kv_value(KvIn *in, KvVal *v) {
    if (in->p >= in->end) return -1;
    v->at = in->p;
    uint8_t b = *in->p;
    if (b == 0xc0) {
        in->p++;
        v->kind = KV_NIL;
    } else if (kv_is_container(b, 0)) {
        int64_t n = kv_container_len(in, 0);
        if (n < 0) return -1;
        v->kind = KV_ARR;
        v->data = in->p;
        v->len = (uint64_t)n;
        v->all_int = v->all_nil = v->all_u32 = 1;
        v->any_neg = v->any_high = 0;
        for (int64_t i = 0; i < n; i++) {
            if (in->p >= in->end) return -1;
            if (*in->p == 0xc0) {
                in->p++;
                v->all_int = v->all_u32 = 0;
                continue;
            }
            int neg;
            uint64_t u;
            int r = kv_int(in, &neg, &u);
            if (r <= 0) return -1; /* a str, a bin, a float, a nested array, ...: Python's */
            v->all_nil = 0;
            if (neg || u > 0xffffffffu) v->all_u32 = 0;
            if (neg) v->any_neg = 1;
            else if (u >> 63) v->any_high = 1;
        }
    } else {
        int r = kv_int(in, &v->neg, &v->u);
        if (r < 0) return -1;
        if (r > 0) {
            v->kind = KV_INT;
        } else {
            int64_t n = kv_str_len(in);
            if (n < 0) return -1;
            v->kind = KV_STR;
            v->data = in->p;
            v->len = (uint64_t)n;
            in->p += n;
        }
    }
    v->end = in->p;
    return 0;
}

static inline int kv_is_u32(const KvVal *v) { return v->kind == KV_INT && !v->neg && v->u <= 0xffffffffu; }
static inline int kv_nil_or_str(const KvVal *v) { return v->kind <= KV_NIL || v->kind == KV_STR; }
static inline int kv_nil(const KvVal *v) { return v->kind <= KV_NIL; }

static inline int kv_same(const KvVal *a, const KvVal *b) {
    if (a->kind <= KV_NIL || b->kind <= KV_NIL) return a->kind <= KV_NIL && b->kind <= KV_NIL;
    return a->end - a->at == b->end - b->at && !memcmp(a->at, b->at, (size_t)(a->end - a->at));
}

/* nil / a str / an int as a Python object (new reference; NULL with an error set, or NULL
 * without one: invalid UTF-8, which Python's decoder would refuse -- the caller falls back). */
static PyObject *kv_object(const KvVal *v) {
    if (v->kind <= KV_NIL) Py_RETURN_NONE;
    if (v->kind == KV_INT)
        return v->neg ? PyLong_FromLongLong((long long)(int64_t)v->u)
                      : PyLong_FromUnsignedLongLong(v->u);
    PyObject *s = PyUnicode_DecodeUTF8((const char *)v->data, (Py_ssize_t)v->len, "strict");
    if (!s && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) PyErr_Clear();
    return s;
}

static PyObject *kv_array_type, *kv_code_u64, *kv_code_i64; /* array.array, "Q", "q" */

static size_t kv_field_lens[KV_NFIELDS];

static int kv_init(void) {
    for (int k = 0; k < KV_NFIELDS; k++) kv_field_lens[k] = strlen(kv_field_names[k]);
    PyObject *mod = PyImport_ImportModule("array");
    if (!mod) return -1;
    kv_array_type = PyObject_GetAttrString(mod, "array");
    Py_DECREF(mod);
    kv_code_u64 = PyUnicode_FromString("Q");
    kv_code_i64 = PyUnicode_FromString("q");
    return kv_array_type && kv_code_u64 && kv_code_i64 ? 0 : -1;
}

/* Words of the engine's hashes gathered for one event or one removal run. */
typedef struct {
    uint64_t *w;
    Py_ssize_t n, cap;
} KvWords;

/* The hashes of an all-int array appended to words: 0, or -1 with MemoryError. */
static int kv_hashes(const KvVal *v, KvWords *words) {
    if ((uint64_t)(words->cap - words->n) < v->len) {
        Py_ssize_t cap = words->cap ? words->cap : 64;
        while ((uint64_t)(cap - words->n) < v->len) cap *= 2;
        uint64_t *grown = PyMem_Realloc(words->w, (size_t)cap * 8);
        if (!grown) {
            PyErr_NoMemory();
            return -1;
        }
        words->w = grown;
        words->cap = cap;
    }
    KvIn in = {v->data, v->end};
    for (uint64_t i = 0; i < v->len; i++) {
        int neg;
        kv_int(&in, &neg, &words->w[words->n++]); /* validated by kv_value */
    }
    return 0;
}

/* Which array a hash array goes in: 1 'q' (one is negative), 2 'Q' (one is >= 2^63), 0 both
 * do. */
static inline int kv_sign(const KvVal *h) { return h->any_neg ? 1 : h->any_high ? 2 : 0; }

/* The gathered words as a new array('q') (signed) or array('Q'); words emptied. */
static PyObject *kv_hash_array(KvWords *words, int is_signed) {
    PyObject *raw = PyBytes_FromStringAndSize((const char *)words->w, words->n * 8);
    words->n = 0;
    if (!raw) return NULL;
    PyObject *out = PyObject_CallFunctionObjArgs(kv_array_type, is_signed ? kv_code_i64 : kv_code_u64,
                                                 raw, NULL);
    Py_DECREF(raw);
    return out;
}

static PyObject *kv_tokens(const KvVal *v) {
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(v->len * 4));
    if (!out) return NULL;
    uint8_t *w = (uint8_t *)PyBytes_AS_STRING(out);
    KvIn in = {v->data, v->end};
    for (uint64_t i = 0; i < v->len; i++) {
        int neg;
        uint64_t u;
        kv_int(&in, &neg, &u);
        w[0] = (uint8_t)u;
        w[1] = (uint8_t)(u >> 8);
        w[2] = (uint8_t)(u >> 16);
        w[3] = (uint8_t)(u >> 24);
        w += 4;
    }
    return out;
}

/* An event's fields by id; 0 ok, -1 not a shape taken here. *tag: 0 stored, 1 removed,
 * 2 cleared. */
static int kv_event(KvIn *in, int sglang, KvVal *f, int *tag) {
    static const char stored[] = "BlockStored", removed[] = "BlockRemoved",
                      cleared[] = "AllBlocksCleared";
    memset(f, 0, sizeof(KvVal) * KV_NFIELDS);
    if (in->p >= in->end) return -1;
    uint8_t b = *in->p;
    if (kv_is_container(b, 1)) {
        int64_t n = kv_container_len(in, 1);
        if (n < 0) return -1;
        for (int64_t i = 0; i < n; i++) {
            int64_t klen = kv_str_len(in);
            if (klen < 0) return -1;
            const uint8_t *key = in->p;
            in->p += klen;
            int id = -1;
            for (int k = 0; k < KV_NFIELDS; k++) {
                if ((size_t)klen == kv_field_lens[k] && key[0] == kv_field_names[k][0] &&
                    !memcmp(key, kv_field_names[k], (size_t)klen)) {
                    id = k;
                    break;
                }
            }
            if (id < 0) return -1; /* a key Python would ignore: let it */
            if (kv_value(in, &f[id]) < 0) return -1;
        }
        if (f[KV_TYPE].kind != KV_STR) return -1;
    } else if (kv_is_container(b, 0)) {
        int64_t n = kv_container_len(in, 0);
        if (n < 1) return -1;
        if (kv_value(in, &f[KV_TYPE]) < 0 || f[KV_TYPE].kind != KV_STR) return -1;
        const KvVal *t = &f[KV_TYPE];
        const int *order;
        int64_t width;
        if (t->len == sizeof(stored) - 1 && !memcmp(t->data, stored, t->len)) {
            order = sglang ? kv_sglang_stored : kv_vllm_stored;
            width = sglang ? (int64_t)(sizeof(kv_sglang_stored) / sizeof(int))
                           : (int64_t)(sizeof(kv_vllm_stored) / sizeof(int));
        } else if (t->len == sizeof(removed) - 1 && !memcmp(t->data, removed, t->len)) {
            order = sglang ? kv_sglang_removed : kv_vllm_removed;
            width = sglang ? (int64_t)(sizeof(kv_sglang_removed) / sizeof(int))
                           : (int64_t)(sizeof(kv_vllm_removed) / sizeof(int));
        } else {
            order = NULL;
            width = 0;
        }
        if (n - 1 > width) return -1; /* extra positional fields: Python ignores them */
        for (int64_t i = 0; i < n - 1; i++)
            if (kv_value(in, &f[order[i]]) < 0) return -1;
    } else {
        return -1;
    }
    const KvVal *t = &f[KV_TYPE];
    if (t->len == sizeof(cleared) - 1 && !memcmp(t->data, cleared, t->len)) {
        for (int k = 0; k < KV_TYPE; k++)
            if (f[k].kind != KV_ABSENT) return -1;
        *tag = 2;
        return 0;
    }
    int is_stored = t->len == sizeof(stored) - 1 && !memcmp(t->data, stored, t->len);
    int is_removed = t->len == sizeof(removed) - 1 && !memcmp(t->data, removed, t->len);
    if (!is_stored && !is_removed) return -1; /* unknown tags are Python's to count */
    const KvVal *h = &f[KV_HASHES];
    if (h->kind != KV_ARR || !h->all_int) return -1;
    if (h->any_neg && h->any_high) return -1; /* neither int64 nor uint64: Python's */
    if (!kv_nil_or_str(&f[KV_MEDIUM]) || !kv_nil_or_str(&f[KV_LOCALITY]) ||
        !kv_nil_or_str(&f[KV_OWNERSHIP]))
        return -1;
    if (!kv_nil(&f[KV_GROUP]) && !kv_is_u32(&f[KV_GROUP])) return -1;
    if (is_removed) {
        /* fields a removal does not read: Python ignores any value there */
        static const int unread[] = {KV_PARENT, KV_TOKENS, KV_BLOCK_SIZE, KV_LORA_ID,
                                     KV_LORA_NAME, KV_EXTRA_KEYS, KV_SPEC_KIND, KV_WINDOW,
                                     KV_SESSION, KV_LOOKAHEAD, KV_CACHE_SALT};
        for (size_t k = 0; k < sizeof(unread) / sizeof(int); k++)
            if (f[unread[k]].kind != KV_ABSENT) return -1;
        *tag = 1;
        return 0;
    }
    const KvVal *p = &f[KV_PARENT], *tok = &f[KV_TOKENS], *e = &f[KV_EXTRA_KEYS];
    if (p->kind != KV_ABSENT && p->kind != KV_NIL && p->kind != KV_INT) return -1;
    if (tok->kind != KV_ARR || !tok->all_u32) return -1;
    if (!kv_is_u32(&f[KV_BLOCK_SIZE])) return -1;
    if (!kv_nil_or_str(&f[KV_SPEC_KIND]) || !kv_nil_or_str(&f[KV_SESSION])) return -1;
    if (!kv_nil(&f[KV_LORA_ID]) || !kv_nil(&f[KV_LORA_NAME]) || !kv_nil(&f[KV_CACHE_SALT]) ||
        !kv_nil(&f[KV_WINDOW]) || !kv_nil(&f[KV_LOOKAHEAD]))
        return -1;
    if (!kv_nil(e) && !(e->kind == KV_ARR && e->all_nil)) return -1;
    *tag = 0;
    return 0;
}

/* A new reference to a tuple of n objects, each stolen (NULLs: the tuple is not built, the
 * others are released; *fallback is set when none of them carried an error). */
static PyObject *kv_pack(PyObject **items, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!items[i]) {
            for (Py_ssize_t j = 0; j < n; j++) Py_XDECREF(items[j]);
            return NULL;
        }
    }
    PyObject *t = PyTuple_New(n);
    if (!t) {
        for (Py_ssize_t j = 0; j < n; j++) Py_DECREF(items[j]);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(t, i, items[i]);
    return t;
}

static PyObject *kv_sizes_bytes(const uint32_t *sizes, Py_ssize_t n) {
    return PyBytes_FromStringAndSize((const char *)sizes, n * 4);
}

/* Append the removal run gathered in run_hashes to events as one event (its hashes, the
 * fields of its first event run_f, the sizes of its events) and clear it: 0, or -1 with an
 * error set, or without one where a field cannot be taken (fall back). */
static int kv_close_run(PyObject *events, KvWords *run_hashes, int *run_open, int run_sign,
                        const KvVal *run_f, const uint32_t *sizes, Py_ssize_t nsizes) {
    *run_open = 0;
    PyObject *items[7] = {
        PyLong_FromLong(1),
        kv_hash_array(run_hashes, run_sign == 1),
        kv_object(&run_f[KV_MEDIUM]),
        kv_object(&run_f[KV_GROUP]),
        kv_object(&run_f[KV_LOCALITY]),
        kv_object(&run_f[KV_OWNERSHIP]),
        kv_sizes_bytes(sizes, nsizes),
    };
    PyObject *item = kv_pack(items, 7);
    if (!item) return -1;
    int rc = PyList_Append(events, item);
    Py_DECREF(item);
    return rc;
}

/* decode_kv_events(payload, sglang) -> (ts, dp_rank, events) | None; see the top. */
static PyObject *decode_kv_events(PyObject *module, PyObject *args) {
    Py_buffer view;
    int sglang;
    if (!PyArg_ParseTuple(args, "y*p", &view, &sglang)) return NULL;
    PyObject *events = NULL, *out = NULL, *ts = NULL, *rank = NULL;
    KvWords run_hashes = {NULL, 0, 0}; /* the removal run being gathered */
    KvWords store_hashes = {NULL, 0, 0};
    int run_open = 0, run_sign = 0; /* the run's array: kv_sign of its hashes */
    uint32_t *sizes = NULL;
    Py_ssize_t nsizes = 0, sizes_cap = 0;
    KvVal run_f[KV_NFIELDS]; /* the run's first event */
    KvVal f[KV_NFIELDS];
    KvIn in = {(const uint8_t *)view.buf, (const uint8_t *)view.buf + view.len};
    if (view.len == 0 || view.len > 64 * 1024 * 1024) goto fallback;
    int64_t top = kv_container_len(&in, 0);
    if (top != 2 && top != 3) goto fallback;
    /* ts */
    if (in.p >= in.end) goto fallback;
    if (*in.p == 0xcb || *in.p == 0xca) {
        int wide = *in.p == 0xcb;
        if (!kv_need(&in, wide ? 9 : 5)) goto fallback;
        uint64_t bits = kv_be(in.p + 1, wide ? 8 : 4);
        double d;
        if (wide) {
            memcpy(&d, &bits, 8);
        } else {
            uint32_t b32 = (uint32_t)bits;
            float fl;
            memcpy(&fl, &b32, 4);
            d = fl;
        }
        if (!isfinite(d)) goto fallback;
        in.p += wide ? 9 : 5;
        ts = PyFloat_FromDouble(d);
    } else {
        int neg;
        uint64_t u;
        if (kv_int(&in, &neg, &u) <= 0) goto fallback;
        ts = PyFloat_FromDouble(neg ? (double)(int64_t)u : (double)u);
    }
    if (!ts) goto error;
    int64_t nev = kv_container_len(&in, 0);
    if (nev < 0) goto fallback;
    events = PyList_New(0);
    if (!events) goto error;
    for (int64_t i = 0; i < nev; i++) {
        int tag;
        if (kv_event(&in, sglang, f, &tag) < 0) goto fallback;
        if (run_open && !(tag == 1 && kv_same(&f[KV_MEDIUM], &run_f[KV_MEDIUM]) &&
                            kv_same(&f[KV_GROUP], &run_f[KV_GROUP]) &&
                            kv_same(&f[KV_LOCALITY], &run_f[KV_LOCALITY]) &&
                            kv_same(&f[KV_OWNERSHIP], &run_f[KV_OWNERSHIP]) &&
                            (!run_sign || !kv_sign(&f[KV_HASHES]) ||
                             run_sign == kv_sign(&f[KV_HASHES])))) {
            goto close_run;
        }
    next_event:
        if (tag == 1) {
            if (!run_open) {
                memcpy(run_f, f, sizeof(f));
                run_open = 1;
                run_sign = 0;
                nsizes = 0;
            }
            if (!run_sign) run_sign = kv_sign(&f[KV_HASHES]);
            if (nsizes == sizes_cap) {
                sizes_cap = sizes_cap ? 2 * sizes_cap : 64;
                uint32_t *grown = PyMem_Realloc(sizes, (size_t)sizes_cap * 4);
                if (!grown) {
                    PyErr_NoMemory();
                    goto error;
                }
                sizes = grown;
            }
            sizes[nsizes++] = (uint32_t)f[KV_HASHES].len;
            if (kv_hashes(&f[KV_HASHES], &run_hashes) < 0) goto error;
        } else if (tag == 2) {
            PyObject *item = Py_BuildValue("(i)", 2);
            if (!item || PyList_Append(events, item) < 0) {
                Py_XDECREF(item);
                goto error;
            }
            Py_DECREF(item);
        } else {
            const KvVal *e = &f[KV_EXTRA_KEYS];
            PyObject *items[12] = {
                PyLong_FromLong(0),
                kv_hashes(&f[KV_HASHES], &store_hashes) < 0 ? NULL
                    : kv_hash_array(&store_hashes, kv_sign(&f[KV_HASHES]) == 1),
                kv_object(&f[KV_PARENT]),
                kv_tokens(&f[KV_TOKENS]),
                kv_object(&f[KV_BLOCK_SIZE]),
                kv_object(&f[KV_MEDIUM]),
                kv_object(&f[KV_SPEC_KIND]),
                kv_object(&f[KV_GROUP]),
                kv_object(&f[KV_LOCALITY]),
                kv_object(&f[KV_OWNERSHIP]),
                kv_object(&f[KV_SESSION]),
                PyLong_FromLongLong(kv_nil(e) ? -1 : (long long)e->len),
            };
            PyObject *item = kv_pack(items, 12);
            if (!item) goto error_or_fallback;
            int rc = PyList_Append(events, item);
            Py_DECREF(item);
            if (rc < 0) goto error;
        }
        continue;
    close_run: {
            if (kv_close_run(events, &run_hashes, &run_open, run_sign, run_f, sizes, nsizes) < 0)
                goto error_or_fallback;
            goto next_event;
        }
    }
    if (run_open) {
        /* the last run: close it as above, with nothing after it */
        if (kv_close_run(events, &run_hashes, &run_open, run_sign, run_f, sizes, nsizes) < 0)
            goto error_or_fallback;
    }
    if (top == 3) {
        int neg;
        uint64_t u;
        if (in.p < in.end && *in.p == 0xc0) {
            in.p++;
            rank = Py_None;
            Py_INCREF(rank);
        } else {
            if (kv_int(&in, &neg, &u) <= 0 || neg || u > 0xffffffffu) goto fallback;
            rank = PyLong_FromUnsignedLongLong(u);
            if (!rank) goto error;
        }
    } else {
        rank = Py_None;
        Py_INCREF(rank);
    }
    if (in.p != in.end) goto fallback; /* trailing bytes: msgpack's ExtraData */
    out = PyTuple_Pack(3, ts, rank, events);
    goto done;
error_or_fallback:
    if (PyErr_Occurred()) goto error;
fallback:
    out = Py_None;
    Py_INCREF(out);
    goto done;
error:
    out = NULL;
done:
    Py_XDECREF(ts);
    Py_XDECREF(rank);
    Py_XDECREF(events);
    PyMem_Free(run_hashes.w);
    PyMem_Free(store_hashes.w);
    PyMem_Free(sizes);
    PyBuffer_Release(&view);
    return out;
}
