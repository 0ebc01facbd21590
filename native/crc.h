/* crc32c (Castagnoli) of memory: the checksum of every extent, block and checkpoint record.
 *
 * The same function as the crc32c package's crc32c(data, value): `crc` is the checksum of the bytes before
 * (0 to start), the result the checksum of those and `n` more. Implementations, picked once per process by
 * what the CPU has (ts_crc32c_impls): folding 64-byte blocks with VPCLMULQDQ (AVX-512), and a table (any CPU).
 * Both give the same value; tests hold them equal to the crc32c package's on random data, lengths and
 * alignments.
 */
#ifndef TIERSTORE_CRC_H
#define TIERSTORE_CRC_H

#include <stdint.h>

#define TS_CRC_TABLE 0  /* slicing-by-8 tables: any CPU */
#define TS_CRC_AVX512 1 /* x86-64 with SSE4.2, AVX-512 (F, VL, BW) and VPCLMULQDQ */

/* crc32c of n bytes at data, continuing from crc, with the fastest implementation this CPU runs. */
uint32_t ts_crc32c(uint32_t crc, const void *data, uint64_t n);

/* The same with implementation `impl` (TS_CRC_*), for tests and benchmarks; one this CPU does not run
 * (not in ts_crc32c_impls()) falls back to the table. */
uint32_t ts_crc32c_with(int impl, uint32_t crc, const void *data, uint64_t n);

/* Bit mask of the implementations this CPU runs (bit TS_CRC_x set), and the one ts_crc32c uses. */
int ts_crc32c_impls(void);
int ts_crc32c_best(void);

#endif
