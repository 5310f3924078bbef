// The one seam between the service and the code that computes attention.
//
// Every backend computes the same math (see proto/mha/v1/attention.proto):
//   scores[b,h,i,j] = scale * <q[b,i,h,:], k[b,j,h/G,:]> + additive[(b,)i,j]     (G = H / Hkv)
//   key j is masked for query i when causal and j > i + (Tk - Tq), when j >= key_lengths[b], or when the
//   additive mask is -inf;
//   p = softmax_j(scores) over unmasked keys; a row with no unmasked key gets p = 0 (and so a zero output);
//   out[b,i,h,:] = sum_j p[b,h,i,j] v[b,j,h/G,:].
// Activations arrive as the wire sent them (fp32, fp16 or bf16 bytes) and outputs are written in the dtype the
// request asked for; a backend that computes in fp32 converts through backends/float_io.h. The reference backend is
// the ground truth; tests/backend_conformance_test.cc runs every other backend against it.
#ifndef MHA_SERVER_BACKENDS_BACKEND_H_
#define MHA_SERVER_BACKENDS_BACKEND_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "proto/mha/v1/attention.pb.h"
#include "proto/mha/v1/attention_shape.h"

namespace mha {

// Backend names: the registry's keys, GetServerInfo's names and the response's `backend` field.
inline constexpr absl::string_view kReferenceBackend = "reference";
inline constexpr absl::string_view kCpuBackend = "cpu";
inline constexpr absl::string_view kCudaBackend = "cuda";

// A borrowed input tensor: row-major elements of `dtype` (FP32, FP16 or BF16), any alignment.
struct ConstTensor {
  const void* data = nullptr;
  v1::DataType dtype = v1::FP32;
};

// A borrowed output tensor the backend fills. data == nullptr means the output was not requested.
struct MutableTensor {
  void* data = nullptr;
  v1::DataType dtype = v1::FP32;

  bool requested() const { return data != nullptr; }
};

// Softmax statistics per query row (attention.proto's lse and HeadStats), which the attention kernels compute from
// the running max and sum they keep: fp32 arrays of one value per (batch item, head, query row), [B, H, Tq] (a
// paged sequence's [H, n]), each null when not asked for. A row with no visible key gets lse -inf and 0 for the
// rest. lse alone may be asked for; entropy, confidence, distance and sink come together; contribution only with
// W_O (MultiHeadAttention, layer sessions).
struct RowStats {
  float* lse = nullptr;           // natural log of sum_j exp(s_j) over the visible scaled, masked scores s_j
  float* entropy = nullptr;       // -sum_j p_j ln p_j
  float* confidence = nullptr;    // max_j p_j
  float* distance = nullptr;      // sum_j p_j |pos - j|, pos the query's position (bottom-right aligned)
  float* sink = nullptr;          // sum over j < sink_tokens of p_j
  float* contribution = nullptr;  // ||head W_O[h]|| / ||output row|| (0 for a zero output row)
  int64_t sink_tokens = 4;

  bool any() const { return lse != nullptr || entropy != nullptr || contribution != nullptr; }
  bool softmax() const { return lse != nullptr || entropy != nullptr; }  // the kernels' part
  // The same arrays for the rows from `offset` on.
  RowStats At(int64_t offset) const;
};

// What a backend is asked to compute, as far as choosing and sizing the work goes: the shape, the activations'
// wire dtype, the requested output dtype, and whether attention weights and softmax statistics are returned.
struct AttentionProblem {
  AttentionShape shape;
  v1::DataType input_dtype = v1::FP32;
  bool mixed_inputs = false;  // the activations come in more than one dtype (input_dtype: the first not FP32)
  v1::DataType output_dtype = v1::FP32;
  bool return_weights = false;
  bool return_stats = false;  // lse or head statistics (RowStats)
};

// Masks beyond causal; all optional and borrowed for the duration of one call.
struct AttentionMask {
  absl::Span<const int32_t> key_lengths;  // empty, or B values in [0, Tk]
  // nullptr, or fp32 [Tq, Tk] / [B, Tq, Tk] (additive_per_batch): finite values and -inf only (checked when it was
  // decoded), host memory.
  const float* additive = nullptr;
  bool additive_per_batch = false;
};

// Asks a running computation to stop: the client cancelled, its deadline passed, or the server is shutting down.
// Backends poll it between blocks of work (a query block of a head, a slice of a projection's rows), so that a
// call stops within tens of milliseconds of work. Thread-safe.
class StopSignal {
 public:
  virtual ~StopSignal() = default;
  // OK to go on; otherwise the status the call ends with (CANCELLED, DEADLINE_EXCEEDED or UNAVAILABLE).
  virtual absl::Status Check() const = 0;
};

// Scaled dot-product attention on head-packed (BSHD) tensors. shape.d_model is 0.
struct SdpaArgs {
  AttentionShape shape;
  AttentionMask mask;
  const StopSignal* stop = nullptr;  // null: runs to the end
  ConstTensor q;          // [B, Tq, H, d_k]
  ConstTensor k;          // [B, Tk, Hkv, d_k]
  ConstTensor v;          // [B, Tk, Hkv, d_k]
  MutableTensor out;      // [B, Tq, H, d_k]
  MutableTensor weights;  // [B, H, Tq, Tk], when requested
  RowStats stats;         // [B, H, Tq] each, when requested (no contribution)
};

// fp32 projection weights in host memory, Y = X W convention (W is [in, out] row-major, row stride ld_*). Borrowed.
// When fused_qkv, w_q, w_k and w_v are the column blocks of one [d_model, (H + 2 Hkv) d_k] matrix (w_k = w_q + H d_k,
// w_v = w_k + Hkv d_k, every ld the full width) and b_q, b_k, b_v likewise of one bias (all three set, or none):
// a self-attention call may project Q|K|V as one product.
struct LayerWeights {
  const float* w_q = nullptr;  // [d_model, H d_k]
  const float* w_k = nullptr;  // [d_kv_in, Hkv d_k]
  const float* w_v = nullptr;  // [d_v_in, Hkv d_k]
  const float* w_o = nullptr;  // [H d_k, d_model], row stride d_model
  int64_t ld_q = 0, ld_k = 0, ld_v = 0;
  const float* b_q = nullptr;  // [H d_k] or nullptr (zero)
  const float* b_k = nullptr;  // [Hkv d_k] or nullptr
  const float* b_v = nullptr;  // [Hkv d_k] or nullptr
  const float* b_o = nullptr;  // [d_model] or nullptr
  bool fused_qkv = false;
  // Names these weights for a device backend's cache of resident copies: a process-unique id of a stored layer,
  // never reused; 0 for weights that live for one call only (inline weights), which are copied per call.
  uint64_t resident_id = 0;
};

// Which tensors a layer's keys and values come from. Decided once, by validation.
enum class KvSource {
  kQuery,      // self-attention: key = value = query
  kKey,        // value = key, a tensor of its own
  kKeyValue,   // key and value are separate tensors
};

// A whole multi-head attention layer: project, attend, (head mask), concatenate, project.
struct MhaArgs {
  AttentionShape shape;
  AttentionMask mask;
  const StopSignal* stop = nullptr;  // null: runs to the end
  LayerWeights weights;
  KvSource kv_source = KvSource::kKeyValue;
  ConstTensor query;  // [B, Tq, d_model]
  ConstTensor key;    // [B, Tk, d_kv_in]; the query's bytes for kQuery
  ConstTensor value;  // [B, Tk, d_v_in]; the key's (or query's) bytes for kKey (kQuery)
  absl::Span<const float> head_mask;  // empty, or H factors applied to each head's attention output
  MutableTensor out;                  // [B, Tq, d_model]
  MutableTensor attention_weights;    // [B, H, Tq, Tk], when requested
  RowStats stats;                     // [B, H, Tq] each, when requested
};

// A session's KV cache as the kernels read it (the session store owns the blocks and lends them for one call): the
// tokens in blocks of block_tokens, token t in block t / block_tokens at slot t % block_tokens. A block holds, for
// each KV head g, its K part then its V part (HeadBytes() per head). In the 16- and 32-bit dtypes the K part is K
// transposed [head_dim][block_tokens] and the V part V [block_tokens][head_dim], elements of dtype; so that the
// scores of a block vectorise across its keys, its values across head_dim, and each KV head's part is one run of
// memory streamed once for every query head of its group. The 8-bit dtypes add their scales to each part
// (quantized_cache.h has their layout).
struct KvCacheLayout {
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t block_tokens = 0;
  v1::DataType dtype = v1::FP32;  // FP32, FP16, BF16, or the 8-bit INT8, FP8_E4M3, FP8_E5M2

  bool Quantized() const { return dtype == v1::INT8 || dtype == v1::FP8_E4M3 || dtype == v1::FP8_E5M2; }
  // Bytes of one KV head's K part and V part, of both, of a block.
  int64_t KeyBytes() const;
  int64_t ValueBytes() const;
  int64_t HeadBytes() const { return KeyBytes() + ValueBytes(); }
  int64_t BlockBytes() const { return num_kv_heads * HeadBytes(); }
  // Byte offsets in a block of KV head g's K part and V part.
  int64_t KeyPart(int64_t g) const { return g * HeadBytes(); }
  int64_t ValuePart(int64_t g) const { return g * HeadBytes() + KeyBytes(); }

  // The 16- and 32-bit dtypes: element offsets in a block of KV head g's K^T and V.
  int64_t HeadElements() const { return 2 * head_dim * block_tokens; }  // one KV head's K^T and V
  int64_t BlockElements() const { return num_kv_heads * HeadElements(); }
  int64_t KeyOffset(int64_t g) const { return g * HeadElements(); }
  int64_t ValueOffset(int64_t g) const { return g * HeadElements() + head_dim * block_tokens; }
};

// One session's part of a paged call: n new tokens appended at positions length..length+n-1, each attending to
// positions 0..length+i of its cache (causal within the new tokens, bottom-right aligned); or, without `append`,
// n tokens at positions length..length+n-1 that attend to positions 0..length-1 alone and are not written.
struct PagedSequence {
  // blocks[b] holds tokens [b block_tokens, (b + 1) block_tokens), for every token below length + n. The backend
  // writes the new tokens' keys and values (after RoPE, rounded to the cache's dtype) into their slots, which
  // belong to this call alone, and reads positions 0..length-1 as they are; an 8-bit cache's last block, which
  // this call alone holds too, may also have its earlier keys requantized (quantized_cache.h).
  absl::Span<char* const> blocks;
  int64_t length = 0;  // tokens cached before this call
  int64_t new_tokens = 0;
  ConstTensor x;                 // a layer's input [n, d_model]
  ConstTensor q, k, v;           // or projected q [n, H, d_k], k and v [n, Hkv, d_k]
  MutableTensor out;             // [n, d_model] with a layer, else [n, H, d_k]
  MutableTensor weights;         // [H, n, length + n] ([H, n, length] without append), when requested
  RowStats stats;                // [H, n] each, when requested
  bool append = true;
  int64_t Keys() const { return append ? length + new_tokens : length; }  // visible to the last new token
};

// What a paged call is, as far as choosing and sizing the work goes.
struct PagedProblem {
  HeadSpec heads;          // causal is implied; rope applies at the cache positions
  int64_t d_model = 0;     // with a layer; 0 for projected q, k, v
  KvCacheLayout cache;
  v1::DataType input_dtype = v1::FP32;
  bool mixed_inputs = false;  // the items' inputs come in more than one dtype (input_dtype: the first not FP32)
  v1::DataType output_dtype = v1::FP32;
  bool return_weights = false;
  bool return_stats = false;   // lse or head statistics
  int64_t sequences = 0;
  int64_t new_tokens = 0;      // over all sequences
  int64_t max_new_tokens = 0;  // of one sequence
  int64_t max_length = 0;      // of one sequence after the call (length + n)
};

// A paged call: every sequence shares the heads, the cache layout and, with a layer, its weights.
struct PagedArgs {
  PagedProblem problem;
  const StopSignal* stop = nullptr;  // null: runs to the end
  LayerWeights weights;              // with a layer (problem.d_model > 0)
  absl::Span<const PagedSequence> sequences;
};

// INTERNAL unless every sequence of `args` is what a backend may compute on: at least one new token, blocks covering
// its length and new tokens, its inputs and output present, the cache layout's sizes the heads'. The store and the
// service always pass such arguments; backends check anyway, since a short block table would send them past it.
absl::Status CheckPagedArgs(const PagedArgs& args);

// Memory for the session store's KV cache blocks (the BlockPool's arena), lent by the backend whose paged kernels
// read the blocks in place: a GPU backend's managed memory, which lives on the device and which the host may still
// read and write (the store copies a block for a fork; another backend may serve a call on the same sessions).
// Address space only until touched; released when the arena is destroyed, after every block is gone. Thread-safe.
class CacheArena {
 public:
  virtual ~CacheArena() = default;
  virtual char* base() const = 0;
  virtual int64_t bytes() const = 0;
  // Where the memory lives, for the server's start-up log: "CUDA managed memory on NVIDIA H200 (device 0)".
  virtual std::string describe() const = 0;
};

// A way to compute attention. Implementations are thread-safe (the server runs a backend's large computations one
// at a time unless concurrent_calls() says more, and tiny requests run concurrently on gRPC's threads). Errors from third-party libraries are converted to Status
// inside; nothing throws across this interface. A call that args.stop stopped returns the signal's status, and
// its outputs are unspecified.
class Backend {
 public:
  Backend() = default;
  virtual ~Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  // Short stable name: one of the k*Backend constants above.
  virtual absl::string_view name() const = 0;
  // Human-readable device, e.g. the CPU model and the kernels in use.
  virtual std::string device() const = 0;

  // Ask before computing: OK if this backend computes `problem`; UNIMPLEMENTED, saying why, otherwise. The service
  // asks before queueing any work.
  virtual absl::Status Supports(const AttentionProblem& problem) const = 0;
  // The dtype the products of `problem` are computed in (FP32, or the 16-bit wire dtype on a path that computes in
  // it): it sets the call's tolerance against the reference (the proto's DataType).
  virtual v1::DataType ComputeDtype(const AttentionProblem& problem) const { return v1::FP32; }
  // Working memory (bytes) `problem` needs beyond its inputs and outputs, so that the service can refuse what would
  // not fit before computing.
  virtual int64_t WorkspaceBytes(const AttentionProblem& problem) const = 0;
  // Calls of at most this many FLOPs (AttentionFlops) run on the calling thread alone and in tens of microseconds,
  // so the server may run them on the gRPC thread that received them. 0: never.
  virtual double inline_max_flops() const { return 0; }
  // Large calls the backend computes well side by side (a GPU's streams: one call's copies overlap another's
  // kernels); the server runs up to this many at once. 1: one at a time, on one thread (a CPU backend's calls
  // already take every core, and its thread pools belong to that thread).
  virtual int concurrent_calls() const { return 1; }
  // Pays one-time start-up costs (library initialisation, code generation, thread pools) with a small
  // representative computation; returns its AttentionFlops, so that a second call can be timed to learn the
  // backend's speed. Called on the thread that will compute.
  virtual absl::StatusOr<double> WarmUp() = 0;

  virtual absl::Status ScaledDotProductAttention(const SdpaArgs& args) = 0;
  virtual absl::Status MultiHeadAttention(const MhaArgs& args) = 0;

  // Sessions (PagedArgs): appends each sequence's new tokens to its cache and attends. The same contract as the
  // calls above: ask before computing, say how much working memory; a backend without it answers UNIMPLEMENTED
  // saying why (BACKEND_AUTO then uses the CPU). On error the new tokens' slots hold unspecified values, which the
  // store never reads (it commits the new length only after success).
  virtual absl::Status SupportsPaged(const PagedProblem& problem) const;
  virtual int64_t PagedWorkspaceBytes(const PagedProblem& problem) const { return 0; }
  virtual absl::Status PagedAttention(const PagedArgs& args);
  // An arena of `bytes` for the session store's blocks, when this backend reads caches faster from memory of its
  // own (UNIMPLEMENTED otherwise: the store reserves host memory). Every backend still accepts blocks from anywhere
  // the host can address.
  virtual absl::StatusOr<std::unique_ptr<CacheArena>> AllocateCacheArena(int64_t bytes);
};

// Number of leading keys that causal (bottom-right aligned: key j is hidden from query i when
// j > i + Tk - Tq) and key_lengths leave visible to query i of batch item b: keys [0, n) may be visible (the
// additive mask can still hide some), keys >= n are not. Between 0 and Tk. Shared by every backend so the rule
// lives in one place.
// The number of keys a row of a paged sequence's new token i sees.
inline int64_t PagedVisibleKeys(const PagedSequence& seq, int64_t i) { return seq.append ? seq.length + i + 1 : seq.length; }

inline int64_t VisibleKeyCount(const AttentionShape& shape, const AttentionMask& mask, int64_t b, int64_t i) {
  int64_t n = shape.kv_len;
  if (shape.heads.causal) n = std::min<int64_t>(n, std::max<int64_t>(0, i + (shape.kv_len - shape.q_len) + 1));
  if (!mask.key_lengths.empty()) n = std::min<int64_t>(n, mask.key_lengths[b]);
  return n;
}

}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_BACKEND_H_
