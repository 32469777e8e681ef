/* block_keys_packed: Cortex block keys of packed tokens (cortex/hashing/keys.py::block_keys) in
 * C; included by _core.c.
 *
 * key_i = xxh3_64(the block's block_size uint32 little-endian tokens, seed = key_{i-1}): XXH3's
 * 64-bit hash with a seed, written here for inputs of at most 240 bytes (blocks of up to 60
 * tokens), where XXH3 uses its default secret with the seed folded into each step. Longer
 * blocks return None (the caller hashes them in Python, with the xxhash package). The
 * differential test (tests/ingest/test_columnar.py) holds it to xxhash.xxh3_64_intdigest on
 * every length from 0 to 240 bytes and random seeds, and to block_keys on random chains.
 */

static const uint8_t xxh3_secret[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

#define XXH_P32_1 0x9E3779B1U
#define XXH_P64_1 0x9E3779B185EBCA87ULL
#define XXH_P64_2 0xC2B2AE3D27D4EB4FULL
#define XXH_P64_3 0x165667B19E3779F9ULL
#define XXH_MX1 0x165667919E3779F9ULL
#define XXH_MX2 0x9FB21C651E98DF25ULL
#define XXH3_MAX_SHORT 240

static inline uint64_t xxh_r64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static inline uint32_t xxh_r32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint64_t xxh_rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t xxh_fold(uint64_t a, uint64_t b) {
    __uint128_t product = (__uint128_t)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
}

static inline uint64_t xxh64_avalanche(uint64_t h) {
    h ^= h >> 33;
    h *= XXH_P64_2;
    h ^= h >> 29;
    h *= XXH_P64_3;
    return h ^ (h >> 32);
}

static inline uint64_t xxh3_avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= XXH_MX1;
    return h ^ (h >> 32);
}

static inline uint64_t xxh3_rrmxmx(uint64_t h, uint64_t len) {
    h ^= xxh_rotl64(h, 49) ^ xxh_rotl64(h, 24);
    h *= XXH_MX2;
    h ^= (h >> 35) + len;
    h *= XXH_MX2;
    return h ^ (h >> 28);
}

static inline uint64_t xxh3_mix16(const uint8_t *in, const uint8_t *secret, uint64_t seed) {
    return xxh_fold(xxh_r64(in) ^ (xxh_r64(secret) + seed),
                    xxh_r64(in + 8) ^ (xxh_r64(secret + 8) - seed));
}

/* XXH3_64bits_withSeed(in, len, seed) for len <= 240. */
static uint64_t xxh3_64_short(const uint8_t *in, size_t len, uint64_t seed) {
    const uint8_t *s = xxh3_secret;
    if (len == 0) return xxh64_avalanche(seed ^ (xxh_r64(s + 56) ^ xxh_r64(s + 64)));
    if (len <= 3) {
        uint32_t combined = (uint32_t)in[0] << 16 | (uint32_t)in[len >> 1] << 24 |
                            (uint32_t)in[len - 1] | (uint32_t)len << 8;
        uint64_t flip = (uint64_t)(xxh_r32(s) ^ xxh_r32(s + 4)) + seed;
        return xxh64_avalanche((uint64_t)combined ^ flip);
    }
    if (len <= 8) {
        uint32_t low = (uint32_t)seed;
        uint32_t swapped = (low >> 24) | ((low >> 8) & 0xff00) | ((low << 8) & 0xff0000) |
                           (low << 24);
        seed ^= (uint64_t)swapped << 32;
        uint64_t flip = (xxh_r64(s + 8) ^ xxh_r64(s + 16)) - seed;
        uint64_t input = (uint64_t)xxh_r32(in + len - 4) + ((uint64_t)xxh_r32(in) << 32);
        return xxh3_rrmxmx(input ^ flip, len);
    }
    if (len <= 16) {
        uint64_t flip1 = (xxh_r64(s + 24) ^ xxh_r64(s + 32)) + seed;
        uint64_t flip2 = (xxh_r64(s + 40) ^ xxh_r64(s + 48)) - seed;
        uint64_t lo = xxh_r64(in) ^ flip1, hi = xxh_r64(in + len - 8) ^ flip2;
        uint64_t acc = len + __builtin_bswap64(lo) + hi + xxh_fold(lo, hi);
        return xxh3_avalanche(acc);
    }
    uint64_t acc = len * XXH_P64_1;
    if (len <= 128) {
        if (len > 32) {
            if (len > 64) {
                if (len > 96) {
                    acc += xxh3_mix16(in + 48, s + 96, seed);
                    acc += xxh3_mix16(in + len - 64, s + 112, seed);
                }
                acc += xxh3_mix16(in + 32, s + 64, seed);
                acc += xxh3_mix16(in + len - 48, s + 80, seed);
            }
            acc += xxh3_mix16(in + 16, s + 32, seed);
            acc += xxh3_mix16(in + len - 32, s + 48, seed);
        }
        acc += xxh3_mix16(in, s, seed);
        acc += xxh3_mix16(in + len - 16, s + 16, seed);
        return xxh3_avalanche(acc);
    }
    size_t rounds = len / 16;
    for (size_t i = 0; i < 8; i++) acc += xxh3_mix16(in + 16 * i, s + 16 * i, seed);
    uint64_t end = xxh3_mix16(in + len - 16, s + 136 - 17, seed);
    acc = xxh3_avalanche(acc);
    for (size_t i = 8; i < rounds; i++) end += xxh3_mix16(in + 16 * i, s + 16 * (i - 8) + 3, seed);
    return xxh3_avalanche(acc + end);
}

/* xxh3_64_short(data, seed) -> int: for the differential test (ValueError past 240 bytes). */
static PyObject *xxh3_short(PyObject *module, PyObject *args) {
    Py_buffer view;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "y*K", &view, &seed)) return NULL;
    PyObject *out = NULL;
    if (view.len > XXH3_MAX_SHORT)
        PyErr_Format(PyExc_ValueError, "xxh3_64_short: %zd bytes (at most 240)", view.len);
    else
        out = PyLong_FromUnsignedLongLong(
            xxh3_64_short((const uint8_t *)view.buf, (size_t)view.len, seed));
    PyBuffer_Release(&view);
    return out;
}

/* block_keys_packed(tokens, block_size, parent) -> list[int] | None: the keys of the full
 * blocks of packed uint32 little-endian tokens chained from parent; None when a block is longer
 * than 240 bytes. ValueError for a length that is not a multiple of 4 or a block size < 1. */
static PyObject *block_keys_packed(PyObject *module, PyObject *args) {
    Py_buffer view;
    Py_ssize_t block_size;
    unsigned long long parent;
    if (!PyArg_ParseTuple(args, "y*nK", &view, &block_size, &parent)) return NULL;
    PyObject *out = NULL;
    if (block_size < 1 || view.len % 4) {
        PyErr_Format(PyExc_ValueError, "block_keys_packed: %zd bytes, block size %zd",
                     view.len, block_size);
        goto done;
    }
    if (block_size > XXH3_MAX_SHORT / 4) {
        out = Py_None;
        Py_INCREF(out);
        goto done;
    }
    size_t step = (size_t)block_size * 4;
    Py_ssize_t n = (Py_ssize_t)((size_t)view.len / step);
    out = PyList_New(n);
    if (!out) goto done;
    const uint8_t *p = (const uint8_t *)view.buf;
    uint64_t key = parent;
    for (Py_ssize_t i = 0; i < n; i++) {
        key = xxh3_64_short(p + (size_t)i * step, step, key);
        PyObject *k = PyLong_FromUnsignedLongLong(key);
        if (!k) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, k);
    }
done:
    PyBuffer_Release(&view);
    return out;
}
