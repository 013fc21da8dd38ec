/*
 * Paged prefill ("extend") attention on the CPU: the queries of prefill chunks against their
 * whole context (cached prefix, earlier chunks, the chunk itself, causally), K/V read in place.
 *
 * Why C: torch's path gathers each chunk's context out of the block table into a contiguous copy
 * per layer, then runs SDPA, whose CPU flash kernel multiplies through MKL's sgemm (on this
 * project's AMD CI machine ~90 GFLOP/s, a fifth of what the hardware does). Here the work is
 * flash attention with the products laid out for AVX-512: 16 keys at a time are transposed into
 * [head_dim][16] once and then serve every query row and every query head of their KV head, so a
 * row's 16 scores are head_dim FMAs with no horizontal sums, and the weighted values 16 x
 * head_dim / 16 more. Softmax is online (running max and sum per row). Prefill over a cached
 * prefix costs no copy of the prefix.
 *
 * Work items: (sequence, KV head, tile of QUERY_TILE query rows), in parallel. AVX-512 only:
 * paged_prefill_supported() says whether this build has it; elsewhere the torch path serves.
 * Layout as paged_decode_cpu.c; out rows of the extend sequences are written.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

#define QUERY_TILE 16
#define KEY_CHUNK 16
#define MAX_HEAD_DIM 256

#define PAGED_PREFILL_OK 0
#define PAGED_PREFILL_NO_MEMORY -1
#define PAGED_PREFILL_BAD_LENGTH -2
#define PAGED_PREFILL_UNSUPPORTED -3

#ifdef HAVE_AVX512_PATH
int paged_prefill_supported(void) { return 1; }

DEFINE_THREAD_SCRATCH(prefill_scratch_for)

static inline float to_f32_f32(float x) { return x; }
static inline float to_f32_bf16(uint16_t x) { return bf16_to_f32(x); }
static inline void out_f32(float* dst, float x) { *dst = x; }
static inline void out_bf16(uint16_t* dst, float x) { *dst = f32_to_bf16(x); }

/* One item: query rows [row_begin, row_end) of one sequence (positions context + row) and the
 * `group` query heads of KV head `kv`. `vecs` = head_dim / 16, constant at the call sites. */
#define DEFINE_PREFILL_ITEM(SUFFIX, T)                                                              \
    static inline __attribute__((always_inline)) void prefill_item_##SUFFIX(                      \
        const T* query, int64_t query_stride, const T* key_cache, const T* value_cache,           \
        const int32_t* table, int64_t first_row, int64_t context, int64_t row_begin,              \
        int64_t row_end, int64_t kv, int64_t group, int64_t num_kv_heads, const int64_t vecs,     \
        int64_t block_size, float scale, T* out, int64_t out_stride, float* scratch) {            \
        const int64_t head_dim = vecs * 16;                                                       \
        const int64_t token_stride = num_kv_heads * head_dim;                                     \
        const int64_t block_stride = block_size * token_stride;                                   \
        const int64_t rows = row_end - row_begin;                                                 \
        const int64_t lanes = rows * group; /* (row, head) pairs of this item */                  \
        float* q = scratch;                      /* [lanes][head_dim], scaled */                  \
        float* acc = q + lanes * head_dim;       /* [lanes][head_dim] */                          \
        float* run_max = acc + lanes * head_dim; /* [lanes] */                                    \
        float* run_sum = run_max + lanes;        /* [lanes] */                                    \
        float* kt = run_sum + lanes;             /* [head_dim][KEY_CHUNK] */                      \
        const T* v_rows[KEY_CHUNK];                                                               \
        for (int64_t r = 0; r < rows; ++r)                                                        \
            for (int64_t g = 0; g < group; ++g) {                                                 \
                const T* src = query + (first_row + row_begin + r) * query_stride +               \
                               (kv * group + g) * head_dim;                                       \
                float* dst = q + (r * group + g) * head_dim;                                      \
                for (int64_t d = 0; d < head_dim; ++d) dst[d] = to_f32_##SUFFIX(src[d]) * scale;  \
            }                                                                                     \
        memset(acc, 0, sizeof(float) * lanes * head_dim);                                         \
        for (int64_t l = 0; l < lanes; ++l) run_max[l] = -FLT_MAX, run_sum[l] = 0.f;              \
        const int64_t num_keys = context + row_end; /* the last row sees this many */             \
        for (int64_t k0 = 0; k0 < num_keys; k0 += KEY_CHUNK) {                                    \
            const int64_t chunk = num_keys - k0 < KEY_CHUNK ? num_keys - k0 : KEY_CHUNK;          \
            for (int64_t j = 0; j < KEY_CHUNK; ++j) {                                             \
                if (j >= chunk) {                                                                 \
                    for (int64_t d = 0; d < head_dim; ++d) kt[d * KEY_CHUNK + j] = 0.f;           \
                    v_rows[j] = v_rows[0];                                                        \
                    continue;                                                                     \
                }                                                                                 \
                const int64_t pos = k0 + j;                                                       \
                const int64_t offset = (int64_t)table[pos / block_size] * block_stride +          \
                                       (pos % block_size) * token_stride + kv * head_dim;         \
                const T* k_row = key_cache + offset;                                              \
                for (int64_t d = 0; d < head_dim; ++d)                                            \
                    kt[d * KEY_CHUNK + j] = to_f32_##SUFFIX(k_row[d]);                            \
                v_rows[j] = value_cache + offset;                                                 \
            }                                                                                     \
            /* Rows before the chunk's first key see none of it (causal). */                      \
            const int64_t first_seeing = k0 - context > row_begin ? k0 - context : row_begin;     \
            for (int64_t r = first_seeing - row_begin; r < rows; ++r) {                           \
                const int64_t visible_to = context + row_begin + r + 1; /* keys < this */         \
                const int64_t visible = visible_to - k0 < chunk ? visible_to - k0 : chunk;        \
                const __mmask16 live = (__mmask16)((1u << visible) - 1u);                         \
                for (int64_t g = 0; g < group; ++g) {                                             \
                    const int64_t lane = r * group + g;                                           \
                    const float* ql = q + lane * head_dim;                                        \
                    /* Four chains: one would wait on each FMA's latency. */                     \
                    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;                   \
                    for (int64_t d = 0; d < head_dim; d += 4) {                                   \
                        const float* kd = kt + d * KEY_CHUNK;                                     \
                        s0 = _mm512_fmadd_ps(_mm512_set1_ps(ql[d]), _mm512_loadu_ps(kd), s0);     \
                        s1 = _mm512_fmadd_ps(_mm512_set1_ps(ql[d + 1]),                           \
                                             _mm512_loadu_ps(kd + KEY_CHUNK), s1);                \
                        s2 = _mm512_fmadd_ps(_mm512_set1_ps(ql[d + 2]),                           \
                                             _mm512_loadu_ps(kd + 2 * KEY_CHUNK), s2);            \
                        s3 = _mm512_fmadd_ps(_mm512_set1_ps(ql[d + 3]),                           \
                                             _mm512_loadu_ps(kd + 3 * KEY_CHUNK), s3);            \
                    }                                                                             \
                    __m512 s = _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3));       \
                    s = _mm512_mask_mov_ps(_mm512_set1_ps(-FLT_MAX), live, s);                    \
                    const float top = _mm512_reduce_max_ps(s);                                    \
                    const float new_max = top > run_max[lane] ? top : run_max[lane];              \
                    const __m512 p =                                                              \
                        _mm512_maskz_mov_ps(live, exp_nonpositive(                                \
                                                      _mm512_sub_ps(s, _mm512_set1_ps(new_max))));\
                    const float correction = expf(run_max[lane] - new_max);                       \
                    run_sum[lane] = run_sum[lane] * correction + _mm512_reduce_add_ps(p);         \
                    run_max[lane] = new_max;                                                      \
                    float weights[KEY_CHUNK] __attribute__((aligned(64)));                        \
                    _mm512_store_ps(weights, p);                                                  \
                    float* a = acc + lane * head_dim;                                             \
                    __m512 av[MAX_HEAD_DIM / 16];                                                 \
                    const __m512 c = _mm512_set1_ps(correction);                                  \
                    for (int64_t v = 0; v < vecs; ++v)                                            \
                        av[v] = _mm512_mul_ps(_mm512_loadu_ps(a + 16 * v), c);                    \
                    for (int64_t j = 0; j < visible; ++j) {                                       \
                        const __m512 w = _mm512_set1_ps(weights[j]);                              \
                        for (int64_t v = 0; v < vecs; ++v)                                        \
                            av[v] = _mm512_fmadd_ps(w, load16_##SUFFIX(v_rows[j] + 16 * v),       \
                                                    av[v]);                                       \
                    }                                                                             \
                    for (int64_t v = 0; v < vecs; ++v) _mm512_storeu_ps(a + 16 * v, av[v]);       \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int64_t r = 0; r < rows; ++r)                                                        \
            for (int64_t g = 0; g < group; ++g) {                                                 \
                const int64_t lane = r * group + g;                                               \
                const float inv = 1.f / run_sum[lane];                                            \
                T* dst = out + (first_row + row_begin + r) * out_stride +                         \
                         (kv * group + g) * head_dim;                                             \
                for (int64_t d = 0; d < head_dim; ++d)                                            \
                    out_##SUFFIX(dst + d, acc[lane * head_dim + d] * inv);                        \
            }                                                                                     \
    }

#define PREFILL_ARGS(VECS)                                                                        \
    query, query_stride, key_cache, value_cache, table, first_row, context, row_begin, row_end,  \
        kv, group, num_kv_heads, (VECS), block_size, scale, out, out_stride, scratch

#define DEFINE_PAGED_PREFILL(SUFFIX, T)                                                             \
    DEFINE_PREFILL_ITEM(SUFFIX, T)                                                                \
    int paged_prefill_##SUFFIX(                                                                   \
        const T* query, int64_t query_stride, const T* key_cache, const T* value_cache,           \
        const int32_t* block_tables, int64_t block_table_stride, const int32_t* seq_lens,         \
        const int32_t* query_start_loc, const int64_t* extend_seqs, int64_t num_extends,          \
        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,            \
        float scale, T* out, int64_t out_stride, int64_t num_threads) {                           \
        if (head_dim % 16 != 0 || head_dim > MAX_HEAD_DIM || num_heads % num_kv_heads != 0)       \
            return PAGED_PREFILL_UNSUPPORTED;                                                     \
        const int64_t group = num_heads / num_kv_heads;                                           \
        /* Items of extend e start at item_start[e]: tiles x KV heads each. */                    \
        int64_t* item_start = (int64_t*)malloc(sizeof(int64_t) * (num_extends + 1));             \
        if (item_start == NULL) return PAGED_PREFILL_NO_MEMORY;                                   \
        item_start[0] = 0;                                                                        \
        for (int64_t e = 0; e < num_extends; ++e) {                                               \
            const int64_t seq = extend_seqs[e];                                                   \
            const int64_t query_len = query_start_loc[seq + 1] - query_start_loc[seq];            \
            if (query_len < 1 || query_len > seq_lens[seq]) {                                     \
                free(item_start);                                                                 \
                return PAGED_PREFILL_BAD_LENGTH;                                                  \
            }                                                                                     \
            const int64_t tiles = (query_len + QUERY_TILE - 1) / QUERY_TILE;                      \
            item_start[e + 1] = item_start[e] + tiles * num_kv_heads;                             \
        }                                                                                         \
        const size_t lanes = (size_t)QUERY_TILE * group;                                          \
        const size_t scratch_floats =                                                             \
            2 * lanes * head_dim + 2 * lanes + (size_t)head_dim * KEY_CHUNK;                      \
        int status = PAGED_PREFILL_OK;                                                            \
        (void)num_threads;                                                                        \
        PRAGMA(omp parallel for schedule(dynamic, 1) num_threads(num_threads))                    \
        for (int64_t item = 0; item < item_start[num_extends]; ++item) {                          \
            int64_t e = 0;                                                                        \
            while (item_start[e + 1] <= item) ++e;                                                \
            const int64_t seq = extend_seqs[e];                                                   \
            const int64_t local = item - item_start[e];                                           \
            const int64_t kv = local % num_kv_heads, tile = local / num_kv_heads;                 \
            const int64_t first_row = query_start_loc[seq];                                       \
            const int64_t query_len = query_start_loc[seq + 1] - first_row;                       \
            const int64_t context = seq_lens[seq] - query_len;                                    \
            const int64_t row_begin = tile * QUERY_TILE;                                          \
            const int64_t row_end =                                                               \
                row_begin + QUERY_TILE < query_len ? row_begin + QUERY_TILE : query_len;          \
            const int32_t* table = block_tables + seq * block_table_stride;                       \
            float* scratch = prefill_scratch_for(scratch_floats);                                 \
            if (scratch == NULL) {                                                                \
                PRAGMA(omp atomic write)                                                          \
                status = PAGED_PREFILL_NO_MEMORY;                                                 \
                continue;                                                                         \
            }                                                                                     \
            switch (head_dim) {                                                                   \
                case 64: prefill_item_##SUFFIX(PREFILL_ARGS(4)); break;                           \
                case 128: prefill_item_##SUFFIX(PREFILL_ARGS(8)); break;                          \
                default: prefill_item_##SUFFIX(PREFILL_ARGS(head_dim / 16));                      \
            }                                                                                     \
        }                                                                                         \
        free(item_start);                                                                         \
        return status;                                                                            \
    }

DEFINE_PAGED_PREFILL(f32, float)
DEFINE_PAGED_PREFILL(bf16, uint16_t)

#else /* no AVX-512: the torch path serves prefills */
int paged_prefill_supported(void) { return 0; }
int paged_prefill_f32(void) { return PAGED_PREFILL_UNSUPPORTED; }
int paged_prefill_bf16(void) { return PAGED_PREFILL_UNSUPPORTED; }
#endif
