/* format.c: the checkpoint file's bytes and its atomic writer, format
 * version 2 (format.h holds the layout that the reader shares;
 * docs/FORMAT.md describes it byte by byte).
 *
 *     def write(path, meta, snap, tag, sign, dedup):  # touches no Python object
 *                                                # but through sign():
 *         for b in snap.blobs:                       # runs without the GIL, in a
 *             b.hash = b.hash or hash64(b.bytes)     # writer thread or a forked child
 *             ref = dedup and dedup.find(b.hash, b.nbytes, dtype of b's first entry)
 *             if ref and ref.file != basename(path):  # bytes an earlier file holds
 *                 b.source = 1 + sources.index(ref.file)  # (added once)
 *                 b.offset, b.crc = ref.offset, ref.crc
 *             else:                                  # bytes this file holds
 *                 b.source, b.offset = 0, data_len; data_len += align64(b.nbytes)
 *         tmp = open(f"{path}.tmp.{pid}.{ns}", O_EXCL)
 *         for b in snap.blobs if b.source == 0:
 *             pwrite(tmp, data_off + b.offset, b.bytes); b.crc = crc32c(b.bytes)
 *         table = counts, source names, blobs (offset, nbytes, crc, source,
 *                 hash), entries (kind, flags, sizes, strides, dtype, device)
 *         sig = sign and sign(table)                 # the signer takes the GIL
 *         header = magic, version 2, section offsets and lengths, counts,
 *                  crc32c(meta), crc32c(table), flags, tag, sig, its own CRC
 *         pwrite(tmp, 0, header + meta + table)      # 192 + meta_len, pad 8, table
 *         fsync(tmp); rename(tmp, path); fsync(dirname(path))
 *         if dedup and basename(path) can name a source:  # durable: later files
 *             dedup.add(b) for b in snap.blobs if b.source == 0  # may refer to its blobs
 *         # at the first failure: unlink(tmp), return (errno, the step that failed)
 *
 * save(obj, path, tag, signer) snapshots obj, pickles its skeleton, and
 * writes the file with the GIL released; the signer signs the tag, metadata
 * and table.
 */
#include "flor.h"
#include "format.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define WRITE_CHUNK ((size_t)8 << 20)

static size_t
entry_size(const flor_entry *e)
{
    return (size_t)align8(ENTRY_FIXED + 16 * (uint64_t)e->ndim + strlen(e->dtype) +
                          strlen(e->device));
}

/* ------------------------------------------------------------------ */
/* Writer.                                                              */

static int
pwrite_all(int fd, const char *buf, size_t len, uint64_t off)
{
    while (len > 0) {
        ssize_t n = pwrite(fd, buf, len, (off_t)off);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            return -1;
        }
        buf += n;
        len -= (size_t)n;
        off += (uint64_t)n;
    }
    return 0;
}

static int
fsync_parent(const char *path)
{
    char *dir;
    const char *slash = strrchr(path, '/');
    int fd, rc;
    if (slash == NULL) {
        dir = strdup(".");
    }
    else if (slash == path) {
        dir = strdup("/");
    }
    else {
        dir = strndup(path, (size_t)(slash - path));
    }
    if (dir == NULL) {
        errno = ENOMEM;
        return -1;
    }
    fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    free(dir);
    if (fd < 0) {
        return -1;
    }
    rc = fsync(fd);
    if (rc < 0 && errno == EINVAL) {
        rc = 0; /* some file systems cannot sync a directory */
    }
    if (close(fd) < 0 && rc == 0) {
        rc = -1;
    }
    return rc;
}

/* The dtype of the first entry that views each blob ("" for none). */
static const char **
blob_dtypes(const FlorSnapshot *s)
{
    const char **dt = calloc(s->n_blobs ? s->n_blobs : 1, sizeof(char *));
    uint32_t i;
    if (dt == NULL) {
        return NULL;
    }
    for (i = 0; i < s->n_blobs; i++) {
        dt[i] = "";
    }
    for (i = s->n_entries; i-- > 0;) {
        if (s->entries[i].blob < s->n_blobs) {
            dt[s->entries[i].blob] = s->entries[i].dtype;
        }
    }
    return dt;
}

static const char *
base_name(const char *path)
{
    const char *slash = strrchr(path, '/');
    return slash != NULL ? slash + 1 : path;
}

/* A fresh name beside path for the file while it is written.  Runs
 * without the GIL: NULL when out of memory (no exception). */
static char *
temp_name(const char *path)
{
    size_t len = strlen(path) + 64;
    char *tmp = malloc(len);
    struct timespec ts;
    if (tmp == NULL) {
        return NULL;
    }
    clock_gettime(CLOCK_REALTIME, &ts);
    snprintf(tmp, len, "%s.tmp.%ld.%lld%09ld", path, (long)getpid(), (long long)ts.tv_sec,
             (long)ts.tv_nsec);
    return tmp;
}

/* Where each part of a file goes, worked out before a byte is written.
 * Per blob: the dtype of the first entry that views it, its content hash,
 * CRC-32C and offset; src_of is 0 for a blob this file holds (the offset is
 * in its data section) and k for one that the earlier file sources[k - 1]
 * holds (the offset is in that file's data section). */
typedef struct {
    const char **dtypes, **sources;
    uint64_t *hashes, *offs;
    uint32_t *crcs, *src_of, n_sources;
    uint64_t meta_off, table_off, table_len, data_off, data_len, file_size;
    uint64_t payload; /* bytes of the blobs this file holds */
} plan_t;

static void
plan_free(plan_t *pl)
{
    free(pl->dtypes);
    free(pl->sources);
    free(pl->hashes);
    free(pl->offs);
    free(pl->crcs);
    free(pl->src_of);
}

/* Lay out the file: which blobs an earlier file of this run holds already,
 * and where; where this file's own blobs go; each section's offset and
 * length.  *pl starts zeroed; plan_free releases it either way.  Runs
 * without the GIL: 0, or -1 with *err set. */
static int
plan_file(plan_t *pl, const char *path, size_t meta_len, const FlorSnapshot *s, flor_dedup *dedup,
          flor_ioerr *err)
{
    const char *data = s->arena != NULL ? s->arena->base : NULL;
    size_t n = s->n_blobs ? s->n_blobs : 1;
    uint32_t i, k;

    pl->dtypes = blob_dtypes(s);
    pl->sources = calloc(n, sizeof(char *));
    pl->hashes = calloc(n, sizeof(uint64_t));
    pl->offs = calloc(n, sizeof(uint64_t));
    pl->crcs = calloc(n, sizeof(uint32_t));
    pl->src_of = calloc(n, sizeof(uint32_t));
    if (pl->dtypes == NULL || pl->sources == NULL || pl->hashes == NULL || pl->offs == NULL ||
        pl->crcs == NULL || pl->src_of == NULL) {
        err->err = ENOMEM;
        err->step = "allocate";
        return -1;
    }
    pl->meta_off = HEADER_SIZE;
    pl->table_len = 16 + (uint64_t)BLOB_REC * s->n_blobs;
    for (i = 0; i < s->n_blobs; i++) {
        const flor_blob *b = &s->blobs[i];
        const char *ref = NULL;
        pl->hashes[i] = b->hashed ? b->hash : flor_hash64(data + b->offset, (size_t)b->nbytes);
        if (dedup != NULL && b->nbytes > 0 &&
            flor_dedup_find(dedup, pl->hashes[i], b->nbytes, pl->dtypes[i], &ref, &pl->offs[i],
                            &pl->crcs[i]) &&
            strcmp(ref, base_name(path)) == 0) { /* never the file being replaced */
            flor_dedup_unrefer(dedup, ref);
            ref = NULL;
        }
        if (ref != NULL) {
            for (k = 0; k < pl->n_sources && strcmp(pl->sources[k], ref) != 0; k++) {
            }
            if (k == pl->n_sources) {
                pl->sources[pl->n_sources++] = ref;
                pl->table_len += align8(2 + strlen(ref));
            }
            pl->src_of[i] = k + 1;
        }
        else {
            pl->offs[i] = pl->data_len;
            pl->data_len += flor_align_up(b->nbytes);
            pl->payload += b->nbytes;
        }
    }
    for (i = 0; i < s->n_entries; i++) {
        pl->table_len += entry_size(&s->entries[i]);
    }
    pl->table_off = align8(pl->meta_off + meta_len);
    pl->data_off = flor_align_up(pl->table_off + pl->table_len);
    pl->file_size = pl->data_off + pl->data_len;
    return 0;
}

/* Write the blobs this file holds into its data section, checksumming each
 * while its bytes are in cache.  Runs without the GIL: 0, or -1 with *err
 * set. */
static int
write_blobs(int fd, const FlorSnapshot *s, plan_t *pl, flor_ioerr *err)
{
    const char *data = s->arena != NULL ? s->arena->base : NULL;
    uint32_t i;
    for (i = 0; i < s->n_blobs; i++) {
        const flor_blob *b = &s->blobs[i];
        uint64_t done = 0, span = flor_align_up(b->nbytes);
        uint32_t crc = 0;
        if (pl->src_of[i] != 0) {
            continue;
        }
        while (done < span) {
            size_t c = (size_t)(span - done < WRITE_CHUNK ? span - done : WRITE_CHUNK);
            if (done < b->nbytes) {
                uint64_t m = b->nbytes - done < c ? b->nbytes - done : c;
                crc = flor_crc32c(crc, data + b->offset + done, (size_t)m);
            }
            if (pwrite_all(fd, data + b->offset + done, c, pl->data_off + pl->offs[i] + done) < 0) {
                err->err = errno;
                err->step = "write";
                return -1;
            }
            done += c;
        }
        pl->crcs[i] = crc;
    }
    return 0;
}

/* The tensor table: counts, the names of the earlier files referred to, a
 * record per blob, then one per entry. */
static void
encode_table(unsigned char *table, const FlorSnapshot *s, const plan_t *pl)
{
    unsigned char *p;
    uint32_t i, k;
    put32(table, s->n_blobs);
    put32(table + 4, s->n_entries);
    put32(table + 8, pl->n_sources);
    p = table + 16;
    for (k = 0; k < pl->n_sources; k++) {
        size_t len = strlen(pl->sources[k]);
        p[0] = (unsigned char)(len & 0xff);
        p[1] = (unsigned char)(len >> 8);
        memcpy(p + 2, pl->sources[k], len);
        p += align8(2 + len);
    }
    for (i = 0; i < s->n_blobs; i++) {
        put64(p, pl->offs[i]);
        put64(p + 8, s->blobs[i].nbytes);
        put32(p + 16, pl->crcs[i]);
        put32(p + 20, pl->src_of[i]);
        put64(p + 24, pl->hashes[i]);
        p += BLOB_REC;
    }
    for (i = 0; i < s->n_entries; i++) {
        const flor_entry *e = &s->entries[i];
        size_t dl = strlen(e->dtype), vl = strlen(e->device);
        p[0] = e->kind;
        p[1] = e->flags;
        p[2] = e->ndim;
        p[3] = (unsigned char)dl;
        p[4] = (unsigned char)vl;
        put32(p + 8, e->blob);
        put64(p + 16, (uint64_t)e->storage_offset);
        for (k = 0; k < 2 * (uint32_t)e->ndim; k++) {
            put64(p + ENTRY_FIXED + 8 * k, (uint64_t)e->dims[k]);
        }
        memcpy(p + ENTRY_FIXED + 16 * (size_t)e->ndim, e->dtype, dl);
        memcpy(p + ENTRY_FIXED + 16 * (size_t)e->ndim + dl, e->device, vl);
        p += entry_size(e);
    }
}

/* The header: sections, counts, checksums of the metadata and the table,
 * flags, tag and signature, and its own checksum last. */
static void
encode_header(unsigned char *header, const char *meta, size_t meta_len, const unsigned char *table,
              const FlorSnapshot *s, const plan_t *pl, const flor_wopts *opts,
              const unsigned char *sig)
{
    memset(header, 0, HEADER_SIZE);
    memcpy(header, MAGIC, 8);
    put32(header + 8, FORMAT_VERSION);
    put32(header + 12, HEADER_SIZE);
    put64(header + 16, pl->file_size);
    put64(header + 24, pl->meta_off);
    put64(header + 32, meta_len);
    put64(header + 40, pl->table_off);
    put64(header + 48, pl->table_len);
    put64(header + 56, pl->data_off);
    put64(header + 64, pl->data_len);
    put32(header + 72, s->n_blobs);
    put32(header + 76, s->n_entries);
    put32(header + 80, flor_crc32c(0, meta, meta_len));
    put32(header + 84, flor_crc32c(0, table, (size_t)pl->table_len));
    put32(header + 88, (opts != NULL && opts->tag != NULL ? FLOR_FILE_TAGGED : 0) |
                           (sig != NULL ? FLOR_FILE_SIGNED | FLOR_FILE_SIGNED_TABLE : 0));
    put32(header + 92, pl->n_sources);
    if (opts != NULL && opts->tag != NULL) {
        memcpy(header + 96, opts->tag, FLOR_TAG_LEN);
    }
    if (sig != NULL) {
        memcpy(header + 128, sig, FLOR_TAG_LEN);
    }
    put32(header + HEADER_SIZE - 4, flor_crc32c(0, header, HEADER_SIZE - 4));
}

/* The file is durable: later checkpoints may refer to the blobs it holds
 * (if a reader will accept its name as a source). */
static void
remember_blobs(flor_dedup *dedup, const char *path, const FlorSnapshot *s, const plan_t *pl)
{
    const char *name = base_name(path);
    uint32_t i;
    if (dedup == NULL || !valid_source_name((const unsigned char *)name, strlen(name))) {
        return;
    }
    for (i = 0; i < s->n_blobs; i++) {
        if (pl->src_of[i] == 0 && s->blobs[i].nbytes > 0) {
            (void)flor_dedup_add(dedup, pl->hashes[i], s->blobs[i].nbytes, pl->dtypes[i], name,
                                 pl->offs[i], pl->crcs[i]);
        }
    }
    flor_dedup_next_generation(dedup);
}

int
flor_write_file(const char *path, const char *meta, size_t meta_len, const FlorSnapshot *s,
                flor_wopts *opts, flor_ioerr *err)
{
    int rc = -1, fd = -1, created = 0, renamed = 0;
    char *tmp = NULL;
    unsigned char *table = NULL, header[HEADER_SIZE], sig[FLOR_TAG_LEN];
    flor_dedup *dedup = opts != NULL ? opts->dedup : NULL;
    int is_signed = 0;
    plan_t pl;

    memset(&pl, 0, sizeof(pl));
    err->err = 0;
    err->step = NULL;
    tmp = temp_name(path);
    if (tmp == NULL) {
        err->err = ENOMEM;
        err->step = "allocate";
        goto cleanup;
    }
    if (plan_file(&pl, path, meta_len, s, dedup, err) < 0) {
        goto cleanup;
    }
    table = calloc(1, (size_t)pl.table_len);
    if (table == NULL) {
        err->err = ENOMEM;
        err->step = "allocate";
        goto cleanup;
    }
    fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) {
        err->err = errno;
        err->step = "create";
        goto cleanup;
    }
    created = 1;
    /* Data first: the table holds the checksums taken as it is written. */
    if (write_blobs(fd, s, &pl, err) < 0) {
        goto cleanup;
    }
    encode_table(table, s, &pl);
    /* Signed once the table holds the blobs' checksums: the signature
     * covers them, so no blob's bytes can change unnoticed. */
    if (opts != NULL && opts->sign != NULL) {
        if (opts->sign(opts->sign_ctx, table, (size_t)pl.table_len, sig) < 0) {
            err->err = EINVAL;
            err->step = "sign";
            goto cleanup;
        }
        is_signed = 1;
    }
    encode_header(header, meta, meta_len, table, s, &pl, opts, is_signed ? sig : NULL);
    if (pwrite_all(fd, (const char *)header, HEADER_SIZE, 0) < 0 ||
        pwrite_all(fd, meta, meta_len, pl.meta_off) < 0 ||
        pwrite_all(fd, (const char *)table, (size_t)pl.table_len, pl.table_off) < 0 ||
        (pl.data_len == 0 && ftruncate(fd, (off_t)pl.file_size) < 0)) {
        err->err = errno;
        err->step = "write";
        goto cleanup;
    }
    if (fsync(fd) < 0) {
        err->err = errno;
        err->step = "fsync";
        goto cleanup;
    }
    if (close(fd) < 0) {
        fd = -1;
        err->err = errno;
        err->step = "close";
        goto cleanup;
    }
    fd = -1;
    if (rename(tmp, path) < 0) {
        err->err = errno;
        err->step = "rename";
        goto cleanup;
    }
    created = 0;
    renamed = 1;
    if (fsync_parent(path) < 0) {
        err->err = errno;
        err->step = "fsync directory";
        goto cleanup;
    }
    remember_blobs(dedup, path, s, &pl);
    if (opts != NULL) {
        opts->written = pl.payload;
    }
    rc = 0;
cleanup:
    /* The files it refers to: kept while it is (once under its name, even
     * if a later step failed), or given back. */
    if (dedup != NULL && pl.n_sources > 0) {
        (void)flor_dedup_wrote(dedup, base_name(path), pl.sources, pl.src_of, s->n_blobs,
                               pl.n_sources, renamed);
    }
    if (fd >= 0) {
        close(fd);
    }
    if (created) {
        unlink(tmp);
    }
    free(tmp);
    free(table);
    plan_free(&pl);
    return rc;
}

/* ------------------------------------------------------------------ */
/* Module functions.                                                    */

PyDoc_STRVAR(save_doc,
             "save(obj, path, tag=None, signer=None, /)\n--\n\n"
             "Snapshot obj and write it to path atomically (temp file, fsync, rename,\n"
             "fsync of the directory). tag (32 bytes) goes into the header;\n"
             "signer(tag, metadata, table) -> 32 bytes signs it. Returns (bytes of\n"
             "data, errno, step); errno is 0 on success.");

int
flor_sign(PyObject *signer, const unsigned char *tag, PyObject *meta, const unsigned char *table,
          size_t table_len, unsigned char *out)
{
    PyObject *r;
    int rc = -1;
    r = PyObject_CallFunction(signer, "y#Oy#", (const char *)tag,
                              (Py_ssize_t)(tag != NULL ? FLOR_TAG_LEN : 0), meta,
                              (const char *)table, (Py_ssize_t)table_len);
    if (r == NULL) {
        return -1;
    }
    if (!PyBytes_Check(r) || PyBytes_GET_SIZE(r) != FLOR_TAG_LEN) {
        PyErr_SetString(PyExc_ValueError, "a checkpoint signer must return 32 bytes");
        goto cleanup;
    }
    memcpy(out, PyBytes_AS_STRING(r), FLOR_TAG_LEN);
    rc = 0;
cleanup:
    Py_DECREF(r);
    return rc;
}

/* A 32-byte tag argument, or None. */
int
flor_tag_arg(PyObject *arg, unsigned char *out)
{
    if (arg == Py_None) {
        return 0;
    }
    if (!PyBytes_Check(arg) || PyBytes_GET_SIZE(arg) != FLOR_TAG_LEN) {
        PyErr_SetString(PyExc_TypeError, "a checkpoint tag must be 32 bytes or None");
        return -1;
    }
    memcpy(out, PyBytes_AS_STRING(arg), FLOR_TAG_LEN);
    return 1;
}

typedef struct {
    PyObject *signer, *meta;
    const unsigned char *tag;
} save_signer;

/* flor_sign_fn for save(): an error stays set for save() to raise. */
static int
save_sign(void *ctx, const unsigned char *table, size_t table_len, unsigned char *sig)
{
    save_signer *ss = ctx;
    PyGILState_STATE g = PyGILState_Ensure();
    int rc = flor_sign(ss->signer, ss->tag, ss->meta, table, table_len, sig);
    PyGILState_Release(g);
    return rc;
}

static PyObject *
mod_save(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    flor_state *st = (flor_state *)PyModule_GetState(module);
    PyObject *snap = NULL, *meta = NULL, *path = NULL, *res = NULL;
    flor_ioerr err = {0, NULL};
    flor_wopts opts;
    save_signer ss;
    unsigned char tag[FLOR_TAG_LEN];
    int has_tag = 0;

    memset(&opts, 0, sizeof(opts));
    if (flor_check_nargs("save", nargs, 2, 4) < 0) {
        return NULL;
    }
    if (nargs > 2 && (has_tag = flor_tag_arg(args[2], tag)) < 0) {
        return NULL;
    }
    if (!PyUnicode_FSConverter(args[1], &path)) {
        return NULL;
    }
    snap = flor_snapshot_ex(st, args[0], NULL, NULL, 0);
    if (snap == NULL || flor_snapshot_wait((FlorSnapshot *)snap) < 0) {
        goto cleanup;
    }
    meta = flor_pickle_skeleton(st, ((FlorSnapshot *)snap)->skeleton, ((FlorSnapshot *)snap)->tree);
    if (meta == NULL) {
        goto cleanup;
    }
    opts.tag = has_tag ? tag : NULL;
    if (nargs > 3 && args[3] != Py_None) {
        ss.signer = args[3];
        ss.meta = meta;
        ss.tag = opts.tag;
        opts.sign = save_sign;
        opts.sign_ctx = &ss;
    }
    Py_BEGIN_ALLOW_THREADS
    /* What failed, if anything, is in err. */
    flor_write_file(PyBytes_AS_STRING(path), PyBytes_AS_STRING(meta),
                    (size_t)PyBytes_GET_SIZE(meta), (FlorSnapshot *)snap, &opts, &err);
    Py_END_ALLOW_THREADS
    if (PyErr_Occurred()) {
        goto cleanup; /* the signer raised */
    }
    res = Py_BuildValue("(Kis)", (unsigned long long)((FlorSnapshot *)snap)->nbytes, err.err,
                        err.step != NULL ? err.step : "");
cleanup:
    Py_XDECREF(path);
    Py_XDECREF(meta);
    Py_XDECREF(snap);
    return res;
}

PyMethodDef flor_format_functions[] = {
    {"save", FLOR_CFUNC(mod_save), METH_FASTCALL, save_doc},
    {NULL, NULL, 0, NULL},
};
