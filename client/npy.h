// Reads and writes numpy's .npy files (numpy.lib.format), the client's on-disk form of tensors.
//
// A .npy file is the magic "\x93NUMPY", a major and minor version byte, the header length (2 bytes little-endian in
// version 1.0; 4 bytes in 2.0 and 3.0, whose header is UTF-8 instead of Latin-1), the header itself: a Python dict
// literal {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), } padded with spaces and ended by '\n', then
// the elements. Supported here: dtypes '<f4' (float32) and '<f2' (float16) in C order, any number of dimensions
// (0-d holds one element; a dim may be 0). Everything else is rejected with INVALID_ARGUMENT naming the file.
#ifndef MHA_CLIENT_NPY_H_
#define MHA_CLIENT_NPY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/mha/v1/attention.pb.h"

namespace mha {

struct NpyArray {
  std::vector<int64_t> shape;     // () for a 0-d array; dims are >= 0.
  v1::DataType dtype = v1::FP32;  // FP32 ('<f4') or FP16 ('<f2').
  std::string data;               // NumElements() * DTypeSize(dtype) bytes, little-endian, C (row-major) order.

  // Product of shape (1 for a 0-d array).
  int64_t NumElements() const;
};

// Parses a .npy file's bytes; `origin` (usually the path) starts every error message. INVALID_ARGUMENT for a bad
// magic, an unknown version, a malformed or truncated header, a dtype other than '<f4'/'<f2', Fortran order, or
// data that is shorter or longer than the shape says.
absl::StatusOr<NpyArray> ParseNpy(absl::string_view bytes, absl::string_view origin);

// ParseNpy of the file at `path`; NOT_FOUND if it cannot be opened.
absl::StatusOr<NpyArray> ReadNpy(const std::string& path);

// The .npy bytes of `array`, byte-for-byte what numpy.save writes for the same array: version 1.0 (2.0 when the
// header exceeds 65535 bytes), keys sorted, 64-byte aligned data. array.data must hold NumElements() elements.
std::string SerializeNpy(const NpyArray& array);

// Writes SerializeNpy(array) to `path` (replaced if present). INTERNAL naming the path if writing fails.
absl::Status WriteNpy(const std::string& path, const NpyArray& array);

// The array form of a tensor that passed CheckTensor: FP32 and FP16 are copied; BF16 (which numpy lacks) is
// widened exactly to FP32.
NpyArray NpyFromTensor(const v1::Tensor& tensor);

// The tensor form of `array` (shape, dtype and bytes copied). INVALID_ARGUMENT naming `field` unless the array has
// `rank` dimensions, each >= 1 (the wire contract's Tensor has no empty dims); `layout` (e.g. "[B, Tq, d_model]")
// explains the expected shape in the message.
absl::Status NpyToTensor(const NpyArray& array, int rank, absl::string_view field, absl::string_view layout,
                         v1::Tensor* tensor);

// numpy's repr of a shape: "()", "(5,)", "(2, 3)".
std::string NpyShapeString(const std::vector<int64_t>& shape);

}  // namespace mha

#endif  // MHA_CLIENT_NPY_H_
