/*
 * Helpers shared by pagedray's C kernels for the CPU (paged_decode_cpu.c, paged_prefill_cpu.c,
 * paged_rows_cpu.c, layer_ops_cpu.c): bf16 conversions as torch rounds, OpenMP pragmas that
 * vanish without OpenMP, a scratch buffer per thread, a prefetch of scattered cache blocks, and
 * where the compiler targets AVX-512, 16-wide loads of K/V rows and an exponential for softmax.
 * Built with them by attention/kernel_library.py, which hashes this header into the build key.
 */
#ifndef PAGEDRAY_CPU_SIMD_H
#define PAGEDRAY_CPU_SIMD_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    /* Round to nearest even, as torch does; NaN stays NaN. */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#ifdef _OPENMP
#define PRAGMA(x) _Pragma(#x)
#else
#define PRAGMA(x)
#endif

/* `NAME(floats)`: this thread's scratch of at least `floats` floats, 64-byte aligned, or NULL
 * where it cannot be allocated. Kept per thread across calls (OpenMP's threads persist): no
 * allocation per layer call; it grows to the largest asked and lives as long as the thread.
 * Each kernel file defines its own. */
#define DEFINE_THREAD_SCRATCH(NAME)                                                               \
    static _Thread_local float* NAME##_buffer = NULL;                                             \
    static _Thread_local size_t NAME##_floats = 0;                                                \
    static float* NAME(size_t floats) {                                                           \
        if (floats > NAME##_floats) {                                                             \
            free(NAME##_buffer);                                                                  \
            NAME##_buffer = (float*)aligned_alloc(64, sizeof(float) * ((floats + 15) / 16 * 16)); \
            NAME##_floats = NAME##_buffer == NULL ? 0 : floats;                                   \
        }                                                                                         \
        return NAME##_buffer;                                                                     \
    }

/* Asks for the next block's rows while this one is computed: blocks lie anywhere in a pool of
 * gigabytes, so the hardware prefetcher, which follows addresses in order, cannot guess them.
 * Each of the block's `rows` rows (`row_stride` elements apart) is `row_bytes` long. */
#define prefetch_rows(first, rows, row_stride, row_bytes)                                         \
    do {                                                                                          \
        for (int64_t r_ = 0; r_ < (rows); ++r_) {                                                 \
            const char* line_ = (const char*)((first) + r_ * (row_stride));                       \
            for (int64_t o_ = 0; o_ < (row_bytes); o_ += 64) __builtin_prefetch(line_ + o_, 0, 1); \
        }                                                                                         \
    } while (0)

#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_AVX512_PATH 1


/* 16 K/V elements as float32: loaded as they are, or widened from bf16 (its top 16 bits). */
static inline __m512 load16_f32(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t* p) {
    const __m256i half = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* e^x for x <= 0 (softmax after the max is taken out), to about 1 ulp: x = n ln2 + r with
 * |r| <= ln2 / 2, e^r by its Taylor series to r^6 (the next term is under 2e-7 relative). */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f)); /* below: 0 after scaling, no denormals */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#endif

#endif /* PAGEDRAY_CPU_SIMD_H */
