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
 *   dynamic 8-bit: inv = 1.0f / absmax; r = |x| * inv; code = number of code boundaries (mids) below r, found
 *                  with one lookup of a packed LUT entry and one integer comparison
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
#include <immintrin.h> /* _mm_sqrt_ps (SSE, baseline x86-64) */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stddef.h> /* offsetof */
#include <stdint.h>
#include <string.h>

#include "quant.h" /* the ABI: constants, job structs, entry points */

#define TSQ_MAX_THREADS 64

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

/* absmax of a block; *bad set when it holds NaN or Inf. On the bit patterns: for |x| (sign bit cleared) the
 * unsigned integer order is the float order, with Inf and NaN above every finite value, so an integer max
 * (which vectorises without -ffast-math) gives the exact float max and flags NaN/Inf at once. */
CLONES static float block_absmax(const float *restrict x, int64_t len, int *bad)
{
    uint32_t m = 0;
    for (int64_t i = 0; i < len; i++) {
        uint32_t a = f2u(x[i]) & 0x7FFFFFFFu; /* bit cast through a union: no strict-aliasing question */
        m = a > m ? a : m;
    }
    *bad = m >= 0x7F800000u;
    return u2f(m);
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

/* Dynamic map, one block. lut is int32 (not uint8) so that AVX2/AVX-512 clones can gather from it; each entry
 * is (codes below the bucket) << 16 | (low 15 bits of the boundary inside it, 0x7FFF if none): [Note: two-level
 * LUT] in quant/dynamic.py. One gather per element. */
static inline int32_t dyn_code(const int32_t *restrict lut, int32_t shift, int32_t base, int32_t top, float r)
{
    uint32_t u = f2u(r);
    int32_t b = imin(imax((int32_t)(u >> shift) - base, 0), top); /* clamp: see the LUT note */
    int32_t e = lut[b];
    return (e >> 16) + (int32_t)((int32_t)(u & ((1u << shift) - 1u)) > (e & 0xFFFF));
}

CLONES static void q_dyn_signed(const int32_t *restrict lut, int32_t shift, int32_t base, int32_t top,
                                const float *restrict x, int64_t len, float inv, uint8_t *restrict out)
{
    for (int64_t i = 0; i < len; i++) {
        float r = fabsf(x[i]) * inv;
        int32_t c = dyn_code(lut, shift, base, top, r);
        /* sign bit only on nonzero magnitudes: -0.0 never gets its own code */
        c |= ((c != 0) & (x[i] < 0.0f)) << 7;
        out[i] = (uint8_t)c;
    }
}

CLONES static void q_dyn_unsigned(const int32_t *restrict lut, int32_t shift, int32_t base, int32_t top,
                                  const float *restrict x, int64_t len, float inv, uint8_t *restrict out)
{
    for (int64_t i = 0; i < len; i++) {
        float r = fabsf(x[i]) * inv;
        int32_t c = dyn_code(lut, shift, base, top, r);
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

CLONES static void dq_dyn(const float *restrict values, const uint8_t *restrict c, int64_t len, float a,
                          float *restrict out)
{
    for (int64_t i = 0; i < len; i++)
        out[i] = values[c[i]] * a;
}

static size_t esize(int dtype) { return dtype == TSQ_F32 ? 4 : 2; }

/* ---- whole blocks over threads ---------------------------------------------------------------- */

/* One thread's share of a job: blocks [b0, b1). */
typedef struct tsq_share tsq_share;
typedef void (*tsq_share_fn)(tsq_share *);
struct tsq_share {
    tsq_share_fn fn;
    const void *job; /* tsq_job or tsq_adamw_job, as fn expects */
    int64_t b0, b1;  /* blocks */
    int quantize;    /* quantize/dequantize shares only */
    int bad;         /* blocks whose result holds NaN/Inf */
};

static void *share_thread(void *arg)
{
    tsq_share *sh = arg;
    sh->fn(sh);
    return NULL;
}

/* Split blocks [0, nblocks) into contiguous shares, one per thread (at most `nthreads`, TSQ_MAX_THREADS and
 * nblocks). The calling thread runs the first share, and the share of any thread that could not start.
 * Whole blocks per share, so the bytes never depend on the thread count. Returns the summed `bad`. */
static int run_shares(tsq_share_fn fn, const void *job, int quantize, int64_t nblocks, int64_t nthreads)
{
    int64_t t = nthreads < 1 ? 1 : (nthreads > TSQ_MAX_THREADS ? TSQ_MAX_THREADS : nthreads);
    if (t > nblocks)
        t = nblocks;
    tsq_share parts[TSQ_MAX_THREADS];
    pthread_t tids[TSQ_MAX_THREADS];
    int started[TSQ_MAX_THREADS] = {0};
    for (int64_t i = 0; i < t; i++)
        parts[i] = (tsq_share){.fn = fn, .job = job, .b0 = nblocks * i / t, .b1 = nblocks * (i + 1) / t,
                               .quantize = quantize};
    for (int64_t i = 1; i < t; i++)
        started[i] = pthread_create(&tids[i], NULL, share_thread, &parts[i]) == 0;
    fn(&parts[0]);
    int bad = parts[0].bad;
    for (int64_t i = 1; i < t; i++) {
        if (started[i])
            pthread_join(tids[i], NULL);
        else
            fn(&parts[i]);
        bad += parts[i].bad;
    }
    return bad;
}

/* ---- one share of a quantize / dequantize job ------------------------------------------------ */

static void run_part(tsq_share *p)
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
                q_dyn_signed(j->lut, j->lut_shift, j->lut_base, j->lut_size - 1, xf, len,
                             a > 0.0f ? 1.0f / a : 0.0f, cb);
                break;
            default:
                q_dyn_unsigned(j->lut, j->lut_shift, j->lut_base, j->lut_size - 1, xf, len,
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

static int run(const tsq_job *j, int quantize)
{
    if (j->n < 0 || j->block < 2 || j->block > TSQ_MAX_BLOCK || (j->block & 1) || j->scheme < 0 ||
        j->scheme > TSQ_DYN_UNSIGNED_BOUNDED || j->dtype < 0 || j->dtype > TSQ_F16)
        return -EINVAL;
    if (j->n == 0)
        return 0;
    if (j->scheme >= TSQ_DYN_SIGNED && (!j->lut || !j->mids || !j->values || j->lut_size < 1))
        return -EINVAL;
    return run_shares(run_part, j, quantize, (j->n + j->block - 1) / j->block, j->nthreads);
}

/* ---- fused 8-bit-state AdamW step ------------------------------------------------------------ *
 * [Note: fused 8-bit step] in quant/states.py. Per block: decode m (signed map) and v (unsigned map) into
 * fp32 scratch, run the AdamW update on param, m and v (torch's fused CPU AdamW arithmetic, element by element,
 * in the order of its scalar path), then take the new absmax of m and v and encode them. One pass over memory:
 * the fp32 states never leave the block's scratch. Threads take whole blocks, so the bytes do not depend on
 * the thread count; no FMA contraction (pragma at the top), so every clone gives the same bytes. The job
 * struct, tsq_adamw_job, is in quant.h. */

/* Correctly rounded square roots of a block. With errno semantics (the default; setup.py sets no -fno-math-errno
 * and an optimize pragma does not reach the builtin), gcc will not vectorise sqrtf, so this uses SSE sqrtps,
 * part of baseline x86-64 and IEEE-exact like sqrtf: every clone gives the same bits. */
CLONES static void block_sqrt(const float *restrict x, int64_t len, float *restrict out)
{
    int64_t i = 0;
    for (; i + 4 <= len; i += 4)
        _mm_storeu_ps(out + i, _mm_sqrt_ps(_mm_loadu_ps(x + i)));
    for (; i < len; i++)
        out[i] = sqrtf(x[i]);
}

/* block_sqrt with 16 lanes (vsqrtps zmm is IEEE-exact as sqrtps: the same bits); tails go to block_sqrt. */
__attribute__((target("avx512f"))) static int64_t block_sqrt_avx512(const float *restrict x, int64_t len,
                                                                   float *restrict out)
{
    int64_t i = 0;
    for (; i + 16 <= len; i += 16)
        _mm512_storeu_ps(out + i, _mm512_sqrt_ps(_mm512_loadu_ps(x + i)));
    return i;
}

/* One block, in three loops: (1) adamw_update: decode m and v, update p, m and v, and take the new absmaxes
 * (integer max on the bit patterns, as block_absmax); (2) block_sqrt; (3) adamw_finish: finish p and encode m
 * and v with the new absmaxes. (1) and (3) vectorise (every array is a restrict parameter: gcc does not trust
 * restrict on locals); the fp32 m and v live only in the caller's stack scratch. */
CLONES static void adamw_update(const tsq_adamw_job *j, int64_t len, float *restrict p, const float *restrict g,
                                const uint8_t *restrict mc, const uint8_t *restrict vc,
                                const float *restrict mvals, const float *restrict vvals, float am_old, float av_old,
                                float *restrict m, float *restrict v, uint32_t *mmax_out, uint32_t *vmax_out)
{
    const float decay = j->decay, w1 = j->w1, omw1 = j->one_minus_w1, beta2 = j->beta2, w2 = j->w2;
    const float sign = j->maximize ? -1.0f : 1.0f;
    const int lerp_small = j->lerp_small;
    uint32_t mmax = 0, vmax = 0;
    for (int64_t i = 0; i < len; i++) {
        float mi = mvals[mc[i]] * am_old; /* = dq_dyn */
        float vi = vvals[vc[i]] * av_old;
        float gi = g[i] * sign;
        p[i] = p[i] * decay;                                   /* decoupled weight decay, before the update */
        mi = lerp_small ? mi + w1 * (gi - mi) : gi - (gi - mi) * omw1; /* torch: exp_avg.lerp_(grad, 1 - beta1) */
        vi = vi * beta2;
        vi = vi + w2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        uint32_t ma = f2u(mi) & 0x7FFFFFFFu, va = f2u(vi) & 0x7FFFFFFFu;
        mmax = ma > mmax ? ma : mmax;
        vmax = va > vmax ? va : vmax;
    }
    *mmax_out = mmax;
    *vmax_out = vmax;
}

CLONES static void adamw_finish(const tsq_adamw_job *j, int64_t len, float *restrict p, const float *restrict m,
                                const float *restrict v, const float *restrict sq, const int32_t *restrict mlut,
                                const int32_t *restrict vlut, float minv, float vinv, uint8_t *restrict mc,
                                uint8_t *restrict vc)
{
    const float bc2 = j->bc2_sqrt, eps = j->eps, ss = j->step_size;
    const int32_t shift = j->lut_shift;
    const int32_t mbase = j->m_lut_base, mtop = j->m_lut_size - 1, vbase = j->v_lut_base, vtop = j->v_lut_size - 1;
    for (int64_t i = 0; i < len; i++) {
        float denom = sq[i] / bc2 + eps;                       /* eps after the bias-corrected sqrt, as torch */
        p[i] = p[i] - ss * m[i] / denom;
        /* = q_dyn_signed / q_dyn_unsigned */
        int32_t c = dyn_code(mlut, shift, mbase, mtop, fabsf(m[i]) * minv);
        c |= ((c != 0) & (m[i] < 0.0f)) << 7;
        mc[i] = (uint8_t)c;
        float r = fabsf(v[i]) * vinv;
        int32_t d = dyn_code(vlut, shift, vbase, vtop, r);
        d += (d == 0) & (r > 0.0f);
        vc[i] = (uint8_t)d;
    }
}

/* [Note: AVX-512 loops] gcc 12 as shipped here emulates table lookups (vals[c[i]], lut[b]) with scalar loads
 * (its x86 tunings no longer emit gathers), which made the lookups half of the fused step. These two functions
 * are adamw_update / adamw_finish written with AVX-512F intrinsics: the same IEEE operations in the same order
 * (no FMA: fp-contract is off, and no fmadd intrinsic is used), explicit gathers for the lookups, so the bytes
 * are those of the portable loops (a test runs both). Used when the CPU has AVX-512F; tails go to the C loops. */
#define AVX512_UPDATE_ARGS                                                                                   \
    const tsq_adamw_job *j, int64_t len, float *restrict p, const float *restrict g, const uint8_t *restrict mc,     \
        const uint8_t *restrict vc, const float *restrict mvals, const float *restrict vvals,                      \
        const uint8_t *restrict planes, float am_old, float av_old, float *restrict m, float *restrict v,          \
        uint32_t *mmax_out, uint32_t *vmax_out

/* The update of 16 elements whose decoded (unscaled) m and v are mi, vi; shared by the two loops below. */
#define AVX512_UPDATE_16(i, mdec, vdec)                                                                           \
    do {                                                                                                        \
        __m512 mi = _mm512_mul_ps((mdec), am), vi = _mm512_mul_ps((vdec), av);                                  \
        __m512 gi = _mm512_mul_ps(_mm512_loadu_ps(g + (i)), sign);                                              \
        _mm512_storeu_ps(p + (i), _mm512_mul_ps(_mm512_loadu_ps(p + (i)), decay));                              \
        mi = lerp_small ? _mm512_add_ps(mi, _mm512_mul_ps(w1, _mm512_sub_ps(gi, mi)))                           \
                        : _mm512_sub_ps(gi, _mm512_mul_ps(_mm512_sub_ps(gi, mi), omw1));                        \
        vi = _mm512_mul_ps(vi, beta2);                                                                          \
        vi = _mm512_add_ps(vi, _mm512_mul_ps(_mm512_mul_ps(w2, gi), gi));                                       \
        _mm512_storeu_ps(m + (i), mi);                                                                          \
        _mm512_storeu_ps(v + (i), vi);                                                                          \
        mmax = _mm512_max_epu32(mmax, _mm512_and_si512(_mm512_castps_si512(mi), absmask));                      \
        vmax = _mm512_max_epu32(vmax, _mm512_and_si512(_mm512_castps_si512(vi), absmask));                      \
    } while (0)

#define AVX512_UPDATE_CONSTANTS                                                                                   \
    const __m512 decay = _mm512_set1_ps(j->decay), w1 = _mm512_set1_ps(j->w1),                                   \
                 omw1 = _mm512_set1_ps(j->one_minus_w1);                                                        \
    const __m512 beta2 = _mm512_set1_ps(j->beta2), w2 = _mm512_set1_ps(j->w2);                                  \
    const __m512 sign = _mm512_set1_ps(j->maximize ? -1.0f : 1.0f);                                            \
    const __m512 am = _mm512_set1_ps(am_old), av = _mm512_set1_ps(av_old);                                      \
    const __m512i absmask = _mm512_set1_epi32(0x7FFFFFFF);                                                      \
    const int lerp_small = j->lerp_small;                                                                       \
    __m512i mmax = _mm512_setzero_si512(), vmax = _mm512_setzero_si512()

__attribute__((target("avx512f"))) static int64_t adamw_update_avx512(AVX512_UPDATE_ARGS)
{
    AVX512_UPDATE_CONSTANTS;
    (void)planes;
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        __m512i ci = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(mc + i)));
        __m512i di = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(vc + i)));
        AVX512_UPDATE_16(i, _mm512_i32gather_ps(ci, mvals, 4), _mm512_i32gather_ps(di, vvals, 4));
    }
    *mmax_out = _mm512_reduce_max_epu32(mmax);
    *vmax_out = _mm512_reduce_max_epu32(vmax);
    return i;
}

/* [Note: byte-plane decode] AVX-512 gathers cost about one cycle per element on the CPUs here, and the update
 * has two per element. With AVX512-VBMI a 256-entry float table is four 256-byte planes (byte k of every value),
 * and vpermi2b looks up 64 bytes in a 128-byte table at once: per plane two lookups (low and high half of the
 * codes) and a blend on bit 7, then byte and word unpacks rebuild the 64 floats. The unpacks work inside
 * 128-bit lanes, so the codes are first permuted (lane and quarter swapped) so that the four results come out
 * in element order. Same floats as the gathers: exact. planes: 4 x 256 bytes per table, m then v
 * (byte_planes()). */
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) static inline void decode64(const uint8_t *restrict pl,
                                                                                   __m512i codes, __m512 out[4])
{
    /* element 16q + 4L + t goes to byte 16L + 4q + t (L, q, t in 0..3) */
    const __m512i order = _mm512_set_epi8(63, 62, 61, 60, 47, 46, 45, 44, 31, 30, 29, 28, 15, 14, 13, 12,
                                          59, 58, 57, 56, 43, 42, 41, 40, 27, 26, 25, 24, 11, 10, 9, 8,
                                          55, 54, 53, 52, 39, 38, 37, 36, 23, 22, 21, 20, 7, 6, 5, 4,
                                          51, 50, 49, 48, 35, 34, 33, 32, 19, 18, 17, 16, 3, 2, 1, 0);
    __m512i c = _mm512_permutexvar_epi8(order, codes);
    __mmask64 high = _mm512_movepi8_mask(c);
    __m512i b[4];
    for (int k = 0; k < 4; k++) {
        const uint8_t *t = pl + 256 * k;
        __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(t), c, _mm512_load_si512(t + 64));
        __m512i hi = _mm512_permutex2var_epi8(_mm512_load_si512(t + 128), c, _mm512_load_si512(t + 192));
        b[k] = _mm512_mask_blend_epi8(high, lo, hi);
    }
    __m512i w0 = _mm512_unpacklo_epi8(b[0], b[1]), w1 = _mm512_unpackhi_epi8(b[0], b[1]);
    __m512i x0 = _mm512_unpacklo_epi8(b[2], b[3]), x1 = _mm512_unpackhi_epi8(b[2], b[3]);
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w0, x0));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w0, x0));
    out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w1, x1));
    out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w1, x1));
}

/* adamw_update_avx512 with the lookups of decode64, 64 elements at a time; tails go to the gather loop. */
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) static int64_t adamw_update_vbmi(AVX512_UPDATE_ARGS)
{
    AVX512_UPDATE_CONSTANTS;
    int64_t i = 0;
    for (; i + 64 <= len; i += 64) {
        __m512 md[4], vd[4];
        decode64(planes, _mm512_loadu_si512(mc + i), md);
        decode64(planes + 1024, _mm512_loadu_si512(vc + i), vd);
        for (int q = 0; q < 4; q++)
            AVX512_UPDATE_16(i + 16 * q, md[q], vd[q]);
    }
    uint32_t mm2, vm2;
    i += adamw_update_avx512(j, len - i, p + i, g + i, mc + i, vc + i, mvals, vvals, planes, am_old, av_old,
                             m + i, v + i, &mm2, &vm2);
    uint32_t mm1 = _mm512_reduce_max_epu32(mmax), vm1 = _mm512_reduce_max_epu32(vmax);
    *mmax_out = mm1 > mm2 ? mm1 : mm2;
    *vmax_out = vm1 > vm2 ? vm1 : vm2;
    return i;
}

/* Byte k of every value of the m table, then of the v table: the planes decode64 looks up. */
static void byte_planes(const float *mvals, const float *vvals, uint8_t *planes)
{
    for (int t = 0; t < 2; t++)
        for (int c = 0; c < 256; c++) {
            uint32_t u = f2u((t ? vvals : mvals)[c]);
            for (int k = 0; k < 4; k++)
                planes[1024 * t + 256 * k + c] = (uint8_t)(u >> (8 * k));
        }
}

__attribute__((target("avx512f"))) static inline __m512i dyn_code_avx512(const int32_t *lut, __m512i shift,
                                                                         __m512i base, __m512i top, __m512 r)
{
    __m512i u = _mm512_castps_si512(r);
    __m512i b = _mm512_min_epi32(_mm512_max_epi32(_mm512_sub_epi32(_mm512_srlv_epi32(u, shift), base),
                                                  _mm512_setzero_si512()), top);
    __m512i e = _mm512_i32gather_epi32(b, lut, 4);
    __m512i lowmask = _mm512_sub_epi32(_mm512_sllv_epi32(_mm512_set1_epi32(1), shift), _mm512_set1_epi32(1));
    __mmask16 up = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, lowmask),
                                           _mm512_and_si512(e, _mm512_set1_epi32(0xFFFF)));
    return _mm512_mask_add_epi32(_mm512_srai_epi32(e, 16), up, _mm512_srai_epi32(e, 16), _mm512_set1_epi32(1));
}

__attribute__((target("avx512f"))) static int64_t adamw_finish_avx512(
    const tsq_adamw_job *j, int64_t len, float *restrict p, const float *restrict m, const float *restrict v,
    const float *restrict sq, const int32_t *restrict mlut, const int32_t *restrict vlut, float minv, float vinv,
    uint8_t *restrict mc, uint8_t *restrict vc)
{
    const __m512 bc2 = _mm512_set1_ps(j->bc2_sqrt), eps = _mm512_set1_ps(j->eps), ss = _mm512_set1_ps(j->step_size);
    const __m512 mi_inv = _mm512_set1_ps(minv), vi_inv = _mm512_set1_ps(vinv), zero = _mm512_setzero_ps();
    const __m512i shift = _mm512_set1_epi32(j->lut_shift);
    const __m512i mbase = _mm512_set1_epi32(j->m_lut_base), mtop = _mm512_set1_epi32(j->m_lut_size - 1);
    const __m512i vbase = _mm512_set1_epi32(j->v_lut_base), vtop = _mm512_set1_epi32(j->v_lut_size - 1);
    const __m512i absmask = _mm512_set1_epi32(0x7FFFFFFF), zi = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        __m512 mi = _mm512_loadu_ps(m + i), vi = _mm512_loadu_ps(v + i);
        __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_loadu_ps(sq + i), bc2), eps);
        _mm512_storeu_ps(p + i, _mm512_sub_ps(_mm512_loadu_ps(p + i), _mm512_div_ps(_mm512_mul_ps(ss, mi), denom)));
        __m512 r = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(mi), absmask)), mi_inv);
        __m512i c = dyn_code_avx512(mlut, shift, mbase, mtop, r);
        __mmask16 neg = _mm512_cmp_epi32_mask(c, zi, _MM_CMPINT_NE) & _mm512_cmp_ps_mask(mi, zero, _CMP_LT_OQ);
        c = _mm512_mask_or_epi32(c, neg, c, _mm512_set1_epi32(128));
        _mm_storeu_si128((__m128i *)(mc + i), _mm512_cvtepi32_epi8(c));
        __m512 rv = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(vi), absmask)), vi_inv);
        __m512i d = dyn_code_avx512(vlut, shift, vbase, vtop, rv);
        __mmask16 zp = _mm512_cmp_epi32_mask(d, zi, _MM_CMPINT_EQ) & _mm512_cmp_ps_mask(rv, zero, _CMP_GT_OQ);
        d = _mm512_mask_add_epi32(d, zp, d, _mm512_set1_epi32(1));
        _mm_storeu_si128((__m128i *)(vc + i), _mm512_cvtepi32_epi8(d));
    }
    return i;
}

/* What the CPU allows: 0 portable loops only; 1 AVX-512F (gathers); 2 AVX-512F with BW and VBMI ([Note: byte-plane
 * decode]) */
static int avx512_level(void)
{
    static int cached = -1; /* racy but idempotent: every thread computes the same value */
    if (cached < 0) {
        __builtin_cpu_init(); /* idempotent; needed if called before libgcc's constructor ran */
        /* libgcc also checks that the OS saves zmm state */
        cached = !__builtin_cpu_supports("avx512f") ? 0
                 : __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi") ? 2 : 1;
    }
    return cached;
}

/* Returns whether the new m or v of block b holds NaN/Inf. planes: byte_planes() where level is 2. */
static int adamw_block(const tsq_adamw_job *j, int level, const uint8_t *planes, int64_t b, int64_t len, float *m,
                       float *v, float *sq)
{
    const int64_t start = b * j->block;
    float *p = j->param + start;
    const float *g = j->grad + start;
    uint8_t *mc = j->m_codes + start, *vc = j->v_codes + start;
    const float am_old = j->m_absmax[b], av_old = j->v_absmax[b];
    uint32_t mmax = 0, vmax = 0, mmax2 = 0, vmax2 = 0;
    int64_t k = 0;
    if (level)
        k = (level == 2 ? adamw_update_vbmi : adamw_update_avx512)(j, len, p, g, mc, vc, j->m_values, j->v_values,
                                                                   planes, am_old, av_old, m, v, &mmax, &vmax);
    adamw_update(j, len - k, p + k, g + k, mc + k, vc + k, j->m_values, j->v_values, am_old, av_old, m + k, v + k,
                 &mmax2, &vmax2);
    mmax = mmax2 > mmax ? mmax2 : mmax;
    vmax = vmax2 > vmax ? vmax2 : vmax;
    k = level ? block_sqrt_avx512(v, len, sq) : 0;
    block_sqrt(v + k, len - k, sq + k);
    const float am = u2f(mmax), av = u2f(vmax);
    const float minv = am > 0.0f ? 1.0f / am : 0.0f, vinv = av > 0.0f ? 1.0f / av : 0.0f;
    k = level ? adamw_finish_avx512(j, len, p, m, v, sq, j->m_lut, j->v_lut, minv, vinv, mc, vc) : 0;
    adamw_finish(j, len - k, p + k, m + k, v + k, sq + k, j->m_lut, j->v_lut, minv, vinv, mc + k, vc + k);
    j->m_absmax[b] = am;
    j->v_absmax[b] = av;
    return mmax >= 0x7F800000u || vmax >= 0x7F800000u;
}

static void adamw_part(tsq_share *pt)
{
    const tsq_adamw_job *j = pt->job;
    float ms[TSQ_MAX_BLOCK] __attribute__((aligned(64)));
    float vs[TSQ_MAX_BLOCK] __attribute__((aligned(64)));
    float sq[TSQ_MAX_BLOCK] __attribute__((aligned(64)));
    uint8_t planes[2048] __attribute__((aligned(64)));
    const int level = j->isa >= 0 && j->isa < avx512_level() ? j->isa : avx512_level();
    if (level == 2)
        byte_planes(j->m_values, j->v_values, planes);
    for (int64_t b = pt->b0; b < pt->b1; b++) {
        int64_t start = b * j->block;
        int64_t len = j->n - start < j->block ? j->n - start : j->block;
        pt->bad += adamw_block(j, level, planes, b, len, ms, vs, sq);
    }
}

/* Returns 0, the number of blocks whose new m or v holds NaN/Inf (their codes are unspecified), or -errno. */
int tsq_adamw_step(const tsq_adamw_job *j)
{
    if (j->n < 0 || j->block < 2 || j->block > TSQ_MAX_BLOCK || (j->block & 1) || !j->param || !j->grad ||
        !j->m_codes || !j->v_codes || !j->m_absmax || !j->v_absmax || !j->m_lut || !j->v_lut || !j->m_mids ||
        !j->v_mids || !j->m_values || !j->v_values || j->m_lut_size < 1 || j->v_lut_size < 1)
        return -EINVAL;
    if (j->n == 0)
        return 0;
    return run_shares(adamw_part, j, 0, (j->n + j->block - 1) / j->block, j->nthreads);
}

int tsq_quantize(const tsq_job *j) { return run(j, 1); }

int tsq_dequantize(const tsq_job *j) { return run(j, 0); }

/* out = {sizeof, then (offset, size) of each field in declaration order}; see quant.h. */
#define FIELD(T, f) offsetof(T, f), sizeof(((T *)0)->f)

static int put_layout(const uint64_t *layout, unsigned count, uint64_t *out, unsigned n)
{
    if (!out || n < count)
        return -EINVAL;
    memcpy(out, layout, count * sizeof(*layout));
    return (int)count;
}

int tsq_job_layout(uint64_t *out, unsigned n)
{
    const uint64_t layout[] = {
        sizeof(tsq_job), FIELD(tsq_job, scheme), FIELD(tsq_job, dtype), FIELD(tsq_job, n), FIELD(tsq_job, block),
        FIELD(tsq_job, x), FIELD(tsq_job, codes), FIELD(tsq_job, absmax), FIELD(tsq_job, mids), FIELD(tsq_job, lut),
        FIELD(tsq_job, values), FIELD(tsq_job, lut_shift), FIELD(tsq_job, lut_base), FIELD(tsq_job, lut_size),
        FIELD(tsq_job, nthreads),
    };
    return put_layout(layout, sizeof(layout) / sizeof(layout[0]), out, n);
}

int tsq_adamw_job_layout(uint64_t *out, unsigned n)
{
#define A(f) FIELD(tsq_adamw_job, f)
    const uint64_t layout[] = {
        sizeof(tsq_adamw_job), A(n), A(block), A(param), A(grad), A(m_codes), A(m_absmax), A(v_codes), A(v_absmax),
        A(m_mids), A(m_values), A(m_lut), A(v_mids), A(v_values), A(v_lut), A(lut_shift), A(m_lut_base),
        A(m_lut_size), A(v_lut_base), A(v_lut_size), A(maximize), A(lerp_small), A(decay), A(w1), A(one_minus_w1),
        A(beta2), A(w2), A(bc2_sqrt), A(eps), A(step_size), A(nthreads), A(isa),
    };
#undef A
    return put_layout(layout, sizeof(layout) / sizeof(layout[0]), out, n);
}

/* The module is loaded with ctypes; this init only lets the import system find the built file. */
static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT, "_native_quant", "tierstore quantization kernels (ctypes)", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native_quant(void) { return PyModule_Create(&moddef); }
