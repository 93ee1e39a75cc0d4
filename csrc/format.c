/* format.c: the checkpoint file, written atomically and read with verification.
 * docs/FORMAT.md describes the layout byte by byte.
 *
 *     def write(path, meta, snapshot):        # no Python object touched: runs
 *         tmp = f"{path}.tmp.{pid}.{ns}"     # without the GIL, in a writer
 *         for blob in snapshot.blobs:         # thread or in a forked child
 *             pwrite(tmp, data_off + blob.offset, blob bytes); crc32c(blob)
 *         pwrite(tmp, 0, header + meta + table)   # each with its CRC-32C
 *         fsync(tmp); rename(tmp, path); fsync(dirname(path))
 *
 *     def load(path, hook):
 *         m = mmap(path, MAP_PRIVATE)         # tensors alias the page cache
 *         check magic, version, sizes, header/meta/table/blob checksums
 *         with loader(m.entries, m.blobs):    # _rebuild() builds each tensor
 *             return pickle.loads(m.meta)     # as a view of the mapping
 *
 * A damaged file raises FormatError(path, section, detail); Python turns it
 * into flor.CheckpointCorrupt.  Nothing is trusted before its checksum passes,
 * and every offset and size is bounds-checked before use.
 */
#include "flor.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define HEADER_SIZE 128
#define FORMAT_VERSION 1u
#define BLOB_REC 24
#define ENTRY_FIXED 24
#define WRITE_CHUNK ((size_t)8 << 20)

static const unsigned char MAGIC[8] = {0x89, 'F', 'L', 'R', '\r', '\n', 0x1a, '\n'};

static void
put32(unsigned char *p, uint32_t v)
{
    int i;
    for (i = 0; i < 4; i++) {
        p[i] = (unsigned char)(v >> (8 * i));
    }
}

static void
put64(unsigned char *p, uint64_t v)
{
    int i;
    for (i = 0; i < 8; i++) {
        p[i] = (unsigned char)(v >> (8 * i));
    }
}

static uint32_t
get32(const unsigned char *p)
{
    uint32_t v = 0;
    int i;
    for (i = 3; i >= 0; i--) {
        v = (v << 8) | p[i];
    }
    return v;
}

static uint64_t
get64(const unsigned char *p)
{
    uint64_t v = 0;
    int i;
    for (i = 7; i >= 0; i--) {
        v = (v << 8) | p[i];
    }
    return v;
}

static uint64_t
align8(uint64_t x)
{
    return (x + 7) & ~(uint64_t)7;
}

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

int
flor_write_file(const char *path, const char *meta, size_t meta_len, const FlorSnapshot *s,
                flor_ioerr *err)
{
    int rc = -1, fd = -1, created = 0;
    char *tmp = NULL;
    unsigned char *table = NULL, header[HEADER_SIZE];
    uint64_t table_len = 8 + (uint64_t)BLOB_REC * s->n_blobs, meta_off = HEADER_SIZE;
    uint64_t table_off, data_off, file_size;
    uint32_t i;
    unsigned char *p;
    const char *data = s->arena != NULL ? s->arena->base : NULL;
    struct timespec ts;
    size_t tmplen;

    err->err = 0;
    err->step = NULL;
    for (i = 0; i < s->n_entries; i++) {
        table_len += entry_size(&s->entries[i]);
    }
    table_off = align8(meta_off + meta_len);
    data_off = flor_align_up(table_off + table_len);
    file_size = data_off + s->data_bytes;

    table = calloc(1, (size_t)table_len);
    tmplen = strlen(path) + 64;
    tmp = malloc(tmplen);
    if (table == NULL || tmp == NULL) {
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
    p = table + 8;
    for (i = 0; i < s->n_blobs; i++) {
        const flor_blob *b = &s->blobs[i];
        uint64_t done = 0, span = flor_align_up(b->nbytes);
        uint32_t crc = 0;
        while (done < span) {
            size_t n = (size_t)(span - done < WRITE_CHUNK ? span - done : WRITE_CHUNK);
            if (done < b->nbytes) {
                uint64_t c = b->nbytes - done < n ? b->nbytes - done : n;
                crc = flor_crc32c(crc, data + b->offset + done, (size_t)c);
            }
            if (pwrite_all(fd, data + b->offset + done, n, data_off + b->offset + done) < 0) {
                err->err = errno;
                err->step = "write";
                goto cleanup;
            }
            done += n;
        }
        put64(p, b->offset);
        put64(p + 8, b->nbytes);
        put32(p + 16, crc);
        p += BLOB_REC;
    }
    put32(table, s->n_blobs);
    put32(table + 4, s->n_entries);
    for (i = 0; i < s->n_entries; i++) {
        const flor_entry *e = &s->entries[i];
        size_t dl = strlen(e->dtype), vl = strlen(e->device), k;
        p[0] = e->kind;
        p[1] = e->flags;
        p[2] = e->ndim;
        p[3] = (unsigned char)dl;
        p[4] = (unsigned char)vl;
        put32(p + 8, e->blob);
        put64(p + 16, (uint64_t)e->storage_offset);
        for (k = 0; k < 2 * (size_t)e->ndim; k++) {
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
    put64(header + 64, s->data_bytes);
    put32(header + 72, s->n_blobs);
    put32(header + 76, s->n_entries);
    put32(header + 80, flor_crc32c(0, meta, meta_len));
    put32(header + 84, flor_crc32c(0, table, (size_t)table_len));
    put32(header + 124, flor_crc32c(0, header, 124));
    if (pwrite_all(fd, (const char *)header, HEADER_SIZE, 0) < 0 ||
        pwrite_all(fd, meta, meta_len, meta_off) < 0 ||
        pwrite_all(fd, (const char *)table, (size_t)table_len, table_off) < 0) {
        err->err = errno;
        err->step = "write";
        goto cleanup;
    }
    if (s->data_bytes == 0 && ftruncate(fd, (off_t)file_size) < 0) {
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
    if (fsync_parent(path) < 0) {
        err->err = errno;
        err->step = "fsync directory";
        goto cleanup_renamed;
    }
    rc = 0;
    goto cleanup_renamed;
cleanup:
    if (fd >= 0) {
        close(fd);
    }
    if (created) {
        unlink(tmp);
    }
cleanup_renamed:
    free(tmp);
    free(table);
    return rc;
}

/* ------------------------------------------------------------------ */
/* Mapping: a private, writable memory map of a checkpoint file.        */

typedef struct {
    PyObject_HEAD
    char *base;
    size_t len;
} FlorMapping;

static void
mapping_dealloc(FlorMapping *m)
{
    PyTypeObject *tp = Py_TYPE(m);
    if (m->base != NULL) {
        munmap(m->base, m->len);
    }
    PyObject_Free(m);
    Py_DECREF(tp);
}

static int
mapping_getbuffer(FlorMapping *m, Py_buffer *view, int flags)
{
    return PyBuffer_FillInfo(view, (PyObject *)m, m->base, (Py_ssize_t)m->len, 0, flags);
}

static PyType_Slot mapping_slots[] = {
    {Py_tp_dealloc, mapping_dealloc},
    {Py_bf_getbuffer, mapping_getbuffer},
    {Py_tp_doc, "Copy-on-write memory map of a checkpoint; loaded tensors are views of it."},
    {0, NULL},
};

PyType_Spec flor_mapping_spec = {
    .name = "flor._core.Mapping",
    .basicsize = sizeof(FlorMapping),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = mapping_slots,
};

/* ------------------------------------------------------------------ */
/* Reader.                                                              */

typedef struct {
    uint64_t file_size, meta_off, meta_len, table_off, table_len, data_off, data_len;
    uint32_t n_blobs, n_entries, meta_crc, table_crc;
} header_t;

static const char *
section_at(const header_t *h, uint64_t end)
{
    if (end < h->meta_off + h->meta_len) {
        return "metadata";
    }
    if (end < h->table_off + h->table_len) {
        return "tensor table";
    }
    return "data";
}

static int
parse_table(flor_state *st, const char *path, const unsigned char *t, const header_t *h,
            flor_entry **entries_out, flor_blob **blobs_out)
{
    const unsigned char *p = t + 8, *end = t + h->table_len;
    flor_entry *entries = NULL;
    flor_blob *blobs = NULL;
    uint32_t i;

    if (h->table_len < 8 || get32(t) != h->n_blobs || get32(t + 4) != h->n_entries ||
        (uint64_t)h->n_blobs * BLOB_REC > h->table_len - 8 ||
        (uint64_t)h->n_entries * ENTRY_FIXED > h->table_len - 8 - (uint64_t)h->n_blobs * BLOB_REC) {
        flor_format_error(st, path, "tensor table", "counts disagree with the header");
        goto error;
    }
    blobs = calloc(h->n_blobs ? h->n_blobs : 1, sizeof(flor_blob));
    entries = calloc(h->n_entries ? h->n_entries : 1, sizeof(flor_entry));
    if (blobs == NULL || entries == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    for (i = 0; i < h->n_blobs; i++, p += BLOB_REC) {
        blobs[i].offset = get64(p);
        blobs[i].nbytes = get64(p + 8);
        blobs[i].crc = get32(p + 16);
        if (blobs[i].offset > h->data_len || blobs[i].nbytes > h->data_len - blobs[i].offset) {
            flor_format_error(st, path, "tensor table",
                              "blob %u (%llu bytes at %llu) lies outside the data section", i,
                              (unsigned long long)blobs[i].nbytes,
                              (unsigned long long)blobs[i].offset);
            goto error;
        }
    }
    for (i = 0; i < h->n_entries; i++) {
        flor_entry *e = &entries[i];
        size_t dl, vl, need;
        if ((size_t)(end - p) < ENTRY_FIXED) {
            goto overrun;
        }
        e->kind = p[0];
        e->flags = p[1];
        e->ndim = p[2];
        dl = p[3];
        vl = p[4];
        e->blob = get32(p + 8);
        e->storage_offset = (int64_t)get64(p + 16);
        need = ENTRY_FIXED + 16 * (size_t)e->ndim + dl + vl;
        if ((size_t)(end - p) < need) {
            goto overrun;
        }
        if (e->ndim > FLOR_MAX_NDIM || dl >= FLOR_NAME_MAX || vl >= FLOR_NAME_MAX ||
            e->blob >= h->n_blobs || e->storage_offset < 0 || e->kind < FLOR_REF_TENSOR ||
            e->kind > FLOR_REF_BYTEARRAY) {
            flor_format_error(st, path, "tensor table", "entry %u is malformed", i);
            goto error;
        }
        if (e->ndim > 0) {
            size_t k;
            e->dims = malloc(2 * (size_t)e->ndim * sizeof(int64_t));
            if (e->dims == NULL) {
                PyErr_NoMemory();
                goto error;
            }
            for (k = 0; k < 2 * (size_t)e->ndim; k++) {
                e->dims[k] = (int64_t)get64(p + ENTRY_FIXED + 8 * k);
                if (e->dims[k] < 0) {
                    flor_format_error(st, path, "tensor table", "entry %u has a negative size", i);
                    goto error;
                }
            }
        }
        memcpy(e->dtype, p + ENTRY_FIXED + 16 * (size_t)e->ndim, dl);
        memcpy(e->device, p + ENTRY_FIXED + 16 * (size_t)e->ndim + dl, vl);
        if (align8(need) > (size_t)(end - p)) {
            goto overrun; /* its padding would run past the table */
        }
        p += align8(need);
    }
    *entries_out = entries;
    *blobs_out = blobs;
    return 0;
overrun:
    flor_format_error(st, path, "tensor table", "entry %u runs past the end of the table", i);
error:
    flor_entries_free(entries, h->n_entries);
    free(blobs);
    return -1;
}

static PyObject *
load_file(flor_state *st, PyObject *path_obj, PyObject *hook)
{
    PyObject *pathb = NULL, *res = NULL, *meta = NULL;
    FlorMapping *m = NULL;
    flor_entry *entries = NULL;
    flor_blob *blobs = NULL;
    const char *path;
    const unsigned char *b;
    header_t h;
    struct stat sb;
    int fd = -1;
    uint32_t i, bad = UINT32_MAX, version;
    flor_loader ld;

    memset(&h, 0, sizeof(h));
    if (!PyUnicode_FSConverter(path_obj, &pathb)) {
        return NULL;
    }
    path = PyBytes_AS_STRING(pathb);
    Py_BEGIN_ALLOW_THREADS
    fd = open(path, O_RDONLY | O_CLOEXEC);
    Py_END_ALLOW_THREADS
    if (fd < 0) {
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path_obj);
        goto cleanup;
    }
    if (fstat(fd, &sb) < 0) {
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path_obj);
        goto cleanup;
    }
    if (!S_ISREG(sb.st_mode)) {
        errno = EISDIR;
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path_obj);
        goto cleanup;
    }
    if (sb.st_size < HEADER_SIZE) {
        flor_format_error(st, path, "header",
                          "the file is %lld bytes, shorter than the %d-byte header (truncated)",
                          (long long)sb.st_size, HEADER_SIZE);
        goto cleanup;
    }
    m = PyObject_New(FlorMapping, st->MappingType);
    if (m == NULL) {
        goto cleanup;
    }
    m->len = (size_t)sb.st_size;
    m->base = mmap(NULL, m->len, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    if (m->base == MAP_FAILED) {
        m->base = NULL;
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path_obj);
        goto cleanup;
    }
    close(fd);
    fd = -1;
    b = (const unsigned char *)m->base;

    if (memcmp(b, MAGIC, 8) != 0) {
        flor_format_error(st, path, "header", "bad magic number: not a flor checkpoint");
        goto cleanup;
    }
    if (flor_crc32c(0, b, 124) != get32(b + 124)) {
        flor_format_error(st, path, "header", "checksum mismatch");
        goto cleanup;
    }
    version = get32(b + 8);
    if (version != FORMAT_VERSION || get32(b + 12) != HEADER_SIZE) {
        flor_format_error(st, path, "header",
                          "format version %u is not supported (this flor reads version %u)",
                          version, FORMAT_VERSION);
        goto cleanup;
    }
    h.file_size = get64(b + 16);
    h.meta_off = get64(b + 24);
    h.meta_len = get64(b + 32);
    h.table_off = get64(b + 40);
    h.table_len = get64(b + 48);
    h.data_off = get64(b + 56);
    h.data_len = get64(b + 64);
    h.n_blobs = get32(b + 72);
    h.n_entries = get32(b + 76);
    h.meta_crc = get32(b + 80);
    h.table_crc = get32(b + 84);
    /* Overflow-safe: each section lies inside file_size, in order. */
    if (h.meta_off != HEADER_SIZE || h.meta_len > h.file_size ||
        h.meta_off > h.file_size - h.meta_len || h.table_len > h.file_size ||
        h.table_off > h.file_size - h.table_len || h.table_off < h.meta_off + h.meta_len ||
        h.data_len > h.file_size || h.data_off > h.file_size - h.data_len ||
        h.data_off < h.table_off + h.table_len || h.data_off + h.data_len != h.file_size ||
        h.data_off % FLOR_ALIGN != 0) {
        flor_format_error(st, path, "header", "section offsets are inconsistent");
        goto cleanup;
    }
    if ((uint64_t)sb.st_size < h.file_size) {
        flor_format_error(st, path, section_at(&h, (uint64_t)sb.st_size),
                          "truncated: the header records %llu bytes, the file has %lld",
                          (unsigned long long)h.file_size, (long long)sb.st_size);
        goto cleanup;
    }
    if ((uint64_t)sb.st_size > h.file_size) {
        flor_format_error(st, path, "data",
                          "%lld unexpected bytes after the end recorded in the header",
                          (long long)sb.st_size - (long long)h.file_size);
        goto cleanup;
    }
    if (flor_crc32c(0, b + h.meta_off, (size_t)h.meta_len) != h.meta_crc) {
        flor_format_error(st, path, "metadata", "checksum mismatch");
        goto cleanup;
    }
    if (flor_crc32c(0, b + h.table_off, (size_t)h.table_len) != h.table_crc) {
        flor_format_error(st, path, "tensor table", "checksum mismatch");
        goto cleanup;
    }
    if (parse_table(st, path, b + h.table_off, &h, &entries, &blobs) < 0) {
        goto cleanup;
    }
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < h.n_blobs; i++) {
        if (flor_crc32c(0, b + h.data_off + blobs[i].offset, (size_t)blobs[i].nbytes) !=
            blobs[i].crc) {
            bad = i;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    if (bad != UINT32_MAX) {
        flor_format_error(st, path, "data",
                          "checksum mismatch in blob %u (%llu bytes at file offset %llu)", bad,
                          (unsigned long long)blobs[bad].nbytes,
                          (unsigned long long)(h.data_off + blobs[bad].offset));
        goto cleanup;
    }
    meta = PyMemoryView_FromMemory(m->base + h.meta_off, (Py_ssize_t)h.meta_len, PyBUF_READ);
    if (meta == NULL) {
        goto cleanup;
    }
    memset(&ld, 0, sizeof(ld));
    ld.entries = entries;
    ld.n_entries = h.n_entries;
    ld.blobs = blobs;
    ld.n_blobs = h.n_blobs;
    ld.data = m->base + h.data_off;
    ld.mapping = (PyObject *)m;
    ld.mapping_offset = h.data_off;
    ld.hook = hook;
    ld.path = path;
    res = flor_unpickle(st, meta, &ld);
cleanup:
    if (fd >= 0) {
        close(fd);
    }
    Py_XDECREF(meta);
    Py_XDECREF(m);
    Py_XDECREF(pathb);
    flor_entries_free(entries, h.n_entries);
    free(blobs);
    return res;
}

/* ------------------------------------------------------------------ */
/* Module functions.                                                    */

PyDoc_STRVAR(save_doc,
             "save(obj, path, /)\n--\n\n"
             "Snapshot obj and write it to path atomically (temp file, fsync, rename,\n"
             "fsync of the directory). Returns (bytes of data, errno, step); errno is\n"
             "0 on success.");

static PyObject *
mod_save(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    flor_state *st = (flor_state *)PyModule_GetState(module);
    PyObject *snap = NULL, *meta = NULL, *path = NULL, *res = NULL;
    flor_ioerr err = {0, NULL};
    int rc;

    if (!flor_check_nargs("save", nargs, 2, 2)) {
        return NULL;
    }
    if (!PyUnicode_FSConverter(args[1], &path)) {
        return NULL;
    }
    snap = flor_snapshot_ex(st, args[0], NULL, NULL);
    if (snap == NULL) {
        goto cleanup;
    }
    meta = flor_pickle_skeleton(st, ((FlorSnapshot *)snap)->skeleton, ((FlorSnapshot *)snap)->tree);
    if (meta == NULL) {
        goto cleanup;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = flor_write_file(PyBytes_AS_STRING(path), PyBytes_AS_STRING(meta),
                         (size_t)PyBytes_GET_SIZE(meta), (FlorSnapshot *)snap, &err);
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

PyDoc_STRVAR(load_doc,
             "load(path, hook, /)\n--\n\n"
             "Read and verify a checkpoint file and rebuild its object. Tensor data is\n"
             "memory-mapped, not copied. hook(storage, device) -> storage relocates\n"
             "each storage, or is None. Damage raises FormatError(path, section, detail).");

static PyObject *
mod_load(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (!flor_check_nargs("load", nargs, 2, 2)) {
        return NULL;
    }
    return load_file((flor_state *)PyModule_GetState(module), args[0], args[1] == Py_None ? NULL : args[1]);
}

PyMethodDef flor_format_functions[] = {
    {"save", FLOR_CFUNC(mod_save), METH_FASTCALL, save_doc},
    {"load", FLOR_CFUNC(mod_load), METH_FASTCALL, load_doc},
    {NULL, NULL, 0, NULL},
};
