/* dedup.c: the blobs a materializer has made durable, by content, so that a
 * later checkpoint of the same run can refer to them instead of writing them,
 * and which files refer to which, so that a file may be removed once none
 * does.
 *
 *     class Dedup:                              # one per Materializer
 *         table: {(hash, nbytes, dtype): (file, offset, crc, generation)}
 *         names: [file: (refs, sources, retired)]
 *         def find(hash, nbytes, dtype):        # a hit refreshes its generation;
 *                                               # for the writer, counts a ref
 *         def add(hash, nbytes, dtype, file, offset, crc):   # after rename+fsync
 *         def next_generation():                # once per file written
 *         def wrote(file, sources, ok):         # its writer is done with it
 *         def retire(file):                     # if no file refers to it:
 *             drop its entries and release its sources; return whether one does
 *
 * Entries always name the file that holds the bytes, never a file that only
 * refers to them, so references are one level deep.  A file's refs count the
 * blobs that files written, or being written, take from it: a find that
 * hands it to the writer counts one at once, under the lock, so a file that
 * retire() finds unreferred is one no file refers to, and once its entries
 * are dropped none will.  wrote() records a written file's sources (their
 * refs stay counted until it is retired) or, for a failed write, gives their
 * refs back.  Names are freed only with the table: the writer holds them as
 * sources.  Entries not used in the last KEEP_GENERATIONS files are dropped
 * when the table grows.  A mutex guards everything: the writer thread,
 * submit() (for its estimate of the bytes a checkpoint will write) and
 * retire() all use it.  Touches no Python object.
 */
#include "flor.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define KEEP_GENERATIONS 8
#define TOMBSTONE UINT32_MAX /* a retired entry: lookups probe past it */

typedef struct {
    uint64_t hash, nbytes, offset;
    uint32_t crc, file; /* file: index into names + 1; 0 marks an empty slot */
                        /* (TOMBSTONE a retired entry's, until the next rebuild) */
    uint64_t gen;
    char dtype[FLOR_NAME_MAX];
} slot;

typedef struct {
    char *name;
    uint64_t refs;    /* blobs that files written or being written take from it */
    uint32_t n_srcs;  /* the files it refers to, once written: */
    uint32_t *srcs;   /* their indices in names */
    uint32_t *counts; /* and how many of its blobs each holds */
    int retired;
} name_t;

struct flor_dedup {
    pthread_mutex_t mu;
    slot *slots;
    size_t cap, used; /* cap: a power of two */
    name_t *names;
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
        free(d->names[i].name);
        free(d->names[i].srcs);
        free(d->names[i].counts);
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
        if (s->file == 0 || (s->file != TOMBSTONE && s->hash == hash && s->nbytes == nbytes &&
                             strcmp(s->dtype, dtype) == 0)) {
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
            *file = d->names[s->file - 1].name;
            *offset = s->offset;
            *crc = s->crc;
            s->gen = d->gen;
            d->names[s->file - 1].refs++;
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
        if (d->slots[i].file != 0 && d->slots[i].file != TOMBSTONE &&
            d->slots[i].gen + KEEP_GENERATIONS >= d->gen) {
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
        if (s->file != 0 && s->file != TOMBSTONE && s->gen + KEEP_GENERATIONS >= d->gen) {
            *lookup(slots, cap, s->hash, s->nbytes, s->dtype) = *s;
        }
    }
    free(d->slots);
    d->slots = slots;
    d->cap = cap;
    d->used = keep;
    return 0;
}

/* The index in names + 1 of `file` (the last name: a file's blobs are added
 * together, then its sources), appended if it is not there; 0 when out of
 * memory. */
static uint32_t
name_locked(flor_dedup *d, const char *file)
{
    name_t *n;
    if (d->n_names > 0 && !d->names[d->n_names - 1].retired &&
        strcmp(d->names[d->n_names - 1].name, file) == 0) {
        return d->n_names;
    }
    if (d->n_names == d->names_cap) {
        uint32_t ncap = d->names_cap ? 2 * d->names_cap : 16;
        name_t *names = realloc(d->names, ncap * sizeof(name_t));
        if (names == NULL) {
            return 0;
        }
        d->names = names;
        d->names_cap = ncap;
    }
    n = &d->names[d->n_names];
    memset(n, 0, sizeof(*n));
    n->name = strdup(file);
    if (n->name == NULL) {
        return 0;
    }
    return ++d->n_names;
}

/* The index in names of the name the writer holds as `ptr` (from find). */
static uint32_t
index_of_locked(const flor_dedup *d, const char *ptr)
{
    uint32_t i;
    for (i = d->n_names; i-- > 0;) {
        if (d->names[i].name == ptr) {
            return i;
        }
    }
    return UINT32_MAX;
}

int
flor_dedup_add(flor_dedup *d, uint64_t hash, uint64_t nbytes, const char *dtype, const char *file,
               uint64_t offset, uint32_t crc)
{
    slot *s;
    int rc = -1;
    uint32_t at;
    size_t dl = strlen(dtype);
    pthread_mutex_lock(&d->mu);
    if (dl >= FLOR_NAME_MAX) {
        goto done;
    }
    at = name_locked(d, file);
    if (at == 0) {
        goto done;
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
    s->file = at;
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

void
flor_dedup_unrefer(flor_dedup *d, const char *source)
{
    uint32_t i;
    pthread_mutex_lock(&d->mu);
    i = index_of_locked(d, source);
    if (i != UINT32_MAX && d->names[i].refs > 0) {
        d->names[i].refs--;
    }
    pthread_mutex_unlock(&d->mu);
}

int
flor_dedup_wrote(flor_dedup *d, const char *file, const char *const *sources,
                 const uint32_t *src_of, uint32_t n_blobs, uint32_t n_sources, int ok)
{
    uint32_t i, k, at = 0, *srcs = NULL, *counts = NULL;
    int rc = -1;
    if (n_sources == 0) {
        return 0;
    }
    srcs = calloc(n_sources, sizeof(uint32_t));
    counts = calloc(n_sources, sizeof(uint32_t));
    pthread_mutex_lock(&d->mu);
    if (srcs == NULL || counts == NULL || (ok && (at = name_locked(d, file)) == 0)) {
        ok = 0; /* the refs stay counted: its sources are kept for good */
        goto done;
    }
    for (i = 0; i < n_blobs; i++) {
        if (src_of[i] > 0 && src_of[i] <= n_sources) {
            counts[src_of[i] - 1]++;
        }
    }
    for (k = 0; k < n_sources; k++) {
        srcs[k] = index_of_locked(d, sources[k]);
        if (!ok && srcs[k] != UINT32_MAX) {
            name_t *n = &d->names[srcs[k]];
            n->refs = n->refs > counts[k] ? n->refs - counts[k] : 0;
        }
    }
    if (ok) {
        name_t *n = &d->names[at - 1];
        free(n->srcs);
        free(n->counts);
        n->srcs = srcs;
        n->counts = counts;
        n->n_srcs = n_sources;
        srcs = counts = NULL;
    }
    rc = 0;
done:
    pthread_mutex_unlock(&d->mu);
    free(srcs);
    free(counts);
    return rc;
}

int
flor_dedup_retire(flor_dedup *d, const char *file)
{
    uint32_t i, k, at = UINT32_MAX;
    size_t j;
    int referred = 0;
    pthread_mutex_lock(&d->mu);
    for (i = d->n_names; i-- > 0;) {
        if (!d->names[i].retired && strcmp(d->names[i].name, file) == 0) {
            at = i;
            break;
        }
    }
    if (at == UINT32_MAX) { /* none of its blobs is in the table */
        goto done;
    }
    if (d->names[at].refs > 0) {
        referred = 1;
        goto done;
    }
    for (j = 0; j < d->cap; j++) {
        if (d->slots[j].file == at + 1) {
            d->slots[j].file = TOMBSTONE; /* still counted in used: a rebuild clears it */
        }
    }
    for (k = 0; k < d->names[at].n_srcs; k++) {
        uint32_t s = d->names[at].srcs[k];
        if (s != UINT32_MAX) {
            name_t *n = &d->names[s];
            n->refs = n->refs > d->names[at].counts[k] ? n->refs - d->names[at].counts[k] : 0;
        }
    }
    d->names[at].retired = 1;
    d->names[at].n_srcs = 0;
done:
    pthread_mutex_unlock(&d->mu);
    return referred;
}
