// RETURN_IF_ERROR / ASSIGN_OR_RETURN: abseil 20220623 ships neither.
#ifndef MHA_SERVER_BASE_STATUS_MACROS_H_
#define MHA_SERVER_BASE_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define MHA_CONCAT_INNER_(a, b) a##b
#define MHA_CONCAT_(a, b) MHA_CONCAT_INNER_(a, b)

// Evaluates expr (an absl::Status) once and returns it from the enclosing function unless it is OK.
#define RETURN_IF_ERROR(expr)                                 \
  do {                                                        \
    ::absl::Status mha_status_ = (expr);                      \
    if (!mha_status_.ok()) return mha_status_;                \
  } while (0)

// ASSIGN_OR_RETURN(auto x, StatusOrExpr()): declares/assigns the value or returns the error status.
#define ASSIGN_OR_RETURN(lhs, expr) \
  MHA_ASSIGN_OR_RETURN_IMPL_(MHA_CONCAT_(mha_statusor_, __LINE__), lhs, expr)
#define MHA_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                               \
  if (!statusor.ok()) return statusor.status();         \
  lhs = std::move(statusor).value()

#endif  // MHA_SERVER_BASE_STATUS_MACROS_H_
