// A gloo ring by id, a tensor's DenseTensor, and the log of communication
// times: shared by raydist's custom ops.
#pragma once

#include <time.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "paddle/extension.h"
#include "paddle/phi/core/dense_tensor.h"
#include "paddle/phi/core/distributed/comm_context_manager.h"
#include "paddle/phi/core/distributed/gloo_comm_context.h"

namespace raydist {

inline phi::distributed::GlooCommContext* Ring(int ring_id) {
  auto& manager = phi::distributed::CommContextManager::GetInstance();
  const std::string key = std::to_string(ring_id);
  PD_CHECK(manager.Has(key), "raydist: no gloo communicator for ring ", ring_id);
  return static_cast<phi::distributed::GlooCommContext*>(manager.Get(key));
}

inline phi::DenseTensor* Dense(const paddle::Tensor& t) {
  return static_cast<phi::DenseTensor*>(t.impl().get());
}

// When each collective (and pipeline receive) ran, for a rank's timeline: the
// last kCommLog of them, in a ring, by CLOCK_MONOTONIC (Python's
// time.monotonic_ns). On gloo a collective returns once every member reached
// it, so its span is this rank's wait for its peers plus the transfer.
// raydist_comm_records (C, collective.cc) copies them out.
enum CommKind : int32_t { kAllReduce = 0, kAllGather, kBroadcast, kReduceScatter, kRecv, kFlush };
struct CommRecord {
  int64_t start_ns, end_ns;
  int32_t kind, ring;
};
constexpr int64_t kCommLog = 1 << 14;
inline CommRecord g_comm_log[kCommLog];
inline std::atomic<int64_t> g_comm_count{0};

inline int64_t NowNs() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

// Records the span of the scope it lives in (about 50 ns).
class Timed {
 public:
  Timed(CommKind kind, int ring) : kind_(kind), ring_(ring), start_(NowNs()) {}
  ~Timed() {
    const int64_t i = g_comm_count.fetch_add(1, std::memory_order_relaxed);
    g_comm_log[i % kCommLog] = CommRecord{start_, NowNs(), kind_, ring_};
  }

 private:
  CommKind kind_;
  int32_t ring_;
  int64_t start_;
};

}  // namespace raydist
