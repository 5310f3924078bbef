// cuBLAS, loaded with dlopen when the CUDA backend starts on a machine with a GPU: the binary has no link-time
// dependency on its 570 MiB of libraries, so it starts without them (and without their 0.1 s of loading per
// process) everywhere else. Also the mapping of this project's row-major products onto cuBLAS's column-major ones.
#ifndef MHA_SERVER_BACKENDS_CUDA_CUBLAS_API_H_
#define MHA_SERVER_BACKENDS_CUDA_CUBLAS_API_H_

#include <cublas_v2.h>

#include <cstdint>

#include "absl/status/statusor.h"

namespace mha {
namespace cuda {

// The cuBLAS entry points the backend calls. Immutable once loaded; shared by every thread.
struct CublasApi {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetMathMode) set_math_mode = nullptr;
  decltype(&cublasGetVersion_v2) get_version = nullptr;
  // cublasGemmEx is overloaded in C++ (a legacy cudaDataType compute type): the C signature, spelled out.
  using GemmEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                    const void*, const void*, cudaDataType, int, const void*, cudaDataType, int,
                                    const void*, void*, cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
  GemmEx gemm_ex = nullptr;

  // Loads libcublas.so.13 once per process (later calls return the same result). UNAVAILABLE naming the library
  // and dlerror's message when it or a symbol is missing.
  static absl::StatusOr<const CublasApi*> Load();
};

// A column-major cublasGemmEx call without transposes: C[m x n] = A[m x k] B[k x n], leading dimensions lda, ldb,
// ldc, all in elements.
struct ColumnMajorGemm {
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* c = nullptr;
  int64_t ldc = 0;
};

// y[rows, n] (row stride ldy) = x[rows, k] (row stride ldx) w[k, n] (row stride ldw), all row-major. A row-major
// matrix is its transpose in column-major order, so this is y^T = w^T x^T: cuBLAS's C[n x rows] = A[n x k]
// B[k x rows] with A = w, B = x, C = y and the row strides as leading dimensions.
inline ColumnMajorGemm RowMajorGemm(int64_t rows, int64_t n, int64_t k, const void* x, int64_t ldx, const void* w,
                                    int64_t ldw, void* y, int64_t ldy) {
  ColumnMajorGemm g;
  g.m = n;
  g.n = rows;
  g.k = k;
  g.a = w;
  g.lda = ldw;
  g.b = x;
  g.ldb = ldx;
  g.c = y;
  g.ldc = ldy;
  return g;
}

}  // namespace cuda
}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_CUDA_CUBLAS_API_H_
