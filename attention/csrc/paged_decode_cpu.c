/*
 * Paged decode attention on the CPU, reading K/V blocks where they lie in the cache.
 *
 * Why C: the plain-torch path must first gather every sequence's blocks into a contiguous
 * tensor per layer (a full copy of the context's K and V) before SDPA reads it again. Here
 * each (sequence, KV head) pair walks its block table once for the scores and once for the
 * weighted sum of values, so K and V are read once and never copied. Built and loaded by
 * attention/cpu_kernels.py with the system C compiler; the torch reference stays the oracle.
 *
 * One thread takes one sequence, all its heads: each K/V row it loads is the contiguous
 * [num_kv_heads, head_dim] slice of a token, and one item's scores stay in its cache.
 *
 * Layout (the same as the torch and Triton backends):
 *   query        [num_tokens, num_heads, head_dim], rows `query_stride` elements apart
 *   key/value    [num_blocks, block_size, num_kv_heads, head_dim], contiguous
 *   block_tables [num_seqs, block_table_stride] int32
 *   out          [num_tokens, num_heads, head_dim], rows `out_stride` elements apart
 * Query head h reads KV head h / G, G = num_heads / num_kv_heads (GQA).
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

/* Rows of K/V as float32: float32 caches are read where they lie, others are converted into the
 * caller's scratch row first. */
static inline const float* row_f32(float* scratch, const float* src, int64_t n) {
    (void)scratch;
    (void)n;
    return src;
}
static inline const float* row_bf16(float* scratch, const uint16_t* src, int64_t n) {
    for (int64_t i = 0; i < n; ++i) scratch[i] = bf16_to_f32(src[i]);
    return scratch;
}
static inline void store_f32(float* dst, const float* src, int64_t n) {
    memcpy(dst, src, sizeof(float) * n);
}
static inline void store_bf16(uint16_t* dst, const float* src, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}
#ifdef __FLT16_MAX__
static inline const float* row_f16(float* scratch, const _Float16* src, int64_t n) {
    for (int64_t i = 0; i < n; ++i) scratch[i] = (float)src[i];
    return scratch;
}
static inline void store_f16(_Float16* dst, const float* src, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = (_Float16)src[i];
}
#endif

#ifdef _OPENMP
#define PRAGMA(x) _Pragma(#x)
#else
#define PRAGMA(x)
#endif

/* Scratch per thread, in floats: scores [num_heads][max_seq_len], query and output accumulators
 * [num_heads][head_dim], one converted K/V token row [num_kv_heads][head_dim]. */
#define SCRATCH_FLOATS(num_heads, num_kv_heads, head_dim, max_seq_len) \
    ((num_heads) * (max_seq_len) + 2 * (num_heads) * (head_dim) + (num_kv_heads) * (head_dim))

/* One sequence's decode for element type T. `head_dim` is a compile-time constant at the call
 * sites for the common sizes, which lets the compiler unroll the dot products fully. */
#define DEFINE_ATTEND_SEQUENCE(SUFFIX, T)                                                           \
    static inline __attribute__((always_inline)) void attend_sequence_##SUFFIX(                   \
        const T* query_row, const T* key_cache, const T* value_cache, const int32_t* table,       \
        int64_t len, int64_t num_heads, int64_t num_kv_heads, const int64_t head_dim,             \
        int64_t block_size, int64_t max_seq_len, float scale, T* out_row, float* scratch) {       \
        const int64_t group = num_heads / num_kv_heads;                                           \
        const int64_t token_stride = num_kv_heads * head_dim;                                     \
        const int64_t block_stride = block_size * token_stride;                                   \
        const int64_t num_blocks = (len + block_size - 1) / block_size;                           \
        float* scores = scratch;                                                                  \
        float* q = scores + num_heads * max_seq_len;                                              \
        float* acc = q + num_heads * head_dim;                                                    \
        float* tmp = acc + num_heads * head_dim;                                                  \
        /* Converted in place into q where needed (tmp holds one K/V row, not all the heads). */ \
        const float* q_in = row_##SUFFIX(q, query_row, num_heads * head_dim);                     \
        for (int64_t i = 0; i < num_heads * head_dim; ++i) q[i] = q_in[i] * scale;                \
        for (int64_t b = 0; b < num_blocks; ++b) {                                                \
            const T* block = key_cache + (int64_t)table[b] * block_stride;                        \
            const int64_t filled = b + 1 < num_blocks ? block_size : len - b * block_size;        \
            for (int64_t p = 0; p < filled; ++p) {                                                \
                const float* k_row = row_##SUFFIX(tmp, block + p * token_stride, token_stride);   \
                for (int64_t h = 0; h < num_heads; ++h) {                                         \
                    const float* k = k_row + (h / group) * head_dim;                              \
                    const float* qh = q + h * head_dim;                                           \
                    float dot = 0.f;                                                              \
                    PRAGMA(omp simd reduction(+ : dot))                                           \
                    for (int64_t i = 0; i < head_dim; ++i) dot += qh[i] * k[i];                   \
                    scores[h * max_seq_len + b * block_size + p] = dot;                           \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int64_t h = 0; h < num_heads; ++h) {                                                 \
            float* s = scores + h * max_seq_len;                                                  \
            float top = -FLT_MAX, sum = 0.f;                                                      \
            for (int64_t p = 0; p < len; ++p) top = s[p] > top ? s[p] : top;                      \
            PRAGMA(omp simd reduction(+ : sum))                                                   \
            for (int64_t p = 0; p < len; ++p) {                                                   \
                s[p] = expf(s[p] - top);                                                          \
                sum += s[p];                                                                      \
            }                                                                                     \
            const float inv = 1.f / sum;                                                          \
            for (int64_t p = 0; p < len; ++p) s[p] *= inv;                                        \
        }                                                                                         \
        memset(acc, 0, sizeof(float) * num_heads * head_dim);                                     \
        for (int64_t b = 0; b < num_blocks; ++b) {                                                \
            const T* block = value_cache + (int64_t)table[b] * block_stride;                      \
            const int64_t filled = b + 1 < num_blocks ? block_size : len - b * block_size;        \
            for (int64_t p = 0; p < filled; ++p) {                                                \
                const float* v_row = row_##SUFFIX(tmp, block + p * token_stride, token_stride);   \
                for (int64_t h = 0; h < num_heads; ++h) {                                         \
                    const float* v = v_row + (h / group) * head_dim;                              \
                    const float w = scores[h * max_seq_len + b * block_size + p];                 \
                    float* a = acc + h * head_dim;                                                \
                    PRAGMA(omp simd)                                                              \
                    for (int64_t i = 0; i < head_dim; ++i) a[i] += w * v[i];                      \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        store_##SUFFIX(out_row, acc, num_heads * head_dim);                                       \
    }

/* The exported entry point: sequences in parallel, each with the head size made constant where
 * it is a common one. Returns 0, or -1 when a thread could not allocate its scratch. */
#define DEFINE_PAGED_DECODE(SUFFIX, T)                                                              \
    DEFINE_ATTEND_SEQUENCE(SUFFIX, T)                                                             \
    int paged_decode_##SUFFIX(                                                                    \
        const T* query, int64_t query_stride, const T* key_cache, const T* value_cache,           \
        const int32_t* block_tables, int64_t block_table_stride, const int32_t* seq_lens,         \
        const int32_t* query_start_loc, const int64_t* decode_seqs, int64_t num_decodes,          \
        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,            \
        int64_t max_seq_len, float scale, T* out, int64_t out_stride, int64_t num_threads) {      \
        int failed = 0;                                                                           \
        (void)num_threads; /* without OpenMP: one thread */                                       \
        PRAGMA(omp parallel num_threads(num_threads))                                             \
        {                                                                                         \
            float* scratch = (float*)malloc(                                                      \
                sizeof(float) * SCRATCH_FLOATS(num_heads, num_kv_heads, head_dim, max_seq_len));  \
            if (scratch == NULL) {                                                                \
                PRAGMA(omp atomic write)                                                          \
                failed = 1;                                                                       \
            }                                                                                     \
            PRAGMA(omp for schedule(dynamic, 1))                                                  \
            for (int64_t i = 0; i < num_decodes; ++i) {                                           \
                if (scratch == NULL) continue;                                                    \
                const int64_t seq = decode_seqs[i];                                               \
                const int64_t row = query_start_loc[seq];                                         \
                const T* q = query + row * query_stride;                                          \
                T* o = out + row * out_stride;                                                    \
                const int32_t* table = block_tables + seq * block_table_stride;                   \
                const int64_t len = seq_lens[seq];                                                \
                switch (head_dim) {                                                               \
                    case 64:                                                                      \
                        attend_sequence_##SUFFIX(q, key_cache, value_cache, table, len,           \
                                                 num_heads, num_kv_heads, 64, block_size,         \
                                                 max_seq_len, scale, o, scratch);                 \
                        break;                                                                    \
                    case 128:                                                                     \
                        attend_sequence_##SUFFIX(q, key_cache, value_cache, table, len,           \
                                                 num_heads, num_kv_heads, 128, block_size,        \
                                                 max_seq_len, scale, o, scratch);                 \
                        break;                                                                    \
                    default:                                                                      \
                        attend_sequence_##SUFFIX(q, key_cache, value_cache, table, len,           \
                                                 num_heads, num_kv_heads, head_dim, block_size,   \
                                                 max_seq_len, scale, o, scratch);                 \
                }                                                                                 \
            }                                                                                     \
            free(scratch);                                                                        \
        }                                                                                         \
        return failed ? -1 : 0;                                                                   \
    }

DEFINE_PAGED_DECODE(f32, float)
DEFINE_PAGED_DECODE(bf16, uint16_t)
#ifdef __FLT16_MAX__
DEFINE_PAGED_DECODE(f16, _Float16)
int has_f16(void) { return 1; }
#else
int has_f16(void) { return 0; }
#endif
