/* Paged attention over the KV pool in place, for fp32 on a CPU (serving/engine/native_attention.py
 * builds and loads this file; docs/architecture.md, "The engine (one replica)").
 *
 * One call per layer and step. It first writes the step's new keys and values into their pool slots,
 * then attends every work item: queries [first_token, first_token + num_queries) of one sequence, the
 * first at position first_position, each seeing the keys at positions 0..its own position, read
 * through the sequence's block table. Nothing is gathered: each cached byte is read once, where it lives.
 *
 * Pool layouts, per layer (the runner allocates them so for this kernel):
 *   keys   [num_blocks][num_kv_heads][head_dim][block_size]  a block's keys transposed, per KV head;
 *   values [num_blocks][block_size][num_kv_heads][head_dim].
 * With keys transposed, a query's scores against a whole block are head_dim multiply-adds across the
 * block's keys at full vector width, with no reduction across lanes; values are summed across head_dim,
 * likewise. A block is read front to back once for every head of the item.
 *
 * Query head h uses KV head h / group (group = num_heads / num_kv_heads), as transformers' repeat_kv
 * does. Softmax is online (a running maximum and sum per query vector and head), in fp32 throughout,
 * with an exp of our own over a vector's lanes (relative error < 2e-7). Keys are taken a vector's width
 * at a time (SY_LANES: 16 with AVX-512, 8 with AVX, 4 otherwise; vector_math.h), and the block size is a
 * multiple of 16, so of every width. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vector_math.h"

#define SY_MAX_VECTORS 128  /* query vectors (queries x heads) per item: Python tiles items to fit */
#define SY_MAX_HEAD_DIM 256
#define SY_MAX_BLOCK_SIZE 64

typedef struct {
    /* the step's new keys and values: element [t][kv_head][d] at t*token_stride + kv_head*head_stride + d */
    const float *k_new;
    const float *v_new;
    int64_t kv_token_stride;
    int64_t kv_head_stride;
    float *k_pool;
    float *v_pool;
    const float *q;  /* [t][head][d] at t*q_token_stride + head*q_head_stride + d */
    int64_t q_token_stride;
    int64_t q_head_stride;
    float *out;      /* [t][head][d] at t*out_token_stride + head*out_head_stride + d */
    int64_t out_token_stride;
    int64_t out_head_stride;
    float scale;     /* applied to q.k, as the layer's own attention scales it */
} SyLayerArgs;

typedef struct {
    const int64_t *slot_mapping;  /* [num_new_tokens] pool slot of each new token */
    int64_t num_new_tokens;
    const int64_t *block_tables;  /* [num_seqs][table_stride] */
    int64_t table_stride;
    const int64_t *items;         /* [num_items][4]: seq row, first token, number of queries, first position */
    int64_t num_items;
    int32_t num_heads;
    int32_t num_kv_heads;
    int32_t head_dim;
    int32_t block_size;
    int32_t num_threads;
} SyStepArgs;

#define SY_MAX_GROUP 8  /* query heads per KV head handled together; more are taken one at a time */

static void write_new_kv(const SyStepArgs *step, const SyLayerArgs *layer) {
    const int64_t kv_heads = step->num_kv_heads, head_dim = step->head_dim, block_size = step->block_size;
    const size_t bytes = (size_t)head_dim * sizeof(float);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < step->num_new_tokens; t++) {
        const int64_t slot = step->slot_mapping[t];
        const int64_t block = slot / block_size, offset = slot % block_size;
        float *v_slot = layer->v_pool + slot * kv_heads * head_dim;
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t src = t * layer->kv_token_stride + h * layer->kv_head_stride;
            float *k_column = layer->k_pool + ((block * kv_heads + h) * head_dim) * block_size + offset;
            for (int64_t d = 0; d < head_dim; d++) k_column[d * block_size] = layer->k_new[src + d];
            memcpy(v_slot + h * head_dim, layer->v_new + src, bytes);
        }
    }
}

/* Per-thread state of one item: its query vectors (scaled), their accumulators and softmax state.
 * Vector i is query i / num_heads, head i % num_heads; a KV head's query heads are consecutive. */
static _Thread_local float sy_queries[SY_MAX_VECTORS][SY_MAX_HEAD_DIM];
static _Thread_local float sy_acc[SY_MAX_VECTORS][SY_MAX_HEAD_DIM];
static _Thread_local float sy_max[SY_MAX_VECTORS];
static _Thread_local float sy_sum[SY_MAX_VECTORS];

/* Folds up to SY_LANES keys (`num_keys` of them visible) into the state of `group` consecutive vectors
 * from `first`, which share one KV head: their scores, the softmax update, then the values. `keys`
 * points at the keys' first column in a transposed block ([head_dim][key_stride]); `values` at the first
 * key's values. Inlined with `group` a constant, so the per-vector state stays in registers. */
static inline __attribute__((always_inline)) void fold_keys(
    const int group, const int first, const float *keys, const int64_t key_stride, const float *values,
    const int64_t value_stride, const int num_keys, const int head_dim) {
    vf scores[SY_MAX_GROUP];
    float probs[SY_MAX_GROUP][SY_LANES];
    float corrections[SY_MAX_GROUP];
    for (int g = 0; g < group; g++) scores[g] = vsplat(0.0f);
    for (int d = 0; d < head_dim; d++) {
        const vf k = vload(keys + d * key_stride);
        for (int g = 0; g < group; g++) scores[g] += sy_queries[first + g][d] * k;
    }
    const vf lanes = vlane_index();
    const vi visible = lanes < vsplat((float)num_keys);
    for (int g = 0; g < group; g++) {
        const int i = first + g;
        const vf s = vselect(visible, scores[g], vsplat(-INFINITY));
        const float block_max = vhmax(s);
        const float new_max = block_max > sy_max[i] ? block_max : sy_max[i];
        corrections[g] = sy_max[i] == -INFINITY ? 0.0f : exp1(sy_max[i] - new_max);
        const vf p = vselect(visible, vexp(s - new_max), vsplat(0.0f));
        sy_sum[i] = sy_sum[i] * corrections[g] + vhsum(p);
        sy_max[i] = new_max;
        vstore(probs[g], p);
    }
    if (head_dim % SY_LANES == 0) {
        for (int c = 0; c < head_dim; c += SY_LANES) {
            vf acc[SY_MAX_GROUP];
            for (int g = 0; g < group; g++) acc[g] = vload(sy_acc[first + g] + c) * corrections[g];
            for (int t = 0; t < num_keys; t++) {
                const vf v = vload(values + t * value_stride + c);
                for (int g = 0; g < group; g++) acc[g] += probs[g][t] * v;
            }
            for (int g = 0; g < group; g++) vstore(sy_acc[first + g] + c, acc[g]);
        }
    } else {
        for (int g = 0; g < group; g++) {
            float *acc = sy_acc[first + g];
            for (int d = 0; d < head_dim; d++) acc[d] *= corrections[g];
            for (int t = 0; t < num_keys; t++) {
                const float weight = probs[g][t];
                const float *v = values + t * value_stride;
#pragma omp simd
                for (int d = 0; d < head_dim; d++) acc[d] += weight * v[d];
            }
        }
    }
}

static void fold_group(const int group, const int first, const float *keys, const int64_t key_stride,
                       const float *values, const int64_t value_stride, const int num_keys,
                       const int head_dim) {
    switch (group) {
        case 1: fold_keys(1, first, keys, key_stride, values, value_stride, num_keys, head_dim); break;
        case 2: fold_keys(2, first, keys, key_stride, values, value_stride, num_keys, head_dim); break;
        case 4: fold_keys(4, first, keys, key_stride, values, value_stride, num_keys, head_dim); break;
        case 8: fold_keys(8, first, keys, key_stride, values, value_stride, num_keys, head_dim); break;
        default:
            for (int g = 0; g < group; g++)
                fold_keys(1, first + g, keys, key_stride, values, value_stride, num_keys, head_dim);
    }
}

/* Asks for `num_floats` of keys and of values from `offset`, one 64-byte line at a time, into the L2
 * cache rather than L1: a block's keys and values are 32 KiB at the bench model's shapes, the whole L1
 * data cache of the Zen 4 core measured, and asked for into L1 the same step was slower. */
static inline void prefetch_lines(const SyLayerArgs *layer, int64_t offset, int64_t num_floats) {
    for (int64_t f = 0; f < num_floats; f += 64 / sizeof(float)) {
        __builtin_prefetch(layer->k_pool + offset + f, 0, 2);
        __builtin_prefetch(layer->v_pool + offset + f, 0, 2);
    }
}

/* A block-table entry names a whole block (>= 0) or, for a sequence's last block, half of one:
 * ~(2 * block + half), its keys and values from column half * block_size / 2 (half_blocks.py). A tail
 * in half 1 has at most block_size / 2 keys, so a vector of keys read from its column may reach past
 * its block's row by up to half a block: into the next row, or past the last block's keys into the
 * layer's values, which the runner allocates right after them (runner.py), never outside the pool. The
 * lanes past the visible keys are masked out. */
static inline int64_t block_of(int64_t entry) { return entry >= 0 ? entry : (~entry) >> 1; }

static inline int64_t column_of(int64_t entry, int64_t block_size) {
    return entry >= 0 ? 0 : ((~entry) & 1) * (block_size / 2);
}

static void attend_item(const SyStepArgs *step, const SyLayerArgs *layer, const int64_t *item) {
    const int64_t row = item[0], first_token = item[1], num_queries = item[2], first_position = item[3];
    const int head_dim = step->head_dim, block_size = step->block_size;
    const int num_heads = step->num_heads, kv_heads = step->num_kv_heads;
    const int group = num_heads / kv_heads;
    const int num_vectors = (int)num_queries * num_heads;
    const int64_t value_stride = (int64_t)kv_heads * head_dim; /* between a block's value slots */
    const int64_t *table = step->block_tables + row * step->table_stride;
    const int64_t last_position = first_position + num_queries - 1;
    const int64_t num_blocks = last_position / block_size + 1;

    for (int i = 0; i < num_vectors; i++) {
        const float *q = layer->q + (first_token + i / num_heads) * layer->q_token_stride +
                         (int64_t)(i % num_heads) * layer->q_head_stride;
        for (int d = 0; d < head_dim; d++) sy_queries[i][d] = q[d] * layer->scale;
        memset(sy_acc[i], 0, (size_t)head_dim * sizeof(float));
        sy_max[i] = -INFINITY;
        sy_sum[i] = 0.0f;
    }
    const int64_t block_floats = (int64_t)block_size * value_stride; /* one block of keys, or of values */
    /* Blocks are scattered over the pool, which defeats the hardware's prefetcher at each jump: the
     * first block is asked for before starting, and each next one while its predecessor is computed,
     * a KV head's share of it before each KV head's work: asked for all at once, the step was slower
     * (docs/architecture.md, "The kernel asks for the next block as it goes"). */
    const int64_t share = block_floats / kv_heads;
    prefetch_lines(layer, block_of(table[0]) * block_floats, block_floats);
    for (int64_t block = 0; block < num_blocks; block++) {
        const int64_t block_start = block * block_size, physical = block_of(table[block]);
        const int64_t column = column_of(table[block], block_size);
        for (int kv_head = 0; kv_head < kv_heads; kv_head++) {
            if (block + 1 < num_blocks)
                prefetch_lines(layer, block_of(table[block + 1]) * block_floats + kv_head * share, share);
            const float *keys =
                layer->k_pool + ((physical * kv_heads + kv_head) * head_dim) * block_size + column;
            const float *values = layer->v_pool + (physical * block_size + column) * value_stride +
                                  (int64_t)kv_head * head_dim;
            for (int query = 0; query < num_queries; query++) {
                /* keys this query may see in the block: up to its own position */
                const int64_t visible = first_position + query + 1 - block_start;
                const int num_keys = (int)(visible < block_size ? visible : block_size);
                for (int start = 0; start < num_keys; start += SY_LANES) {
                    const int n = num_keys - start < SY_LANES ? num_keys - start : SY_LANES;
                    fold_group(group, query * num_heads + kv_head * group, keys + start, block_size,
                               values + start * value_stride, value_stride, n, head_dim);
                }
            }
        }
    }
    for (int i = 0; i < num_vectors; i++) {
        float *o = layer->out + (first_token + i / num_heads) * layer->out_token_stride +
                   (int64_t)(i % num_heads) * layer->out_head_stride;
        const float inverse = 1.0f / sy_sum[i];
#pragma omp simd
        for (int d = 0; d < head_dim; d++) o[d] = sy_acc[i][d] * inverse;
    }
}

/* The one entry point: returns 0, or 1 for shapes past this file's limits (checked before any write). */
int sy_paged_attention(const SyStepArgs *step, const SyLayerArgs *layer) {
    if (step->head_dim > SY_MAX_HEAD_DIM || step->block_size > SY_MAX_BLOCK_SIZE ||
        step->block_size % SY_LANES != 0 || step->num_heads % step->num_kv_heads != 0)
        return 1;
    for (int64_t i = 0; i < step->num_items; i++)
        if (step->items[4 * i + 2] * step->num_heads > SY_MAX_VECTORS) return 1;
#pragma omp parallel num_threads(step->num_threads)
    {
        write_new_kv(step, layer); /* ends with the barrier every read below needs */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < step->num_items; i++) attend_item(step, layer, step->items + 4 * i);
    }
    return 0;
}
