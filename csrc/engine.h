/*
 * engine.h: the C API of megatron_snake's native async I/O engine (csrc/engine.c).
 *
 * Plain C, no Python: the engine moves bytes between caller-owned memory and open fds. The
 * CPython binding (csrc/snake_aio.c) validates and parses arguments, releases the GIL around
 * the calls that can block (engine_submit, engine_wait, engine_close, engine_destroy) and
 * builds the Python results; the engine never touches a Python object. The model (requests,
 * chunks, handles, the two backends) is described at the top of engine.c.
 */
#ifndef SNAKE_ENGINE_H
#define SNAKE_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "hidden.h"

enum { ENGINE_OP_READ = 0, ENGINE_OP_WRITE = 1 };

/* err of a request that hit end of file before all its bytes (a truncated file) */
#define ENGINE_SHORT (-1)

typedef enum { ENGINE_BACKEND_URING = 0, ENGINE_BACKEND_THREADS = 1 } engine_backend_t;

/* engine_create() results; *sys_errno holds the errno behind EVENTFD and RING_INIT */
enum {
    ENGINE_OK = 0,
    ENGINE_ERR_NOMEM,        /* allocating the engine or its thread table failed */
    ENGINE_ERR_EVENTFD,      /* eventfd() failed */
    ENGINE_ERR_RING_INIT,    /* io_uring_queue_init() failed */
    ENGINE_ERR_RING_THREAD,  /* the io_uring thread could not be started */
    ENGINE_ERR_THREADS,      /* an I/O thread of the pool could not be started */
};

typedef struct engine engine_t;

/* Creates an engine and starts its thread(s). The caller has checked 1 <= queue_depth <= 4096,
   1 <= nthreads <= 256 (used by the threads backend only) and chunk_bytes >= 4096. Returns
   ENGINE_OK with *out set, or an ENGINE_ERR_* code with *out = NULL and nothing left running. */
SNAKE_HIDDEN int engine_create(engine_t **out, engine_backend_t backend, int queue_depth,
                               int nthreads, size_t chunk_bytes, int *sys_errno);

/* Queues a read (ENGINE_OP_READ) or write of nbytes at offset of fd, to/from addr (which must
   stay valid until the request is waited for), and returns its handle. Blocks only while 4096
   requests are outstanding. The caller has checked op, fd >= 0, nbytes >= 0, offset >= 0 and
   that the engine is not closed. */
SNAKE_HIDDEN uint64_t engine_submit(engine_t *e, int op, int fd, void *addr, long long nbytes,
                                    long long offset);

/* Blocks until the request completes, consumes its handle and returns 0 with *err (0, an
   errno > 0, or ENGINE_SHORT), *err_off (file offset of the first failure) and *done (bytes
   transferred); returns -1 for an unknown or already waited handle. */
SNAKE_HIDDEN int engine_wait(engine_t *e, uint64_t handle, int *err, long long *err_off,
                             long long *done);

/* 1 when the request has completed (or the handle is unknown), 0 otherwise; never blocks for
   long and does not consume the handle. */
SNAKE_HIDDEN int engine_done(engine_t *e, uint64_t handle);

/* Waits for the I/O in flight and stops the engine's threads; idempotent. engine_wait and
   engine_done keep answering for requests submitted before. */
SNAKE_HIDDEN void engine_close(engine_t *e);

/* engine_close(), then frees the engine. */
SNAKE_HIDDEN void engine_destroy(engine_t *e);

SNAKE_HIDDEN int engine_closed(const engine_t *e);
SNAKE_HIDDEN int engine_inflight(engine_t *e);              /* chunks in flight now */
SNAKE_HIDDEN const char *engine_backend_name(const engine_t *e);  /* "uring" or "threads" */

#endif /* SNAKE_ENGINE_H */
