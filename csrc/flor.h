/* flor.h: declarations shared by the C files of flor._core.
 *
 * One C file per concern, each depending only on the files listed above it
 * (module.c, which registers everything, depends on all of them; no two
 * files depend on each other):
 *   support.c       helpers: clock, argument checks, FormatError, torch/numpy lookups
 *   crc32c.c        CRC-32C checksums (hardware instruction when present), content hash,
 *                   the digest under state fingerprints
 *   arena.c         warm host staging buffers, reused across snapshots
 *   skeleton.c      the Ref placeholder, pickling a skeleton, rebuilding tensors
 *                   and arrays when it is unpickled
 *   walk.c          flor.snapshot(): the copy walk, and the Snapshot type; state
 *                   fingerprints (CUDA tensors through the Python module flor._cuda)
 *   dedup.c         the durable blobs of a run by content, for incremental checkpoints
 *   format.c        the checkpoint file's bytes (format.h: the layout, shared with
 *                   picklescan.c and reader.c) and its atomic writer; tags, signing
 *   picklescan.c    the opcode scan of a file's metadata pickle, run before anything
 *                   unpickles it
 *   reader.c        the verifying reader: the Mapping, header and table checks,
 *                   the earlier files a file refers to, load()
 *   materializer.c  inline / thread / fork background writers
 *   skipblock.c     the SkipBlock state machine and the adaptive checkpoint rule
 *                   (QuietSteps: a step loop's run of iterations the rule is not asked at)
 *   capture.c       output capture: the Journal of writes and the Tee that feeds it
 *   module.c        the module: registration and per-module state
 *
 * Errors, in every file: a function returning a pointer returns NULL only
 * with an exception set; one returning an int returns a negative value only
 * with an exception set (0 or more is success, and may say which).  Where
 * there is no Python error to raise (code run without the GIL), the function
 * says so in its own comment.
 */
#ifndef FLOR_H
#define FLOR_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define FLOR_ALIGN 64
#define FLOR_NAME_MAX 32
#define FLOR_MAX_NDIM 64

/* Cast any C function to PyCFunction without tripping -Wcast-function-type. */
#define FLOR_CFUNC(f) ((PyCFunction)(void (*)(void))(f))

static inline uint64_t
flor_align_up(uint64_t x)
{
    return (x + (FLOR_ALIGN - 1)) & ~(uint64_t)(FLOR_ALIGN - 1);
}

/* ------------------------------------------------------------------ */
/* Records shared by snapshots (in memory) and checkpoint files.       */

enum flor_ref_kind {
    FLOR_REF_TENSOR = 1,    /* torch.Tensor: index = entry */
    FLOR_REF_ARRAY = 2,     /* numpy.ndarray: index = entry */
    FLOR_REF_BYTEARRAY = 3, /* bytearray: index = entry */
    FLOR_REF_NAMED = 4,     /* torch dtype / layout / memory_format: payload = name */
    FLOR_REF_DEVICE = 5,    /* torch.device: payload = "cuda:0" */
    FLOR_REF_SIZE = 6,      /* torch.Size: payload = tuple of ints */
    FLOR_REF_GENERATOR = 7, /* torch.Generator: index = state entry, payload = device */
};

enum flor_entry_flags {
    FLOR_ENTRY_REQUIRES_GRAD = 1,
    FLOR_ENTRY_PARAMETER = 2,
};

/* A tensor or array: how to view one blob of bytes. */
typedef struct {
    uint8_t kind; /* FLOR_REF_TENSOR / ARRAY / BYTEARRAY */
    uint8_t flags;
    uint8_t ndim;
    uint32_t blob;
    int64_t storage_offset; /* in elements */
    int64_t *dims;          /* ndim sizes then ndim strides; NULL when ndim == 0 */
    char dtype[FLOR_NAME_MAX];  /* "float32" for torch, "<f4" for numpy */
    char device[FLOR_NAME_MAX]; /* where the source lived: "cpu", "cuda:0" */
} flor_entry;

enum flor_blob_where {
    FLOR_BLOB_HOST = 0,   /* memcpy from src */
    FLOR_BLOB_BUFFER = 1, /* PyBuffer_ToContiguous from view (needs the GIL) */
    FLOR_BLOB_CUDA = 2,   /* device-to-host copy through torch */
};

/* One contiguous run of bytes (a tensor storage, an array's data). */
typedef struct {
    uint64_t offset; /* within the arena (snapshot) or the data section (file) */
    uint64_t nbytes;
    uint32_t crc;
    uint8_t where;
    /* Only while a snapshot is being taken: */
    PyObject *owner; /* keeps the source alive */
    const char *src;
    Py_buffer *view;
    int recheck;     /* owner is a live CPU storage: re-read src before copying */
    /* Content hash (snapshots: once hashed; files: as written). */
    uint64_t hash;
    int hashed;
    uint32_t source; /* files: 0 here, k: in the k-th earlier file of the table */
    int copy;        /* loading: another blob maps the same bytes, so copy them */
    /* Fingerprint walks: the bytes the tensors met view, [lo, hi) (empty when lo >= hi),
     * for a blob reached only through tensors (spanned); the rest of a
     * storage may never have been written (a reduction's 0-d result). */
    uint64_t lo, hi;
    int spanned;
} flor_blob;

/* ------------------------------------------------------------------ */
/* Staging arenas (arena.c).                                           */

typedef struct flor_arena {
    char *base;
    size_t cap;
    pid_t owner;  /* process whose address space holds the mapping */
    int pinned;   /* registered with the CUDA driver */
    struct flor_arena *next;
} flor_arena;

typedef struct {
    flor_arena *free_list;
    size_t free_bytes;
    size_t high_water; /* largest request seen: the pool keeps 2x this */
    pid_t owner;
    uint64_t takes, fresh, fresh_bytes;
} flor_pool;

/* ------------------------------------------------------------------ */
/* Per-module state.                                                   */

typedef struct {
    PyTypeObject *SnapshotType;
    PyTypeObject *RefType;
    PyTypeObject *MappingType;
    PyTypeObject *MaterializerType;
    PyTypeObject *SkipMachineType;
    PyTypeObject *QuietStepsType;
    PyTypeObject *JournalType;
    PyTypeObject *TeeType;
    PyObject *FormatError; /* raised with (path, section, detail) */

    PyObject *kind_cache; /* {type: walk kind} */
    PyObject *rebuild;    /* the module's _rebuild function (for Ref.__reduce__) */
    PyObject *loaders;    /* {thread id: capsule of the active flor_loader} */

    /* Looked up once torch / numpy have been imported by someone else. */
    int torch_ready;
    PyObject *torch;
    PyObject *Tensor, *Parameter, *Generator, *Size;
    PyObject *dtype_t, *device_t, *layout_t, *memfmt_t;
    PyObject *strided, *uint8;
    PyObject *atom_names; /* {torch.float32: "float32", torch.strided: "strided", ...} */
    PyObject *ndarray;
    PyObject *cuda; /* flor._cuda, imported the first time a CUDA tensor is met */
    PyObject *handle_capture; /* flor.handles.capture, imported the first time a handle is met */

    /* Python helpers, looked up at module exec. */
    PyObject *copyreg_dispatch, *deepcopy, *dumps, *loads, *weakref_t;
    PyObject *Pickler, *BytesIO; /* cloudpickle.Pickler, io.BytesIO */
    PyObject *tree_safe;         /* {OrderedDict, defaultdict, Counter, deque} */

    /* Interned attribute names. */
    PyObject *s_state_dict, *s_load_state_dict, *s_deepcopy_attr, *s_reduce_ex;
    PyObject *s_setstate, *s_dict, *s_append, *s_items;
    PyObject *s_where, *s_info; /* a session's where, a journal's info (QuietSteps) */

    flor_pool pool;
} flor_state;

/* The module state of an object of one of flor's types.  Every type is
 * final (none has Py_TPFLAGS_BASETYPE), so an object's type is the type the
 * module created, and the module is the type's own. */
static inline flor_state *
flor_state_of_type(PyTypeObject *tp)
{
    return (flor_state *)PyType_GetModuleState(tp);
}

/* support.c */
int flor_torch_init(flor_state *st);   /* 0: torch not imported yet, 1: ready, -1: error */
int flor_numpy_init(flor_state *st);
PyObject *flor_format_error(flor_state *st, const char *path, const char *section, const char *fmt,
                            ...);
double flor_now(void);
int flor_check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t lo,
                     Py_ssize_t hi); /* 0, or -1 with a TypeError set */
void flor_entries_free(flor_entry *e, uint32_t n);
int flor_device_name(const char *s); /* "cpu", "cuda:0": a device torch can parse */

/* dedup.c */
typedef struct flor_dedup flor_dedup;
flor_dedup *flor_dedup_new(void);
void flor_dedup_free(flor_dedup *d);
int flor_dedup_find(flor_dedup *d, uint64_t hash, uint64_t nbytes, const char *dtype,
                    const char **file, uint64_t *offset, uint32_t *crc);
int flor_dedup_add(flor_dedup *d, uint64_t hash, uint64_t nbytes, const char *dtype,
                   const char *file, uint64_t offset, uint32_t crc);
void flor_dedup_next_generation(flor_dedup *d);
void flor_dedup_unrefer(flor_dedup *d, const char *source); /* a find's ref, not used */
int flor_dedup_wrote(flor_dedup *d, const char *file, const char *const *sources,
                     const uint32_t *src_of, uint32_t n_blobs, uint32_t n_sources, int ok);
int flor_dedup_retire(flor_dedup *d, const char *file); /* 1: a file refers to it (kept) */

/* crc32c.c */
uint32_t flor_crc32c(uint32_t crc, const void *buf, size_t len);
#define FLOR_HASH_CHUNK ((size_t)256 << 10) /* pieces of the content hash */
uint64_t flor_hash64_start(uint64_t nbytes);
uint64_t flor_hash64_update(uint64_t h, const void *piece, size_t len); /* one piece */
uint64_t flor_hash64(const void *buf, size_t len);
/* total plus the digest terms of buf's words, the first at word index first */
uint64_t flor_digest64(uint64_t total, uint64_t first, const void *buf, size_t len);
extern PyMethodDef flor_crc32c_functions[];

/* arena.c */
size_t flor_pool_charge(size_t nbytes);
flor_arena *flor_pool_take(flor_state *st, size_t nbytes, int pinned);
void flor_pool_give(flor_state *st, flor_arena *a);
void flor_pool_trim(flor_state *st, size_t keep);
void flor_arena_set_inherit(flor_arena *a, int inherit);
void flor_pool_clear(flor_state *st);
void flor_pool_release(flor_state *st); /* at module teardown: no Python calls */
extern PyMethodDef flor_arena_functions[];

/* skeleton.c: placeholders, pickling, and the active unpickling context
 * through which _rebuild turns Refs back into objects. */
typedef struct {
    const flor_entry *entries;
    const flor_blob *blobs;
    uint32_t n_entries, n_blobs;
    /* Snapshots: blob offsets are relative to `data`, bytes are copied. */
    const char *data;
    /* Files: blob b lives in the Mapping maps[b.source], at data_offs[b.source]
     * + b.offset; its CRC is checked the first time it is used. */
    PyObject **maps;
    const uint64_t *data_offs;
    char **sources;      /* names of maps[1:], for messages */
    PyObject **storages; /* per-blob cache */
    unsigned char *verified;
    PyObject *hook;      /* map_location hook, or NULL */
    int hook_failed;     /* the hook raised: its error passes through unchanged */
    const char *path;    /* for messages */
} flor_loader;

PyObject *flor_ref_new(flor_state *st, int kind, Py_ssize_t index, PyObject *payload);
extern PyType_Spec flor_ref_spec;
PyObject *flor_pickle_skeleton(flor_state *st, PyObject *skeleton, int tree);
PyObject *flor_unpickle(flor_state *st, PyObject *loads, PyObject *meta, flor_loader *ld);
extern PyMethodDef flor_skeleton_functions[];

/* walk.c */
typedef struct {
    PyObject_HEAD
    PyObject *skeleton;
    flor_entry *entries;
    flor_blob *blobs;
    uint32_t n_entries, n_blobs;
    flor_arena *arena;
    uint64_t nbytes;      /* payload bytes */
    uint64_t data_bytes;  /* payload plus 64-byte alignment padding */
    pid_t owner;
    double copy_seconds;  /* time spent copying bytes */
    int tree;             /* no object in the skeleton is referenced twice */
    int foreign;          /* holds objects copied by their own __deepcopy__ */
    PyObject *pending;    /* device-to-host copies still in flight (flor._cuda), or NULL */
} FlorSnapshot;

/* Called after the walk, before any byte is copied: may wait (backpressure).
 * Runs with the GIL held; returns -1 with an exception set to abort, 1 to
 * stop without copying (the snapshot then only knows its byte counts). */
typedef int (*flor_reserve_fn)(void *ctx, uint64_t charge); /* flor_pool_charge(data_bytes) */

/* hash: compute each host blob's content hash while copying it. */
PyObject *flor_snapshot_ex(flor_state *st, PyObject *obj, flor_reserve_fn reserve, void *ctx,
                           int hash);
/* Wait until the snapshot's device-to-host copies have landed in its arena
 * (GIL held; it is released while waiting).  Every reader of the arena
 * calls it first.  0, or -1 with an exception set. */
int flor_snapshot_wait(FlorSnapshot *s);
extern PyType_Spec flor_snapshot_spec;
extern PyMethodDef flor_walk_functions[];

/* format.c */
typedef struct {
    int err;          /* errno, or 0 */
    const char *step; /* "open", "write", "fsync", "rename", ... */
} flor_ioerr;

#define FLOR_TAG_LEN 32
enum flor_file_flags {
    FLOR_FILE_TAGGED = 1, /* the header holds the tag of what the file is for */
    FLOR_FILE_SIGNED = 2, /* the header holds an HMAC of the tag and metadata */
    FLOR_FILE_SIGNED_TABLE = 4, /* ... and of the tensor table (its blobs' checksums) */
    FLOR_FILE_FLAGS = 7,
};
/* Signs a file once its tensor table is known: 0 with FLOR_TAG_LEN bytes in
 * sig, or -1 (the callee records why).  Called without the GIL. */
typedef int (*flor_sign_fn)(void *ctx, const unsigned char *table, size_t table_len,
                            unsigned char *sig);
typedef struct {
    const unsigned char *tag; /* FLOR_TAG_LEN bytes, or NULL */
    flor_sign_fn sign;        /* signs tag, metadata and table, or NULL: unsigned */
    void *sign_ctx;
    flor_dedup *dedup;        /* refer to blobs of earlier files, or NULL */
    uint64_t written;         /* out: data bytes written into this file */
} flor_wopts;

/* Runs without the GIL: 0, or -1 with *err saying what failed (no exception). */
int flor_write_file(const char *path, const char *meta, size_t meta_len, const FlorSnapshot *s,
                    flor_wopts *opts, flor_ioerr *err);
/* signer(tag, metadata, table) -> FLOR_TAG_LEN bytes (GIL held): 0, or -1
 * with an exception set. */
int flor_sign(PyObject *signer, const unsigned char *tag, PyObject *meta,
              const unsigned char *table, size_t table_len, unsigned char *out);
int flor_tag_arg(PyObject *arg, unsigned char *out);
extern PyMethodDef flor_format_functions[];

/* picklescan.c: 0, or -1 with FormatError(path, "metadata", ...) set. */
int flor_scan_pickle(flor_state *st, const char *path, const unsigned char *p, uint64_t len);

/* reader.c */
/* A private, writable memory map of a checkpoint file. */
typedef struct {
    PyObject_HEAD
    char *base;
    size_t len;
} FlorMapping;

extern PyType_Spec flor_mapping_spec;
extern PyMethodDef flor_reader_functions[];

/* materializer.c */
extern PyType_Spec flor_materializer_spec;

/* skipblock.c */
extern PyType_Spec flor_skipmachine_spec, flor_quietsteps_spec;
int flor_skipblock_constants(PyObject *module);
extern PyMethodDef flor_skipblock_functions[];

/* capture.c */
extern PyType_Spec flor_journal_spec, flor_tee_spec;

#endif /* FLOR_H */
