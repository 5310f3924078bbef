#include "tests/fuzz/fuzz_env.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "proto/mha/v1/tensor_codec.h"
#include "server/calls/execute.h"
#include "server/config/server_options.h"

namespace mha::fuzz {

void FillFixed(absl::Span<const int64_t> shape, v1::Tensor* t) {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  std::vector<float> values(n);
  const int64_t offset = shape.empty() ? 0 : shape[0];
  for (int64_t i = 0; i < n; ++i) values[i] = std::sin(0.37f * static_cast<float>(i + offset)) * 0.3f;
  FloatsToTensor(values, shape, v1::FP32, t);
}

namespace {

// A [rows, cols] tensor ([rows] when cols is 0) of FillFixed's values.
void Fill(int64_t rows, int64_t cols, v1::Tensor* t) {
  if (cols == 0) {
    FillFixed({rows}, t);
  } else {
    FillFixed({rows, cols}, t);
  }
}

std::shared_ptr<const Layer> MakeLayer(const char* name, int64_t d_model, int64_t d_kv_in, int64_t d_v_in, int heads,
                                       int kv_heads, int head_dim, bool bias, bool causal) {
  v1::AttentionWeights w;
  Fill(d_model, heads * head_dim, w.mutable_w_q());
  Fill(d_kv_in, kv_heads * head_dim, w.mutable_w_k());
  Fill(d_v_in, kv_heads * head_dim, w.mutable_w_v());
  Fill(heads * head_dim, d_model, w.mutable_w_o());
  if (bias) {
    Fill(heads * head_dim, 0, w.mutable_b_q());
    Fill(kv_heads * head_dim, 0, w.mutable_b_k());
    Fill(kv_heads * head_dim, 0, w.mutable_b_v());
    Fill(d_model, 0, w.mutable_b_o());
  }
  v1::HeadConfig h;
  h.set_num_heads(heads);
  h.set_num_kv_heads(kv_heads);
  h.set_head_dim(head_dim);
  h.set_causal(causal);
  absl::StatusOr<std::shared_ptr<const Layer>> layer = BuildLayer(name, "builtin", w, h, name);
  if (!layer.ok()) {
    std::fprintf(stderr, "fuzz_env: layer %s: %s\n", name, std::string(layer.status().message()).c_str());
    std::abort();
  }
  return *layer;
}

Env* MakeEnv() {
  auto* env = new Env;
  env->registry = BackendRegistry::Create();
  env->reference = *env->registry->Find(kReferenceBackend, "backend");
  absl::StatusOr<Backend*> cpu = env->registry->Find(kCpuBackend, "backend");
  if (!cpu.ok()) {
    std::fprintf(stderr, "fuzz_env: %s\n", std::string(cpu.status().message()).c_str());
    std::abort();
  }
  env->cpu = *cpu;
  for (const BackendFactory& factory : BackendRegistry::Factories()) {
    if (factory.name != kCpuBackend || factory.variant.empty()) continue;
    absl::StatusOr<std::unique_ptr<Backend>> backend = factory.create();
    if (backend.ok()) env->cpu_variants.push_back(*std::move(backend));  // else: not on this CPU
  }
  const ServerOptions options;
  env->layers = std::make_unique<LayerStore>(static_cast<int64_t>(options.max_layer_mb) << 20, options.max_layers);
  for (auto layer : {MakeLayer("tiny", 8, 8, 8, 2, 2, 4, false, false), MakeLayer("gqa", 12, 6, 5, 4, 2, 3, true, true)}) {
    if (!env->layers->Add(layer).ok()) std::abort();
  }
  env->context.layers = env->layers.get();
  env->context.backends = env->registry.get();
  env->context.max_message_bytes = static_cast<int64_t>(options.max_message_mb) << 20;
  env->context.max_scratch_bytes = static_cast<int64_t>(options.max_scratch_mb) << 20;
  env->context.max_request_flops = options.max_request_gflop * 1e9;
  env->context.max_reference_flops = options.max_reference_gflop * 1e9;

  // The "shm" region: created, registered (the registry maps it by name), then unlinked, so that nothing is left in
  // /dev/shm however the process ends; the mappings keep the memory.
  const std::string key = "/mha_fuzz_" + std::to_string(getpid());
  const int fd = shm_open(key.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0 || ftruncate(fd, kSharedMemoryBytes) != 0) std::abort();
  void* bytes = mmap(nullptr, kSharedMemoryBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (bytes == MAP_FAILED) std::abort();
  env->shared_bytes = static_cast<char*>(bytes);
  env->shared_memory = std::make_unique<SharedMemoryRegistry>(1, kSharedMemoryBytes);
  const absl::Status registered = env->shared_memory->Register("shm", key, kSharedMemoryBytes);
  shm_unlink(key.c_str());
  if (!registered.ok()) Fail("registering the fuzz region", registered);
  env->context.shared_memory = env->shared_memory.get();
  return env;
}

int64_t counts[3] = {0, 0, 0};

void PrintCounts() {
  std::fprintf(stderr, "fuzz stats: parsed %lld, valid %lld, computed %lld\n", static_cast<long long>(counts[0]),
               static_cast<long long>(counts[1]), static_cast<long long>(counts[2]));
}

}  // namespace

void Count(Stage stage) {
  static const bool enabled = [] {
    const char* env = std::getenv("MHA_FUZZ_STATS");
    const bool on = env != nullptr && std::string(env) == "1";
    if (on) std::atexit(PrintCounts);
    return on;
  }();
  if (enabled) ++counts[static_cast<int>(stage)];
}

std::vector<Backend*> Env::BackendsFor(size_t input_size) const {
  std::vector<Backend*> backends = {reference, cpu};
  if (!cpu_variants.empty()) backends.push_back(cpu_variants[input_size % cpu_variants.size()].get());
  return backends;
}

const Env& GetEnv() {
  static const Env* env = MakeEnv();
  return *env;
}

void ResetSharedMemory(const Env& env) {
  const float quarter = 0.25f;
  for (int64_t at = 0; at < kSharedMemoryBytes; at += sizeof(quarter)) {
    std::memcpy(env.shared_bytes + at, &quarter, sizeof(quarter));
  }
}

void CheckComputedOutput(const AttentionPlan& plan, const v1::Tensor& tensor) {
  if (plan.output_to == nullptr) return CheckOutput(tensor, "output");
  const absl::StatusOr<int64_t> count = CheckTensorHeader(tensor, "output");
  if (!count.ok() || !tensor.data().empty() || !tensor.has_shared_memory()) {
    Fail("an output in shared memory is described wrongly", count.ok() ? absl::InternalError("") : count.status());
  }
}

bool SmallEnough(const AttentionPlan& plan) {
  return plan.flops <= kMaxComputeFlops && plan.response_bytes + plan.workspace_bytes <= kMaxComputeBytes;
}

void CheckOutput(const v1::Tensor& tensor, const char* what) {
  const absl::StatusOr<int64_t> count = CheckTensor(tensor, what);
  if (!count.ok()) {
    std::fprintf(stderr, "fuzz: a computed %s is malformed: %s\n", what, std::string(count.status().message()).c_str());
    std::abort();
  }
}

void RunLayer(const std::shared_ptr<const Layer>& layer, const std::vector<Backend*>& backends) {
  const LayerShape& shape = layer->shape;
  if (shape.d_model > 4096 || shape.d_kv_in > 4096 || shape.d_v_in > 4096) return;
  // Self-attention when the layer allows it (d_kv_in = d_v_in = d_model), else a key and a value of their own.
  auto fixed_values = [](int64_t n) {
    std::vector<float> v(n);
    for (int64_t i = 0; i < n; ++i) v[i] = 0.25f * static_cast<float>(i % 7) - 0.5f;
    return v;
  };
  v1::Tensor query, key, value;
  FloatsToTensor(fixed_values(2 * shape.d_model), {1, 2, shape.d_model}, v1::FP32, &query);
  MhaPlan plan;
  plan.layer = layer;
  plan.query = plan.key = plan.value = &query;
  plan.kv_source = KvSource::kQuery;
  if (!shape.fused_qkv()) {
    FloatsToTensor(fixed_values(2 * shape.d_kv_in), {1, 2, shape.d_kv_in}, v1::FP32, &key);
    FloatsToTensor(fixed_values(2 * shape.d_v_in), {1, 2, shape.d_v_in}, v1::FP32, &value);
    plan.key = &key;
    plan.value = &value;
    plan.kv_source = KvSource::kKeyValue;
  }
  AttentionShape& s = plan.problem.shape;
  s.batch = 1;
  s.q_len = s.kv_len = 2;
  s.d_model = shape.d_model;
  s.d_kv_in = shape.d_kv_in;
  s.d_v_in = shape.d_v_in;
  s.heads = shape.heads;
  plan.problem.return_weights = true;
  plan.flops = AttentionFlops(s);
  plan.response_bytes = 4 * (2 * s.d_model + s.heads.num_heads * 4);
  for (Backend* backend : backends) {
    plan.backend = backend;
    plan.workspace_bytes = backend->WorkspaceBytes(plan.problem);
    if (!SmallEnough(plan)) return;
    Count(Stage::kComputed);
    MhaReply reply;
    const absl::Status status = ExecuteMultiHeadAttention(plan, nullptr, &reply);
    if (!status.ok()) {
      std::fprintf(stderr, "fuzz: a valid layer's call failed on %s: %s\n", std::string(backend->name()).c_str(),
                   std::string(status.message()).c_str());
      std::abort();
    }
    const v1::MultiHeadAttentionResponse response = reply.Assembled();
    CheckOutput(response.output(), "output");
    CheckOutput(response.attention_weights(), "attention_weights");
  }
}

void Fail(const char* what, const absl::Status& status) {
  std::fprintf(stderr, "%s: %s\n", what, status.ToString().c_str());
  std::abort();
}

void CheckRefusal(const absl::Status& status, std::initializer_list<absl::StatusCode> allowed) {
  if (std::find(allowed.begin(), allowed.end(), status.code()) == allowed.end()) {
    Fail("validation returned a code the contract does not name", status);
  }
  if (status.message().empty()) Fail("error without a message", status);
}

}  // namespace mha::fuzz
