/*
 * snake_aio: the CPython binding of megatron_snake's native async I/O engine (module
 * megatron_snake._snake_aio).
 *
 * A plain CPython extension. It never links against torch: callers pass raw addresses
 * (tensor.data_ptr(), numpy) and lengths, so one build serves every torch version.
 *
 * Only the binding lives here: argument parsing and checks, the GIL (released around
 * everything that blocks or runs long) and the Python results. The engine itself is plain C
 * in csrc/engine.c (engine.h: its model, backends and the measurements behind the default),
 * the checksum in csrc/crc32c.c (crc32c.h); setup.py and tools/gpu_carry.sh compile all three
 * into the one module.
 *
 *   Engine(backend="uring"|"threads", queue_depth=32, threads=4, chunk_bytes=1 MiB)
 *   submit(op, fd, addr, nbytes, offset) -> handle, at once (waits only while 4096 requests
 *        are outstanding), GIL released
 *   wait(handle) releases the GIL and returns (err, err_offset, bytes_done):
 *     err == 0   everything transferred,
 *     err  > 0   an errno from the kernel (the Python side raises with path/offset/len),
 *     err == -1  short transfer (end of file: a truncated file), bytes_done tells how much.
 *   done(handle) -> bool, close(), .backend, .inflight
 *
 * Also: crc32c(addr, nbytes, crc=0) with the SSE4.2 instruction when the CPU has it
 * (three interleaved streams; software slicing-by-8 otherwise), GIL released: the record
 * checksum of the tensor store.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "crc32c.h"
#include "engine.h"

/* ---------------------------------------------------------------- Python type */

typedef struct {
    PyObject_HEAD
    engine_t *eng;   /* NULL until __init__ succeeds */
} Engine;

static int Engine_init(Engine *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"backend", "queue_depth", "threads", "chunk_bytes", NULL};
    const char *backend = "uring";
    int qd = 32, nthreads = 4;
    Py_ssize_t chunk = 1 << 20;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|siin", kwlist, &backend, &qd, &nthreads, &chunk))
        return -1;
    if (qd < 1 || qd > 4096 || nthreads < 1 || nthreads > 256 || chunk < 4096) {
        PyErr_SetString(PyExc_ValueError, "snake_aio: bad queue_depth/threads/chunk_bytes");
        return -1;
    }
    engine_backend_t kind;
    if (strcmp(backend, "uring") == 0) {
        kind = ENGINE_BACKEND_URING;
    } else if (strcmp(backend, "threads") == 0) {
        kind = ENGINE_BACKEND_THREADS;
    } else {
        PyErr_Format(PyExc_ValueError, "snake_aio: unknown backend '%s' (uring|threads)", backend);
        return -1;
    }
    if (self->eng) {   /* __init__ called again: retire the engine it made before */
        engine_t *old = self->eng;
        self->eng = NULL;
        Py_BEGIN_ALLOW_THREADS
        engine_destroy(old);
        Py_END_ALLOW_THREADS
    }
    int sys_errno = 0;
    switch (engine_create(&self->eng, kind, qd, nthreads, (size_t)chunk, &sys_errno)) {
    case ENGINE_OK:
        return 0;
    case ENGINE_ERR_NOMEM:
        PyErr_NoMemory();
        return -1;
    case ENGINE_ERR_EVENTFD:
        errno = sys_errno;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    case ENGINE_ERR_RING_INIT:
        PyErr_Format(PyExc_OSError, "snake_aio: io_uring_queue_init failed: %s (errno %d)",
                     strerror(sys_errno), sys_errno);
        return -1;
    case ENGINE_ERR_RING_THREAD:
        PyErr_SetString(PyExc_OSError, "snake_aio: cannot start the io_uring thread");
        return -1;
    default:   /* ENGINE_ERR_THREADS */
        PyErr_SetString(PyExc_OSError, "snake_aio: cannot start I/O threads");
        return -1;
    }
}

static void Engine_dealloc(Engine *self) {
    if (self->eng) {
        Py_BEGIN_ALLOW_THREADS
        engine_destroy(self->eng);
        Py_END_ALLOW_THREADS
        self->eng = NULL;
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Engine_close(Engine *self, PyObject *unused) {
    if (self->eng) {
        Py_BEGIN_ALLOW_THREADS
        engine_close(self->eng);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyObject *Engine_submit(Engine *self, PyObject *args) {
    int op, fd;
    unsigned long long addr;
    long long nbytes, offset;
    if (!PyArg_ParseTuple(args, "iiKLL", &op, &fd, &addr, &nbytes, &offset)) return NULL;
    if (!self->eng || engine_closed(self->eng)) {
        PyErr_SetString(PyExc_ValueError, "snake_aio: engine is closed");
        return NULL;
    }
    if ((op != ENGINE_OP_READ && op != ENGINE_OP_WRITE) || nbytes < 0 || offset < 0 || fd < 0) {
        PyErr_SetString(PyExc_ValueError, "snake_aio: bad op/fd/nbytes/offset");
        return NULL;
    }
    uint64_t h;
    Py_BEGIN_ALLOW_THREADS
    h = engine_submit(self->eng, op, fd, (void *)(uintptr_t)addr, nbytes, offset);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *Engine_wait(Engine *self, PyObject *args) {
    unsigned long long h;
    if (!PyArg_ParseTuple(args, "K", &h)) return NULL;
    int err = 0, bad = 1;
    long long err_off = 0, done = 0;
    if (self->eng) {
        Py_BEGIN_ALLOW_THREADS
        bad = engine_wait(self->eng, h, &err, &err_off, &done) != 0;
        Py_END_ALLOW_THREADS
    }
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "snake_aio: unknown or already waited handle");
        return NULL;
    }
    return Py_BuildValue("iLL", err, err_off, done);
}

static PyObject *Engine_done(Engine *self, PyObject *args) {
    unsigned long long h;
    if (!PyArg_ParseTuple(args, "K", &h)) return NULL;
    /* short: the engine's lock only, with the GIL held */
    return PyBool_FromLong(self->eng ? engine_done(self->eng, h) : 1);
}

static PyObject *Engine_get_backend(Engine *self, void *closure) {
    return PyUnicode_FromString(self->eng ? engine_backend_name(self->eng) : "threads");
}

static PyObject *Engine_get_inflight(Engine *self, void *closure) {
    return PyLong_FromLong(self->eng ? engine_inflight(self->eng) : 0);
}

static PyMethodDef Engine_methods[] = {
    {"submit", (PyCFunction)Engine_submit, METH_VARARGS,
     "submit(op, fd, addr, nbytes, offset) -> handle; op 0 = read, 1 = write"},
    {"wait", (PyCFunction)Engine_wait, METH_VARARGS,
     "wait(handle) -> (err, err_offset, bytes_done); err 0 ok, >0 errno, -1 short transfer"},
    {"done", (PyCFunction)Engine_done, METH_VARARGS, "done(handle) -> bool (does not consume it)"},
    {"close", (PyCFunction)Engine_close, METH_NOARGS, "wait for in-flight I/O and stop the engine"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Engine_getset[] = {
    {"backend", (getter)Engine_get_backend, NULL, "uring or threads", NULL},
    {"inflight", (getter)Engine_get_inflight, NULL, "chunks in flight now", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "megatron_snake._snake_aio.Engine",
    .tp_basicsize = sizeof(Engine),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Async direct-I/O engine (io_uring or pthread pool); raw addresses, no torch.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Engine_init,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_methods = Engine_methods,
    .tp_getset = Engine_getset,
};

/* ---------------------------------------------------------------- crc32c */

static PyObject *py_crc32c(PyObject *mod, PyObject *args) {
    unsigned long long addr;
    long long n;
    unsigned int crc = 0;
    if (!PyArg_ParseTuple(args, "KL|I", &addr, &n, &crc)) return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "crc32c: negative length");
        return NULL;
    }
    uint32_t out;
    const void *p = (const void *)(uintptr_t)addr;
    Py_BEGIN_ALLOW_THREADS
    out = crc32c(crc, p, (size_t)n);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(out);
}

static PyObject *py_crc32c_hw(PyObject *mod, PyObject *unused) {
    return PyBool_FromLong(crc32c_hw_available());
}

static PyMethodDef module_methods[] = {
    {"crc32c", py_crc32c, METH_VARARGS, "crc32c(addr, nbytes, crc=0) -> int (GIL released)"},
    {"crc32c_hardware", py_crc32c_hw, METH_NOARGS, "True when the SSE4.2 instruction is used"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_snake_aio", "megatron_snake native async I/O engine", -1, module_methods,
};

PyMODINIT_FUNC PyInit__snake_aio(void) {
    crc32c_init();
    if (PyType_Ready(&EngineType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    Py_INCREF(&EngineType);
    PyModule_AddObject(m, "Engine", (PyObject *)&EngineType);
    PyModule_AddIntConstant(m, "OP_READ", ENGINE_OP_READ);
    PyModule_AddIntConstant(m, "OP_WRITE", ENGINE_OP_WRITE);
    PyModule_AddIntConstant(m, "SHORT", ENGINE_SHORT);
    return m;
}
