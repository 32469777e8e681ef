/* cortex.ledger._core: reading protobuf wire bytes in place.
 *
 * Just enough of the encoding (varints, fixed64, length-delimited spans) for the core to walk
 * a ReplicaBatch's ops without a message object per op. A reader never trusts its input:
 * every length is checked against the end of its span; groups (wire types 3 and 4, absent
 * from cortex.index.v1) read as malformed.
 */
#ifndef CORTEX_LEDGER_WIRE_H
#define CORTEX_LEDGER_WIRE_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    const uint8_t *p;
    const uint8_t *end;
} WireReader;

typedef struct {
    uint32_t number;     /* field number */
    int type;            /* wire type: 0 varint, 1 fixed64, 2 length-delimited, 5 fixed32 */
    uint64_t value;      /* types 0 and 1 */
    const uint8_t *data; /* type 2: the field's bytes */
    size_t len;
} WireField;

/* A little-endian uint64 at any address, as the host's integer. */
static inline uint64_t wire_le64(const uint8_t *p) {
    return (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24 |
           (uint64_t)p[4] << 32 | (uint64_t)p[5] << 40 | (uint64_t)p[6] << 48 |
           (uint64_t)p[7] << 56;
}

static inline int wire_varint(WireReader *r, uint64_t *out) {
    uint64_t v = 0;
    for (int shift = 0; shift < 70; shift += 7) {
        if (r->p >= r->end) return -1;
        uint8_t b = *r->p++;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return 0;
        }
    }
    return -1; /* more than 10 bytes */
}

/* The next field of the span: 1 read, 0 at the end, -1 malformed. */
static inline int wire_next(WireReader *r, WireField *f) {
    if (r->p >= r->end) return 0;
    uint64_t tag, len;
    if (wire_varint(r, &tag) < 0 || (tag >> 3) == 0 || (tag >> 3) > 0x1FFFFFFF) return -1;
    f->number = (uint32_t)(tag >> 3);
    f->type = (int)(tag & 7);
    switch (f->type) {
    case 0:
        return wire_varint(r, &f->value) < 0 ? -1 : 1;
    case 1:
        if (r->end - r->p < 8) return -1;
        f->value = wire_le64(r->p);
        r->p += 8;
        return 1;
    case 2:
        if (wire_varint(r, &len) < 0 || len > (uint64_t)(r->end - r->p)) return -1;
        f->data = r->p;
        f->len = (size_t)len;
        r->p += len;
        return 1;
    case 5:
        if (r->end - r->p < 4) return -1;
        r->p += 4;
        return 1;
    default:
        return -1;
    }
}

#endif
