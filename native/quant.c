/*
 * tierstore block-wise quantization kernels (see docs/quant.md and tierstore/quant/).
 *
 * One job describes a whole tensor: n elements cut into blocks of `block` elements (the last block may be
 * partial); each block gets one fp32 absmax and one code per element (int4: two codes per byte, element i in
 * byte i/2, even elements in the low nibble). Blocks are independent, so the work is split over threads by
 * whole blocks and the result does not depend on the thread count ([Note: determinism] in quant/quantized.py).
 *
 * Arithmetic is written so that the torch reference in tierstore/quant reproduces it bit for bit:
 *   linear int8:  inv = 127.0f / absmax; q = rint(x * inv) in [-127, 127];  x^ = q * (absmax / 127.0f)
 *   linear int4:  inv =   7.0f / absmax; q = rint(x * inv) in [-7, 7], stored q + 8; x^ = q * (absmax / 7.0f)
 *   dynamic 8-bit: inv = 1.0f / absmax; r = |x| * inv; code = lut[bucket(r)] + (mids[lut[...]] < r)
 *                  (count of midpoints strictly below r: ties go to the smaller magnitude);  x^ = values[code] * absmax
 *                  (scheme 4, bounded rounding: the same with other boundaries in `mids`)
 * rint is round-half-to-even (the default rounding mode); no expression is contracted into an FMA (pragma below),
 * so every compiled clone gives the same bytes. absmax == 0 gives inv = 0 and all codes zero.
 *
 * Every entry point returns 0, a positive count of blocks that held NaN/Inf (their codes are unspecified: the
 * Python side raises), or -errno.
 */
#pragma GCC optimize("fp-contract=off")
#define _GNU_SOURCE
#include <Python.h> /* only for the empty module init at the bottom */

#include <errno.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define TSQ_INT8 0
#define TSQ_INT4 1
#define TSQ_DYN_SIGNED 2
#define TSQ_DYN_UNSIGNED 3
#define TSQ_DYN_UNSIGNED_BOUNDED 4 /* the unsigned map with other code boundaries in `mids` (quant/dynamic.py) */

#define TSQ_F32 0
#define TSQ_BF16 1
#define TSQ_F16 2

#define TSQ_MAX_BLOCK 8192 /* elements */
#define TSQ_MAX_THREADS 64

/* Mirrored by ctypes in tierstore/quant/_native.py; keep the field order. */
typedef struct {
    int32_t scheme;
    int32_t dtype;       /* of x (quantize input / dequantize output) */
    int64_t n;           /* elements */
    int64_t block;       /* elements per block, even, <= TSQ_MAX_BLOCK */
    void *x;             /* n elements of dtype */
    uint8_t *codes;      /* n bytes (int4: (n + 1) / 2 bytes) */
    float *absmax;       /* ceil(n / block) floats */
    const float *mids;   /* dynamic: sorted code boundaries (midpoints for nearest rounding), last = +inf */
    const int32_t *lut;  /* dynamic: bucket -> magnitude code */
    const float *values; /* dynamic: code (0..255, full byte) -> value in [-1, 1] */
    int32_t lut_shift;   /* bucket = (bits(r) >> lut_shift) - lut_base, clamped to [0, lut_size) */
    int32_t lut_base;
    int32_t lut_size;
    int32_t nthreads;
} tsq_job;

#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

static inline uint32_t f2u(float f)
{
    union { float f; uint32_t u; } v = {.f = f}; /* type punning through a union is defined in GNU C */
    return v.u;
}

static inline float u2f(uint32_t u)
{
    union { uint32_t u; float f; } v = {.u = u};
    return v.f;
}

/* min/max as functions: written as nested ?: in the loop body, gcc 12 refuses to vectorise the gathers */
static inline int32_t imax(int32_t a, int32_t b) { return a > b ? a : b; }
static inline int32_t imin(int32_t a, int32_t b) { return a < b ? a : b; }

/* ---- dtype conversion of one block into / out of an fp32 scratch ------------------------------- */

CLONES static void to_f32(const void *src, int dtype, int64_t len, float *dst)
{
    if (dtype == TSQ_BF16) {
        const uint16_t *s = src;
        for (int64_t i = 0; i < len; i++)
            dst[i] = u2f((uint32_t)s[i] << 16);
    } else { /* TSQ_F16 */
        const _Float16 *s = src;
        for (int64_t i = 0; i < len; i++)
            dst[i] = (float)s[i];
    }
}

CLONES static void from_f32(const float *src, int dtype, int64_t len, void *dst)
{
    if (dtype == TSQ_BF16) {
        /* round to nearest even, as torch does (inputs are finite: dequantized values) */
        uint16_t *d = dst;
        for (int64_t i = 0; i < len; i++) {
            uint32_t u = f2u(src[i]);
            d[i] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
        }
    } else {
        _Float16 *d = dst;
        for (int64_t i = 0; i < len; i++)
            d[i] = (_Float16)src[i];
    }
}

/* ---- per-block kernels ------------------------------------------------------------------------ */

/* absmax of a block; *bad set when it holds NaN or Inf. 16 independent lanes so it vectorises without
 * -ffast-math (max is exact, so the lane split does not change the result). */
CLONES static float block_absmax(const float *x, int64_t len, int *bad)
{
    float acc[16] = {0};
    int32_t nf[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= len; i += 16)
        for (int j = 0; j < 16; j++) {
            float a = fabsf(x[i + j]);
            acc[j] = a > acc[j] ? a : acc[j];
            nf[j] |= !(a <= FLT_MAX);
        }
    for (; i < len; i++) {
        float a = fabsf(x[i]);
        acc[0] = a > acc[0] ? a : acc[0];
        nf[0] |= !(a <= FLT_MAX);
    }
    float m = 0.0f;
    int b = 0;
    for (int j = 0; j < 16; j++) {
        m = acc[j] > m ? acc[j] : m;
        b |= nf[j];
    }
    *bad = b;
    return m;
}

CLONES static void q_int8(const float *x, int64_t len, float inv, uint8_t *out)
{
    for (int64_t i = 0; i < len; i++) {
        float q = rintf(x[i] * inv);
        q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
        out[i] = (uint8_t)(int8_t)(int32_t)q;
    }
}

CLONES static void q_int4(const float *x, int64_t len, float inv, uint8_t *out)
{
    /* len is even except for the very last block of a tensor of odd length */
    int64_t pairs = len / 2;
    for (int64_t i = 0; i < pairs; i++) {
        float a = rintf(x[2 * i] * inv), b = rintf(x[2 * i + 1] * inv);
        a = a > 7.0f ? 7.0f : (a < -7.0f ? -7.0f : a);
        b = b > 7.0f ? 7.0f : (b < -7.0f ? -7.0f : b);
        out[i] = (uint8_t)(((int32_t)a + 8) | (((int32_t)b + 8) << 4));
    }
    if (len & 1) {
        float a = rintf(x[len - 1] * inv);
        a = a > 7.0f ? 7.0f : (a < -7.0f ? -7.0f : a);
        out[pairs] = (uint8_t)((int32_t)a + 8); /* high nibble of the padding half-byte is 0 */
    }
}

/* Dynamic map, one block. lut is int32 (not uint8) so that AVX2/AVX-512 clones can gather from it. */
CLONES static void q_dyn_signed(const int32_t *restrict lut, const float *restrict mids, int32_t shift, int32_t base, int32_t top,
                                const float *restrict x, int64_t len, float inv, uint8_t *restrict out)
{
    for (int64_t i = 0; i < len; i++) {
        float r = fabsf(x[i]) * inv;
        int32_t b = imin(imax((int32_t)(f2u(r) >> shift) - base, 0), top); /* clamp: see the LUT note */
        int32_t c = lut[b];
        c += (int32_t)(mids[c] < r);
        /* sign bit only on nonzero magnitudes: -0.0 never gets its own code */
        c |= ((c != 0) & (x[i] < 0.0f)) << 7;
        out[i] = (uint8_t)c;
    }
}

CLONES static void q_dyn_unsigned(const int32_t *restrict lut, const float *restrict mids, int32_t shift, int32_t base, int32_t top,
                                  const float *restrict x, int64_t len, float inv, uint8_t *restrict out)
{
    for (int64_t i = 0; i < len; i++) {
        float r = fabsf(x[i]) * inv;
        int32_t b = imin(imax((int32_t)(f2u(r) >> shift) - base, 0), top); /* clamp: see the LUT note */
        int32_t c = lut[b];
        c += (int32_t)(mids[c] < r);
        /* [Note: zero-point] in quant/dynamic.py: a nonzero second moment never maps to code 0 */
        c += (c == 0) & (r > 0.0f);
        out[i] = (uint8_t)c;
    }
}

CLONES static void dq_int8(const uint8_t *c, int64_t len, float s, float *out)
{
    for (int64_t i = 0; i < len; i++)
        out[i] = (float)(int8_t)c[i] * s;
}

CLONES static void dq_int4(const uint8_t *c, int64_t len, float s, float *out)
{
    int64_t pairs = len / 2;
    for (int64_t i = 0; i < pairs; i++) {
        out[2 * i] = (float)((int32_t)(c[i] & 15u) - 8) * s;
        out[2 * i + 1] = (float)((int32_t)(c[i] >> 4) - 8) * s;
    }
    if (len & 1)
        out[len - 1] = (float)((int32_t)(c[pairs] & 15u) - 8) * s;
}

CLONES static void dq_dyn(const float *values, const uint8_t *c, int64_t len, float a, float *out)
{
    for (int64_t i = 0; i < len; i++)
        out[i] = values[c[i]] * a;
}

static size_t esize(int dtype) { return dtype == TSQ_F32 ? 4 : 2; }

/* ---- one thread's range of blocks -------------------------------------------------------------- */

typedef struct {
    const tsq_job *job;
    int64_t b0, b1; /* blocks [b0, b1) */
    int bad;        /* blocks with NaN/Inf */
    int quantize;
} tsq_part;

static void run_part(tsq_part *p)
{
    const tsq_job *j = p->job;
    float scratch[TSQ_MAX_BLOCK] __attribute__((aligned(64)));
    const size_t es = esize(j->dtype);
    for (int64_t b = p->b0; b < p->b1; b++) {
        int64_t start = b * j->block;
        int64_t len = j->n - start < j->block ? j->n - start : j->block;
        char *xb = (char *)j->x + start * (int64_t)es;
        uint8_t *cb = j->codes + (j->scheme == TSQ_INT4 ? start / 2 : start);
        if (p->quantize) {
            const float *xf = (const float *)xb;
            if (j->dtype != TSQ_F32) {
                to_f32(xb, j->dtype, len, scratch);
                xf = scratch;
            }
            int bad = 0;
            float a = block_absmax(xf, len, &bad);
            p->bad += bad;
            j->absmax[b] = a;
            switch (j->scheme) {
            case TSQ_INT8:
                q_int8(xf, len, a > 0.0f ? 127.0f / a : 0.0f, cb);
                break;
            case TSQ_INT4:
                q_int4(xf, len, a > 0.0f ? 7.0f / a : 0.0f, cb);
                break;
            case TSQ_DYN_SIGNED:
                q_dyn_signed(j->lut, j->mids, j->lut_shift, j->lut_base, j->lut_size - 1, xf, len,
                             a > 0.0f ? 1.0f / a : 0.0f, cb);
                break;
            default:
                q_dyn_unsigned(j->lut, j->mids, j->lut_shift, j->lut_base, j->lut_size - 1, xf, len,
                               a > 0.0f ? 1.0f / a : 0.0f, cb);
            }
        } else {
            float a = j->absmax[b];
            float *of = j->dtype == TSQ_F32 ? (float *)xb : scratch;
            switch (j->scheme) {
            case TSQ_INT8:
                dq_int8(cb, len, a / 127.0f, of);
                break;
            case TSQ_INT4:
                dq_int4(cb, len, a / 7.0f, of);
                break;
            default:
                dq_dyn(j->values, cb, len, a, of);
            }
            if (j->dtype != TSQ_F32)
                from_f32(scratch, j->dtype, len, xb);
        }
    }
}

static void *thread_main(void *arg)
{
    run_part(arg);
    return NULL;
}

static int run(const tsq_job *j, int quantize)
{
    if (j->n < 0 || j->block < 2 || j->block > TSQ_MAX_BLOCK || (j->block & 1) || j->scheme < 0 || j->scheme > 4 ||
        j->dtype < 0 || j->dtype > 2)
        return -EINVAL;
    if (j->n == 0)
        return 0;
    if (j->scheme >= TSQ_DYN_SIGNED && (!j->lut || !j->mids || !j->values || j->lut_size < 1))
        return -EINVAL;
    int64_t nblocks = (j->n + j->block - 1) / j->block;
    int64_t t = j->nthreads < 1 ? 1 : (j->nthreads > TSQ_MAX_THREADS ? TSQ_MAX_THREADS : j->nthreads);
    if (t > nblocks)
        t = nblocks;
    tsq_part parts[TSQ_MAX_THREADS];
    pthread_t tids[TSQ_MAX_THREADS];
    int started[TSQ_MAX_THREADS] = {0};
    for (int64_t i = 0; i < t; i++) {
        parts[i] = (tsq_part){.job = j, .b0 = nblocks * i / t, .b1 = nblocks * (i + 1) / t, .quantize = quantize};
    }
    for (int64_t i = 1; i < t; i++)
        started[i] = pthread_create(&tids[i], NULL, thread_main, &parts[i]) == 0;
    run_part(&parts[0]);
    int bad = parts[0].bad;
    for (int64_t i = 1; i < t; i++) {
        if (started[i])
            pthread_join(tids[i], NULL);
        else
            run_part(&parts[i]); /* could not start a thread: do its share here */
        bad += parts[i].bad;
    }
    return bad;
}

int tsq_quantize(const tsq_job *j) { return run(j, 1); }

int tsq_dequantize(const tsq_job *j) { return run(j, 0); }

/* The module is loaded with ctypes; this init only lets the import system find the built file. */
static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_native_quant", "tierstore quantization kernels (ctypes)",
                                    -1, NULL};

PyMODINIT_FUNC PyInit__native_quant(void) { return PyModule_Create(&moddef); }
