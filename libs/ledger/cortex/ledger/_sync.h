/* cortex.ledger._core: an ingest's Sync batch applied from its wire bytes (included by _core.c).
 *
 * The index applies every block stored or evicted anywhere in the cluster; decoding each
 * LedgerUpdate into Python objects (the update, its op, its key array, its sequencing and
 * journal records) cost more than storing its blocks. plan_update_batch reads an UpdateBatch's
 * updates into an UpdatePlan each (one pass, nothing applied); apply_update_run then applies a
 * run of them -- in-order stores and removals of sources the caller vouches for -- straight
 * from the batch's bytes, and encodes the replica journal's ops as it goes. Anything else
 * (snapshots, clears, state changes, removals of sources, a duplicate, a gap, another epoch or
 * domain, an unusual encoding: a repeated key field, an unknown field, a key list that is not
 * whole words, an empty store) ends the run: the caller applies that update through the
 * protobuf runtime and the Python path, which stays the one definition of what it means. */
#ifndef CORTEX_LEDGER_SYNC_H
#define CORTEX_LEDGER_SYNC_H

enum { UP_PYTHON = 0, UP_STORE = 1, UP_REMOVE = 2 };

typedef struct {
    int32_t kind;
    int32_t source; /* index of the update's Source bytes among the batch's distinct ones */
    int32_t domain; /* index of its Domain bytes among the batch's distinct ones */
    int32_t pad_;
    uint64_t epoch;
    uint64_t seq;
    uint64_t parent; /* UP_STORE: the chain's parent key */
    int64_t keys;    /* byte offset of keys_le in the batch */
    int64_t n;       /* keys */
} UpdatePlan;

#define F_BATCH_UPDATES 2
#define F_UP_SOURCE 1
#define F_UP_DOMAIN 2
#define F_UP_EPOCH 3
#define F_UP_SEQ 4
#define F_UP_STORE 10
#define F_UP_REMOVE 11

/* The index of the bytes [p, p + len) in ``list`` (added when new), -1 with an error set. */
static int32_t intern_span(PyObject *index, PyObject *list, const uint8_t *p, size_t len) {
    PyObject *key = PyBytes_FromStringAndSize((const char *)p, (Py_ssize_t)len);
    if (!key) return -1;
    int32_t at = -1;
    PyObject *known = PyDict_GetItemWithError(index, key);
    if (known) {
        at = (int32_t)PyLong_AsLong(known);
    } else if (!PyErr_Occurred()) {
        PyObject *pos = PyLong_FromSsize_t(PyList_GET_SIZE(list));
        if (pos && PyDict_SetItem(index, key, pos) == 0 && PyList_Append(list, key) == 0)
            at = (int32_t)(PyList_GET_SIZE(list) - 1);
        Py_XDECREF(pos);
    }
    Py_DECREF(key);
    return at;
}

/* The op of one LedgerUpdate's body (store or remove), its keys located; UP_PYTHON when the
 * encoding is unusual or the store is empty. */
static int32_t plan_update_body(const uint8_t *batch, uint32_t which, const uint8_t *p,
                                size_t len, UpdatePlan *plan) {
    WireReader r = {p, p + len};
    WireField f;
    int got, seen_parent = 0, seen_keys = 0;
    size_t keys_len = 0;
    plan->parent = 0;
    plan->keys = 0;
    while ((got = wire_next(&r, &f)) == 1) {
        if (which == F_UP_STORE && f.number == 1 && f.type == 1 && !seen_parent++) {
            plan->parent = f.value;
        } else if (((which == F_UP_STORE && f.number == 3) ||
                    (which == F_UP_REMOVE && f.number == 2)) && f.type == 2 && !seen_keys++) {
            plan->keys = f.data - batch;
            keys_len = f.len;
        } else {
            return UP_PYTHON; /* the repeated key field, or anything unknown */
        }
    }
    if (got < 0 || keys_len % 8) return UP_PYTHON;
    plan->n = (int64_t)(keys_len / 8);
    if (which == F_UP_STORE) return plan->n ? UP_STORE : UP_PYTHON;
    return UP_REMOVE;
}

/* One LedgerUpdate into ``plan`` (its Source and Domain interned); -1 with an error set. */
static int plan_update(const uint8_t *batch, const uint8_t *p, size_t len, UpdatePlan *plan,
                       PyObject *src_index, PyObject *sources, PyObject *dom_index,
                       PyObject *domains) {
    WireReader r = {p, p + len};
    WireField f, body = {0}, src = {0}, dom = {0};
    int got, nsrc = 0, ndom = 0, nbody = 0, unusual = 0;
    memset(plan, 0, sizeof(*plan));
    plan->source = plan->domain = -1;
    while ((got = wire_next(&r, &f)) == 1) {
        if (f.number == F_UP_SOURCE && f.type == 2) {
            src = f;
            nsrc++;
        } else if (f.number == F_UP_DOMAIN && f.type == 2) {
            dom = f;
            ndom++;
        } else if (f.number == F_UP_EPOCH && f.type == 0) {
            plan->epoch = f.value;
        } else if (f.number == F_UP_SEQ && f.type == 0) {
            plan->seq = f.value;
        } else if ((f.number == F_UP_STORE || f.number == F_UP_REMOVE) && f.type == 2) {
            body = f;
            nbody++;
        } else {
            unusual = 1; /* clear, state, snapshot, remove_source, or anything unknown */
        }
    }
    if (got < 0 || unusual || nsrc != 1 || ndom != 1 || nbody != 1) {
        plan->kind = UP_PYTHON;
        return 0;
    }
    plan->kind = plan_update_body(batch, body.number, body.data, body.len, plan);
    if (plan->kind == UP_PYTHON) return 0;
    plan->source = intern_span(src_index, sources, src.data, src.len);
    if (plan->source < 0) return -1;
    plan->domain = intern_span(dom_index, domains, dom.data, dom.len);
    return plan->domain < 0 ? -1 : 0;
}

/* plan_update_batch(batch) -> (plan, sources, domains): an UpdatePlan per update of the
 * UpdateBatch bytes ``batch``, and the distinct Source and Domain messages (bytes) its planned
 * updates name. ValueError when the bytes are not a protobuf message. */
static PyObject *plan_update_batch(PyObject *module, PyObject *data) {
    if (!PyBytes_Check(data))
        return PyErr_Format(PyExc_TypeError, "plan_update_batch: bytes needed");
    const uint8_t *batch = (const uint8_t *)PyBytes_AS_STRING(data);
    WireReader r = {batch, batch + PyBytes_GET_SIZE(data)};
    WireField f;
    int got;
    Py_ssize_t n = 0, cap = 64;
    UpdatePlan *plans = PyMem_Malloc((size_t)cap * sizeof(UpdatePlan));
    PyObject *src_index = PyDict_New(), *sources = PyList_New(0);
    PyObject *dom_index = PyDict_New(), *domains = PyList_New(0), *out = NULL;
    if (!plans || !src_index || !sources || !dom_index || !domains) {
        PyErr_NoMemory();
        goto done;
    }
    while ((got = wire_next(&r, &f)) == 1) {
        if (f.number != F_BATCH_UPDATES) continue;
        if (f.type != 2) {
            PyErr_SetString(PyExc_ValueError, "update batch: updates is not a message");
            goto done;
        }
        if (n == cap) {
            UpdatePlan *more = PyMem_Realloc(plans, (size_t)(cap *= 2) * sizeof(UpdatePlan));
            if (!more) {
                PyErr_NoMemory();
                goto done;
            }
            plans = more;
        }
        if (plan_update(batch, f.data, f.len, &plans[n++], src_index, sources, dom_index,
                        domains) < 0)
            goto done;
    }
    if (got < 0) {
        PyErr_SetString(PyExc_ValueError, "update batch: malformed protobuf");
        goto done;
    }
    PyObject *bytes = PyByteArray_FromStringAndSize((const char *)plans,
                                                    n * (Py_ssize_t)sizeof(UpdatePlan));
    if (bytes) out = PyTuple_Pack(3, bytes, sources, domains);
    Py_XDECREF(bytes);
done:
    PyMem_Free(plans);
    Py_XDECREF(src_index);
    Py_XDECREF(sources);
    Py_XDECREF(dom_index);
    Py_XDECREF(domains);
    return out;
}

/* ---- the journal's encoding: ReplicaBatch.ops entries ------------------------------------ */

typedef struct {
    uint8_t *p;
    size_t len, cap;
} OutBuf;

static int out_room(OutBuf *b, size_t more) {
    if (b->len + more <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + more) cap *= 2;
    uint8_t *p = PyMem_Realloc(b->p, cap);
    if (!p) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = p;
    b->cap = cap;
    return 0;
}

static size_t varint_size(uint64_t v) {
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static void put_varint(OutBuf *b, uint64_t v) {
    while (v >= 0x80) {
        b->p[b->len++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    b->p[b->len++] = (uint8_t)v;
}

static void put_le64(OutBuf *b, uint64_t v) {
    for (int i = 0; i < 8; i++) b->p[b->len++] = (uint8_t)(v >> (8 * i));
}

/* Append one ReplicaBatch ``ops`` entry: ReplicaOp{source, store{parent_key, keys_le}} (field
 * 11) or ReplicaOp{source, remove{keys_le}} (field 13), keys as little-endian words. */
static int journal_op(OutBuf *b, int store, const uint8_t *src, size_t src_len,
                      uint64_t parent, const uint64_t *keys, int64_t n) {
    size_t keys_bytes = (size_t)n * 8;
    size_t body = (store && parent ? 9 : 0) + 1 + varint_size(keys_bytes) + keys_bytes;
    size_t op = 1 + varint_size(src_len) + src_len + 1 + varint_size(body) + body;
    if (out_room(b, 1 + varint_size(op) + op) < 0) return -1;
    b->p[b->len++] = (8 << 3) | 2; /* ReplicaBatch.ops */
    put_varint(b, op);
    b->p[b->len++] = (1 << 3) | 2; /* ReplicaOp.source */
    put_varint(b, src_len);
    memcpy(b->p + b->len, src, src_len);
    b->len += src_len;
    b->p[b->len++] = (uint8_t)(((store ? 11 : 13) << 3) | 2);
    put_varint(b, body);
    if (store && parent) {
        b->p[b->len++] = (1 << 3) | 1; /* StoreBlocks.parent_key (proto3: 0 is absent) */
        put_le64(b, parent);
    }
    b->p[b->len++] = (uint8_t)(((store ? 3 : 2) << 3) | 2); /* keys_le */
    put_varint(b, keys_bytes);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(b->p + b->len, keys, keys_bytes);
    b->len += keys_bytes;
#else
    for (int64_t i = 0; i < n; i++) put_le64(b, keys[i]);
#endif
    return 0;
}

/* The finished segment of journal ops (if any) appended to ``segments`` as (domain, bytes). */
static int flush_segment(PyObject *segments, OutBuf *b, int32_t domain) {
    if (!b->len) return 0;
    PyObject *item = Py_BuildValue("(iy#)", domain, (const char *)b->p, (Py_ssize_t)b->len);
    int failed = !item || PyList_Append(segments, item) < 0;
    Py_XDECREF(item);
    b->len = 0;
    return failed ? -1 : 0;
}

/* ---- a run of updates applied -------------------------------------------------------------- */

typedef struct {
    Tree *tree;
    Py_ssize_t bit;
    int32_t domain;      /* the Domain bytes (index) the source's record is in; -1: none */
    uint64_t epoch;
    uint64_t seq;        /* last applied */
    int64_t node_bytes;  /* the budget's estimate per node of the source's tree */
    int touched;
} SyncTarget;

static int sync_targets(PyObject *targets, SyncTarget *out, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyList_GET_ITEM(targets, i);
        out[i].tree = NULL;
        out[i].touched = 0;
        if (t == Py_None) continue;
        PyObject *tree;
        long long bit, epoch, seq, node_bytes;
        int domain;
        if (!PyTuple_Check(t) ||
            !PyArg_ParseTuple(t, "O!LiLLL", &TreeType, &tree, &bit, &domain, &epoch, &seq,
                              &node_bytes)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "apply_update_run: targets are tuples");
            return -1;
        }
        if (check_bit((Tree *)tree, (Py_ssize_t)bit) < 0) return -1;
        out[i].tree = (Tree *)tree;
        out[i].bit = (Py_ssize_t)bit;
        out[i].domain = domain;
        out[i].epoch = (uint64_t)epoch;
        out[i].seq = (uint64_t)seq;
        out[i].node_bytes = node_bytes;
    }
    return 0;
}

/* apply_update_run(batch, plan, start, targets, tick, headroom, sources, journal)
 *   -> (stop, tick, stores, removes, seqs, removed, segments)
 *
 * Apply the planned updates from ``start`` in order while each is a store or removal of a
 * source whose entry in ``targets`` is ``(Tree, bit, domain, epoch, last_seq, node_bytes)``
 * (else None) with the same domain and epoch and seq == last_seq + 1: the sequencing rule of
 * an in-sync source. A store takes recency tick + 1 (``tick`` counts stores). ``stop`` is the
 * first update not applied (the plan's length when all were), or the one after a store that
 * took ``headroom`` (bytes: the memory budget's room, node_bytes per new node) below 0.
 * ``seqs``: (source, last seq) per source applied to; ``removed``: (update index, source, the
 * keys it no longer holds) per removal that dropped any; ``segments``: with ``journal``, the
 * ReplicaBatch ``ops`` entries of the applied changes, as (domain, bytes) per run of one
 * domain (a removal that dropped nothing journals nothing). ``sources`` are the plan's Source
 * bytes. A store its tree refuses ends the run before it (nothing of it applied). */
static PyObject *apply_update_run(PyObject *module, PyObject *args) {
    PyObject *data, *targets, *sources;
    Py_buffer pv;
    Py_ssize_t start;
    unsigned long long tick;
    long long headroom;
    int journal;
    if (!PyArg_ParseTuple(args, "O!y*nO!KLO!p", &PyBytes_Type, &data, &pv, &start,
                          &PyList_Type, &targets, &tick, &headroom, &PyList_Type, &sources,
                          &journal))
        return NULL;
    const uint8_t *batch = (const uint8_t *)PyBytes_AS_STRING(data);
    int64_t size = PyBytes_GET_SIZE(data);
    const UpdatePlan *plans = pv.buf;
    Py_ssize_t n = pv.len / (Py_ssize_t)sizeof(UpdatePlan), i = start < 0 ? 0 : start;
    Py_ssize_t nt = PyList_GET_SIZE(targets);
    uint64_t *keys = NULL, *dropped = NULL;
    int64_t keys_cap = 0, dropped_cap = 0, stores = 0, removes = 0;
    int32_t seg_domain = -1;
    OutBuf seg = {0};
    SyncTarget *tg = PyMem_Calloc((size_t)(nt ? nt : 1), sizeof(SyncTarget));
    PyObject *removed = PyList_New(0), *segments = PyList_New(0), *seqs = NULL, *out = NULL;
    if (!tg || !removed || !segments) {
        PyErr_NoMemory();
        goto done;
    }
    if (nt != PyList_GET_SIZE(sources)) {
        PyErr_SetString(PyExc_ValueError, "apply_update_run: a target per source needed");
        goto done;
    }
    if (sync_targets(targets, tg, nt) < 0) goto done;
    for (; i < n; i++) {
        const UpdatePlan *up = &plans[i];
        if (up->kind == UP_PYTHON) break;
        if (up->source < 0 || up->source >= nt || up->n < 0 || up->keys < 0 ||
            up->keys > size || up->n > (size - up->keys) / 8) {
            PyErr_SetString(PyExc_ValueError, "apply_update_run: the plan is not this batch's");
            goto done;
        }
        SyncTarget *t = &tg[up->source];
        if (!t->tree || t->domain != up->domain || t->epoch != up->epoch ||
            up->seq != t->seq + 1)
            break; /* not in order for an in-sync source: the caller's sequencing decides */
        const uint64_t *k = wire_keys(batch, up->keys, up->n, &keys, &keys_cap);
        if (!k) goto done;
        PyObject *src = PyList_GET_ITEM(sources, up->source);
        if (journal && up->domain != seg_domain) {
            if (flush_segment(segments, &seg, seg_domain) < 0) goto done;
            seg_domain = up->domain;
        }
        if (up->kind == UP_REMOVE) {
            if (up->n > dropped_cap || !dropped) {
                int64_t want = up->n > 0 ? up->n : 1;
                uint64_t *more = PyMem_Realloc(dropped, (size_t)want * 8);
                if (!more) {
                    PyErr_NoMemory();
                    goto done;
                }
                dropped = more;
                dropped_cap = want;
            }
            int64_t gone = remove_keys(t->tree, t->bit, k, up->n, dropped);
            if (gone) {
                PyObject *item = Py_BuildValue("(niN)", i, up->source, words_out(dropped, gone));
                if (!item || PyList_Append(removed, item) < 0) {
                    Py_XDECREF(item);
                    goto done;
                }
                Py_DECREF(item);
                if (journal && journal_op(&seg, 0, (const uint8_t *)PyBytes_AS_STRING(src),
                                          (size_t)PyBytes_GET_SIZE(src), 0, dropped, gone) < 0)
                    goto done;
            }
            removes++;
        } else {
            int64_t before = t->tree->nodes;
            PyObject *fresh = store_batch(t->tree, t->bit, NULL, up->parent, k, up->n,
                                          tick + 1);
            if (!fresh) {
                if (!PyErr_ExceptionMatches(PyExc_ValueError)) goto done;
                PyErr_Clear(); /* refused, nothing changed: the caller's path reports it */
                break;
            }
            Py_DECREF(fresh);
            tick++;
            stores++;
            if (journal && journal_op(&seg, 1, (const uint8_t *)PyBytes_AS_STRING(src),
                                      (size_t)PyBytes_GET_SIZE(src), up->parent, k, up->n) < 0)
                goto done;
            headroom -= (t->tree->nodes - before) * t->node_bytes;
        }
        t->seq = up->seq;
        t->touched = 1;
        if (headroom < 0) {
            i++;
            break;
        }
    }
    if (journal && flush_segment(segments, &seg, seg_domain) < 0) goto done;
    seqs = PyList_New(0);
    if (!seqs) goto done;
    for (Py_ssize_t s = 0; s < nt; s++) {
        if (!tg[s].touched) continue;
        PyObject *item = Py_BuildValue("(nK)", s, (unsigned long long)tg[s].seq);
        if (!item || PyList_Append(seqs, item) < 0) {
            Py_XDECREF(item);
            goto done;
        }
        Py_DECREF(item);
    }
    out = Py_BuildValue("(nKLLOOO)", i, tick, (long long)stores, (long long)removes, seqs,
                        removed, segments);
done:
    PyBuffer_Release(&pv);
    PyMem_Free(keys);
    PyMem_Free(dropped);
    PyMem_Free(seg.p);
    PyMem_Free(tg);
    Py_XDECREF(seqs);
    Py_XDECREF(removed);
    Py_XDECREF(segments);
    return out;
}

#endif
