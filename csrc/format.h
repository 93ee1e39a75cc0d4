/* format.h: the bytes of a checkpoint file, as docs/FORMAT.md lays them out:
 * sizes, little-endian fields, padding, and the names a file may give the
 * earlier files it refers to.  Private to the files that read and write
 * checkpoints (format.c, picklescan.c, reader.c); flor.h declares what the
 * rest of the C core uses.
 */
#ifndef FLOR_FORMAT_H
#define FLOR_FORMAT_H

#include "flor.h"

#define HEADER_SIZE 192
#define HEADER_SIZE_V1 128
#define FORMAT_VERSION 2u
#define BLOB_REC 32
#define BLOB_REC_V1 24
#define ENTRY_FIXED 24

static const unsigned char MAGIC[8] = {0x89, 'F', 'L', 'R', '\r', '\n', 0x1a, '\n'};

static inline void
put32(unsigned char *p, uint32_t v)
{
    int i;
    for (i = 0; i < 4; i++) {
        p[i] = (unsigned char)(v >> (8 * i));
    }
}

static inline void
put64(unsigned char *p, uint64_t v)
{
    int i;
    for (i = 0; i < 8; i++) {
        p[i] = (unsigned char)(v >> (8 * i));
    }
}

static inline uint32_t
get32(const unsigned char *p)
{
    uint32_t v = 0;
    int i;
    for (i = 3; i >= 0; i--) {
        v = (v << 8) | p[i];
    }
    return v;
}

static inline uint64_t
get64(const unsigned char *p)
{
    uint64_t v = 0;
    int i;
    for (i = 7; i >= 0; i--) {
        v = (v << 8) | p[i];
    }
    return v;
}

static inline uint64_t
align8(uint64_t x)
{
    return (x + 7) & ~(uint64_t)7;
}

/* A source name is a plain file name in the checkpoint's own directory. */
static inline int
valid_source_name(const unsigned char *p, size_t len)
{
    size_t i;
    if (len == 0 || len > 255 || (len == 1 && p[0] == '.') ||
        (len == 2 && p[0] == '.' && p[1] == '.')) {
        return 0;
    }
    for (i = 0; i < len; i++) {
        if (p[i] <= ' ' || p[i] >= 0x7f || p[i] == '/' || p[i] == '\\') {
            return 0;
        }
    }
    return 1;
}

#endif /* FLOR_FORMAT_H */
