// Collectives that find their gloo communicator by ring id.
//
// Paddle 3.3.1's CPU collective kernels (all_reduce, all_gather, ...) take
// their communicator from the device context, and on CPU every op shares ONE
// CPUContext. The PIR executor binds that context to the communicator of the
// first collective it builds (SetDeviceCommContext sets it only while it is
// unset), so with two rings per process (dp and mp on a 2-D mesh) every
// collective runs on the first ring. raydist rewrites the collectives of the
// programs into these ops, which look the ring up themselves.
//
// The ops keep the attribute name "ring_id", so the executor still treats them
// as communication ops and runs them in program order.

#include <algorithm>
#include <vector>

#include "ring.h"

namespace {

using raydist::Dense;
using raydist::Ring;
using raydist::Timed;

// phi::ReduceType::kRedAvg. Paddle's gloo has no average ("Unsupported reduce
// type: 4", gloo_utils.h); auto-parallel asks for one where a mean runs over a
// sharded dim (Partial(avg)). It is a sum, then a division by the ring's size.
constexpr int kRedAvg = 4;

void ReduceInto(paddle::Tensor& out, const paddle::Tensor& x, int ring_id, int reduce_type) {  // NOLINT
  auto* ring = Ring(ring_id);
  {
    Timed timed(raydist::kAllReduce, ring_id);
    ring->AllReduce(Dense(out), *Dense(x), reduce_type == kRedAvg ? 0 : reduce_type);
  }
  if (reduce_type != kRedAvg) return;
  const int64_t n = out.numel();
  PD_DISPATCH_FLOATING_TYPES(out.type(), "raydist_all_reduce (avg)", ([&] {
    auto* data = out.data<data_t>();
    const auto size = static_cast<data_t>(ring->GetSize());
    for (int64_t i = 0; i < n; ++i) data[i] /= size;
  }));
}

std::vector<paddle::Tensor> AllReduce(const paddle::Tensor& x, int ring_id, int reduce_type) {
  auto out = paddle::empty(x.shape(), x.dtype(), x.place());
  ReduceInto(out, x, ring_id, reduce_type);
  return {out};
}

void AllReduceInplace(paddle::Tensor& x, int ring_id, int reduce_type) {  // NOLINT
  ReduceInto(x, x, ring_id, reduce_type);
}

std::vector<paddle::Tensor> AllGather(const paddle::Tensor& x, int ring_id, int nranks) {
  auto shape = x.shape();
  shape[0] *= nranks;
  auto out = paddle::empty(shape, x.dtype(), x.place());
  Timed timed(raydist::kAllGather, ring_id);
  Ring(ring_id)->AllGather(Dense(out), *Dense(x));
  return {out};
}

std::vector<std::vector<int64_t>> AllGatherShape(const std::vector<int64_t>& x, int ring_id, int nranks) {
  auto shape = x;
  if (!shape.empty() && shape[0] > 0) shape[0] *= nranks;
  return {shape};
}

std::vector<paddle::Tensor> Broadcast(const paddle::Tensor& x, int ring_id, int root) {
  auto out = paddle::empty(x.shape(), x.dtype(), x.place());
  Timed timed(raydist::kBroadcast, ring_id);
  Ring(ring_id)->Broadcast(Dense(out), *Dense(x), root);
  return {out};
}

void BroadcastInplace(paddle::Tensor& x, int ring_id, int root) {  // NOLINT
  Timed timed(raydist::kBroadcast, ring_id);
  Ring(ring_id)->Broadcast(Dense(x), *Dense(x), root);
}

// gloo in Paddle has no reduce-scatter: all-reduce, then keep this rank's rows.
std::vector<paddle::Tensor> ReduceScatter(const paddle::Tensor& x, int ring_id, int nranks) {
  auto* ring = Ring(ring_id);
  auto sum = paddle::empty(x.shape(), x.dtype(), x.place());
  {
    Timed timed(raydist::kReduceScatter, ring_id);
    ring->AllReduce(Dense(sum), *Dense(x), /*reduce_type=*/0);
  }
  const int64_t rows = x.shape()[0] / nranks;
  return {sum.slice(ring->GetRank() * rows, (ring->GetRank() + 1) * rows).copy_to(x.place(), true)};
}

std::vector<std::vector<int64_t>> ReduceScatterShape(const std::vector<int64_t>& x, int ring_id, int nranks) {
  auto shape = x;
  if (!shape.empty() && shape[0] > 0) shape[0] /= nranks;
  return {shape};
}

}  // namespace

// Copies the communication records numbered from `since` on (as many of them as
// the log still holds, at most `most`) into `out`, 6 int64 each: number, start
// ns, end ns, kind, ring, 0. Returns how many were copied; `*next` gets the
// number after the last record made.
extern "C" int64_t raydist_comm_records(int64_t since, int64_t* out, int64_t most, int64_t* next) {
  const int64_t count = raydist::g_comm_count.load();
  const int64_t first = std::max({since, count - raydist::kCommLog, int64_t{0}});
  int64_t copied = 0;
  for (int64_t i = first; i < count && copied < most; ++i, ++copied) {
    const auto& r = raydist::g_comm_log[i % raydist::kCommLog];
    int64_t* row = out + 6 * copied;
    row[0] = i, row[1] = r.start_ns, row[2] = r.end_ns, row[3] = r.kind, row[4] = r.ring, row[5] = 0;
  }
  *next = count;
  return copied;
}

PD_BUILD_OP(raydist_all_reduce)
    .Inputs({"X"})
    .Outputs({"Out"})
    .Attrs({"ring_id: int", "reduce_type: int"})
    .SetKernelFn(PD_KERNEL(AllReduce));

PD_BUILD_OP(raydist_all_reduce_)
    .Inputs({"X"})
    .Outputs({"Out"})
    .Attrs({"ring_id: int", "reduce_type: int"})
    .SetInplaceMap({{"X", "Out"}})
    .SetKernelFn(PD_KERNEL(AllReduceInplace));

PD_BUILD_OP(raydist_all_gather)
    .Inputs({"X"})
    .Outputs({"Out"})
    .Attrs({"ring_id: int", "nranks: int"})
    .SetKernelFn(PD_KERNEL(AllGather))
    .SetInferShapeFn(PD_INFER_SHAPE(AllGatherShape));

PD_BUILD_OP(raydist_broadcast)
    .Inputs({"X"})
    .Outputs({"Out"})
    .Attrs({"ring_id: int", "root: int"})
    .SetKernelFn(PD_KERNEL(Broadcast));

PD_BUILD_OP(raydist_broadcast_)
    .Inputs({"X"})
    .Outputs({"Out"})
    .Attrs({"ring_id: int", "root: int"})
    .SetInplaceMap({{"X", "Out"}})
    .SetKernelFn(PD_KERNEL(BroadcastInplace));

PD_BUILD_OP(raydist_reduce_scatter)
    .Inputs({"X"})
    .Outputs({"Out"})
    .Attrs({"ring_id: int", "nranks: int"})
    .SetKernelFn(PD_KERNEL(ReduceScatter))
    .SetInferShapeFn(PD_INFER_SHAPE(ReduceScatterShape));
