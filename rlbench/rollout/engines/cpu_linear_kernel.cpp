// y = x @ w.T (+ bias) for a few rows of x, float32, AVX2 + FMA: the decoding step's products on CPU.
// Built on first use by rlbench/rollout/cpu_linear.py (torch.utils.cpp_extension); see its docstring.
//
// Each output y[m, n] is one dot product over k = 0, 8, 16, ... in eight float lanes, the lanes summed
// in a fixed order at the end. It depends on x's row m and w's row n only: not on the other rows of the
// batch, nor on how many threads share the work (threads split n). w's rows are read from memory once
// per call: for each block of 4 of them, every row of x is multiplied while they sit in L1.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int kRowsPerBlock = 3;     // rows of x per inner block
constexpr int kOutputsPerBlock = 4;  // rows of w per inner block: 3 x 4 = 12 accumulators

inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[m0 .. m0+MB, n0 .. n0+NB] for K a multiple of 8
template <int MB, int NB>
inline void dot_block(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N,
                      int64_t m0, int64_t n0) {
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm256_loadu_ps(w + (n0 + j) * K + k);
    for (int i = 0; i < MB; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + (m0 + i) * K + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      y[(m0 + i) * N + n0 + j] = lane_sum(acc[i][j]) + (bias ? bias[n0 + j] : 0.0f);
}

template <int NB>
inline void output_block(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K,
                         int64_t N, int64_t n0) {
  int64_t m = 0;
  for (; m + kRowsPerBlock <= M; m += kRowsPerBlock) dot_block<kRowsPerBlock, NB>(x, w, bias, y, K, N, m, n0);
  if (M - m == 2) dot_block<2, NB>(x, w, bias, y, K, N, m, n0);
  if (M - m == 1) dot_block<1, NB>(x, w, bias, y, K, N, m, n0);
}

}  // namespace

torch::Tensor few_rows_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "few_rows_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "few_rows_linear: float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.device().is_cpu() && w.device().is_cpu(),
              "few_rows_linear: contiguous CPU tensors only");
  TORCH_CHECK(x.size(1) % 8 == 0, "few_rows_linear: K must be a multiple of 8");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "few_rows_linear: bias must be a contiguous float32 [N]");
    b = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = N / kOutputsPerBlock;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) output_block<kOutputsPerBlock>(xp, wp, b, yp, M, K, N, blk * kOutputsPerBlock);
  });
  for (int64_t n = blocks * kOutputsPerBlock; n < N; ++n) output_block<1>(xp, wp, b, yp, M, K, N, n);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("few_rows_linear", &few_rows_linear, "x @ w.T + bias for a few rows of x (float32, AVX2 + FMA)");
}
