// The emulated cuBLAS (runtime.h): CublasApi::Load() hands the backend these host functions instead of
// libcublas's. cublasGemmEx is emulated for what the backend asks of it (no transposes, fp32/fp16/bf16 inputs of
// one type, output in that type or fp32, fp32 accumulation, host alpha and beta) and enqueued on the handle's stream;
// any other call returns CUBLAS_STATUS_NOT_SUPPORTED, and operands outside their allocations
// CUBLAS_STATUS_INVALID_VALUE.
#include <cublas_v2.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/backends/cuda/cublas_api.h"
#include "tests/emulated_cuda/runtime.h"

// cuBLAS's opaque handle type, defined here.
struct cublasContext {
  cudaStream_t stream = nullptr;
  cublasMath_t math = CUBLAS_DEFAULT_MATH;
};

namespace mha {
namespace cuda {
namespace {

cublasStatus_t Create(cublasHandle_t* handle) {
  *handle = new cublasContext;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t Destroy(cublasHandle_t handle) {
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t SetStream(cublasHandle_t handle, cudaStream_t stream) {
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t SetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  handle->math = mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t GetVersion(cublasHandle_t, int* version) {
  *version = CUBLAS_VERSION;
  return CUBLAS_STATUS_SUCCESS;
}

// The wire dtype of a cuBLAS data type, or 0.
int Dtype(cudaDataType type) {
  switch (type) {
    case CUDA_R_32F:
      return v1::FP32;
    case CUDA_R_16F:
      return v1::FP16;
    case CUDA_R_16BF:
      return v1::BF16;
    default:
      return 0;
  }
}

// fp32 rounded to TF32's 10 mantissa bits (to nearest, ties away, as the tensor cores' conversion).
float ToTf32(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0x7f800000u) != 0x7f800000u) bits = (bits + 0x1000u) & 0xffffe000u;
  std::memcpy(&x, &bits, 4);
  return x;
}

// A column-major matrix of `rows` x `cols` with leading dimension ld, decoded to fp32.
std::vector<float> Decode(int dtype, const void* data, int rows, int cols, int ld, bool tf32) {
  std::vector<float> m(static_cast<size_t>(rows) * cols);
  const size_t size = DTypeSize(dtype);
  for (int j = 0; j < cols; ++j) {
    DecodeToFloat(dtype, static_cast<const char*>(data) + static_cast<size_t>(j) * ld * size, rows,
                  m.data() + static_cast<size_t>(j) * rows);
  }
  if (tf32) {
    for (float& x : m) x = ToTf32(x);
  }
  return m;
}

// Bytes a column-major operand spans.
int64_t Span(int rows, int cols, int ld, int dtype) {
  return rows == 0 || cols == 0 ? 0 : (static_cast<int64_t>(cols - 1) * ld + rows) * DTypeSize(dtype);
}

cublasStatus_t Gemm(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k,
                    const void* alpha, const void* a, cudaDataType a_type, int lda, const void* b,
                    cudaDataType b_type, int ldb, const void* beta, void* c, cudaDataType c_type, int ldc,
                    cublasComputeType_t compute, cublasGemmAlgo_t) {
  const int ta = Dtype(a_type), tc = Dtype(c_type);
  const bool tf32 = compute == CUBLAS_COMPUTE_32F_FAST_TF32 || handle->math == CUBLAS_TF32_TENSOR_OP_MATH;
  if (transa != CUBLAS_OP_N || transb != CUBLAS_OP_N || ta == 0 || b_type != a_type ||
      (tc != ta && tc != v1::FP32) || (compute != CUBLAS_COMPUTE_32F && compute != CUBLAS_COMPUTE_32F_FAST_TF32)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (m < 0 || n < 0 || k < 0 || lda < std::max(1, m) || ldb < std::max(1, k) || ldc < std::max(1, m)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if ((k > 0 && (!emulation::IsDeviceRange(a, Span(m, k, lda, ta)) ||
                 !emulation::IsDeviceRange(b, Span(k, n, ldb, ta)))) ||
      !emulation::IsDeviceRange(c, Span(m, n, ldc, tc))) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  float alpha_value, beta_value;
  std::memcpy(&alpha_value, alpha, 4);
  std::memcpy(&beta_value, beta, 4);
  const bool tf32_inputs = tf32 && ta == v1::FP32;
  emulation::EnqueueWork(handle->stream, [=] {
    const std::vector<float> A = Decode(ta, a, m, k, lda, tf32_inputs), B = Decode(ta, b, k, n, ldb, tf32_inputs);
    // beta == 0: C is not read (it may hold anything, NaN included), as cuBLAS documents.
    std::vector<float> C = beta_value == 0.0f ? std::vector<float>(static_cast<size_t>(m) * n)
                                              : Decode(tc, c, m, n, ldc, false);
    for (int j = 0; j < n; ++j) {
      for (int i = 0; i < m; ++i) {
        float sum = 0.0f;
        for (int p = 0; p < k; ++p) sum += A[static_cast<size_t>(p) * m + i] * B[static_cast<size_t>(j) * k + p];
        float& out = C[static_cast<size_t>(j) * m + i];
        out = alpha_value * sum + (beta_value == 0.0f ? 0.0f : beta_value * out);
      }
    }
    const size_t size = DTypeSize(tc);
    for (int j = 0; j < n; ++j) {
      EncodeFromFloat(tc, C.data() + static_cast<size_t>(j) * m, m,
                      static_cast<char*>(c) + static_cast<size_t>(j) * ldc * size);
    }
    return cudaSuccess;
  });
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

absl::StatusOr<const CublasApi*> CublasApi::Load() {
  static const CublasApi* const api = [] {
    auto* table = new CublasApi;
    table->create = Create;
    table->destroy = Destroy;
    table->set_stream = SetStream;
    table->set_math_mode = SetMathMode;
    table->get_version = GetVersion;
    table->gemm_ex = Gemm;
    return table;
  }();
  return api;
}

}  // namespace cuda
}  // namespace mha
