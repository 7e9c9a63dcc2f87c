/*
 * crc32c.c: CRC-32C for megatron_snake's record checksums (API in crc32c.h).
 *
 * crc32c(crc, buf, len) with the SSE4.2 instruction when the CPU has it (three interleaved
 * streams; software slicing-by-8 otherwise). Plain C, no Python: the binding
 * (csrc/snake_aio.c) calls it with the GIL released as the record checksum of the tensor
 * store. Its own file because it shares nothing with the I/O engine.
 */
#include "crc32c.h"

#include <stdint.h>
#include <string.h>

#define CRC_LONG 8192
#define CRC_SHORT 256
static uint32_t crc_table[8][256];
static uint32_t crc_long[4][256], crc_short[4][256];
static void zeros_table(uint32_t zeros[][256], size_t len);
static int have_sse42 = 0;

void crc32c_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
    zeros_table(crc_long, CRC_LONG);
    zeros_table(crc_short, CRC_SHORT);
#if defined(__x86_64__)
    __builtin_cpu_init();
    have_sse42 = __builtin_cpu_supports("sse4.2") != 0;
#endif
}

int crc32c_hw_available(void) { return have_sse42; }

static uint32_t crc32c_sw(uint32_t crc, const unsigned char *p, size_t n) {
    crc = ~crc;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        v ^= crc;
        crc = crc_table[7][v & 0xff] ^ crc_table[6][(v >> 8) & 0xff] ^ crc_table[5][(v >> 16) & 0xff] ^
              crc_table[4][(v >> 24) & 0xff] ^ crc_table[3][(v >> 32) & 0xff] ^
              crc_table[2][(v >> 40) & 0xff] ^ crc_table[1][(v >> 48) & 0xff] ^ crc_table[0][v >> 56];
        p += 8; n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ crc_table[0][(crc ^ *p++) & 0xff];
    return ~crc;
}

/* Three interleaved crc32q streams over blocks of LONG (then SHORT) bytes, combined with
   precomputed "append that many zero bytes" operators: Mark Adler's crc32c hw method. */
static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1) sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

static void zeros_op(uint32_t *even, size_t len) {
    uint32_t odd[32], row = 1;
    odd[0] = 0x82F63B78u;
    for (int n = 1; n < 32; n++) { odd[n] = row; row <<= 1; }
    gf2_square(even, odd);   /* 2 zero bits */
    gf2_square(odd, even);   /* 4 zero bits */
    do {
        gf2_square(even, odd);
        len >>= 1;
        if (len == 0) return;
        gf2_square(odd, even);
        len >>= 1;
    } while (len);
    for (int n = 0; n < 32; n++) even[n] = odd[n];
}

static void zeros_table(uint32_t zeros[][256], size_t len) {
    uint32_t op[32];
    zeros_op(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        zeros[0][n] = gf2_times(op, n);
        zeros[1][n] = gf2_times(op, n << 8);
        zeros[2][n] = gf2_times(op, n << 16);
        zeros[3][n] = gf2_times(op, n << 24);
    }
}

static inline uint32_t crc_shift(uint32_t zeros[][256], uint32_t crc) {
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^
           zeros[3][crc >> 24];
}

#if defined(__x86_64__)
/* One span of 3 x ``block`` bytes as three interleaved streams (the crc32 instruction has a
   3-cycle latency and a 1-cycle throughput), recombined by shifting through ``zeros``, the
   table for ``block`` zero bytes. Always inlined, so each call site is specialised to its
   constant block size. */
__attribute__((target("sse4.2"), always_inline))
static inline uint64_t crc32c_3way(uint64_t crc0, const unsigned char *next, size_t block,
                                   uint32_t zeros[][256]) {
    uint64_t crc1 = 0, crc2 = 0;
    const unsigned char *end = next + block;
    do {
        uint64_t a, b, c;
        memcpy(&a, next, 8);
        memcpy(&b, next + block, 8);
        memcpy(&c, next + 2 * block, 8);
        crc0 = __builtin_ia32_crc32di(crc0, a);
        crc1 = __builtin_ia32_crc32di(crc1, b);
        crc2 = __builtin_ia32_crc32di(crc2, c);
        next += 8;
    } while (next < end);
    crc0 = crc_shift(zeros, (uint32_t)crc0) ^ (uint32_t)crc1;
    return crc_shift(zeros, (uint32_t)crc0) ^ (uint32_t)crc2;
}

__attribute__((target("sse4.2")))
static uint32_t crc32c_hw(uint32_t crc, const unsigned char *next, size_t len) {
    uint64_t crc0 = (uint32_t)~crc;
    while (len && ((uintptr_t)next & 7) != 0) {
        crc0 = __builtin_ia32_crc32qi((uint32_t)crc0, *next++);
        len--;
    }
    while (len >= CRC_LONG * 3) {
        crc0 = crc32c_3way(crc0, next, CRC_LONG, crc_long);
        next += 3 * CRC_LONG;
        len -= 3 * CRC_LONG;
    }
    while (len >= CRC_SHORT * 3) {
        crc0 = crc32c_3way(crc0, next, CRC_SHORT, crc_short);
        next += 3 * CRC_SHORT;
        len -= 3 * CRC_SHORT;
    }
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, next, 8);
        crc0 = __builtin_ia32_crc32di(crc0, v);
        next += 8;
        len -= 8;
    }
    uint32_t c32 = (uint32_t)crc0;
    while (len--) c32 = __builtin_ia32_crc32qi(c32, *next++);
    return ~c32;
}
#endif

uint32_t crc32c(uint32_t crc, const void *buf, size_t len) {
    const unsigned char *p = (const unsigned char *)buf;
#if defined(__x86_64__)
    if (have_sse42) return crc32c_hw(crc, p, len);
#endif
    return crc32c_sw(crc, p, len);
}
