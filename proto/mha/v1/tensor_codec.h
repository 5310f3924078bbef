// Conversions between mha.v1.Tensor messages and plain fp32 arrays, shared by the server and the clients.
//
// A Tensor's bytes are row-major, little-endian elements of its dtype. fp16 and bf16 are widened exactly to fp32
// on decode and rounded to nearest even on encode (NaN stays NaN, overflow becomes inf).
#ifndef MHA_PROTO_TENSOR_CODEC_H_
#define MHA_PROTO_TENSOR_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "proto/mha/v1/attention.pb.h"

namespace mha {

// Bytes per element of a tensor on the wire; 0 for DATA_TYPE_UNSPECIFIED, for the cache-only dtypes (INT8,
// FP8_E4M3, FP8_E5M2) and for values outside the enum.
size_t DTypeSize(int dtype);
// Whether `dtype` is one of the 8-bit dtypes that only a KV cache stores (CreateSessionRequest.cache_dtype).
bool IsCacheOnlyDType(int dtype);
// "fp32", "fp16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2", "unspecified" or "dtype(<n>)".
std::string DTypeName(int dtype);

uint16_t FloatToHalf(float value);
float HalfToFloat(uint16_t bits);
uint16_t FloatToBf16(float value);
float Bf16ToFloat(uint16_t bits);

// Widens n elements of `dtype` at src (no alignment required) into dst. dtype must have a non-zero DTypeSize.
void DecodeToFloat(int dtype, const void* src, size_t n, float* dst);
// Narrows n fp32 values into n elements of `dtype` at dst (no alignment required).
void EncodeFromFloat(int dtype, const float* src, size_t n, void* dst);

// "[2, 3, 4]".
std::string ShapeString(absl::Span<const int64_t> shape);

// Product of dims; INVALID_ARGUMENT naming `field` if a dim is < 1 or the product (times 16 bytes of headroom)
// overflows int64.
absl::StatusOr<int64_t> CheckedElementCount(absl::Span<const int64_t> shape, absl::string_view field);

// Checks a tensor's dtype, that every dim is >= 1, and that data holds exactly product(shape) * dtype size
// bytes (a tensor in shared memory is refused: only the server's validation of the activations resolves those).
// Errors are INVALID_ARGUMENT and name `field`. Returns the element count.
absl::StatusOr<int64_t> CheckTensor(const v1::Tensor& tensor, absl::string_view field);
// The same without looking at where the bytes are: dtype and dims only.
absl::StatusOr<int64_t> CheckTensorHeader(const v1::Tensor& tensor, absl::string_view field);

// Index of the first NaN or infinite element among n elements of `dtype` at src (no alignment required), or -1
// when every one is finite. dtype must have a non-zero DTypeSize.
int64_t FirstNonFinite(int dtype, const void* src, size_t n);

// For a tensor that passed CheckTensor: INVALID_ARGUMENT naming `field`, the first non-finite element's index and
// its value when the tensor holds NaN or inf (the service rejects them rather than compute with them).
absl::Status CheckFinite(const v1::Tensor& tensor, absl::string_view field);
// The same for a tensor whose first non-finite element is already known to be `first_non_finite` (-1: none), its
// bytes at `data` (null: tensor.data()).
absl::Status NonFiniteError(const v1::Tensor& tensor, absl::string_view field, int64_t first_non_finite,
                            const char* data = nullptr);

// Decodes a tensor that passed CheckTensor into fp32.
std::vector<float> TensorToFloats(const v1::Tensor& tensor);

// Fills `tensor` with `shape`, `dtype` and the encoded values (values.size() must equal product(shape)).
void FloatsToTensor(absl::Span<const float> values, absl::Span<const int64_t> shape, v1::DataType dtype,
                    v1::Tensor* tensor);

}  // namespace mha

#endif  // MHA_PROTO_TENSOR_CODEC_H_
