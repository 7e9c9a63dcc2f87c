/*
 * snake_adamw: the CPython binding of megatron_snake's one-pass host AdamW update (module
 * megatron_snake._snake_adamw; the kernel is csrc/adamw.c, its API and rules adamw.h).
 *
 * A plain CPython extension, apart from _snake_aio so that it builds without liburing. It
 * never links against torch: callers pass raw addresses (tensor.data_ptr()), so one build
 * serves every torch version. Only the binding lives here: argument parsing, the GIL
 * (released for the whole update) and errors. megatron_snake/optim/host_kernel.py is the
 * Python side (tensors in, segments and dtype codes out).
 *
 *   step(segments, nseg, *, grad, master, exp_avg, exp_avg_sq, weights, lr, beta1, beta2,
 *        eps, weight_decay, step, clip=None, rules=RULES_FMA, weights_round=ROUND_EVEN,
 *        mode=WRITE, pieces=0, scale_in=(0, 0, 0), scale_out=(0, 0, 0), minmax=(0, 0, 0),
 *        threads=1, isa=-1)
 *     segments: the address of nseg rows of SEGMENT_FIELDS int64 (adamw_segment's fields in
 *     order); the dtypes are codes (F32, BF16, F16, E4M3, REM16, NONE); scale_in and
 *     scale_out: addresses of float32 arrays of `pieces` values per state (master, exp_avg,
 *     exp_avg_sq), minmax of 2 * pieces (min, max), 0 where the state is not scaled; isa -1:
 *     the widest the CPU has.
 *   bound(g, p, m, v, w, n, threads=1, isa=-1): the STREAM-like bound (adamw_bound).
 *   isa_supported(isa) -> bool, best_isa() -> int, and the codes as constants.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>

#include "adamw.h"

/* the rows the caller packs are read as adamw_segment */
_Static_assert(sizeof(adamw_segment) == ADAMW_SEGMENT_FIELDS * sizeof(int64_t),
               "adamw_segment must be SEGMENT_FIELDS 8-byte fields");

static int raise_for(int rc) {
    switch (rc) {
    case ADAMW_OK:
        return 0;
    case ADAMW_ERR_DTYPE:
        PyErr_SetString(PyExc_ValueError, "snake_adamw: a dtype this stream cannot have "
                        "(or remainders without bf16 weights, or ties-away rounding of "
                        "weights that are not bf16)");
        return -1;
    case ADAMW_ERR_ISA:
        PyErr_SetString(PyExc_ValueError, "snake_adamw: this CPU lacks the instruction set "
                        "asked for");
        return -1;
    case ADAMW_ERR_NOMEM:
        PyErr_NoMemory();
        return -1;
    default:
        PyErr_SetString(PyExc_ValueError, "snake_adamw: bad arguments (a missing pointer, a "
                        "piece out of range, a missing scale array, or a bad count)");
        return -1;
    }
}

static PyObject *py_step(PyObject *mod, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"segments", "nseg", "grad", "master", "exp_avg", "exp_avg_sq",
                             "weights", "lr", "beta1", "beta2", "eps", "weight_decay", "step",
                             "clip", "rules", "weights_round", "mode", "pieces", "scale_in",
                             "scale_out", "minmax", "threads", "isa", NULL};
    unsigned long long segs_addr;
    Py_ssize_t nseg, pieces = 0;
    adamw_args a = {.lr = NAN, .beta1 = NAN, .beta2 = NAN, .eps = NAN, .weight_decay = NAN,
                    .step = NAN, .grad = ADAMW_F32, .master = ADAMW_F32,
                    .exp_avg = ADAMW_F32, .exp_avg_sq = ADAMW_F32, .weights = ADAMW_NONE,
                    .rules = ADAMW_RULES_FMA, .weights_round = ADAMW_ROUND_EVEN,
                    .mode = ADAMW_WRITE};
    unsigned long long sin[3] = {0, 0, 0}, sout[3] = {0, 0, 0}, mm[3] = {0, 0, 0};
    PyObject *clip = Py_None;
    int threads = 1, isa = -1;
    if (!PyArg_ParseTupleAndKeywords(
            args, kw, "Kn|$iiiiidddddfOiiin(KKK)(KKK)(KKK)ii", kwlist, &segs_addr, &nseg,
            &a.grad, &a.master, &a.exp_avg, &a.exp_avg_sq, &a.weights, &a.lr, &a.beta1,
            &a.beta2, &a.eps, &a.weight_decay, &a.step, &clip, &a.rules, &a.weights_round,
            &a.mode, &pieces, &sin[0], &sin[1], &sin[2], &sout[0], &sout[1], &sout[2],
            &mm[0], &mm[1], &mm[2], &threads, &isa))
        return NULL;
    if (isnan(a.lr) || isnan(a.beta1) || isnan(a.beta2) || isnan(a.eps) ||
        isnan(a.weight_decay) || isnan(a.step)) {
        PyErr_SetString(PyExc_TypeError, "snake_adamw.step: lr, beta1, beta2, eps, "
                        "weight_decay and step are required");
        return NULL;
    }
    if (clip != Py_None) {
        double c = PyFloat_AsDouble(clip);
        if (c == -1.0 && PyErr_Occurred()) return NULL;
        a.has_clip = 1;
        a.clip = (float)c;
    }
    a.pieces = pieces;
    for (int st = 0; st < 3; st++) {
        a.scale_in[st] = (const float *)(uintptr_t)sin[st];
        a.scale_out[st] = (const float *)(uintptr_t)sout[st];
        a.minmax[st] = (float *)(uintptr_t)mm[st];
    }
    if (isa < 0) isa = adamw_best_isa();
    if (nseg < 0 || (nseg > 0 && !segs_addr)) {
        raise_for(ADAMW_ERR_ARGS);
        return NULL;
    }
    int rc;
    const adamw_segment *segs = (const adamw_segment *)(uintptr_t)segs_addr;
    Py_BEGIN_ALLOW_THREADS
    rc = adamw_step(&a, segs, nseg, threads, isa);
    Py_END_ALLOW_THREADS
    if (raise_for(rc)) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_bound(PyObject *mod, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"g", "p", "m", "v", "w", "n", "threads", "isa", NULL};
    unsigned long long g, p, m, v, w;
    long long n;
    int threads = 1, isa = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KKKKKL|ii", kwlist, &g, &p, &m, &v, &w, &n,
                                     &threads, &isa))
        return NULL;
    if (isa < 0) isa = adamw_best_isa();
    if (n > 0 && (!g || !p || !m || !v || !w)) {
        raise_for(ADAMW_ERR_ARGS);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = adamw_bound((const float *)(uintptr_t)g, (float *)(uintptr_t)p, (float *)(uintptr_t)m,
                     (float *)(uintptr_t)v, (uint16_t *)(uintptr_t)w, n, threads, isa);
    Py_END_ALLOW_THREADS
    if (raise_for(rc)) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_isa_supported(PyObject *mod, PyObject *args) {
    int isa;
    if (!PyArg_ParseTuple(args, "i", &isa)) return NULL;
    return PyBool_FromLong(adamw_isa_supported(isa));
}

static PyObject *py_best_isa(PyObject *mod, PyObject *unused) {
    return PyLong_FromLong(adamw_best_isa());
}

static PyMethodDef module_methods[] = {
    {"step", (PyCFunction)(void (*)(void))py_step, METH_VARARGS | METH_KEYWORDS,
     "step(segments, nseg, *, ...) : one AdamW update over the segments (GIL released)"},
    {"bound", (PyCFunction)(void (*)(void))py_bound, METH_VARARGS | METH_KEYWORDS,
     "bound(g, p, m, v, w, n, threads=1, isa=-1): the STREAM-like bound (GIL released)"},
    {"isa_supported", py_isa_supported, METH_VARARGS, "isa_supported(isa) -> bool"},
    {"best_isa", py_best_isa, METH_NOARGS, "the widest instruction set this CPU runs"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_snake_adamw", "megatron_snake one-pass host AdamW update", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__snake_adamw(void) {
    adamw_init();
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    static const struct { const char *name; int value; } consts[] = {
        {"NONE", ADAMW_NONE}, {"F32", ADAMW_F32}, {"BF16", ADAMW_BF16}, {"F16", ADAMW_F16},
        {"E4M3", ADAMW_E4M3}, {"REM16", ADAMW_REM16},
        {"GENERIC", ADAMW_GENERIC}, {"AVX2", ADAMW_AVX2}, {"AVX512", ADAMW_AVX512},
        {"RULES_PLAIN", ADAMW_RULES_PLAIN}, {"RULES_FMA", ADAMW_RULES_FMA},
        {"ROUND_EVEN", ADAMW_ROUND_EVEN}, {"ROUND_TE", ADAMW_ROUND_TE},
        {"WRITE", ADAMW_WRITE}, {"MINMAX", ADAMW_MINMAX},
        {"SEGMENT_FIELDS", ADAMW_SEGMENT_FIELDS},
    };
    for (size_t i = 0; i < sizeof(consts) / sizeof(consts[0]); i++) {
        if (PyModule_AddIntConstant(m, consts[i].name, consts[i].value) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
