/* reader.c: a checkpoint file (format version 1 or 2) read with
 * verification, and the Mapping its tensors are views of.  docs/FORMAT.md
 * describes the layout byte by byte.
 *
 *     def load(path, hook, policy):
 *         m, h, meta, table = map_checked(path)  # mmap MAP_PRIVATE; the header, meta and
 *             # table copied out, then checked: magic, version, header CRC, sections in
 *             # order ending at file_size == the file's size, meta and table CRCs
 *         entries, blobs, sources = parse_table(table)  # counts, source names, the
 *             # blobs of source 0 inside the data, every entry's dims, dtype and device
 *         scan_pickle(meta)                      # picklescan.c: before any unpickling
 *         for b in blobs sharing a region of one source, all but the first:
 *             b.copy = True                      # tensors saved apart stay apart
 *         maps = [m] + [map_checked(dirname(path) / s)[0] for s in sources]
 *         check each blob with b.source > 0 lies inside maps[b.source]'s data
 *         loads = policy(h.version, h.tag, h.sig, meta)  # the caller's trust decision
 *         with loader(entries, blobs, maps, hook):  # _rebuild() makes each tensor a view
 *             return loads(meta)                 # of its mapping, its blob's CRC checked
 *                                                # the first time it is used
 *
 * A damaged file raises FormatError(path, section, detail); Python turns it
 * into flor.CheckpointCorrupt.  Nothing is trusted before its checksum passes,
 * and every offset and size is bounds-checked before use.
 */
#include "flor.h"
#include "format.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ------------------------------------------------------------------ */
/* Mapping: a private, writable memory map of a checkpoint file.        */

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
    uint32_t version, header_size, flags, n_sources;
    uint64_t file_size, meta_off, meta_len, table_off, table_len, data_off, data_len;
    uint32_t n_blobs, n_entries, meta_crc, table_crc;
    const unsigned char *tag, *sig; /* into tag_buf / sig_buf, or NULL */
    unsigned char tag_buf[FLOR_TAG_LEN], sig_buf[FLOR_TAG_LEN];
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

/* Map `path` and check its header and the checksums of its metadata and
 * table.  Returns a new Mapping, or NULL with FormatError/OSError set.
 *
 * The mapping shows later writes to the file, so everything that decides
 * how to read the file is checked and used on private copies: the header,
 * and (when meta_out / table_out are given) the metadata and the table. */
static FlorMapping *
map_checked(flor_state *st, const char *path, header_t *h, PyObject **meta_out,
            unsigned char **table_out)
{
    FlorMapping *m = NULL, *res = NULL;
    struct stat sb;
    int fd;
    const unsigned char *b;
    unsigned char hb[HEADER_SIZE];
    PyObject *meta = NULL;
    unsigned char *table = NULL;

    memset(h, 0, sizeof(*h));
    Py_BEGIN_ALLOW_THREADS
    fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK); /* a FIFO must not block */
    Py_END_ALLOW_THREADS
    if (fd < 0 || fstat(fd, &sb) < 0) {
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
        goto cleanup;
    }
    if (!S_ISREG(sb.st_mode)) {
        errno = EISDIR;
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
        goto cleanup;
    }
    if (sb.st_size < HEADER_SIZE_V1) {
        flor_format_error(st, path, "header",
                          "the file is %lld bytes, shorter than the %d-byte header (truncated)",
                          (long long)sb.st_size, HEADER_SIZE_V1);
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
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
        goto cleanup;
    }
    /* Blobs are read front to back (checksums, then the tensors): ask the
     * kernel to read ahead, so a cold file streams instead of faulting in
     * page by page.  Advice only: failure changes nothing. */
    (void)posix_fadvise(fd, 0, (off_t)m->len, POSIX_FADV_SEQUENTIAL);
    (void)posix_fadvise(fd, 0, (off_t)m->len, POSIX_FADV_WILLNEED);
    (void)madvise(m->base, m->len, MADV_SEQUENTIAL);
    memset(hb, 0, sizeof(hb));
    memcpy(hb, m->base, m->len < HEADER_SIZE ? m->len : HEADER_SIZE);
    b = hb;
    if (memcmp(b, MAGIC, 8) != 0) {
        flor_format_error(st, path, "header", "bad magic number: not a flor checkpoint");
        goto cleanup;
    }
    h->version = get32(b + 8);
    h->header_size = get32(b + 12);
    if (h->version == FORMAT_VERSION && h->header_size == HEADER_SIZE &&
        (uint64_t)sb.st_size < HEADER_SIZE) {
        flor_format_error(st, path, "header",
                          "the file is %lld bytes, shorter than the %d-byte header (truncated)",
                          (long long)sb.st_size, HEADER_SIZE);
        goto cleanup;
    }
    if (!((h->version == 1 && h->header_size == HEADER_SIZE_V1) ||
          (h->version == FORMAT_VERSION && h->header_size == HEADER_SIZE)) ||
        (uint64_t)sb.st_size < h->header_size) {
        /* Check the version's own header CRC first when it is ours. */
        if ((uint64_t)sb.st_size >= HEADER_SIZE_V1 &&
            flor_crc32c(0, b, HEADER_SIZE_V1 - 4) != get32(b + HEADER_SIZE_V1 - 4) &&
            ((uint64_t)sb.st_size < HEADER_SIZE ||
             flor_crc32c(0, b, HEADER_SIZE - 4) != get32(b + HEADER_SIZE - 4))) {
            flor_format_error(st, path, "header", "checksum mismatch");
            goto cleanup;
        }
        flor_format_error(st, path, "header",
                          "format version %u is not supported (this flor reads versions 1 and "
                          "%u)",
                          h->version, FORMAT_VERSION);
        goto cleanup;
    }
    if (flor_crc32c(0, b, h->header_size - 4) != get32(b + h->header_size - 4)) {
        flor_format_error(st, path, "header", "checksum mismatch");
        goto cleanup;
    }
    h->file_size = get64(b + 16);
    h->meta_off = get64(b + 24);
    h->meta_len = get64(b + 32);
    h->table_off = get64(b + 40);
    h->table_len = get64(b + 48);
    h->data_off = get64(b + 56);
    h->data_len = get64(b + 64);
    h->n_blobs = get32(b + 72);
    h->n_entries = get32(b + 76);
    h->meta_crc = get32(b + 80);
    h->table_crc = get32(b + 84);
    if (h->version >= 2) {
        h->flags = get32(b + 88);
        h->n_sources = get32(b + 92);
        memcpy(h->tag_buf, b + 96, FLOR_TAG_LEN);
        memcpy(h->sig_buf, b + 128, FLOR_TAG_LEN);
        h->tag = (h->flags & FLOR_FILE_TAGGED) ? h->tag_buf : NULL;
        h->sig = (h->flags & FLOR_FILE_SIGNED) ? h->sig_buf : NULL;
    }
    /* Overflow-safe: each section lies inside file_size, in order. */
    if (h->meta_off != h->header_size || h->meta_len > h->file_size ||
        h->meta_off > h->file_size - h->meta_len || h->table_len > h->file_size ||
        h->table_off > h->file_size - h->table_len || h->table_off < h->meta_off + h->meta_len ||
        h->data_len > h->file_size || h->data_off > h->file_size - h->data_len ||
        h->data_off < h->table_off + h->table_len || h->data_off + h->data_len != h->file_size ||
        h->data_off % FLOR_ALIGN != 0 || (h->flags & ~(uint32_t)FLOR_FILE_FLAGS) != 0) {
        flor_format_error(st, path, "header", "section offsets are inconsistent");
        goto cleanup;
    }
    if ((uint64_t)sb.st_size < h->file_size) {
        flor_format_error(st, path, section_at(h, (uint64_t)sb.st_size),
                          "truncated: the header records %llu bytes, the file has %lld",
                          (unsigned long long)h->file_size, (long long)sb.st_size);
        goto cleanup;
    }
    if ((uint64_t)sb.st_size > h->file_size) {
        flor_format_error(st, path, "data",
                          "%lld unexpected bytes after the end recorded in the header",
                          (long long)sb.st_size - (long long)h->file_size);
        goto cleanup;
    }
    if (meta_out != NULL) {
        meta = PyBytes_FromStringAndSize(m->base + h->meta_off, (Py_ssize_t)h->meta_len);
        table = malloc(h->table_len ? (size_t)h->table_len : 1);
        if (meta == NULL || table == NULL) {
            if (table == NULL) {
                PyErr_NoMemory();
            }
            goto cleanup;
        }
        memcpy(table, m->base + h->table_off, (size_t)h->table_len);
    }
    if (flor_crc32c(0, meta != NULL ? PyBytes_AS_STRING(meta) : m->base + h->meta_off,
                    (size_t)h->meta_len) != h->meta_crc) {
        flor_format_error(st, path, "metadata", "checksum mismatch");
        goto cleanup;
    }
    if (flor_crc32c(0, table != NULL ? table : (unsigned char *)m->base + h->table_off,
                    (size_t)h->table_len) != h->table_crc) {
        flor_format_error(st, path, "tensor table", "checksum mismatch");
        goto cleanup;
    }
    if (meta_out != NULL) {
        *meta_out = meta;
        *table_out = table;
        meta = NULL;
        table = NULL;
    }
    res = m;
    m = NULL;
cleanup:
    if (fd >= 0) {
        close(fd);
    }
    Py_XDECREF(m);
    Py_XDECREF(meta);
    free(table);
    return res;
}

/* Names in the table are ASCII letters, digits and a few marks. */
static int
valid_name(const char *s)
{
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              strchr("_:<>|=.", c) != NULL)) {
            return 0;
        }
    }
    return 1;
}

static int
parse_table(flor_state *st, const char *path, const unsigned char *t, const header_t *h,
            flor_entry **entries_out, flor_blob **blobs_out, char ***sources_out)
{
    const unsigned char *p, *end = t + h->table_len;
    flor_entry *entries = NULL;
    flor_blob *blobs = NULL;
    char **sources = NULL;
    uint32_t i, k;
    uint64_t rec = h->version >= 2 ? BLOB_REC : BLOB_REC_V1, head = h->version >= 2 ? 16 : 8;

    if (h->table_len < head || get32(t) != h->n_blobs || get32(t + 4) != h->n_entries ||
        (h->version >= 2 &&
         (get32(t + 8) != h->n_sources || get32(t + 12) != 0 || h->n_sources > h->n_blobs)) ||
        (uint64_t)h->n_blobs * rec > h->table_len - head ||
        (uint64_t)h->n_entries * ENTRY_FIXED > h->table_len - head - (uint64_t)h->n_blobs * rec) {
        flor_format_error(st, path, "tensor table", "counts disagree with the header");
        goto error;
    }
    blobs = calloc(h->n_blobs ? h->n_blobs : 1, sizeof(flor_blob));
    entries = calloc(h->n_entries ? h->n_entries : 1, sizeof(flor_entry));
    sources = calloc((size_t)h->n_sources + 1, sizeof(char *));
    if (blobs == NULL || entries == NULL || sources == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    p = t + head;
    for (k = 0; k < h->n_sources; k++) {
        size_t len;
        if (end - p < 2 ||
            (len = (size_t)p[0] | ((size_t)p[1] << 8), (size_t)(end - p) < align8(2 + len)) ||
            !valid_source_name(p + 2, len)) {
            flor_format_error(st, path, "tensor table", "source %u is malformed", k);
            goto error;
        }
        sources[k] = strndup((const char *)p + 2, len);
        if (sources[k] == NULL) {
            PyErr_NoMemory();
            goto error;
        }
        p += align8(2 + len);
    }
    if ((uint64_t)(end - p) < (uint64_t)h->n_blobs * rec) {
        flor_format_error(st, path, "tensor table", "counts disagree with the header");
        goto error;
    }
    for (i = 0; i < h->n_blobs; i++, p += rec) {
        blobs[i].offset = get64(p);
        blobs[i].nbytes = get64(p + 8);
        blobs[i].crc = get32(p + 16);
        if (h->version >= 2) {
            blobs[i].source = get32(p + 20);
            blobs[i].hash = get64(p + 24);
        }
        if (blobs[i].source > h->n_sources) {
            flor_format_error(st, path, "tensor table", "blob %u names source %u of %u", i,
                              blobs[i].source, h->n_sources);
            goto error;
        }
        if (blobs[i].source == 0 &&
            (blobs[i].offset > h->data_len || blobs[i].nbytes > h->data_len - blobs[i].offset)) {
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
            e->kind > FLOR_REF_BYTEARRAY || (e->flags & ~3u) != 0) {
            flor_format_error(st, path, "tensor table", "entry %u is malformed", i);
            goto error;
        }
        if (e->ndim > 0) {
            e->dims = malloc(2 * (size_t)e->ndim * sizeof(int64_t));
            if (e->dims == NULL) {
                PyErr_NoMemory();
                goto error;
            }
            for (k = 0; k < 2 * (uint32_t)e->ndim; k++) {
                e->dims[k] = (int64_t)get64(p + ENTRY_FIXED + 8 * k);
                if (e->dims[k] < 0) {
                    flor_format_error(st, path, "tensor table", "entry %u has a negative size", i);
                    goto error;
                }
            }
        }
        memcpy(e->dtype, p + ENTRY_FIXED + 16 * (size_t)e->ndim, dl);
        memcpy(e->device, p + ENTRY_FIXED + 16 * (size_t)e->ndim + dl, vl);
        if (!valid_name(e->dtype) || !flor_device_name(e->device)) {
            flor_format_error(st, path, "tensor table", "entry %u has a malformed dtype or device",
                              i);
            goto error;
        }
        if (align8(need) > (size_t)(end - p)) {
            goto overrun; /* its padding would run past the table */
        }
        p += align8(need);
    }
    *entries_out = entries;
    *blobs_out = blobs;
    *sources_out = sources;
    return 0;
overrun:
    flor_format_error(st, path, "tensor table", "entry %u runs past the end of the table", i);
error:
    flor_entries_free(entries, h->n_entries);
    free(blobs);
    if (sources != NULL) {
        for (k = 0; k < h->n_sources; k++) {
            free(sources[k]);
        }
        free(sources);
    }
    return -1;
}

static int
cmp_region(const void *a, const void *b)
{
    const flor_blob *x = *(const flor_blob *const *)a, *y = *(const flor_blob *const *)b;
    if (x->source != y->source) {
        return x->source < y->source ? -1 : 1;
    }
    if (x->offset != y->offset) {
        return x->offset < y->offset ? -1 : 1;
    }
    return x < y ? -1 : (x > y);
}

/* Blobs with equal bytes may refer to one region of an earlier file; each
 * but the first is then loaded as a copy, so that no two loaded tensors
 * share memory that were apart when saved. */
static int
mark_shared_regions(flor_blob *blobs, uint32_t n)
{
    flor_blob **order;
    uint32_t i;
    if (n < 2) {
        return 0;
    }
    order = malloc((size_t)n * sizeof(*order));
    if (order == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (i = 0; i < n; i++) {
        order[i] = &blobs[i];
    }
    qsort(order, n, sizeof(*order), cmp_region);
    for (i = 1; i < n; i++) {
        if (order[i]->source != 0 && order[i]->source == order[i - 1]->source &&
            order[i]->offset == order[i - 1]->offset && order[i]->nbytes > 0) {
            order[i]->copy = 1;
        }
    }
    free(order);
    return 0;
}

/* Map the earlier files this one refers to; check each referenced range lies
 * in its data section.  maps[0] is the file itself. */
static int
map_sources(flor_state *st, const char *path, const header_t *h, char **sources, flor_blob *blobs,
            PyObject **maps, uint64_t *data_offs, uint64_t *data_lens)
{
    const char *slash = strrchr(path, '/');
    size_t dirlen = slash != NULL ? (size_t)(slash - path) + 1 : 0;
    uint32_t k, i;
    int rc = -1;
    char *full = NULL;

    for (k = 0; k < h->n_sources; k++) {
        header_t sh;
        full = malloc(dirlen + strlen(sources[k]) + 1);
        if (full == NULL) {
            PyErr_NoMemory();
            goto cleanup;
        }
        memcpy(full, path, dirlen);
        strcpy(full + dirlen, sources[k]);
        maps[k + 1] = (PyObject *)map_checked(st, full, &sh, NULL, NULL);
        if (maps[k + 1] == NULL) {
            PyObject *t, *v, *tb, *msg;
            PyErr_Fetch(&t, &v, &tb);
            PyErr_NormalizeException(&t, &v, &tb);
            msg = v != NULL ? PyObject_Str(v) : NULL;
            if (t != NULL && PyErr_GivenExceptionMatches(t, PyExc_FileNotFoundError)) {
                flor_format_error(st, path, "data",
                                  "its blobs are stored in the earlier checkpoint %s, which is "
                                  "missing",
                                  full);
            }
            else {
                flor_format_error(st, path, "data",
                                  "its blobs are stored in the earlier checkpoint %s, which "
                                  "cannot be used: %S",
                                  full, msg != NULL ? msg : Py_None);
            }
            Py_XDECREF(msg);
            Py_XDECREF(t);
            Py_XDECREF(v);
            Py_XDECREF(tb);
            goto cleanup;
        }
        data_offs[k + 1] = sh.data_off;
        data_lens[k + 1] = sh.data_len;
        free(full);
        full = NULL;
    }
    for (i = 0; i < h->n_blobs; i++) {
        const flor_blob *b = &blobs[i];
        if (b->source != 0 &&
            (b->offset > data_lens[b->source] || b->nbytes > data_lens[b->source] - b->offset)) {
            flor_format_error(st, path, "tensor table", "blob %u lies outside the data of %s", i,
                              sources[b->source - 1]);
            goto cleanup;
        }
    }
    rc = 0;
cleanup:
    free(full);
    return rc;
}

static PyObject *
load_file(flor_state *st, PyObject *path_obj, PyObject *hook, PyObject *policy)
{
    PyObject *pathb = NULL, *res = NULL, *meta = NULL, *loads = NULL, *signed_table = NULL;
    unsigned char *table = NULL;
    PyObject **maps = NULL;
    FlorMapping *m = NULL;
    flor_entry *entries = NULL;
    flor_blob *blobs = NULL;
    char **sources = NULL;
    uint64_t *data_offs = NULL, *data_lens = NULL;
    const char *path;
    const unsigned char *b;
    header_t h;
    uint32_t k;
    flor_loader ld;

    memset(&h, 0, sizeof(h));
    memset(&ld, 0, sizeof(ld));
    if (!PyUnicode_FSConverter(path_obj, &pathb)) {
        return NULL;
    }
    path = PyBytes_AS_STRING(pathb);
    m = map_checked(st, path, &h, &meta, &table);
    if (m == NULL) {
        goto cleanup;
    }
    b = (const unsigned char *)PyBytes_AS_STRING(meta);
    if (parse_table(st, path, table, &h, &entries, &blobs, &sources) < 0) {
        goto cleanup;
    }
    maps = calloc((size_t)h.n_sources + 1, sizeof(PyObject *));
    data_offs = calloc((size_t)h.n_sources + 1, sizeof(uint64_t));
    data_lens = calloc((size_t)h.n_sources + 1, sizeof(uint64_t));
    if (maps == NULL || data_offs == NULL || data_lens == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    maps[0] = Py_NewRef((PyObject *)m);
    data_offs[0] = h.data_off;
    data_lens[0] = h.data_len;
    if (flor_scan_pickle(st, path, b, h.meta_len) < 0 ||
        mark_shared_regions(blobs, h.n_blobs) < 0 ||
        map_sources(st, path, &h, sources, blobs, maps, data_offs, data_lens) < 0) {
        goto cleanup;
    }
    /* The caller decides how to unpickle, from what is not pickled: the
     * table goes with it where the signature covers it. */
    if (h.flags & FLOR_FILE_SIGNED_TABLE) {
        signed_table = PyBytes_FromStringAndSize((const char *)table, (Py_ssize_t)h.table_len);
        if (signed_table == NULL) {
            goto cleanup;
        }
    }
    loads = PyObject_CallFunction(policy, "iy#y#OO", (int)h.version, (const char *)h.tag,
                                  (Py_ssize_t)(h.tag != NULL ? FLOR_TAG_LEN : 0),
                                  (const char *)h.sig,
                                  (Py_ssize_t)(h.sig != NULL ? FLOR_TAG_LEN : 0), meta,
                                  signed_table != NULL ? signed_table : Py_None);
    if (loads == NULL) {
        goto cleanup;
    }
    ld.entries = entries;
    ld.n_entries = h.n_entries;
    ld.blobs = blobs;
    ld.n_blobs = h.n_blobs;
    ld.maps = maps;
    ld.data_offs = data_offs;
    ld.sources = sources;
    ld.hook = hook;
    ld.path = path;
    res = flor_unpickle(st, loads, meta, &ld);
cleanup:
    Py_XDECREF(loads);
    Py_XDECREF(signed_table);
    Py_XDECREF(meta);
    free(table);
    Py_XDECREF(m);
    if (maps != NULL) {
        for (k = 0; k <= h.n_sources; k++) {
            Py_XDECREF(maps[k]);
        }
    }
    if (sources != NULL) {
        for (k = 0; k < h.n_sources; k++) {
            free(sources[k]);
        }
    }
    free(sources);
    free(maps);
    free(data_offs);
    free(data_lens);
    Py_XDECREF(pathb);
    flor_entries_free(entries, h.n_entries);
    free(blobs);
    return res;
}

/* ------------------------------------------------------------------ */
/* Module functions.                                                    */

PyDoc_STRVAR(load_doc,
             "load(path, hook, policy, /)\n--\n\n"
             "Read and verify a checkpoint file and rebuild its object. Tensor data is\n"
             "memory-mapped, not copied; each blob's checksum is checked when it is\n"
             "first used. hook(storage, device) -> storage relocates each storage, or\n"
             "is None. Before anything is unpickled, policy(version, tag, signature,\n"
             "metadata, table) returns the function that unpickles the metadata (or\n"
             "raises); table is the tensor table where the signature covers it, else\n"
             "None.\n"
             "Damage raises FormatError(path, section, detail).");

static PyObject *
mod_load(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (flor_check_nargs("load", nargs, 3, 3) < 0) {
        return NULL;
    }
    return load_file((flor_state *)PyModule_GetState(module), args[0],
                     args[1] == Py_None ? NULL : args[1], args[2]);
}

PyMethodDef flor_reader_functions[] = {
    {"load", FLOR_CFUNC(mod_load), METH_FASTCALL, load_doc},
    {NULL, NULL, 0, NULL},
};
