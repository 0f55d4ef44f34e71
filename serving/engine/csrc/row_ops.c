/* Row-wise operators of the engine's own Llama forward (serving/engine/native_ops.py), each one pass
 * over its rows where torch's eager operators take several: RMSNorm (transformers' arithmetic: the mean
 * of squares in fp32, x * rsqrt(mean + eps) * weight) and SiLU(gate) * up over a fused gate/up product.
 * Rows are split over the threads when there are enough of them to pay for waking a team. */

#include <math.h>
#include <stdint.h>

#include "vector_math.h"

#define SY_PARALLEL_MIN_ELEMENTS 32768

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
        int64_t i = 0;
        for (; i + SY_LANES <= width; i += SY_LANES) {
            const vf g = vload(gate + i);
            vstore(o + i, g / (1.0f + vexp(-g)) * vload(up + i));
        }
        for (; i < width; i++) o[i] = gate[i] / (1.0f + exp1(-gate[i])) * up[i];
    }
}
