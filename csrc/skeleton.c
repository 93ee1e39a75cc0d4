/* skeleton.c: the skeleton of a snapshot, a copy of the object in which each
 * tensor, array and torch constant is a placeholder (Ref), and its way back.
 *
 *     class Ref:                              # what the walk leaves in place
 *         kind, index, payload                # of bytes: TENSOR / ARRAY / BYTEARRAY
 *         def __reduce__(self):               # -> entry `index` of the table;
 *             return _rebuild, (kind, index, payload)   # constants by payload
 *
 *     def pickle_skeleton(skeleton, tree):    # cloudpickle, protocol 5; a tree
 *         return dumps(skeleton)              # (nothing referenced twice) without
 *                                             # the pickler's memo
 *     def unpickle(meta, loader):             # loader: the table, the bytes and
 *         with loader active on this thread:  # a map_location hook
 *             return pickle.loads(meta)       # each Ref calls _rebuild
 *
 *     def _rebuild(kind, index, payload):
 *         no loader active -> Ref(kind, index, payload)  # unpickled elsewhere
 *         TENSOR -> torch.empty(0, dtype).set_(storage of its blob, offset, size, stride)
 *                   (a Parameter, a subclass and requires_grad put back)
 *         ARRAY  -> numpy.frombuffer(blob).reshape(shape);  BYTEARRAY -> bytearray(blob)
 *         dtype / device / Size / Generator -> rebuilt from payload
 *
 * Used by walk.c (Snapshot.restore), reader.c (load) and materializer.c
 * (pickling in a writer); it depends on none of them.
 */
#include "flor.h"

#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ */
/* Ref: the placeholder a skeleton holds in place of bytes.             */

typedef struct {
    PyObject_HEAD
    int kind;
    Py_ssize_t index;
    PyObject *payload;
} FlorRef;

PyObject *
flor_ref_new(flor_state *st, int kind, Py_ssize_t index, PyObject *payload)
{
    FlorRef *r = PyObject_New(FlorRef, st->RefType);
    if (r == NULL) {
        return NULL;
    }
    r->kind = kind;
    r->index = index;
    r->payload = Py_NewRef(payload != NULL ? payload : Py_None);
    return (PyObject *)r;
}

static void
ref_dealloc(FlorRef *r)
{
    PyTypeObject *tp = Py_TYPE(r);
    Py_XDECREF(r->payload);
    PyObject_Free(r);
    Py_DECREF(tp);
}

static PyObject *
ref_reduce(FlorRef *r, PyObject *Py_UNUSED(ignored))
{
    flor_state *st = flor_state_of_type(Py_TYPE(r));
    if (st == NULL) {
        return NULL;
    }
    return Py_BuildValue("O(inO)", st->rebuild, r->kind, r->index, r->payload);
}

static PyObject *
ref_repr(FlorRef *r)
{
    return PyUnicode_FromFormat("<flor Ref kind=%d index=%zd payload=%R>", r->kind, r->index,
                                r->payload);
}

static PyMethodDef ref_methods[] = {
    {"__reduce__", FLOR_CFUNC(ref_reduce), METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot ref_slots[] = {
    {Py_tp_dealloc, ref_dealloc},
    {Py_tp_methods, ref_methods},
    {Py_tp_repr, ref_repr},
    {Py_tp_doc, "Placeholder for staged bytes inside a snapshot skeleton."},
    {0, NULL},
};

PyType_Spec flor_ref_spec = {
    .name = "flor._core.Ref",
    .basicsize = sizeof(FlorRef),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = ref_slots,
};

/* ------------------------------------------------------------------ */
/* Pickling.                                                            */

/* Pickle a tree without the pickler's memo: no object in it is referenced
 * twice, so the memo would only cost time (4-5x on many small containers). */
static PyObject *
pickle_tree(flor_state *st, PyObject *skeleton)
{
    PyObject *bio = NULL, *p = NULL, *r = NULL, *res = NULL;
    bio = PyObject_CallNoArgs(st->BytesIO);
    p = bio == NULL ? NULL : PyObject_CallFunction(st->Pickler, "Oi", bio, 5);
    if (p == NULL || PyObject_SetAttrString(p, "fast", Py_True) < 0) {
        goto cleanup;
    }
    r = PyObject_CallMethod(p, "dump", "(O)", skeleton);
    if (r != NULL) {
        res = PyObject_CallMethod(bio, "getvalue", NULL);
    }
cleanup:
    Py_XDECREF(bio);
    Py_XDECREF(p);
    Py_XDECREF(r);
    return res;
}

PyObject *
flor_pickle_skeleton(flor_state *st, PyObject *skeleton, int tree)
{
    if (st->dumps == NULL) {
        PyObject *cp = PyImport_ImportModule("cloudpickle"), *io = NULL;
        if (cp == NULL) {
            return NULL;
        }
        io = PyImport_ImportModule("io");
        st->dumps = PyObject_GetAttrString(cp, "dumps");
        st->Pickler = PyObject_GetAttrString(cp, "Pickler");
        st->BytesIO = io == NULL ? NULL : PyObject_GetAttrString(io, "BytesIO");
        Py_DECREF(cp);
        Py_XDECREF(io);
        if (st->dumps == NULL || st->Pickler == NULL || st->BytesIO == NULL) {
            Py_CLEAR(st->dumps);
            Py_CLEAR(st->Pickler);
            Py_CLEAR(st->BytesIO);
            return NULL;
        }
    }
    if (tree) {
        PyObject *res = pickle_tree(st, skeleton);
        if (res != NULL) {
            return res;
        }
        /* e.g. cloudpickle pickling a recursive function by value */
        PyErr_Clear();
    }
    return PyObject_CallFunction(st->dumps, "Oi", skeleton, 5);
}

/* ------------------------------------------------------------------ */
/* Unpickling: Refs back to tensors, arrays and torch constants.        */

static flor_loader *
current_loader(flor_state *st)
{
    PyObject *key, *cap;
    flor_loader *ld = NULL;
    key = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
    if (key == NULL) {
        return NULL;
    }
    cap = PyDict_GetItemWithError(st->loaders, key);
    Py_DECREF(key);
    if (cap != NULL) {
        ld = PyCapsule_GetPointer(cap, "flor.loader");
    }
    return ld;
}

PyObject *
flor_unpickle(flor_state *st, PyObject *loads, PyObject *meta, flor_loader *ld)
{
    PyObject *key = NULL, *prev = NULL, *cap = NULL, *res = NULL;
    uint32_t i;

    ld->storages = calloc(ld->n_blobs ? ld->n_blobs : 1, sizeof(PyObject *));
    ld->verified = calloc(ld->n_blobs ? ld->n_blobs : 1, 1);
    if (ld->storages == NULL || ld->verified == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    key = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
    cap = PyCapsule_New(ld, "flor.loader", NULL);
    if (key == NULL || cap == NULL) {
        goto cleanup;
    }
    prev = PyDict_GetItemWithError(st->loaders, key);
    Py_XINCREF(prev);
    if (PyErr_Occurred() || PyDict_SetItem(st->loaders, key, cap) < 0) {
        goto cleanup;
    }
    res = PyObject_CallOneArg(loads != NULL ? loads : st->loads, meta);
    /* Restore the enclosing load's context, keeping any exception. */
    {
        PyObject *t, *v, *tb;
        int r;
        PyErr_Fetch(&t, &v, &tb);
        r = prev != NULL ? PyDict_SetItem(st->loaders, key, prev)
                         : PyDict_DelItem(st->loaders, key);
        if (r < 0) {
            PyErr_Clear();
        }
        PyErr_Restore(t, v, tb);
    }
cleanup:
    if (ld->storages != NULL) {
        for (i = 0; i < ld->n_blobs; i++) {
            Py_XDECREF(ld->storages[i]);
        }
    }
    free(ld->storages);
    free(ld->verified);
    ld->storages = NULL;
    ld->verified = NULL;
    Py_XDECREF(prev);
    Py_XDECREF(cap);
    Py_XDECREF(key);
    return res;
}

/* Where blob `bi` lies: its Mapping (NULL for a snapshot, whose bytes are
 * copied) and its offset there.  A file's blob has its CRC checked the first
 * time it is used; a mismatch raises FormatError naming the file. */
static const char *
blob_bytes(flor_state *st, flor_loader *ld, uint32_t bi, PyObject **mapping, uint64_t *moff)
{
    const flor_blob *b = &ld->blobs[bi];
    const char *p;
    uint32_t crc;
    if (ld->maps == NULL) {
        *mapping = NULL;
        *moff = 0;
        return ld->data + b->offset;
    }
    *mapping = ld->maps[b->source];
    *moff = ld->data_offs[b->source] + b->offset;
    p = ((FlorMapping *)*mapping)->base + *moff;
    if (!ld->verified[bi]) {
        Py_BEGIN_ALLOW_THREADS
        crc = flor_crc32c(0, p, (size_t)b->nbytes);
        Py_END_ALLOW_THREADS
        if (crc != b->crc) {
            if (b->source != 0) {
                flor_format_error(st, ld->path, "data",
                                  "checksum mismatch in blob %u (%llu bytes, stored in %s)", bi,
                                  (unsigned long long)b->nbytes, ld->sources[b->source - 1]);
            }
            else {
                flor_format_error(st, ld->path, "data",
                                  "checksum mismatch in blob %u (%llu bytes at file offset %llu)",
                                  bi, (unsigned long long)b->nbytes, (unsigned long long)*moff);
            }
            return NULL;
        }
        ld->verified[bi] = 1;
    }
    return p;
}

static PyObject *
torch_module(flor_state *st)
{
    PyObject *torch = PyImport_ImportModule("torch");
    if (torch == NULL) {
        return NULL;
    }
    if (flor_torch_init(st) < 0) {
        Py_DECREF(torch);
        return NULL;
    }
    return torch;
}

static PyObject *
dims_tuple(const flor_entry *e, int strides)
{
    PyObject *t = PyTuple_New(e->ndim);
    int k;
    if (t == NULL) {
        return NULL;
    }
    for (k = 0; k < e->ndim; k++) {
        PyObject *v = PyLong_FromLongLong(e->dims[(strides ? e->ndim : 0) + k]);
        if (v == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, k, v);
    }
    return t;
}

/* The bytes of one blob as an untyped torch storage (cached per load). */
static PyObject *
blob_storage(flor_state *st, flor_loader *ld, uint32_t bi, const char *device)
{
    const flor_blob *b = &ld->blobs[bi];
    PyObject *u8 = NULL, *storage = NULL, *kw = NULL, *args = NULL, *fn = NULL, *ptr = NULL;
    PyObject *mapping;
    const char *src;
    uint64_t moff;

    if (ld->storages[bi] != NULL) {
        return Py_NewRef(ld->storages[bi]);
    }
    src = blob_bytes(st, ld, bi, &mapping, &moff);
    if (src == NULL) {
        return NULL;
    }
    if (mapping != NULL && !b->copy && b->nbytes > 0) {
        fn = PyObject_GetAttrString(st->torch, "frombuffer");
        args = PyTuple_Pack(1, mapping);
        kw = Py_BuildValue("{s:O,s:K,s:K}", "dtype", st->uint8, "count",
                           (unsigned long long)b->nbytes, "offset", (unsigned long long)moff);
        if (fn == NULL || args == NULL || kw == NULL) {
            goto cleanup;
        }
        u8 = PyObject_Call(fn, args, kw);
    }
    else {
        fn = PyObject_GetAttrString(st->torch, "empty");
        args = Py_BuildValue("((K))", (unsigned long long)b->nbytes);
        kw = Py_BuildValue("{s:O}", "dtype", st->uint8);
        if (fn == NULL || args == NULL || kw == NULL) {
            goto cleanup;
        }
        u8 = PyObject_Call(fn, args, kw);
        if (u8 != NULL && b->nbytes > 0) {
            char *dst;
            ptr = PyObject_CallMethod(u8, "data_ptr", NULL);
            if (ptr == NULL) {
                goto cleanup;
            }
            dst = PyLong_AsVoidPtr(ptr);
            if (dst == NULL) {
                goto cleanup;
            }
            Py_BEGIN_ALLOW_THREADS
            memcpy(dst, src, (size_t)b->nbytes);
            Py_END_ALLOW_THREADS
        }
    }
    if (u8 == NULL) {
        goto cleanup;
    }
    storage = PyObject_CallMethod(u8, "untyped_storage", NULL);
    if (storage != NULL && ld->hook != NULL) {
        Py_SETREF(storage, PyObject_CallFunction(ld->hook, "Os", storage, device));
        ld->hook_failed = storage == NULL;
    }
    if (storage != NULL) {
        ld->storages[bi] = Py_NewRef(storage);
    }
cleanup:
    Py_XDECREF(u8);
    Py_XDECREF(kw);
    Py_XDECREF(args);
    Py_XDECREF(fn);
    Py_XDECREF(ptr);
    return storage;
}

static int
check_extent(flor_state *st, flor_loader *ld, const flor_entry *e, uint64_t itemsize,
             Py_ssize_t index)
{
    const uint64_t limit = (uint64_t)1 << 62;
    uint64_t last = (uint64_t)e->storage_offset;
    int k;
    if (itemsize == 0 || last > limit) {
        goto bad;
    }
    for (k = 0; k < e->ndim; k++) {
        uint64_t size = (uint64_t)e->dims[k], stride = (uint64_t)e->dims[e->ndim + k];
        if (size == 0) {
            return 0; /* an empty view touches no bytes */
        }
        if (stride != 0 && (size - 1) > limit / stride) {
            goto bad;
        }
        last += (size - 1) * stride;
        if (last > limit) {
            goto bad;
        }
    }
    if (last + 1 > limit / itemsize || (last + 1) * itemsize > ld->blobs[e->blob].nbytes) {
        goto bad;
    }
    return 0;
bad:
    flor_format_error(st, ld->path, "tensor table",
                      "entry %zd addresses bytes beyond its %llu-byte blob", index,
                      (unsigned long long)ld->blobs[e->blob].nbytes);
    return -1;
}

static PyObject *
build_tensor(flor_state *st, flor_loader *ld, Py_ssize_t index, PyObject *cls)
{
    const flor_entry *e;
    PyObject *torch = NULL, *storage = NULL, *dtype = NULL, *t = NULL, *device = NULL;
    PyObject *size = NULL, *stride = NULL, *itemsize = NULL, *res = NULL, *kw = NULL, *args = NULL;
    PyObject *empty = NULL;
    int rg;

    e = &ld->entries[index];
    if (e->kind != FLOR_REF_TENSOR) {
        flor_format_error(st, ld->path, "metadata", "reference %zd is not a tensor", index);
        return NULL;
    }
    torch = torch_module(st);
    if (torch == NULL) {
        return NULL;
    }
    dtype = PyObject_GetAttrString(torch, e->dtype);
    if (dtype == NULL || !PyObject_TypeCheck(dtype, (PyTypeObject *)st->dtype_t)) {
        PyErr_Clear();
        flor_format_error(st, ld->path, "tensor table",
                          "unknown tensor dtype '%s' (written by a newer torch?)", e->dtype);
        goto cleanup;
    }
    if (e->dtype[0] == 'q') {
        /* qint8, quint8, ...: the walk refuses them (their bytes lose the
         * scale and zero point), so no file of flor's names one. */
        flor_format_error(st, ld->path, "tensor table",
                          "entry %zd has the quantized dtype '%s', which flor never writes", index,
                          e->dtype);
        goto cleanup;
    }
    itemsize = PyObject_GetAttrString(dtype, "itemsize");
    if (itemsize == NULL ||
        check_extent(st, ld, e, PyLong_AsUnsignedLongLong(itemsize), index) < 0) {
        goto cleanup;
    }
    storage = blob_storage(st, ld, e->blob, e->device);
    if (storage == NULL || (device = PyObject_GetAttrString(storage, "device")) == NULL) {
        goto cleanup;
    }
    empty = PyObject_GetAttrString(torch, "empty");
    args = Py_BuildValue("((i))", 0);
    kw = Py_BuildValue("{s:O,s:O}", "dtype", dtype, "device", device);
    size = dims_tuple(e, 0);
    stride = dims_tuple(e, 1);
    if (empty == NULL || args == NULL || kw == NULL || size == NULL || stride == NULL) {
        goto cleanup;
    }
    t = PyObject_Call(empty, args, kw);
    if (t == NULL) {
        goto cleanup;
    }
    Py_SETREF(t, PyObject_CallMethod(t, "set_", "OLOO", storage, (long long)e->storage_offset, size,
                                     stride));
    if (t == NULL) {
        goto cleanup;
    }
    rg = (e->flags & FLOR_ENTRY_REQUIRES_GRAD) != 0;
    if (rg) {
        /* Only floating and complex tensors can require gradients: say so
         * before torch refuses (it throws through C++). */
        PyObject *fl = PyObject_GetAttrString(dtype, "is_floating_point");
        PyObject *cx = fl == NULL ? NULL : PyObject_GetAttrString(dtype, "is_complex");
        int ok = cx != NULL && (PyObject_IsTrue(fl) == 1 || PyObject_IsTrue(cx) == 1);
        Py_XDECREF(fl);
        Py_XDECREF(cx);
        if (!ok) {
            if (!PyErr_Occurred()) {
                flor_format_error(st, ld->path, "tensor table",
                                  "entry %zd of dtype %s requires gradients", index, e->dtype);
            }
            goto cleanup;
        }
    }
    if (e->flags & FLOR_ENTRY_PARAMETER) {
        PyObject *pcls = cls != Py_None ? cls : st->Parameter;
        res = PyObject_CallFunction(pcls, "OO", t, rg ? Py_True : Py_False);
        goto cleanup;
    }
    if (cls != Py_None) {
        Py_SETREF(t, PyObject_CallMethod(t, "as_subclass", "(O)", cls));
        if (t == NULL) {
            goto cleanup;
        }
    }
    if (rg) {
        PyObject *r = PyObject_CallMethod(t, "requires_grad_", "(O)", Py_True);
        if (r == NULL) {
            goto cleanup;
        }
        Py_DECREF(r);
    }
    res = Py_NewRef(t);
cleanup:
    Py_XDECREF(torch);
    Py_XDECREF(storage);
    Py_XDECREF(dtype);
    Py_XDECREF(t);
    Py_XDECREF(device);
    Py_XDECREF(size);
    Py_XDECREF(stride);
    Py_XDECREF(itemsize);
    Py_XDECREF(kw);
    Py_XDECREF(args);
    Py_XDECREF(empty);
    return res;
}

static PyObject *
build_array(flor_state *st, flor_loader *ld, Py_ssize_t index)
{
    const flor_entry *e = &ld->entries[index];
    const flor_blob *b = &ld->blobs[e->blob];
    PyObject *np = NULL, *dtype = NULL, *itemsize = NULL, *src = NULL, *arr = NULL, *shape = NULL;
    PyObject *res = NULL, *fn = NULL, *args = NULL, *kw = NULL, *mapping;
    uint64_t nelem = 1, isz, moff;
    const char *bytes;
    int k;

    bytes = blob_bytes(st, ld, e->blob, &mapping, &moff);
    if (bytes == NULL) {
        return NULL;
    }
    if (e->kind == FLOR_REF_BYTEARRAY) {
        return PyByteArray_FromStringAndSize(bytes, (Py_ssize_t)b->nbytes);
    }
    if (e->dtype[0] != '<' && e->dtype[0] != '>' && e->dtype[0] != '|' && e->dtype[0] != '=') {
        return flor_format_error(st, ld->path, "tensor table", "unknown array dtype '%s'",
                                 e->dtype);
    }
    np = PyImport_ImportModule("numpy");
    if (np == NULL) {
        return NULL;
    }
    dtype = PyObject_CallMethod(np, "dtype", "s", e->dtype);
    if (dtype != NULL) {
        /* Arrays of Python objects are never raw bytes. */
        PyObject *obj = PyObject_GetAttrString(dtype, "hasobject");
        int has = obj == NULL ? -1 : PyObject_IsTrue(obj);
        Py_XDECREF(obj);
        if (has != 0) {
            Py_CLEAR(dtype);
        }
    }
    if (dtype == NULL) {
        PyErr_Clear();
        flor_format_error(st, ld->path, "tensor table", "unknown array dtype '%s'", e->dtype);
        goto cleanup;
    }
    itemsize = PyObject_GetAttrString(dtype, "itemsize");
    if (itemsize == NULL) {
        goto cleanup;
    }
    isz = PyLong_AsUnsignedLongLong(itemsize);
    for (k = 0; k < e->ndim; k++) {
        nelem *= (uint64_t)e->dims[k];
    }
    if (PyErr_Occurred()) {
        goto cleanup;
    }
    if (nelem * isz != b->nbytes) {
        flor_format_error(st, ld->path, "tensor table",
                          "array entry %zd needs %llu bytes, its blob has %llu", index,
                          (unsigned long long)(nelem * isz), (unsigned long long)b->nbytes);
        goto cleanup;
    }
    shape = dims_tuple(e, 0);
    if (shape == NULL) {
        goto cleanup;
    }
    if (nelem == 0) {
        res = PyObject_CallMethod(np, "empty", "OO", shape, dtype);
        goto cleanup;
    }
    if (mapping != NULL && b->copy) {
        mapping = NULL; /* its bytes are another blob's too: a private copy */
    }
    if (mapping != NULL) {
        src = Py_NewRef(mapping);
    }
    else {
        src = PyMemoryView_FromMemory((char *)bytes, (Py_ssize_t)b->nbytes, PyBUF_READ);
    }
    fn = PyObject_GetAttrString(np, "frombuffer");
    args = src == NULL ? NULL : PyTuple_Pack(1, src);
    kw = Py_BuildValue("{s:O,s:K,s:K}", "dtype", dtype, "count", (unsigned long long)nelem,
                       "offset", (unsigned long long)(mapping != NULL ? moff : 0));
    if (fn == NULL || args == NULL || kw == NULL) {
        goto cleanup;
    }
    arr = PyObject_Call(fn, args, kw);
    Py_XSETREF(arr, arr == NULL ? NULL : PyObject_CallMethod(arr, "reshape", "(O)", shape));
    if (arr == NULL) {
        goto cleanup;
    }
    res = mapping != NULL ? Py_NewRef(arr) : PyObject_CallMethod(arr, "copy", NULL);
cleanup:
    Py_XDECREF(np);
    Py_XDECREF(dtype);
    Py_XDECREF(itemsize);
    Py_XDECREF(src);
    Py_XDECREF(arr);
    Py_XDECREF(shape);
    Py_XDECREF(fn);
    Py_XDECREF(args);
    Py_XDECREF(kw);
    return res;
}

/* A failure while rebuilding from a well-formed-looking table means the
 * table lies: report it as damage, except errors of the map_location hook
 * (the caller's) and memory errors, which pass through. */
static PyObject *
as_damage(flor_state *st, flor_loader *ld, const char *section, Py_ssize_t index)
{
    PyObject *t, *v, *tb, *msg;
    if (ld->hook_failed || PyErr_ExceptionMatches(st->FormatError) ||
        PyErr_ExceptionMatches(PyExc_MemoryError) ||
        PyErr_ExceptionMatches(PyExc_KeyboardInterrupt)) {
        return NULL;
    }
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    msg = v != NULL ? PyObject_Repr(v) : NULL;
    if (msg == NULL) {
        PyErr_Clear();
    }
    flor_format_error(st, ld->path, section, "reference %zd cannot be rebuilt: %S", index,
                      msg != NULL ? msg : Py_None);
    Py_XDECREF(msg);
    Py_XDECREF(t);
    Py_XDECREF(v);
    Py_XDECREF(tb);
    return NULL;
}

/* A str payload that names a device (flor_device_name). */
static int
device_name(PyObject *o)
{
    const char *s = PyUnicode_Check(o) ? PyUnicode_AsUTF8(o) : NULL;
    if (s == NULL) {
        PyErr_Clear();
        return 0;
    }
    return flor_device_name(s);
}

static int
int_tuple(PyObject *o)
{
    Py_ssize_t i;
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) > FLOR_MAX_NDIM) {
        return 0;
    }
    for (i = 0; i < PyTuple_GET_SIZE(o); i++) {
        if (!PyLong_CheckExact(PyTuple_GET_ITEM(o, i))) {
            return 0;
        }
    }
    return 1;
}

static PyObject *
rebuild(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    flor_state *st = (flor_state *)PyModule_GetState(module);
    flor_loader *ld;
    PyObject *torch = NULL, *res = NULL, *payload;
    int kind;
    Py_ssize_t index;

    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "_rebuild() takes exactly 3 arguments");
        return NULL;
    }
    kind = (int)PyLong_AsLong(args[0]);
    index = PyLong_AsSsize_t(args[1]);
    payload = args[2];
    if (PyErr_Occurred()) {
        return NULL;
    }
    ld = current_loader(st);
    if (ld == NULL) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        /* Unpickled outside flor.load: keep the placeholder. */
        return flor_ref_new(st, kind, index, payload);
    }
    switch (kind) {
    case FLOR_REF_TENSOR:
    case FLOR_REF_ARRAY:
    case FLOR_REF_BYTEARRAY:
        if (index < 0 || (uint64_t)index >= ld->n_entries || ld->entries[index].kind != kind) {
            return flor_format_error(st, ld->path, "metadata",
                                     "reference to entry %zd does not match the tensor table",
                                     index);
        }
        if (kind == FLOR_REF_TENSOR) {
            if (payload != Py_None && (torch = torch_module(st)) == NULL) {
                return NULL;
            }
            Py_CLEAR(torch);
            if (payload != Py_None &&
                (!PyType_Check(payload) ||
                 !PyType_IsSubtype((PyTypeObject *)payload, (PyTypeObject *)st->Tensor))) {
                return flor_format_error(st, ld->path, "metadata",
                                         "reference %zd names a class that is not a tensor", index);
            }
            res = build_tensor(st, ld, index, payload);
        }
        else {
            res = build_array(st, ld, index);
        }
        return res != NULL ? res : as_damage(st, ld, "tensor table", index);
    case FLOR_REF_NAMED:
    case FLOR_REF_DEVICE:
    case FLOR_REF_SIZE:
    case FLOR_REF_GENERATOR:
        torch = torch_module(st);
        if (torch == NULL) {
            return NULL;
        }
        if (kind == FLOR_REF_NAMED) {
            /* Only a dtype, layout or memory format: never any other
             * attribute of torch. */
            Py_ssize_t pos = 0;
            PyObject *k, *v;
            while (PyUnicode_Check(payload) && PyDict_Next(st->atom_names, &pos, &k, &v)) {
                int eq = PyUnicode_Compare(v, payload) == 0;
                if (PyErr_Occurred()) {
                    PyErr_Clear();
                }
                if (eq) {
                    res = Py_NewRef(k);
                    break;
                }
            }
        }
        else if (kind == FLOR_REF_DEVICE) {
            res = device_name(payload) ? PyObject_CallMethod(torch, "device", "(O)", payload)
                                       : NULL;
        }
        else if (kind == FLOR_REF_SIZE) {
            res = int_tuple(payload) ? PyObject_CallMethod(torch, "Size", "(O)", payload) : NULL;
        }
        else if (PyTuple_Check(payload) && PyTuple_GET_SIZE(payload) == 2 &&
                 device_name(PyTuple_GET_ITEM(payload, 0)) &&
                 PyObject_TypeCheck(PyTuple_GET_ITEM(payload, 1), (PyTypeObject *)st->Tensor)) {
            PyObject *r;
            res = PyObject_CallMethod(torch, "Generator", "(O)", PyTuple_GET_ITEM(payload, 0));
            r = res == NULL
                    ? NULL
                    : PyObject_CallMethod(res, "set_state", "(O)", PyTuple_GET_ITEM(payload, 1));
            if (r == NULL) {
                Py_CLEAR(res);
            }
            Py_XDECREF(r);
        }
        Py_DECREF(torch);
        if (res == NULL && !PyErr_Occurred()) {
            flor_format_error(st, ld->path, "metadata", "malformed torch constant %R", payload);
        }
        return res != NULL ? res : as_damage(st, ld, "metadata", index);
    default:
        return flor_format_error(st, ld->path, "metadata", "unknown reference kind %d", kind);
    }
}

PyDoc_STRVAR(rebuild_doc,
             "_rebuild(kind, index, payload, /)\n--\n\n"
             "Unpickling helper: turns a snapshot placeholder back into its object.");

PyMethodDef flor_skeleton_functions[] = {
    {"_rebuild", FLOR_CFUNC(rebuild), METH_FASTCALL, rebuild_doc},
    {NULL, NULL, 0, NULL},
};
