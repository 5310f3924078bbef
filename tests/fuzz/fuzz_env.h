// What the libFuzzer targets share (docs/FUZZING.md): the backends, a layer store holding small registered layers,
// the server's validation context with its default limits, and the rule for which valid requests are computed.
//
// Nothing here starts a gRPC server: a target calls the functions service.cc calls (validate, execute, the layer
// store) on the request it parsed.
#ifndef MHA_TESTS_FUZZ_FUZZ_ENV_H_
#define MHA_TESTS_FUZZ_FUZZ_ENV_H_

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "proto/mha/v1/attention.pb.h"
#include "server/backends/registry.h"
#include "server/calls/validate.h"
#include "server/layers/layer_store.h"

namespace mha::fuzz {

// A valid request is computed only when it is this small, so that an execution stays in the milliseconds under
// ASan: at most this much work (AttentionFlops) and this many bytes of response plus backend working memory.
constexpr double kMaxComputeFlops = 2e6;
constexpr int64_t kMaxComputeBytes = 8 << 20;

// Layers registered in Env::layers: "tiny" (d_model 8, 2 heads of 4, fused Q|K|V, no bias) and
// "gqa" (d_model 12, d_kv_in 6, d_v_in 5, 4 query heads on 2 KV heads of 3, every bias, causal). The seed generator
// writes requests against them; "demo" (d_model 512) is not registered, so that start-up stays quick and a request
// naming it exercises NOT_FOUND.
struct Env {
  std::unique_ptr<BackendRegistry> registry;
  // What a request may run on: the reference backend, the CPU backend as the server runs it, and each CPU tile-kernel
  // variant this machine runs (one per input, chosen by the input's size, so that every set gets inputs).
  Backend* reference = nullptr;
  Backend* cpu = nullptr;
  std::vector<std::unique_ptr<Backend>> cpu_variants;
  std::unique_ptr<LayerStore> layers;
  // One shared-memory region, "shm" (kSharedMemoryBytes of a /mha_fuzz_<pid> object), so that references in a
  // request reach the bounds checks, the in-place scan and the backends; refilled before each input
  // (ResetSharedMemory), since outputs written there would otherwise carry state from one input to the next.
  std::unique_ptr<SharedMemoryRegistry> shared_memory;
  char* shared_bytes = nullptr;
  ValidationContext context;  // ServerOptions' defaults, shared memory on

  // The backends an input of `input_size` bytes is computed on.
  std::vector<Backend*> BackendsFor(size_t input_size) const;
};

inline constexpr int64_t kSharedMemoryBytes = 64 << 10;

// Built once per process (the first call), then shared.
const Env& GetEnv();

// Fills the "shm" region with the same small finite values (fp32 0.25 = bf16 pair 0x3e80 0x0000, fp16 pair ...).
void ResetSharedMemory(const Env& env);

// The output of a computed call, in the response or (output_shared_memory) only described there.
void CheckComputedOutput(const AttentionPlan& plan, const v1::Tensor& tensor);

// A tensor of `shape` holding fixed, varied fp32 values (no randomness: a run must be reproducible from its input
// alone).
void FillFixed(absl::Span<const int64_t> shape, v1::Tensor* t);

// Whether a plan is small enough to compute (kMaxComputeFlops, kMaxComputeBytes).
bool SmallEnough(const AttentionPlan& plan);

// A layer's own tiny call: self-attention on a [1, 2, d_model] fp32 query of fixed values through every backend of
// `backends`, when the call is SmallEnough. Used by the LoadLayer and safetensors targets on a layer they built.
void RunLayer(const std::shared_ptr<const Layer>& layer, const std::vector<Backend*>& backends);

// How far an input got, counted per process; with MHA_FUZZ_STATS=1 in the environment the counts are printed at exit
// (MHA_FUZZ_STATS=1 tests/fuzz/run.sh ... shows them in its summary), so that one can see how much of the fuzzing reaches validation's end and the backends.
enum class Stage { kParsed, kValid, kComputed };
void Count(Stage stage);

// Prints "<what>: <status>" and aborts: a finding for the fuzzer.
[[noreturn]] void Fail(const char* what, const absl::Status& status);

// For a validation that refused its input: aborts unless the code is one of `allowed` (what the contract names for
// that step) and the status has a message.
void CheckRefusal(const absl::Status& status, std::initializer_list<absl::StatusCode> allowed);

// Aborts (a finding for the fuzzer) unless an output tensor passes CheckTensor: its bytes hold its shape and dtype.
void CheckOutput(const v1::Tensor& tensor, const char* what);

}  // namespace mha::fuzz

#endif  // MHA_TESTS_FUZZ_FUZZ_ENV_H_
