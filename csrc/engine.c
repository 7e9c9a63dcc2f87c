/*
 * engine.c: the native async I/O engine of megatron_snake (API in engine.h).
 *
 * Plain C, no Python: the binding (csrc/snake_aio.c) turns these calls into the Engine type
 * of megatron_snake._snake_aio and releases the GIL around the ones that block. Callers pass
 * raw addresses (tensor.data_ptr(), numpy) and lengths.
 *
 * Model. A request (read or write of `nbytes` at `offset` of an open fd, to/from `addr`)
 * is split into chunks of `chunk_bytes` (1 MiB by default) so that one large record keeps
 * many requests in flight. submit() queues the chunks and returns an integer handle at once
 * (it waits only while 4096 requests are outstanding; the data buffers belong to the caller,
 * whose host pool bounds them); the engine keeps at most `queue_depth` chunks in flight.
 * wait(handle) returns (err, err_offset, bytes_done):
 *   err == 0   everything transferred,
 *   err  > 0   an errno from the kernel (the Python side raises with path/offset/len),
 *   err == -1  short transfer (end of file: a truncated file), bytes_done tells how much.
 * Short reads/writes in the middle of a chunk are resumed, EINTR/EAGAIN retried.
 *
 * Two backends behind the same calls:
 *   "uring"   io_uring (liburing). One thread owns the ring: it moves queued chunks into
 *             the ring (at most queue_depth in flight), submits and reaps in one
 *             io_uring_submit_and_wait, and is woken by an eventfd read that is always
 *             armed. SINGLE_ISSUER|DEFER_TASKRUN when the kernel has them (6.1+), so
 *             completions run in that thread, as in fio. submit() never blocks.
 *   "threads" a pool of pthreads doing pread/pwrite (kvikio's design), queue_depth threads.
 *
 * Choice by measurement (docs/benchmarks_io.md, tools/bench_io.py: 2-core VM, virtio disk,
 * ext4, O_DIRECT, 4 GiB, 1 MiB requests, queue depth 32, fio io_uring as the reference):
 *   store over uring:   write 1.88 GB/s, read 1.43 GB/s (median of 5; fio 1.71 / 1.33)
 *   store over threads: write 1.57 GB/s, read 1.24 GB/s (same run)
 * so "uring" is the default; it also needs one thread instead of queue_depth blocking ones
 * (CPU the optimizer can use). A first version where every caller thread submitted and one
 * reaper reaped stayed ~10-25% below fio on reads (completions ran as task work in other
 * threads); the single-owner ring closed that gap. "threads" remains for kernels where
 * io_uring is missing or disabled (seccomp, old kernels): make_engine() falls back to it.
 */
#include "engine.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <sys/eventfd.h>
#include <sys/syscall.h>

#include <liburing.h>

#define MAX_REQS 4096

typedef struct {
    int active;          /* slot in use */
    uint32_t gen;        /* generation, part of the handle */
    int pending;         /* chunks not yet completed */
    int submitted_all;   /* all chunks of the request are submitted */
    int err;             /* 0, errno > 0, -1 short */
    long long err_off;   /* file offset of the first failure */
    long long done;      /* bytes transferred */
} req_t;

typedef struct chunk {
    struct chunk *next;
    int op;
    int fd;
    char *addr;
    size_t len;
    long long off;
    size_t done;
    int slot;
} chunk_t;

struct engine {
    int use_uring;
    int closed;
    int queue_depth;
    int nthreads;
    size_t chunk_bytes;

    pthread_mutex_t mu;        /* guards reqs, queue, inflight */
    pthread_cond_t done_cv;    /* a request completed */
    pthread_cond_t space_cv;   /* in-flight room or a free slot */
    pthread_cond_t work_cv;    /* threads backend: queue not empty */
    req_t reqs[MAX_REQS];
    int next_slot;
    int inflight;

    /* threads backend */
    chunk_t *q_head, *q_tail;
    pthread_t *threads;
    int stopping;

    /* uring backend: one thread owns the ring (submits and reaps, like fio) */
    struct io_uring ring;
    pthread_t ring_thread;
    int ring_ok;
    int evfd;                  /* wakes the ring thread when work is queued */
    unsigned long long evbuf;
    int ring_flags;            /* setup flags that were accepted */
};

/* ---------------------------------------------------------------- completion */

static void complete_chunk(engine_t *e, chunk_t *c, int err) {
    pthread_mutex_lock(&e->mu);
    req_t *r = &e->reqs[c->slot];
    r->done += (long long)c->done;
    if (err != 0 && r->err == 0) {
        r->err = err;
        r->err_off = c->off + (long long)c->done;
    }
    r->pending--;
    e->inflight--;
    if (r->pending == 0 && r->submitted_all)
        pthread_cond_broadcast(&e->done_cv);
    pthread_mutex_unlock(&e->mu);
    free(c);
}

/* ---------------------------------------------------------------- threads backend */

static void *worker_main(void *arg) {
    engine_t *e = (engine_t *)arg;
    for (;;) {
        pthread_mutex_lock(&e->mu);
        while (!e->q_head && !e->stopping)
            pthread_cond_wait(&e->work_cv, &e->mu);
        if (!e->q_head && e->stopping) {
            pthread_mutex_unlock(&e->mu);
            return NULL;
        }
        chunk_t *c = e->q_head;
        e->q_head = c->next;
        if (!e->q_head) e->q_tail = NULL;
        pthread_mutex_unlock(&e->mu);

        int err = 0;
        while (c->done < c->len) {
            ssize_t n;
            if (c->op == ENGINE_OP_READ)
                n = pread(c->fd, c->addr + c->done, c->len - c->done, c->off + (off_t)c->done);
            else
                n = pwrite(c->fd, c->addr + c->done, c->len - c->done, c->off + (off_t)c->done);
            if (n < 0) {
                if (errno == EINTR || errno == EAGAIN) continue;
                err = errno;
                break;
            }
            if (n == 0) { err = ENGINE_SHORT; break; }
            c->done += (size_t)n;
        }
        complete_chunk(e, c, err);
    }
}

/* ---------------------------------------------------------------- uring backend */

#define EV_TAG ((void *)1)

static struct io_uring_sqe *ring_sqe(engine_t *e) {
    /* the SQ has qd+2 entries and at most qd+1 operations are in flight, so this only
       loops if the kernel left earlier SQEs unsubmitted (-EBUSY): push them and retry */
    struct io_uring_sqe *sqe;
    while ((sqe = io_uring_get_sqe(&e->ring)) == NULL) {
        if (io_uring_submit(&e->ring) < 0) usleep(100);
    }
    return sqe;
}

static void ring_prep(engine_t *e, chunk_t *c) {
    struct io_uring_sqe *sqe = ring_sqe(e);
    if (c->op == ENGINE_OP_READ)
        io_uring_prep_read(sqe, c->fd, c->addr + c->done, (unsigned)(c->len - c->done),
                           (unsigned long long)(c->off + (long long)c->done));
    else
        io_uring_prep_write(sqe, c->fd, c->addr + c->done, (unsigned)(c->len - c->done),
                            (unsigned long long)(c->off + (long long)c->done));
    io_uring_sqe_set_data(sqe, c);
}

static void ring_arm_eventfd(engine_t *e) {
    struct io_uring_sqe *sqe = ring_sqe(e);
    io_uring_prep_read(sqe, e->evfd, &e->evbuf, sizeof(e->evbuf), 0);
    io_uring_sqe_set_data(sqe, EV_TAG);
}

static void *ring_main(void *arg) {
    engine_t *e = (engine_t *)arg;
    int ring_inflight = 0;   /* chunks in the ring (not counting the eventfd read) */
#ifdef IORING_SETUP_R_DISABLED
    if (e->ring_flags & IORING_SETUP_R_DISABLED)   /* io_uring_enable_rings(), liburing >= 2.4 */
        syscall(__NR_io_uring_register, e->ring.ring_fd, IORING_REGISTER_ENABLE_RINGS, NULL, 0);
#endif
    ring_arm_eventfd(e);
    for (;;) {
        /* move queued chunks into the ring, up to the queue depth */
        pthread_mutex_lock(&e->mu);
        while (e->q_head && ring_inflight < e->queue_depth) {
            chunk_t *c = e->q_head;
            e->q_head = c->next;
            if (!e->q_head) e->q_tail = NULL;
            ring_prep(e, c);
            ring_inflight++;
        }
        int stop = e->stopping && !e->q_head && ring_inflight == 0;
        pthread_mutex_unlock(&e->mu);
        if (stop) return NULL;
        int rc = io_uring_submit_and_wait(&e->ring, 1);
        if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY && rc != -ETIME) {
            /* the ring itself failed (never seen with a healthy ring): back off, retry */
            usleep(1000);
        }
        struct io_uring_cqe *cqe;
        unsigned head, seen = 0;
        io_uring_for_each_cqe(&e->ring, head, cqe) {
            seen++;
            void *data = io_uring_cqe_get_data(cqe);
            int res = cqe->res;
            if (data == EV_TAG) {         /* new work or a stop request */
                ring_arm_eventfd(e);
                continue;
            }
            chunk_t *c = (chunk_t *)data;
            if (res == -EINTR || res == -EAGAIN) { ring_prep(e, c); continue; }
            if (res < 0) { ring_inflight--; complete_chunk(e, c, -res); continue; }
            if (res == 0) { ring_inflight--; complete_chunk(e, c, ENGINE_SHORT); continue; }
            c->done += (size_t)res;
            if (c->done < c->len) { ring_prep(e, c); continue; }   /* short: resume */
            ring_inflight--;
            complete_chunk(e, c, 0);
        }
        io_uring_cq_advance(&e->ring, seen);
    }
}

static void ring_wake(engine_t *e) {
    unsigned long long one = 1;
    ssize_t n;
    do { n = write(e->evfd, &one, sizeof(one)); } while (n < 0 && errno == EINTR);
}

/* ---------------------------------------------------------------- lifecycle */

int engine_create(engine_t **out, engine_backend_t backend, int qd, int nthreads,
                  size_t chunk_bytes, int *sys_errno) {
    *out = NULL;
    *sys_errno = 0;
    /* zeroed: the fields not set below (reqs, threads, ring_ok, ...) start at 0 / NULL */
    engine_t *e = calloc(1, sizeof(engine_t));
    if (!e) return ENGINE_ERR_NOMEM;
    e->queue_depth = qd;
    e->nthreads = nthreads;
    e->chunk_bytes = chunk_bytes;
    e->closed = 0;
    e->stopping = 0;
    e->next_slot = 0;
    e->inflight = 0;
    e->q_head = e->q_tail = NULL;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->done_cv, NULL);
    pthread_cond_init(&e->space_cv, NULL);
    pthread_cond_init(&e->work_cv, NULL);

    int rc = ENGINE_OK;
    if (backend == ENGINE_BACKEND_URING) {
        e->use_uring = 1;
        e->evfd = eventfd(0, EFD_CLOEXEC);
        if (e->evfd < 0) {
            *sys_errno = errno;
            rc = ENGINE_ERR_EVENTFD;
            goto fail;
        }
        /* one thread submits and reaps: let the kernel run completions in that thread only
           when it asks for them (6.1+); older kernels take the plain ring */
        unsigned entries = (unsigned)qd + 2;
        int urc = -EINVAL;
#ifdef IORING_SETUP_DEFER_TASKRUN
        /* created disabled: the ring thread enables it and so becomes its single issuer */
        e->ring_flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN |
                        IORING_SETUP_R_DISABLED;
        urc = io_uring_queue_init(entries, &e->ring, e->ring_flags);
#endif
        if (urc < 0) {
            e->ring_flags = 0;
            urc = io_uring_queue_init(entries, &e->ring, 0);
        }
        if (urc < 0) {
            close(e->evfd);
            *sys_errno = -urc;
            rc = ENGINE_ERR_RING_INIT;
            goto fail;
        }
        e->ring_ok = 1;
        if (pthread_create(&e->ring_thread, NULL, ring_main, e) != 0) {
            io_uring_queue_exit(&e->ring);
            close(e->evfd);
            e->ring_ok = 0;
            rc = ENGINE_ERR_RING_THREAD;
            goto fail;
        }
    } else {
        e->use_uring = 0;
        e->threads = calloc((size_t)nthreads, sizeof(pthread_t));
        if (!e->threads) {
            rc = ENGINE_ERR_NOMEM;
            goto fail;
        }
        for (int i = 0; i < nthreads; i++) {
            if (pthread_create(&e->threads[i], NULL, worker_main, e) != 0) {
                e->nthreads = i;
                engine_close(e);   /* stops and joins the i threads already started */
                rc = ENGINE_ERR_THREADS;
                goto fail;
            }
        }
    }
    *out = e;
    return ENGINE_OK;

fail:
    free(e->threads);
    pthread_cond_destroy(&e->work_cv);
    pthread_cond_destroy(&e->space_cv);
    pthread_cond_destroy(&e->done_cv);
    pthread_mutex_destroy(&e->mu);
    free(e);
    return rc;
}

void engine_close(engine_t *e) {
    if (e->closed) return;
    e->closed = 1;
    if (e->use_uring) {
        if (e->ring_ok) {
            pthread_mutex_lock(&e->mu);
            e->stopping = 1;
            pthread_mutex_unlock(&e->mu);
            ring_wake(e);
            pthread_join(e->ring_thread, NULL);
            io_uring_queue_exit(&e->ring);
            close(e->evfd);
            e->ring_ok = 0;
        }
    } else if (e->threads) {
        pthread_mutex_lock(&e->mu);
        e->stopping = 1;
        pthread_cond_broadcast(&e->work_cv);
        pthread_mutex_unlock(&e->mu);
        for (int i = 0; i < e->nthreads; i++) pthread_join(e->threads[i], NULL);
        free(e->threads);
        e->threads = NULL;
    }
}

void engine_destroy(engine_t *e) {
    engine_close(e);
    pthread_cond_destroy(&e->work_cv);
    pthread_cond_destroy(&e->space_cv);
    pthread_cond_destroy(&e->done_cv);
    pthread_mutex_destroy(&e->mu);
    free(e);
}

int engine_closed(const engine_t *e) { return e->closed; }

const char *engine_backend_name(const engine_t *e) { return e->use_uring ? "uring" : "threads"; }

int engine_inflight(engine_t *e) {
    pthread_mutex_lock(&e->mu);
    int n = e->inflight;
    pthread_mutex_unlock(&e->mu);
    return n;
}

/* ---------------------------------------------------------------- requests */

uint64_t engine_submit(engine_t *e, int op, int fd, void *addr, long long nbytes,
                       long long offset) {
    int slot = -1;
    uint32_t gen = 0;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        for (int i = 0; i < MAX_REQS; i++) {
            int s = (e->next_slot + i) % MAX_REQS;
            if (!e->reqs[s].active) { slot = s; break; }
        }
        if (slot >= 0) break;
        pthread_cond_wait(&e->space_cv, &e->mu);
    }
    e->next_slot = (slot + 1) % MAX_REQS;
    req_t *r = &e->reqs[slot];
    r->active = 1;
    r->gen++;
    gen = r->gen;
    r->pending = 0;
    r->submitted_all = 0;
    r->err = 0;
    r->err_off = 0;
    r->done = 0;
    pthread_mutex_unlock(&e->mu);

    long long pos = 0;
    while (pos < nbytes) {
        size_t len = (size_t)(nbytes - pos) < e->chunk_bytes ? (size_t)(nbytes - pos) : e->chunk_bytes;
        chunk_t *c = calloc(1, sizeof(chunk_t));
        c->op = op; c->fd = fd; c->addr = (char *)addr + pos;
        c->len = len; c->off = offset + pos; c->slot = slot;
        pthread_mutex_lock(&e->mu);
        e->inflight++;
        r->pending++;
        c->next = NULL;
        if (e->q_tail) e->q_tail->next = c; else e->q_head = c;
        e->q_tail = c;
        if (!e->use_uring) pthread_cond_signal(&e->work_cv);
        pthread_mutex_unlock(&e->mu);
        pos += (long long)len;
    }
    pthread_mutex_lock(&e->mu);
    r->submitted_all = 1;
    if (r->pending == 0) pthread_cond_broadcast(&e->done_cv);
    pthread_mutex_unlock(&e->mu);
    if (e->use_uring && nbytes > 0) ring_wake(e);
    return ((uint64_t)gen << 32) | (unsigned)slot;
}

static req_t *lookup(engine_t *e, uint64_t h) {
    unsigned slot = (unsigned)(h & 0xffffffffu);
    uint32_t gen = (uint32_t)(h >> 32);
    if (slot >= MAX_REQS) return NULL;
    req_t *r = &e->reqs[slot];
    if (!r->active || r->gen != gen) return NULL;
    return r;
}

int engine_wait(engine_t *e, uint64_t h, int *err, long long *err_off, long long *done) {
    int bad = 0;
    pthread_mutex_lock(&e->mu);
    req_t *r = lookup(e, h);
    if (!r) {
        bad = 1;
    } else {
        while (!(r->submitted_all && r->pending == 0)) pthread_cond_wait(&e->done_cv, &e->mu);
        *err = r->err; *err_off = r->err_off; *done = r->done;
        r->active = 0;
        pthread_cond_broadcast(&e->space_cv);
    }
    pthread_mutex_unlock(&e->mu);
    return bad ? -1 : 0;
}

int engine_done(engine_t *e, uint64_t h) {
    pthread_mutex_lock(&e->mu);
    req_t *r = lookup(e, h);
    int d = r ? (r->submitted_all && r->pending == 0) : 1;
    pthread_mutex_unlock(&e->mu);
    return d;
}
