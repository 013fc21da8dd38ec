/*
 * The element-wise work of a decoder layer on the CPU, one call where torch takes 5 to 10 ops:
 * residual add + RMSNorm, rotary embedding of q and k with the K/V store into the paged cache,
 * and SiLU(gate) * up.
 *
 * Why: a decode step over a few sequences is made of small ops, and on the CPU each torch op
 * costs 1-3 us of dispatch before any arithmetic, about 150 us a layer; here each call is one
 * ctypes hop. Built into the same library as paged_decode_cpu.c by attention/kernel_library.py;
 * workers/layers/cpu_ops.py calls it, and the torch code it replaces stays the reference.
 *
 * Rounding follows the torch code step for step, HF's order: in bf16 every op whose torch
 * result is bf16 is rounded to bf16 here too (x + residual, the normalised row before the
 * weight, weight * row, cos and sin, each product and sum of the rotation, SiLU, the product).
 * So the rotation, the K/V store and the residual sum are bit-exact; the norm and SiLU can land
 * one bf16 step away where a float32 intermediate (a sum taken in another order, expf against
 * torch's Sleef exp) differs in its last bit. In float32 results differ by rounding only.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

/* Below this many elements a call runs on one thread: waking the pool costs more. */
#define PARALLEL_MIN_ELEMENTS 32768

static inline float bf16_load(uint16_t x) { return bf16_to_f32(x); }
static inline float bf16_r(float x) { return bf16_to_f32(f32_to_bf16(x)); }
static inline uint16_t bf16_store(float x) { return f32_to_bf16(x); }

/* R(x): x as torch would hold it in the element type (identity in float32). */
static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }
static inline float f32_r(float x) { return x; }

#define DEFINE_LAYER_OPS(SUFFIX, T)                                                                 \
    /* out = weight * R(R(x [+ residual]) * rsqrt(mean(R(x [+ residual])^2) + eps)); with a      \
     * residual, residual_out = R(x + residual). Rows of x and out are `stride` apart. */          \
    void rms_norm_##SUFFIX(const T* x, int64_t x_stride, const T* residual, const T* weight,      \
                           T* out, T* residual_out, int64_t rows, int64_t hidden, float eps) {    \
        PRAGMA(omp parallel for schedule(static) if (rows * hidden >= PARALLEL_MIN_ELEMENTS))     \
        for (int64_t r = 0; r < rows; ++r) {                                                      \
            const T* xr = x + r * x_stride;                                                       \
            T* o = out + r * hidden;                                                              \
            float sum = 0.f;                                                                      \
            if (residual != NULL) {                                                               \
                const T* rr = residual + r * hidden;                                              \
                T* ro = residual_out + r * hidden;                                                \
                for (int64_t i = 0; i < hidden; ++i) {                                            \
                    const float s = SUFFIX##_r(SUFFIX##_load(xr[i]) + SUFFIX##_load(rr[i]));      \
                    ro[i] = SUFFIX##_store(s);                                                    \
                    sum += s * s;                                                                 \
                }                                                                                 \
                xr = ro;                                                                          \
            } else {                                                                              \
                for (int64_t i = 0; i < hidden; ++i) {                                            \
                    const float s = SUFFIX##_load(xr[i]);                                         \
                    sum += s * s;                                                                 \
                }                                                                                 \
            }                                                                                     \
            const float inv = 1.f / sqrtf(sum / (float)hidden + eps);                             \
            for (int64_t i = 0; i < hidden; ++i) {                                                \
                const float normed = SUFFIX##_r(SUFFIX##_load(xr[i]) * inv);                      \
                o[i] = SUFFIX##_store(SUFFIX##_load(weight[i]) * normed);                         \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    /* out[r, :] = R(SiLU(gate)) * up (rounded), gate = gate_up[r, :inter], up = the rest. */     \
    void silu_mul_##SUFFIX(const T* gate_up, T* out, int64_t rows, int64_t inter) {               \
        PRAGMA(omp parallel for schedule(static) if (rows * inter >= PARALLEL_MIN_ELEMENTS))      \
        for (int64_t r = 0; r < rows; ++r) {                                                      \
            const T* g = gate_up + r * 2 * inter;                                                 \
            const T* u = g + inter;                                                               \
            T* o = out + r * inter;                                                               \
            for (int64_t i = 0; i < inter; ++i) {                                                 \
                const float x = SUFFIX##_load(g[i]);                                              \
                const float act = SUFFIX##_r(x / (1.f + expf(-x)));                               \
                o[i] = SUFFIX##_store(act * SUFFIX##_load(u[i]));                                 \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    /* Neox rotary embedding of the q and k heads of each row of qkv ([q heads | k heads | v      \
     * heads], rows `qkv_stride` apart), q in place; rotated k and plain v are written to their   \
     * slot of the caches ([num_slots, num_kv_heads, head_dim]); a slot < 0 is padding. cos and  \
     * sin tables are float32 [max_position, head_dim / 2], rounded to T as torch casts them.   \
     * Returns -2, having written nothing, when a position is outside [0, max_position). */     \
    int rope_store_##SUFFIX(T* qkv, int64_t qkv_stride, int64_t rows, int64_t num_heads,          \
                            int64_t num_kv_heads, int64_t head_dim, const int64_t* positions,     \
                            int64_t max_position, const float* cos_table, const float* sin_table, \
                            T* key_cache, T* value_cache, const int64_t* slots) {                 \
        for (int64_t r = 0; r < rows; ++r)                                                        \
            if (positions[r] < 0 || positions[r] >= max_position) return -2;                      \
        const int64_t half = head_dim / 2;                                                        \
        const int64_t kv_row = num_kv_heads * head_dim;                                           \
        PRAGMA(omp parallel for schedule(static) if (rows * (num_heads + 2 * num_kv_heads) *      \
                                                     head_dim >= PARALLEL_MIN_ELEMENTS))           \
        for (int64_t r = 0; r < rows; ++r) {                                                      \
            T* row = qkv + r * qkv_stride;                                                        \
            const float* cr = cos_table + positions[r] * half;                                    \
            const float* sr = sin_table + positions[r] * half;                                    \
            const int64_t slot = slots[r];                                                        \
            for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {                              \
                T* x = row + h * head_dim;                                                        \
                T* dst = x;                                                                       \
                if (h >= num_heads) {                                                             \
                    if (slot < 0) continue;                                                       \
                    dst = key_cache + slot * kv_row + (h - num_heads) * head_dim;                 \
                }                                                                                 \
                for (int64_t i = 0; i < half; ++i) {                                              \
                    const float c = SUFFIX##_r(cr[i]), s = SUFFIX##_r(sr[i]);                     \
                    const float x1 = SUFFIX##_load(x[i]), x2 = SUFFIX##_load(x[i + half]);        \
                    const float lo = SUFFIX##_r(SUFFIX##_r(x1 * c) - SUFFIX##_r(x2 * s));         \
                    const float hi = SUFFIX##_r(SUFFIX##_r(x2 * c) + SUFFIX##_r(x1 * s));         \
                    dst[i] = SUFFIX##_store(lo);                                                  \
                    dst[i + half] = SUFFIX##_store(hi);                                           \
                }                                                                                 \
            }                                                                                     \
            if (slot >= 0)                                                                        \
                memcpy(value_cache + slot * kv_row, row + (num_heads + num_kv_heads) * head_dim,  \
                       sizeof(T) * kv_row);                                                       \
        }                                                                                         \
        return 0;                                                                                 \
    }

DEFINE_LAYER_OPS(f32, float)
DEFINE_LAYER_OPS(bf16, uint16_t)

/* Structured outputs: logits[rows[i], t] = -inf for every token t that row i of the bitmask does
 * not allow (bit t % 32 of word t / 32 clear). Tokens past the bitmask's words are not allowed.
 * float32 logits only: the sampler's are float32 whatever the model's dtype. A word of all ones
 * (inside a string, most of the vocabulary) costs one compare. */
void apply_token_bitmask_f32(float* logits, int64_t logits_stride, int64_t vocab_size,
                             const int32_t* words, int64_t words_per_row, const int64_t* rows,
                             int64_t num_rows) {
    /* NOTE: -inf from its bits: under -ffast-math the compiler may assume no float is infinite. */
    const uint32_t neg_inf_bits = 0xFF800000u;
    float neg_inf;
    memcpy(&neg_inf, &neg_inf_bits, sizeof neg_inf);
    for (int64_t i = 0; i < num_rows; ++i) {
        float* row = logits + rows[i] * logits_stride;
        const uint32_t* bits = (const uint32_t*)(words + i * words_per_row);
        for (int64_t w = 0; w * 32 < vocab_size; ++w) {
            const uint32_t word = w < words_per_row ? bits[w] : 0u;
            if (word == 0xFFFFFFFFu) continue;
            const int64_t end = (w + 1) * 32 < vocab_size ? (w + 1) * 32 : vocab_size;
            for (int64_t t = w * 32; t < end; ++t)
                if (!((word >> (t - w * 32)) & 1u)) row[t] = neg_inf;
        }
    }
}
