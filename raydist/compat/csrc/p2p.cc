// Point-to-point transfers between pipeline stages over gloo.
//
// Paddle 3.3.1's CPU kernels of send_v2 / recv_v2 (and p_send / p_recv) throw
// "Do not support send/recv for cpu kernel now", so a pipeline cannot move an
// activation from one stage's ranks to the next on CPU. raydist rewrites them
// into these ops, on the same rings (one per ordered pair: [src, dst]).
//
// A gloo send returns only once the peer has posted the matching receive.
// Pipeline schedules (1F1B, VPP) are written for sends that do not wait: both
// neighbours may send before either receives. So raydist_send_ copies the
// tensor and queues it; one thread per ring sends the queue in order, and the
// receiver takes them in the same order (the same schedule runs on both ends).
// raydist_p2p_flush (C, for ctypes) waits until every queue is sent, and
// reports the first failure of a sender thread (a dead peer, say); a send or a
// receive after a failure raises it too. raydist_p2p_waited_ns (C) is the time
// spent waiting in receives and flushes: a stage's share of the pipeline bubble.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ring.h"

namespace {

using raydist::Dense;
using raydist::Ring;

std::mutex g_mu;
std::condition_variable g_cv;
std::string g_error;  // the first sender's failure
int g_pending = 0;    // queued or being sent, over all rings
std::atomic<int64_t> g_waited_ns{0};  // in receives and flushes: the pipeline's bubble, as this rank sees it

struct Waiting {
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  ~Waiting() {
    g_waited_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
                       .count();
  }
};

struct Outbox {
  std::deque<std::pair<paddle::Tensor, int>> queue;  // (copy, peer)
};
std::map<int, std::unique_ptr<Outbox>> g_outboxes;  // by ring id

void CheckFailed() {
  // called with g_mu held
  PD_CHECK(g_error.empty(), "raydist: an earlier pipeline send failed: ", g_error);
}

void SendLoop(int ring_id, Outbox* box) {
  auto* ring = Ring(ring_id);
  std::unique_lock<std::mutex> lock(g_mu);
  for (;;) {
    g_cv.wait(lock, [box] { return !box->queue.empty(); });
    auto item = std::move(box->queue.front());
    box->queue.pop_front();
    lock.unlock();
    std::string error;
    try {
      ring->Send(*Dense(item.first), item.second);
    } catch (const std::exception& e) {
      error = std::string("ring ") + std::to_string(ring_id) + ": " + e.what();
    }
    item.first = paddle::Tensor();  // free the copy outside the lock
    lock.lock();
    if (!error.empty() && g_error.empty()) g_error = error;
    --g_pending;
    g_cv.notify_all();
  }
}

void SendInplace(paddle::Tensor& x, int ring_id, int peer) {  // NOLINT
  auto copy = x.copy_to(x.place(), true);
  std::lock_guard<std::mutex> lock(g_mu);
  CheckFailed();
  auto& box = g_outboxes[ring_id];
  if (!box) {
    box.reset(new Outbox());
    std::thread(SendLoop, ring_id, box.get()).detach();  // lives as long as the process
  }
  box->queue.emplace_back(std::move(copy), peer);
  ++g_pending;
  g_cv.notify_all();
}

void RecvInplace(paddle::Tensor& buffer, int ring_id, int peer) {  // NOLINT
  {
    std::lock_guard<std::mutex> lock(g_mu);
    CheckFailed();
  }
  Waiting waiting;
  raydist::Timed timed(raydist::kRecv, ring_id);
  Ring(ring_id)->Recv(Dense(buffer), peer);
}

}  // namespace

// Wait until every queued send went out; 0, or -1 with the failure in `error`.
extern "C" int raydist_p2p_flush(char* error, int size) {
  Waiting waiting;
  raydist::Timed timed(raydist::kFlush, -1);
  std::unique_lock<std::mutex> lock(g_mu);
  g_cv.wait(lock, [] { return g_pending == 0 || !g_error.empty(); });
  if (g_error.empty()) return 0;
  snprintf(error, size, "%s", g_error.c_str());
  return -1;
}

// Nanoseconds spent waiting in receives and flushes so far.
extern "C" int64_t raydist_p2p_waited_ns() { return g_waited_ns.load(); }

PD_BUILD_OP(raydist_send_)
    .Inputs({"X"})
    .Outputs({"Out"})
    .Attrs({"ring_id: int", "peer: int"})
    .SetInplaceMap({{"X", "Out"}})
    .SetKernelFn(PD_KERNEL(SendInplace));

PD_BUILD_OP(raydist_recv_)
    .Inputs({"X"})
    .Outputs({"Out"})
    .Attrs({"ring_id: int", "peer: int"})
    .SetInplaceMap({{"X", "Out"}})
    .SetKernelFn(PD_KERNEL(RecvInplace));
