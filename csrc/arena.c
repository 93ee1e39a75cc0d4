/* arena.c: warm host staging buffers, reused across snapshots.
 *
 *     class Pool:                                   # one per module, GIL-protected
 *         def take(self, n, pinned):
 *             a = smallest free arena with n <= a.cap <= 2 * n + 2 MiB
 *             if a is None:
 *                 a = mmap(round_up(n, 2 MiB))      # madvise HUGEPAGE, DONTFORK;
 *                                                   # 64 KiB steps under 1 MiB
 *                 if pinned: cudaHostRegister(a)    # via torch.cuda.cudart()
 *             return a
 *         def give(self, a):
 *             self.free.insert(0, a)
 *             drop least recently used arenas while free bytes > 2 * largest request
 *
 * Why: the first write to fresh memory page-faults, and on a VM that costs
 * ten times the copy itself.  A snapshot copies into an arena that an earlier
 * snapshot already touched, so it runs at memcpy speed.
 *
 * Arenas are MADV_DONTFORK: children forked by the user (DataLoader workers)
 * do not share them, so refilling an arena never takes a copy-on-write fault.
 * The fork materializer marks the arenas of the batch it hands to its child as
 * inheritable just around its own fork().  A forked process drops the pool it
 * inherited (the mappings are not there) and starts an empty one.
 */
#include "flor.h"

#include <errno.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#define ARENA_GRAIN ((size_t)2 << 20) /* huge-page size */
#define SMALL_GRAIN ((size_t)64 << 10)  /* arenas under half a huge page */

/* An arena's size for `n` bytes: whole huge pages, except that a small
 * snapshot (a counter, a 1 KB state) takes 64 KiB steps: at 2 MiB each, a
 * backlog of small checkpoints held a thousand times their bytes. */
static size_t
round_grain(size_t n)
{
    size_t grain = n < ARENA_GRAIN / 2 ? SMALL_GRAIN : ARENA_GRAIN;
    if (n == 0) {
        n = 1;
    }
    return (n + grain - 1) & ~(grain - 1);
}

/* Register or unregister an arena with the CUDA driver through torch.
 * Returns 1 on success, 0 if CUDA said no (the caller falls back to
 * synchronous copies), -1 with an exception set on a Python error. */
static int
cuda_host_call(const char *fn, flor_arena *a, int reg)
{
    int rc = -1;
    PyObject *cuda = NULL, *cudart = NULL, *res = NULL, *code = NULL;

    cuda = PyImport_ImportModule("torch.cuda");
    if (cuda == NULL) {
        goto cleanup;
    }
    cudart = PyObject_CallMethod(cuda, "cudart", NULL);
    if (cudart == NULL) {
        goto cleanup;
    }
    if (reg) {
        res = PyObject_CallMethod(cudart, fn, "KnI", (unsigned long long)(uintptr_t)a->base,
                                  (Py_ssize_t)a->cap, 0u);
    }
    else {
        res = PyObject_CallMethod(cudart, fn, "K", (unsigned long long)(uintptr_t)a->base);
    }
    if (res == NULL) {
        goto cleanup;
    }
    code = PyNumber_Long(res);
    if (code == NULL) {
        goto cleanup;
    }
    rc = PyLong_AsLong(code) == 0 ? 1 : 0;
    if (PyErr_Occurred()) {
        rc = -1;
    }
cleanup:
    Py_XDECREF(code);
    Py_XDECREF(res);
    Py_XDECREF(cudart);
    Py_XDECREF(cuda);
    return rc;
}

static void
arena_free(flor_arena *a)
{
    if (a->owner == getpid()) {
        if (a->pinned) {
            /* Best effort: a failure here only leaks a registration.  This
             * may run while an exception propagates: keep it. */
            PyObject *t, *v, *tb;
            PyErr_Fetch(&t, &v, &tb);
            if (cuda_host_call("cudaHostUnregister", a, 0) < 0) {
                PyErr_Clear();
            }
            PyErr_Restore(t, v, tb);
        }
        munmap(a->base, a->cap);
    }
    free(a);
}

/* A forked child inherits the pool's bookkeeping but not the mappings. */
static void
pool_check_owner(flor_state *st)
{
    pid_t me = getpid();
    if (st->pool.owner != me) {
        flor_arena *a = st->pool.free_list;
        while (a != NULL) {
            flor_arena *next = a->next;
            free(a);
            a = next;
        }
        st->pool.free_list = NULL;
        st->pool.free_bytes = 0;
        st->pool.owner = me;
    }
}

/* What staging `nbytes` holds of memory: the capacity of the arena a fresh
 * take maps.  Backpressure counts this, not the bytes staged: a small
 * snapshot still holds a whole arena until its write is done. */
size_t
flor_pool_charge(size_t nbytes)
{
    return nbytes == 0 ? 0 : round_grain(nbytes);
}

flor_arena *
flor_pool_take(flor_state *st, size_t nbytes, int pinned)
{
    flor_arena **best = NULL, **pp;
    flor_arena *a = NULL;
    size_t cap;

    pool_check_owner(st);
    st->pool.takes++;
    if (nbytes > st->pool.high_water) {
        st->pool.high_water = nbytes;
    }
    for (pp = &st->pool.free_list; *pp != NULL; pp = &(*pp)->next) {
        flor_arena *c = *pp;
        if (c->cap < nbytes || c->cap > 2 * nbytes + ARENA_GRAIN) {
            continue;
        }
        if (pinned && !c->pinned) {
            continue;
        }
        if (best == NULL || c->cap < (*best)->cap) {
            best = pp;
        }
    }
    if (best != NULL) {
        a = *best;
        *best = a->next;
        a->next = NULL;
        st->pool.free_bytes -= a->cap;
        return a;
    }

    cap = round_grain(nbytes);
    a = calloc(1, sizeof(*a));
    if (a == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    a->base = mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (a->base == MAP_FAILED) {
        free(a);
        errno = ENOMEM;
        PyErr_Format(PyExc_MemoryError, "flor: cannot map a %zu-byte staging buffer for a snapshot",
                     cap);
        return NULL;
    }
    a->cap = cap;
    a->owner = getpid();
#ifdef MADV_HUGEPAGE
    (void)madvise(a->base, cap, MADV_HUGEPAGE);
#endif
#ifdef MADV_DONTFORK
    (void)madvise(a->base, cap, MADV_DONTFORK);
#endif
    st->pool.fresh++;
    st->pool.fresh_bytes += cap;
    if (pinned) {
        int r = cuda_host_call("cudaHostRegister", a, 1);
        if (r < 0) {
            arena_free(a);
            return NULL;
        }
        a->pinned = r;
    }
    return a;
}

void
flor_pool_trim(flor_state *st, size_t keep)
{
    pool_check_owner(st);
    while (st->pool.free_bytes > keep && st->pool.free_list != NULL) {
        /* give() pushes at the head: the tail is the least recently used. */
        flor_arena **pp = &st->pool.free_list;
        flor_arena *a;
        while ((*pp)->next != NULL) {
            pp = &(*pp)->next;
        }
        a = *pp;
        *pp = NULL;
        st->pool.free_bytes -= a->cap;
        arena_free(a);
    }
}

void
flor_pool_give(flor_state *st, flor_arena *a)
{
    if (a == NULL) {
        return;
    }
    pool_check_owner(st);
    if (a->owner != st->pool.owner) {
        /* Taken by the process we were forked from: not mapped here. */
        free(a);
        return;
    }
    a->next = st->pool.free_list;
    st->pool.free_list = a;
    st->pool.free_bytes += a->cap;
    /* In whole arenas: below one grain, twice the largest request would
     * keep none, and every small snapshot would map (and pin) a fresh one. */
    flor_pool_trim(st, 2 * round_grain(st->pool.high_water));
}

/* Unmap every free arena and forget the largest request: after a one-time
 * large snapshot (the store's calibration), small ones keep no more than
 * they need. */
void
flor_pool_clear(flor_state *st)
{
    flor_pool_trim(st, 0);
    st->pool.high_water = 0;
}

void
flor_pool_release(flor_state *st)
{
    flor_arena *a = st->pool.free_list;
    pid_t me = getpid();
    while (a != NULL) {
        flor_arena *next = a->next;
        if (a->owner == me && st->pool.owner == me) {
            munmap(a->base, a->cap); /* a pinned arena dies with its registration */
        }
        free(a);
        a = next;
    }
    st->pool.free_list = NULL;
    st->pool.free_bytes = 0;
}

void
flor_arena_set_inherit(flor_arena *a, int inherit)
{
#if defined(MADV_DOFORK) && defined(MADV_DONTFORK)
    (void)madvise(a->base, a->cap, inherit ? MADV_DOFORK : MADV_DONTFORK);
#else
    (void)a;
    (void)inherit;
#endif
}

/* ------------------------------------------------------------------ */
/* Module functions.                                                    */

PyDoc_STRVAR(pool_stats_doc,
             "pool_stats()\n--\n\n"
             "Staging-buffer pool counters: free bytes held, largest request, takes,\n"
             "fresh mappings and their bytes.");

static PyObject *
mod_pool_stats(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    flor_pool *p = &((flor_state *)PyModule_GetState(module))->pool;
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K}", "free_bytes", (unsigned long long)p->free_bytes,
                         "high_water", (unsigned long long)p->high_water, "takes",
                         (unsigned long long)p->takes, "fresh", (unsigned long long)p->fresh,
                         "fresh_bytes", (unsigned long long)p->fresh_bytes);
}

PyDoc_STRVAR(trim_pool_doc,
             "trim_pool()\n--\n\n"
             "Unmap every free staging buffer and forget the largest request (the\n"
             "pool keeps up to twice it free).");

static PyObject *
mod_trim_pool(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    flor_pool_clear(((flor_state *)PyModule_GetState(module)));
    Py_RETURN_NONE;
}

PyMethodDef flor_arena_functions[] = {
    {"pool_stats", FLOR_CFUNC(mod_pool_stats), METH_NOARGS, pool_stats_doc},
    {"trim_pool", FLOR_CFUNC(mod_trim_pool), METH_NOARGS, trim_pool_doc},
    {NULL, NULL, 0, NULL},
};
