#include "server/transport/token_gate.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "server/base/grpc_status.h"
#include "server/base/log_safe.h"
#include "spdlog/spdlog.h"

namespace mha {
namespace {

absl::string_view Find(const grpc::AuthMetadataProcessor::InputMetadata& metadata, absl::string_view key) {
  const auto it = metadata.find(grpc::string_ref(key.data(), key.size()));
  return it == metadata.end() ? absl::string_view() : absl::string_view(it->second.data(), it->second.size());
}

}  // namespace

grpc::Status TokenGate::Process(const InputMetadata& metadata, grpc::AuthContext* /*context*/,
                                OutputMetadata* /*consumed*/, OutputMetadata* /*response*/) {
  const absl::string_view path = Find(metadata, ":path");
  // Health is for probes and balancers, without tokens; without a path (not an RPC) the handler decides.
  if (path.empty() || absl::StartsWith(path, "/grpc.health.v1.Health/")) return grpc::Status::OK;
  const absl::Status status = auth_->Check(Find(metadata, "authorization"), Role::kCompute, path);
  int64_t left_out = 0;
  if (!status.ok() && log_budget_.Take(absl::Now(), &left_out)) {
    spdlog::warn("rpc={} status={} error=\"{}\" (refused on its metadata, before its message){}",
                 LogSafe(path, 128), absl::StatusCodeToString(status.code()), LogSafe(status.message(), 1024),
                 left_out > 0 ? absl::StrCat(" (", left_out, " such lines before this one left out)") : "");
  }
  return ToGrpcStatus(status);
}

}  // namespace mha
