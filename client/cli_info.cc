// mha_client health and info: the server's health status, and its version, backends, limits, sessions, layers and
// shared-memory regions.
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/cli.h"
#include "proto/mha/v1/tensor_codec.h"

namespace mha::cli {

int RunHealth(const ClientOptions& options) {
  AttentionClient client(options);
  absl::StatusOr<bool> serving = client.Serving();
  if (!serving.ok()) return Fail(serving.status());
  std::printf("%s\n", *serving ? "SERVING" : "NOT_SERVING");
  return *serving ? kExitOk : kExitFailure;
}

int RunInfo(const ClientOptions& options) {
  AttentionClient client(options);
  absl::StatusOr<v1::GetServerInfoResponse> info = client.GetServerInfo();
  if (!info.ok()) return Fail(info.status());
  std::printf("version %s, default backend %s, instance %s\n", info->version().c_str(),
              info->default_backend().c_str(), info->instance_id().c_str());
  for (const auto& b : info->backends()) {
    std::printf("  backend %-9s %s %s\n", b.name().c_str(), b.available() ? "available  " : "unavailable",
                b.available() ? b.device().c_str() : b.detail().c_str());
    std::string dtypes;
    for (int dtype : b.cache_dtypes()) absl::StrAppend(&dtypes, dtypes.empty() ? "" : ", ", DTypeName(dtype));
    if (!dtypes.empty()) std::printf("    session caches: %s\n", dtypes.c_str());
  }
  const auto& l = info->limits();
  std::printf("limits: max_message %lld MiB, queue %d, compute threads %d, layers %lld MiB, scratch %lld MiB, "
              "%.0f GFLOP per request\n",
              static_cast<long long>(l.max_message_bytes() >> 20), l.max_queue_size(), l.compute_threads(),
              static_cast<long long>(l.max_layer_bytes() >> 20), static_cast<long long>(l.max_scratch_bytes() >> 20),
              l.max_request_gflop());
  absl::StatusOr<v1::ListSessionsResponse> sessions = client.ListSessions();
  if (!sessions.ok()) return Fail(sessions.status());
  std::printf("sessions: %d open (at most %d), KV cache pool %lld MiB in blocks of %d tokens, up to %lld tokens per "
              "cache, idle timeout %d s (at most %d s)\n",
              sessions->sessions_size(), l.max_sessions(), static_cast<long long>(l.kv_cache_bytes() >> 20),
              l.kv_block_tokens(), static_cast<long long>(l.max_session_tokens()), l.session_idle_s(),
              l.max_session_idle_s());
  absl::StatusOr<v1::ListLayersResponse> layers = client.ListLayers();
  if (!layers.ok()) return Fail(layers.status());
  for (const auto& layer : layers->layers()) {
    std::printf("  layer %-16s d_model %lld, heads %d (kv %d, d_k %d)%s, %s\n", layer.name().c_str(),
                static_cast<long long>(layer.d_model()), layer.heads().num_heads(), layer.heads().num_kv_heads(),
                layer.heads().head_dim(), layer.heads().causal() ? ", causal" : "", layer.source().c_str());
  }
  if (l.max_shared_memory_regions() == 0) return kExitOk;
  std::printf("shared memory: up to %d regions, %lld MiB\n", l.max_shared_memory_regions(),
              static_cast<long long>(l.max_shared_memory_bytes() >> 20));
  absl::StatusOr<v1::GetSharedMemoryStatusResponse> regions = client.GetSharedMemoryStatus();
  if (!regions.ok()) return Fail(regions.status());
  for (const auto& region : regions->regions()) {
    std::printf("  region %-16s %s, %llu bytes%s\n", region.name().c_str(), region.key().c_str(),
                static_cast<unsigned long long>(region.byte_size()), region.intact() ? "" : ", LOST PAGES");
  }
  return kExitOk;
}

}  // namespace mha::cli
