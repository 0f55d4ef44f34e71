/* Row-wise operators of the engine's own Llama forward (serving/engine/native_ops.py), each one pass
 * over its rows where torch's eager operators take several: RMSNorm (transformers' arithmetic: the mean
 * of squares in fp32, x * rsqrt(mean + eps) * weight) and SiLU(gate) * up over a fused gate/up product.
 * Rows are split over the threads when there are enough of them to pay for waking a team. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#define SY_PARALLEL_MIN_ELEMENTS 32768

/* exp(x), clamped to [-87, 88]: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 Taylor polynomial;
 * n rounded by adding 1.5 * 2^23, whose float then holds n in its low bits. Relative error < 2e-7, and
 * branch-free, so the compiler vectorises loops of it (libm's expf is a call per element). */
static inline float sy_exp(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    const float magic = 12582912.0f;
    const float shifted = x * 1.44269504088896341f + magic;
    const float n = shifted - magic;
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits, magic_bits;
    memcpy(&bits, &shifted, sizeof bits);
    memcpy(&magic_bits, &magic, sizeof magic_bits);
    bits = (bits - magic_bits + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* out[r] = x[r] * 1 / sqrt(mean(x[r]^2) + eps) * weight, for `rows` rows of `dim` floats. */
void sy_rms_norm(const float *x, int64_t x_stride, const float *weight, float *out, int64_t out_stride,
                 int64_t rows, int64_t dim, float eps, int32_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * dim >= SY_PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *in = x + r * x_stride;
        float *o = out + r * out_stride;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t d = 0; d < dim; d++) sum += in[d] * in[d];
        const float inverse = 1.0f / sqrtf(sum / (float)dim + eps);
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) o[d] = weight[d] * (in[d] * inverse);
    }
}

/* out[r][i] = silu(gate_up[r][i]) * gate_up[r][width + i]: the gate is the first `width` columns of
 * each row, the up projection the next `width`. silu(g) = g / (1 + exp(-g)). */
void sy_silu_and_mul(const float *gate_up, int64_t gate_up_stride, float *out, int64_t out_stride,
                     int64_t rows, int64_t width, int32_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * width >= SY_PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * gate_up_stride;
        const float *up = gate + width;
        float *o = out + r * out_stride;
#pragma omp simd
        for (int64_t i = 0; i < width; i++) o[i] = gate[i] / (1.0f + sy_exp(-gate[i])) * up[i];
    }
}
