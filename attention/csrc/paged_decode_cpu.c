/*
 * Paged decode attention on the CPU, reading K/V blocks where they lie in the cache.
 *
 * Why C: the plain-torch path must first gather every sequence's blocks into a contiguous
 * tensor per layer (a full copy of the context's K and V) before SDPA reads it again. Here
 * each (sequence, KV head) pair walks its block table once for the scores and once for the
 * weighted sum of values, so K and V are read once and never copied. Built and loaded by
 * attention/cpu_kernels.py with the system C compiler; the torch reference stays the oracle.
 *
 * Layout (the same as the torch and Triton backends):
 *   query        [num_tokens, num_heads, head_dim], rows `query_stride` elements apart
 *   key/value    [num_blocks, block_size, num_kv_heads, head_dim], contiguous
 *   block_tables [num_seqs, block_table_stride] int32
 *   out          [num_tokens, num_heads, head_dim], rows `out_stride` elements apart
 * Query heads g*G .. g*G+G-1 share KV head g (GQA), so they are computed together and each
 * K/V row loaded serves all G of them.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

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

/* The per-(sequence, KV head) work, shared by every element type: `load` turns a K/V or query
 * row into float32 scratch, `store` writes the output row back. */
#define DEFINE_PAGED_DECODE(NAME, T, LOAD_ROW, STORE_ROW)                                          \
    int NAME(const T* query, int64_t query_stride, const T* key_cache, const T* value_cache,      \
             const int32_t* block_tables, int64_t block_table_stride, const int32_t* seq_lens,    \
             const int32_t* query_start_loc, const int64_t* decode_seqs, int64_t num_decodes,     \
             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,       \
             int64_t max_seq_len, float scale, T* out, int64_t out_stride, int64_t num_threads) { \
        const int64_t group = num_heads / num_kv_heads;                                          \
        const int64_t token_stride = num_kv_heads * head_dim;                                    \
        const int64_t block_stride = block_size * token_stride;                                  \
        const int64_t num_items = num_decodes * num_kv_heads;                                    \
        int failed = 0;                                                                           \
        PARALLEL(num_threads)                                                                     \
        {                                                                                         \
            /* scores [group][max_seq_len], q and acc [group][head_dim], kv [head_dim] */         \
            float* scratch = (float*)malloc(                                                      \
                sizeof(float) * (group * max_seq_len + 2 * group * head_dim + head_dim));       \
            if (scratch == NULL) {                                                                \
                ATOMIC_FAIL(failed);                                                              \
            } else {                                                                              \
                float* scores = scratch;                                                          \
                float* q = scores + group * max_seq_len;                                          \
                float* acc = q + group * head_dim;                                                \
                float* kv = acc + group * head_dim;                                               \
                FOR_DYNAMIC                                                                       \
                for (int64_t item = 0; item < num_items; ++item) {                                \
                    const int64_t seq = decode_seqs[item / num_kv_heads];                         \
                    const int64_t kv_head = item % num_kv_heads;                                  \
                    const int64_t len = seq_lens[seq];                                            \
                    const int64_t row = query_start_loc[seq];                                     \
                    const int32_t* table = block_tables + seq * block_table_stride;               \
                    const int64_t head_off = kv_head * head_dim;                                  \
                    for (int64_t g = 0; g < group; ++g) {                                         \
                        LOAD_ROW(q + g * head_dim,                                                \
                                 query + row * query_stride + (kv_head * group + g) * head_dim,   \
                                 head_dim);                                                       \
                        for (int64_t i = 0; i < head_dim; ++i) q[g * head_dim + i] *= scale;     \
                    }                                                                             \
                    for (int64_t pos = 0; pos < len; ++pos) {                                     \
                        const T* k = key_cache + (int64_t)table[pos / block_size] * block_stride  \
                                     + (pos % block_size) * token_stride + head_off;              \
                        LOAD_ROW(kv, k, head_dim);                                                \
                        for (int64_t g = 0; g < group; ++g) {                                     \
                            const float* qg = q + g * head_dim;                                   \
                            float dot = 0.f;                                                      \
                            SIMD_REDUCE(dot)                                                      \
                            for (int64_t i = 0; i < head_dim; ++i) dot += qg[i] * kv[i];         \
                            scores[g * max_seq_len + pos] = dot;                                  \
                        }                                                                         \
                    }                                                                             \
                    for (int64_t g = 0; g < group; ++g) {                                         \
                        float* s = scores + g * max_seq_len;                                      \
                        float top = -FLT_MAX, sum = 0.f;                                          \
                        for (int64_t pos = 0; pos < len; ++pos) top = s[pos] > top ? s[pos] : top; \
                        SIMD_REDUCE(sum)                                                          \
                        for (int64_t pos = 0; pos < len; ++pos) {                                 \
                            s[pos] = expf(s[pos] - top);                                          \
                            sum += s[pos];                                                        \
                        }                                                                         \
                        const float inv = 1.f / sum;                                              \
                        for (int64_t pos = 0; pos < len; ++pos) s[pos] *= inv;                    \
                    }                                                                             \
                    memset(acc, 0, sizeof(float) * group * head_dim);                             \
                    for (int64_t pos = 0; pos < len; ++pos) {                                     \
                        const T* v = value_cache + (int64_t)table[pos / block_size] * block_stride \
                                     + (pos % block_size) * token_stride + head_off;              \
                        LOAD_ROW(kv, v, head_dim);                                                \
                        for (int64_t g = 0; g < group; ++g) {                                     \
                            const float w = scores[g * max_seq_len + pos];                        \
                            float* a = acc + g * head_dim;                                        \
                            for (int64_t i = 0; i < head_dim; ++i) a[i] += w * kv[i];            \
                        }                                                                         \
                    }                                                                             \
                    for (int64_t g = 0; g < group; ++g)                                           \
                        STORE_ROW(out + row * out_stride + (kv_head * group + g) * head_dim,      \
                                  acc + g * head_dim, head_dim);                                  \
                }                                                                                 \
                free(scratch);                                                                    \
            }                                                                                     \
        }                                                                                         \
        return failed ? -1 : 0;                                                                   \
    }

#ifdef _OPENMP
#define PRAGMA(x) _Pragma(#x)
#define PARALLEL(n) PRAGMA(omp parallel num_threads(n))
#define FOR_DYNAMIC PRAGMA(omp for schedule(dynamic, 1))
#define SIMD_REDUCE(var) PRAGMA(omp simd reduction(+ : var))
#define ATOMIC_FAIL(flag) PRAGMA(omp atomic write) flag = 1
#else
#define PARALLEL(n)
#define FOR_DYNAMIC
#define SIMD_REDUCE(var)
#define ATOMIC_FAIL(flag) flag = 1
#endif

static inline void load_f32(float* dst, const float* src, int64_t n) { memcpy(dst, src, sizeof(float) * n); }
static inline void store_f32(float* dst, const float* src, int64_t n) { memcpy(dst, src, sizeof(float) * n); }

static inline void load_bf16(float* dst, const uint16_t* src, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}
static inline void store_bf16(uint16_t* dst, const float* src, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

DEFINE_PAGED_DECODE(paged_decode_f32, float, load_f32, store_f32)
DEFINE_PAGED_DECODE(paged_decode_bf16, uint16_t, load_bf16, store_bf16)

#ifdef __FLT16_MAX__
static inline void load_f16(float* dst, const _Float16* src, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = (float)src[i];
}
static inline void store_f16(_Float16* dst, const float* src, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = (_Float16)src[i];
}
DEFINE_PAGED_DECODE(paged_decode_f16, _Float16, load_f16, store_f16)
int has_f16(void) { return 1; }
#else
int has_f16(void) { return 0; }
#endif
