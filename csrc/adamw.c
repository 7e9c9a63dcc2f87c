/*
 * adamw.c: the host update of the offloaded AdamW in one pass over memory (API and the
 * rules it follows in adamw.h).
 *
 * Three variants of the same per-element arithmetic, chosen at run time:
 *   - AVX-512 and AVX2 loops (16 or 8 elements a step) for the dtypes that carry the
 *     throughput: gradient F32/BF16, master F32 or REM16, both moments F32 or both BF16,
 *     weights none or BF16, torch's vector rule;
 *   - batches of 64 for everything else (torch's tail rule, its plain build, the scaled
 *     dtypes, fp16 weights, and the min/max pass): each stream converted in its own loop,
 *     then the arithmetic over the batch (by 8 on AVX2 machines, with the fp16 conversions,
 *     the remainders and the min/max: batch_ops);
 *   - generic C, the batches alone, where the CPU has no AVX2, FMA and F16C.
 * tests/test_host_kernel.py holds every variant it can run to torch's own kernel, bit for
 * bit. Compiled with -ffp-contract=off: the only fused multiply-adds are the explicit ones
 * that reproduce torch's.
 *
 * Threads: the elements of all segments, in order, are cut into one span per thread (at
 * multiples of 64 elements, so no two threads write one cache line of an aligned stream);
 * the calling thread runs the first span and starts the others, each a pthread for the
 * call's length. A call updates a part of tens of megabytes, so starting threads costs
 * nothing measurable next to it, and there is no pool to own or shut down.
 */
#include "adamw.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define MAX_THREADS 256
#define SPAN_ALIGN 64        /* elements: a cache line of fp32, two of bf16 */
#define MIN_SPAN 4096        /* elements a thread gets at least (a smaller call runs on fewer) */

enum { RULE_VECTOR, RULE_TAIL, RULE_PLAIN };   /* see adamw.h */
/* the SIMD blocks' master and weights: F32 alone, F32 with BF16 weights by torch's cast or
   by TE's split, REM16 (whose weights are its high halves) */
enum { MW_F32, MW_EVEN, MW_TE, MW_REM16 };

static int have_avx2 = 0, have_avx512 = 0;
static float e4m3_value[256];

/* ---------------------------------------------------------------- conversions */

static inline uint32_t f2u(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float u2f(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

static inline float bf16_to_f32(uint16_t h) { return u2f((uint32_t)h << 16); }

/* torch's cast: round to nearest even; NaN becomes 0xFFFF, as torch's vectorized copy
   writes it */
static inline uint16_t f32_to_bf16(float x) {
    uint32_t u = f2u(x);
    if (x != x) return 0xFFFF;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* Transformer Engine's remainder split (precision.split_master): the high half rounded
   up when the low half is negative as an int16, i.e. (bits + 0x8000) >> 16 */
static inline uint16_t te_high(uint32_t u) { return (uint16_t)((u + 0x8000u) >> 16); }

/* ... and its join: high * 65536 + the remainder sign-extended (wrapping) */
static inline float te_join(uint16_t high, int16_t rem) {
    return u2f(((uint32_t)high << 16) + (uint32_t)(int32_t)rem);
}

/* IEEE half to float, exact (c10's fp16_ieee_to_fp32_value) */
static inline float f16_to_f32(uint16_t h) {
    uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    float normalized = u2f((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    float denormalized = u2f((two_w >> 17) | (126u << 23)) - 0.5f;
    return u2f(sign | (two_w < (1u << 27) ? f2u(denormalized) : f2u(normalized)));
}

/* float to IEEE half, round to nearest even, NaN to sign | 0x7E00 (c10's
   fp16_ieee_from_fp32_value, which torch's cast agrees with) */
static inline uint16_t f32_to_f16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t w = f2u(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = u2f((bias >> 1) + 0x07800000u) + base;
    uint32_t bits = f2u(base);
    uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

/* float to fp8 E4M3 (no infinities; 0x7F is NaN), round to nearest even (c10's
   fp8e4m3fn_from_fp32_value); callers clamp to +-448 first, as precision.quantize does */
static inline uint8_t f32_to_e4m3(float f) {
    uint32_t bits = f2u(f), sign = bits & 0x80000000u, result;
    bits ^= sign;
    if (bits >= (1087u << 20)) {            /* |f| >= 480 or NaN */
        result = 0x7F;
    } else if (bits < (121u << 23)) {       /* below 2^-6: a subnormal, rounded by the FPU */
        uint32_t denorm = 141u << 23;
        result = (uint8_t)(f2u(u2f(bits) + u2f(denorm)) - denorm);
    } else {
        uint32_t odd = (bits >> 20) & 1u;
        bits += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + odd;
        result = (uint8_t)(bits >> 20);
    }
    return (uint8_t)(result | (sign >> 24));
}

static float e4m3_decode(uint8_t b) {
    int sign = b >> 7, exp = (b >> 3) & 15, mant = b & 7;
    float x;
    if (exp == 15 && mant == 7) return NAN;
    x = exp ? ldexpf(1.0f + mant / 8.0f, exp - 7) : ldexpf(mant / 8.0f, -6);
    return sign ? -x : x;
}

/* ---------------------------------------------------------------- the arithmetic */

/* torch's constants (adam_fused_step_impl, adam_math), each computed in double and cast to
   float where the kernel casts it */
typedef struct {
    float decay_factor;   /* 1 - lr * weight_decay */
    int decays;           /* weight_decay != 0 */
    int small;            /* |1 - beta1| < 0.5: the lerp from exp_avg, else from grad */
    float coeff;          /* 1 - beta1, minus 1 when not small */
    float b2, c2, bc2_sqrt, eps, neg_step;
    int has_clip;
    float clip;
} consts_t;

static void make_consts(const adamw_args *a, consts_t *k) {
    double step = (double)a->step;
    double bc1 = 1 - pow(a->beta1, step), bc2 = 1 - pow(a->beta2, step);
    float lerp_weight = (float)(1 - a->beta1);
    k->decays = a->weight_decay != 0.0;
    k->decay_factor = (float)(1 - a->lr * a->weight_decay);
    k->small = fabsf(lerp_weight) < 0.5f;
    k->coeff = k->small ? lerp_weight : lerp_weight - 1.0f;
    k->b2 = (float)a->beta2;
    k->c2 = (float)(1 - a->beta2);
    k->bc2_sqrt = (float)sqrt(bc2);
    k->eps = (float)a->eps;
    k->neg_step = (float)(-(a->lr / bc1));
    k->has_clip = a->has_clip;
    k->clip = a->clip;
}

/* fma(a, b, c) rounded once, without the FMA instruction (the generic variant's; libm's
   fmaf emulates it far more slowly where the instruction is missing): a * b is exact in
   double, the sum rounded to odd in double (the nearest sum, moved one unit toward the exact
   one when inexact and even), and rounding that to float is then the correctly rounded
   result (Boldo and Melquiond: double has at least two bits more than float). */
static inline float fma_odd(float a, float b, float c) {
    double p = (double)a * (double)b, s = p + (double)c;
    double bs = s - p, err = (p - (s - bs)) + ((double)c - bs);   /* s + err == p + c */
    if (err != 0 && isfinite(s)) {
        uint64_t u;
        memcpy(&u, &s, 8);
        if (!(u & 1)) {
            u += ((err > 0) == (s > 0)) ? 1 : (uint64_t)-1;   /* away from / toward zero */
            memcpy(&s, &u, 8);
        }
    }
    return (float)s;
}

/* One element's AdamW under a rule (adamw.h). The lerp m + w (g - m), or g + (w - 1)(g - m)
   for a large weight, is torch's fmadd(coeff, g - m, base); the tail's
   g - (g - m)(1 - w) is the same number (1 - w and w - 1 are exact negations). hw_fma: the
   caller is compiled for the FMA instruction (a constant once inlined). */
static inline __attribute__((always_inline)) void adamw_math(float *pp, float *pm, float *pv,
                                                              float g, int decay,
                                                              const consts_t *k, int rule,
                                                              int hw_fma) {
#define FUSED(a, b, c) (hw_fma ? fmaf(a, b, c) : fma_odd(a, b, c))
    float p = *pp, m = *pm, v = *pv;
    if (decay) p = p * k->decay_factor;
    float base = k->small ? m : g;
    if (rule == RULE_PLAIN) {
        m = k->coeff * (g - m) + base;
        v = v * k->b2 + (k->c2 * g) * g;
    } else {
        m = FUSED(k->coeff, g - m, base);
        v = rule == RULE_VECTOR ? FUSED(k->c2 * g, g, v * k->b2) : FUSED(v, k->b2, (k->c2 * g) * g);
    }
#undef FUSED
    float denom = sqrtf(v) / k->bc2_sqrt + k->eps;
    *pp = p + (k->neg_step * m) / denom;
    *pm = m;
    *pv = v;
}

/* ---------------------------------------------------------------- one call's work */

typedef struct {
    const adamw_args *args;
    consts_t k;
    const adamw_segment *segs;
    int64_t nseg;
    int64_t *starts;      /* segment i's elements are [starts[i], starts[i + 1]) of the call */
    int isa;
    int mw;               /* the SIMD blocks' master and weights (MW_*), -1: not theirs */
    float *minmax;        /* ADAMW_MINMAX: [worker][state][piece][min, max] */
} job_t;

static inline int scaled(int dtype) { return dtype == ADAMW_F16 || dtype == ADAMW_E4M3; }

/* A piece's multipliers: read with in[], stored with scale out[] as cast(x * q[]) */
typedef struct { float in[3], out[3], q[3]; } piece_scales;

static void scales_of(const adamw_args *a, int64_t piece, piece_scales *ps) {
    const int dtypes[3] = {a->master, a->exp_avg, a->exp_avg_sq};
    for (int st = 0; st < 3; st++) {
        ps->in[st] = ps->out[st] = ps->q[st] = 1.0f;
        if (!scaled(dtypes[st])) continue;
        ps->in[st] = a->scale_in[st][piece];
        if (a->mode != ADAMW_WRITE) continue;
        float s = a->scale_out[st][piece];
        ps->out[st] = s;
        ps->q[st] = s > 0 ? 1.0f / s : 0.0f;   /* fp16: where(scale > 0, 1 / scale, 0) */
    }
}

/* What a batch does that a variant may do faster: the arithmetic (adamw_math over n
   elements of float arrays), the fp16 conversions (x times mult in, x times q out), a
   state's running (min, max), and the remainders' join and split */
typedef struct {
    void (*math)(float *p, float *m, float *v, const float *g, int n, int decay,
                 const consts_t *k, int rule);
    void (*load_f16)(const uint16_t *src, int n, float mult, float *out);
    void (*store_f16)(uint16_t *dst, int n, const float *x, float q);
    void (*minmax)(const float *x, int n, float *mm);
    void (*join)(const uint16_t *high, const int16_t *rem, int n, float *out);
    void (*split)(const float *x, int n, uint16_t *high, int16_t *rem);
} batch_ops;

/* A stream's elements [i, i + n) into float (a scaled dtype times its multiplier) */
static inline void load_stream(int dtype, const void *base, int64_t i, int n, float mult,
                               float *out, const batch_ops *ops) {
    switch (dtype) {
    case ADAMW_F32:
        memcpy(out, (const float *)base + i, (size_t)n * sizeof(float));
        break;
    case ADAMW_BF16:
        for (int e = 0; e < n; e++) out[e] = bf16_to_f32(((const uint16_t *)base)[i + e]);
        break;
    case ADAMW_F16:
        ops->load_f16((const uint16_t *)base + i, n, mult, out);
        break;
    default:   /* E4M3 */
        for (int e = 0; e < n; e++) out[e] = e4m3_value[((const uint8_t *)base)[i + e]] * mult;
    }
}

/* Floats into a stream by precision.quantize's rules (s: the piece's scale, q: 1 / s) */
static inline void store_stream(int dtype, void *base, int64_t i, int n, const float *x,
                                float s, float q, const batch_ops *ops) {
    switch (dtype) {
    case ADAMW_F32:
        memcpy((float *)base + i, x, (size_t)n * sizeof(float));
        break;
    case ADAMW_BF16:
        for (int e = 0; e < n; e++) ((uint16_t *)base)[i + e] = f32_to_bf16(x[e]);
        break;
    case ADAMW_F16:   /* fp16(x * (1 / scale)), 1 / scale being 0 when the scale is not > 0 */
        ops->store_f16((uint16_t *)base + i, n, x, q);
        break;
    default:          /* E4M3 */
        if (s > 0) {  /* e4m3(clamp(x * (1 / scale), -448, 448)); NaN stays NaN */
            for (int e = 0; e < n; e++) {
                float y = x[e] * q;
                y = y < -448.0f ? -448.0f : (y > 448.0f ? 448.0f : y);
                ((uint8_t *)base)[i + e] = f32_to_e4m3(y);
            }
        } else if (s == 0) {   /* an all-zero piece is stored as zeros */
            memset((uint8_t *)base + i, 0, (size_t)n);
        } else {               /* a NaN scale: e4m3(x * scale), NaN */
            for (int e = 0; e < n; e++) ((uint8_t *)base)[i + e] = f32_to_e4m3(x[e] * s);
        }
    }
}

/* A running (min, max) that a NaN takes over for good, as torch.aminmax propagates NaN */
static inline void track(float *mm, float x) {
    if (mm[0] != mm[0]) return;
    if (x != x) {
        mm[0] = mm[1] = x;
        return;
    }
    if (x < mm[0]) mm[0] = x;
    if (x > mm[1]) mm[1] = x;
}

static void scalar_math(float *p, float *m, float *v, const float *g, int n, int decay,
                        const consts_t *k, int rule) {
    for (int e = 0; e < n; e++) adamw_math(&p[e], &m[e], &v[e], g[e], decay, k, rule, 0);
}

static void scalar_load_f16(const uint16_t *src, int n, float mult, float *out) {
    for (int e = 0; e < n; e++) out[e] = f16_to_f32(src[e]) * mult;
}

static void scalar_store_f16(uint16_t *dst, int n, const float *x, float q) {
    for (int e = 0; e < n; e++) dst[e] = f32_to_f16(x[e] * q);
}

static void scalar_minmax(const float *x, int n, float *mm) {
    for (int e = 0; e < n; e++) track(mm, x[e]);
}

static void scalar_join(const uint16_t *high, const int16_t *rem, int n, float *out) {
    for (int e = 0; e < n; e++) out[e] = te_join(high[e], rem[e]);
}

static void scalar_split(const float *x, int n, uint16_t *high, int16_t *rem) {
    for (int e = 0; e < n; e++) {
        uint32_t u = f2u(x[e]);
        high[e] = te_high(u);
        rem[e] = (int16_t)(u & 0xFFFFu);
    }
}

static const batch_ops generic_ops = {scalar_math, scalar_load_f16, scalar_store_f16,
                                      scalar_minmax, scalar_join, scalar_split};

/* Up to BATCH elements [i, i + n), any dtypes: the generic variant's work and the SIMD
   variants' leftovers. Each stream is loaded into floats in its own loop, the arithmetic
   runs over the batch (math: by 8 where the CPU can), then each stream is stored: the long
   division and square-root chains of neighbouring elements overlap, where one element at
   a time they would not. minmax: this piece's [state][min, max] (ADAMW_MINMAX). */
#define BATCH 64
static inline __attribute__((always_inline)) void update_batch(const job_t *j,
                                                                const adamw_segment *s,
                                                                int64_t i, int n, int rule,
                                                                const piece_scales *ps,
                                                                float *minmax,
                                                                const batch_ops *ops) {
    const adamw_args *a = j->args;
    const consts_t *k = &j->k;
    float g[BATCH], p[BATCH], m[BATCH], v[BATCH];
    load_stream(a->grad, s->grad, i, n, 1.0f, g, ops);
    if (k->has_clip)
        for (int e = 0; e < n; e++) g[e] = g[e] * k->clip;
    if (a->master == ADAMW_REM16)
        ops->join((const uint16_t *)s->weights + i, (const int16_t *)s->master + i, n, p);
    else
        load_stream(a->master, s->master, i, n, ps->in[ADAMW_MASTER], p, ops);
    load_stream(a->exp_avg, s->exp_avg, i, n, ps->in[ADAMW_EXP_AVG], m, ops);
    load_stream(a->exp_avg_sq, s->exp_avg_sq, i, n, ps->in[ADAMW_EXP_AVG_SQ], v, ops);
    ops->math(p, m, v, g, n, s->decay && k->decays, k, rule);
    if (a->mode == ADAMW_MINMAX) {
        const int dtypes[3] = {a->master, a->exp_avg, a->exp_avg_sq};
        const float *values[3] = {p, m, v};
        for (int st = 0; st < 3; st++)
            if (scaled(dtypes[st]))
                ops->minmax(values[st], n, minmax + 2 * st);
        return;
    }
    /* the weights from the fp32 result, before a scaled master is rounded (TE's order) */
    uint16_t *w = (uint16_t *)s->weights_out;
    if (a->master == ADAMW_REM16) {
        ops->split(p, n, w + i, (int16_t *)s->master_out + i);
    } else {
        if (a->weights == ADAMW_BF16 && a->weights_round == ADAMW_ROUND_TE)
            for (int e = 0; e < n; e++) w[i + e] = te_high(f2u(p[e]));
        else if (a->weights == ADAMW_BF16)
            for (int e = 0; e < n; e++) w[i + e] = f32_to_bf16(p[e]);
        else if (a->weights == ADAMW_F16)   /* x * 1.0f is x */
            ops->store_f16(w + i, n, p, 1.0f);
        store_stream(a->master, s->master_out, i, n, p, ps->out[ADAMW_MASTER],
                     ps->q[ADAMW_MASTER], ops);
    }
    store_stream(a->exp_avg, s->exp_avg_out, i, n, m, ps->out[ADAMW_EXP_AVG],
                 ps->q[ADAMW_EXP_AVG], ops);
    store_stream(a->exp_avg_sq, s->exp_avg_sq_out, i, n, v, ps->out[ADAMW_EXP_AVG_SQ],
                 ps->q[ADAMW_EXP_AVG_SQ], ops);
}

static void generic_run(const job_t *j, const adamw_segment *s, int64_t lo, int64_t hi,
                        int rule, const piece_scales *ps, float *minmax) {
    for (int64_t i = lo; i < hi; i += BATCH)
        update_batch(j, s, i, hi - i < BATCH ? (int)(hi - i) : BATCH, rule, ps, minmax,
                     &generic_ops);
}

/* ---------------------------------------------------------------- SIMD
 * The blocks run torch's vector rule on the dtypes that carry the throughput, taken as
 * constants (each dispatch level below turns one runtime value into a literal, and
 * always_inline makes one loop per combination): the gradient F32 or BF16, both moments F32
 * or both BF16, and the master with its weights (mw). Everything else goes by batches
 * (fma_run): torch's tail rule (at most lanes - 1 elements of a tensor), its plain build,
 * the other dtypes. Weight decay and an absent clip are multiplies by exactly 1 here, which
 * change no bit (x * 1.0f is x), so the blocks do not branch on them. */
#if defined(__x86_64__)
#define AVX2_FN static inline __attribute__((always_inline, target("avx2,fma")))

typedef struct {
    __m256 decay, clip, small, coeff, b2, c2, bc2_sqrt, eps, neg_step;
    int nt[4];   /* non-temporal stores: weights, master, exp_avg, exp_avg_sq (nt_plan) */
} avx2_consts;

AVX2_FN __m256 avx2_load(int dtype, const void *base, int64_t i) {
    if (dtype == ADAMW_F32) return _mm256_loadu_ps((const float *)base + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* eight 32-bit lanes holding values below 65536 -> eight uint16 */
AVX2_FN __m128i avx2_pack16(__m256i r) {
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

AVX2_FN __m128i avx2_bf16(__m256 x) {   /* f32_to_bf16, eight at a time */
    __m256i u = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                                                   odd), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return avx2_pack16(_mm256_or_si256(r, _mm256_and_si256(nan, _mm256_set1_epi32(0xFFFF))));
}

AVX2_FN __m128i avx2_te_high(__m256i u) {   /* te_high, eight at a time */
    return avx2_pack16(_mm256_srli_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x8000)), 16));
}

AVX2_FN void avx2_put(float *dst, __m256 x, int nt) {
    if (nt) _mm256_stream_ps(dst, x); else _mm256_storeu_ps(dst, x);
}

AVX2_FN void avx2_put16(void *dst, __m128i x, int nt) {
    if (nt) _mm_stream_si128((__m128i *)dst, x); else _mm_storeu_si128((__m128i *)dst, x);
}

AVX2_FN void avx2_store(int dtype, void *base, int64_t i, __m256 x, int nt) {
    if (dtype == ADAMW_F32)
        avx2_put((float *)base + i, x, nt);
    else
        avx2_put16((uint16_t *)base + i, avx2_bf16(x), nt);
}

/* adamw_math, eight at a time */
AVX2_FN void avx2_math(__m256 *pp, __m256 *pm, __m256 *pv, __m256 g, const avx2_consts *c,
                       int rule) {
    __m256 p = _mm256_mul_ps(*pp, c->decay), m = *pm, v = *pv;
    __m256 base = _mm256_blendv_ps(g, m, c->small), c2g = _mm256_mul_ps(c->c2, g);
    if (rule == RULE_PLAIN) {
        m = _mm256_add_ps(_mm256_mul_ps(c->coeff, _mm256_sub_ps(g, m)), base);
        v = _mm256_add_ps(_mm256_mul_ps(v, c->b2), _mm256_mul_ps(c2g, g));
    } else {
        m = _mm256_fmadd_ps(c->coeff, _mm256_sub_ps(g, m), base);
        v = rule == RULE_VECTOR ? _mm256_fmadd_ps(c2g, g, _mm256_mul_ps(v, c->b2))
                                : _mm256_fmadd_ps(v, c->b2, _mm256_mul_ps(c2g, g));
    }
    __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), c->bc2_sqrt), c->eps);
    *pp = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(c->neg_step, m), denom));
    *pm = m;
    *pv = v;
}

AVX2_FN avx2_consts avx2_constants(const consts_t *k, int decay) {
    avx2_consts c = {_mm256_set1_ps(decay ? k->decay_factor : 1.0f),
                     _mm256_set1_ps(k->has_clip ? k->clip : 1.0f),
                     _mm256_castsi256_ps(_mm256_set1_epi32(k->small ? -1 : 0)),
                     _mm256_set1_ps(k->coeff), _mm256_set1_ps(k->b2), _mm256_set1_ps(k->c2),
                     _mm256_set1_ps(k->bc2_sqrt), _mm256_set1_ps(k->eps),
                     _mm256_set1_ps(k->neg_step)};
    return c;
}

AVX2_FN void avx2_block(const avx2_consts *c, const adamw_segment *s, int64_t i, int grad,
                        int moments, int mw) {
    __m256 g = _mm256_mul_ps(avx2_load(grad, s->grad, i), c->clip), p;
    if (mw == MW_REM16) {   /* te_join */
        __m128i hi = _mm_loadu_si128((const __m128i *)((const uint16_t *)s->weights + i));
        __m128i rem = _mm_loadu_si128((const __m128i *)((const int16_t *)s->master + i));
        p = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16),
                                                 _mm256_cvtepi16_epi32(rem)));
    } else {
        p = _mm256_loadu_ps((const float *)s->master + i);
    }
    __m256 m = avx2_load(moments, s->exp_avg, i), v = avx2_load(moments, s->exp_avg_sq, i);
    avx2_math(&p, &m, &v, g, c, RULE_VECTOR);
    __m256i u = _mm256_castps_si256(p);
    if (mw == MW_REM16) {
        avx2_put16((uint16_t *)s->weights_out + i, avx2_te_high(u), c->nt[0]);
        avx2_put16((int16_t *)s->master_out + i,
                   avx2_pack16(_mm256_and_si256(u, _mm256_set1_epi32(0xFFFF))), c->nt[1]);
    } else {
        avx2_put((float *)s->master_out + i, p, c->nt[1]);
        if (mw != MW_F32)
            avx2_put16((uint16_t *)s->weights_out + i,
                       mw == MW_TE ? avx2_te_high(u) : avx2_bf16(p), c->nt[0]);
    }
    avx2_store(moments, s->exp_avg_out, i, m, c->nt[2]);
    avx2_store(moments, s->exp_avg_sq_out, i, v, c->nt[3]);
}

/* Software prefetch of the streams read, PREFETCH elements ahead, once per 64 bytes of
   fp32: the divisions fill the out-of-order window, so the loads the hardware would issue
   early wait behind them (5-8% faster on the CPU machine, tools/bench_host_update.py) */
#define PREFETCH 256
static inline void prefetch(const void *base, int64_t i, int size) {
    _mm_prefetch((const char *)base + (i + PREFETCH) * size, _MM_HINT_T0);
}

static inline void prefetch_inputs(const adamw_segment *s, int64_t i, int grad, int moments,
                                   int mw) {
    int state = moments == ADAMW_F32 ? 4 : 2;
    prefetch(s->grad, i, grad == ADAMW_F32 ? 4 : 2);
    prefetch(s->master, i, mw == MW_REM16 ? 2 : 4);
    if (mw == MW_REM16) prefetch(s->weights, i, 2);
    prefetch(s->exp_avg, i, state);
    prefetch(s->exp_avg_sq, i, state);
}

AVX2_FN void avx2_loop(const avx2_consts *c, const adamw_segment *s, int64_t i, int64_t end,
                       int grad, int moments, int mw) {
    adamw_segment seg = *s;   /* a local copy: its pointers stay in registers */
    for (; i + 16 <= end; i += 16) {
        prefetch_inputs(&seg, i, grad, moments, mw);
        avx2_block(c, &seg, i, grad, moments, mw);
        avx2_block(c, &seg, i + 8, grad, moments, mw);
    }
    if (i < end) avx2_block(c, &seg, i, grad, moments, mw);
}

AVX2_FN void avx2_loop_mw(const avx2_consts *c, const adamw_segment *s, int64_t i, int64_t end,
                          int grad, int moments, int mw) {
    switch (mw) {
    case MW_F32: avx2_loop(c, s, i, end, grad, moments, MW_F32); break;
    case MW_EVEN: avx2_loop(c, s, i, end, grad, moments, MW_EVEN); break;
    case MW_TE: avx2_loop(c, s, i, end, grad, moments, MW_TE); break;
    default: avx2_loop(c, s, i, end, grad, moments, MW_REM16);
    }
}

AVX2_FN void avx2_loop_moments(const avx2_consts *c, const adamw_segment *s, int64_t i,
                               int64_t end, int grad, int moments, int mw) {
    if (moments == ADAMW_F32)
        avx2_loop_mw(c, s, i, end, grad, ADAMW_F32, mw);
    else
        avx2_loop_mw(c, s, i, end, grad, ADAMW_BF16, mw);
}

/* [lo, end) of a segment by blocks of eight (vector rule); returns end. nt: nt_plan's */
__attribute__((target("avx2,fma")))
static int64_t avx2_vector(const job_t *j, const adamw_segment *s, int64_t lo, int64_t hi,
                           const int nt[4]) {
    avx2_consts c = avx2_constants(&j->k, s->decay && j->k.decays);
    memcpy(c.nt, nt, sizeof(c.nt));
    int64_t end = lo + (hi - lo) / 8 * 8;
    if (j->args->grad == ADAMW_F32)
        avx2_loop_moments(&c, s, lo, end, ADAMW_F32, j->args->exp_avg, j->mw);
    else
        avx2_loop_moments(&c, s, lo, end, ADAMW_BF16, j->args->exp_avg, j->mw);
    if (nt[0] || nt[1] || nt[2] || nt[3]) _mm_sfence();   /* before the threads are joined */
    return end;
}

/* A batch's arithmetic by 8 (the clip is applied already: the multiply by 1 of c.clip is
   not used here) */
__attribute__((target("avx2,fma")))
static void avx2_batch_math(float *p, float *m, float *v, const float *g, int n, int decay,
                            const consts_t *k, int rule) {
    avx2_consts c = avx2_constants(k, decay);
    int e = 0;
    for (; e + 8 <= n; e += 8) {
        __m256 pe = _mm256_loadu_ps(p + e), me = _mm256_loadu_ps(m + e);
        __m256 ve = _mm256_loadu_ps(v + e);
        avx2_math(&pe, &me, &ve, _mm256_loadu_ps(g + e), &c, rule);
        _mm256_storeu_ps(p + e, pe);
        _mm256_storeu_ps(m + e, me);
        _mm256_storeu_ps(v + e, ve);
    }
    for (; e < n; e++) adamw_math(&p[e], &m[e], &v[e], g[e], decay, k, rule, 1);
}

/* fp16 by 8 with the F16C instructions: exact in, round to nearest even out, as torch's
   AVX2 cast (a NaN keeps its sign, as f32_to_f16's) */
__attribute__((target("avx2,fma,f16c")))
static void avx2_load_f16(const uint16_t *src, int n, float mult, float *out) {
    int e = 0;
    for (; e + 8 <= n; e += 8)
        _mm256_storeu_ps(out + e, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + e))),
                                                _mm256_set1_ps(mult)));
    for (; e < n; e++) out[e] = f16_to_f32(src[e]) * mult;
}

__attribute__((target("avx2,fma,f16c")))
static void avx2_store_f16(uint16_t *dst, int n, const float *x, float q) {
    int e = 0;
    for (; e + 8 <= n; e += 8)
        _mm_storeu_si128((__m128i *)(dst + e),
                         _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(x + e), _mm256_set1_ps(q)),
                                         _MM_FROUND_TO_NEAREST_INT));
    for (; e < n; e++) dst[e] = f32_to_f16(x[e] * q);
}

/* track() by 8: min(x, old) and max(x, old) keep the old value on ties, as track does;
   a NaN is noted apart (the instructions would drop it) */
__attribute__((target("avx2,fma")))
static void avx2_minmax(const float *x, int n, float *mm) {
    int e = 0;
    if (n >= 8 && mm[0] == mm[0]) {
        __m256 lo = _mm256_set1_ps(mm[0]), hi = _mm256_set1_ps(mm[1]), nan = _mm256_setzero_ps();
        for (; e + 8 <= n; e += 8) {
            __m256 v = _mm256_loadu_ps(x + e);
            lo = _mm256_min_ps(v, lo);
            hi = _mm256_max_ps(v, hi);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float los[8], his[8];
        _mm256_storeu_ps(los, lo);
        _mm256_storeu_ps(his, hi);
        if (_mm256_movemask_ps(nan)) {
            mm[0] = mm[1] = NAN;
            return;
        }
        for (int l = 0; l < 8; l++) {
            track(mm, los[l]);
            track(mm, his[l]);
        }
    }
    for (; e < n; e++) track(mm, x[e]);
}

__attribute__((target("avx2,fma")))
static void avx2_join(const uint16_t *high, const int16_t *rem, int n, float *out) {
    int e = 0;
    for (; e + 8 <= n; e += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(high + e));
        __m128i r = _mm_loadu_si128((const __m128i *)(rem + e));
        _mm256_storeu_si256((__m256i *)(out + e),
                            _mm256_add_epi32(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16),
                                             _mm256_cvtepi16_epi32(r)));
    }
    scalar_join(high + e, rem + e, n - e, out + e);
}

__attribute__((target("avx2,fma")))
static void avx2_split(const float *x, int n, uint16_t *high, int16_t *rem) {
    int e = 0;
    for (; e + 8 <= n; e += 8) {
        __m256i u = _mm256_loadu_si256((const __m256i *)(x + e));
        _mm_storeu_si128((__m128i *)(high + e), avx2_te_high(u));
        _mm_storeu_si128((__m128i *)(rem + e),
                         avx2_pack16(_mm256_and_si256(u, _mm256_set1_epi32(0xFFFF))));
    }
    scalar_split(x + e, n - e, high + e, rem + e);
}

static const batch_ops avx2_ops = {avx2_batch_math, avx2_load_f16, avx2_store_f16,
                                   avx2_minmax, avx2_join, avx2_split};

/* The batches of the generic variant with AVX2 operations (AVX2 and AVX-512 machines) */
__attribute__((target("avx2,fma")))
static void fma_run(const job_t *j, const adamw_segment *s, int64_t lo, int64_t hi, int rule,
                    const piece_scales *ps, float *minmax) {
    for (int64_t i = lo; i < hi; i += BATCH)
        update_batch(j, s, i, hi - i < BATCH ? (int)(hi - i) : BATCH, rule, ps, minmax,
                     &avx2_ops);
}

/* ---------------------------------------------------------------- AVX-512: the same, by 16 */
#define AVX512_FN static inline __attribute__((always_inline, target("avx512f,avx2,fma")))

typedef struct {
    __m512 decay, clip, coeff, b2, c2, bc2_sqrt, eps, neg_step;
    __mmask16 small;
    int nt[4];
} avx512_consts;

AVX512_FN __m512 avx512_load(int dtype, const void *base, int64_t i) {
    if (dtype == ADAMW_F32) return _mm512_loadu_ps((const float *)base + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

AVX512_FN __m256i avx512_bf16(__m512 x) {   /* f32_to_bf16, sixteen at a time */
    __m512i u = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                                                   odd), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0xFFFF)));
}

AVX512_FN __m256i avx512_te_high(__m512i u) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x8000)),
                                                   16));
}

AVX512_FN void avx512_put(float *dst, __m512 x, int nt) {
    if (nt) _mm512_stream_ps(dst, x); else _mm512_storeu_ps(dst, x);
}

AVX512_FN void avx512_put16(void *dst, __m256i x, int nt) {
    if (nt) _mm256_stream_si256((__m256i *)dst, x); else _mm256_storeu_si256((__m256i *)dst, x);
}

AVX512_FN void avx512_store(int dtype, void *base, int64_t i, __m512 x, int nt) {
    if (dtype == ADAMW_F32)
        avx512_put((float *)base + i, x, nt);
    else
        avx512_put16((uint16_t *)base + i, avx512_bf16(x), nt);
}

AVX512_FN void avx512_block(const avx512_consts *c, const adamw_segment *s, int64_t i, int grad,
                            int moments, int mw) {
    __m512 g = _mm512_mul_ps(avx512_load(grad, s->grad, i), c->clip), p;
    if (mw == MW_REM16) {
        __m256i hi = _mm256_loadu_si256((const __m256i *)((const uint16_t *)s->weights + i));
        __m256i rem = _mm256_loadu_si256((const __m256i *)((const int16_t *)s->master + i));
        p = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16),
                                                 _mm512_cvtepi16_epi32(rem)));
    } else {
        p = _mm512_loadu_ps((const float *)s->master + i);
    }
    __m512 m = avx512_load(moments, s->exp_avg, i), v = avx512_load(moments, s->exp_avg_sq, i);
    p = _mm512_mul_ps(p, c->decay);
    m = _mm512_fmadd_ps(c->coeff, _mm512_sub_ps(g, m), _mm512_mask_mov_ps(g, c->small, m));
    v = _mm512_fmadd_ps(_mm512_mul_ps(c->c2, g), g, _mm512_mul_ps(v, c->b2));
    __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), c->bc2_sqrt), c->eps);
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(c->neg_step, m), denom));
    __m512i u = _mm512_castps_si512(p);
    if (mw == MW_REM16) {
        avx512_put16((uint16_t *)s->weights_out + i, avx512_te_high(u), c->nt[0]);
        avx512_put16((int16_t *)s->master_out + i, _mm512_cvtepi32_epi16(u), c->nt[1]);
    } else {
        avx512_put((float *)s->master_out + i, p, c->nt[1]);
        if (mw != MW_F32)
            avx512_put16((uint16_t *)s->weights_out + i,
                         mw == MW_TE ? avx512_te_high(u) : avx512_bf16(p), c->nt[0]);
    }
    avx512_store(moments, s->exp_avg_out, i, m, c->nt[2]);
    avx512_store(moments, s->exp_avg_sq_out, i, v, c->nt[3]);
}

AVX512_FN void avx512_loop(const avx512_consts *c, const adamw_segment *s, int64_t i,
                           int64_t end, int grad, int moments, int mw) {
    adamw_segment seg = *s;
    for (; i < end; i += 16) {
        prefetch_inputs(&seg, i, grad, moments, mw);
        avx512_block(c, &seg, i, grad, moments, mw);
    }
}

AVX512_FN void avx512_loop_mw(const avx512_consts *c, const adamw_segment *s, int64_t i,
                              int64_t end, int grad, int moments, int mw) {
    switch (mw) {
    case MW_F32: avx512_loop(c, s, i, end, grad, moments, MW_F32); break;
    case MW_EVEN: avx512_loop(c, s, i, end, grad, moments, MW_EVEN); break;
    case MW_TE: avx512_loop(c, s, i, end, grad, moments, MW_TE); break;
    default: avx512_loop(c, s, i, end, grad, moments, MW_REM16);
    }
}

AVX512_FN void avx512_loop_moments(const avx512_consts *c, const adamw_segment *s, int64_t i,
                                   int64_t end, int grad, int moments, int mw) {
    if (moments == ADAMW_F32)
        avx512_loop_mw(c, s, i, end, grad, ADAMW_F32, mw);
    else
        avx512_loop_mw(c, s, i, end, grad, ADAMW_BF16, mw);
}

__attribute__((target("avx512f,avx2,fma")))
static int64_t avx512_vector(const job_t *j, const adamw_segment *s, int64_t lo, int64_t hi,
                             const int nt[4]) {
    const consts_t *k = &j->k;
    avx512_consts c = {_mm512_set1_ps(s->decay && k->decays ? k->decay_factor : 1.0f),
                       _mm512_set1_ps(k->has_clip ? k->clip : 1.0f), _mm512_set1_ps(k->coeff),
                       _mm512_set1_ps(k->b2), _mm512_set1_ps(k->c2),
                       _mm512_set1_ps(k->bc2_sqrt), _mm512_set1_ps(k->eps),
                       _mm512_set1_ps(k->neg_step), (__mmask16)(k->small ? 0xFFFF : 0)};
    memcpy(c.nt, nt, sizeof(c.nt));
    int64_t end = lo + (hi - lo) / 16 * 16;
    if (j->args->grad == ADAMW_F32)
        avx512_loop_moments(&c, s, lo, end, ADAMW_F32, j->args->exp_avg, j->mw);
    else
        avx512_loop_moments(&c, s, lo, end, ADAMW_BF16, j->args->exp_avg, j->mw);
    if (nt[0] || nt[1] || nt[2] || nt[3]) _mm_sfence();
    return end;
}
#endif /* __x86_64__ */

#if defined(__x86_64__)
/* Non-temporal stores for the outputs nothing reads here (the weights of an fp32 master,
   every state written out of place): they skip the read of each line before it is written
   (read-for-ownership), a sixth of the traffic of an fp32 update's weights, and leave the
   cache to the inputs. They need aligned addresses: the SIMD loop starts where the first
   such stream is aligned (the elements before it, fewer than a block, go by batch), and
   each such stream takes them when it is aligned there too. Returns that start. */
static int64_t nt_plan(const job_t *j, const adamw_segment *s, int64_t lo, int64_t hi,
                       int nt[4]) {
    const int block = j->isa == ADAMW_AVX512 ? 16 : 8;
    const int f32 = j->mw != MW_REM16;   /* the master's stored size: 4, or 2 (remainders) */
    void *outs[4] = {s->weights_out, s->master_out, s->exp_avg_out, s->exp_avg_sq_out};
    const void *ins[4] = {s->weights, s->master, s->exp_avg, s->exp_avg_sq};
    int size[4] = {2, f32 ? 4 : 2, j->args->exp_avg == ADAMW_F32 ? 4 : 2,
                   j->args->exp_avg_sq == ADAMW_F32 ? 4 : 2};
    int64_t start = lo;
    int first = 1;
    for (int st = 0; st < 4; st++) {
        nt[st] = 0;
        if (!outs[st] || outs[st] == ins[st] || (st == 0 && j->mw == MW_F32)) continue;
        uintptr_t align = (uintptr_t)block * (uintptr_t)size[st];   /* one block's bytes */
        uintptr_t at = (uintptr_t)outs[st] + (uintptr_t)(start * size[st]);
        if (first) {   /* the first write-only stream sets where the loop starts */
            if (at % (uintptr_t)size[st]) return lo;
            start += (int64_t)(((align - at % align) % align) / (uintptr_t)size[st]);
            if (start > hi) return lo;
            first = 0;
            at = (uintptr_t)outs[st] + (uintptr_t)(start * size[st]);
        }
        nt[st] = at % align == 0;
    }
    return start;
}
#endif

/* Elements [lo, hi) of one segment: the vector rule up to s->vector, the tail rule after */
static void run_range(const job_t *j, const adamw_segment *s, int64_t lo, int64_t hi,
                      float *minmax) {
    int64_t split = s->vector < lo ? lo : (s->vector > hi ? hi : s->vector);
    int fma = j->args->rules == ADAMW_RULES_FMA;
    int rules[2] = {fma ? RULE_VECTOR : RULE_PLAIN, fma ? RULE_TAIL : RULE_PLAIN};
    int64_t bounds[3] = {lo, split, hi};
    piece_scales ps;
    scales_of(j->args, s->piece, &ps);
    for (int r = 0; r < 2; r++) {
        int64_t i = bounds[r];
        if (i == bounds[r + 1]) continue;
#if defined(__x86_64__)
        if (j->isa != ADAMW_GENERIC) {
            if (j->mw >= 0 && rules[r] == RULE_VECTOR) {
                int nt[4];
                int64_t start = nt_plan(j, s, i, bounds[r + 1], nt);
                fma_run(j, s, i, start, rules[r], &ps, minmax);
                i = j->isa == ADAMW_AVX512 ? avx512_vector(j, s, start, bounds[r + 1], nt)
                                           : avx2_vector(j, s, start, bounds[r + 1], nt);
            }
            fma_run(j, s, i, bounds[r + 1], rules[r], &ps, minmax);
            continue;
        }
#endif
        generic_run(j, s, i, bounds[r + 1], rules[r], &ps, minmax);
    }
}

/* ---------------------------------------------------------------- threads */

typedef void (*span_fn)(void *ctx, int64_t lo, int64_t hi, int worker);

typedef struct {
    span_fn fn;
    void *ctx;
    int64_t lo, hi;
    int worker;
} span_t;

static void *span_main(void *arg) {
    span_t *t = (span_t *)arg;
    t->fn(t->ctx, t->lo, t->hi, t->worker);
    return NULL;
}

static int workers_for(int64_t total, int threads) {
    int64_t w = total / MIN_SPAN;
    if (w > threads) w = threads;
    return w < 1 ? 1 : (int)w;
}

/* [0, total) cut into `workers` spans at multiples of SPAN_ALIGN; span 0 on this thread.
   A thread that cannot be started has its span run here, after this thread's own. */
static void run_parallel(span_fn fn, void *ctx, int64_t total, int workers) {
    span_t spans[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS];
    for (int w = 0; w < workers; w++) {
        int64_t lo = w == 0 ? 0 : (int64_t)((__int128)total * w / workers) / SPAN_ALIGN * SPAN_ALIGN;
        int64_t hi = w + 1 == workers ? total
                     : (int64_t)((__int128)total * (w + 1) / workers) / SPAN_ALIGN * SPAN_ALIGN;
        spans[w] = (span_t){fn, ctx, lo, hi, w};
    }
    for (int w = 1; w < workers; w++)
        started[w] = pthread_create(&tids[w], NULL, span_main, &spans[w]) == 0;
    span_main(&spans[0]);
    for (int w = 1; w < workers; w++) {
        if (started[w])
            pthread_join(tids[w], NULL);
        else
            span_main(&spans[w]);
    }
}

static void step_span(void *ctx, int64_t lo, int64_t hi, int worker) {
    const job_t *j = (const job_t *)ctx;
    int64_t first = 0, last = j->nseg;   /* the segment holding element lo: binary search */
    while (last - first > 1) {
        int64_t mid = (first + last) / 2;
        if (j->starts[mid] <= lo) first = mid; else last = mid;
    }
    int64_t pieces = j->args->pieces;
    float *mine = j->minmax ? j->minmax + (size_t)worker * 3 * 2 * pieces : NULL;
    float one[6];   /* the segment's piece: [state][min, max] */
    for (int64_t i = first; i < j->nseg && j->starts[i] < hi; i++) {
        int64_t a = (lo > j->starts[i] ? lo : j->starts[i]) - j->starts[i];
        int64_t b = (hi < j->starts[i + 1] ? hi : j->starts[i + 1]) - j->starts[i];
        int64_t piece = j->segs[i].piece;
        if (a >= b) continue;
        if (mine)
            for (int st = 0; st < 3; st++) memcpy(one + 2 * st, mine + 2 * (st * pieces + piece), 8);
        run_range(j, &j->segs[i], a, b, one);
        if (mine)
            for (int st = 0; st < 3; st++) memcpy(mine + 2 * (st * pieces + piece), one + 2 * st, 8);
    }
}

/* ---------------------------------------------------------------- entry points */

void adamw_init(void) {
    for (int b = 0; b < 256; b++) e4m3_value[b] = e4m3_decode((uint8_t)b);
#if defined(__x86_64__)
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                __builtin_cpu_supports("f16c");
    have_avx512 = have_avx2 && __builtin_cpu_supports("avx512f");
#endif
}

int adamw_isa_supported(int isa) {
    return isa == ADAMW_GENERIC || (isa == ADAMW_AVX2 && have_avx2) ||
           (isa == ADAMW_AVX512 && have_avx512);
}

int adamw_best_isa(void) {
    return have_avx512 ? ADAMW_AVX512 : have_avx2 ? ADAMW_AVX2 : ADAMW_GENERIC;
}

/* The SIMD blocks' master and weights for these arguments, or -1 where they do not apply */
static int simd_mw(const adamw_args *a) {
    if (a->mode != ADAMW_WRITE || a->rules != ADAMW_RULES_FMA || a->grad > ADAMW_BF16 ||
        a->exp_avg > ADAMW_BF16 || a->exp_avg_sq != a->exp_avg)
        return -1;
    if (a->master == ADAMW_REM16) return MW_REM16;
    if (a->master != ADAMW_F32) return -1;
    if (a->weights == ADAMW_NONE) return MW_F32;
    if (a->weights != ADAMW_BF16) return -1;
    return a->weights_round == ADAMW_ROUND_TE ? MW_TE : MW_EVEN;
}

static int check_args(const adamw_args *a, const adamw_segment *segs, int64_t nseg,
                      int threads) {
    const int states[3] = {a->master, a->exp_avg, a->exp_avg_sq};
    int any_scaled = 0;
    if (a->grad != ADAMW_F32 && a->grad != ADAMW_BF16) return ADAMW_ERR_DTYPE;
    if (a->master != ADAMW_F32 && a->master != ADAMW_F16 && a->master != ADAMW_REM16)
        return ADAMW_ERR_DTYPE;
    for (int st = 1; st < 3; st++)
        if (states[st] < ADAMW_F32 || states[st] > ADAMW_E4M3) return ADAMW_ERR_DTYPE;
    if (a->weights != ADAMW_NONE && a->weights != ADAMW_BF16 && a->weights != ADAMW_F16)
        return ADAMW_ERR_DTYPE;
    if (a->master == ADAMW_REM16 && a->weights != ADAMW_BF16) return ADAMW_ERR_DTYPE;
    if (a->weights_round == ADAMW_ROUND_TE && a->weights != ADAMW_BF16) return ADAMW_ERR_DTYPE;
    if ((a->rules != ADAMW_RULES_PLAIN && a->rules != ADAMW_RULES_FMA) ||
        (a->weights_round != ADAMW_ROUND_EVEN && a->weights_round != ADAMW_ROUND_TE) ||
        (a->mode != ADAMW_WRITE && a->mode != ADAMW_MINMAX) || nseg < 0 || threads < 1 ||
        threads > MAX_THREADS)
        return ADAMW_ERR_ARGS;
    for (int st = 0; st < 3; st++) {
        if (!scaled(states[st])) continue;
        any_scaled = 1;
        if (a->pieces < 1 || !a->scale_in[st] ||
            (a->mode == ADAMW_WRITE && !a->scale_out[st]) ||
            (a->mode == ADAMW_MINMAX && !a->minmax[st]))
            return ADAMW_ERR_ARGS;
    }
    if (a->mode == ADAMW_MINMAX && !any_scaled) return ADAMW_ERR_ARGS;
    for (int64_t i = 0; i < nseg; i++) {
        const adamw_segment *s = &segs[i];
        int write = a->mode == ADAMW_WRITE;
        if (s->numel < 0 || s->vector < 0) return ADAMW_ERR_ARGS;
        if (any_scaled && (s->piece < 0 || s->piece >= a->pieces)) return ADAMW_ERR_ARGS;
        if (s->numel == 0) continue;
        if (!s->grad || !s->master || !s->exp_avg || !s->exp_avg_sq ||
            (a->master == ADAMW_REM16 && !s->weights) ||
            (write && (!s->master_out || !s->exp_avg_out || !s->exp_avg_sq_out)) ||
            (write && a->weights != ADAMW_NONE && !s->weights_out))
            return ADAMW_ERR_ARGS;
    }
    return ADAMW_OK;
}

int adamw_step(const adamw_args *a, const adamw_segment *segs, int64_t nseg, int threads,
               int isa) {
    int rc = check_args(a, segs, nseg, threads);
    if (rc != ADAMW_OK) return rc;
    if (!adamw_isa_supported(isa)) return ADAMW_ERR_ISA;
    job_t j = {.args = a, .segs = segs, .nseg = nseg, .isa = isa};
    make_consts(a, &j.k);
    j.mw = simd_mw(a);
    j.starts = (int64_t *)malloc(sizeof(int64_t) * (size_t)(nseg + 1));
    if (!j.starts) return ADAMW_ERR_NOMEM;
    j.starts[0] = 0;
    for (int64_t i = 0; i < nseg; i++) j.starts[i + 1] = j.starts[i] + segs[i].numel;
    int64_t total = j.starts[nseg];
    int workers = workers_for(total, threads);
    if (a->mode == ADAMW_MINMAX) {
        size_t n = (size_t)workers * 3 * (size_t)a->pieces;
        j.minmax = (float *)malloc(n * 2 * sizeof(float));
        if (!j.minmax) {
            free(j.starts);
            return ADAMW_ERR_NOMEM;
        }
        for (size_t i = 0; i < n; i++) {   /* no element yet */
            j.minmax[2 * i] = INFINITY;
            j.minmax[2 * i + 1] = -INFINITY;
        }
    }
    if (total > 0) run_parallel(step_span, &j, total, workers);
    if (j.minmax) {   /* the workers' (min, max) of each piece, combined */
        const int states[3] = {a->master, a->exp_avg, a->exp_avg_sq};
        for (int st = 0; st < 3; st++) {
            if (!scaled(states[st])) continue;
            for (int64_t piece = 0; piece < a->pieces; piece++) {
                float mm[2] = {INFINITY, -INFINITY};
                for (int w = 0; w < workers; w++) {
                    const float *part = j.minmax + 2 * (((size_t)w * 3 + st) * a->pieces + piece);
                    if (part[0] > part[1]) continue;   /* this worker saw none of the piece */
                    track(mm, part[0]);
                    track(mm, part[1]);
                }
                a->minmax[st][2 * piece] = mm[0];
                a->minmax[st][2 * piece + 1] = mm[1];
            }
        }
        free(j.minmax);
    }
    free(j.starts);
    return ADAMW_OK;
}

/* ---------------------------------------------------------------- the memory bound */

typedef struct {
    const float *g;
    float *p, *m, *v;
    uint16_t *w;
    int isa;
} bound_t;

#if defined(__x86_64__)
/* the elements before w + i is aligned to `bytes`, or all of them when it cannot be */
static int64_t bound_peel(const bound_t *b, int64_t i, int64_t hi, uintptr_t bytes) {
    int64_t stop = i;
    while (stop < hi && ((uintptr_t)(b->w + stop)) % bytes) stop++;
    for (int64_t e = i; e < stop; e++) {
        b->p[e] += b->g[e]; b->m[e] += b->g[e]; b->v[e] += b->g[e];
        b->w[e] = (uint16_t)(f2u(b->p[e]) >> 16);
    }
    return stop;
}

/* The same stores as adamw_step's: in place for p, m, v, non-temporal for w (write-only) */
__attribute__((target("avx2,fma")))
static void bound_avx2(const bound_t *b, int64_t i, int64_t hi) {
    i = bound_peel(b, i, hi, 16);
    for (; i + 8 <= hi; i += 8) {
        __m256 g = _mm256_loadu_ps(b->g + i);
        __m256 p = _mm256_add_ps(_mm256_loadu_ps(b->p + i), g);
        _mm256_storeu_ps(b->p + i, p);
        _mm256_storeu_ps(b->m + i, _mm256_add_ps(_mm256_loadu_ps(b->m + i), g));
        _mm256_storeu_ps(b->v + i, _mm256_add_ps(_mm256_loadu_ps(b->v + i), g));
        _mm_stream_si128((__m128i *)(b->w + i),
                         avx2_pack16(_mm256_srli_epi32(_mm256_castps_si256(p), 16)));
    }
    _mm_sfence();
    for (; i < hi; i++) {
        b->p[i] += b->g[i]; b->m[i] += b->g[i]; b->v[i] += b->g[i];
        b->w[i] = (uint16_t)(f2u(b->p[i]) >> 16);
    }
}

__attribute__((target("avx512f,avx2,fma")))
static void bound_avx512(const bound_t *b, int64_t i, int64_t hi) {
    i = bound_peel(b, i, hi, 32);
    for (; i + 16 <= hi; i += 16) {
        __m512 g = _mm512_loadu_ps(b->g + i);
        __m512 p = _mm512_add_ps(_mm512_loadu_ps(b->p + i), g);
        _mm512_storeu_ps(b->p + i, p);
        _mm512_storeu_ps(b->m + i, _mm512_add_ps(_mm512_loadu_ps(b->m + i), g));
        _mm512_storeu_ps(b->v + i, _mm512_add_ps(_mm512_loadu_ps(b->v + i), g));
        _mm256_stream_si256((__m256i *)(b->w + i),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(p), 16)));
    }
    _mm_sfence();
    bound_avx2(b, i, hi);
}
#endif

static void bound_span(void *ctx, int64_t lo, int64_t hi, int worker) {
    const bound_t *b = (const bound_t *)ctx;
    (void)worker;
#if defined(__x86_64__)
    if (b->isa == ADAMW_AVX512) { bound_avx512(b, lo, hi); return; }
    if (b->isa == ADAMW_AVX2) { bound_avx2(b, lo, hi); return; }
#endif
    for (int64_t i = lo; i < hi; i++) {
        b->p[i] += b->g[i]; b->m[i] += b->g[i]; b->v[i] += b->g[i];
        b->w[i] = (uint16_t)(f2u(b->p[i]) >> 16);
    }
}

int adamw_bound(const float *g, float *p, float *m, float *v, uint16_t *w, int64_t n,
                int threads, int isa) {
    if (n < 0 || threads < 1 || threads > MAX_THREADS) return ADAMW_ERR_ARGS;
    if (!adamw_isa_supported(isa)) return ADAMW_ERR_ISA;
    bound_t b = {g, p, m, v, w, isa};
    if (n > 0) run_parallel(bound_span, &b, n, workers_for(n, threads));
    return ADAMW_OK;
}
