#include "server/base/grpc_status.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace mha {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // A message that echoes a client's input (a rank-1,000,000 shape) would otherwise make a trailer clients refuse
  // ("metadata size exceeds limit") instead of showing the status.
  std::string message(status.message());
  if (message.size() > kMaxStatusMessageBytes) {
    size_t cut = kMaxStatusMessageBytes;
    while (cut > 0 && (static_cast<unsigned char>(message[cut]) & 0xC0) == 0x80) --cut;
    const size_t dropped = message.size() - cut;
    message.resize(cut);
    absl::StrAppend(&message, " ... (", dropped, " more bytes)");
  }
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), message);
}

}  // namespace mha
