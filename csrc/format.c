/* format.c: the checkpoint file's bytes (format.h holds the layout shared
 * with the reader) and its atomic writer.  docs/FORMAT.md describes the
 * layout byte by byte.
 *
 *     def write(path, meta, snapshot):        # no Python object touched: runs
 *         tmp = f"{path}.tmp.{pid}.{ns}"     # without the GIL, in a writer
 *         for blob in snapshot.blobs:         # thread or in a forked child
 *             pwrite(tmp, data_off + blob.offset, blob bytes); crc32c(blob)
 *         pwrite(tmp, 0, header + meta + table)   # each with its CRC-32C
 *         fsync(tmp); rename(tmp, path); fsync(dirname(path))
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

int
flor_write_file(const char *path, const char *meta, size_t meta_len, const FlorSnapshot *s,
                flor_wopts *opts, flor_ioerr *err)
{
    int rc = -1, fd = -1, created = 0;
    char *tmp = NULL;
    unsigned char *table = NULL, header[HEADER_SIZE];
    const char **dtypes = NULL, **ref_file = NULL, **sources = NULL;
    uint64_t *hashes = NULL, *offs = NULL;
    uint32_t *crcs = NULL, *src_of = NULL, n_sources = 0;
    uint64_t table_len = 16 + (uint64_t)BLOB_REC * s->n_blobs, meta_off = HEADER_SIZE;
    uint64_t table_off, data_off, data_len = 0, file_size, payload = 0;
    uint32_t i, k;
    unsigned char *p;
    const char *data = s->arena != NULL ? s->arena->base : NULL;
    flor_dedup *dedup = opts != NULL ? opts->dedup : NULL;
    struct timespec ts;
    size_t tmplen, n = s->n_blobs ? s->n_blobs : 1;

    err->err = 0;
    err->step = NULL;
    dtypes = blob_dtypes(s);
    ref_file = calloc(n, sizeof(char *));
    sources = calloc(n, sizeof(char *));
    hashes = calloc(n, sizeof(uint64_t));
    offs = calloc(n, sizeof(uint64_t));
    crcs = calloc(n, sizeof(uint32_t));
    src_of = calloc(n, sizeof(uint32_t));
    tmplen = strlen(path) + 64;
    tmp = malloc(tmplen);
    if (dtypes == NULL || ref_file == NULL || sources == NULL || hashes == NULL || offs == NULL ||
        crcs == NULL || src_of == NULL || tmp == NULL) {
        err->err = ENOMEM;
        err->step = "allocate";
        goto cleanup;
    }
    /* Which blobs an earlier file of this run holds already, and where. */
    for (i = 0; i < s->n_blobs; i++) {
        const flor_blob *b = &s->blobs[i];
        hashes[i] = b->hashed ? b->hash : flor_hash64(data + b->offset, (size_t)b->nbytes);
        if (dedup != NULL && b->nbytes > 0 &&
            flor_dedup_find(dedup, hashes[i], b->nbytes, dtypes[i], &ref_file[i], &offs[i],
                            &crcs[i]) &&
            strcmp(ref_file[i], base_name(path)) != 0) { /* never the file being replaced */
            for (k = 0; k < n_sources && strcmp(sources[k], ref_file[i]) != 0; k++) {
            }
            if (k == n_sources) {
                sources[n_sources++] = ref_file[i];
                table_len += align8(2 + strlen(ref_file[i]));
            }
            src_of[i] = k + 1;
        }
        else {
            offs[i] = data_len;
            data_len += flor_align_up(b->nbytes);
            payload += b->nbytes;
        }
    }
    for (i = 0; i < s->n_entries; i++) {
        table_len += entry_size(&s->entries[i]);
    }
    table_off = align8(meta_off + meta_len);
    data_off = flor_align_up(table_off + table_len);
    file_size = data_off + data_len;
    table = calloc(1, (size_t)table_len);
    if (table == NULL) {
        err->err = ENOMEM;
        err->step = "allocate";
        goto cleanup;
    }
    clock_gettime(CLOCK_REALTIME, &ts);
    snprintf(tmp, tmplen, "%s.tmp.%ld.%lld%09ld", path, (long)getpid(), (long long)ts.tv_sec,
             (long)ts.tv_nsec);
    fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) {
        err->err = errno;
        err->step = "create";
        goto cleanup;
    }
    created = 1;

    /* Data first, checksumming each blob while its bytes are in cache. */
    for (i = 0; i < s->n_blobs; i++) {
        const flor_blob *b = &s->blobs[i];
        uint64_t done = 0, span = flor_align_up(b->nbytes);
        uint32_t crc = 0;
        if (src_of[i] != 0) {
            continue;
        }
        while (done < span) {
            size_t c = (size_t)(span - done < WRITE_CHUNK ? span - done : WRITE_CHUNK);
            if (done < b->nbytes) {
                uint64_t m = b->nbytes - done < c ? b->nbytes - done : c;
                crc = flor_crc32c(crc, data + b->offset + done, (size_t)m);
            }
            if (pwrite_all(fd, data + b->offset + done, c, data_off + offs[i] + done) < 0) {
                err->err = errno;
                err->step = "write";
                goto cleanup;
            }
            done += c;
        }
        crcs[i] = crc;
    }
    put32(table, s->n_blobs);
    put32(table + 4, s->n_entries);
    put32(table + 8, n_sources);
    p = table + 16;
    for (k = 0; k < n_sources; k++) {
        size_t len = strlen(sources[k]);
        p[0] = (unsigned char)(len & 0xff);
        p[1] = (unsigned char)(len >> 8);
        memcpy(p + 2, sources[k], len);
        p += align8(2 + len);
    }
    for (i = 0; i < s->n_blobs; i++) {
        put64(p, offs[i]);
        put64(p + 8, s->blobs[i].nbytes);
        put32(p + 16, crcs[i]);
        put32(p + 20, src_of[i]);
        put64(p + 24, hashes[i]);
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

    memset(header, 0, sizeof(header));
    memcpy(header, MAGIC, 8);
    put32(header + 8, FORMAT_VERSION);
    put32(header + 12, HEADER_SIZE);
    put64(header + 16, file_size);
    put64(header + 24, meta_off);
    put64(header + 32, meta_len);
    put64(header + 40, table_off);
    put64(header + 48, table_len);
    put64(header + 56, data_off);
    put64(header + 64, data_len);
    put32(header + 72, s->n_blobs);
    put32(header + 76, s->n_entries);
    put32(header + 80, flor_crc32c(0, meta, meta_len));
    put32(header + 84, flor_crc32c(0, table, (size_t)table_len));
    put32(header + 88, (opts != NULL && opts->tag != NULL ? FLOR_FILE_TAGGED : 0) |
                           (opts != NULL && opts->sig != NULL ? FLOR_FILE_SIGNED : 0));
    put32(header + 92, n_sources);
    if (opts != NULL && opts->tag != NULL) {
        memcpy(header + 96, opts->tag, FLOR_TAG_LEN);
    }
    if (opts != NULL && opts->sig != NULL) {
        memcpy(header + 128, opts->sig, FLOR_TAG_LEN);
    }
    put32(header + HEADER_SIZE - 4, flor_crc32c(0, header, HEADER_SIZE - 4));
    if (pwrite_all(fd, (const char *)header, HEADER_SIZE, 0) < 0 ||
        pwrite_all(fd, meta, meta_len, meta_off) < 0 ||
        pwrite_all(fd, (const char *)table, (size_t)table_len, table_off) < 0) {
        err->err = errno;
        err->step = "write";
        goto cleanup;
    }
    if (data_len == 0 && ftruncate(fd, (off_t)file_size) < 0) {
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
    if (fsync_parent(path) < 0) {
        err->err = errno;
        err->step = "fsync directory";
        goto cleanup;
    }
    /* Durable: later checkpoints may refer to this file's blobs (if a reader
     * will accept its name as a source). */
    if (dedup != NULL &&
        valid_source_name((const unsigned char *)base_name(path), strlen(base_name(path)))) {
        for (i = 0; i < s->n_blobs; i++) {
            if (src_of[i] == 0 && s->blobs[i].nbytes > 0) {
                (void)flor_dedup_add(dedup, hashes[i], s->blobs[i].nbytes, dtypes[i],
                                     base_name(path), offs[i], crcs[i]);
            }
        }
        flor_dedup_next_generation(dedup);
    }
    if (opts != NULL) {
        opts->written = payload;
    }
    rc = 0;
cleanup:
    if (fd >= 0) {
        close(fd);
    }
    if (created) {
        unlink(tmp);
    }
    free(tmp);
    free(table);
    free(dtypes);
    free(ref_file);
    free(sources);
    free(hashes);
    free(offs);
    free(crcs);
    free(src_of);
    return rc;
}

/* ------------------------------------------------------------------ */
/* Module functions.                                                    */

PyDoc_STRVAR(save_doc,
             "save(obj, path, tag=None, signer=None, /)\n--\n\n"
             "Snapshot obj and write it to path atomically (temp file, fsync, rename,\n"
             "fsync of the directory). tag (32 bytes) goes into the header;\n"
             "signer(tag, metadata) -> 32 bytes signs it. Returns (bytes of data,\n"
             "errno, step); errno is 0 on success.");

/* The signature of a file's metadata: signer(tag, meta) -> 32 bytes. */
int
flor_sign(PyObject *signer, const unsigned char *tag, PyObject *meta, unsigned char *out)
{
    PyObject *r;
    int rc = -1;
    r = PyObject_CallFunction(signer, "y#O", (const char *)tag,
                              (Py_ssize_t)(tag != NULL ? FLOR_TAG_LEN : 0), meta);
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

static PyObject *
mod_save(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    flor_state *st = (flor_state *)PyModule_GetState(module);
    PyObject *snap = NULL, *meta = NULL, *path = NULL, *res = NULL;
    flor_ioerr err = {0, NULL};
    flor_wopts opts;
    unsigned char tag[FLOR_TAG_LEN], sig[FLOR_TAG_LEN];
    int rc, has_tag = 0;

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
        if (flor_sign(args[3], opts.tag, meta, sig) < 0) {
            goto cleanup;
        }
        opts.sig = sig;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = flor_write_file(PyBytes_AS_STRING(path), PyBytes_AS_STRING(meta),
                         (size_t)PyBytes_GET_SIZE(meta), (FlorSnapshot *)snap, &opts, &err);
    Py_END_ALLOW_THREADS
    (void)rc;
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
