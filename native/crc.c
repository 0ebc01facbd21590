/* crc32c of memory, declared in crc.h. Built with gcc and the Python headers alone (the instruction sets are
 * chosen per function with target attributes and picked at load time from what the CPU reports).
 *
 * [Note: crc32c by folding]
 * The crc32c package computes the checksum with the CPU's crc32 instruction, 8 bytes at a time in three
 * interleaved streams: about 13 GiB/s here, about half the CPU a put() or get() spends (docs/io.md).
 * Folding goes faster: a CRC is linear, so a 128-bit slice of the message at distance D bits ahead of a
 * later slice can be replaced by its carry-less product with x^D mod P, added into the later slice, without
 * changing the remainder. Per 64-bit half: lo * k1 ^ hi * k2 ^ next, where, in the reflected bit order the
 * crc32c polynomial P uses here, k1 = reflect(x^(D+32) mod P) << 1 and k2 = reflect(x^(D-32) mod P) << 1
 * (found by checking every candidate exponent against the crc32c package; computed below rather than written
 * as magic numbers). VPCLMULQDQ (AVX-512) does four 128-bit lanes per instruction; the loop keeps four such
 * 64-byte accumulators (256 bytes a round), folds them into one at the end, its four lanes into one, then
 * any 16-byte blocks left, and hands the last 16 bytes to the crc32 instruction, which reduces them to the
 * 32-bit register, and the tail under 16 bytes too. The incoming checksum enters by XOR into the first 4
 * bytes, which is what a CRC register does.
 * Only where the CPU has VPCLMULQDQ: folding 16-byte blocks with plain PCLMULQDQ was as fast as the package
 * on an AMD EPYC (13 GiB/s, PCLMULQDQ's throughput) and half as fast on an Intel Xeon (6.0 vs 11.5 GiB/s),
 * so tierstore.io.checksum uses the crc32c package on such CPUs (and on ARM, where it has the CPU's crc32
 * instruction). The table here is the portable reference the tests compare with.
 */
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "crc.h"

#define POLY_REFLECTED 0x82F63B78u
#define POLY_NORMAL 0x1EDC6F41u

static uint32_t table[8][256]; /* table[k][b]: the register after byte b and k zero bytes */
static int best = TS_CRC_TABLE;
static int impls = 1 << TS_CRC_TABLE;

static uint32_t reflect32(uint32_t v)
{
    uint32_t r = 0;
    for (int i = 0; i < 32; i++)
        r |= ((v >> i) & 1u) << (31 - i);
    return r;
}

/* x^e mod P, normal bit order (P of degree 32) */
static uint32_t xpow_mod(unsigned e)
{
    uint64_t r = 1;
    for (unsigned i = 0; i < e; i++) {
        r <<= 1;
        if (r >> 32)
            r ^= (1ull << 32) | POLY_NORMAL;
    }
    return (uint32_t)r;
}

/* The fold constants for distance d bits: k[0] multiplies the low 64 bits, k[1] the high. */
static void fold_constants(unsigned d, uint64_t k[2])
{
    k[0] = (uint64_t)reflect32(xpow_mod(d + 32)) << 1;
    k[1] = (uint64_t)reflect32(xpow_mod(d - 32)) << 1;
}

static uint64_t k128[2], k256[2], k384[2], k512[2], k2048[2];

static uint32_t crc_table(uint32_t reg, const uint8_t *p, size_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        reg = (reg >> 8) ^ table[0][(reg ^ *p++) & 0xff];
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        w = __builtin_bswap64(w);
#endif
        w ^= reg;
        reg = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^ table[5][(w >> 16) & 0xff] ^
              table[4][(w >> 24) & 0xff] ^ table[3][(w >> 32) & 0xff] ^ table[2][(w >> 40) & 0xff] ^
              table[1][(w >> 48) & 0xff] ^ table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        reg = (reg >> 8) ^ table[0][(reg ^ *p++) & 0xff];
    return reg;
}

#if defined(__x86_64__)
#include <immintrin.h>

#define SSE_TARGET __attribute__((target("sse4.2,pclmul")))
#define AVX512_TARGET __attribute__((target("sse4.2,pclmul,avx2,avx512f,avx512vl,avx512bw,vpclmulqdq")))

SSE_TARGET static uint32_t crc_hw(uint32_t reg, const uint8_t *p, size_t n)
{
    uint64_t r = reg;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        r = _mm_crc32_u64(r, w);
        p += 8;
        n -= 8;
    }
    while (n--)
        r = _mm_crc32_u8((uint32_t)r, *p++);
    return (uint32_t)r;
}

SSE_TARGET static inline __m128i fold16(__m128i x, __m128i k, __m128i next)
{
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), next);
}

/* The 16-byte accumulator x, then 16-byte blocks while there are, then the crc32 instruction. */
SSE_TARGET static uint32_t finish16(__m128i x, const uint8_t *p, size_t n)
{
    const __m128i k = _mm_set_epi64x((long long)k128[1], (long long)k128[0]);
    while (n >= 16) {
        x = fold16(x, k, _mm_loadu_si128((const __m128i *)p));
        p += 16;
        n -= 16;
    }
    uint64_t r = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(x));
    r = _mm_crc32_u64(r, (uint64_t)_mm_extract_epi64(x, 1));
    return crc_hw((uint32_t)r, p, n);
}

AVX512_TARGET static inline __m512i fold64(__m512i x, __m512i k, __m512i next)
{
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11),
                                     next, 0x96); /* a ^ b ^ c */
}

AVX512_TARGET static uint32_t crc_avx512(uint32_t reg, const uint8_t *p, size_t n)
{
    if (n < 512)
        return crc_hw(reg, p, n);
    const __m512i kr = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)k2048[1], (long long)k2048[0]));
    const __m512i k1 = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)k512[1], (long long)k512[0]));
    __m512i x0 = _mm512_xor_si512(_mm512_loadu_si512(p),
                                  _mm512_inserti32x4(_mm512_setzero_si512(), _mm_cvtsi32_si128((int)reg), 0));
    __m512i x1 = _mm512_loadu_si512(p + 64);
    __m512i x2 = _mm512_loadu_si512(p + 128);
    __m512i x3 = _mm512_loadu_si512(p + 192);
    p += 256;
    n -= 256;
    while (n >= 256) {
        x0 = fold64(x0, kr, _mm512_loadu_si512(p));
        x1 = fold64(x1, kr, _mm512_loadu_si512(p + 64));
        x2 = fold64(x2, kr, _mm512_loadu_si512(p + 128));
        x3 = fold64(x3, kr, _mm512_loadu_si512(p + 192));
        p += 256;
        n -= 256;
    }
    x1 = fold64(x0, k1, x1);
    x2 = fold64(x1, k1, x2);
    x3 = fold64(x2, k1, x3);
    while (n >= 64) {
        x3 = fold64(x3, k1, _mm512_loadu_si512(p));
        p += 64;
        n -= 64;
    }
    /* lanes 0, 1, 2 folded onto lane 3 (distances 384, 256, 128 bits); lane 3 kept as it is */
    const __m512i kl = _mm512_set_epi64(0, 0, (long long)k128[1], (long long)k128[0], (long long)k256[1],
                                        (long long)k256[0], (long long)k384[1], (long long)k384[0]);
    __m512i t = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x3, kl, 0x00), _mm512_clmulepi64_epi128(x3, kl, 0x11),
                                          _mm512_maskz_mov_epi64(0xC0, x3), 0x96);
    __m256i h = _mm256_xor_si256(_mm512_castsi512_si256(t), _mm512_extracti64x4_epi64(t, 1));
    __m128i x = _mm_xor_si128(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    return finish16(x, p, n);
}
#endif

uint32_t ts_crc32c_with(int impl, uint32_t crc, const void *data, uint64_t n)
{
    const uint8_t *p = data;
    uint32_t reg = ~crc;
#if defined(__x86_64__)
    if (impl == TS_CRC_AVX512 && (impls >> TS_CRC_AVX512 & 1))
        return ~crc_avx512(reg, p, (size_t)n);
#endif
    (void)impl;
    return ~crc_table(reg, p, (size_t)n);
}

uint32_t ts_crc32c(uint32_t crc, const void *data, uint64_t n) { return ts_crc32c_with(best, crc, data, n); }

int ts_crc32c_impls(void) { return impls; }

int ts_crc32c_best(void) { return best; }

__attribute__((constructor)) static void crc_init(void)
{
    for (unsigned b = 0; b < 256; b++) {
        uint32_t c = b;
        for (int i = 0; i < 8; i++)
            c = (c >> 1) ^ ((c & 1u) ? POLY_REFLECTED : 0u);
        table[0][b] = c;
    }
    for (unsigned k = 1; k < 8; k++)
        for (unsigned b = 0; b < 256; b++)
            table[k][b] = (table[k - 1][b] >> 8) ^ table[0][table[k - 1][b] & 0xff];
    fold_constants(128, k128);
    fold_constants(256, k256);
    fold_constants(384, k384);
    fold_constants(512, k512);
    fold_constants(2048, k2048);
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("vpclmulqdq")) {
        impls |= 1 << TS_CRC_AVX512;
        best = TS_CRC_AVX512;
    }
#endif
}

/* The module is loaded with ctypes; this init only lets the import system find the built file. */
static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT, "_native_crc", "tierstore crc32c (ctypes)", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native_crc(void) { return PyModule_Create(&moddef); }
