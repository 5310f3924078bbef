// The one place where a backend that computes in fp32 meets the wire's dtypes: inputs widened to fp32 (borrowed in
// place when they already are fp32), outputs narrowed to the requested dtype (written in place when that is fp32).
// Host memory only.
#ifndef MHA_SERVER_BACKENDS_FLOAT_IO_H_
#define MHA_SERVER_BACKENDS_FLOAT_IO_H_

#include <cstdint>
#include <vector>

#include "server/backends/backend.h"

namespace mha {

// An fp32 view of `count` elements of `tensor`: its own bytes when they are aligned fp32, else a decoded copy.
// A tensor with no data gives nullptr.
class FloatInput {
 public:
  FloatInput(const ConstTensor& tensor, int64_t count);
  FloatInput(const FloatInput&) = delete;
  FloatInput& operator=(const FloatInput&) = delete;

  const float* data() const { return data_; }

 private:
  std::vector<float> storage_;
  const float* data_ = nullptr;
};

// fp32 room for `count` elements of `tensor`: the backend writes fp32 into data(), then Finish() encodes it into the
// tensor's dtype (nothing to do when data() already is the tensor's bytes). An unrequested tensor gives nullptr.
class FloatOutput {
 public:
  FloatOutput(const MutableTensor& tensor, int64_t count);
  FloatOutput(const FloatOutput&) = delete;
  FloatOutput& operator=(const FloatOutput&) = delete;

  float* data() { return data_; }
  void Finish();

 private:
  MutableTensor tensor_;
  int64_t count_;
  std::vector<float> storage_;
  float* data_ = nullptr;
};

}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_FLOAT_IO_H_
