/* support.c: helpers shared by the other C files of flor._core.
 *
 *     flor_now()                  monotonic seconds
 *     flor_check_nargs(...)       argument-count check of a fast-call function
 *     flor_format_error(...)      raise FormatError(path, section, detail)
 *     flor_torch_init(st)         look up torch's types once someone imported torch
 *     flor_numpy_init(st)         look up numpy.ndarray once someone imported numpy
 *     flor_entries_free(e, n)     free a tensor table
 *
 * Nothing here imports torch or numpy: they are looked up only after the
 * user's program imported them.
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
        return -1;
    }
    return 0;
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
                PyObject *shortname = full == NULL
                                          ? NULL
                                          : PyUnicode_FromString(
                                                strncmp(full, "torch.", 6) == 0 ? full + 6 : full);
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
#define GET(field, obj, name)                                          \
    if ((st->field = PyObject_GetAttrString((obj), (name))) == NULL) { \
        goto cleanup;                                                  \
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

void
flor_entries_free(flor_entry *e, uint32_t n)
{
    uint32_t i;
    if (e == NULL) {
        return;
    }
    for (i = 0; i < n; i++) {
        free(e[i].dims);
    }
    free(e);
}

/* A device name as torch spells one: a known type and an optional index.
 * Names read from a file are checked here before torch sees them (torch's
 * parser refuses a bad one by throwing through C++). */
int
flor_device_name(const char *s)
{
    static const char *const types[] = {"cpu",    "cuda",   "ipu",   "xpu",  "mkldnn",
                                        "opengl", "opencl", "ideep", "hip",  "ve",
                                        "fpga",   "maia",   "xla",   "lazy", "vulkan",
                                        "mps",    "meta",   "hpu",   "mtia", "privateuseone"};
    const char *colon = strchr(s, ':');
    size_t i, n = colon != NULL ? (size_t)(colon - s) : strlen(s);
    for (i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        if (strlen(types[i]) == n && strncmp(types[i], s, n) == 0) {
            break;
        }
    }
    if (i == sizeof(types) / sizeof(types[0])) {
        return 0;
    }
    if (colon == NULL) {
        return 1;
    }
    s = colon + 1;
    n = strlen(s);
    if (n == 0 || n > 4 || (s[0] == '0' && n > 1)) {
        return 0;
    }
    for (i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') {
            return 0;
        }
    }
    return 1;
}
