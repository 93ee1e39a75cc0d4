/* dedup.c: the blobs a materializer has made durable, by content, so that a
 * later checkpoint of the same run can refer to them instead of writing them.
 *
 *     class Dedup:                              # one per Materializer
 *         table: {(hash, nbytes, dtype): (file, offset, crc, generation)}
 *         def find(hash, nbytes, dtype):        # a hit refreshes its generation
 *         def add(hash, nbytes, dtype, file, offset, crc):   # after rename+fsync
 *         def next_generation():                # once per file written
 *
 * Entries always name the file that holds the bytes, never a file that only
 * refers to them, so references are one level deep.  Entries not used in the
 * last KEEP_GENERATIONS files are dropped when the table grows.  A mutex
 * guards everything: the writer thread and submit() (for its estimate of the
 * bytes a checkpoint will write) both use it.  Touches no Python object.
 */
#include "flor.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define KEEP_GENERATIONS 8

typedef struct {
    uint64_t hash, nbytes, offset;
    uint32_t crc, file; /* file: index into names + 1; 0 marks an empty slot */
    uint64_t gen;
    char dtype[FLOR_NAME_MAX];
} slot;

struct flor_dedup {
    pthread_mutex_t mu;
    slot *slots;
    size_t cap, used; /* cap: a power of two */
    char **names;
    uint32_t n_names, names_cap;
    uint64_t gen;
};

flor_dedup *
flor_dedup_new(void)
{
    flor_dedup *d = calloc(1, sizeof(*d));
    if (d == NULL) {
        return NULL;
    }
    d->cap = 256;
    d->slots = calloc(d->cap, sizeof(slot));
    if (d->slots == NULL || pthread_mutex_init(&d->mu, NULL) != 0) {
        free(d->slots);
        free(d);
        return NULL;
    }
    return d;
}

void
flor_dedup_free(flor_dedup *d)
{
    uint32_t i;
    if (d == NULL) {
        return;
    }
    for (i = 0; i < d->n_names; i++) {
        free(d->names[i]);
    }
    free(d->names);
    free(d->slots);
    pthread_mutex_destroy(&d->mu);
    free(d);
}

static size_t
home(uint64_t hash, uint64_t nbytes, size_t cap)
{
    return (size_t)((hash ^ (nbytes * 0x9E3779B97F4A7C15ull)) & (cap - 1));
}

static slot *
lookup(slot *slots, size_t cap, uint64_t hash, uint64_t nbytes, const char *dtype)
{
    size_t i = home(hash, nbytes, cap);
    for (;;) {
        slot *s = &slots[i];
        if (s->file == 0 ||
            (s->hash == hash && s->nbytes == nbytes && strcmp(s->dtype, dtype) == 0)) {
            return s;
        }
        i = (i + 1) & (cap - 1);
    }
}

int
flor_dedup_find(flor_dedup *d, uint64_t hash, uint64_t nbytes, const char *dtype, const char **file,
                uint64_t *offset, uint32_t *crc)
{
    slot *s;
    int found = 0;
    pthread_mutex_lock(&d->mu);
    s = lookup(d->slots, d->cap, hash, nbytes, dtype);
    if (s->file != 0) {
        if (file != NULL) {
            *file = d->names[s->file - 1];
            *offset = s->offset;
            *crc = s->crc;
            s->gen = d->gen;
        }
        found = 1;
    }
    pthread_mutex_unlock(&d->mu);
    return found;
}

/* Rebuild the table with the entries used lately, at a size that leaves it
 * at most a quarter full.  Touches no Python object: -1 when out of memory,
 * with no exception (the table is left as it was). */
static int
rehash_locked(flor_dedup *d)
{
    size_t i, keep = 0, cap = 256;
    slot *slots;
    for (i = 0; i < d->cap; i++) {
        if (d->slots[i].file != 0 && d->slots[i].gen + KEEP_GENERATIONS >= d->gen) {
            keep++;
        }
    }
    while (cap < 4 * (keep + 1)) {
        cap *= 2;
    }
    slots = calloc(cap, sizeof(slot));
    if (slots == NULL) {
        return -1;
    }
    for (i = 0; i < d->cap; i++) {
        const slot *s = &d->slots[i];
        if (s->file != 0 && s->gen + KEEP_GENERATIONS >= d->gen) {
            *lookup(slots, cap, s->hash, s->nbytes, s->dtype) = *s;
        }
    }
    free(d->slots);
    d->slots = slots;
    d->cap = cap;
    d->used = keep;
    return 0;
}

int
flor_dedup_add(flor_dedup *d, uint64_t hash, uint64_t nbytes, const char *dtype, const char *file,
               uint64_t offset, uint32_t crc)
{
    slot *s;
    int rc = -1;
    size_t dl = strlen(dtype);
    pthread_mutex_lock(&d->mu);
    if (dl >= FLOR_NAME_MAX) {
        goto done;
    }
    if (d->n_names == 0 || strcmp(d->names[d->n_names - 1], file) != 0) {
        if (d->n_names == d->names_cap) {
            uint32_t ncap = d->names_cap ? 2 * d->names_cap : 16;
            char **names = realloc(d->names, ncap * sizeof(char *));
            if (names == NULL) {
                goto done;
            }
            d->names = names;
            d->names_cap = ncap;
        }
        d->names[d->n_names] = strdup(file);
        if (d->names[d->n_names] == NULL) {
            goto done;
        }
        d->n_names++;
    }
    if (2 * (d->used + 1) > d->cap && rehash_locked(d) < 0) {
        goto done;
    }
    s = lookup(d->slots, d->cap, hash, nbytes, dtype);
    if (s->file == 0) {
        d->used++;
    }
    s->hash = hash;
    s->nbytes = nbytes;
    s->offset = offset;
    s->crc = crc;
    s->file = d->n_names;
    s->gen = d->gen;
    memcpy(s->dtype, dtype, dl + 1);
    rc = 0;
done:
    pthread_mutex_unlock(&d->mu);
    return rc;
}

void
flor_dedup_next_generation(flor_dedup *d)
{
    pthread_mutex_lock(&d->mu);
    d->gen++;
    pthread_mutex_unlock(&d->mu);
}
