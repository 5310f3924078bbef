// A .npy file's bytes through the client's reader (client/npy.h). An array that parses must hold exactly its
// shape's bytes, survive SerializeNpy -> ParseNpy unchanged, and, when every dim is >= 1, convert to a Tensor that
// passes CheckTensor and back (NpyToTensor, NpyFromTensor) unchanged.
#include <cstdio>
#include <cstdlib>

#include "client/npy.h"
#include "proto/mha/v1/tensor_codec.h"

namespace {

void Fail(const char* what) {
  std::fprintf(stderr, "fuzz_npy: %s\n", what);
  std::abort();
}

bool Same(const mha::NpyArray& a, const mha::NpyArray& b) {
  return a.shape == b.shape && a.dtype == b.dtype && a.data == b.data;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mha;
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<NpyArray> array = ParseNpy(bytes, "fuzz.npy");
  if (!array.ok()) {
    if (array.status().code() != absl::StatusCode::kInvalidArgument) Fail(array.status().ToString().c_str());
    return 0;
  }
  if (array->data.size() != static_cast<size_t>(array->NumElements()) * DTypeSize(array->dtype)) {
    Fail("data size disagrees with the shape");
  }
  absl::StatusOr<NpyArray> again = ParseNpy(SerializeNpy(*array), "again.npy");
  if (!again.ok()) Fail(again.status().ToString().c_str());
  if (!Same(*array, *again)) Fail("SerializeNpy -> ParseNpy changed the array");

  v1::Tensor tensor;
  const int rank = static_cast<int>(array->shape.size());
  if (NpyToTensor(*array, rank, "tensor", "any", &tensor).ok()) {
    if (!CheckTensor(tensor, "tensor").ok()) Fail("NpyToTensor made a tensor CheckTensor rejects");
    if (!Same(NpyFromTensor(tensor), *array)) Fail("NpyFromTensor(NpyToTensor(a)) != a");
  }
  return 0;
}
