#include "client/decode.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <mutex>
#include <random>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/decode_shards.h"
#include "client/prefix_keys.h"
#include "client/session_recovery.h"
#include "nlohmann/json.hpp"
#include "proto/mha/v1/tensor_codec.h"

namespace mha {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// The shape a run works with: the options' heads (head sessions) or the first layer's (layer sessions).
struct Shape {
  int64_t d_model = 0;  // layer sessions only
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  double rope_theta = 0;
  int64_t caches = 1;
  bool layer() const { return d_model > 0; }
  // One token's inputs: x, or q | k | v.
  int64_t width() const { return layer() ? d_model : (heads + 2 * kv_heads) * head_dim; }
};

absl::StatusOr<Shape> ShapeOf(AttentionClient& client, const DecodeOptions& o) {
  Shape s;
  s.caches = o.layers.empty() ? o.num_layers : static_cast<int64_t>(o.layers.size());
  if (o.layers.empty()) {
    s.heads = o.heads;
    s.kv_heads = o.kv_heads;
    s.head_dim = o.head_dim;
    s.rope_theta = o.rope_theta;
    return s;
  }
  absl::StatusOr<v1::ListLayersResponse> layers = client.ListLayers();
  if (!layers.ok()) return layers.status();
  for (const v1::LayerInfo& info : layers->layers()) {
    if (info.name() != o.layers.front()) continue;
    s.d_model = info.d_model();
    s.heads = info.heads().num_heads();
    s.kv_heads = info.heads().num_kv_heads();
    s.head_dim = info.heads().head_dim();
    s.rope_theta = info.heads().rope_theta();
    return s;
  }
  return absl::NotFoundError(absl::StrCat("layer '", o.layers.front(), "' is not registered on the server"));
}

// n tokens' inputs uniform in [-1, 1], rounded to the wire dtype so that a local reference sees what the server does.
std::vector<float> Random(std::mt19937& rng, int64_t n, v1::DataType wire) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> values(n);
  for (float& x : values) x = uniform(rng);
  std::string bytes(n * DTypeSize(wire), '\0');
  EncodeFromFloat(wire, values.data(), n, bytes.data());
  DecodeToFloat(wire, bytes.data(), n, values.data());
  return values;
}

// Columns [begin, end) of every row of rows [n, width].
std::vector<float> Columns(const float* rows, int64_t n, int64_t width, int64_t begin, int64_t end) {
  std::vector<float> out;
  out.reserve(n * (end - begin));
  for (int64_t t = 0; t < n; ++t) out.insert(out.end(), rows + t * width + begin, rows + t * width + end);
  return out;
}

// One session's item for n tokens of `rows`; without `append`, a head session's q alone (a shard's step that
// attends to its cache without joining it).
v1::ExtendItem Item(const Shape& s, const std::string& id, const float* rows, int64_t n, v1::DataType wire,
                    bool append = true) {
  v1::ExtendItem item;
  item.set_session_id(id);
  if (s.layer()) {
    FloatsToTensor(absl::MakeConstSpan(rows, n * s.d_model), {n, s.d_model}, wire, item.mutable_x());
    return item;
  }
  const int64_t qw = s.heads * s.head_dim, kvw = s.kv_heads * s.head_dim;
  FloatsToTensor(Columns(rows, n, s.width(), 0, qw), {n, s.heads, s.head_dim}, wire, item.mutable_q());
  if (!append) {
    item.set_append(false);
    return item;
  }
  FloatsToTensor(Columns(rows, n, s.width(), qw, qw + kvw), {n, s.kv_heads, s.head_dim}, wire, item.mutable_k());
  FloatsToTensor(Columns(rows, n, s.width(), qw + kvw, qw + 2 * kvw), {n, s.kv_heads, s.head_dim}, wire,
                 item.mutable_v());
  return item;
}

// The last token's heads [H, d_k] of a head session whose inputs so far are `rows` (q | k | v, unrotated), in
// double: RoPE (rotate-half) at the cache positions, then GQA attention over every token.
std::vector<double> ReferenceLastRow(const Shape& s, const std::vector<float>& rows) {
  const int64_t T = static_cast<int64_t>(rows.size()) / s.width(), dk = s.head_dim;
  const int64_t qw = s.heads * dk, kvw = s.kv_heads * dk, G = s.heads / s.kv_heads;
  const auto rotated = [&](const float* v, int64_t position) {
    std::vector<double> out(v, v + dk);
    if (s.rope_theta <= 0) return out;
    for (int64_t i = 0; i < dk / 2; ++i) {
      const double angle = position * std::pow(s.rope_theta, -2.0 * i / dk);
      out[i] = v[i] * std::cos(angle) - v[i + dk / 2] * std::sin(angle);
      out[i + dk / 2] = v[i + dk / 2] * std::cos(angle) + v[i] * std::sin(angle);
    }
    return out;
  };
  std::vector<double> result(qw, 0.0), scores(T);
  for (int64_t h = 0; h < s.heads; ++h) {
    const std::vector<double> q = rotated(rows.data() + (T - 1) * s.width() + h * dk, T - 1);
    double max = -INFINITY, sum = 0;
    for (int64_t t = 0; t < T; ++t) {
      const std::vector<double> k = rotated(rows.data() + t * s.width() + qw + (h / G) * dk, t);
      double dot = 0;
      for (int64_t d = 0; d < dk; ++d) dot += q[d] * k[d];
      scores[t] = dot / std::sqrt(static_cast<double>(dk));
      max = std::max(max, scores[t]);
    }
    for (double& x : scores) sum += (x = std::exp(x - max));
    for (int64_t t = 0; t < T; ++t) {
      const float* v = rows.data() + t * s.width() + qw + kvw + (h / G) * dk;
      for (int64_t d = 0; d < dk; ++d) result[h * dk + d] += scores[t] / sum * v[d];
    }
  }
  return result;
}

// The workload's sessions and what it keeps of their inputs: session 0's for --check, every session's in the
// stateless mode (it resends them), and with --recover each session's record. Sessions [first, last) of a step
// belong to one thread. With shards, each session is one session per shard, shard i's on *clients[i].
class DecodeRun {
 public:
  DecodeRun(std::vector<AttentionClient*> clients, const DecodeOptions& o, const Shape& s)
      : clients_(std::move(clients)), o_(o), s_(s), ids_(o.shards),
        run_tag_(absl::StrFormat("%08x", std::random_device()())), rows_(o.sessions) {
    // The steps' tokens come from a pool drawn once, so that the steps time the calls, not a random generator.
    std::mt19937 rng(o.seed + 1);
    for (int i = 0; i < kPoolTokens; ++i) pool_.push_back(Random(rng, s_.width(), o_.wire_dtype));
  }

  // Creates the sessions and prefills their caches, every layer (past the tokens a session attached).
  absl::Status Prefill(DecodeReport* report) {
    std::mt19937 rng(o_.seed);
    if (absl::Status status = PreparePrefix(report); !status.ok()) return status;
    const auto start = Clock::now();
    for (int i = 0; i < o_.sessions; ++i) {
      int64_t attached = 0;
      for (int shard = 0; !o_.stateless && shard < o_.shards; ++shard) {
        const v1::CreateSessionRequest create = CreateRequest(i, shard);
        const auto asked = Clock::now();
        absl::StatusOr<v1::CreateSessionResponse> created = clients_[shard]->CreateSession(create);
        if (!created.ok()) return created.status();
        ids_[shard].push_back(created->session().session_id());
        attached = created->session().attached_tokens();
        if (attached > 0) report->attach_seconds_max = std::max(report->attach_seconds_max, Since(asked));
        if (o_.recover) records_.emplace_back(create);
      }
      report->attached_tokens += attached;
      for (int64_t t0 = 0; t0 < o_.context; t0 += o_.prefill_chunk) {
        const int64_t n = std::min(o_.prefill_chunk, o_.context - t0);
        const std::vector<float> rows = ContextRows(rng, t0, n);
        Keep(i, rows);
        const int64_t skip = std::clamp<int64_t>(attached - t0, 0, n);
        if (o_.stateless || skip == n) continue;
        const std::vector<float> sent(rows.begin() + skip * s_.width(), rows.end());
        if (absl::Status status = PrefillChunk(i, t0 + skip, sent, report); !status.ok()) return status;
      }
    }
    report->prefill_seconds = Since(start);
    if (o_.shared_prefix == 0) return absl::OkStatus();
    absl::StatusOr<v1::GetServerInfoResponse> info = clients_[0]->GetServerInfo();
    if (!info.ok()) return info.status();
    report->pool_used_bytes = info->kv_cache().used_bytes();
    report->pool_prefix_bytes = info->kv_cache().prefix_bytes();
    return absl::OkStatus();
  }

  // What a step says of itself besides its status.
  struct StepInfo {
    bool streamed = false;      // its Extends went over the client's streams
    double server_seconds = 0;  // the server's time in its calls (Timing.handler_us), Extends of one shard only
  };

  // One decode step of sessions [first, last), every layer: one token each. Adds the bytes it sent to *bytes and,
  // when first is 0, puts session 0's layer-0 output into *session0. `unary`: its Extends go unary even where the
  // client streams them.
  absl::Status Step(int first, int last, std::mt19937& rng, int64_t* bytes, std::vector<float>* session0, bool unary,
                    StepInfo* info) {
    unary = unary || o_.transport == DecodeOptions::Transport::kUnary || o_.shards > 1;
    std::vector<const std::vector<float>*> rows;
    for (int i = first; i < last; ++i) {
      rows.push_back(&pool_[rng() % pool_.size()]);
      Keep(i, *rows.back());
    }
    for (int64_t layer = 0; layer < s_.caches; ++layer) {
      std::vector<float>* out = layer == 0 && first == 0 ? session0 : nullptr;
      absl::Status status =
          o_.stateless ? Resend(first, last, bytes, out)
                       : Extend(layer, first, rows, bytes, out, unary, &info->server_seconds);
      if (!status.ok()) return status;
    }
    info->streamed = !unary && !o_.stateless && clients_[0]->streams_extends();
    return absl::OkStatus();
  }

  const std::vector<float>& Session0Rows() const { return rows_[0]; }
  // Sessions rebuilt so far (recover).
  int64_t recoveries() const { return recoveries_.load(); }
  // With shards: session 0's first cache's length per shard after its last step.
  const std::vector<int64_t>& Session0ShardLengths() const { return session0_lengths_; }

  void Close() {
    for (int shard = 0; shard < o_.shards; ++shard) {
      for (const std::string& id : ids_[shard]) clients_[shard]->CloseSession(id).IgnoreError();
    }
  }

 private:
  // Session i's context tokens [t0, t0 + n) (`rows`), each part to the shard that holds it, every layer.
  absl::Status PrefillChunk(int i, int64_t t0, const std::vector<float>& rows, DecodeReport* report) {
    const int64_t n = static_cast<int64_t>(rows.size()) / s_.width();
    for (int shard = 0; shard < o_.shards; ++shard) {
      const int64_t begin = std::max(t0, ShardBegin(o_.context, o_.shards, shard));
      const int64_t end = std::min(t0 + n, ShardBegin(o_.context, o_.shards, shard + 1));
      for (int64_t layer = 0; begin < end && layer < s_.caches; ++layer) {
        v1::ExtendRequest request = Request(layer);
        *request.add_items() =
            Item(s_, ids_[shard][i], rows.data() + (begin - t0) * s_.width(), end - begin, o_.wire_dtype);
        absl::StatusOr<v1::ExtendResponse> response =
            Send(*clients_[shard], request, i, o_.transport == DecodeOptions::Transport::kUnary);
        if (!response.ok()) return response.status();
        report->prefill_tokens += end - begin;
      }
    }
    return absl::OkStatus();
  }

  // Session i's (shard's) CreateSession, named by the client.
  v1::CreateSessionRequest CreateRequest(int i, int shard) const {
    v1::CreateSessionRequest create;
    create.set_session_id(o_.shards > 1 ? absl::StrCat("decode-", run_tag_, "-", i, "-s", shard)
                                        : absl::StrCat("decode-", run_tag_, "-", i));
    for (const std::string& layer : o_.layers) create.add_layers(layer);
    if (o_.layers.empty()) {
      create.mutable_heads()->set_num_heads(o_.heads);
      create.mutable_heads()->set_num_kv_heads(o_.kv_heads);
      create.mutable_heads()->set_head_dim(o_.head_dim);
      create.mutable_heads()->set_rope_theta(o_.rope_theta);
      create.set_num_layers(o_.num_layers);
    }
    create.set_cache_dtype(o_.cache_dtype);
    create.set_max_tokens(o_.context + o_.steps);
    for (const std::string& key : prefix_keys_) create.add_prefix_keys(key);
    return create;
  }

  v1::ExtendRequest Request(int64_t layer) const {
    v1::ExtendRequest request;
    request.set_layer_index(static_cast<int32_t>(layer));
    request.set_output_dtype(v1::FP32);
    request.set_backend(o_.backend);
    return request;
  }

  // An Extend whose items are sessions [first, ...) in order, over the client's streams unless `unary`: recovered
  // with their records under --recover.
  absl::StatusOr<v1::ExtendResponse> Send(AttentionClient& client, const v1::ExtendRequest& request, int first,
                                          bool unary) {
    if (!o_.recover) return unary ? client.ExtendUnary(request) : client.Extend(request);
    std::vector<SessionRecord*> records;
    for (int i = first; i < first + request.items_size(); ++i) records.push_back(&records_[i]);
    int64_t rebuilt = 0;
    absl::StatusOr<v1::ExtendResponse> response =
        ExtendRecovering(client, request, records, RecoveryOptions(), &rebuilt, unary);
    recoveries_ += rebuilt;
    return response;
  }

  // --shared_prefix: the prefix's rows (the same for every session) and its keys, for the server's block size.
  absl::Status PreparePrefix(DecodeReport* report) {
    if (o_.shared_prefix == 0) return absl::OkStatus();
    absl::StatusOr<v1::GetServerInfoResponse> info = clients_[0]->GetServerInfo();
    if (!info.ok()) return info.status();
    report->block_tokens = std::max<int64_t>(1, info->limits().kv_block_tokens());
    std::mt19937 rng(o_.seed + 2);
    prefix_rows_ = Random(rng, o_.shared_prefix * s_.width(), o_.wire_dtype);
    std::vector<int64_t> positions(o_.shared_prefix);
    for (int64_t t = 0; t < o_.shared_prefix; ++t) positions[t] = t;
    // The rows depend on these: a run of another seed, shape or wire dtype must not find this one's blocks.
    prefix_keys_ = PrefixKeys(positions, report->block_tokens,
                              absl::StrCat("mha_client decode|", o_.seed, "|", s_.width(), "|", o_.wire_dtype));
    return absl::OkStatus();
  }

  // Context tokens [t0, t0 + n) of a session: the shared prefix's, then its own random ones.
  std::vector<float> ContextRows(std::mt19937& rng, int64_t t0, int64_t n) {
    const int64_t shared = std::clamp<int64_t>(o_.shared_prefix - t0, 0, n);
    if (shared == 0) return Random(rng, n * s_.width(), o_.wire_dtype);
    std::vector<float> rows(prefix_rows_.begin() + t0 * s_.width(),
                            prefix_rows_.begin() + (t0 + shared) * s_.width());
    const std::vector<float> own = Random(rng, (n - shared) * s_.width(), o_.wire_dtype);
    rows.insert(rows.end(), own.begin(), own.end());
    return rows;
  }

  void Keep(int i, const std::vector<float>& rows) {
    if (o_.stateless || (i == 0 && o_.check)) rows_[i].insert(rows_[i].end(), rows.begin(), rows.end());
  }

  // Adds the server's time in the call to *server_seconds (unsharded).
  absl::Status Extend(int64_t layer, int first, const std::vector<const std::vector<float>*>& rows, int64_t* bytes,
                      std::vector<float>* session0, bool unary, double* server_seconds) {
    if (o_.shards > 1) return ExtendAcrossShards(layer, first, rows, bytes, session0);
    v1::ExtendRequest request = Request(layer);
    for (int i = first; i < first + static_cast<int>(rows.size()); ++i) {
      *request.add_items() = Item(s_, ids_[0][i], rows[i - first]->data(), 1, o_.wire_dtype);
    }
    *bytes += static_cast<int64_t>(request.ByteSizeLong());
    absl::StatusOr<v1::ExtendResponse> response = Send(*clients_[0], request, first, unary);
    if (!response.ok()) return response.status();
    *server_seconds += static_cast<double>(response->timing().handler_us()) * 1e-6;
    if (session0 != nullptr) *session0 = TensorToFloats(response->results(0).output());
    return absl::OkStatus();
  }

  // The step sent to every shard at once: q alone to all but the last (append = false), q, k and v to the last,
  // which appends the token; each shard's output and lse merged into the attention over the whole context.
  absl::Status ExtendAcrossShards(int64_t layer, int first, const std::vector<const std::vector<float>*>& rows,
                                  int64_t* bytes, std::vector<float>* session0) {
    std::vector<v1::ExtendRequest> requests;
    for (int shard = 0; shard < o_.shards; ++shard) {
      v1::ExtendRequest request = Request(layer);
      request.set_return_lse(true);
      for (int i = first; i < first + static_cast<int>(rows.size()); ++i) {
        *request.add_items() =
            Item(s_, ids_[shard][i], rows[i - first]->data(), 1, o_.wire_dtype, shard + 1 == o_.shards);
      }
      *bytes += static_cast<int64_t>(request.ByteSizeLong());
      requests.push_back(std::move(request));
    }
    absl::StatusOr<std::vector<ShardedResult>> results = ExtendShards(clients_, requests);
    if (!results.ok()) return results.status();
    if (session0 != nullptr) {
      *session0 = std::move(results->front().output.values);
      session0_lengths_ = results->front().lengths;
    }
    return absl::OkStatus();
  }

  // The stateless way: every session's whole history sent again, its last token as the query, causal.
  absl::Status Resend(int first, int last, int64_t* bytes, std::vector<float>* session0) {
    const int64_t B = last - first, T = static_cast<int64_t>(rows_[first].size()) / s_.width();
    std::vector<float> query, key, value;
    const int64_t qw = s_.heads * s_.head_dim, kvw = s_.kv_heads * s_.head_dim;
    for (int i = first; i < last; ++i) {
      const float* r = rows_[i].data();
      const std::vector<float> q = s_.layer() ? Columns(r + (T - 1) * s_.width(), 1, s_.width(), 0, s_.d_model)
                                              : Columns(r + (T - 1) * s_.width(), 1, s_.width(), 0, qw);
      query.insert(query.end(), q.begin(), q.end());
      const std::vector<float> k = s_.layer() ? Columns(r, T, s_.width(), 0, s_.d_model)
                                              : Columns(r, T, s_.width(), qw, qw + kvw);
      key.insert(key.end(), k.begin(), k.end());
      if (s_.layer()) continue;
      const std::vector<float> v = Columns(r, T, s_.width(), qw + kvw, qw + 2 * kvw);
      value.insert(value.end(), v.begin(), v.end());
    }
    if (s_.layer()) {
      v1::MultiHeadAttentionRequest request;
      FloatsToTensor(query, {B, 1, s_.d_model}, o_.wire_dtype, request.mutable_query());
      FloatsToTensor(key, {B, T, s_.d_model}, o_.wire_dtype, request.mutable_key());
      request.set_layer(o_.layers.front());
      request.mutable_heads()->set_causal(true);
      request.set_output_dtype(v1::FP32);
      request.set_backend(o_.backend);
      *bytes += static_cast<int64_t>(request.ByteSizeLong());
      absl::StatusOr<v1::MultiHeadAttentionResponse> response = clients_[0]->MultiHeadAttention(request);
      if (!response.ok()) return response.status();
      if (session0 != nullptr) *session0 = TensorToFloats(response->output());
      return absl::OkStatus();
    }
    v1::ScaledDotProductAttentionRequest request;
    FloatsToTensor(query, {B, 1, s_.heads, s_.head_dim}, o_.wire_dtype, request.mutable_q());
    FloatsToTensor(key, {B, T, s_.kv_heads, s_.head_dim}, o_.wire_dtype, request.mutable_k());
    FloatsToTensor(value, {B, T, s_.kv_heads, s_.head_dim}, o_.wire_dtype, request.mutable_v());
    request.mutable_heads()->set_causal(true);
    request.mutable_heads()->set_rope_theta(s_.rope_theta);
    request.set_output_dtype(v1::FP32);
    request.set_backend(o_.backend);
    *bytes += static_cast<int64_t>(request.ByteSizeLong());
    absl::StatusOr<v1::ScaledDotProductAttentionResponse> response = clients_[0]->ScaledDotProductAttention(request);
    if (!response.ok()) return response.status();
    if (session0 != nullptr) {
      const std::vector<float> all = TensorToFloats(response->output());
      *session0 = std::vector<float>(all.begin(), all.begin() + qw);
    }
    return absl::OkStatus();
  }

  const std::vector<AttentionClient*> clients_;  // per shard
  const DecodeOptions o_;
  const Shape s_;
  static constexpr int kPoolTokens = 256;
  std::vector<std::vector<std::string>> ids_;  // [shard][session]
  const std::string run_tag_;                 // in every session id: runs side by side do not collide
  std::vector<SessionRecord> records_;        // [session], recover only (one shard)
  std::atomic<int64_t> recoveries_{0};
  std::vector<int64_t> session0_lengths_;
  std::vector<std::vector<float>> rows_;
  std::vector<std::vector<float>> pool_;  // [kPoolTokens][width]: the decode steps' inputs
  std::vector<float> prefix_rows_;        // [shared_prefix][width]
  std::vector<std::string> prefix_keys_;  // of its full blocks
};

// Decode steps timed: batched (one thread, every session per call) or per session (C threads, each its sessions).
struct Timed {
  std::vector<double> step_seconds;
  std::vector<double> by_transport[2];  // the same, of the steps over a stream [0] and unary [1]
  std::vector<double> server_seconds;   // the server's time in each step's calls
  double seconds = 0;
  int64_t bytes = 0;
  int64_t tokens = 0;  // of the calls that succeeded: the failed ones' are neither counted nor timed
  int64_t errors = 0;
  std::string first_error;
  std::vector<float> session0;
};

Timed RunSteps(DecodeRun& run, const DecodeOptions& o) {
  Timed timed;
  std::mutex mu;
  const int threads = o.per_session ? std::min(o.concurrency, o.sessions) : 1;
  const auto start = Clock::now();
  std::vector<std::thread> workers;
  for (int w = 0; w < threads; ++w) {
    workers.emplace_back([&, w] {
      std::mt19937 rng(o.seed * 7919 + w + 1);
      std::vector<double> steps, by_transport[2], server;
      std::vector<float> session0;
      int64_t bytes = 0, errors = 0, tokens = 0;
      std::string first_error;
      for (int step = 0; step < o.steps; ++step) {
        for (int i = w; i < (o.per_session ? o.sessions : 1); i += threads) {
          const int first = o.per_session ? i : 0, last = o.per_session ? i + 1 : o.sessions;
          const bool unary = o.transport == DecodeOptions::Transport::kBoth && step % 2 == 1;
          DecodeRun::StepInfo info;
          const auto at = Clock::now();
          const absl::Status status =
              run.Step(first, last, rng, &bytes, first == 0 ? &session0 : nullptr, unary, &info);
          if (status.ok()) {
            steps.push_back(Since(at));
            by_transport[info.streamed ? 0 : 1].push_back(steps.back());
            server.push_back(info.server_seconds);
            tokens += last - first;
          } else if (errors++ == 0) {
            first_error = status.ToString();
          }
        }
      }
      std::lock_guard<std::mutex> lock(mu);
      timed.step_seconds.insert(timed.step_seconds.end(), steps.begin(), steps.end());
      timed.server_seconds.insert(timed.server_seconds.end(), server.begin(), server.end());
      for (int t = 0; t < 2; ++t) {
        timed.by_transport[t].insert(timed.by_transport[t].end(), by_transport[t].begin(), by_transport[t].end());
      }
      timed.bytes += bytes;
      timed.tokens += tokens;
      timed.errors += errors;
      if (timed.first_error.empty()) timed.first_error = first_error;
      if (!session0.empty()) timed.session0 = std::move(session0);
    });
  }
  for (std::thread& worker : workers) worker.join();
  timed.seconds = Since(start);
  return timed;
}

// |got - want| / (1 + |want|) at its largest: session 0's last step against its reference.
absl::StatusOr<double> CheckSession0(AttentionClient& client, const DecodeOptions& o, const Shape& s,
                                     const DecodeRun& run, const std::vector<float>& got) {
  std::vector<double> want;
  const std::vector<float>& rows = run.Session0Rows();
  if (!s.layer()) {
    want = ReferenceLastRow(s, rows);
  } else {
    // A layer session: one stateless causal call over the whole sequence, on the reference backend.
    const int64_t T = static_cast<int64_t>(rows.size()) / s.d_model;
    v1::MultiHeadAttentionRequest request;
    FloatsToTensor(rows, {1, T, s.d_model}, v1::FP32, request.mutable_query());
    request.set_layer(o.layers.front());
    request.mutable_heads()->set_causal(true);
    request.set_backend(v1::BACKEND_REFERENCE);
    absl::StatusOr<v1::MultiHeadAttentionResponse> response = client.MultiHeadAttention(request);
    if (!response.ok()) return response.status();
    const std::vector<float> all = TensorToFloats(response->output());
    want.assign(all.end() - s.d_model, all.end());
  }
  if (got.size() != want.size()) {
    return absl::InternalError(absl::StrCat("session 0's output has ", got.size(), " values, its reference ",
                                            want.size()));
  }
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]) / (1 + std::abs(want[i])));
  return worst;
}

// What session 0's last step may differ from its reference by: one rounding of K and V to a 16-bit cache (or of
// the inputs to a 16-bit wire, which the reference sees too, then the output's), as the proto's tolerances.
double Tolerance(const DecodeOptions& o) {
  // An 8-bit cache: its codes' rounding (relative to each channel's or token's largest value), a few percent of an
  // output of unit scale (docs/PERFORMANCE.md has the measured error).
  if (!o.stateless && IsCacheOnlyDType(o.cache_dtype)) return o.cache_dtype == v1::FP8_E5M2 ? 0.25 : 0.1;
  const bool stored_bf16 = o.wire_dtype == v1::BF16 || (!o.stateless && o.cache_dtype == v1::BF16);
  const bool stored_fp16 = o.wire_dtype == v1::FP16 || (!o.stateless && o.cache_dtype == v1::FP16);
  return stored_bf16 ? 3e-2 : stored_fp16 ? 4e-3 : 1e-4;
}

// What --shards needs besides its range.
absl::Status ValidateShards(const DecodeOptions& o) {
  if (!o.layers.empty()) {
    return absl::InvalidArgumentError(
        "--shards needs head sessions: a layer session's output has mixed its heads and cannot be merged per head "
        "(drop --session_layers)");
  }
  if (o.stateless) return absl::InvalidArgumentError("--shards spreads sessions over servers; --stateless has none");
  if (o.rope_theta != 0) {
    return absl::InvalidArgumentError(
        "--shards needs --rope_theta 0: a shard's cache positions start at 0 (the API has no position offset), so "
        "RoPE would rotate its keys by the wrong positions");
  }
  if (o.recover) {
    return absl::InvalidArgumentError(
        "--recover does not go with --shards: a sharded step is several calls, and one that reached some shards "
        "cannot be sent again whole");
  }
  if (o.context < o.shards) {
    return absl::InvalidArgumentError(absl::StrCat("--shards ", o.shards, " needs --context of at least ", o.shards,
                                                   ": every shard holds part of the context"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateDecodeOptions(const DecodeOptions& o) {
  const auto in = [](const char* name, int64_t value, int64_t lo, int64_t hi) {
    return value >= lo && value <= hi ? absl::OkStatus()
                                      : absl::InvalidArgumentError(
                                            absl::StrCat("--", name, " must be in [", lo, ", ", hi, "], got ", value));
  };
  for (const absl::Status& status :
       {in("sessions", o.sessions, 1, 4096), in("context", o.context, 1, int64_t{1} << 22),
        in("steps", o.steps, 1, 1 << 20), in("num_layers", o.num_layers, 1, 1024), in("c", o.concurrency, 1, 1024),
        in("prefill_chunk", o.prefill_chunk, 1, int64_t{1} << 20), in("heads", o.heads, 1, 4096),
        in("kv_heads", o.kv_heads, 1, o.heads), in("head_dim", o.head_dim, 1, 4096), in("shards", o.shards, 1, 256)}) {
    if (!status.ok()) return status;
  }
  if (o.heads % o.kv_heads != 0) return absl::InvalidArgumentError("--kv_heads must divide --heads");
  if (!(o.rope_theta >= 0) || !std::isfinite(o.rope_theta)) {
    return absl::InvalidArgumentError("--rope_theta must be finite and >= 0");
  }
  if (o.recover && o.stateless) {
    return absl::InvalidArgumentError("--recover rebuilds lost sessions; --stateless has none");
  }
  if (absl::Status status = in("shared_prefix", o.shared_prefix, 0, o.context); !status.ok()) return status;
  if (o.shared_prefix > 0 && (o.stateless || o.recover || o.shards > 1)) {
    return absl::InvalidArgumentError("--shared_prefix shares session caches: not with --stateless, --recover or "
                                      "--shards");
  }
  return o.shards > 1 ? ValidateShards(o) : absl::OkStatus();
}

absl::StatusOr<DecodeOptions::Transport> ParseTransport(absl::string_view name) {
  if (name == "stream") return DecodeOptions::Transport::kStream;
  if (name == "unary") return DecodeOptions::Transport::kUnary;
  if (name == "both") return DecodeOptions::Transport::kBoth;
  return absl::InvalidArgumentError(absl::StrCat("--transport must be stream, unary or both; got \"", name, "\""));
}

absl::StatusOr<DecodeReport> RunDecode(AttentionClient& client, const DecodeOptions& o) {
  return RunDecode(std::vector<AttentionClient*>{&client}, o);
}

absl::StatusOr<DecodeReport> RunDecode(const std::vector<AttentionClient*>& clients, const DecodeOptions& o) {
  if (absl::Status valid = ValidateDecodeOptions(o); !valid.ok()) return valid;
  if (clients.empty() || static_cast<int>(clients.size()) > o.shards) {
    return absl::InvalidArgumentError(
        absl::StrCat("decode over ", o.shards, " shard(s) needs 1 to ", o.shards, " servers; got ", clients.size()));
  }
  std::vector<AttentionClient*> shard_clients;
  for (int shard = 0; shard < o.shards; ++shard) shard_clients.push_back(clients[shard % clients.size()]);
  AttentionClient& client = *clients[0];
  absl::StatusOr<Shape> shape = ShapeOf(client, o);
  if (!shape.ok()) return shape.status();
  DecodeReport report;
  report.options = o;
  report.d_model = shape->d_model;
  report.heads = shape->heads;
  report.kv_heads = shape->kv_heads;
  report.head_dim = shape->head_dim;
  report.caches = shape->caches;
  DecodeRun run(shard_clients, o, *shape);
  if (absl::Status status = run.Prefill(&report); !status.ok()) {
    run.Close();
    return status;
  }
  Timed timed = RunSteps(run, o);
  report.recoveries = run.recoveries();
  report.decode_seconds = timed.seconds;
  report.decode_tokens = timed.tokens;
  report.tokens_per_second = report.decode_tokens / std::max(timed.seconds, 1e-9);
  report.errors = timed.errors;
  report.first_error = timed.first_error;
  report.step = SummarizeLatencies(timed.step_seconds);
  report.stream_step = SummarizeLatencies(timed.by_transport[0]);
  report.unary_step = SummarizeLatencies(timed.by_transport[1]);
  report.stream_steps = static_cast<int64_t>(timed.by_transport[0].size());
  report.unary_steps = static_cast<int64_t>(timed.by_transport[1].size());
  if (!o.stateless && o.shards == 1) report.server_step = SummarizeLatencies(timed.server_seconds);
  report.request_bytes_per_step = timed.bytes / o.steps;
  // Each step's attention reads every cached token of every session and layer once, K and V of each KV head.
  HeadSpec heads;
  heads.num_kv_heads = shape->kv_heads;
  heads.head_dim = shape->head_dim;
  // An 8-bit cache's scales counted for the server's default --kv_block_tokens (32).
  constexpr int64_t kDefaultBlockTokens = 32;
  const int cache_dtype = o.stateless ? o.wire_dtype : o.cache_dtype;
  for (int step = 0; step < o.steps; ++step) {
    report.kv_bytes_read += static_cast<double>(o.sessions) * shape->caches *
                            KvCacheBytes(heads, o.context + step + 1, cache_dtype, kDefaultBlockTokens);
  }
  // Of the calls that succeeded (the steps are alike but for their length: in proportion to the tokens).
  report.kv_bytes_read *= static_cast<double>(timed.tokens) / std::max<int64_t>(int64_t{o.sessions} * o.steps, 1);
  report.kv_bytes_per_second = report.kv_bytes_read / std::max(timed.seconds, 1e-9);
  if (o.check && timed.errors == 0) {
    absl::StatusOr<double> error = CheckSession0(client, o, *shape, run, timed.session0);
    if (!error.ok()) {
      run.Close();
      return error.status();
    }
    report.checked = true;
    report.check_max_error = *error;
    report.check_tolerance = Tolerance(o);
  }
  if (o.shards > 1) report.shard_lengths = run.Session0ShardLengths();
  const int64_t block_tokens = std::max<int64_t>(report.block_tokens, 1);
  report.attached_bytes =
      static_cast<double>(shape->caches) * KvCacheBytes(heads, report.attached_tokens, cache_dtype, block_tokens);
  run.Close();
  return report;
}

std::string FormatDecodePretty(const DecodeReport& r) {
  const DecodeOptions& o = r.options;
  std::string text = absl::StrFormat(
      "decode: %d session(s), context %d, %d steps, %s, cache %s, wire %s, %s\n", o.sessions, o.context, o.steps,
      absl::StrFormat("%s H=%d Hkv=%d d_k=%d x %d layer(s)",
                      o.layers.empty() ? "heads" : absl::StrCat("layer ", o.layers.front(), " d_model=", r.d_model),
                      r.heads, r.kv_heads, r.head_dim, r.caches),
      DTypeName(o.cache_dtype), DTypeName(o.wire_dtype),
      o.stateless ? "stateless (history resent every step)"
      : o.per_session ? absl::StrFormat("one call per session, %d in flight", o.concurrency)
                      : std::string("every session in one call per layer"));
  if (o.shards > 1) {
    absl::StrAppendFormat(&text, "  shards    %d, session 0's cache holds %s tokens (merged by lse each step)\n",
                          o.shards, r.shard_lengths.empty() ? "?" : absl::StrJoin(r.shard_lengths, " + "));
  }
  absl::StrAppendFormat(&text, "  prefill   %d tokens in %.3f s\n", r.prefill_tokens, r.prefill_seconds);
  if (o.shared_prefix > 0) {
    const int64_t asked = static_cast<int64_t>(o.sessions) * (o.shared_prefix / r.block_tokens * r.block_tokens);
    absl::StrAppendFormat(&text,
                          "  prefix    %d shared tokens: %d of %d tokens attached (%.0f%%, blocks of %d), %.1f MB "
                          "of cache stored once instead of prefilled; CreateSession attaching them %.2f ms at most\n",
                          o.shared_prefix, r.attached_tokens, asked,
                          asked > 0 ? 100.0 * r.attached_tokens / asked : 0.0, r.block_tokens, r.attached_bytes / 1e6,
                          r.attach_seconds_max * 1e3);
    absl::StrAppendFormat(&text, "            the server's pool after the prefill: %.1f MB in use, %.1f MB of it findable "
                          "by prefix key\n", r.pool_used_bytes / 1e6, r.pool_prefix_bytes / 1e6);
  }
  absl::StrAppendFormat(&text, "  decode    %.1f tokens/s (%d tokens in %.3f s), %d errors\n", r.tokens_per_second,
                        r.decode_tokens, r.decode_seconds, r.errors);
  absl::StrAppendFormat(&text, "  per step  p50 %.3f ms, p90 %.3f ms, p99 %.3f ms, max %.3f ms\n", r.step.p50 * 1e3,
                        r.step.p90 * 1e3, r.step.p99 * 1e3, r.step.slowest * 1e3);
  for (const auto& [name, count, s] : {std::make_tuple("stream", r.stream_steps, &r.stream_step),
                                       std::make_tuple("unary ", r.unary_steps, &r.unary_step)}) {
    if (count == 0) continue;
    absl::StrAppendFormat(&text, "    %s  p50 %.3f ms, p90 %.3f ms, p99 %.3f ms, max %.3f ms (%d steps)\n", name,
                          s->p50 * 1e3, s->p90 * 1e3, s->p99 * 1e3, s->slowest * 1e3, count);
  }
  if (r.server_step.p50 > 0) {
    absl::StrAppendFormat(&text, "    server  p50 %.3f ms, p99 %.3f ms (its handler time in the step's calls)\n",
                          r.server_step.p50 * 1e3, r.server_step.p99 * 1e3);
  }
  absl::StrAppendFormat(&text, "  KV read   %.2f GB/s (%.3f GB); sent %.1f KiB per step\n", r.kv_bytes_per_second / 1e9,
                        r.kv_bytes_read / 1e9, r.request_bytes_per_step / 1024.0);
  if (o.recover) {
    absl::StrAppendFormat(&text, "  recovered %d session(s): rebuilt from their records, the failed calls sent again\n",
                          r.recoveries);
  }
  if (!r.first_error.empty()) absl::StrAppend(&text, "  first error: ", r.first_error, "\n");
  if (r.checked) {
    absl::StrAppendFormat(&text, "  check     session 0's last step: max error %.3g (tolerance %.3g) %s\n",
                          r.check_max_error, r.check_tolerance, r.check_max_error <= r.check_tolerance ? "OK" : "FAIL");
  }
  return text;
}

std::string FormatDecodeJson(const DecodeReport& r) {
  const DecodeOptions& o = r.options;
  nlohmann::json j;
  j["sessions"] = o.sessions;
  j["context"] = o.context;
  j["steps"] = o.steps;
  j["shards"] = o.shards;
  if (!r.shard_lengths.empty()) j["shard_lengths"] = r.shard_lengths;
  j["layers"] = o.layers;
  j["heads"] = {{"num_heads", r.heads}, {"num_kv_heads", r.kv_heads}, {"head_dim", r.head_dim},
                {"caches", r.caches}};
  if (r.d_model > 0) j["d_model"] = r.d_model;
  if (o.layers.empty()) j["rope_theta"] = o.rope_theta;
  j["cache_dtype"] = DTypeName(o.cache_dtype);
  j["wire_dtype"] = DTypeName(o.wire_dtype);
  j["mode"] = o.stateless ? "stateless" : o.per_session ? "per_session" : "batched";
  j["concurrency"] = o.per_session ? o.concurrency : 1;
  j["prefill_tokens"] = r.prefill_tokens;
  j["prefill_seconds"] = r.prefill_seconds;
  j["decode_tokens"] = r.decode_tokens;
  j["decode_seconds"] = r.decode_seconds;
  j["tokens_per_second"] = r.tokens_per_second;
  j["step_ms"] = {{"p50", r.step.p50 * 1e3}, {"p90", r.step.p90 * 1e3}, {"p99", r.step.p99 * 1e3},
                  {"mean", r.step.mean * 1e3}, {"max", r.step.slowest * 1e3}};
  for (const auto& [name, count, s] : {std::make_tuple("stream", r.stream_steps, &r.stream_step),
                                       std::make_tuple("unary", r.unary_steps, &r.unary_step)}) {
    j["transport"][name] = {{"steps", count}, {"p50", s->p50 * 1e3}, {"p90", s->p90 * 1e3},
                            {"p99", s->p99 * 1e3}, {"mean", s->mean * 1e3}, {"max", s->slowest * 1e3}};
  }
  j["server_step_ms"] = {{"p50", r.server_step.p50 * 1e3}, {"p99", r.server_step.p99 * 1e3}};
  j["kv_bytes_read"] = r.kv_bytes_read;
  j["kv_bytes_per_second"] = r.kv_bytes_per_second;
  j["request_bytes_per_step"] = r.request_bytes_per_step;
  j["errors"] = r.errors;
  j["recover"] = o.recover;
  j["recoveries"] = r.recoveries;
  if (!r.first_error.empty()) j["first_error"] = r.first_error;
  if (r.checked) j["check"] = {{"max_error", r.check_max_error}, {"tolerance", r.check_tolerance}};
  if (o.shared_prefix > 0) {
    j["shared_prefix"] = {{"tokens", o.shared_prefix}, {"block_tokens", r.block_tokens},
                          {"attached_tokens", r.attached_tokens}, {"attached_bytes", r.attached_bytes},
                          {"attach_ms_max", r.attach_seconds_max * 1e3}, {"pool_used_bytes", r.pool_used_bytes},
                          {"pool_prefix_bytes", r.pool_prefix_bytes}};
  }
  return j.dump(2) + "\n";
}

}  // namespace mha
