/* materializer.c: snapshot now, write later.
 *
 *     class Materializer:
 *         def submit(self, path, obj):
 *             snap = snapshot(obj)            # waits first while held_bytes (the
 *             if mode == INLINE:              # staging arenas' sizes) would pass
 *                                             # max_buffer_bytes (backpressure)
 *                 write(path, pickle(snap.skeleton), snap)
 *             elif mode == THREAD:
 *                 queue.put((path, snap))     # C writer thread: pickles the skeleton
 *             else:                           # with the GIL, writes without it
 *                 batch.append((path, snap))
 *                 if batch passes batch_bytes or batch_count:
 *                     fork(); the child pickles and writes the batch, reports each
 *                     result on a pipe, and _exit()s; at most max_children live
 *         def flush(self):
 *             write everything submitted; return the failures (path, errno, step, msg)
 *
 * The fork happens between PyOS_BeforeFork() and PyOS_AfterFork_*().  The
 * child runs no tensor operation, no CUDA and no OpenMP parallel region: the
 * skeleton it pickles holds only plain Python objects and Refs, and the bytes
 * it writes sit in arenas.  (The Python at-fork hooks that
 * PyOS_AfterFork_Child runs include torch's, which reads the thread count.)  It
 * pauses the garbage collector (no finalizer runs), blocks SIGINT/SIGTERM/SIGHUP
 * so a batch in progress is finished, and leaves with _exit().  Children are
 * reaped by pid; their results travel on a pipe, so a SIGCHLD disposition set
 * by the user (even SIG_IGN) or a stray waitpid(-1) elsewhere changes nothing.
 * No signal disposition of the process is ever changed.
 *
 * One thread at a time drives an engine (flor.Materializer holds a lock around
 * submit, flush and close); the writer thread shares only the queue, the done
 * list and the byte counts, under `mu`.
 */
#include "flor.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { MODE_INLINE = 0, MODE_THREAD = 1, MODE_FORK = 2 };

#define MSG_MAX 1024

typedef struct flor_job {
    struct flor_job *next;
    PyObject *snapshot; /* FlorSnapshot */
    PyObject *meta;     /* pickled skeleton, once made */
    char *path;
    uint64_t bytes;  /* staging memory held: flor_pool_charge(data_bytes) */
    uint64_t nbytes; /* the snapshot's bytes */
    int err;        /* errno; -1 for a Python error (message in msg) */
    const char *step;
    char *msg;
    int done;
    double seconds; /* spent pickling and writing */
    unsigned char tag[FLOR_TAG_LEN];
    int has_tag;
    PyObject *signer;   /* signer(tag, meta, table) -> 32 bytes, or NULL */
    flor_dedup *dedup;  /* the engine's, in thread and inline modes */
    uint64_t written;   /* data bytes the file holds (refs to earlier files excluded) */
} flor_job;

typedef struct {
    pid_t pid;
    int fd;
    flor_job *jobs;
    char *buf;
    size_t len, cap;
} flor_child;

typedef struct {
    PyObject_HEAD
    int mode;
    uint64_t max_buffer_bytes, batch_bytes;
    Py_ssize_t batch_count;
    int max_children;
    pid_t owner;
    int closed;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    int thread_started, stopping, busy;
    int thread_exited; /* the writer thread left its loop (its CPU is in writer_cpu) */
    flor_job *queue_head, *queue_tail;
    flor_job *done; /* finished, awaiting the GIL to be released */
    uint64_t held_bytes, peak_held_bytes;
    uint64_t reserved; /* what the snapshot in progress reserved */

    flor_job *batch_head, *batch_tail;
    Py_ssize_t batch_n;
    uint64_t batch_now;
    flor_child *children;
    int nchildren;

    PyObject *failures; /* [(path, errno, step, message)] */
    PyObject *signer;   /* signs each file's metadata, or NULL */
    flor_dedup *dedup;  /* incremental: blobs made durable so far */
    flor_dedup *submitted_index; /* and those of the last checkpoints submitted */
    uint64_t bytes_referenced;
    uint64_t submitted, written, failed, bytes_written, forks, fork_fallbacks;
    double block_seconds, max_block_seconds, write_seconds;
    double writer_cpu; /* CPU seconds of writers that finished: threads, reaped children */
} FlorMaterializer;

static flor_state *
mat_state(FlorMaterializer *m)
{
    return flor_state_of_type(Py_TYPE(m));
}

/* ------------------------------------------------------------------ */
/* Jobs.                                                                */

static void
job_free(flor_job *j)
{
    Py_XDECREF(j->snapshot);
    Py_XDECREF(j->meta);
    Py_XDECREF(j->signer);
    free(j->path);
    free(j->msg);
    free(j);
}

/* The Python error just raised becomes the job's result (GIL held), never
 * a lost exception; the job is not written. */
static void
job_error(flor_job *j, const char *step)
{
    PyObject *t, *v, *tb, *s;
    const char *u;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    s = v != NULL ? PyObject_Repr(v) : NULL;
    u = s != NULL ? PyUnicode_AsUTF8(s) : NULL;
    j->err = -1;
    j->step = step;
    free(j->msg);
    j->msg = strdup(u != NULL ? u : "unprintable error");
    PyErr_Clear();
    Py_XDECREF(s);
    Py_XDECREF(t);
    Py_XDECREF(v);
    Py_XDECREF(tb);
}

static void
job_fail(flor_job *j, const char *step)
{
    job_error(j, step);
    Py_CLEAR(j->meta);
}

/* Pickle the job's skeleton (GIL held). */
static void
job_pickle(flor_state *st, flor_job *j)
{
    double t0 = flor_now();
    if (j->meta != NULL || j->err != 0) {
        return;
    }
    j->meta = flor_pickle_skeleton(st, ((FlorSnapshot *)j->snapshot)->skeleton,
                                   ((FlorSnapshot *)j->snapshot)->tree);
    j->seconds += flor_now() - t0;
    if (j->meta == NULL) {
        job_fail(j, "pickle");
    }
}

/* Wait for the snapshot's device-to-host copies (GIL held, released while
 * waiting): its bytes are read only once they have landed. */
static void
job_wait(flor_job *j)
{
    if (j->err == 0 && flor_snapshot_wait((FlorSnapshot *)j->snapshot) < 0) {
        job_fail(j, "copy");
    }
}

/* flor_sign_fn of a job: its signer signs its tag, metadata and table (the
 * GIL taken here; a failure is the job's). */
static int
job_sign(void *ctx, const unsigned char *table, size_t table_len, unsigned char *sig)
{
    flor_job *j = ctx;
    PyGILState_STATE g = PyGILState_Ensure();
    int rc = flor_sign(j->signer, j->has_tag ? j->tag : NULL, j->meta, table, table_len, sig);
    if (rc < 0) {
        job_error(j, "sign");
    }
    PyGILState_Release(g);
    return rc;
}

/* Write one job (no GIL needed; a signer takes it). */
static void
job_write(flor_job *j)
{
    flor_ioerr e;
    flor_wopts o;
    double t0 = flor_now();
    if (j->meta == NULL) {
        return;
    }
    memset(&o, 0, sizeof(o));
    o.tag = j->has_tag ? j->tag : NULL;
    if (j->signer != NULL) {
        o.sign = job_sign;
        o.sign_ctx = j;
    }
    o.dedup = j->dedup;
    if (flor_write_file(j->path, PyBytes_AS_STRING(j->meta), (size_t)PyBytes_GET_SIZE(j->meta),
                        (FlorSnapshot *)j->snapshot, &o, &e) < 0 &&
        j->err == 0) {
        j->err = e.err; /* (a signer's failure is recorded already) */
        j->step = e.step;
    }
    j->written = o.written;
    j->seconds += flor_now() - t0;
}

/* Release finished jobs and collect their failures (GIL held). */
static int
reap_done(FlorMaterializer *m)
{
    flor_job *j, *next;
    int rc = 0;
    pthread_mutex_lock(&m->mu);
    j = m->done;
    m->done = NULL;
    pthread_mutex_unlock(&m->mu);
    for (; j != NULL; j = next) {
        next = j->next;
        if (j->err != 0) {
            /* A child may cut a long message inside a UTF-8 sequence. */
            const char *msg = j->msg ? j->msg : "";
            PyObject *f = Py_BuildValue("(yisN)", j->path, j->err, j->step ? j->step : "",
                                        PyUnicode_DecodeUTF8(msg, (Py_ssize_t)strlen(msg),
                                                             "replace"));
            if (f == NULL || PyList_Append(m->failures, f) < 0) {
                rc = -1;
            }
            Py_XDECREF(f);
        }
        job_free(j);
    }
    return rc;
}

/* A job finished: its counters change with its write's seconds, so that
   stats() never shows the time of a write without its file and bytes. */
static void
push_done_locked(FlorMaterializer *m, flor_job *j)
{
    j->done = 1;
    j->next = m->done;
    m->done = j;
    m->held_bytes -= j->bytes;
    m->write_seconds += j->seconds;
    if (j->err != 0) {
        m->failed++;
    }
    else {
        m->written++;
        /* A fork child's count stays in the child: it writes every blob. */
        m->bytes_written += j->dedup != NULL ? j->written : j->nbytes;
        m->bytes_referenced += j->dedup != NULL ? j->nbytes - j->written : 0;
    }
}

/* ------------------------------------------------------------------ */
/* Thread mode.                                                         */

/* Seconds on `clock` (a CPU-time clock), 0 where it cannot be read. */
static double
clock_seconds(clockid_t clock)
{
    struct timespec ts;
    if (clock_gettime(clock, &ts) != 0) {
        return 0.0;
    }
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* CPU seconds the writers have used so far: those that finished, and the
 * writer thread's own clock while it runs.  `mu` held: the thread cannot
 * leave its loop (and be joined) meanwhile.  A forked copy of the engine
 * has no writer thread of its own: it reports the writers that finished. */
static double
writer_cpu_locked(FlorMaterializer *m)
{
    clockid_t clock;
    double s = m->writer_cpu;
    if (m->owner == getpid() && m->thread_started && !m->thread_exited &&
        pthread_getcpuclockid(m->thread, &clock) == 0) {
        s += clock_seconds(clock);
    }
    return s;
}

static void *
writer_main(void *arg)
{
    FlorMaterializer *m = arg;
    flor_state *st = NULL;
    pthread_mutex_lock(&m->mu);
    for (;;) {
        flor_job *j;
        while (m->queue_head == NULL && !m->stopping) {
            pthread_cond_wait(&m->cv, &m->mu);
        }
        if (m->queue_head == NULL) {
            break;
        }
        j = m->queue_head;
        m->queue_head = j->next;
        if (m->queue_head == NULL) {
            m->queue_tail = NULL;
        }
        j->next = NULL;
        m->busy = 1;
        pthread_mutex_unlock(&m->mu);

        /* Only this thread touches a queued job's snapshot. */
        if (j->meta == NULL || ((FlorSnapshot *)j->snapshot)->pending != NULL) {
            /* The skeleton is a private, immutable copy: pickling it needs
             * the GIL but cannot race with the training thread.  The GPU
             * copies go on meanwhile; then this thread waits for them. */
            PyGILState_STATE g = PyGILState_Ensure();
            if (st == NULL) {
                st = mat_state(m);
            }
            if (st == NULL) {
                PyErr_Clear();
                j->err = -1;
                j->step = "pickle";
                j->msg = strdup("flor._core module state is gone");
            }
            else {
                job_pickle(st, j);
                job_wait(j);
            }
            PyGILState_Release(g);
        }
        job_write(j);

        pthread_mutex_lock(&m->mu);
        push_done_locked(m, j);
        m->busy = 0;
        pthread_cond_broadcast(&m->cv);
    }
    m->writer_cpu += clock_seconds(CLOCK_THREAD_CPUTIME_ID);
    m->thread_exited = 1;
    pthread_mutex_unlock(&m->mu);
    {
        /* Drop the reference ensure_thread() took for this thread.  close()
         * (which stopped us) holds another, so this never frees the engine. */
        PyGILState_STATE g = PyGILState_Ensure();
        Py_DECREF(m);
        PyGILState_Release(g);
    }
    return NULL;
}

static int
ensure_thread(FlorMaterializer *m)
{
    int e;
    if (m->thread_started) {
        return 0;
    }
    /* The thread owns a reference: the engine cannot be freed (for instance
     * by a collection triggered from code the writer runs) while it works. */
    Py_INCREF(m);
    m->stopping = 0;
    m->thread_exited = 0;
    e = pthread_create(&m->thread, NULL, writer_main, m);
    if (e != 0) {
        Py_DECREF(m);
        errno = e;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    m->thread_started = 1;
    return 0;
}

/* Wait with the GIL released until the writer is idle and the queue empty. */
static void
thread_drain(FlorMaterializer *m)
{
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&m->mu);
    while (m->queue_head != NULL || m->busy) {
        pthread_cond_wait(&m->cv, &m->mu);
    }
    pthread_mutex_unlock(&m->mu);
    Py_END_ALLOW_THREADS
}

/* ------------------------------------------------------------------ */
/* Fork mode.                                                           */

static int
write_full(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            return -1;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* Result record on the pipe: u32 index, i32 err, u16 step length,
 * u16 message length, f64 seconds, step bytes, message bytes. */
#define REC_HEAD 20

static void
child_report(int fd, uint32_t index, const flor_job *j)
{
    unsigned char rec[REC_HEAD + 64 + MSG_MAX];
    size_t sl = j->step ? strlen(j->step) : 0, ml = j->msg ? strlen(j->msg) : 0;
    int32_t err = j->err;
    uint16_t s16, m16;
    if (sl > 64) {
        sl = 64;
    }
    if (ml > MSG_MAX) {
        ml = MSG_MAX;
    }
    s16 = (uint16_t)sl;
    m16 = (uint16_t)ml;
    memcpy(rec, &index, 4);
    memcpy(rec + 4, &err, 4);
    memcpy(rec + 8, &s16, 2);
    memcpy(rec + 10, &m16, 2);
    memcpy(rec + 12, &j->seconds, 8);
    if (sl) {
        memcpy(rec + REC_HEAD, j->step, sl);
    }
    if (ml) {
        memcpy(rec + REC_HEAD + sl, j->msg, ml);
    }
    (void)write_full(fd, rec, REC_HEAD + sl + ml);
}

static void
child_main(flor_state *st, flor_job *jobs, int fd)
{
    sigset_t set;
    flor_job *j;
    uint32_t i = 0;

    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    PyGC_Disable();
    for (j = jobs; j != NULL; j = j->next, i++) {
        job_pickle(st, j);
        job_write(j);
        child_report(fd, i, j);
    }
    close(fd);
    _exit(0);
}

static int
parse_results(flor_child *c)
{
    size_t pos = 0;
    while (c->len - pos >= REC_HEAD) {
        uint32_t idx, k;
        int32_t err;
        uint16_t sl, ml;
        flor_job *j;
        memcpy(&idx, c->buf + pos, 4);
        memcpy(&err, c->buf + pos + 4, 4);
        memcpy(&sl, c->buf + pos + 8, 2);
        memcpy(&ml, c->buf + pos + 10, 2);
        if (c->len - pos < REC_HEAD + (size_t)sl + ml) {
            break;
        }
        for (j = c->jobs, k = 0; j != NULL && k < idx; j = j->next, k++) {
        }
        if (j != NULL) {
            j->done = 1;
            j->err = err;
            memcpy(&j->seconds, c->buf + pos + 12, 8);
            if (err != 0) {
                /* step names are static strings on this side */
                static const char *const steps[] = {"create", "write",  "fsync",
                                                    "close",  "rename", "fsync directory",
                                                    "pickle", "sign",   "allocate",
                                                    "copy"};
                size_t s;
                j->step = "write";
                for (s = 0; s < sizeof(steps) / sizeof(steps[0]); s++) {
                    if (strlen(steps[s]) == sl &&
                        memcmp(steps[s], c->buf + pos + REC_HEAD, sl) == 0) {
                        j->step = steps[s];
                    }
                }
                if (ml) {
                    free(j->msg);
                    j->msg = strndup(c->buf + pos + REC_HEAD + sl, ml);
                }
            }
        }
        pos += REC_HEAD + (size_t)sl + ml;
    }
    memmove(c->buf, c->buf + pos, c->len - pos);
    c->len -= pos;
    return 0;
}

/* A child closed its pipe: reap it and move its jobs to the done list. */
static void
child_finish(FlorMaterializer *m, int ci)
{
    flor_child *c = &m->children[ci];
    flor_job *j, *next;
    int status = 0, reaped;
    struct rusage ru;
    pid_t r;

    close(c->fd);
    memset(&ru, 0, sizeof(ru));
    Py_BEGIN_ALLOW_THREADS
    do {
        r = wait4(c->pid, &status, 0, &ru);
    } while (r < 0 && errno == EINTR);
    Py_END_ALLOW_THREADS
    reaped = r == c->pid;
    pthread_mutex_lock(&m->mu);
    if (reaped) {
        m->writer_cpu += (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 +
                         (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
    }
    for (j = c->jobs; j != NULL; j = next) {
        next = j->next;
        if (!j->done) {
            char buf[160];
            if (reaped && WIFSIGNALED(status)) {
                snprintf(buf, sizeof(buf), "writer process %ld was killed by signal %d",
                         (long)c->pid, WTERMSIG(status));
            }
            else {
                snprintf(buf, sizeof(buf), "writer process %ld exited before writing this",
                         (long)c->pid);
            }
            j->err = -1;
            j->step = "child";
            j->msg = strdup(buf);
        }
        push_done_locked(m, j);
    }
    pthread_mutex_unlock(&m->mu);
    free(c->buf);
    m->children[ci] = m->children[--m->nchildren];
}

/* Collect results from children; with block set, until one has finished.
 * GIL held on entry and exit. */
static int
children_poll(FlorMaterializer *m, int block)
{
    struct pollfd fds[64];
    int n, i, finished = 0;

    while (m->nchildren > 0) {
        for (i = 0; i < m->nchildren; i++) {
            fds[i].fd = m->children[i].fd;
            fds[i].events = POLLIN;
            fds[i].revents = 0;
        }
        Py_BEGIN_ALLOW_THREADS
        n = poll(fds, (nfds_t)m->nchildren, block && !finished ? -1 : 0);
        Py_END_ALLOW_THREADS
        if (n < 0) {
            if (errno == EINTR) {
                if (PyErr_CheckSignals() < 0) {
                    return -1;
                }
                continue;
            }
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        if (n == 0) {
            break;
        }
        for (i = m->nchildren - 1; i >= 0; i--) {
            flor_child *c = &m->children[i];
            ssize_t got;
            if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR | POLLNVAL))) {
                continue;
            }
            if (c->cap - c->len < 4096) {
                size_t cap = c->cap ? c->cap * 2 : 16384;
                char *b = realloc(c->buf, cap);
                if (b == NULL) {
                    PyErr_NoMemory();
                    return -1;
                }
                c->buf = b;
                c->cap = cap;
            }
            got = read(c->fd, c->buf + c->len, c->cap - c->len);
            if (got > 0) {
                c->len += (size_t)got;
                parse_results(c);
            }
            else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
                child_finish(m, i);
                finished++;
            }
        }
    }
    return finished;
}

static int
fork_batch(FlorMaterializer *m)
{
    flor_state *st = mat_state(m);
    flor_job *batch, *j;
    int fds[2];
    pid_t pid;
    int saved;

    if (st == NULL) {
        return -1;
    }
    if (m->batch_head == NULL) {
        return 0;
    }
    while (m->nchildren >= m->max_children) {
        if (children_poll(m, 1) < 0) {
            return -1;
        }
    }
    if (pipe2(fds, O_CLOEXEC) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    batch = m->batch_head;
    m->batch_head = m->batch_tail = NULL;
    m->batch_n = 0;
    m->batch_now = 0;
    for (j = batch; j != NULL; j = j->next) {
        FlorSnapshot *s = (FlorSnapshot *)j->snapshot;
        job_wait(j); /* the child runs no CUDA: the bytes must be there */
        if (s->arena != NULL) {
            flor_arena_set_inherit(s->arena, 1);
        }
    }
    PyOS_BeforeFork();
    pid = fork();
    if (pid == 0) {
        PyOS_AfterFork_Child();
        close(fds[0]);
        child_main(st, batch, fds[1]); /* does not return */
    }
    saved = errno;
    PyOS_AfterFork_Parent();
    for (j = batch; j != NULL; j = j->next) {
        FlorSnapshot *s = (FlorSnapshot *)j->snapshot;
        if (s->arena != NULL) {
            flor_arena_set_inherit(s->arena, 0);
        }
    }
    close(fds[1]);
    if (pid < 0) {
        /* No child (EAGAIN, ENOMEM): write the batch here rather than lose it. */
        close(fds[0]);
        m->fork_fallbacks++;
        (void)saved;
        for (j = batch; j != NULL; j = j->next) {
            job_pickle(st, j);
        }
        Py_BEGIN_ALLOW_THREADS
        for (j = batch; j != NULL; j = j->next) {
            job_write(j);
        }
        Py_END_ALLOW_THREADS
        pthread_mutex_lock(&m->mu);
        while (batch != NULL) {
            j = batch;
            batch = batch->next;
            push_done_locked(m, j);
        }
        pthread_mutex_unlock(&m->mu);
        return 0;
    }
    m->forks++;
    m->children[m->nchildren].pid = pid;
    m->children[m->nchildren].fd = fds[0];
    m->children[m->nchildren].jobs = batch;
    m->children[m->nchildren].buf = NULL;
    m->children[m->nchildren].len = 0;
    m->children[m->nchildren].cap = 0;
    m->nchildren++;
    return 0;
}

/* ------------------------------------------------------------------ */
/* Backpressure: runs after the walk, before bytes are copied.          */

static int
reserve_cb(void *ctx, uint64_t need)
{
    FlorMaterializer *m = ctx;
    for (;;) {
        int ok;
        if (reap_done(m) < 0) {
            return -1;
        }
        pthread_mutex_lock(&m->mu);
        ok = m->held_bytes == 0 || m->held_bytes + need <= m->max_buffer_bytes;
        if (ok) {
            m->held_bytes += need;
            m->reserved = need;
            if (m->held_bytes > m->peak_held_bytes) {
                m->peak_held_bytes = m->held_bytes;
            }
        }
        pthread_mutex_unlock(&m->mu);
        if (ok) {
            return 0;
        }
        if (m->mode == MODE_THREAD) {
            /* The writer broadcasts each time it finishes a job. */
            Py_BEGIN_ALLOW_THREADS
            pthread_mutex_lock(&m->mu);
            while (m->done == NULL && m->held_bytes != 0 &&
                   m->held_bytes + need > m->max_buffer_bytes) {
                pthread_cond_wait(&m->cv, &m->mu);
            }
            pthread_mutex_unlock(&m->mu);
            Py_END_ALLOW_THREADS
        }
        else if (m->batch_head != NULL) {
            if (fork_batch(m) < 0) {
                return -1;
            }
        }
        else if (children_poll(m, 1) < 0) {
            return -1;
        }
    }
}

/* ------------------------------------------------------------------ */
/* Python methods.                                                      */

static int
check_usable(FlorMaterializer *m)
{
    if (m->owner != getpid()) {
        PyErr_Format(PyExc_RuntimeError,
                     "this flor Materializer belongs to process %ld; a forked child cannot use "
                     "it. Create a new Materializer in the child.",
                     (long)m->owner);
        return -1;
    }
    if (m->closed) {
        PyErr_SetString(PyExc_ValueError, "the flor Materializer is closed");
        return -1;
    }
    return 0;
}

static PyObject *
take_failures(FlorMaterializer *m)
{
    PyObject *f = m->failures;
    m->failures = PyList_New(0);
    if (m->failures == NULL) {
        m->failures = f;
        return NULL;
    }
    return f;
}

PyDoc_STRVAR(mat_submit_doc,
             "submit($self, path, obj, tag=None, /)\n--\n\n"
             "Snapshot obj now and write it to path later, with tag (32 bytes) in its\n"
             "header. Returns the data bytes the file will hold: with incremental on,\n"
             "those not found in earlier files. Waits first if the bytes held would\n"
             "pass max_buffer_bytes.");

/* The bytes of a snapshot that neither a durable file of the run nor a
 * checkpoint submitted lately (still being written) holds: what its file
 * will hold.  Blobs not hashed while copied (CUDA, strided buffers) count
 * as new.  The snapshot's blobs then join the submitted ones. */
static uint64_t
new_bytes(FlorMaterializer *m, const FlorSnapshot *s)
{
    uint64_t n = 0;
    uint32_t i;
    const char **dtypes;
    if (m->dedup == NULL) {
        return s->nbytes;
    }
    dtypes = calloc(s->n_blobs ? s->n_blobs : 1, sizeof(char *));
    if (dtypes == NULL) {
        return s->nbytes;
    }
    for (i = 0; i < s->n_blobs; i++) {
        dtypes[i] = "";
    }
    for (i = s->n_entries; i-- > 0;) {
        if (s->entries[i].blob < s->n_blobs) {
            dtypes[s->entries[i].blob] = s->entries[i].dtype;
        }
    }
    for (i = 0; i < s->n_blobs; i++) {
        const flor_blob *b = &s->blobs[i];
        if (!b->hashed ||
            (!flor_dedup_find(m->dedup, b->hash, b->nbytes, dtypes[i], NULL, NULL, NULL) &&
             !flor_dedup_find(m->submitted_index, b->hash, b->nbytes, dtypes[i], NULL, NULL,
                              NULL))) {
            n += b->nbytes;
        }
    }
    for (i = 0; i < s->n_blobs; i++) {
        if (s->blobs[i].hashed && s->blobs[i].nbytes > 0) {
            (void)flor_dedup_add(m->submitted_index, s->blobs[i].hash, s->blobs[i].nbytes,
                                 dtypes[i], "submitted", 0, 0);
        }
    }
    flor_dedup_next_generation(m->submitted_index);
    free(dtypes);
    return n;
}

static PyObject *
mat_submit(FlorMaterializer *m, PyObject *const *args, Py_ssize_t nargs)
{
    flor_state *st = mat_state(m);
    PyObject *pathb = NULL, *snap = NULL, *res = NULL;
    flor_job *j = NULL;
    double t0 = flor_now(), dt;
    uint64_t reserved = 0;
    int handed = 0;

    unsigned char tag[FLOR_TAG_LEN];
    int has_tag = 0;
    uint64_t estimate;

    if (st == NULL || flor_check_nargs("submit", nargs, 2, 3) < 0 || check_usable(m) < 0) {
        return NULL;
    }
    if (nargs > 2 && (has_tag = flor_tag_arg(args[2], tag)) < 0) {
        return NULL;
    }
    if (!PyUnicode_FSConverter(args[0], &pathb)) {
        return NULL;
    }
    if (reap_done(m) < 0 || (m->mode == MODE_FORK && children_poll(m, 0) < 0)) {
        goto cleanup;
    }
    m->reserved = 0;
    snap = flor_snapshot_ex(st, args[1], m->mode == MODE_INLINE ? NULL : reserve_cb, m,
                            m->dedup != NULL);
    if (snap == NULL) {
        /* Give back a reservation the failed snapshot may have made. */
        pthread_mutex_lock(&m->mu);
        m->held_bytes -= m->reserved;
        pthread_mutex_unlock(&m->mu);
        goto cleanup;
    }
    reserved = m->mode == MODE_INLINE ? 0 : flor_pool_charge(((FlorSnapshot *)snap)->data_bytes);
    j = calloc(1, sizeof(*j));
    if (j == NULL || (j->path = strdup(PyBytes_AS_STRING(pathb))) == NULL) {
        PyErr_NoMemory();
        goto cleanup;
    }
    j->snapshot = Py_NewRef(snap);
    j->bytes = reserved;
    j->nbytes = ((FlorSnapshot *)snap)->nbytes;
    j->has_tag = has_tag;
    if (has_tag) {
        memcpy(j->tag, tag, FLOR_TAG_LEN);
    }
    j->signer = Py_XNewRef(m->signer);
    j->dedup = m->dedup;
    m->submitted++;
    estimate = new_bytes(m, (FlorSnapshot *)snap);
    if (m->mode == MODE_INLINE) {
        job_pickle(st, j);
        job_wait(j);
        Py_BEGIN_ALLOW_THREADS
        job_write(j);
        Py_END_ALLOW_THREADS
        pthread_mutex_lock(&m->mu);
        push_done_locked(m, j);
        pthread_mutex_unlock(&m->mu);
        j = NULL;
        handed = 1;
        if (reap_done(m) < 0) {
            goto cleanup;
        }
    }
    else if (m->mode == MODE_THREAD) {
        if (ensure_thread(m) < 0) {
            goto cleanup;
        }
        pthread_mutex_lock(&m->mu);
        if (m->queue_tail != NULL) {
            m->queue_tail->next = j;
        }
        else {
            m->queue_head = j;
        }
        m->queue_tail = j;
        pthread_cond_broadcast(&m->cv);
        pthread_mutex_unlock(&m->mu);
        j = NULL;
        handed = 1;
    }
    else {
        if (((FlorSnapshot *)snap)->foreign) {
            /* Copied by a class's own __deepcopy__: may hold live torch
             * objects, which the child must not pickle. */
            job_pickle(st, j);
        }
        if (m->batch_tail != NULL) {
            m->batch_tail->next = j;
        }
        else {
            m->batch_head = j;
        }
        m->batch_tail = j;
        m->batch_n++;
        m->batch_now += j->bytes;
        j = NULL;
        handed = 1;
        if ((m->batch_now >= m->batch_bytes || m->batch_n >= m->batch_count) && fork_batch(m) < 0) {
            goto cleanup;
        }
    }
    res = PyLong_FromUnsignedLongLong(estimate);
cleanup:
    if (snap != NULL && !handed) {
        /* The job never reached a writer: give its bytes back. */
        pthread_mutex_lock(&m->mu);
        m->held_bytes -= reserved;
        pthread_mutex_unlock(&m->mu);
    }
    if (j != NULL) {
        job_free(j);
    }
    dt = flor_now() - t0;
    m->block_seconds += dt;
    if (dt > m->max_block_seconds) {
        m->max_block_seconds = dt;
    }
    Py_XDECREF(snap);
    Py_XDECREF(pathb);
    return res;
}

static int
do_flush(FlorMaterializer *m)
{
    if (m->mode == MODE_THREAD && m->thread_started) {
        thread_drain(m);
    }
    else if (m->mode == MODE_FORK) {
        if (fork_batch(m) < 0) {
            return -1;
        }
        while (m->nchildren > 0) {
            if (children_poll(m, 1) < 0) {
                return -1;
            }
        }
    }
    return reap_done(m);
}

PyDoc_STRVAR(mat_flush_doc,
             "flush($self, /)\n--\n\n"
             "Return once every submitted checkpoint is durable (or failed). Returns the\n"
             "failures since the last call: a list of (path, errno, step, message).");

static PyObject *
mat_flush(FlorMaterializer *m, PyObject *Py_UNUSED(ignored))
{
    if (check_usable(m) < 0 || do_flush(m) < 0) {
        return NULL;
    }
    return take_failures(m);
}

static void
stop_thread(FlorMaterializer *m)
{
    if (!m->thread_started) {
        return;
    }
    pthread_mutex_lock(&m->mu);
    m->stopping = 1;
    pthread_cond_broadcast(&m->cv);
    pthread_mutex_unlock(&m->mu);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(m->thread, NULL);
    Py_END_ALLOW_THREADS
    m->thread_started = 0;
    m->stopping = 0;
}

PyDoc_STRVAR(mat_close_doc,
             "close($self, /)\n--\n\n"
             "Flush, stop the writer, and return the remaining failures.");

static PyObject *
mat_close(FlorMaterializer *m, PyObject *Py_UNUSED(ignored))
{
    int rc;
    if (m->owner != getpid()) {
        (void)check_usable(m);
        return NULL;
    }
    if (m->closed) {
        return take_failures(m);
    }
    rc = do_flush(m);
    stop_thread(m);
    if (rc < 0) {
        return NULL;
    }
    /* The writer stopped after its last job; collect what it finished. */
    if (reap_done(m) < 0) {
        return NULL;
    }
    m->closed = 1;
    return take_failures(m);
}

PyDoc_STRVAR(mat_stats_doc,
             "stats($self, /)\n--\n\n"
             "Counters: submitted, written, failed, bytes_written, bytes_referenced\n"
             "(left in earlier files), write_seconds,\n"
             "block_seconds, max_block_seconds, forks, fork_fallbacks, held_bytes,\n"
             "peak_held_bytes, pending, writing, writer_cpu_seconds. write_seconds is time\n"
             "spent pickling and writing; written and failed count the checkpoints whose\n"
             "writes finished, as write_seconds does; pending counts those not yet durable\n"
             "and counted (a fork child's until the child is done), writing those of them\n"
             "being written now (pending less a fork batch not yet started);\n"
             "writer_cpu_seconds is the CPU time the writers used (thread mode: the\n"
             "writer thread's, as it runs; fork mode: children's, once reaped);\n"
             "held_bytes is the staging memory of the snapshots not yet written.");

static PyObject *
mat_stats(FlorMaterializer *m, PyObject *Py_UNUSED(ignored))
{
    uint64_t held, peak, pending, writing, written, failed, bytes_written, bytes_referenced;
    double ws, cpu;
    flor_job *j;
    int i;
    /* fork mode: take the results the children have sent, without waiting */
    if (m->mode == MODE_FORK && children_poll(m, 0) < 0) {
        return NULL;
    }
    pthread_mutex_lock(&m->mu);
    held = m->held_bytes;
    peak = m->peak_held_bytes;
    ws = m->write_seconds;
    written = m->written;
    failed = m->failed;
    bytes_written = m->bytes_written;
    bytes_referenced = m->bytes_referenced;
    cpu = writer_cpu_locked(m);
    pending = (uint64_t)m->busy;
    for (j = m->queue_head; j != NULL; j = j->next) {
        pending++;
    }
    pthread_mutex_unlock(&m->mu);
    /* A child's checkpoints stay pending until the child is done and they
       are counted (its reports come before its exit). */
    for (i = 0; i < m->nchildren; i++) {
        for (j = m->children[i].jobs; j != NULL; j = j->next) {
            pending++;
        }
    }
    writing = pending;
    pending += (uint64_t)m->batch_n;
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:d,s:d,s:d,s:K,s:K,s:K,s:K,s:K,s:K,s:d}",
                         "bytes_referenced", (unsigned long long)bytes_referenced, "submitted",
                         (unsigned long long)m->submitted, "written", (unsigned long long)written,
                         "failed", (unsigned long long)failed, "bytes_written",
                         (unsigned long long)bytes_written, "write_seconds", ws, "block_seconds",
                         m->block_seconds, "max_block_seconds", m->max_block_seconds, "forks",
                         (unsigned long long)m->forks, "fork_fallbacks",
                         (unsigned long long)m->fork_fallbacks, "held_bytes",
                         (unsigned long long)held, "peak_held_bytes", (unsigned long long)peak,
                         "pending", (unsigned long long)pending, "writing",
                         (unsigned long long)writing, "writer_cpu_seconds", cpu);
}

static PyObject *
mat_children(FlorMaterializer *m, PyObject *Py_UNUSED(ignored))
{
    PyObject *l = PyList_New(m->nchildren);
    int i;
    if (l == NULL) {
        return NULL;
    }
    for (i = 0; i < m->nchildren; i++) {
        PyObject *p = PyLong_FromLong((long)m->children[i].pid);
        if (p == NULL) {
            Py_DECREF(l);
            return NULL;
        }
        PyList_SET_ITEM(l, i, p);
    }
    return l;
}

PyDoc_STRVAR(mat_retire_doc,
             "retire($self, name, /)\n--\n\n"
             "Unless a checkpoint of this materializer (written, or being written) refers to\n"
             "the bytes of the written file `name` (a plain file name in its directory), let\n"
             "no later one refer to them, and release the files it refers to. Returns True\n"
             "when none refers to them (the file may be deleted), False when one does (it\n"
             "must stay until those are retired). Without incremental writing, always True.");

static PyObject *
mat_retire(FlorMaterializer *m, PyObject *name)
{
    const char *file;
    Py_ssize_t len;
    if (m->owner != getpid()) { /* closed is fine: the index outlives the writer */
        (void)check_usable(m); /* sets the error */
        return NULL;
    }
    if (!PyUnicode_Check(name)) {
        PyErr_Format(PyExc_TypeError, "retire: name must be a str, not %.100s",
                     Py_TYPE(name)->tp_name);
        return NULL;
    }
    file = PyUnicode_AsUTF8AndSize(name, &len);
    if (file == NULL) {
        return NULL;
    }
    if ((size_t)len != strlen(file)) {
        PyErr_SetString(PyExc_ValueError, "retire: name holds a NUL character");
        return NULL;
    }
    if (m->dedup == NULL) {
        Py_RETURN_TRUE;
    }
    return PyBool_FromLong(!flor_dedup_retire(m->dedup, file));
}

PyDoc_STRVAR(mat_children_doc,
             "children($self, /)\n--\n\n"
             "Pids of live writer children.");

static PyObject *
mat_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"mode",        "max_buffer_bytes", "max_children", "batch_bytes",
                             "batch_count", "incremental",      "signer",       NULL};
    FlorMaterializer *m;
    flor_state *st = flor_state_of_type(type);
    int mode, max_children, incremental = 0;
    unsigned long long max_buffer, batch_bytes;
    Py_ssize_t batch_count;
    PyObject *signer = Py_None;

    if (st == NULL || !PyArg_ParseTupleAndKeywords(args, kwds, "iKiKn|pO:Materializer", kwlist,
                                                   &mode, &max_buffer, &max_children, &batch_bytes,
                                                   &batch_count, &incremental, &signer)) {
        return NULL;
    }
    if (signer != Py_None && !PyCallable_Check(signer)) {
        PyErr_SetString(PyExc_TypeError, "Materializer: signer must be callable or None");
        return NULL;
    }
    if (mode < MODE_INLINE || mode > MODE_FORK || max_children < 1 || max_children > 64 ||
        batch_count < 1 || max_buffer == 0) {
        PyErr_SetString(PyExc_ValueError, "Materializer: invalid mode or bounds");
        return NULL;
    }
    /* The fork child pickles with cloudpickle: import it here, not there. */
    {
        PyObject *probe = flor_pickle_skeleton(st, Py_None, 1);
        if (probe == NULL) {
            return NULL;
        }
        Py_DECREF(probe);
    }
    m = (FlorMaterializer *)type->tp_alloc(type, 0);
    if (m == NULL) {
        return NULL;
    }
    m->mode = mode;
    m->max_buffer_bytes = max_buffer;
    m->batch_bytes = batch_bytes;
    m->batch_count = batch_count;
    m->max_children = max_children;
    m->owner = getpid();
    m->failures = PyList_New(0);
    m->children = calloc((size_t)max_children, sizeof(flor_child));
    m->signer = signer != Py_None ? Py_NewRef(signer) : NULL;
    /* Fork children cannot tell the parent what they made durable: fork
     * mode writes every blob. */
    m->dedup = incremental && mode != MODE_FORK ? flor_dedup_new() : NULL;
    m->submitted_index = m->dedup != NULL ? flor_dedup_new() : NULL;
    if (m->failures == NULL || m->children == NULL ||
        (incremental && mode != MODE_FORK && (m->dedup == NULL || m->submitted_index == NULL))) {
        int nomem = m->failures != NULL;
        Py_DECREF(m);
        return nomem ? PyErr_NoMemory() : NULL;
    }
    pthread_mutex_init(&m->mu, NULL);
    pthread_cond_init(&m->cv, NULL);
    return (PyObject *)m;
}

static void
free_list(flor_job *j)
{
    while (j != NULL) {
        flor_job *next = j->next;
        job_free(j);
        j = next;
    }
}

/* The objects the Python side hands the materializer (its signer, the list
 * of failures) take part in garbage collection: a signer that refers back
 * to the materializer is a cycle the collector can free.  The jobs' objects
 * are not visited: writer threads hold them, and each job owns its
 * references until it is done. */
static int
mat_traverse(FlorMaterializer *m, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(m));
    Py_VISIT(m->signer);
    Py_VISIT(m->failures);
    return 0;
}

static int
mat_clear(FlorMaterializer *m)
{
    Py_CLEAR(m->signer);
    return 0;
}

static void
mat_dealloc(FlorMaterializer *m)
{
    PyTypeObject *tp = Py_TYPE(m);
    int i;
    PyObject_GC_UnTrack(m);
    if (m->owner == getpid() && m->children != NULL) {
        if (!m->closed) {
            PyObject *f;
            PyObject *t, *v, *tb;
            PyErr_Fetch(&t, &v, &tb);
            f = mat_close(m, NULL);
            if (f == NULL) {
                PyErr_WriteUnraisable((PyObject *)m);
            }
            else if (PyList_GET_SIZE(f) > 0) {
                PyErr_Format(PyExc_RuntimeError,
                             "flor Materializer garbage-collected with %zd failed writes: %R",
                             PyList_GET_SIZE(f), f);
                PyErr_WriteUnraisable((PyObject *)m);
            }
            Py_XDECREF(f);
            PyErr_Restore(t, v, tb);
        }
        pthread_mutex_destroy(&m->mu);
        pthread_cond_destroy(&m->cv);
        free_list(m->done);
    }
    /* In a forked copy the lists belong to the parent's writers: the
     * snapshots are only released, never written. */
    if (m->owner != getpid()) {
        free_list(m->queue_head);
        free_list(m->done);
        free_list(m->batch_head);
        for (i = 0; m->children != NULL && i < m->nchildren; i++) {
            free_list(m->children[i].jobs);
            free(m->children[i].buf);
        }
    }
    free(m->children);
    Py_XDECREF(m->failures);
    Py_XDECREF(m->signer);
    if (m->owner == getpid()) {
        flor_dedup_free(m->dedup); /* the writer thread has stopped */
        flor_dedup_free(m->submitted_index);
    }
    tp->tp_free(m);
    Py_DECREF(tp);
}

static PyMethodDef mat_methods[] = {
    {"submit", FLOR_CFUNC(mat_submit), METH_FASTCALL, mat_submit_doc},
    {"flush", FLOR_CFUNC(mat_flush), METH_NOARGS, mat_flush_doc},
    {"close", FLOR_CFUNC(mat_close), METH_NOARGS, mat_close_doc},
    {"stats", FLOR_CFUNC(mat_stats), METH_NOARGS, mat_stats_doc},
    {"children", FLOR_CFUNC(mat_children), METH_NOARGS, mat_children_doc},
    {"retire", FLOR_CFUNC(mat_retire), METH_O, mat_retire_doc},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot mat_slots[] = {
    {Py_tp_new, mat_new},
    {Py_tp_dealloc, mat_dealloc},
    {Py_tp_traverse, mat_traverse},
    {Py_tp_clear, mat_clear},
    {Py_tp_methods, mat_methods},
    {Py_tp_doc, "Materializer(mode, max_buffer_bytes, max_children, batch_bytes, batch_count,\n"
                "incremental=False, signer=None)\n"
                "--\n\nThe C engine behind flor.Materializer."},
    {0, NULL},
};

PyType_Spec flor_materializer_spec = {
    .name = "flor._core.Materializer",
    .basicsize = sizeof(FlorMaterializer),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = mat_slots,
};
