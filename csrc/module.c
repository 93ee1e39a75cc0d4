/* module.c: the flor._core extension module (multi-phase init, PEP 489):
 * registration only.  Each C file exports its types and functions; this one
 * adds them to the module and owns the per-module state's lifetime.
 *
 *     snapshot, measure, fingerprint, Snapshot       walk.c
 *     save(obj, path)                                format.c
 *     load(path, hook, policy), Mapping              reader.c
 *     _rebuild(kind, i, payload), Ref                skeleton.c
 *     crc32c, hash64, digest64                       crc32c.c
 *     pool_stats(), trim_pool()                      arena.c
 *     Materializer                                   materializer.c
 *     SkipMachine, rule(...), state constants        skipblock.c
 *     Journal, Tee                                   capture.c
 *     FormatError                                    raised by reader.c, picklescan.c
 *                                                    and skeleton.c
 *
 * Nothing here imports torch: torch objects are looked up the first time a
 * snapshot or load runs after someone else imported torch (support.c).
 */
#include "flor.h"

static flor_state *
get_state(PyObject *module)
{
    return (flor_state *)PyModule_GetState(module);
}

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
    if (PyModule_AddFunctions(module, flor_walk_functions) < 0 ||
        PyModule_AddFunctions(module, flor_format_functions) < 0 ||
        PyModule_AddFunctions(module, flor_reader_functions) < 0 ||
        PyModule_AddFunctions(module, flor_skeleton_functions) < 0 ||
        PyModule_AddFunctions(module, flor_crc32c_functions) < 0 ||
        PyModule_AddFunctions(module, flor_arena_functions) < 0 ||
        PyModule_AddFunctions(module, flor_skipblock_functions) < 0) {
        goto cleanup;
    }
    if (add_type(module, &st->SnapshotType, &flor_snapshot_spec) < 0 ||
        add_type(module, &st->RefType, &flor_ref_spec) < 0 ||
        add_type(module, &st->MappingType, &flor_mapping_spec) < 0 ||
        add_type(module, &st->MaterializerType, &flor_materializer_spec) < 0 ||
        add_type(module, &st->SkipMachineType, &flor_skipmachine_spec) < 0 ||
        add_type(module, &st->QuietStepsType, &flor_quietsteps_spec) < 0 ||
        add_type(module, &st->JournalType, &flor_journal_spec) < 0 ||
        add_type(module, &st->TeeType, &flor_tee_spec) < 0 ||
        flor_skipblock_constants(module) < 0) {
        goto cleanup;
    }
    st->FormatError = PyErr_NewExceptionWithDoc(
        "flor._core.FormatError", "A checkpoint file is damaged. args: (path, section, detail).",
        PyExc_ValueError, NULL);
    if (st->FormatError == NULL ||
        PyModule_AddObjectRef(module, "FormatError", st->FormatError) < 0) {
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
#define INTERN(field, s)                                       \
    if ((st->field = PyUnicode_InternFromString(s)) == NULL) { \
        goto cleanup;                                          \
    }
    INTERN(s_state_dict, "state_dict");
    INTERN(s_load_state_dict, "load_state_dict");
    INTERN(s_deepcopy_attr, "__deepcopy__");
    INTERN(s_reduce_ex, "__reduce_ex__");
    INTERN(s_setstate, "__setstate__");
    INTERN(s_dict, "__dict__");
    INTERN(s_append, "append");
    INTERN(s_items, "items");
    INTERN(s_where, "where");
    INTERN(s_info, "info");
#undef INTERN
    rc = 0;
cleanup:
    Py_XDECREF(copyreg);
    Py_XDECREF(copy);
    Py_XDECREF(pickle);
    Py_XDECREF(weakref);
    return rc;
}

/* Kept as written (clang-format would re-flow the X list): grouped as flor_state
 * declares its objects. */
/* clang-format off */
#define FLOR_STATE_OBJECTS(X)                                                                  \
    X(SnapshotType) X(RefType) X(MappingType) X(MaterializerType) X(SkipMachineType)           \
    X(QuietStepsType) X(JournalType) X(TeeType)                                                \
    X(FormatError) X(kind_cache)                                                               \
    X(rebuild) X(loaders) X(torch) X(Tensor) X(Parameter) X(Generator) X(Size) X(dtype_t)      \
    X(device_t) X(layout_t) X(memfmt_t) X(strided) X(uint8) X(atom_names) X(ndarray)           \
    X(cuda) X(handle_capture)                                                                  \
    X(copyreg_dispatch) X(deepcopy) X(dumps) X(loads) X(weakref_t) X(Pickler) X(BytesIO)       \
    X(tree_safe)                                                                               \
    X(s_state_dict)                                                                            \
    X(s_load_state_dict) X(s_deepcopy_attr) X(s_reduce_ex) X(s_setstate) X(s_dict) X(s_append) \
    X(s_items) X(s_where) X(s_info)
/* clang-format on */

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

/* Subinterpreters: every object and setting of the module lives in its
 * module state (multi-phase init, heap types, no mutable static data), so
 * each interpreter that imports flor._core gets its own.  A per-interpreter
 * GIL is not supported: the fork writer forks the whole process and the
 * Tee writes to the process's descriptors.  (torch does not load in a
 * subinterpreter; flor itself runs in the main interpreter.) */
static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_SUPPORTED},
#endif
    {0, NULL},
};

PyDoc_STRVAR(module_doc, "The C core of flor: snapshot walk, checkpoint format, materializer,\n"
                         "SkipBlock state machine.");

PyModuleDef flor_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "flor._core",
    .m_doc = module_doc,
    .m_size = sizeof(flor_state),
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
