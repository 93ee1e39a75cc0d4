/* module.c: the flor._core extension module (multi-phase init, PEP 489).
 *
 *     snapshot(obj)              -> Snapshot          (walk.c)
 *     measure(obj)               -> bytes a snapshot would hold, no copy
 *     save(obj, path)            -> bytes written     (walk.c + format.c)
 *     load(path, hook)           -> obj               (format.c)
 *     _rebuild(kind, i, payload) -> tensor / array    (unpickling helper)
 *     crc32c(data, crc=0)        -> int
 *     pool_stats() / trim_pool() -> staging-buffer bookkeeping
 *     Materializer               -> background writer (materializer.c)
 *     SkipMachine                -> SkipBlock states and the checkpoint rule (skipblock.c)
 *
 * Nothing here imports torch: torch objects are looked up the first time a
 * snapshot or load runs after someone else imported torch.
 */
#include "flor.h"

#include <string.h>
#include <time.h>

double
flor_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int
flor_check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t lo, Py_ssize_t hi)
{
    if (nargs < lo || nargs > hi) {
        if (lo == hi) {
            PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd arguments (%zd given)", name, lo,
                         nargs);
        }
        else {
            PyErr_Format(PyExc_TypeError, "%s() takes %zd to %zd arguments (%zd given)", name, lo,
                         hi, nargs);
        }
        return 0;
    }
    return 1;
}

PyObject *
flor_format_error(flor_state *st, const char *path, const char *section, const char *fmt, ...)
{
    PyObject *detail, *args;
    va_list va;
    va_start(va, fmt);
    detail = PyUnicode_FromFormatV(fmt, va);
    va_end(va);
    if (detail == NULL) {
        return NULL;
    }
    args = Py_BuildValue("(NsN)", PyUnicode_DecodeFSDefault(path), section, detail);
    if (args != NULL) {
        PyErr_SetObject(st->FormatError, args);
        Py_DECREF(args);
    }
    return NULL;
}

/* Map each torch dtype / layout / memory_format object to its short name. */
static int
collect_atom_names(flor_state *st)
{
    int rc = -1;
    PyObject *names = NULL, *it = NULL, *name;

    names = PyObject_Dir(st->torch);
    if (names == NULL || (it = PyObject_GetIter(names)) == NULL) {
        goto cleanup;
    }
    while ((name = PyIter_Next(it)) != NULL) {
        PyObject *v = PyObject_GetAttr(st->torch, name);
        int r = 0;
        if (v == NULL) {
            PyErr_Clear(); /* lazily failing attributes are not constants */
        }
        else {
            PyObject *tp = (PyObject *)Py_TYPE(v);
            if ((tp == st->dtype_t || tp == st->layout_t || tp == st->memfmt_t) &&
                PyDict_GetItemWithError(st->atom_names, v) == NULL && !PyErr_Occurred()) {
                /* The first name wins: torch.float32 before its alias torch.float. */
                PyObject *s = PyObject_Str(v);
                const char *full = s == NULL ? NULL : PyUnicode_AsUTF8(s);
                PyObject *shortname = full == NULL ? NULL
                                      : PyUnicode_FromString(strncmp(full, "torch.", 6) == 0
                                                                 ? full + 6
                                                                 : full);
                r = shortname == NULL ? -1 : PyDict_SetItem(st->atom_names, v, shortname);
                Py_XDECREF(shortname);
                Py_XDECREF(s);
            }
            r = PyErr_Occurred() ? -1 : r;
            Py_DECREF(v);
        }
        Py_DECREF(name);
        if (r < 0) {
            goto cleanup;
        }
    }
    rc = PyErr_Occurred() ? -1 : 0;
cleanup:
    Py_XDECREF(it);
    Py_XDECREF(names);
    return rc;
}

int
flor_torch_init(flor_state *st)
{
    PyObject *modules, *torch, *nn = NULL, *param = NULL;
    int rc = -1;

    if (st->torch_ready) {
        return 1;
    }
    modules = PyImport_GetModuleDict();
    torch = PyDict_GetItemString(modules, "torch");
    if (torch == NULL) {
        return 0; /* nobody imported torch: no object can be a tensor */
    }
    st->torch = Py_NewRef(torch);
#define GET(field, obj, name)                                            \
    if ((st->field = PyObject_GetAttrString((obj), (name))) == NULL) { \
        goto cleanup;                                                    \
    }
    GET(Tensor, torch, "Tensor");
    GET(Generator, torch, "Generator");
    GET(Size, torch, "Size");
    GET(dtype_t, torch, "dtype");
    GET(device_t, torch, "device");
    GET(layout_t, torch, "layout");
    GET(memfmt_t, torch, "memory_format");
    GET(strided, torch, "strided");
    GET(uint8, torch, "uint8");
#undef GET
    nn = PyImport_ImportModule("torch.nn.parameter");
    if (nn == NULL || (param = PyObject_GetAttrString(nn, "Parameter")) == NULL) {
        goto cleanup;
    }
    st->Parameter = param;
    param = NULL;
    st->atom_names = PyDict_New();
    if (st->atom_names == NULL || collect_atom_names(st) < 0) {
        goto cleanup;
    }
    PyDict_Clear(st->kind_cache); /* types seen before torch was imported */
    st->torch_ready = 1;
    rc = 1;
cleanup:
    Py_XDECREF(nn);
    Py_XDECREF(param);
    if (rc < 0) {
        Py_CLEAR(st->torch);
        Py_CLEAR(st->Tensor);
        Py_CLEAR(st->Parameter);
        Py_CLEAR(st->Generator);
        Py_CLEAR(st->Size);
        Py_CLEAR(st->dtype_t);
        Py_CLEAR(st->device_t);
        Py_CLEAR(st->layout_t);
        Py_CLEAR(st->memfmt_t);
        Py_CLEAR(st->strided);
        Py_CLEAR(st->uint8);
        Py_CLEAR(st->atom_names);
    }
    return rc;
}

int
flor_numpy_init(flor_state *st)
{
    PyObject *np;
    if (st->ndarray != NULL) {
        return 1;
    }
    np = PyDict_GetItemString(PyImport_GetModuleDict(), "numpy");
    if (np == NULL) {
        return 0;
    }
    st->ndarray = PyObject_GetAttrString(np, "ndarray");
    if (st->ndarray == NULL) {
        return -1;
    }
    PyDict_Clear(st->kind_cache);
    return 1;
}

/* ------------------------------------------------------------------ */

static flor_state *
get_state(PyObject *module)
{
    return (flor_state *)PyModule_GetState(module);
}

PyDoc_STRVAR(snapshot_doc,
             "snapshot(obj, /)\n--\n\n"
             "Return a flor.Snapshot: an isolated copy of obj that shares no mutable\n"
             "memory with it. Tensors on any device are copied to host memory.");

static PyObject *
mod_snapshot(PyObject *module, PyObject *obj)
{
    return flor_snapshot_ex(get_state(module), obj, NULL, NULL);
}

static int
measure_only(void *Py_UNUSED(ctx), uint64_t Py_UNUSED(nbytes))
{
    return 1;
}

PyDoc_STRVAR(measure_doc,
             "measure(obj, /)\n--\n\n"
             "Bytes of tensor and array data a snapshot of obj would hold, found by\n"
             "the same walk without copying any data.");

static PyObject *
mod_measure(PyObject *module, PyObject *obj)
{
    PyObject *s = flor_snapshot_ex(get_state(module), obj, measure_only, NULL), *r;
    if (s == NULL) {
        return NULL;
    }
    r = PyLong_FromUnsignedLongLong(((FlorSnapshot *)s)->nbytes);
    Py_DECREF(s);
    return r;
}

PyDoc_STRVAR(save_doc,
             "save(obj, path, /)\n--\n\n"
             "Snapshot obj and write it to path atomically (temp file, fsync, rename,\n"
             "fsync of the directory). Returns (bytes of data, errno, step); errno is\n"
             "0 on success.");

static PyObject *
mod_save(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    flor_state *st = get_state(module);
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
    return flor_load_file(get_state(module), args[0], args[1] == Py_None ? NULL : args[1]);
}

PyDoc_STRVAR(crc32c_doc,
             "crc32c(data, crc=0, /)\n--\n\n"
             "CRC-32C of a bytes-like object, continuing from crc.");

static PyObject *
mod_crc32c(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    unsigned long crc = 0;
    uint32_t r;
    if (!flor_check_nargs("crc32c", nargs, 1, 2)) {
        return NULL;
    }
    if (nargs == 2) {
        crc = PyLong_AsUnsignedLong(args[1]);
        if (PyErr_Occurred()) {
            return NULL;
        }
    }
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    r = flor_crc32c((uint32_t)crc, view.buf, (size_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(r);
}

PyDoc_STRVAR(pool_stats_doc,
             "pool_stats()\n--\n\n"
             "Staging-buffer pool counters: free bytes held, largest request, takes,\n"
             "fresh mappings and their bytes.");

static PyObject *
mod_pool_stats(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    flor_pool *p = &get_state(module)->pool;
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K}", "free_bytes", (unsigned long long)p->free_bytes,
                         "high_water", (unsigned long long)p->high_water, "takes",
                         (unsigned long long)p->takes, "fresh", (unsigned long long)p->fresh,
                         "fresh_bytes", (unsigned long long)p->fresh_bytes);
}

PyDoc_STRVAR(trim_pool_doc,
             "trim_pool()\n--\n\n"
             "Unmap every free staging buffer.");

static PyObject *
mod_trim_pool(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    flor_pool_clear(get_state(module));
    Py_RETURN_NONE;
}

PyDoc_STRVAR(rebuild_doc,
             "_rebuild(kind, index, payload, /)\n--\n\n"
             "Unpickling helper: turns a snapshot placeholder back into its object.");

static PyMethodDef module_methods[] = {
    {"snapshot", FLOR_CFUNC(mod_snapshot), METH_O, snapshot_doc},
    {"measure", FLOR_CFUNC(mod_measure), METH_O, measure_doc},
    {"save", FLOR_CFUNC(mod_save), METH_FASTCALL, save_doc},
    {"load", FLOR_CFUNC(mod_load), METH_FASTCALL, load_doc},
    {"crc32c", FLOR_CFUNC(mod_crc32c), METH_FASTCALL, crc32c_doc},
    {"pool_stats", FLOR_CFUNC(mod_pool_stats), METH_NOARGS, pool_stats_doc},
    {"trim_pool", FLOR_CFUNC(mod_trim_pool), METH_NOARGS, trim_pool_doc},
    {"_rebuild", FLOR_CFUNC(flor_rebuild), METH_FASTCALL, rebuild_doc},
    {"rule", FLOR_CFUNC(flor_rule), METH_FASTCALL, flor_rule_doc},
    {NULL, NULL, 0, NULL},
};

/* ------------------------------------------------------------------ */

static int
add_type(PyObject *module, PyTypeObject **slot, PyType_Spec *spec)
{
    *slot = (PyTypeObject *)PyType_FromModuleAndSpec(module, spec, NULL);
    if (*slot == NULL) {
        return -1;
    }
    return PyModule_AddType(module, *slot);
}

static int
module_exec(PyObject *module)
{
    flor_state *st = get_state(module);
    PyObject *copyreg = NULL, *copy = NULL, *pickle = NULL, *weakref = NULL;
    int rc = -1;

    st->pool.owner = 0;
    if (add_type(module, &st->SnapshotType, &flor_snapshot_spec) < 0 ||
        add_type(module, &st->RefType, &flor_ref_spec) < 0 ||
        add_type(module, &st->MappingType, &flor_mapping_spec) < 0 ||
        add_type(module, &st->MaterializerType, &flor_materializer_spec) < 0 ||
        add_type(module, &st->SkipMachineType, &flor_skipmachine_spec) < 0 ||
        flor_skipblock_constants(module) < 0) {
        goto cleanup;
    }
    st->FormatError = PyErr_NewExceptionWithDoc(
        "flor._core.FormatError",
        "A checkpoint file is damaged. args: (path, section, detail).", PyExc_ValueError, NULL);
    if (st->FormatError == NULL || PyModule_AddObjectRef(module, "FormatError", st->FormatError) < 0) {
        goto cleanup;
    }
    st->kind_cache = PyDict_New();
    st->loaders = PyDict_New();
    st->rebuild = PyObject_GetAttrString(module, "_rebuild");
    if (st->kind_cache == NULL || st->loaders == NULL || st->rebuild == NULL) {
        goto cleanup;
    }
    copyreg = PyImport_ImportModule("copyreg");
    copy = PyImport_ImportModule("copy");
    pickle = PyImport_ImportModule("pickle");
    weakref = PyImport_ImportModule("weakref");
    if (copyreg == NULL || copy == NULL || pickle == NULL || weakref == NULL) {
        goto cleanup;
    }
    {
        PyObject *coll = PyImport_ImportModule("collections"), *names = NULL;
        names = coll == NULL ? NULL
                             : Py_BuildValue("(NNNN)", PyObject_GetAttrString(coll, "OrderedDict"),
                                             PyObject_GetAttrString(coll, "defaultdict"),
                                             PyObject_GetAttrString(coll, "Counter"),
                                             PyObject_GetAttrString(coll, "deque"));
        st->tree_safe = names == NULL ? NULL : PyFrozenSet_New(names);
        Py_XDECREF(names);
        Py_XDECREF(coll);
        if (st->tree_safe == NULL) {
            goto cleanup;
        }
    }
    st->copyreg_dispatch = PyObject_GetAttrString(copyreg, "dispatch_table");
    st->deepcopy = PyObject_GetAttrString(copy, "deepcopy");
    st->loads = PyObject_GetAttrString(pickle, "loads");
    st->weakref_t = PyObject_GetAttrString(weakref, "ref");
    if (st->copyreg_dispatch == NULL || st->deepcopy == NULL || st->loads == NULL ||
        st->weakref_t == NULL) {
        goto cleanup;
    }
#define INTERN(field, s)                                          \
    if ((st->field = PyUnicode_InternFromString(s)) == NULL) { \
        goto cleanup;                                             \
    }
    INTERN(s_state_dict, "state_dict");
    INTERN(s_load_state_dict, "load_state_dict");
    INTERN(s_deepcopy_attr, "__deepcopy__");
    INTERN(s_reduce_ex, "__reduce_ex__");
    INTERN(s_setstate, "__setstate__");
    INTERN(s_dict, "__dict__");
    INTERN(s_append, "append");
    INTERN(s_items, "items");
#undef INTERN
    rc = 0;
cleanup:
    Py_XDECREF(copyreg);
    Py_XDECREF(copy);
    Py_XDECREF(pickle);
    Py_XDECREF(weakref);
    return rc;
}

#define FLOR_STATE_OBJECTS(X)                                                                  \
    X(SnapshotType) X(RefType) X(MappingType) X(MaterializerType) X(SkipMachineType)           \
    X(FormatError) X(kind_cache)                                                               \
    X(rebuild) X(loaders) X(torch) X(Tensor) X(Parameter) X(Generator) X(Size) X(dtype_t)      \
    X(device_t) X(layout_t) X(memfmt_t) X(strided) X(uint8) X(atom_names) X(ndarray)           \
    X(copyreg_dispatch) X(deepcopy) X(dumps) X(loads) X(weakref_t) X(Pickler) X(BytesIO)       \
    X(tree_safe)                                                                               \
    X(s_state_dict)                                                                            \
    X(s_load_state_dict) X(s_deepcopy_attr) X(s_reduce_ex) X(s_setstate) X(s_dict) X(s_append) \
    X(s_items)

static int
module_traverse(PyObject *module, visitproc visit, void *arg)
{
    flor_state *st = get_state(module);
#define VISIT(f) Py_VISIT(st->f);
    FLOR_STATE_OBJECTS(VISIT)
#undef VISIT
    return 0;
}

static int
module_clear(PyObject *module)
{
    flor_state *st = get_state(module);
#define CLEAR(f) Py_CLEAR(st->f);
    FLOR_STATE_OBJECTS(CLEAR)
#undef CLEAR
    st->torch_ready = 0;
    return 0;
}

static void
module_free(void *module)
{
    flor_state *st = get_state((PyObject *)module);
    flor_pool_release(st);
    module_clear((PyObject *)module);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

PyDoc_STRVAR(module_doc, "The C core of flor: snapshot walk, checkpoint format, materializer.");

PyModuleDef flor_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "flor._core",
    .m_doc = module_doc,
    .m_size = sizeof(flor_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC
PyInit__core(void)
{
    return PyModuleDef_Init(&flor_module);
}
