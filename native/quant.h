/*
 * tierstore block-wise quantization kernels: the ABI that tierstore/quant/_native.py binds with ctypes.
 *
 * This header is the one declaration of that ABI. native/quant.c includes it (so the compiler checks the
 * definitions against it) and tests/io/test_native_abi.py checks the bindings against it: every function's
 * argument and result types, every constant (against the Python values it mirrors), and the layout of both
 * job structs as the compiler laid them out (tsq_job_layout, tsq_adamw_job_layout) against the ctypes
 * Structures. Every entry point returns 0, a positive count of blocks that held NaN/Inf, or -errno.
 */
#ifndef TIERSTORE_QUANT_H
#define TIERSTORE_QUANT_H

#include <stdint.h>

/* Scheme ids: the `id` of the built-in records in tierstore/quant/schemes.py (stored in codec headers). */
#define TSQ_INT8 0
#define TSQ_INT4 1
#define TSQ_DYN_SIGNED 2
#define TSQ_DYN_UNSIGNED 3
#define TSQ_DYN_UNSIGNED_BOUNDED 4 /* the unsigned map with other code boundaries in `mids` (quant/dynamic.py) */

/* Element dtype ids (tierstore/quant/layout.py DTYPES) */
#define TSQ_F32 0
#define TSQ_BF16 1
#define TSQ_F16 2

#define TSQ_MAX_BLOCK 8192 /* elements (layout.py MAX_BLOCK); one block of fp32 scratch lives on the stack */

/* One quantize / dequantize call: a whole tensor. */
typedef struct tsq_job {
    int32_t scheme;
    int32_t dtype;       /* of x (quantize input / dequantize output) */
    int64_t n;           /* elements */
    int64_t block;       /* elements per block, even, <= TSQ_MAX_BLOCK */
    void *x;             /* n elements of dtype */
    uint8_t *codes;      /* n bytes (int4: (n + 1) / 2 bytes) */
    float *absmax;       /* ceil(n / block) floats */
    const float *mids;   /* dynamic: sorted code boundaries (midpoints for nearest rounding), last = +inf; the
                          * kernels read only lut (which encodes them), the field keeps the layout */
    const int32_t *lut;  /* dynamic: bucket -> codes below << 16 | boundary's low bits ([Note: two-level LUT]) */
    const float *values; /* dynamic: code (0..255, full byte) -> value in [-1, 1] */
    int32_t lut_shift;   /* bucket = (bits(r) >> lut_shift) - lut_base, clamped to [0, lut_size) */
    int32_t lut_base;
    int32_t lut_size;
    int32_t nthreads;
} tsq_job;

/* One fused 8-bit-state AdamW step ([Note: fused 8-bit step] in quant/states.py): a whole tensor. */
typedef struct tsq_adamw_job {
    int64_t n;           /* elements */
    int64_t block;       /* elements per block, even, <= TSQ_MAX_BLOCK */
    float *param;        /* n fp32, updated in place */
    const float *grad;   /* n fp32 */
    uint8_t *m_codes;    /* n bytes, signed map */
    float *m_absmax;     /* ceil(n / block) */
    uint8_t *v_codes;    /* n bytes, unsigned map */
    float *v_absmax;
    const float *m_mids, *m_values; const int32_t *m_lut;
    const float *v_mids, *v_values; const int32_t *v_lut;
    int32_t lut_shift, m_lut_base, m_lut_size, v_lut_base, v_lut_size;
    int32_t maximize;    /* 1: gradient ascent */
    int32_t lerp_small;  /* |1 - beta1| < 0.5: m += w * (g - m); else m = g - (g - m) * (1 - w), as torch */
    float decay;         /* 1 - lr * weight_decay (decoupled weight decay), rounded to fp32 */
    float w1;            /* 1 - beta1 */
    float one_minus_w1;  /* fp32(1) - fp32(w1), as torch computes it */
    float beta2, w2;     /* beta2 and 1 - beta2 */
    float bc2_sqrt;      /* sqrt(1 - beta2^t) */
    float eps;
    float step_size;     /* lr / (1 - beta1^t) */
    int32_t nthreads;
    int32_t isa;         /* the most the loops may use: -1 what the CPU has, 0 portable C, 1 AVX-512F, 2 AVX-512
                          * VBMI (tests compare the paths byte for byte) */
} tsq_adamw_job;

int tsq_quantize(const tsq_job *j);
int tsq_dequantize(const tsq_job *j);
/* Returns 0, the number of blocks whose new m or v holds NaN/Inf (their codes are unspecified), or -errno. */
int tsq_adamw_step(const tsq_adamw_job *j);
/* sizeof the struct, then the offset and the size of each field in declaration order, into out[0..n); returns
 * the count written, or -EINVAL when n is too small. */
int tsq_job_layout(uint64_t *out, unsigned n);
int tsq_adamw_job_layout(uint64_t *out, unsigned n);

#endif
