/*
 * adamw.h: the host update of the offloaded AdamW in one pass over memory.
 *
 * One call reads each element's gradient, master weight and both moments once, applies the
 * clip coefficient (grad * clip), runs AdamW with decoupled weight decay with the arithmetic
 * of torch's CPU fused kernel (torch._fused_adamw_, aten/src/ATen/native/cpu/
 * FusedAdamKernel.cpp, ADAMW mode), and writes the new master, moments and working weights,
 * each in its stored dtype (Megatron-Core's precision-aware optimizer; the rounding rules are
 * those of megatron_snake/optim/precision.py). Plain C on raw pointers, no Python and no
 * torch: the binding (csrc/snake_adamw.c) calls it with the GIL released; callers pass
 * tensor.data_ptr(), so one build serves every torch version.
 *
 * torch's bits. torch's kernel runs a tensor in vector lanes from its first element and
 * its last (numel mod lanes) elements on a scalar path, and the two round differently: in
 * torch's AVX2 and AVX-512 builds the compiler fused different multiplies into FMAs (the
 * vector loop v = fma(c2*g, g, v*b2), the scalar tail v = fma(v, b2, (c2*g)*g); both fuse
 * the exp_avg lerp, fma(coeff, g - m, base)); its default (no-AVX) build fuses nothing.
 * Each element is independent of the others, so any element can be computed by either rule
 * in any grouping: a segment says how many of its leading elements follow the vector rule
 * (ADAMW_RULES_FMA) and the rest follow the tail rule. Everything else is separate IEEE
 * single operations with torch's double constants cast to float: this file is compiled with
 * -ffp-contract=off so that no other multiply-add is fused.
 *
 * Dtypes (adamw_dtype): the gradient F32 or BF16; the master F32, F16 (scaled) or REM16
 * (int16 remainders whose bf16 high halves are the working weights, Transformer Engine's
 * split); the moments F32, BF16, F16 or E4M3 (scaled); the working weights NONE, BF16 or F16.
 * A scaled state (F16 master, F16 or E4M3 moment) is stored per parameter piece with
 * Transformer Engine's scale = max(-min, max) / range of the piece's NEW values: one call in
 * ADAMW_MINMAX mode computes each piece's min and max without writing anything, the caller
 * makes the scales (torch ops: precision.scale_for), and a second call in ADAMW_WRITE mode
 * stores.
 *
 * Out of place: each output may be the input it replaces (in place) or memory that does not
 * overlap any input; a partial overlap is not supported.
 */
#ifndef SNAKE_ADAMW_H
#define SNAKE_ADAMW_H

#include <stddef.h>
#include <stdint.h>

#include "hidden.h"

enum adamw_dtype {
    ADAMW_NONE = -1,
    ADAMW_F32 = 0,
    ADAMW_BF16 = 1,
    ADAMW_F16 = 2,
    ADAMW_E4M3 = 3,   /* fp8 E4M3 bytes (Megatron's "fp8", stored as uint8) */
    ADAMW_REM16 = 4,  /* master only: int16 remainders + bf16 high halves */
};

enum adamw_isa { ADAMW_GENERIC = 0, ADAMW_AVX2 = 1, ADAMW_AVX512 = 2 };

/* Which torch build's arithmetic: FMA = its AVX2 / AVX-512 kernels (vector and tail rules
   differ), PLAIN = its default kernel (no FMA; both rules are the same). */
enum adamw_rules { ADAMW_RULES_PLAIN = 0, ADAMW_RULES_FMA = 1 };

/* The bf16 working weights of an F32 master: EVEN rounds to nearest even (torch's cast,
   Megatron's copy into its bf16 parameters), TE to nearest with ties away from zero
   (Transformer Engine's remainder split; a REM16 master always uses it). */
enum adamw_round { ADAMW_ROUND_EVEN = 0, ADAMW_ROUND_TE = 1 };

enum adamw_mode { ADAMW_WRITE = 0, ADAMW_MINMAX = 1 };

enum { ADAMW_MASTER = 0, ADAMW_EXP_AVG = 1, ADAMW_EXP_AVG_SQ = 2 };   /* scaled arrays */

/* Error codes of adamw_step (0: done). */
enum {
    ADAMW_OK = 0,
    ADAMW_ERR_DTYPE = -1,   /* a dtype this stream cannot have, or REM16 without BF16 weights */
    ADAMW_ERR_ARGS = -2,    /* a missing pointer, a piece out of range, a bad count */
    ADAMW_ERR_ISA = -3,     /* the CPU lacks the instruction set asked for */
    ADAMW_ERR_NOMEM = -4,
};

/* One segment: elements contiguous in every stream, each pointer at the segment's first
   element. The binding reads an int64 array of rows with exactly these 13 fields in this
   order (ADAMW_SEGMENT_FIELDS), so keep them 8 bytes each. */
typedef struct {
    const void *grad, *master, *exp_avg, *exp_avg_sq;
    const void *weights;   /* REM16: the bf16 high halves read with the remainders; else NULL */
    void *master_out, *exp_avg_out, *exp_avg_sq_out;
    void *weights_out;     /* the new working weights (NULL when args.weights is NONE) */
    int64_t numel;
    int64_t vector;        /* [0, vector): torch's vector rule; [vector, numel): its tail rule */
    int64_t piece;         /* scaled states: the parameter piece (index of the scale arrays) */
    int64_t decay;         /* nonzero: weight decay applies (Megatron's first group) */
} adamw_segment;

#define ADAMW_SEGMENT_FIELDS 13

typedef struct {
    double lr, beta1, beta2, eps, weight_decay;
    float step;            /* torch reads the step count as a float */
    int has_clip;
    float clip;            /* grad * clip when has_clip (Megatron's clip_coeff, fp32) */
    int grad, master, exp_avg, exp_avg_sq, weights;   /* adamw_dtype of each stream */
    int rules, weights_round, mode;
    int64_t pieces;        /* length of each scale array below */
    const float *scale_in[3];   /* scaled state: per piece, the multiplier its stored values
                                   are read back with (dequantize) */
    const float *scale_out[3];  /* ADAMW_WRITE, scaled state: per piece, the scale it is
                                   stored with (absmax / range) */
    float *minmax[3];           /* ADAMW_MINMAX, scaled state: per piece, out: the min and
                                   the max of its new values (2 floats a piece; NaN when
                                   one is NaN; +inf, -inf when the piece has no element) */
} adamw_args;

/* Builds the E4M3 table and detects the CPU's instruction sets. Call once (module init). */
SNAKE_HIDDEN void adamw_init(void);

/* 1 when this CPU (and this build) can run isa. */
SNAKE_HIDDEN int adamw_isa_supported(int isa);

/* The widest isa adamw_isa_supported() accepts. */
SNAKE_HIDDEN int adamw_best_isa(void);

/* One update over nseg segments on `threads` threads (the calling one and threads - 1 it
   starts and joins), with the instruction set isa. Returns ADAMW_OK or an error code; on
   an error nothing has been written. Thread-safe: calls share nothing. */
SNAKE_HIDDEN int adamw_step(const adamw_args *args, const adamw_segment *segs, int64_t nseg,
                            int threads, int isa);

/* The STREAM-like bound of an F32 update with BF16 weights, for tools/bench_host_update.py:
   the same bytes per element (reads g, p, m, v; writes p, m, v in place and the 16-bit w)
   with trivial arithmetic (p += g, m += g, v += g, w = the high half of p), on the same
   threads, stores and instruction set as adamw_step. */
SNAKE_HIDDEN int adamw_bound(const float *g, float *p, float *m, float *v, uint16_t *w,
                             int64_t n, int threads, int isa);

#endif /* SNAKE_ADAMW_H */
