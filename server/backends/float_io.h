// The one place where a backend that computes in fp32 meets the wire's dtypes: inputs widened to fp32 (borrowed in
// place when they already are fp32), outputs narrowed to the requested dtype (written in place when that is fp32).
// Host memory only.
#ifndef MHA_SERVER_BACKENDS_FLOAT_IO_H_
#define MHA_SERVER_BACKENDS_FLOAT_IO_H_

#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"
#include "server/backends/backend.h"

namespace mha {

// Where FloatInput and FloatOutput put an fp32 copy, and which threads convert it. Without one they use a vector of
// their own and the calling thread; the CPU backend passes buffers its threads keep across calls and its OpenMP
// team. Used by one call at a time.
class ConversionSpace {
 public:
  virtual ~ConversionSpace() = default;
  // At least `count` floats, valid until the next Room() call.
  virtual float* Room(int64_t count) = 0;
  // Calls convert(begin, n) on pieces that cover [0, count) once each, possibly on several threads at a time, and
  // returns when all are done.
  virtual void ForEachPiece(int64_t count, absl::FunctionRef<void(int64_t begin, int64_t n)> convert) = 0;
};

// An fp32 view of `count` elements of `tensor`: its own bytes when they are aligned fp32, else a decoded copy (in
// `space` when given; it must outlive this object). A tensor with no data gives nullptr.
class FloatInput {
 public:
  FloatInput(const ConstTensor& tensor, int64_t count, ConversionSpace* space = nullptr);
  FloatInput(const FloatInput&) = delete;
  FloatInput& operator=(const FloatInput&) = delete;

  const float* data() const { return data_; }

 private:
  std::vector<float> storage_;
  const float* data_ = nullptr;
};

// fp32 room for `count` elements of `tensor`: the backend writes fp32 into data(), then Finish() encodes it into the
// tensor's dtype (nothing to do when data() already is the tensor's bytes). The room is in `space` when given (it
// must outlive this object). An unrequested tensor gives nullptr.
class FloatOutput {
 public:
  FloatOutput(const MutableTensor& tensor, int64_t count, ConversionSpace* space = nullptr);
  FloatOutput(const FloatOutput&) = delete;
  FloatOutput& operator=(const FloatOutput&) = delete;

  float* data() { return data_; }
  void Finish();

 private:
  const MutableTensor tensor_;
  const int64_t count_;
  ConversionSpace* const space_;
  std::vector<float> storage_;
  float* data_ = nullptr;
  float* staged_ = nullptr;  // data_ when it is a copy to encode, else null
};

}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_FLOAT_IO_H_
