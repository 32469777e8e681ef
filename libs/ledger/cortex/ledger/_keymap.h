/* cortex.ledger._core: the per-block loops of the ingest's key map (cortex.ingest.ledger).
 *
 * An ingest maps every engine block hash it hears to a Cortex key, and each key to its
 * parent, in four dicts (engine hash -> key, key -> parent key, and the extra copies of a
 * hash or of a key beyond the first). These functions are Ledger.store and Ledger.remove
 * written against the same dicts: the same lookups and writes in the same order, so the
 * dicts (insertion order included) end exactly as the Python methods leave them, errors
 * included (a key list shorter or longer than the hashes: the common part is applied, then
 * ValueError, as zip(strict=True) does). They save the interpreter's work per block, not
 * the dicts'. Included by _core.c.
 */
#ifndef CORTEX_LEDGER_KEYMAP_H
#define CORTEX_LEDGER_KEYMAP_H

#include <Python.h>

/* counts[item] += 1 (a missing item counts 0). */
static int keymap_bump(PyObject *counts, PyObject *item) {
    PyObject *had = PyDict_GetItemWithError(counts, item);
    if (!had && PyErr_Occurred()) return -1;
    long n = had ? PyLong_AsLong(had) : 0;
    if (n == -1 && PyErr_Occurred()) return -1;
    PyObject *v = PyLong_FromLong(n + 1);
    if (!v) return -1;
    int rc = PyDict_SetItem(counts, item, v);
    Py_DECREF(v);
    return rc;
}

/* One fewer extra copy of ``item`` when it has one: 1 taken, 0 none, -1 error. */
static int keymap_take_extra(PyObject *counts, PyObject *item) {
    if (!PyDict_GET_SIZE(counts)) return 0;
    PyObject *had = PyDict_GetItemWithError(counts, item);
    if (!had) return PyErr_Occurred() ? -1 : 0;
    int truth = PyObject_IsTrue(had);
    if (truth <= 0) return truth;
    long n = PyLong_AsLong(had);
    if (n == -1 && PyErr_Occurred()) return -1;
    if (n == 1) return PyDict_DelItem(counts, item) < 0 ? -1 : 1;
    PyObject *v = PyLong_FromLong(n - 1);
    if (!v) return -1;
    int rc = PyDict_SetItem(counts, item, v);
    Py_DECREF(v);
    return rc < 0 ? -1 : 1;
}

/* dict.pop(item): 1 with a new reference in *out, 0 when absent, -1 on error. */
static int keymap_pop(PyObject *dict, PyObject *item, PyObject **out) {
    PyObject *had = PyDict_GetItemWithError(dict, item);
    if (!had) return PyErr_Occurred() ? -1 : 0;
    Py_INCREF(had);
    if (PyDict_DelItem(dict, item) < 0) {
        Py_DECREF(had);
        return -1;
    }
    *out = had;
    return 1;
}

typedef struct {
    PyObject *key_of, *parent_of, *dup_hash, *dup_key;
} KeyMapDicts;

/* Ledger._forget: drop ``hash`` entirely; a new reference to its key when the key is no
 * longer held, Py_None when another copy keeps it, NULL on error. */
static PyObject *keymap_forget(const KeyMapDicts *d, PyObject *hash) {
    if (PyDict_GET_SIZE(d->dup_hash)) {
        PyObject *gone = NULL;
        if (keymap_pop(d->dup_hash, hash, &gone) < 0) return NULL;
        Py_XDECREF(gone);
    }
    PyObject *key = NULL;
    int found = keymap_pop(d->key_of, hash, &key);
    if (found < 0) return NULL;
    if (!found) {
        PyErr_SetObject(PyExc_KeyError, hash);
        return NULL;
    }
    int extra = keymap_take_extra(d->dup_key, key);
    if (extra) {
        Py_DECREF(key);
        if (extra < 0) return NULL;
        Py_RETURN_NONE;
    }
    if (PyDict_DelItem(d->parent_of, key) < 0) {
        Py_DECREF(key);
        return NULL;
    }
    return key;
}

/* Ledger._hold: ``key`` (under ``parent``) gains a copy. */
static int keymap_hold(const KeyMapDicts *d, PyObject *key, PyObject *parent) {
    int held = PyDict_Contains(d->parent_of, key);
    if (held < 0) return -1;
    return held ? keymap_bump(d->dup_key, key) : PyDict_SetItem(d->parent_of, key, parent);
}

static int keymap_dicts(PyObject *args, KeyMapDicts *d, PyObject **a, PyObject **b,
                        PyObject **c) {
    if (!PyArg_ParseTuple(args, "O!O!O!O!O|OO", &PyDict_Type, &d->key_of, &PyDict_Type,
                          &d->parent_of, &PyDict_Type, &d->dup_hash, &PyDict_Type, &d->dup_key,
                          a, b, c))
        return -1;
    return 0;
}

/* keymap_store(key_of, parent_of, dup_hash, dup_key, hashes, keys, parent_key): Ledger.store. */
static PyObject *keymap_store(PyObject *module, PyObject *args) {
    KeyMapDicts d;
    PyObject *hashes_in, *keys_in = NULL, *parent = NULL;
    if (keymap_dicts(args, &d, &hashes_in, &keys_in, &parent) < 0) return NULL;
    if (!keys_in || !parent)
        return PyErr_Format(PyExc_TypeError, "keymap_store: hashes, keys and a parent key");
    PyObject *hashes = PySequence_Fast(hashes_in, "keymap_store: hashes must be a sequence");
    if (!hashes) return NULL;
    PyObject *keys = PySequence_Fast(keys_in, "keymap_store: keys must be a sequence");
    if (!keys) {
        Py_DECREF(hashes);
        return NULL;
    }
    Py_ssize_t nh = PySequence_Fast_GET_SIZE(hashes), nk = PySequence_Fast_GET_SIZE(keys);
    Py_ssize_t n = nh < nk ? nh : nk;
    PyObject **hs = PySequence_Fast_ITEMS(hashes), **ks = PySequence_Fast_ITEMS(keys);
    PyObject *out = NULL;
    Py_INCREF(parent);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *hash = hs[i], *key = ks[i];
        PyObject *old = PyDict_GetItemWithError(d.key_of, hash);
        if (!old) {
            if (PyErr_Occurred() || PyDict_SetItem(d.key_of, hash, key) < 0 ||
                keymap_hold(&d, key, parent) < 0)
                goto done;
        } else {
            Py_INCREF(old); /* _forget below may drop the dict's reference */
            int same = PyObject_RichCompareBool(old, key, Py_EQ);
            Py_DECREF(old);
            if (same < 0) goto done;
            if (same) {
                if (keymap_bump(d.dup_hash, hash) < 0) goto done;
            } else { /* the engine reused a hash for other tokens: the newest store wins */
                PyObject *forgotten = keymap_forget(&d, hash);
                if (!forgotten) goto done;
                Py_DECREF(forgotten);
                if (PyDict_SetItem(d.key_of, hash, key) < 0 || keymap_hold(&d, key, parent) < 0)
                    goto done;
            }
        }
        Py_INCREF(key);
        Py_SETREF(parent, key); /* a chain's next parent */
    }
    if (nh != nk) {
        PyErr_Format(PyExc_ValueError, "keymap_store: %zd hashes for %zd keys", nh, nk);
        goto done;
    }
    out = Py_None;
    Py_INCREF(out);
done:
    Py_DECREF(parent);
    Py_DECREF(hashes);
    Py_DECREF(keys);
    return out;
}

/* keymap_remove(key_of, parent_of, dup_hash, dup_key, hashes) -> (dead keys, unknown):
 * Ledger.remove. */
static PyObject *keymap_remove(PyObject *module, PyObject *args) {
    KeyMapDicts d;
    PyObject *hashes_in, *unused = NULL, *unused2 = NULL;
    if (keymap_dicts(args, &d, &hashes_in, &unused, &unused2) < 0) return NULL;
    if (unused) return PyErr_Format(PyExc_TypeError, "keymap_remove: only hashes");
    PyObject *iter = PyObject_GetIter(hashes_in);
    if (!iter) return NULL;
    PyObject *dead = PyList_New(0), *hash, *out = NULL;
    Py_ssize_t unknown = 0;
    if (!dead) goto done;
    while ((hash = PyIter_Next(iter))) {
        int known = PyDict_Contains(d.key_of, hash);
        int extra = known > 0 ? keymap_take_extra(d.dup_hash, hash) : 0;
        PyObject *key = NULL;
        if (known > 0 && extra == 0) key = keymap_forget(&d, hash);
        Py_DECREF(hash);
        if (known < 0 || extra < 0) goto done;
        if (!known) {
            unknown++;
            continue;
        }
        if (extra) continue;
        if (!key) goto done;
        int rc = key == Py_None ? 0 : PyList_Append(dead, key);
        Py_DECREF(key);
        if (rc < 0) goto done;
    }
    if (!PyErr_Occurred()) out = Py_BuildValue("(On)", dead, unknown);
done:
    Py_DECREF(iter);
    Py_XDECREF(dead);
    return out;
}

#endif
