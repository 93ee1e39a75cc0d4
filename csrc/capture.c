/* capture.c: the hot path of output capture, O(1) per write.
 *
 *     class Journal:                          # one per session
 *         info       # the session's context and phase: set on every change
 *         capturing  # False while replay discards a pseudoresumed iteration
 *         ord        # the last row number used (shared with the session's logs)
 *
 *         def add(stream, text, located=True):
 *             code, offset = None, -1
 *             if stream == STDOUT and located:  # the innermost frame of the user's
 *                 code, offset = ...              # program (a pointer-keyed cache holds
 *                                                 # classify(code): hashing a code object
 *                                                 # walks its bytecode)
 *                                                 # and the byte offset of its instruction;
 *                                                 # none where a frame that classify()
 *                                                 # calls None (a barrier) comes first
 *             if the open segment has this stream, code, offset and info:
 *                 segment.pieces.append(text)
 *             else:
 *                 ord += 1; open a new segment (ord, stream, code, offset, info, [text])
 *
 *         def take(self):                      # -> [(ord, stream, code, offset, info, text)]
 *             close every segment, join its pieces, empty the journal
 *
 *     class Tee:                               # its write is sys.stdout.write while flor runs
 *         def write(self, text):
 *             if self.tee: self.real.write(text)
 *             if journal.capturing and text: journal.add(self.stream, text)
 *             return len(text)
 *
 * Consecutive writes of one print statement (its text, then "\n") and of one
 * statement in a loop land in one segment: Python turns segments into rows
 * only when the session flushes (and an offset into a line number once per
 * segment: that walks the function's line table), and into printed lines
 * only when they are read.  Nothing here releases the GIL: every step touches Python objects.
 */
#include "flor.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    long long ord;
    int stream;
    int offset;       /* of the instruction, in bytes (f_lasti) */
    PyObject *code;   /* a code object, or None */
    PyObject *info;
    PyObject *pieces; /* list of str */
} segment;

/* Which code objects are the user's: keyed by address, each holding a
 * reference (so that an address is never reused while cached). */
typedef struct {
    PyObject **codes;
    unsigned char *mine;
    size_t cap, n; /* cap: a power of two, or 0 */
} codemap;

typedef struct {
    PyObject_HEAD
    segment *segs;
    Py_ssize_t n, cap;
    int open;          /* the last segment still takes writes */
    int capturing;
    long long ord;
    PyObject *info;
    codemap users;
    PyObject *classify; /* classify(code) -> bool */
} FlorJournal;

typedef struct {
    PyObject_HEAD
    FlorJournal *journal;
    PyObject *real;
    PyObject *write; /* real.write */
    int stream;
    int tee;
} FlorTee;

/* ------------------------------------------------------------------ */
/* The code map.                                                        */

static size_t
code_slot(const codemap *m, PyObject *code)
{
    uint64_t x = (uint64_t)(uintptr_t)code;
    size_t i;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    for (i = (size_t)x & (m->cap - 1); m->codes[i] != NULL && m->codes[i] != code;
         i = (i + 1) & (m->cap - 1)) {
    }
    return i;
}

/* 1 (the user's), 0 (not) or BARRIER if code is known, -1 if not. */
#define BARRIER 2
static int
codemap_get(const codemap *m, PyObject *code)
{
    size_t i;
    if (m->cap == 0) {
        return -1;
    }
    i = code_slot(m, code);
    return m->codes[i] == NULL ? -1 : m->mine[i];
}

static int
codemap_put(codemap *m, PyObject *code, int mine)
{
    size_t i;
    if ((m->n + 1) * 2 > m->cap) {
        codemap g = {NULL, NULL, m->cap ? m->cap * 2 : 64, 0};
        g.codes = calloc(g.cap, sizeof(PyObject *));
        g.mine = calloc(g.cap, 1);
        if (g.codes == NULL || g.mine == NULL) {
            free(g.codes);
            free(g.mine);
            PyErr_NoMemory();
            return -1;
        }
        for (i = 0; i < m->cap; i++) {
            if (m->codes[i] != NULL) {
                size_t k = code_slot(&g, m->codes[i]);
                g.codes[k] = m->codes[i];
                g.mine[k] = m->mine[i];
                g.n++;
            }
        }
        free(m->codes);
        free(m->mine);
        *m = g;
    }
    i = code_slot(m, code);
    m->codes[i] = Py_NewRef(code);
    m->mine[i] = (unsigned char)mine;
    m->n++;
    return 0;
}

static void
codemap_clear(codemap *m)
{
    size_t i;
    for (i = 0; i < m->cap; i++) {
        Py_CLEAR(m->codes[i]);
    }
    free(m->codes);
    free(m->mine);
    memset(m, 0, sizeof(*m));
}

/* ------------------------------------------------------------------ */
/* Journal.                                                             */

static void
segments_clear(FlorJournal *j)
{
    Py_ssize_t i;
    for (i = 0; i < j->n; i++) {
        Py_CLEAR(j->segs[i].code);
        Py_CLEAR(j->segs[i].info);
        Py_CLEAR(j->segs[i].pieces);
    }
    j->n = 0;
    j->open = 0;
}

/* The innermost frame of the user's program: a new reference to its code
 * object in *code (None if there is none, or if a barrier's frame comes
 * first: output written under it belongs to no statement) and its
 * instruction's byte offset in *offset. */
static int
user_frame(FlorJournal *j, PyObject **code, int *offset)
{
    int rc = -1, mine;
    PyFrameObject *f = PyEval_GetFrame(), *back;
    PyCodeObject *c = NULL;

    Py_XINCREF(f);
    while (f != NULL) {
        c = PyFrame_GetCode(f);
        mine = codemap_get(&j->users, (PyObject *)c);
        if (mine < 0) {
            PyObject *r = PyObject_CallOneArg(j->classify, (PyObject *)c);
            if (r == NULL) {
                goto cleanup;
            }
            mine = r == Py_None ? BARRIER : PyObject_IsTrue(r);
            Py_DECREF(r);
            if (mine < 0 || codemap_put(&j->users, (PyObject *)c, mine) < 0) {
                goto cleanup;
            }
        }
        if (mine == BARRIER) {
            break;
        }
        if (mine) {
            *code = (PyObject *)c;
            c = NULL;
            *offset = PyFrame_GetLasti(f);
            rc = 0;
            goto cleanup;
        }
        Py_CLEAR(c);
        back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    *code = Py_NewRef(Py_None);
    *offset = -1;
    rc = 0;
cleanup:
    Py_XDECREF(c);
    Py_XDECREF(f);
    return rc;
}

static int
journal_add(FlorJournal *j, int stream, PyObject *text, int located)
{
    int rc = -1, offset = -1;
    PyObject *code = NULL;
    segment *s;

    if (stream == 0 && located) {
        if (user_frame(j, &code, &offset) < 0) {
            return -1;
        }
    }
    else {
        code = Py_NewRef(Py_None);
    }
    if (j->open && j->n > 0) {
        s = &j->segs[j->n - 1];
        if (s->stream == stream && s->code == code && s->offset == offset && s->info == j->info) {
            rc = PyList_Append(s->pieces, text);
            goto cleanup;
        }
    }
    if (j->n == j->cap) {
        Py_ssize_t cap = j->cap ? j->cap * 2 : 64;
        segment *segs = realloc(j->segs, (size_t)cap * sizeof(segment));
        if (segs == NULL) {
            PyErr_NoMemory();
            goto cleanup;
        }
        j->segs = segs;
        j->cap = cap;
    }
    s = &j->segs[j->n];
    s->pieces = PyList_New(1);
    if (s->pieces == NULL) {
        goto cleanup;
    }
    PyList_SET_ITEM(s->pieces, 0, Py_NewRef(text));
    s->ord = ++j->ord;
    s->stream = stream;
    s->offset = offset;
    s->code = code;
    code = NULL;
    s->info = Py_NewRef(j->info);
    j->n++;
    j->open = 1;
    rc = 0;
cleanup:
    Py_XDECREF(code);
    return rc;
}

PyDoc_STRVAR(journal_add_doc,
             "add($self, stream, text, located=True, /)\n--\n\n"
             "Journal text written to stream (0 stdout, 1 stderr). With located, a\n"
             "stdout write is attributed to the innermost frame of the user's program.");

static PyObject *
journal_add_meth(FlorJournal *j, PyObject *const *args, Py_ssize_t nargs)
{
    int stream, located = 1;
    if (flor_check_nargs("add", nargs, 2, 3) < 0) {
        return NULL;
    }
    stream = PyObject_IsTrue(args[0]);
    if (stream < 0) {
        return NULL;
    }
    if (!PyUnicode_Check(args[1])) {
        PyErr_Format(PyExc_TypeError, "add() takes str text, not %.100s",
                     Py_TYPE(args[1])->tp_name);
        return NULL;
    }
    if (nargs == 3 && (located = PyObject_IsTrue(args[2])) < 0) {
        return NULL;
    }
    if (PyUnicode_GET_LENGTH(args[1]) > 0 && journal_add(j, stream, args[1], located) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(journal_take_doc,
             "take($self, /)\n--\n\n"
             "The segments journaled since the last call, in order, as tuples\n"
             "(ord, stream, code or None, instruction offset, info, text); the journal\n"
             "is emptied.");

static PyObject *
journal_take(FlorJournal *j, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = NULL, *empty = NULL;
    Py_ssize_t i;

    out = PyList_New(j->n);
    empty = PyUnicode_New(0, 0);
    if (out == NULL || empty == NULL) {
        goto error;
    }
    for (i = 0; i < j->n; i++) {
        segment *s = &j->segs[i];
        PyObject *text = PyUnicode_Join(empty, s->pieces), *t;
        if (text == NULL) {
            goto error;
        }
        t = Py_BuildValue("(LiOiON)", s->ord, s->stream, s->code, s->offset, s->info, text);
        if (t == NULL) {
            goto error;
        }
        PyList_SET_ITEM(out, i, t);
    }
    segments_clear(j);
    Py_DECREF(empty);
    return out;
error:
    Py_XDECREF(out);
    Py_XDECREF(empty);
    return NULL;
}

PyDoc_STRVAR(journal_close_doc,
             "close_segment($self, /)\n--\n\n"
             "End the open segment: the next write starts a new one.");

static PyObject *
journal_close_segment(FlorJournal *j, PyObject *Py_UNUSED(ignored))
{
    j->open = 0;
    Py_RETURN_NONE;
}

static PyObject *
journal_get_info(FlorJournal *j, void *Py_UNUSED(closure))
{
    return Py_NewRef(j->info);
}

static int
journal_set_info(FlorJournal *j, PyObject *v, void *Py_UNUSED(closure))
{
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete info");
        return -1;
    }
    Py_SETREF(j->info, Py_NewRef(v));
    return 0;
}

static PyObject *
journal_get_capturing(FlorJournal *j, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(j->capturing);
}

static int
journal_set_capturing(FlorJournal *j, PyObject *v, void *Py_UNUSED(closure))
{
    int r;
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete capturing");
        return -1;
    }
    r = PyObject_IsTrue(v);
    if (r < 0) {
        return -1;
    }
    j->capturing = r;
    return 0;
}

static PyObject *
journal_get_ord(FlorJournal *j, void *Py_UNUSED(closure))
{
    return PyLong_FromLongLong(j->ord);
}

static int
journal_set_ord(FlorJournal *j, PyObject *v, void *Py_UNUSED(closure))
{
    long long ord;
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete ord");
        return -1;
    }
    ord = PyLong_AsLongLong(v);
    if (ord == -1 && PyErr_Occurred()) {
        return -1;
    }
    j->ord = ord;
    return 0;
}

static PyObject *
journal_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"classify", NULL};
    PyObject *classify;
    FlorJournal *j;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:Journal", kwlist, &classify)) {
        return NULL;
    }
    if (!PyCallable_Check(classify)) {
        PyErr_SetString(PyExc_TypeError, "Journal(classify): classify must be callable");
        return NULL;
    }
    j = (FlorJournal *)type->tp_alloc(type, 0);
    if (j == NULL) {
        return NULL;
    }
    j->capturing = 1;
    j->info = Py_NewRef(Py_None);
    j->classify = Py_NewRef(classify);
    return (PyObject *)j;
}

static int
journal_traverse(FlorJournal *j, visitproc visit, void *arg)
{
    Py_ssize_t i;
    Py_VISIT(Py_TYPE(j));
    Py_VISIT(j->info);
    Py_VISIT(j->classify);
    for (i = 0; i < j->n; i++) {
        Py_VISIT(j->segs[i].code);
        Py_VISIT(j->segs[i].info);
        Py_VISIT(j->segs[i].pieces);
    }
    return 0;
}

static int
journal_clear(FlorJournal *j)
{
    segments_clear(j);
    codemap_clear(&j->users);
    Py_CLEAR(j->info);
    Py_CLEAR(j->classify);
    return 0;
}

static void
journal_dealloc(FlorJournal *j)
{
    PyTypeObject *tp = Py_TYPE(j);
    PyObject_GC_UnTrack(j);
    journal_clear(j);
    free(j->segs);
    tp->tp_free(j);
    Py_DECREF(tp);
}

static PyMethodDef journal_methods[] = {
    {"add", FLOR_CFUNC(journal_add_meth), METH_FASTCALL, journal_add_doc},
    {"take", FLOR_CFUNC(journal_take), METH_NOARGS, journal_take_doc},
    {"close_segment", FLOR_CFUNC(journal_close_segment), METH_NOARGS, journal_close_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef journal_getset[] = {
    {"info", (getter)journal_get_info, (setter)journal_set_info,
     "The session's context, attached to each segment.", NULL},
    {"capturing", (getter)journal_get_capturing, (setter)journal_set_capturing,
     "False: writes are passed on but not journaled.", NULL},
    {"ord", (getter)journal_get_ord, (setter)journal_set_ord, "The last row number used.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot journal_slots[] = {
    {Py_tp_new, journal_new},
    {Py_tp_dealloc, journal_dealloc},
    {Py_tp_traverse, journal_traverse},
    {Py_tp_clear, journal_clear},
    {Py_tp_methods, journal_methods},
    {Py_tp_getset, journal_getset},
    {Py_tp_doc, "Journal(classify)\n--\n\n"
                "Output written while flor runs, in segments of consecutive writes of one\n"
                "statement in one context. classify(code) says whether a code object is\n"
                "the user's."},
    {0, NULL},
};

PyType_Spec flor_journal_spec = {
    .name = "flor._core.Journal",
    .basicsize = sizeof(FlorJournal),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = journal_slots,
};

/* ------------------------------------------------------------------ */
/* Tee.                                                                 */

PyDoc_STRVAR(tee_write_doc,
             "write($self, text, /)\n--\n\n"
             "Pass text on to the real stream (when teeing) and journal it.");

static PyObject *
tee_write(FlorTee *t, PyObject *text)
{
    Py_ssize_t n;
    if (!PyUnicode_Check(text)) {
        PyErr_Format(PyExc_TypeError, "write() argument must be str, not %.100s",
                     Py_TYPE(text)->tp_name);
        return NULL;
    }
    if (t->tee) {
        PyObject *r = PyObject_CallOneArg(t->write, text);
        if (r == NULL) {
            return NULL;
        }
        Py_DECREF(r);
    }
    n = PyUnicode_GET_LENGTH(text);
    if (t->journal->capturing && n > 0 && journal_add(t->journal, t->stream, text, 1) < 0) {
        return NULL;
    }
    return PyLong_FromSsize_t(n);
}

static PyObject *
tee_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"journal", "real", "stream", "tee", NULL};
    flor_state *st = flor_state_of_type(type);
    PyObject *journal, *real;
    int stream, tee;
    FlorTee *t;
    if (st == NULL || !PyArg_ParseTupleAndKeywords(args, kwds, "O!Oip:Tee", kwlist, st->JournalType,
                                                   &journal, &real, &stream, &tee)) {
        return NULL;
    }
    if (stream != 0 && stream != 1) {
        PyErr_SetString(PyExc_ValueError, "Tee: stream must be 0 (stdout) or 1 (stderr)");
        return NULL;
    }
    t = (FlorTee *)type->tp_alloc(type, 0);
    if (t == NULL) {
        return NULL;
    }
    t->write = PyObject_GetAttrString(real, "write");
    if (t->write == NULL) {
        Py_DECREF(t);
        return NULL;
    }
    t->journal = (FlorJournal *)Py_NewRef(journal);
    t->real = Py_NewRef(real);
    t->stream = stream;
    t->tee = tee;
    return (PyObject *)t;
}

static int
tee_traverse(FlorTee *t, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(t));
    Py_VISIT(t->journal);
    Py_VISIT(t->real);
    Py_VISIT(t->write);
    return 0;
}

static int
tee_clear(FlorTee *t)
{
    Py_CLEAR(t->journal);
    Py_CLEAR(t->real);
    Py_CLEAR(t->write);
    return 0;
}

static void
tee_dealloc(FlorTee *t)
{
    PyTypeObject *tp = Py_TYPE(t);
    PyObject_GC_UnTrack(t);
    tee_clear(t);
    tp->tp_free(t);
    Py_DECREF(tp);
}

static PyObject *
tee_get_tee(FlorTee *t, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(t->tee);
}

static int
tee_set_tee(FlorTee *t, PyObject *v, void *Py_UNUSED(closure))
{
    int r;
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete tee");
        return -1;
    }
    r = PyObject_IsTrue(v);
    if (r < 0) {
        return -1;
    }
    t->tee = r;
    return 0;
}

static PyGetSetDef tee_getset[] = {
    {"tee", (getter)tee_get_tee, (setter)tee_set_tee,
     "Whether writes are passed on to the real stream now.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef tee_methods[] = {
    {"write", FLOR_CFUNC(tee_write), METH_O, tee_write_doc},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot tee_slots[] = {
    {Py_tp_new, tee_new},
    {Py_tp_dealloc, tee_dealloc},
    {Py_tp_traverse, tee_traverse},
    {Py_tp_clear, tee_clear},
    {Py_tp_methods, tee_methods},
    {Py_tp_getset, tee_getset},
    {Py_tp_doc, "Tee(journal, real, stream, tee)\n--\n\n"
                "The write of a captured stream: passes text on to real (when tee) and\n"
                "journals it as stream 0 (stdout) or 1 (stderr)."},
    {0, NULL},
};

PyType_Spec flor_tee_spec = {
    .name = "flor._core.Tee",
    .basicsize = sizeof(FlorTee),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = tee_slots,
};
