/* skipblock.c: the SkipBlock state machine and the adaptive checkpoint rule.
 *
 *     class SkipMachine:                       # one per process
 *         mode: RECORD or REPLAY;  phase: WORK or PSEUDORESUME (replay)
 *         blocks[i]: n executions, k checkpoints, compute seconds, restores
 *
 *         def wants(probed):        # the skip table: restore rather than run?
 *             return mode == REPLAY and (phase == PSEUDORESUME or not probed)
 *
 *         def enter(i, probed, has_checkpoint):      # SkipBlock.step_into
 *             if has_checkpoint and wants(probed):
 *                 state = PSEUDORESUME if phase == PSEUDORESUME else SKIP
 *             else:
 *                 state = EXECUTE if mode == RECORD else STEP_INTO
 *             push (i, state, now); return state  # the body runs for EXECUTE, STEP_INTO
 *
 *         def leave(i):                             # SkipBlock.end
 *             pop (must be i); if the body ran: n += 1, compute += elapsed
 *
 *         def ran(i, seconds):       # record: an execution timed without enter/leave
 *             n += 1, compute += seconds
 *
 *         def decide(i, nbytes, M, W, B=0):         # record: checkpoint now?
 *             C = compute / n          # M: what training pays per checkpoint,
 *             R = c * W                # W: its write time, R: a restore's
 *                                      # B: flor's other time at its executions
 *             cheap = (k + 1) * M + B < n * epsilon * C
 *             worth = (k + 1) * (M + R) < n * C
 *             if cheap and worth or not adaptive:
 *                 k += 1; materialize += W; return True, terms
 *             return False, terms  # the numbers compared: Python words them
 *
 * The two halves of the paper's joint invariant (Eq. 4): k * M < n * epsilon
 * * C keeps record overhead at most epsilon, and k * (M + R) < n * C keeps
 * replay from checkpoints cheaper than re-running.  With M = W they are the
 * paper's M/C < n/(k+1) * min(1/(1+c), epsilon) (rule() below); Python
 * measures M apart from W (flor/runtime/charge.py: the training thread's
 * blocking plus the slowdown of steps that overlap the background write).
 */
#include "flor.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { SB_RECORD = 0, SB_REPLAY = 1 };
enum { PHASE_WORK = 0, PHASE_PSEUDORESUME = 1 };
enum { ST_EXECUTE = 0, ST_SKIP = 1, ST_STEP_INTO = 2, ST_PSEUDORESUME = 3 };

static const char *const state_names[] = {"execute", "skip", "step_into", "pseudoresume"};

typedef struct {
    PyObject *key;
    uint64_t n, k, skips, steps, restores;
    double compute, restore, materialize;
    uint64_t nbytes;
} sb_block;

typedef struct {
    Py_ssize_t block;
    int state;
    double start;
} sb_frame;

typedef struct {
    PyObject_HEAD
    int mode, phase, adaptive;
    double epsilon, c;
    sb_block *blocks;
    Py_ssize_t nblocks, cap;
    PyObject *index; /* {key: handle} */
    sb_frame *stack;
    Py_ssize_t depth, stack_cap;
} FlorSkipMachine;

static int
check_handle(FlorSkipMachine *m, Py_ssize_t i)
{
    if (i < 0 || i >= m->nblocks) {
        PyErr_Format(PyExc_IndexError, "no SkipBlock with handle %zd", i);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(sm_block_doc,
             "block($self, key, /)\n--\n\n"
             "The handle of the block identified by key, registering it if new.");

static PyObject *
sm_block(FlorSkipMachine *m, PyObject *key)
{
    PyObject *h = PyDict_GetItemWithError(m->index, key), *hv;
    if (h != NULL) {
        return Py_NewRef(h);
    }
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (m->nblocks == m->cap) {
        Py_ssize_t cap = m->cap ? m->cap * 2 : 8;
        sb_block *b = realloc(m->blocks, (size_t)cap * sizeof(sb_block));
        if (b == NULL) {
            return PyErr_NoMemory();
        }
        m->blocks = b;
        m->cap = cap;
    }
    hv = PyLong_FromSsize_t(m->nblocks);
    if (hv == NULL || PyDict_SetItem(m->index, key, hv) < 0) {
        Py_XDECREF(hv);
        return NULL;
    }
    memset(&m->blocks[m->nblocks], 0, sizeof(sb_block));
    m->blocks[m->nblocks].key = Py_NewRef(key);
    m->nblocks++;
    return hv;
}

/* The skip table, in one place: whether a block execution that has a
 * checkpoint restores it instead of running its body. */
static int
wants_checkpoint(const FlorSkipMachine *m, int probed)
{
    return m->mode == SB_REPLAY && (m->phase == PHASE_PSEUDORESUME || !probed);
}

PyDoc_STRVAR(sm_wants_doc, "wants($self, probed, /)\n--\n\n"
                           "Whether enter() would restore a checkpoint of a block (probed or\n"
                           "not) rather than run it: the caller loads one only then.");

static PyObject *
sm_wants(FlorSkipMachine *m, PyObject *arg)
{
    int probed = PyObject_IsTrue(arg);
    if (probed < 0) {
        return NULL;
    }
    return PyBool_FromLong(wants_checkpoint(m, probed));
}

PyDoc_STRVAR(sm_enter_doc,
             "enter($self, handle, probed, has_checkpoint, /)\n--\n\n"
             "Open a block and return its state: EXECUTE or STEP_INTO run the body,\n"
             "SKIP or PSEUDORESUME skip it and restore its checkpoint at end().");

static PyObject *
sm_enter(FlorSkipMachine *m, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t i;
    int probed, has_ckpt, state;
    if (flor_check_nargs("enter", nargs, 3, 3) < 0) {
        return NULL;
    }
    i = PyLong_AsSsize_t(args[0]);
    probed = PyObject_IsTrue(args[1]);
    has_ckpt = PyObject_IsTrue(args[2]);
    if ((i == -1 && PyErr_Occurred()) || probed < 0 || has_ckpt < 0 || check_handle(m, i) < 0) {
        return NULL;
    }
    if (has_ckpt && wants_checkpoint(m, probed)) {
        state = m->phase == PHASE_PSEUDORESUME ? ST_PSEUDORESUME : ST_SKIP;
    }
    else {
        state = m->mode == SB_RECORD ? ST_EXECUTE : ST_STEP_INTO;
    }
    if (m->depth == m->stack_cap) {
        Py_ssize_t cap = m->stack_cap ? m->stack_cap * 2 : 8;
        sb_frame *f = realloc(m->stack, (size_t)cap * sizeof(sb_frame));
        if (f == NULL) {
            return PyErr_NoMemory();
        }
        m->stack = f;
        m->stack_cap = cap;
    }
    m->stack[m->depth].block = i;
    m->stack[m->depth].state = state;
    m->stack[m->depth].start = flor_now();
    m->depth++;
    return PyLong_FromLong(state);
}

PyDoc_STRVAR(sm_leave_doc,
             "leave($self, handle, /)\n--\n\n"
             "Close the innermost block, which must be handle. Returns (state, seconds).");

static PyObject *
sm_leave(FlorSkipMachine *m, PyObject *arg)
{
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    sb_frame f;
    sb_block *b;
    double dt;
    if (i == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (m->depth == 0) {
        PyErr_SetString(PyExc_RuntimeError,
                        "flor.SkipBlock.end() without a matching flor.SkipBlock.step_into()");
        return NULL;
    }
    f = m->stack[m->depth - 1];
    if (f.block != i) {
        PyErr_Format(PyExc_RuntimeError,
                     "flor.SkipBlock.end() does not match the innermost open block %R",
                     m->blocks[f.block].key);
        return NULL;
    }
    m->depth--;
    dt = flor_now() - f.start;
    b = &m->blocks[i];
    switch (f.state) {
    case ST_EXECUTE:
        b->n++;
        b->compute += dt;
        break;
    case ST_STEP_INTO:
        b->steps++;
        b->compute += dt;
        break;
    default:
        b->skips++;
        break;
    }
    return Py_BuildValue("(id)", f.state, dt);
}

/* The (handle, seconds) arguments of ran() and restored(): each converted and
 * checked in turn; seconds finite and at least 0.  -1 with an exception set. */
static int
handle_and_seconds(FlorSkipMachine *m, const char *name, PyObject *const *args, Py_ssize_t nargs,
                   Py_ssize_t *i, double *s)
{
    if (flor_check_nargs(name, nargs, 2, 2) < 0) {
        return -1;
    }
    *i = PyLong_AsSsize_t(args[0]);
    if (*i == -1 && PyErr_Occurred()) {
        return -1;
    }
    *s = PyFloat_AsDouble(args[1]);
    if ((*s == -1.0 && PyErr_Occurred()) || check_handle(m, *i) < 0) {
        return -1;
    }
    if (!(*s >= 0.0 && isfinite(*s))) {
        PyErr_Format(PyExc_ValueError, "%s: seconds must be finite, at least 0", name);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(sm_ran_doc,
             "ran($self, handle, seconds, /)\n--\n\n"
             "Record mode: account an execution of the block that ran for `seconds` without\n"
             "enter() and leave() (an iteration of a step loop at which the rule is not asked).");

static PyObject *
sm_ran(FlorSkipMachine *m, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t i;
    double s;
    if (handle_and_seconds(m, "ran", args, nargs, &i, &s) < 0) {
        return NULL;
    }
    if (m->mode != SB_RECORD) {
        PyErr_SetString(PyExc_RuntimeError, "ran() outside record mode");
        return NULL;
    }
    m->blocks[i].n++;
    m->blocks[i].compute += s;
    Py_RETURN_NONE;
}

/* Eq. 4: checkpoint iff M/C < n/(k+1) * min(1/(1+c), epsilon). */
static int
joint_invariant(double M, double C, uint64_t n, uint64_t k, double c, double eps, double *ratio,
                double *limit)
{
    double floor = 1.0 / (1.0 + c) < eps ? 1.0 / (1.0 + c) : eps;
    *limit = (double)n / (double)(k + 1) * floor;
    *ratio = C > 0.0 ? M / C : (M > 0.0 ? 1e300 : 0.0);
    return *ratio < *limit;
}

PyDoc_STRVAR(rule_doc,
             "rule(M, C, n, k, c, epsilon, /)\n--\n\n"
             "The adaptive checkpoint rule alone: (checkpoint, M/C, limit) with\n"
             "checkpoint = M/C < n/(k+1) * min(1/(1+c), epsilon).");

static PyObject *
rule(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    double M, C, c, eps, ratio, limit;
    unsigned long long n, k;
    int yes;
    if (flor_check_nargs("rule", nargs, 6, 6) < 0) {
        return NULL;
    }
    M = PyFloat_AsDouble(args[0]);
    C = PyFloat_AsDouble(args[1]);
    n = PyLong_AsUnsignedLongLong(args[2]);
    k = PyLong_AsUnsignedLongLong(args[3]);
    c = PyFloat_AsDouble(args[4]);
    eps = PyFloat_AsDouble(args[5]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    yes = joint_invariant(M, C, n, k, c, eps, &ratio, &limit);
    return Py_BuildValue("(Ndd)", PyBool_FromLong(yes), ratio, limit);
}

PyDoc_STRVAR(sm_decide_doc,
             "decide($self, handle, nbytes, M, write_s, spent=0.0, /)\n--\n\n"
             "Record mode, after leave(): whether to checkpoint this execution of nbytes,\n"
             "iff (M + spent/(k+1))/C < n/(k+1) * epsilon (record overhead) and\n"
             "(M + c*write_s)/C < n/(k+1) (replay from checkpoints cheaper than\n"
             "re-running), with M the seconds a checkpoint costs training, spent the\n"
             "seconds flor's other work at the block's n executions cost it, write_s the\n"
             "seconds its background write takes (accounted as its materialize time) and\n"
             "C the mean compute time. Returns\n"
             "(checkpoint, ratio, limit, M, terms): ratio and limit of the half that\n"
             "binds (the overhead half when both hold); terms = (cheap, worth, C, n, k,\n"
             "overhead ratio, overhead limit, replay ratio, replay limit), each half and\n"
             "the numbers it compared, k before this decision.");

static PyObject *
sm_decide(FlorSkipMachine *m, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t i;
    unsigned long long nbytes, n, k;
    double write_s, M, C, ratio, limit, oratio, olimit, rratio, rlimit, spent = 0.0;
    int yes, cheap, worth;
    sb_block *b;
    PyObject *terms;

    if (flor_check_nargs("decide", nargs, 4, 5) < 0) {
        return NULL;
    }
    i = PyLong_AsSsize_t(args[0]);
    if (i == -1 && PyErr_Occurred()) {
        return NULL;
    }
    nbytes = PyLong_AsUnsignedLongLong(args[1]);
    if (nbytes == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    M = PyFloat_AsDouble(args[2]);
    if (M == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    write_s = PyFloat_AsDouble(args[3]);
    if ((write_s == -1.0 && PyErr_Occurred()) || check_handle(m, i) < 0) {
        return NULL;
    }
    if (nargs == 5) {
        spent = PyFloat_AsDouble(args[4]);
        if (spent == -1.0 && PyErr_Occurred()) {
            return NULL;
        }
    }
    if (!(M >= 0.0 && isfinite(M)) || !(write_s >= 0.0 && isfinite(write_s)) ||
        !(spent >= 0.0 && isfinite(spent))) {
        PyErr_SetString(PyExc_ValueError,
                        "M, write_s and spent must be finite seconds, at least 0");
        return NULL;
    }
    b = &m->blocks[i];
    if (b->n == 0) {
        PyErr_SetString(PyExc_RuntimeError, "decide() before the block ever executed");
        return NULL;
    }
    n = (unsigned long long)b->n;
    k = (unsigned long long)b->k;
    C = b->compute / (double)b->n;
    /* the overhead half: the paper's rule with c = 0 puts epsilon in the floor;
     * flor's other work at the executions shares the bound with the checkpoints */
    cheap = joint_invariant(M + spent / (double)(b->k + 1), C, b->n, b->k, 0.0, m->epsilon, &oratio,
                            &olimit);
    /* the replay half: (M + R)/C < n/(k+1) */
    worth = joint_invariant(M + m->c * write_s, C, b->n, b->k, 0.0, 1.0, &rratio, &rlimit);
    yes = (cheap && worth) || !m->adaptive;
    ratio = cheap && !worth ? rratio : oratio;
    limit = cheap && !worth ? rlimit : olimit;
    terms = Py_BuildValue("(NNdKKdddd)", PyBool_FromLong(cheap), PyBool_FromLong(worth), C, n, k,
                          oratio, olimit, rratio, rlimit);
    if (terms == NULL) {
        return NULL;
    }
    if (yes) {
        b->k++;
        b->materialize += write_s;
        b->nbytes = nbytes;
    }
    return Py_BuildValue("(NdddN)", PyBool_FromLong(yes), ratio, limit, M, terms);
}

PyDoc_STRVAR(sm_overruled_doc,
             "overruled($self, handle, checkpoint, write_s, nbytes, /)\n--\n\n"
             "Record mode, after decide(): the ranks of a data-parallel group follow one\n"
             "decision per execution, and it was `checkpoint`, not what decide() said.\n"
             "Moves this execution's accounting (k, materialize time, bytes) to match.");

static PyObject *
sm_overruled(FlorSkipMachine *m, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t i;
    int yes;
    double write_s;
    unsigned long long nbytes;
    sb_block *b;

    if (flor_check_nargs("overruled", nargs, 4, 4) < 0) {
        return NULL;
    }
    i = PyLong_AsSsize_t(args[0]);
    if (i == -1 && PyErr_Occurred()) {
        return NULL;
    }
    yes = PyObject_IsTrue(args[1]);
    if (yes < 0) {
        return NULL;
    }
    write_s = PyFloat_AsDouble(args[2]);
    if (write_s == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    nbytes = PyLong_AsUnsignedLongLong(args[3]);
    if (nbytes == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    if (check_handle(m, i) < 0) {
        return NULL;
    }
    if (!(write_s >= 0.0 && isfinite(write_s))) {
        PyErr_SetString(PyExc_ValueError, "write_s must be finite seconds, at least 0");
        return NULL;
    }
    b = &m->blocks[i];
    if (yes) {
        b->k++;
        b->materialize += write_s;
        b->nbytes = nbytes;
    }
    else {
        if (b->k == 0) {
            PyErr_SetString(PyExc_RuntimeError,
                            "overruled(False) without a checkpoint that decide() allowed");
            return NULL;
        }
        b->k--;
        b->materialize = b->materialize > write_s ? b->materialize - write_s : 0.0;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(sm_restored_doc,
             "restored($self, handle, seconds, /)\n--\n\n"
             "Account the time spent restoring a skipped block's checkpoint.");

static PyObject *
sm_restored(FlorSkipMachine *m, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t i;
    double s;
    if (handle_and_seconds(m, "restored", args, nargs, &i, &s) < 0) {
        return NULL;
    }
    m->blocks[i].restores++;
    m->blocks[i].restore += s;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(sm_stats_doc,
             "stats($self, handle=None, /)\n--\n\n"
             "Per-block counters: key, n, k, compute_s, materialize_s (estimated),\n"
             "restore_s, restores, skips, steps, nbytes; a list of them by handle, or\n"
             "one block's when `handle` is given (a step loop asks at every iteration).");

static PyObject *
block_stats(const sb_block *b)
{
    return Py_BuildValue("{s:O,s:K,s:K,s:d,s:d,s:d,s:K,s:K,s:K,s:K}", "key", b->key, "n",
                         (unsigned long long)b->n, "k", (unsigned long long)b->k, "compute_s",
                         b->compute, "materialize_s", b->materialize, "restore_s", b->restore,
                         "restores", (unsigned long long)b->restores, "skips",
                         (unsigned long long)b->skips, "steps", (unsigned long long)b->steps,
                         "nbytes", (unsigned long long)b->nbytes);
}

static PyObject *
sm_stats(FlorSkipMachine *m, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *l = NULL;
    Py_ssize_t i;

    if (flor_check_nargs("stats", nargs, 0, 1) < 0) {
        goto done;
    }
    if (nargs == 1 && args[0] != Py_None) {
        i = PyLong_AsSsize_t(args[0]);
        if ((i == -1 && PyErr_Occurred()) || check_handle(m, i) < 0) {
            goto done;
        }
        l = block_stats(&m->blocks[i]);
        goto done;
    }
    l = PyList_New(m->nblocks);
    if (l == NULL) {
        goto done;
    }
    for (i = 0; i < m->nblocks; i++) {
        PyObject *d = block_stats(&m->blocks[i]);
        if (d == NULL) {
            Py_CLEAR(l);
            goto done;
        }
        PyList_SET_ITEM(l, i, d);
    }
done:
    return l;
}

static PyObject *
sm_get_phase(FlorSkipMachine *m, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(m->phase);
}

static int
sm_set_phase(FlorSkipMachine *m, PyObject *v, void *Py_UNUSED(closure))
{
    long p;
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete phase");
        return -1;
    }
    p = PyLong_AsLong(v);
    if (p == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (p != PHASE_WORK && p != PHASE_PSEUDORESUME) {
        PyErr_SetString(PyExc_ValueError, "phase must be WORK or PSEUDORESUME");
        return -1;
    }
    if (m->mode != SB_REPLAY && p == PHASE_PSEUDORESUME) {
        PyErr_SetString(PyExc_ValueError, "pseudoresume happens only in replay");
        return -1;
    }
    m->phase = (int)p;
    return 0;
}

static PyObject *
sm_get_depth(FlorSkipMachine *m, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(m->depth);
}

static PyObject *
sm_get_mode(FlorSkipMachine *m, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(m->mode);
}

static PyObject *
sm_get_epsilon(FlorSkipMachine *m, void *Py_UNUSED(closure))
{
    return PyFloat_FromDouble(m->epsilon);
}

static PyObject *
sm_get_c(FlorSkipMachine *m, void *Py_UNUSED(closure))
{
    return PyFloat_FromDouble(m->c);
}

static PyObject *
sm_get_adaptive(FlorSkipMachine *m, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(m->adaptive);
}

static PyObject *
sm_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"mode", "epsilon", "c", "adaptive", NULL};
    FlorSkipMachine *m;
    int mode, adaptive = 1;
    double eps, c;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "idd|p:SkipMachine", kwlist, &mode, &eps, &c,
                                     &adaptive)) {
        return NULL;
    }
    if (mode != SB_RECORD && mode != SB_REPLAY) {
        PyErr_SetString(PyExc_ValueError, "mode must be RECORD or REPLAY");
        return NULL;
    }
    if (!(eps > 0.0 && eps < 1.0) || !(c >= 0.0)) {
        /* The values as parsed: they may have come by keyword. */
        char got[96];
        snprintf(got, sizeof(got), "epsilon=%.17g, c=%.17g", eps, c);
        PyErr_Format(PyExc_ValueError, "epsilon must be in (0, 1) and c at least 0 (got %s)", got);
        return NULL;
    }
    m = (FlorSkipMachine *)type->tp_alloc(type, 0);
    if (m == NULL) {
        return NULL;
    }
    m->mode = mode;
    m->epsilon = eps;
    m->c = c;
    m->adaptive = adaptive;
    m->index = PyDict_New();
    if (m->index == NULL) {
        Py_DECREF(m);
        return NULL;
    }
    return (PyObject *)m;
}

static int
sm_traverse(FlorSkipMachine *m, visitproc visit, void *arg)
{
    Py_ssize_t i;
    Py_VISIT(Py_TYPE(m));
    Py_VISIT(m->index);
    for (i = 0; i < m->nblocks; i++) {
        Py_VISIT(m->blocks[i].key);
    }
    return 0;
}

static int
sm_clear(FlorSkipMachine *m)
{
    Py_ssize_t i;
    Py_CLEAR(m->index);
    for (i = 0; i < m->nblocks; i++) {
        Py_CLEAR(m->blocks[i].key);
    }
    return 0;
}

static void
sm_dealloc(FlorSkipMachine *m)
{
    PyTypeObject *tp = Py_TYPE(m);
    PyObject_GC_UnTrack(m);
    sm_clear(m);
    free(m->blocks);
    free(m->stack);
    tp->tp_free(m);
    Py_DECREF(tp);
}

/* ------------------------------------------------------------------ */
/* QuietSteps: a run of a step loop's iterations at which the rule is not
 * asked and no block runs (flor/runtime/loops.py, recording.py).
 *
 *     def __next__(self):                   # the body of the last item ended
 *         if started:
 *             body = now - t_item
 *             if session.where is not last_where or now >= deadline:
 *                 status, pending = OPEN, body; stop  # a loop or block opened in
 *                                        # it, or a flush is due: Python ends it
 *             n += 1; compute += body            # as ran(handle, body)
 *             accounted += 1; clean += body
 *             if accounted == quota: status = LIMIT; stop
 *         frame[3] = i                          # the context's index, and where
 *         session.where = journal.info = Where(phase, f"{head}{i}]]", top, i, (i,))
 *         x = next(it)                          # StopIteration: status = ENDED; stop
 *         i += 1; drawn += 1; t_item = now; return x
 *
 * A step loop's every step costs the training thread what it does here, in
 * place of a dozen Python calls per step.  Python reads outcome() once the
 * run stops (or the loop is left by break or an exception), and accounts
 * what the run did in one go. */

enum { QS_RUNNING = -1, QS_LIMIT = 0, QS_ENDED = 1, QS_OPEN = 2, QS_FAILED = 3 };

typedef struct {
    PyObject_HEAD
    FlorSkipMachine *machine;
    Py_ssize_t handle;
    PyObject *it, *frame, *session, *journal, *where_type, *phase, *head, *top;
    PyObject *last_where;
    const flor_state *st; /* its module's: the type (held) holds the module */
    Py_ssize_t index, quota, drawn, accounted;
    double deadline, t_item, clean, own, pending;
    int started, status;
} FlorQuietSteps;

/* Point the session at iteration q->index: frame[3], session.where and the
 * journal's info, as Session._context_changed() does for a step loop. */
static int
qs_set_index(FlorQuietSteps *q)
{
    PyObject *i = NULL, *ctx = NULL, *ind = NULL, *vals = NULL, *targs = NULL, *w = NULL;
    int rc = -1;

    i = PyLong_FromSsize_t(q->index);
    if (i == NULL) {
        goto done;
    }
    ctx = PyUnicode_FromFormat("%U%zd]]", q->head, q->index);
    ind = PyTuple_Pack(1, i);
    if (ctx == NULL || ind == NULL) {
        goto done;
    }
    vals = PyTuple_Pack(5, q->phase, ctx, q->top, i, ind);
    targs = vals == NULL ? NULL : PyTuple_Pack(1, vals);
    if (targs == NULL) {
        goto done;
    }
    /* tuple.__new__(Where, values): what the named tuple's own __new__ does */
    w = PyTuple_Type.tp_new((PyTypeObject *)q->where_type, targs, NULL);
    if (w == NULL || PyList_SetItem(q->frame, 3, Py_NewRef(i)) < 0 ||
        PyObject_SetAttr(q->session, q->st->s_where, w) < 0 ||
        PyObject_SetAttr(q->journal, q->st->s_info, w) < 0) {
        goto done;
    }
    Py_XSETREF(q->last_where, Py_NewRef(w));
    rc = 0;
done:
    Py_XDECREF(i);
    Py_XDECREF(ctx);
    Py_XDECREF(ind);
    Py_XDECREF(vals);
    Py_XDECREF(targs);
    Py_XDECREF(w);
    return rc;
}

/* The body of the last item ended at `now`: account it, or stop the run
 * (1) where the session must see this iteration's end (a loop or block
 * opened in it; a flush is due, which the end of an iteration does). */
static int
qs_end_body(FlorQuietSteps *q, double now)
{
    double body = now - q->t_item;
    sb_block *b;
    int same;
    PyObject *cur = PyObject_GetAttr(q->session, q->st->s_where);
    if (cur == NULL) {
        return -1;
    }
    same = cur == q->last_where;
    Py_DECREF(cur);
    if (!same || now >= q->deadline) {
        q->status = QS_OPEN;
        q->pending = body;
        return 1;
    }
    b = &q->machine->blocks[q->handle];
    b->n++;
    b->compute += body;
    q->clean += body;
    q->accounted++;
    if (q->accounted >= q->quota) {
        q->status = QS_LIMIT;
        return 1;
    }
    return 0;
}

static PyObject *
qs_next(FlorQuietSteps *q)
{
    double t0 = flor_now(), t1;
    PyObject *x = NULL;
    int got;

    if (q->status != QS_RUNNING) {
        goto done;
    }
    if (q->started) {
        got = qs_end_body(q, t0);
        if (got != 0) {
            if (got < 0) {
                q->status = QS_FAILED;
            }
            goto done;
        }
    }
    q->started = 1;
    if (qs_set_index(q) < 0) {
        q->status = QS_FAILED;
        goto done;
    }
    t1 = flor_now();
    q->own += t1 - t0;
    x = PyIter_Next(q->it); /* what runs while it is drawn is the iteration's */
    if (x == NULL) {
        q->status = PyErr_Occurred() ? QS_FAILED : QS_ENDED;
        goto done;
    }
    q->index++;
    q->drawn++;
    q->t_item = flor_now();
done:
    return x;
}

PyDoc_STRVAR(qs_outcome_doc,
             "outcome($self, /)\n--\n\n"
             "(status, drawn, accounted, clean, own, pending): why the run stopped\n"
             "(-1 running, 0 LIMIT, 1 ENDED, 2 OPEN, 3 FAILED), the items drawn, the\n"
             "iterations ended and accounted (ran() of each), the seconds of their bodies,\n"
             "flor's seconds at them, and the body seconds of the last item drawn where\n"
             "the run stopped at its end and left it to end in Python (OPEN).");

static PyObject *
qs_outcome(FlorQuietSteps *q, PyObject *Py_UNUSED(ignored))
{
    return Py_BuildValue("(innddd)", q->status, q->drawn, q->accounted, q->clean, q->own,
                         q->pending);
}

static int
qs_traverse(FlorQuietSteps *q, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(q));
    Py_VISIT(q->machine);
    Py_VISIT(q->it);
    Py_VISIT(q->frame);
    Py_VISIT(q->session);
    Py_VISIT(q->journal);
    Py_VISIT(q->where_type);
    Py_VISIT(q->phase);
    Py_VISIT(q->head);
    Py_VISIT(q->top);
    Py_VISIT(q->last_where);
    return 0;
}

static int
qs_clear(FlorQuietSteps *q)
{
    Py_CLEAR(q->machine);
    Py_CLEAR(q->it);
    Py_CLEAR(q->frame);
    Py_CLEAR(q->session);
    Py_CLEAR(q->journal);
    Py_CLEAR(q->where_type);
    Py_CLEAR(q->phase);
    Py_CLEAR(q->head);
    Py_CLEAR(q->top);
    Py_CLEAR(q->last_where);
    return 0;
}

static void
qs_dealloc(FlorQuietSteps *q)
{
    PyTypeObject *tp = Py_TYPE(q);
    PyObject_GC_UnTrack(q);
    qs_clear(q);
    tp->tp_free(q);
    Py_DECREF(tp);
}

static PyMethodDef qs_methods[] = {
    {"outcome", FLOR_CFUNC(qs_outcome), METH_NOARGS, qs_outcome_doc},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot qs_slots[] = {
    {Py_tp_dealloc, qs_dealloc},
    {Py_tp_traverse, qs_traverse},
    {Py_tp_clear, qs_clear},
    {Py_tp_iter, PyObject_SelfIter},
    {Py_tp_iternext, qs_next},
    {Py_tp_methods, qs_methods},
    {Py_tp_doc, "A run of a step loop's quiet iterations (SkipMachine.quiet_steps)."},
    {0, NULL},
};

PyType_Spec flor_quietsteps_spec = {
    .name = "flor._core.QuietSteps",
    .basicsize = sizeof(FlorQuietSteps),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = qs_slots,
};

PyDoc_STRVAR(
    sm_quiet_steps_doc,
    "quiet_steps($self, handle, it, frame, index, quota, deadline, session, journal, where_type,\n"
    "            phase, head, top, /)\n--\n\n"
    "Record mode: an iterator over the items of `it` for a run of at most `quota`\n"
    "iterations of the step loop whose LoopFrame is `frame`, starting at iteration\n"
    "`index`, each accounted as ran(handle, seconds of its body) as it ends; it stops\n"
    "after `quota`, at the end of an iteration in which the session's where changed\n"
    "or by which the monotonic clock passed `deadline` (left open), or when `it`\n"
    "ends (see outcome()).  Each item sets frame[3], session.where and journal.info\n"
    "to where_type(phase, f\"{head}{i}]]\", top, i, (i,)) before it is drawn.");

static PyObject *
sm_quiet_steps(FlorSkipMachine *m, PyObject *const *args, Py_ssize_t nargs)
{
    flor_state *st = flor_state_of_type(Py_TYPE(m));
    FlorQuietSteps *q = NULL;
    Py_ssize_t h, index, quota;
    double deadline;
    PyObject *it;

    if (flor_check_nargs("quiet_steps", nargs, 12, 12) < 0) {
        goto done;
    }
    if ((h = PyLong_AsSsize_t(args[0])) == -1 && PyErr_Occurred()) {
        goto done;
    }
    if ((index = PyLong_AsSsize_t(args[3])) == -1 && PyErr_Occurred()) {
        goto done;
    }
    if ((quota = PyLong_AsSsize_t(args[4])) == -1 && PyErr_Occurred()) {
        goto done;
    }
    if (((deadline = PyFloat_AsDouble(args[5])) == -1.0 && PyErr_Occurred()) ||
        check_handle(m, h) < 0) {
        goto done;
    }
    if (m->mode != SB_RECORD) {
        PyErr_SetString(PyExc_RuntimeError, "quiet_steps() outside record mode");
        goto done;
    }
    it = args[1];
    if (!PyIter_Check(it)) {
        PyErr_SetString(PyExc_TypeError, "quiet_steps() needs an iterator");
        goto done;
    }
    if (!PyList_Check(args[2]) || PyList_GET_SIZE(args[2]) < 4) {
        PyErr_SetString(PyExc_TypeError, "quiet_steps() needs a loop frame [L, loop, run, i]");
        goto done;
    }
    if (!PyType_Check(args[8]) || !PyType_IsSubtype((PyTypeObject *)args[8], &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "quiet_steps() needs a tuple type for where");
        goto done;
    }
    if (!PyUnicode_Check(args[10])) {
        PyErr_SetString(PyExc_TypeError, "quiet_steps() needs a str head");
        goto done;
    }
    if (index < 0 || quota < 1) {
        PyErr_SetString(PyExc_ValueError, "quiet_steps() needs index >= 0 and quota >= 1");
        goto done;
    }
    q = PyObject_GC_New(FlorQuietSteps, st->QuietStepsType);
    if (q == NULL) {
        goto done;
    }
    q->machine = (FlorSkipMachine *)Py_NewRef(m);
    q->handle = h;
    q->it = Py_NewRef(it);
    q->frame = Py_NewRef(args[2]);
    q->session = Py_NewRef(args[6]);
    q->journal = Py_NewRef(args[7]);
    q->where_type = Py_NewRef(args[8]);
    q->phase = Py_NewRef(args[9]);
    q->head = Py_NewRef(args[10]);
    q->top = Py_NewRef(args[11]);
    q->last_where = NULL;
    q->st = st;
    q->index = index;
    q->quota = quota;
    q->drawn = q->accounted = 0;
    q->deadline = deadline;
    q->t_item = q->clean = q->own = q->pending = 0.0;
    q->started = 0;
    q->status = QS_RUNNING;
    PyObject_GC_Track(q);
done:
    return (PyObject *)q;
}

static PyMethodDef sm_methods[] = {
    {"block", FLOR_CFUNC(sm_block), METH_O, sm_block_doc},
    {"wants", FLOR_CFUNC(sm_wants), METH_O, sm_wants_doc},
    {"enter", FLOR_CFUNC(sm_enter), METH_FASTCALL, sm_enter_doc},
    {"leave", FLOR_CFUNC(sm_leave), METH_O, sm_leave_doc},
    {"ran", FLOR_CFUNC(sm_ran), METH_FASTCALL, sm_ran_doc},
    {"decide", FLOR_CFUNC(sm_decide), METH_FASTCALL, sm_decide_doc},
    {"overruled", FLOR_CFUNC(sm_overruled), METH_FASTCALL, sm_overruled_doc},
    {"restored", FLOR_CFUNC(sm_restored), METH_FASTCALL, sm_restored_doc},
    {"stats", FLOR_CFUNC(sm_stats), METH_FASTCALL, sm_stats_doc},
    {"quiet_steps", FLOR_CFUNC(sm_quiet_steps), METH_FASTCALL, sm_quiet_steps_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef sm_getset[] = {
    {"phase", (getter)sm_get_phase, (setter)sm_set_phase, "WORK or PSEUDORESUME.", NULL},
    {"depth", (getter)sm_get_depth, NULL, "Number of open blocks.", NULL},
    {"mode", (getter)sm_get_mode, NULL, "RECORD or REPLAY.", NULL},
    {"epsilon", (getter)sm_get_epsilon, NULL, "Record overhead tolerance.", NULL},
    {"c", (getter)sm_get_c, NULL, "Restore/materialize time ratio.", NULL},
    {"adaptive", (getter)sm_get_adaptive, NULL,
     "False: checkpoint every execution (the rule is still evaluated and reported).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot sm_slots[] = {
    {Py_tp_new, sm_new},
    {Py_tp_dealloc, sm_dealloc},
    {Py_tp_traverse, sm_traverse},
    {Py_tp_clear, sm_clear},
    {Py_tp_methods, sm_methods},
    {Py_tp_getset, sm_getset},
    {Py_tp_doc, "SkipMachine(mode, epsilon, c, adaptive=True)\n--\n\n"
                "The SkipBlock state machine and the adaptive checkpoint rule."},
    {0, NULL},
};

PyType_Spec flor_skipmachine_spec = {
    .name = "flor._core.SkipMachine",
    .basicsize = sizeof(FlorSkipMachine),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = sm_slots,
};

int
flor_skipblock_constants(PyObject *module)
{
    size_t i;
    if (PyModule_AddIntConstant(module, "RECORD", SB_RECORD) < 0 ||
        PyModule_AddIntConstant(module, "REPLAY", SB_REPLAY) < 0 ||
        PyModule_AddIntConstant(module, "WORK", PHASE_WORK) < 0 ||
        PyModule_AddIntConstant(module, "PSEUDORESUME_PHASE", PHASE_PSEUDORESUME) < 0 ||
        PyModule_AddIntConstant(module, "QUIET_LIMIT", QS_LIMIT) < 0 ||
        PyModule_AddIntConstant(module, "QUIET_ENDED", QS_ENDED) < 0 ||
        PyModule_AddIntConstant(module, "QUIET_OPEN", QS_OPEN) < 0) {
        return -1;
    }
    for (i = 0; i < sizeof(state_names) / sizeof(state_names[0]); i++) {
        char name[32];
        size_t k;
        snprintf(name, sizeof(name), "%s", state_names[i]);
        for (k = 0; name[k]; k++) {
            name[k] = (char)(name[k] >= 'a' && name[k] <= 'z' ? name[k] - 32 : name[k]);
        }
        if (PyModule_AddIntConstant(module, name, (long)i) < 0) {
            return -1;
        }
    }
    return 0;
}

PyMethodDef flor_skipblock_functions[] = {
    {"rule", FLOR_CFUNC(rule), METH_FASTCALL, rule_doc},
    {NULL, NULL, 0, NULL},
};
