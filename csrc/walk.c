/* walk.c: flor.snapshot(obj), an isolated copy of obj that shares no mutable
 * memory with it, and the reverse step that rebuilds objects from a copy.
 *
 *     def snapshot(obj):
 *         skeleton = copy(obj)                # containers copied, atoms shared,
 *                                             # tensors and arrays -> Ref(i)
 *         arena = pool.take(sum(aligned blob sizes))   # GPU blobs first
 *         with nogil: memcpy every host blob into the arena
 *         pending = flor._cuda.copy(arena, GPU blobs)  # queued, not waited for
 *         return Snapshot(skeleton, entries, blobs, arena, pending)
 *
 *     snapshot.restore(), a writer, flor.save: pending.wait() before the
 *     arena is read; a snapshot dropped early waits before its arena is reused
 *
 *     def copy(x):                            # the walk
 *         atom (None, bool, int, float, str, bytes, type, function) -> x
 *         seen before (memo on identity)      -> the same copy
 *         dict / list / tuple / set           -> walked item by item
 *         torch.Tensor, nn.Parameter          -> Ref; bytes staged once per storage
 *         numpy.ndarray, bytearray            -> Ref; bytes staged
 *         torch dtype / device / Size / Generator -> Ref (no torch code in a writer child)
 *         has state_dict() and load_state_dict()  -> copy(x.state_dict())
 *         has __deepcopy__                    -> copy.deepcopy(x); where that is x
 *                                                itself and x a known handle, its Handle
 *         anything else                       -> rebuilt from copy(x.__reduce_ex__(4))
 *
 * The memo keeps shared and tied tensors shared (one blob per storage, each
 * tensor keeps its dtype, shape, strides and offset) and makes cycles safe.
 * An object whose reference count is 1 is reachable along one path only, so
 * it is not memoised: a dict of a million small lists costs no memo traffic.
 * When no object was reached twice the skeleton is a tree, and the writer
 * pickles it without the pickler's memo (several times faster).
 * The garbage collector is paused during the walk, and copied containers that
 * hold only atoms are untracked: the skeleton is private and never mutated.
 */
#include "flor.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* ------------------------------------------------------------------ */
/* Pointer-keyed open-addressing map.                                   */

typedef struct {
    uintptr_t *keys;
    uintptr_t *vals;
    size_t cap; /* power of two, or 0 */
    size_t n;
} pmap;

static inline size_t
pmap_hash(uintptr_t k)
{
    uint64_t x = (uint64_t)k;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return (size_t)x;
}

static int
pmap_get(const pmap *m, uintptr_t k, uintptr_t *v)
{
    size_t i;
    if (m->cap == 0) {
        return 0;
    }
    for (i = pmap_hash(k) & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        if (m->keys[i] == k) {
            *v = m->vals[i];
            return 1;
        }
        if (m->keys[i] == 0) {
            return 0;
        }
    }
}

static int pmap_put(pmap *m, uintptr_t k, uintptr_t v);

static int
pmap_grow(pmap *m)
{
    pmap n = {0};
    size_t i;
    n.cap = m->cap ? m->cap * 2 : 64;
    n.keys = calloc(n.cap, sizeof(uintptr_t));
    n.vals = calloc(n.cap, sizeof(uintptr_t));
    if (n.keys == NULL || n.vals == NULL) {
        free(n.keys);
        free(n.vals);
        PyErr_NoMemory();
        return -1;
    }
    for (i = 0; i < m->cap; i++) {
        if (m->keys[i] != 0) {
            (void)pmap_put(&n, m->keys[i], m->vals[i]);
        }
    }
    free(m->keys);
    free(m->vals);
    *m = n;
    return 0;
}

static int
pmap_put(pmap *m, uintptr_t k, uintptr_t v)
{
    size_t i;
    if ((m->n + 1) * 2 > m->cap && pmap_grow(m) < 0) {
        return -1;
    }
    for (i = pmap_hash(k) & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        if (m->keys[i] == 0 || m->keys[i] == k) {
            if (m->keys[i] == 0) {
                m->n++;
            }
            m->keys[i] = k;
            m->vals[i] = v;
            return 0;
        }
    }
}

static void
pmap_free(pmap *m)
{
    free(m->keys);
    free(m->vals);
    memset(m, 0, sizeof(*m));
}

/* ------------------------------------------------------------------ */
/* The walker.                                                          */

enum walk_kind {
    K_ATOM = 1,
    K_TENSOR,
    K_NAMED,
    K_DEVICE,
    K_SIZE,
    K_GENERATOR,
    K_NDARRAY,
    K_BYTEARRAY,
    K_SET,
    K_FROZENSET,
    K_STATEFUL,
    K_DEEPCOPY,
    K_REDUCE,
};

typedef struct {
    flor_state *st;
    pmap memo;     /* id(original) -> copy */
    pmap storages; /* tensor StorageImpl address -> blob index + 1 */
    PyObject *keep; /* strong refs for memo keys and values */
    PyObject *path; /* segments gathered while an error unwinds */
    flor_entry *entries;
    flor_blob *blobs;
    uint32_t n_entries, cap_entries, n_blobs, cap_blobs;
    int any_cuda;
    int not_tree; /* an object may appear twice in the skeleton */
    int foreign;  /* holds a copy.deepcopy result (a class's own, or deepcopy_instead) */
    PyObject *deep_memo; /* copy.deepcopy's memo, shared by deepcopy_instead's calls */
    int spans;    /* find the bytes each storage's tensors view (fingerprints) */
} walker;

static PyObject *walk(walker *w, PyObject *o, int shared);
static PyObject *handle_capture(flor_state *st);

static inline int
is_atom(PyObject *o)
{
    PyTypeObject *tp = Py_TYPE(o);
    return tp == &PyLong_Type || tp == &PyUnicode_Type || tp == &PyFloat_Type || o == Py_None ||
           tp == &PyBool_Type || tp == &PyBytes_Type;
}

/* Walk an item reached through a borrowed reference from its container. */
static inline PyObject *
walk_child(walker *w, PyObject *item)
{
    PyObject *r;
    int shared;
    if (is_atom(item)) {
        return Py_NewRef(item);
    }
    shared = Py_REFCNT(item) > 1;
    Py_INCREF(item);
    r = walk(w, item, shared);
    Py_DECREF(item);
    return r;
}

/* Record a path segment while an exception propagates. */
static void
path_push(walker *w, const char *fmt, ...)
{
    PyObject *type, *value, *tb, *seg;
    va_list va;
    PyErr_Fetch(&type, &value, &tb);
    va_start(va, fmt);
    seg = PyUnicode_FromFormatV(fmt, va);
    va_end(va);
    if (seg == NULL || PyList_Append(w->path, seg) < 0) {
        PyErr_Clear();
    }
    Py_XDECREF(seg);
    PyErr_Restore(type, value, tb);
}

static int
memo_put(walker *w, PyObject *orig, PyObject *copy)
{
    if (PyList_Append(w->keep, orig) < 0 || PyList_Append(w->keep, copy) < 0) {
        return -1;
    }
    return pmap_put(&w->memo, (uintptr_t)orig, (uintptr_t)copy);
}

/* Atoms and Refs cannot take part in a reference cycle. */
static inline int
is_leaf_copy(walker *w, PyObject *o)
{
    return is_atom(o) || Py_TYPE(o) == w->st->RefType;
}

/* Append one zeroed element to a growable array; returns its index or -1. */
static Py_ssize_t
grow(void **items, uint32_t *n, uint32_t *cap, size_t size)
{
    if (*n == *cap) {
        uint32_t c = *cap ? *cap * 2 : 16;
        void *p = realloc(*items, (size_t)c * size);
        if (p == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        *items = p;
        *cap = c;
    }
    memset((char *)*items + (size_t)*n * size, 0, size);
    return (*n)++;
}

static Py_ssize_t
add_entry(walker *w)
{
    return grow((void **)&w->entries, &w->n_entries, &w->cap_entries, sizeof(flor_entry));
}

static Py_ssize_t
add_blob(walker *w)
{
    return grow((void **)&w->blobs, &w->n_blobs, &w->cap_blobs, sizeof(flor_blob));
}

static int
set_name(char *dst, PyObject *name, const char *what)
{
    Py_ssize_t len;
    const char *s = PyUnicode_AsUTF8AndSize(name, &len);
    if (s == NULL) {
        return -1;
    }
    if (len >= FLOR_NAME_MAX) {
        PyErr_Format(PyExc_ValueError, "flor.snapshot: %s name %R is too long", what, name);
        return -1;
    }
    memcpy(dst, s, (size_t)len + 1);
    return 0;
}

static int
fill_dims(flor_entry *e, PyObject *shape, PyObject *stride)
{
    Py_ssize_t nd = PyTuple_GET_SIZE(shape), i;
    if (nd > FLOR_MAX_NDIM || (stride != NULL && PyTuple_GET_SIZE(stride) != nd)) {
        PyErr_SetString(PyExc_ValueError, "flor.snapshot: unsupported number of dimensions");
        return -1;
    }
    e->ndim = (uint8_t)nd;
    if (nd == 0) {
        return 0;
    }
    e->dims = malloc(2 * (size_t)nd * sizeof(int64_t));
    if (e->dims == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (i = 0; i < nd; i++) {
        e->dims[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
        if (stride != NULL) {
            e->dims[nd + i] = PyLong_AsLongLong(PyTuple_GET_ITEM(stride, i));
        }
    }
    if (stride == NULL) { /* C-contiguous, in elements */
        int64_t s = 1;
        for (i = nd - 1; i >= 0; i--) {
            e->dims[nd + i] = s;
            s *= e->dims[i];
        }
    }
    return PyErr_Occurred() ? -1 : 0;
}

/* Find or add the blob holding a tensor's storage. */
static Py_ssize_t
tensor_blob(walker *w, int is_cpu, int is_cuda, PyObject *storage)
{
    Py_ssize_t idx = -1;
    uintptr_t key, found;
    PyObject *cdata = NULL, *nbytes = NULL, *ptr = NULL, *host = NULL;
    flor_blob *b;

    cdata = PyObject_GetAttrString(storage, "_cdata");
    if (cdata == NULL) {
        goto cleanup;
    }
    key = (uintptr_t)PyLong_AsVoidPtr(cdata);
    if (PyErr_Occurred()) {
        goto cleanup;
    }
    if (pmap_get(&w->storages, key, &found)) {
        idx = (Py_ssize_t)found - 1;
        goto cleanup;
    }
    nbytes = PyObject_CallMethod(storage, "nbytes", NULL);
    if (nbytes == NULL) {
        goto cleanup;
    }
    if (is_cpu) {
        host = Py_NewRef(storage);
    }
    else if (!is_cuda) {
        /* Another accelerator: a synchronous copy to the host.  The source
         * stays referenced so that its address (the memo key) is not reused. */
        host = PyObject_CallMethod(storage, "cpu", NULL);
        if (host == NULL || PyList_Append(w->keep, storage) < 0) {
            goto cleanup;
        }
    }
    if (host != NULL) {
        ptr = PyObject_CallMethod(host, "data_ptr", NULL);
        if (ptr == NULL) {
            goto cleanup;
        }
    }
    idx = add_blob(w);
    if (idx < 0) {
        goto cleanup;
    }
    b = &w->blobs[idx];
    b->nbytes = PyLong_AsUnsignedLongLong(nbytes);
    if (host != NULL) {
        b->where = FLOR_BLOB_HOST;
        b->src = (const char *)PyLong_AsVoidPtr(ptr);
        b->owner = Py_NewRef(host);
        b->recheck = is_cpu;
    }
    else {
        b->where = FLOR_BLOB_CUDA;
        b->owner = Py_NewRef(storage);
        w->any_cuda = 1;
    }
    if (PyErr_Occurred() || pmap_put(&w->storages, key, (uintptr_t)idx + 1) < 0) {
        idx = -1;
        goto cleanup;
    }
cleanup:
    Py_XDECREF(cdata);
    Py_XDECREF(nbytes);
    Py_XDECREF(ptr);
    Py_XDECREF(host);
    return idx;
}

/* Widen the span of e's blob to the bytes the tensor t views: from its
 * storage offset to its last element, or none when it has no element. */
static int
span_tensor(walker *w, PyObject *t, const flor_entry *e)
{
    flor_blob *b = &w->blobs[e->blob];
    PyObject *r = PyObject_CallMethod(t, "element_size", NULL);
    long long es = r == NULL ? -1 : PyLong_AsLongLong(r);
    int64_t last = e->storage_offset;
    uint8_t i;
    Py_XDECREF(r);
    if (es < 0) {
        return -1;
    }
    if (!b->spanned) {
        b->spanned = 1;
        b->lo = UINT64_MAX;
        b->hi = 0;
    }
    for (i = 0; i < e->ndim; i++) {
        if (e->dims[i] == 0) {
            return 0;
        }
        last += (e->dims[i] - 1) * e->dims[e->ndim + i];
    }
    if (e->storage_offset < 0 || last < e->storage_offset) {
        b->lo = 0; /* not a plain view (cannot happen with torch's strides): all of it */
        b->hi = b->nbytes;
        return 0;
    }
    if ((uint64_t)e->storage_offset * (uint64_t)es < b->lo) {
        b->lo = (uint64_t)e->storage_offset * (uint64_t)es;
    }
    if ((uint64_t)(last + 1) * (uint64_t)es > b->hi) {
        b->hi = (uint64_t)(last + 1) * (uint64_t)es;
    }
    if (b->hi > b->nbytes) {
        b->hi = b->nbytes;
    }
    return 0;
}

static PyObject *
walk_tensor(walker *w, PyObject *t)
{
    flor_state *st = w->st;
    PyObject *const orig = t;
    const char *nm;
    PyObject *res = NULL, *layout = NULL, *dtype = NULL, *name = NULL, *resolved = NULL;
    PyObject *flag = NULL;
    PyObject *storage = NULL, *shape = NULL, *stride = NULL, *offset = NULL, *device = NULL;
    PyObject *devstr = NULL, *cls = Py_None;
    int is_cpu, is_cuda = 0, rg;
    Py_ssize_t bidx, eidx;
    flor_entry *e;

    layout = PyObject_GetAttrString(t, "layout");
    if (layout == NULL) {
        goto cleanup;
    }
    if (layout != st->strided) {
        PyErr_Format(PyExc_TypeError,
                     "flor.snapshot copies dense tensors only; got a tensor with layout %R "
                     "(convert it with .to_dense() before checkpointing)",
                     layout);
        goto cleanup;
    }
    dtype = PyObject_GetAttrString(t, "dtype");
    if (dtype == NULL) {
        goto cleanup;
    }
    name = PyDict_GetItemWithError(st->atom_names, dtype);
    if (name == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_TypeError, "flor.snapshot: unsupported tensor dtype %R", dtype);
        }
        goto cleanup;
    }
    Py_INCREF(name);
    nm = PyUnicode_AsUTF8(name);
    if (nm == NULL) {
        goto cleanup;
    }
    if (nm[0] == 'q') {
        /* qint8, quint8, ...: the bytes alone lose scale and zero point. */
        PyErr_Format(PyExc_TypeError,
                     "flor.snapshot does not copy quantized tensors (dtype %s); "
                     "checkpoint t.dequantize() or the int_repr() and its quantization parameters",
                     nm);
        goto cleanup;
    }
    /* A lazily negated (any dtype, e.g. z.conj().imag) or conjugated
     * (complex) view: its storage bytes alone have the wrong values, so
     * copy the resolved values.  Both calls return t itself when no bit is set. */
    resolved = strncmp(nm, "complex", 7) == 0 ? PyObject_CallMethod(t, "resolve_conj", NULL)
                                              : Py_NewRef(t);
    if (resolved != NULL) {
        Py_SETREF(resolved, PyObject_CallMethod(resolved, "resolve_neg", NULL));
    }
    if (resolved == NULL) {
        goto cleanup;
    }
    t = resolved;
    flag = PyObject_GetAttrString(t, "is_cpu");
    if (flag == NULL) {
        goto cleanup;
    }
    is_cpu = flag == Py_True;
    if (!is_cpu) {
        Py_SETREF(flag, PyObject_GetAttrString(t, "is_cuda"));
        if (flag == NULL) {
            goto cleanup;
        }
        is_cuda = flag == Py_True;
        device = PyObject_GetAttrString(t, "device");
        if (device == NULL || (devstr = PyObject_Str(device)) == NULL) {
            goto cleanup;
        }
        if (PyUnicode_CompareWithASCIIString(devstr, "meta") == 0) {
            PyErr_SetString(PyExc_TypeError,
                            "flor.snapshot: a tensor on the 'meta' device has no data to copy");
            goto cleanup;
        }
    }
    storage = PyObject_CallMethod(t, "untyped_storage", NULL);
    if (storage == NULL) {
        goto cleanup;
    }
    bidx = tensor_blob(w, is_cpu, is_cuda, storage);
    if (bidx < 0) {
        goto cleanup;
    }
    shape = PyObject_GetAttrString(t, "shape");
    stride = PyObject_CallMethod(t, "stride", NULL);
    offset = PyObject_CallMethod(t, "storage_offset", NULL);
    Py_XSETREF(flag, PyObject_GetAttrString(t, "requires_grad"));
    if (shape == NULL || stride == NULL || offset == NULL || flag == NULL) {
        goto cleanup;
    }
    if (!PyTuple_Check(shape) || !PyTuple_Check(stride)) {
        PyErr_SetString(PyExc_TypeError, "flor.snapshot: tensor shape or stride is not a tuple");
        goto cleanup;
    }
    rg = flag == Py_True;
    eidx = add_entry(w);
    if (eidx < 0) {
        goto cleanup;
    }
    e = &w->entries[eidx];
    e->kind = FLOR_REF_TENSOR;
    e->blob = (uint32_t)bidx;
    e->storage_offset = PyLong_AsLongLong(offset);
    if (PyErr_Occurred() || fill_dims(e, shape, stride) < 0 ||
        set_name(e->dtype, name, "dtype") < 0 || (w->spans && span_tensor(w, t, e) < 0)) {
        goto cleanup;
    }
    if (is_cpu) {
        memcpy(e->device, "cpu", 4);
    }
    else if (set_name(e->device, devstr, "device") < 0) {
        goto cleanup;
    }
    if (rg) {
        e->flags |= FLOR_ENTRY_REQUIRES_GRAD;
    }
    if (PyObject_TypeCheck(orig, (PyTypeObject *)st->Parameter)) {
        e->flags |= FLOR_ENTRY_PARAMETER;
    }
    if ((PyObject *)Py_TYPE(orig) != st->Tensor && (PyObject *)Py_TYPE(orig) != st->Parameter) {
        cls = (PyObject *)Py_TYPE(orig);
    }
    res = flor_ref_new(st, FLOR_REF_TENSOR, eidx, cls);
cleanup:
    Py_XDECREF(layout);
    Py_XDECREF(dtype);
    Py_XDECREF(name);
    Py_XDECREF(resolved);
    Py_XDECREF(flag);
    Py_XDECREF(storage);
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    Py_XDECREF(offset);
    Py_XDECREF(device);
    Py_XDECREF(devstr);
    return res;
}

/* numpy arrays and bytearrays: bytes through the buffer protocol.  Returns
 * 1 with the placeholder in *out, 0 when the array must take the reduce
 * path (object or structured dtype, no buffer export), -1 with an
 * exception set. */
static int
walk_buffer(walker *w, PyObject *o, int kind, PyObject **out)
{
    int res = -1;
    PyObject *dtype = NULL, *attr = NULL, *dstr = NULL, *shape = NULL;
    Py_buffer *view = NULL;
    Py_ssize_t bidx, eidx, i;
    flor_entry *e;
    flor_blob *b;

    if (kind == FLOR_REF_ARRAY) {
        dtype = PyObject_GetAttrString(o, "dtype");
        if (dtype == NULL || (attr = PyObject_GetAttrString(dtype, "hasobject")) == NULL) {
            goto cleanup;
        }
        if (attr == Py_True) {
            res = 0; /* object arrays hold references: reduce path */
            goto cleanup;
        }
        Py_SETREF(attr, PyObject_GetAttrString(dtype, "fields"));
        if (attr == NULL) {
            goto cleanup;
        }
        if (attr != Py_None) {
            res = 0; /* structured dtype: reduce path */
            goto cleanup;
        }
        dstr = PyObject_GetAttrString(dtype, "str");
        if (dstr == NULL) {
            goto cleanup;
        }
        if (PyUnicode_GET_LENGTH(dstr) >= FLOR_NAME_MAX) {
            res = 0; /* a dtype name no entry holds: reduce path */
            goto cleanup;
        }
    }
    view = calloc(1, sizeof(Py_buffer));
    if (view == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    if (PyObject_GetBuffer(o, view, PyBUF_STRIDES) < 0) {
        free(view);
        view = NULL;
        if (kind == FLOR_REF_ARRAY && PyErr_ExceptionMatches(PyExc_ValueError)) {
            PyErr_Clear(); /* e.g. datetime64: no buffer export, reduce path */
            res = 0;
        }
        goto cleanup;
    }
    shape = PyTuple_New(view->ndim);
    if (shape == NULL) {
        goto cleanup;
    }
    for (i = 0; i < view->ndim; i++) {
        PyObject *d = PyLong_FromSsize_t(view->shape ? view->shape[i] : view->len);
        if (d == NULL) {
            goto cleanup;
        }
        PyTuple_SET_ITEM(shape, i, d);
    }
    bidx = add_blob(w);
    if (bidx < 0) {
        goto cleanup;
    }
    b = &w->blobs[bidx];
    b->where = FLOR_BLOB_BUFFER;
    b->nbytes = (uint64_t)view->len;
    b->src = view->buf;
    b->view = view;
    view = NULL;
    eidx = add_entry(w);
    if (eidx < 0) {
        goto cleanup;
    }
    e = &w->entries[eidx];
    e->kind = (uint8_t)kind;
    e->blob = (uint32_t)bidx;
    memcpy(e->device, "cpu", 4);
    if (fill_dims(e, shape, NULL) < 0) {
        goto cleanup;
    }
    if (dstr != NULL && set_name(e->dtype, dstr, "dtype") < 0) {
        goto cleanup;
    }
    if (dstr == NULL) {
        memcpy(e->dtype, "|u1", 4);
    }
    *out = flor_ref_new(w->st, kind, eidx, NULL);
    res = *out == NULL ? -1 : 1;
cleanup:
    if (view != NULL) {
        PyBuffer_Release(view);
        free(view);
    }
    Py_XDECREF(dtype);
    Py_XDECREF(attr);
    Py_XDECREF(dstr);
    Py_XDECREF(shape);
    return res;
}

/* Copy the items of list o into res (prefilled with None when shared). */
static int
list_items(walker *w, PyObject *o, PyObject *res, int shared, int *flat)
{
    Py_ssize_t n = PyList_GET_SIZE(res), i;
    for (i = 0; i < n; i++) {
        PyObject *c;
        if (PyList_GET_SIZE(o) != n) {
            PyErr_SetString(PyExc_RuntimeError, "list changed size during flor.snapshot");
            return -1;
        }
        c = walk_child(w, PyList_GET_ITEM(o, i));
        if (c == NULL) {
            path_push(w, "[%zd]", i);
            return -1;
        }
        *flat &= is_leaf_copy(w, c);
        if (shared) {
            Py_SETREF(PySequence_Fast_ITEMS(res)[i], c);
        }
        else {
            PyList_SET_ITEM(res, i, c);
        }
    }
    return 0;
}

static PyObject *
walk_list(walker *w, PyObject *o, int shared)
{
    Py_ssize_t n = PyList_GET_SIZE(o), i;
    int flat = 1, rc;
    PyObject *res = PyList_New(n);
    if (res == NULL) {
        return NULL;
    }
    if (shared) {
        /* Reachable through the memo while its items are copied (a cycle may
         * hand it to Python code): never let that code see NULL slots. */
        for (i = 0; i < n; i++) {
            PyList_SET_ITEM(res, i, Py_NewRef(Py_None));
        }
        if (memo_put(w, o, res) < 0) {
            goto error;
        }
    }
    if (Py_EnterRecursiveCall(" while taking a flor snapshot")) {
        goto error;
    }
    rc = list_items(w, o, res, shared, &flat);
    Py_LeaveRecursiveCall();
    if (rc < 0) {
        goto error;
    }
    if (flat) {
        /* The skeleton is private and never mutated: a list of atoms can be
         * left out of the garbage collector's generations. */
        PyObject_GC_UnTrack(res);
    }
    return res;
error:
    Py_DECREF(res);
    return NULL;
}

/* Copy the items of tuple o.  *res stays NULL while every copy is the item
 * itself; then it is made, holding the items so far. */
static int
tuple_items(walker *w, PyObject *o, PyObject **res)
{
    Py_ssize_t n = PyTuple_GET_SIZE(o), i, j;
    for (i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(o, i);
        PyObject *c = walk_child(w, item);
        if (c == NULL) {
            path_push(w, "[%zd]", i);
            return -1;
        }
        if (*res == NULL && c != item) {
            *res = PyTuple_New(n);
            if (*res == NULL) {
                Py_DECREF(c);
                return -1;
            }
            for (j = 0; j < i; j++) {
                PyTuple_SET_ITEM(*res, j, Py_NewRef(PyTuple_GET_ITEM(o, j)));
            }
        }
        if (*res != NULL) {
            PyTuple_SET_ITEM(*res, i, c);
        }
        else {
            Py_DECREF(c);
        }
    }
    return 0;
}

static PyObject *
walk_tuple(walker *w, PyObject *o, int shared)
{
    PyObject *res = NULL;
    uintptr_t found;
    int rc;
    if (PyTuple_GET_SIZE(o) == 0) {
        return Py_NewRef(o);
    }
    if (Py_EnterRecursiveCall(" while taking a flor snapshot")) {
        return NULL;
    }
    rc = tuple_items(w, o, &res);
    Py_LeaveRecursiveCall();
    if (rc < 0) {
        Py_XDECREF(res);
        return NULL;
    }
    if (res == NULL) {
        return Py_NewRef(o); /* nothing inside needed copying */
    }
    if (shared) {
        if (pmap_get(&w->memo, (uintptr_t)o, &found)) {
            /* A cycle through a mutable item already copied this tuple. */
            w->not_tree = 1;
            Py_DECREF(res);
            return Py_NewRef((PyObject *)found);
        }
        if (memo_put(w, o, res) < 0) {
            Py_DECREF(res);
            return NULL;
        }
    }
    return res;
}

/* 1 if every key is an atom; counts the values that are not atoms. */
static int
simple_keys(PyObject *d, Py_ssize_t *nonatom)
{
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    *nonatom = 0;
    while (PyDict_Next(d, &pos, &k, &v)) {
        if (!is_atom(k)) {
            return 0;
        }
        *nonatom += !is_atom(v);
    }
    return 1;
}

/* Copy the items of dict o into res: into a clone of o (fast, every key an
 * atom) only the values that are not atoms.  Counts the values replaced. */
static int
dict_items(walker *w, PyObject *o, PyObject *res, int fast, int *flat, Py_ssize_t *replaced)
{
    Py_ssize_t pos = 0, n0 = PyDict_GET_SIZE(o);
    PyObject *k, *v;
    while (PyDict_Next(o, &pos, &k, &v)) {
        PyObject *ck, *cv;
        int rc;
        if (fast && is_atom(v)) {
            continue;
        }
        Py_INCREF(k);
        if (fast) {
            /* res holds one more reference to v than o alone does. */
            int vshared = Py_REFCNT(v) > 2;
            Py_INCREF(v);
            ck = Py_NewRef(k);
            cv = walk(w, v, vshared);
            Py_DECREF(v);
        }
        else {
            Py_INCREF(v); /* walking the key may run code that drops it */
            ck = walk_child(w, k);
            cv = ck == NULL ? NULL : walk_child(w, v);
            Py_DECREF(v);
        }
        if (cv == NULL) {
            path_push(w, "[%R]", k);
            Py_XDECREF(ck);
            Py_DECREF(k);
            return -1;
        }
        *flat &= is_leaf_copy(w, cv);
        (*replaced)++;
        rc = PyDict_SetItem(res, ck, cv);
        Py_DECREF(ck);
        Py_DECREF(cv);
        Py_DECREF(k);
        if (rc < 0) {
            return -1;
        }
        if (PyDict_GET_SIZE(o) != n0) {
            PyErr_SetString(PyExc_RuntimeError, "dictionary changed size during flor.snapshot");
            return -1;
        }
    }
    return 0;
}

static PyObject *
walk_dict(walker *w, PyObject *o, int shared)
{
    Py_ssize_t n0 = PyDict_GET_SIZE(o), nonatom = 0, replaced = 0;
    PyObject *res;
    int fast = simple_keys(o, &nonatom);
    int flat = 1, rc;

    /* Fast path: clone the table, then replace the values that need a copy. */
    res = fast ? PyDict_Copy(o) : PyDict_New();
    if (res == NULL) {
        return NULL;
    }
    if (shared && memo_put(w, o, res) < 0) {
        goto error;
    }
    if (Py_EnterRecursiveCall(" while taking a flor snapshot")) {
        goto error;
    }
    rc = dict_items(w, o, res, fast, &flat, &replaced);
    Py_LeaveRecursiveCall();
    if (rc < 0) {
        goto error;
    }
    if (fast && (PyDict_GET_SIZE(res) != n0 || replaced != nonatom)) {
        /* Code run by the walk swapped keys: the clone may still hold a
         * value of the live dict that was never copied. */
        PyErr_SetString(PyExc_RuntimeError, "dictionary changed during flor.snapshot");
        goto error;
    }
    if (flat && fast && PyObject_GC_IsTracked(res)) {
        /* Every value is an atom or a Ref (the atoms were skipped above):
         * nothing here can form a cycle. */
        PyObject_GC_UnTrack(res);
    }
    return res;
error:
    Py_DECREF(res);
    return NULL;
}

/* Copy the items that iterator it yields into the list items. */
static int
set_items(walker *w, PyObject *it, PyObject *items, int *changed)
{
    PyObject *item;
    while ((item = PyIter_Next(it)) != NULL) {
        PyObject *c = walk_child(w, item);
        int rc;
        if (c == NULL) {
            Py_DECREF(item);
            return -1;
        }
        *changed |= c != item;
        rc = PyList_Append(items, c);
        Py_DECREF(c);
        Py_DECREF(item);
        if (rc < 0) {
            return -1;
        }
    }
    return PyErr_Occurred() ? -1 : 0;
}

static PyObject *
walk_set(walker *w, PyObject *o, int shared, int frozen)
{
    PyObject *res = NULL, *items = NULL, *it = NULL;
    int changed = 0, rc;

    items = PyList_New(0);
    if (items == NULL) {
        return NULL;
    }
    if (!frozen) {
        res = PySet_New(NULL);
        if (res == NULL || (shared && memo_put(w, o, res) < 0)) {
            goto error;
        }
    }
    it = PyObject_GetIter(o);
    if (it == NULL || Py_EnterRecursiveCall(" while taking a flor snapshot")) {
        goto error;
    }
    rc = set_items(w, it, items, &changed);
    Py_LeaveRecursiveCall();
    if (rc < 0) {
        goto error;
    }
    if (frozen) {
        res = changed ? PyFrozenSet_New(items) : Py_NewRef(o);
        if (res == NULL || (changed && shared && memo_put(w, o, res) < 0)) {
            goto error;
        }
    }
    else {
        Py_ssize_t i;
        for (i = 0; i < PyList_GET_SIZE(items); i++) {
            if (PySet_Add(res, PyList_GET_ITEM(items, i)) < 0) {
                goto error;
            }
        }
    }
    Py_DECREF(it);
    Py_DECREF(items);
    return res;
error:
    Py_XDECREF(it);
    Py_XDECREF(items);
    Py_XDECREF(res);
    return NULL;
}

/* Give the copy `y` its walked state; *own is set where the class's own
 * setstate (or __setstate__) raised. */
static int
apply_state(walker *w, PyObject *y, PyObject *state, PyObject *setstate, int *own)
{
    int rc = -1;
    PyObject *cstate = NULL, *meth = NULL, *r = NULL, *dict = NULL, *slots = NULL;
    PyObject *k, *v;
    Py_ssize_t pos = 0;

    cstate = walk_child(w, state);
    if (cstate == NULL) {
        goto cleanup;
    }
    if (setstate != Py_None) {
        r = PyObject_CallFunctionObjArgs(setstate, y, cstate, NULL);
        rc = r == NULL ? -1 : 0;
        *own = r == NULL;
        goto cleanup;
    }
    meth = PyObject_GetAttr(y, w->st->s_setstate);
    if (meth != NULL) {
        r = PyObject_CallOneArg(meth, cstate);
        rc = r == NULL ? -1 : 0;
        *own = r == NULL;
        goto cleanup;
    }
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
        goto cleanup;
    }
    PyErr_Clear();
    if (PyTuple_Check(cstate) && PyTuple_GET_SIZE(cstate) == 2) {
        slots = Py_NewRef(PyTuple_GET_ITEM(cstate, 1));
        Py_SETREF(cstate, Py_NewRef(PyTuple_GET_ITEM(cstate, 0)));
    }
    if (cstate != Py_None) {
        dict = PyObject_GetAttr(y, w->st->s_dict);
        if (dict == NULL) {
            goto cleanup;
        }
        r = PyObject_CallMethod(dict, "update", "(O)", cstate);
        if (r == NULL) {
            goto cleanup;
        }
    }
    if (slots != NULL && slots != Py_None) {
        if (!PyDict_Check(slots)) {
            PyErr_SetString(PyExc_TypeError, "flor.snapshot: slot state is not a dict");
            goto cleanup;
        }
        while (PyDict_Next(slots, &pos, &k, &v)) {
            if (PyObject_SetAttr(y, k, v) < 0) {
                goto cleanup;
            }
        }
    }
    rc = 0;
cleanup:
    Py_XDECREF(cstate);
    Py_XDECREF(slots);
    Py_XDECREF(meth);
    Py_XDECREF(r);
    Py_XDECREF(dict);
    return rc;
}

/* Types whose reduce rebuilds them only from parts this walk copies, so
 * any object the copy holds twice was also seen twice by the walk. */
static int
tree_safe(flor_state *st, PyTypeObject *tp)
{
    int r = PySet_Contains(st->tree_safe, (PyObject *)tp);
    if (r != 0) {
        return r;
    }
    return PyType_IsSubtype(tp, &PyTuple_Type) && PyObject_HasAttrString((PyObject *)tp, "_fields");
}

/* The class's own __setstate__ raised on the walked state of `o`, given
 * to its copy `res`: it may read the arrays of its state, which the copy
 * holds as the skeleton's placeholders (numpy's bit generators:
 * RandomState, Generator(MT19937)).  Where that raised an Exception, the
 * class is an extension type's (C or Cython code, as numpy's; a Python
 * class whose __setstate__ refuses the copy keeps refusing, as it did
 * before: its state may share objects with the rest of the snapshot, which
 * a copy of its own would split) and nothing else holds `res` (no object of
 * its state refers back to it), `o` is copied whole by copy.deepcopy
 * instead, as a class that copies itself is (K_DEEPCOPY), with one memo for
 * the walk's such copies (a bit generator and the RandomState around it
 * stay one), and the walk's memo and error path are put back.  The arrays
 * its state walk met stay in the snapshot, unused.  Otherwise, or if the
 * deep copy fails too, the first error is raised.  Steals `res`. */
static PyObject *
deepcopy_instead(walker *w, PyObject *o, PyObject *res, int shared, Py_ssize_t path_len)
{
    PyObject *type, *value, *tb, *copy = NULL;

    if (!PyErr_ExceptionMatches(PyExc_Exception) ||
        PyType_HasFeature(Py_TYPE(o), Py_TPFLAGS_HEAPTYPE)) {
        Py_DECREF(res);
        goto cleanup;
    }
    PyErr_Fetch(&type, &value, &tb);
    if (Py_REFCNT(res) != 1 + shared) {
        Py_DECREF(res);
        PyErr_Restore(type, value, tb);
        goto cleanup;
    }
    Py_DECREF(res);
    if (w->deep_memo == NULL) {
        w->deep_memo = PyDict_New();
    }
    if (w->deep_memo != NULL) {
        copy = PyObject_CallFunctionObjArgs(w->st->deepcopy, o, w->deep_memo, NULL);
    }
    if (copy == NULL || (shared && memo_put(w, o, copy) < 0)) {
        Py_CLEAR(copy);
        PyErr_Clear();
        PyErr_Restore(type, value, tb);
        goto cleanup;
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    if (PyList_SetSlice(w->path, path_len, PyList_GET_SIZE(w->path), NULL) < 0) {
        Py_CLEAR(copy);
        goto cleanup;
    }
    w->not_tree = 1;
    w->foreign = 1;
cleanup:
    return copy;
}

/* copy._reconstruct, with every component copied by this walk. */
static PyObject *
walk_reduce(walker *w, PyObject *o, int shared)
{
    flor_state *st = w->st;
    PyObject *reductor, *rv = NULL, *res = NULL, *cargs = NULL, *it = NULL, *item = NULL;
    PyObject *callable, *args, *state = Py_None, *listitems = Py_None, *dictitems = Py_None;
    PyObject *setstate = Py_None;
    Py_ssize_t n, path_len = PyList_GET_SIZE(w->path);
    int own = 0;

    switch (tree_safe(st, Py_TYPE(o))) {
    case -1:
        return NULL;
    case 0:
        /* A class's own constructor or __setstate__ may share objects
         * inside the copy without the walk seeing them twice. */
        w->not_tree = 1;
    }
    reductor = PyDict_GetItemWithError(st->copyreg_dispatch, (PyObject *)Py_TYPE(o));
    if (reductor != NULL) {
        rv = PyObject_CallOneArg(reductor, o);
    }
    else if (!PyErr_Occurred()) {
        rv = PyObject_CallMethod(o, "__reduce_ex__", "i", 4);
    }
    if (rv == NULL) {
        goto cleanup;
    }
    if (PyUnicode_Check(rv)) {
        res = Py_NewRef(o); /* a global: shared like an atom */
        goto cleanup;
    }
    n = PyTuple_Check(rv) ? PyTuple_GET_SIZE(rv) : 0;
    if (n < 2 || n > 6) {
        PyErr_Format(PyExc_TypeError,
                     "flor.snapshot: cannot copy a %.200s: its __reduce_ex__ returned %R",
                     Py_TYPE(o)->tp_name, rv);
        goto cleanup;
    }
    callable = PyTuple_GET_ITEM(rv, 0);
    args = PyTuple_GET_ITEM(rv, 1);
    if (n > 2) state = PyTuple_GET_ITEM(rv, 2);
    if (n > 3) listitems = PyTuple_GET_ITEM(rv, 3);
    if (n > 4) dictitems = PyTuple_GET_ITEM(rv, 4);
    if (n > 5) setstate = PyTuple_GET_ITEM(rv, 5);

    cargs = walk_child(w, args);
    if (cargs == NULL) {
        goto cleanup;
    }
    if (!PyTuple_Check(cargs)) {
        PyErr_Format(PyExc_TypeError, "flor.snapshot: reduce arguments of a %.200s are not a tuple",
                     Py_TYPE(o)->tp_name);
        goto cleanup;
    }
    res = PyObject_Call(callable, cargs, NULL);
    if (res == NULL) {
        goto cleanup;
    }
    if (shared && memo_put(w, o, res) < 0) {
        Py_CLEAR(res);
        goto cleanup;
    }
    if (state != Py_None && apply_state(w, res, state, setstate, &own) < 0) {
        if (own) { /* (a deep copy holds its list and dict items too) */
            res = deepcopy_instead(w, o, res, shared, path_len);
        }
        else {
            Py_CLEAR(res);
        }
        goto cleanup;
    }
    if (listitems != Py_None) {
        it = PyObject_GetIter(listitems);
        if (it == NULL) {
            Py_CLEAR(res);
            goto cleanup;
        }
        while ((item = PyIter_Next(it)) != NULL) {
            PyObject *c = walk_child(w, item), *r;
            Py_CLEAR(item);
            r = c == NULL ? NULL : PyObject_CallMethodOneArg(res, st->s_append, c);
            Py_XDECREF(c);
            if (r == NULL) {
                Py_CLEAR(res);
                goto cleanup;
            }
            Py_DECREF(r);
        }
        if (PyErr_Occurred()) {
            Py_CLEAR(res);
            goto cleanup;
        }
        Py_CLEAR(it);
    }
    if (dictitems != Py_None) {
        it = PyObject_GetIter(dictitems);
        if (it == NULL) {
            Py_CLEAR(res);
            goto cleanup;
        }
        while ((item = PyIter_Next(it)) != NULL) {
            PyObject *ck = NULL, *cv = NULL;
            int rc = -1;
            if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
                PyErr_SetString(PyExc_TypeError, "flor.snapshot: dict items must be pairs");
            }
            else if ((ck = walk_child(w, PyTuple_GET_ITEM(item, 0))) == NULL) {
            }
            else if ((cv = walk_child(w, PyTuple_GET_ITEM(item, 1))) == NULL) {
                path_push(w, "[%R]", PyTuple_GET_ITEM(item, 0));
            }
            else {
                rc = PyObject_SetItem(res, ck, cv);
            }
            Py_XDECREF(ck);
            Py_XDECREF(cv);
            Py_CLEAR(item);
            if (rc < 0) {
                Py_CLEAR(res);
                goto cleanup;
            }
        }
        if (PyErr_Occurred()) {
            Py_CLEAR(res);
            goto cleanup;
        }
    }
cleanup:
    Py_XDECREF(it);
    Py_XDECREF(rv);
    Py_XDECREF(cargs);
    return res;
}

/* 1 if the type has a callable attribute `name`, 0 if not, -1 on error. */
static int
optional_callable(PyTypeObject *tp, PyObject *name)
{
    int r;
    PyObject *attr = PyObject_GetAttr((PyObject *)tp, name);
    if (attr == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            return -1;
        }
        PyErr_Clear();
        return 0;
    }
    r = PyCallable_Check(attr);
    Py_DECREF(attr);
    return r;
}

static int
classify(flor_state *st, PyTypeObject *tp)
{
    PyObject *cached, *val;
    int kind = K_REDUCE;

    cached = PyDict_GetItemWithError(st->kind_cache, (PyObject *)tp);
    if (cached != NULL) {
        return (int)PyLong_AsLong(cached);
    }
    if (PyErr_Occurred()) {
        return -1;
    }
    if (PyType_IsSubtype(tp, &PyType_Type) || tp == &PyFunction_Type || tp == &PyCFunction_Type ||
        tp == &PyCode_Type || tp == &PyModule_Type || tp == &PyRange_Type ||
        tp == &PyComplex_Type || tp == Py_TYPE(Py_Ellipsis) || tp == Py_TYPE(Py_NotImplemented) ||
        tp == &PyProperty_Type || (PyObject *)tp == st->weakref_t) {
        kind = K_ATOM;
    }
    else if (st->torch_ready && PyType_IsSubtype(tp, (PyTypeObject *)st->Tensor)) {
        kind = K_TENSOR;
    }
    else if (st->torch_ready && ((PyObject *)tp == st->dtype_t || (PyObject *)tp == st->layout_t ||
                                 (PyObject *)tp == st->memfmt_t)) {
        kind = K_NAMED;
    }
    else if (st->torch_ready && (PyObject *)tp == st->device_t) {
        kind = K_DEVICE;
    }
    else if (st->torch_ready && (PyObject *)tp == st->Size) {
        kind = K_SIZE;
    }
    else if (st->torch_ready && PyType_IsSubtype(tp, (PyTypeObject *)st->Generator)) {
        kind = K_GENERATOR;
    }
    else if (st->ndarray != NULL && (PyObject *)tp == st->ndarray) {
        kind = K_NDARRAY;
    }
    else if (tp == &PyByteArray_Type) {
        kind = K_BYTEARRAY;
    }
    else if (tp == &PySet_Type) {
        kind = K_SET;
    }
    else if (tp == &PyFrozenSet_Type) {
        kind = K_FROZENSET;
    }
    else {
        int has_sd = optional_callable(tp, st->s_state_dict);
        int has_load = has_sd > 0 ? optional_callable(tp, st->s_load_state_dict) : 0;
        int has_dc = optional_callable(tp, st->s_deepcopy_attr);
        if (has_sd < 0 || has_load < 0 || has_dc < 0) {
            return -1;
        }
        if (has_sd && has_load) {
            kind = K_STATEFUL;
        }
        else if (has_dc) {
            kind = K_DEEPCOPY;
        }
    }
    if (PyDict_GET_SIZE(st->kind_cache) > 4096) {
        PyDict_Clear(st->kind_cache);
    }
    val = PyLong_FromLong(kind);
    if (val == NULL || PyDict_SetItem(st->kind_cache, (PyObject *)tp, val) < 0) {
        Py_XDECREF(val);
        return -1;
    }
    Py_DECREF(val);
    return kind;
}

static PyObject *
walk(walker *w, PyObject *o, int shared)
{
    flor_state *st = w->st;
    PyTypeObject *tp = Py_TYPE(o);
    PyObject *res = NULL, *tmp = NULL, *payload = NULL;
    uintptr_t found;
    int kind;

    if (is_atom(o)) {
        return Py_NewRef(o);
    }
    if (shared && pmap_get(&w->memo, (uintptr_t)o, &found)) {
        w->not_tree = 1;
        return Py_NewRef((PyObject *)found);
    }
    if (tp == &PyDict_Type) {
        return walk_dict(w, o, shared);
    }
    if (tp == &PyList_Type) {
        return walk_list(w, o, shared);
    }
    if (tp == &PyTuple_Type) {
        return walk_tuple(w, o, shared);
    }
    kind = classify(st, tp);
    switch (kind) {
    case K_ATOM:
        return Py_NewRef(o);
    case K_TENSOR:
        res = walk_tensor(w, o);
        break;
    case K_NAMED:
        payload = PyDict_GetItemWithError(st->atom_names, o);
        if (payload == NULL) {
            if (!PyErr_Occurred()) {
                PyErr_Format(PyExc_TypeError, "flor.snapshot: unknown torch constant %R", o);
            }
            return NULL;
        }
        res = flor_ref_new(st, FLOR_REF_NAMED, -1, payload);
        break;
    case K_DEVICE:
        payload = PyObject_Str(o);
        res = payload == NULL ? NULL : flor_ref_new(st, FLOR_REF_DEVICE, -1, payload);
        Py_XDECREF(payload);
        break;
    case K_SIZE:
        payload = PySequence_Tuple(o);
        res = payload == NULL ? NULL : flor_ref_new(st, FLOR_REF_SIZE, -1, payload);
        Py_XDECREF(payload);
        break;
    case K_GENERATOR: {
        PyObject *state = NULL, *sref = NULL, *dev = NULL, *devs = NULL;
        state = PyObject_CallMethod(o, "get_state", NULL);
        if (state != NULL) {
            sref = walk_tensor(w, state);
        }
        if (sref != NULL) {
            dev = PyObject_GetAttrString(o, "device");
        }
        if (dev != NULL) {
            devs = PyObject_Str(dev);
        }
        if (devs != NULL) {
            payload = PyTuple_Pack(2, devs, sref);
        }
        if (payload != NULL) {
            res = flor_ref_new(st, FLOR_REF_GENERATOR, -1, payload);
        }
        Py_XDECREF(state);
        Py_XDECREF(sref);
        Py_XDECREF(dev);
        Py_XDECREF(devs);
        Py_XDECREF(payload);
        break;
    }
    case K_NDARRAY:
    case K_BYTEARRAY:
        switch (walk_buffer(w, o, kind == K_NDARRAY ? FLOR_REF_ARRAY : FLOR_REF_BYTEARRAY, &res)) {
        case 0:
            return walk_reduce(w, o, shared);
        case -1:
            res = NULL;
            break;
        default:
            break;
        }
        break;
    case K_SET:
    case K_FROZENSET:
        return walk_set(w, o, shared, kind == K_FROZENSET);
    case K_STATEFUL:
        tmp = PyObject_CallMethodNoArgs(o, st->s_state_dict);
        if (tmp == NULL) {
            path_push(w, ".state_dict()");
            return NULL;
        }
        res = walk(w, tmp, Py_REFCNT(tmp) > 1);
        Py_DECREF(tmp);
        if (res == NULL) {
            path_push(w, ".state_dict()");
            return NULL;
        }
        break;
    case K_DEEPCOPY:
        /* The class copies itself.  Its copy may share objects internally
         * and may hold tensors: it is pickled with the memo, and never in a
         * forked writer (which must not run torch code).  An object whose
         * copy is itself is kept as it is, unless it is a known handle
         * (flor/handles.py: an Accelerator), walked as its flor.handles.Handle. */
        res = PyObject_CallOneArg(st->deepcopy, o);
        if (res == o) {
            Py_CLEAR(res);
            tmp = handle_capture(st);
            tmp = tmp == NULL ? NULL : PyObject_CallOneArg(tmp, o);
            if (tmp == o) {
                res = tmp;
            }
            else if (tmp != NULL) {
                res = walk(w, tmp, 0);
                Py_DECREF(tmp);
            }
        }
        else if (res != NULL) {
            w->not_tree = 1;
            w->foreign = 1;
        }
        break;
    case K_REDUCE:
        return walk_reduce(w, o, shared);
    default:
        return NULL; /* classify() failed with an exception set */
    }
    if (res != NULL && shared && memo_put(w, o, res) < 0) {
        Py_CLEAR(res);
    }
    return res;
}

/* ------------------------------------------------------------------ */
/* Copy phase.                                                          */

static void
blobs_release(flor_blob *b, uint32_t n)
{
    uint32_t i;
    for (i = 0; i < n; i++) {
        if (b[i].view != NULL) {
            PyBuffer_Release(b[i].view);
            free(b[i].view);
            b[i].view = NULL;
        }
        Py_CLEAR(b[i].owner);
        b[i].src = NULL;
    }
}

/* flor.handles.capture (borrowed), imported the first time a handle is met. */
static PyObject *
handle_capture(flor_state *st)
{
    PyObject *mod;
    if (st->handle_capture == NULL) {
        mod = PyImport_ImportModule("flor.handles");
        if (mod != NULL) {
            st->handle_capture = PyObject_GetAttrString(mod, "capture");
            Py_DECREF(mod);
        }
    }
    return st->handle_capture;
}

/* flor._cuda (borrowed), imported the first time a CUDA blob is met: the
 * device side of snapshots and fingerprints, written against torch's
 * stream and event API. */
static PyObject *
cuda_helper(flor_state *st)
{
    if (st->cuda == NULL) {
        st->cuda = PyImport_ImportModule("flor._cuda");
    }
    return st->cuda;
}

/* Queue the device-to-host copy of every CUDA blob into the arena
 * (flor._cuda.copy); the snapshot keeps what to wait on before the arena is
 * read. */
static int
cuda_start(flor_state *st, FlorSnapshot *s)
{
    int rc = -1;
    uint32_t i;
    PyObject *helper, *mv = NULL, *blobs = NULL, *pending = NULL;

    helper = cuda_helper(st);
    if (helper == NULL) {
        goto cleanup;
    }
    mv = PyMemoryView_FromMemory(s->arena->base, (Py_ssize_t)s->data_bytes, PyBUF_WRITE);
    blobs = PyList_New(0);
    if (mv == NULL || blobs == NULL) {
        goto cleanup;
    }
    for (i = 0; i < s->n_blobs; i++) {
        flor_blob *b = &s->blobs[i];
        PyObject *item;
        int r;
        if (b->where != FLOR_BLOB_CUDA || b->nbytes == 0) {
            continue;
        }
        item = Py_BuildValue("(OKK)", b->owner, (unsigned long long)b->offset,
                             (unsigned long long)b->nbytes);
        r = item == NULL ? -1 : PyList_Append(blobs, item);
        Py_XDECREF(item);
        if (r < 0) {
            goto cleanup;
        }
    }
    pending = PyObject_CallMethod(helper, "copy", "OOO", mv, blobs,
                                  s->arena->pinned ? Py_True : Py_False);
    if (pending == NULL) {
        goto cleanup;
    }
    s->pending = pending;
    rc = 0;
cleanup:
    Py_XDECREF(mv);
    Py_XDECREF(blobs);
    return rc;
}

int
flor_snapshot_wait(FlorSnapshot *s)
{
    PyObject *p, *r;
    if (s->pending == NULL) {
        return 0;
    }
    /* Another thread may wait on the same copies meanwhile (the GIL is
     * released in wait()); whoever returns first clears them. */
    p = Py_NewRef(s->pending);
    r = PyObject_CallMethod(p, "wait", NULL);
    if (r != NULL && s->pending == p) {
        Py_CLEAR(s->pending);
    }
    Py_DECREF(p);
    if (r == NULL) {
        return -1;
    }
    Py_DECREF(r);
    return 0;
}

/* Code run after the walk saw a storage (a __reduce_ex__, a state_dict(),
 * another thread while backpressure waited) may have resized it: read its
 * address again with the GIL held, just before the bytes are copied. */
static int
recheck_storage(flor_blob *b)
{
    int rc = -1;
    PyObject *nbytes = NULL, *ptr = NULL;
    nbytes = PyObject_CallMethod(b->owner, "nbytes", NULL);
    ptr = nbytes == NULL ? NULL : PyObject_CallMethod(b->owner, "data_ptr", NULL);
    if (ptr == NULL) {
        goto cleanup;
    }
    if (PyLong_AsUnsignedLongLong(nbytes) != b->nbytes) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_RuntimeError,
                            "a tensor's storage was resized while flor.snapshot was copying it");
        }
        goto cleanup;
    }
    b->src = (const char *)PyLong_AsVoidPtr(ptr);
    rc = PyErr_Occurred() ? -1 : 0;
cleanup:
    Py_XDECREF(nbytes);
    Py_XDECREF(ptr);
    return rc;
}

static int
copy_phase(walker *w, FlorSnapshot *s, flor_reserve_fn reserve, void *ctx, int hash)
{
    flor_state *st = w->st;
    uint64_t total = 0, payload = 0;
    uint32_t i;
    int rc = -1;
    double t0;
    char *base;

    /* CUDA blobs first: with one device (the usual case) they are one run
     * of the arena, which a single copy fills (flor._cuda). */
    for (i = 0; i < s->n_blobs; i++) {
        if (s->blobs[i].where == FLOR_BLOB_CUDA) {
            s->blobs[i].offset = total;
            total += flor_align_up(s->blobs[i].nbytes);
        }
        payload += s->blobs[i].nbytes;
    }
    for (i = 0; i < s->n_blobs; i++) {
        if (s->blobs[i].where != FLOR_BLOB_CUDA) {
            s->blobs[i].offset = total;
            total += flor_align_up(s->blobs[i].nbytes);
        }
    }
    s->data_bytes = total;
    s->nbytes = payload;
    if (reserve != NULL) {
        int r = reserve(ctx, flor_pool_charge(total));
        if (r < 0) {
            goto cleanup;
        }
        if (r > 0) {
            rc = 0; /* measure only */
            goto cleanup;
        }
    }
    if (total == 0) {
        rc = 0;
        goto cleanup;
    }
    s->arena = flor_pool_take(st, total, w->any_cuda);
    if (s->arena == NULL) {
        goto cleanup;
    }
    base = s->arena->base;
    t0 = flor_now();
    for (i = 0; i < s->n_blobs; i++) {
        flor_blob *b = &s->blobs[i];
        if (b->where == FLOR_BLOB_BUFFER && PyBuffer_IsContiguous(b->view, 'C')) {
            b->where = FLOR_BLOB_HOST; /* the view stays held until released below */
        }
        if (b->recheck && recheck_storage(b) < 0) {
            goto cleanup;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    /* Only raw memory here: sources are kept alive by blob owners/views. */
    for (i = 0; i < s->n_blobs; i++) {
        flor_blob *b = &s->blobs[i];
        uint64_t pad = flor_align_up(b->nbytes) - b->nbytes;
        if (b->where == FLOR_BLOB_HOST && b->nbytes > 0 && hash) {
            /* Hash each piece just copied, while it is in cache. */
            uint64_t done = 0, h = flor_hash64_start(b->nbytes);
            while (done < b->nbytes) {
                size_t n = (size_t)(b->nbytes - done < FLOR_HASH_CHUNK ? b->nbytes - done
                                                                       : FLOR_HASH_CHUNK);
                memcpy(base + b->offset + done, b->src + done, n);
                h = flor_hash64_update(h, base + b->offset + done, n);
                done += n;
            }
            b->hash = h;
            b->hashed = 1;
        }
        else if (b->where == FLOR_BLOB_HOST && b->nbytes > 0) {
            memcpy(base + b->offset, b->src, b->nbytes);
        }
        if (pad) {
            memset(base + b->offset + b->nbytes, 0, pad);
        }
    }
    Py_END_ALLOW_THREADS
    for (i = 0; i < s->n_blobs; i++) {
        flor_blob *b = &s->blobs[i];
        if (b->where == FLOR_BLOB_BUFFER &&
            PyBuffer_ToContiguous(base + b->offset, b->view, (Py_ssize_t)b->nbytes, 'C') < 0) {
            goto cleanup;
        }
    }
    /* Queued after the padding above is written: the copies and this
     * thread never touch the same bytes at once. */
    if (w->any_cuda && cuda_start(st, s) < 0) {
        goto cleanup;
    }
    s->copy_seconds = flor_now() - t0;
    rc = 0;
cleanup:
    blobs_release(s->blobs, s->n_blobs);
    return rc;
}

static void
add_path_note(walker *w)
{
    PyObject *type, *value, *tb, *sep = NULL, *rev = NULL, *joined = NULL, *note = NULL, *r = NULL;
    if (PyList_GET_SIZE(w->path) == 0) {
        return;
    }
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    rev = PyList_GetSlice(w->path, 0, PyList_GET_SIZE(w->path));
    if (rev != NULL && PyList_Reverse(rev) == 0 && (sep = PyUnicode_FromString("")) != NULL &&
        (joined = PyUnicode_Join(sep, rev)) != NULL &&
        (note = PyUnicode_FromFormat("while taking a flor snapshot of obj%U", joined)) != NULL &&
        value != NULL) {
        r = PyObject_CallMethod(value, "add_note", "(O)", note);
    }
    if (r == NULL) {
        PyErr_Clear();
    }
    Py_XDECREF(r);
    Py_XDECREF(note);
    Py_XDECREF(joined);
    Py_XDECREF(sep);
    Py_XDECREF(rev);
    PyErr_Restore(type, value, tb);
}

/* The walk alone: a snapshot whose blobs still point at their sources
 * (copy_phase or a fingerprint then reads them and releases them).
 * On success *w keeps only what copy_phase needs.  With spans, each
 * blob also gets the bytes its tensors view (version 3 fingerprints). */
static FlorSnapshot *
walk_object(flor_state *st, PyObject *obj, walker *w, int spans)
{
    FlorSnapshot *s = NULL;
    PyObject *skeleton = NULL;
    int gc_was;

    memset(w, 0, sizeof(*w));
    w->st = st;
    w->spans = spans;
    if (flor_torch_init(st) < 0 || flor_numpy_init(st) < 0) {
        return NULL;
    }
    w->keep = PyList_New(0);
    w->path = PyList_New(0);
    if (w->keep == NULL || w->path == NULL) {
        goto error;
    }
    gc_was = PyGC_Disable();
    skeleton = walk(w, obj, 1);
    if (gc_was) {
        PyGC_Enable();
    }
    if (skeleton == NULL) {
        add_path_note(w);
        goto error;
    }
    s = PyObject_New(FlorSnapshot, st->SnapshotType);
    if (s == NULL) {
        goto error;
    }
    s->skeleton = skeleton;
    skeleton = NULL;
    s->entries = w->entries;
    s->n_entries = w->n_entries;
    s->blobs = w->blobs;
    s->n_blobs = w->n_blobs;
    s->arena = NULL;
    s->nbytes = s->data_bytes = 0;
    s->owner = getpid();
    s->copy_seconds = 0.0;
    s->tree = !w->not_tree;
    s->foreign = w->foreign;
    s->pending = NULL;
    w->entries = NULL;
    w->blobs = NULL;
    /* The memo must not outlive the walk: drop it before reading bytes. */
    pmap_free(&w->memo);
    pmap_free(&w->storages);
    Py_CLEAR(w->keep);
    Py_CLEAR(w->path);
    Py_CLEAR(w->deep_memo);
    return s;
error:
    Py_XDECREF(skeleton);
    blobs_release(w->blobs, w->n_blobs);
    free(w->blobs);
    flor_entries_free(w->entries, w->n_entries);
    pmap_free(&w->memo);
    pmap_free(&w->storages);
    Py_XDECREF(w->keep);
    Py_XDECREF(w->path);
    Py_CLEAR(w->deep_memo);
    return NULL;
}

PyObject *
flor_snapshot_ex(flor_state *st, PyObject *obj, flor_reserve_fn reserve, void *ctx, int hash)
{
    walker w;
    FlorSnapshot *s = walk_object(st, obj, &w, 0);
    if (s != NULL && copy_phase(&w, s, reserve, ctx, hash) < 0) {
        Py_CLEAR(s);
    }
    return (PyObject *)s;
}

/* The bytes of a host blob, contiguous: its source, or a copy into *tmp of
 * a strided buffer (the caller frees *tmp).  NULL with an exception set. */
static const char *
host_bytes(flor_blob *b, char **tmp)
{
    *tmp = NULL;
    if (b->where == FLOR_BLOB_HOST && b->recheck && recheck_storage(b) < 0) {
        return NULL;
    }
    if (b->where == FLOR_BLOB_BUFFER && !PyBuffer_IsContiguous(b->view, 'C')) {
        *tmp = malloc((size_t)b->nbytes);
        if (*tmp == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        if (PyBuffer_ToContiguous(*tmp, b->view, (Py_ssize_t)b->nbytes, 'C') < 0) {
            free(*tmp);
            *tmp = NULL;
            return NULL;
        }
        return *tmp;
    }
    return b->src;
}

static void
le64(unsigned char *out, uint64_t v)
{
    int k;
    for (k = 0; k < 8; k++) {
        out[k] = (unsigned char)(v >> (8 * k));
    }
}

/* Version 1: CRC-32C of every blob's bytes, each preceded by its length,
 * read where they are (a CUDA blob through a host copy). */
static int
fingerprint_v1(FlorSnapshot *s, uint64_t *out)
{
    uint32_t crc = 0, i;
    int rc = -1;
    char *tmp = NULL;
    PyObject *host = NULL, *ptr = NULL;
    for (i = 0; i < s->n_blobs; i++) {
        flor_blob *b = &s->blobs[i];
        unsigned char len[8];
        const char *src;
        le64(len, b->nbytes);
        crc = flor_crc32c(crc, len, 8);
        if (b->nbytes == 0) {
            continue;
        }
        if (b->where == FLOR_BLOB_CUDA) {
            host = PyObject_CallMethod(b->owner, "cpu", NULL);
            ptr = host == NULL ? NULL : PyObject_CallMethod(host, "data_ptr", NULL);
            src = ptr == NULL ? NULL : PyLong_AsVoidPtr(ptr);
        }
        else {
            src = host_bytes(b, &tmp);
        }
        if (src == NULL) {
            goto cleanup;
        }
        /* Only raw memory: its owner (view, storage, host copy) is held. */
        Py_BEGIN_ALLOW_THREADS
        crc = flor_crc32c(crc, src, (size_t)b->nbytes);
        Py_END_ALLOW_THREADS
        free(tmp);
        tmp = NULL;
        Py_CLEAR(host);
        Py_CLEAR(ptr);
    }
    *out = crc;
    rc = 0;
cleanup:
    free(tmp);
    Py_XDECREF(host);
    Py_XDECREF(ptr);
    return rc;
}

/* Versions 2 and 3: the CRC-32C of the blobs' lengths and of the digest
 * (crc32c.c) of their bytes, each blob starting at a fresh 8-byte word;
 * CUDA blobs are digested on their device (flor._cuda.digest), with no host
 * copy.  Version 2 reads whole blobs; version 3 reads, of a blob reached
 * through tensors, only the bytes they view (its span: a storage's other
 * bytes may never have been written, and differ from run to run); its
 * length is the span's.  Bit 32 (version 2)
 * or bit 33 (version 3) is set: a recorded value tells its version.  With
 * `later` set, the value is not waited for: *later gets flor._cuda.later's
 * object, given the CRC of the lengths and the host blobs' sum, which adds
 * the device's sum once the device has it (fingerprint(obj, 3, True)). */
static int
fingerprint_v2(flor_state *st, FlorSnapshot *s, long version, uint64_t *out, PyObject **later)
{
    uint32_t crc = 0, i;
    uint64_t total = 0, index = 0;
    unsigned char bytes[8];
    int rc = -1;
    PyObject *device = NULL, *helper, *r = NULL;

    for (i = 0; i < s->n_blobs; i++) {
        flor_blob *b = &s->blobs[i];
        uint64_t lo = 0, n = b->nbytes;
        if (version >= 3 && b->spanned) {
            lo = b->lo < b->hi ? b->lo : 0;
            n = b->lo < b->hi ? b->hi - b->lo : 0;
        }
        le64(bytes, n);
        crc = flor_crc32c(crc, bytes, 8);
        if (n == 0) {
            continue;
        }
        if (b->where == FLOR_BLOB_CUDA) {
            PyObject *item = Py_BuildValue("(OKKK)", b->owner, (unsigned long long)index,
                                           (unsigned long long)lo, (unsigned long long)n);
            int e = item == NULL || (device == NULL && (device = PyList_New(0)) == NULL) ||
                    PyList_Append(device, item) < 0;
            Py_XDECREF(item);
            if (e) {
                goto cleanup;
            }
        }
        else {
            char *tmp;
            const char *src = host_bytes(b, &tmp);
            if (src == NULL) {
                goto cleanup;
            }
            Py_BEGIN_ALLOW_THREADS
            total = flor_digest64(total, index, src + lo, (size_t)n);
            Py_END_ALLOW_THREADS
            free(tmp);
        }
        index += (n + 7) / 8;
    }
    if (later != NULL) {
        if (device == NULL && (device = PyList_New(0)) == NULL) {
            goto cleanup;
        }
        helper = cuda_helper(st);
        *later = helper == NULL
                     ? NULL
                     : PyObject_CallMethod(helper, "later", "OkKl", device, (unsigned long)crc,
                                           (unsigned long long)total, version);
        rc = *later == NULL ? -1 : 0;
        goto cleanup;
    }
    if (device != NULL) {
        helper = cuda_helper(st);
        r = helper == NULL ? NULL : PyObject_CallMethod(helper, "digest", "(O)", device);
        if (r == NULL) {
            goto cleanup;
        }
        total += PyLong_AsUnsignedLongLong(r);
        if (PyErr_Occurred()) {
            goto cleanup;
        }
    }
    le64(bytes, total);
    *out = (uint64_t)1 << (version >= 3 ? 33 : 32) | flor_crc32c(crc, bytes, 8);
    rc = 0;
cleanup:
    Py_XDECREF(device);
    Py_XDECREF(r);
    return rc;
}

/* ------------------------------------------------------------------ */
/* Snapshot type.                                                       */

static void
snapshot_dealloc(FlorSnapshot *s)
{
    PyTypeObject *tp = Py_TYPE(s);
    PyObject *t, *v, *tb;
    flor_state *st;
    /* Deallocation may run while an exception propagates: keep it, and
     * never leave one of our own set. */
    PyErr_Fetch(&t, &v, &tb);
    st = flor_state_of_type(tp);
    if (st == NULL) {
        PyErr_Clear(); /* the module is gone (interpreter teardown) */
    }
    if (s->pending != NULL) {
        /* The arena goes back to the pool only once no copy writes into it;
         * where that cannot be known (a forked child, a failed wait, the
         * module gone) it is never reused. */
        int landed = st != NULL && s->owner == getpid() && flor_snapshot_wait(s) == 0;
        if (!landed) {
            PyErr_Clear();
            Py_CLEAR(s->pending);
            s->arena = NULL;
        }
    }
    Py_XDECREF(s->skeleton);
    blobs_release(s->blobs, s->n_blobs);
    free(s->blobs);
    flor_entries_free(s->entries, s->n_entries);
    if (s->arena != NULL) {
        if (st != NULL) {
            flor_pool_give(st, s->arena);
        }
        else {
            if (s->arena->owner == getpid()) {
                munmap(s->arena->base, s->arena->cap);
            }
            free(s->arena);
        }
    }
    PyObject_Free(s);
    Py_DECREF(tp);
    PyErr_Restore(t, v, tb);
}

static int
snapshot_check_owner(FlorSnapshot *s)
{
    if (s->owner != getpid()) {
        PyErr_Format(PyExc_RuntimeError,
                     "this flor snapshot was taken in process %ld; its staging memory is not "
                     "inherited by forked children. Take the snapshot in this process.",
                     (long)s->owner);
        return -1;
    }
    return 0;
}

static PyObject *
snapshot_restore(FlorSnapshot *s)
{
    flor_state *st = flor_state_of_type(Py_TYPE(s));
    PyObject *meta = NULL, *res = NULL;
    flor_loader ld;
    if (st == NULL || snapshot_check_owner(s) < 0 || flor_snapshot_wait(s) < 0) {
        return NULL;
    }
    meta = flor_pickle_skeleton(st, s->skeleton, s->tree);
    if (meta == NULL) {
        return NULL;
    }
    memset(&ld, 0, sizeof(ld));
    ld.entries = s->entries;
    ld.n_entries = s->n_entries;
    ld.blobs = s->blobs;
    ld.n_blobs = s->n_blobs;
    ld.data = s->arena != NULL ? s->arena->base : NULL;
    ld.path = "<snapshot>";
    res = flor_unpickle(st, NULL, meta, &ld);
    Py_DECREF(meta);
    return res;
}

static PyObject *
snapshot_restore_meth(FlorSnapshot *s, PyObject *Py_UNUSED(ignored))
{
    return snapshot_restore(s);
}

static PyObject *
snapshot_get_nbytes(FlorSnapshot *s, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(s->nbytes);
}

static PyObject *
snapshot_get_copy_seconds(FlorSnapshot *s, void *Py_UNUSED(closure))
{
    return PyFloat_FromDouble(s->copy_seconds);
}

static PyObject *
snapshot_get_ntensors(FlorSnapshot *s, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLong(s->n_entries);
}

static PyObject *
snapshot_repr(FlorSnapshot *s)
{
    return PyUnicode_FromFormat("<flor.Snapshot %u arrays, %llu bytes>", s->n_entries,
                                (unsigned long long)s->nbytes);
}

PyDoc_STRVAR(snapshot_restore_doc,
             "restore($self, /)\n--\n\n"
             "Return a fresh copy of the captured object.\n\n"
             "Tensors come back on the CPU; objects captured through state_dict()\n"
             "come back as their state dict. Each call returns new objects.");

static PyMethodDef snapshot_methods[] = {
    {"restore", FLOR_CFUNC(snapshot_restore_meth), METH_NOARGS, snapshot_restore_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef snapshot_getset[] = {
    {"nbytes", (getter)snapshot_get_nbytes, NULL, "Bytes of tensor and array data held.", NULL},
    {"copy_seconds", (getter)snapshot_get_copy_seconds, NULL,
     "Seconds spent copying bytes into the staging buffer.", NULL},
    {"narrays", (getter)snapshot_get_ntensors, NULL, "Number of tensors and arrays held.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot snapshot_slots[] = {
    {Py_tp_dealloc, snapshot_dealloc},
    {Py_tp_methods, snapshot_methods},
    {Py_tp_getset, snapshot_getset},
    {Py_tp_repr, snapshot_repr},
    {Py_tp_doc, "An isolated copy of an object, taken by flor.snapshot()."},
    {0, NULL},
};

PyType_Spec flor_snapshot_spec = {
    .name = "flor.Snapshot",
    .basicsize = sizeof(FlorSnapshot),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = snapshot_slots,
};

/* ------------------------------------------------------------------ */
/* Module functions.                                                    */

PyDoc_STRVAR(snapshot_doc,
             "snapshot(obj, /)\n--\n\n"
             "Return a flor.Snapshot: an isolated copy of obj that shares no mutable\n"
             "memory with it. Tensors on any device are copied to host memory.");

static PyObject *
mod_snapshot(PyObject *module, PyObject *obj)
{
    return flor_snapshot_ex((flor_state *)PyModule_GetState(module), obj, NULL, NULL, 0);
}

static int
measure_only(void *Py_UNUSED(ctx), uint64_t Py_UNUSED(nbytes))
{
    return 1;
}

PyDoc_STRVAR(measure_doc,
             "measure(obj, on_device=False, /)\n--\n\n"
             "Bytes of tensor and array data a snapshot of obj would hold, found by\n"
             "the same walk without copying any data; with on_device, (bytes, bytes\n"
             "of them in CUDA tensors).");

static PyObject *
mod_measure(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *s = NULL, *r = NULL;
    int split = 0;
    uint64_t device = 0;
    uint32_t i;
    if (flor_check_nargs("measure", nargs, 1, 2) < 0 ||
        (nargs == 2 && (split = PyObject_IsTrue(args[1])) < 0)) {
        return NULL;
    }
    s = flor_snapshot_ex((flor_state *)PyModule_GetState(module), args[0], measure_only, NULL, 0);
    if (s == NULL) {
        return NULL;
    }
    for (i = 0; i < ((FlorSnapshot *)s)->n_blobs; i++) {
        const flor_blob *b = &((FlorSnapshot *)s)->blobs[i];
        device += b->where == FLOR_BLOB_CUDA ? b->nbytes : 0;
    }
    r = split ? Py_BuildValue("(KK)", (unsigned long long)((FlorSnapshot *)s)->nbytes,
                              (unsigned long long)device)
              : PyLong_FromUnsignedLongLong(((FlorSnapshot *)s)->nbytes);
    Py_DECREF(s);
    return r;
}

PyDoc_STRVAR(fingerprint_doc,
             "fingerprint(obj, version=3, later=False, /)\n--\n\n"
             "A checksum of the bytes of every tensor and array a snapshot of obj would\n"
             "hold, read in place (found by the same walk, without copying). Version 3\n"
             "(bit 33 set) reads of each tensor storage only the bytes the tensors\n"
             "view; version 2 (bit 32), of records made before it, whole storages.\n"
             "Both read CUDA tensors on their device and equal the fingerprint of the\n"
             "same bytes on the host; version 1, of older records, is the CRC-32C of\n"
             "the bytes. With later true (versions 2 and 3), returns an object whose\n"
             "value() is the fingerprint: the call\n"
             "queues the device's part and does not wait for the kernels queued\n"
             "before it; value() waits for that part alone (flor._cuda.Later).");

static PyObject *
mod_fingerprint(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    flor_state *st = (flor_state *)PyModule_GetState(module);
    walker w;
    uint64_t fp = 0;
    long version = 3;
    int rc, later = 0;
    FlorSnapshot *s;
    PyObject *lazy = NULL;
    if (flor_check_nargs("fingerprint", nargs, 1, 3) < 0) {
        return NULL;
    }
    if (nargs == 3 && (later = PyObject_IsTrue(args[2])) < 0) {
        return NULL;
    }
    if (nargs >= 2) {
        version = PyLong_AsLong(args[1]);
        if (version == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (version < 1 || version > 3) {
            PyErr_Format(PyExc_ValueError, "fingerprint: version must be 1, 2 or 3, not %ld",
                         version);
            return NULL;
        }
    }
    if (later && version == 1) {
        PyErr_SetString(PyExc_ValueError, "fingerprint: later is for versions 2 and 3 only");
        return NULL;
    }
    s = walk_object(st, args[0], &w, version >= 3);
    if (s == NULL) {
        return NULL;
    }
    rc = version == 1 ? fingerprint_v1(s, &fp)
                      : fingerprint_v2(st, s, version, &fp, later ? &lazy : NULL);
    blobs_release(s->blobs, s->n_blobs);
    Py_DECREF(s);
    if (rc < 0) {
        return NULL;
    }
    return later ? lazy : PyLong_FromUnsignedLongLong(fp);
}

PyMethodDef flor_walk_functions[] = {
    {"fingerprint", FLOR_CFUNC(mod_fingerprint), METH_FASTCALL, fingerprint_doc},
    {"snapshot", FLOR_CFUNC(mod_snapshot), METH_O, snapshot_doc},
    {"measure", FLOR_CFUNC(mod_measure), METH_FASTCALL, measure_doc},
    {NULL, NULL, 0, NULL},
};
