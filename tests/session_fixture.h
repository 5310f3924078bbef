// The session RPCs' test fixture: requests for layer sessions (the demo layer) and head sessions (H=4, Hkv=2,
// d_k=8), and each RPC as one blocking call. Tests start their server (ServiceTest::StartServer) in SetUp.
#ifndef MHA_TESTS_SESSION_FIXTURE_H_
#define MHA_TESTS_SESSION_FIXTURE_H_

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/service_fixture.h"

namespace mha::testing {

inline constexpr int64_t kDemo = 512;  // the demo layer's d_model (8 heads of 64)

class SessionTest : public ServiceTest {
 protected:
  static v1::CreateSessionRequest LayerSession(const std::string& id = "", v1::DataType cache = v1::FP32) {
    v1::CreateSessionRequest r;
    r.set_session_id(id);
    r.add_layers("demo");
    r.set_cache_dtype(cache);
    return r;
  }
  static v1::CreateSessionRequest HeadSession(const std::string& id = "", int layers = 1) {
    v1::CreateSessionRequest r;
    r.set_session_id(id);
    r.mutable_heads()->set_num_heads(4);
    r.mutable_heads()->set_num_kv_heads(2);
    r.mutable_heads()->set_head_dim(8);
    r.set_num_layers(layers);
    return r;
  }
  static v1::ExtendItem XItem(const std::string& id, int64_t n, uint32_t seed = 1) {
    v1::ExtendItem item;
    item.set_session_id(id);
    SetTensor(item.mutable_x(), {n, kDemo}, seed);
    return item;
  }
  static v1::ExtendItem QkvItem(const std::string& id, int64_t n, uint32_t seed = 1) {
    v1::ExtendItem item;
    item.set_session_id(id);
    SetTensor(item.mutable_q(), {n, 4, 8}, seed);
    SetTensor(item.mutable_k(), {n, 2, 8}, seed + 1);
    SetTensor(item.mutable_v(), {n, 2, 8}, seed + 2);
    return item;
  }
  static v1::ExtendRequest ExtendOf(std::vector<v1::ExtendItem> items, int layer_index = 0) {
    v1::ExtendRequest r;
    r.set_layer_index(layer_index);
    for (v1::ExtendItem& item : items) *r.add_items() = std::move(item);
    return r;
  }

  grpc::Status Create(const v1::CreateSessionRequest& r, v1::SessionInfo* info = nullptr) {
    grpc::ClientContext context;
    v1::CreateSessionResponse response;
    grpc::Status status = stub_->CreateSession(&context, r, &response);
    if (info != nullptr) *info = response.session();
    return status;
  }
  std::string Created(const v1::CreateSessionRequest& r) {
    v1::SessionInfo info;
    const grpc::Status status = Create(r, &info);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return info.session_id();
  }
  grpc::Status Extend(const v1::ExtendRequest& r, v1::ExtendResponse* response = nullptr) {
    grpc::ClientContext context;
    v1::ExtendResponse unused;
    return stub_->Extend(&context, r, response != nullptr ? response : &unused);
  }
  grpc::Status Fork(const std::string& id, const std::string& new_id, v1::SessionInfo* info = nullptr) {
    grpc::ClientContext context;
    v1::ForkSessionRequest r;
    r.set_session_id(id);
    r.set_new_session_id(new_id);
    v1::ForkSessionResponse response;
    grpc::Status status = stub_->ForkSession(&context, r, &response);
    if (info != nullptr) *info = response.session();
    return status;
  }
  grpc::Status Truncate(const std::string& id, int64_t length, v1::SessionInfo* info = nullptr) {
    grpc::ClientContext context;
    v1::TruncateSessionRequest r;
    r.set_session_id(id);
    r.set_length(length);
    v1::TruncateSessionResponse response;
    grpc::Status status = stub_->TruncateSession(&context, r, &response);
    if (info != nullptr) *info = response.session();
    return status;
  }
  grpc::Status Close(const std::string& id) {
    grpc::ClientContext context;
    v1::CloseSessionRequest r;
    r.set_session_id(id);
    v1::CloseSessionResponse response;
    return stub_->CloseSession(&context, r, &response);
  }
  std::vector<v1::SessionInfo> List() {
    grpc::ClientContext context;
    v1::ListSessionsResponse response;
    EXPECT_TRUE(stub_->ListSessions(&context, v1::ListSessionsRequest(), &response).ok());
    return {response.sessions().begin(), response.sessions().end()};
  }
  int64_t Length(const std::string& id) {
    for (const v1::SessionInfo& info : List()) {
      if (info.session_id() == id) return info.lengths(0);
    }
    return -1;
  }
};

// The code and a piece of the message of a failed call.
inline void ExpectError(const grpc::Status& status, grpc::StatusCode code, const std::string& piece) {
  EXPECT_EQ(status.error_code(), code) << status.error_message();
  EXPECT_THAT(status.error_message(), ::testing::HasSubstr(piece));
}

}  // namespace mha::testing

#endif  // MHA_TESTS_SESSION_FIXTURE_H_
