/*
 * crc32c.h: CRC-32C (Castagnoli) of a buffer, the record checksum of the tensor store.
 *
 * Plain C, no Python: csrc/crc32c.c holds the software tables and the SSE4.2 path; the
 * CPython binding (csrc/snake_aio.c) calls crc32c() with the GIL released. Kept apart from
 * the I/O engine because it shares nothing with it but the extension module.
 */
#ifndef SNAKE_CRC32C_H
#define SNAKE_CRC32C_H

#include <stddef.h>
#include <stdint.h>

#include "hidden.h"

/* Builds the tables and detects SSE4.2. Call once, before any crc32c() (module init). */
SNAKE_HIDDEN void crc32c_init(void);

/* The CRC-32C of len bytes at buf, continuing from crc (0 to start; the result of one call
   continues over the next buffer). SSE4.2 instruction when available, software otherwise;
   both give the same value. Thread-safe after crc32c_init(). */
SNAKE_HIDDEN uint32_t crc32c(uint32_t crc, const void *buf, size_t len);

/* 1 when crc32c() uses the SSE4.2 instruction, 0 for the software path. */
SNAKE_HIDDEN int crc32c_hw_available(void);

#endif /* SNAKE_CRC32C_H */
