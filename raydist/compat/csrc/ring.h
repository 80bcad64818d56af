// A gloo ring by id, and a tensor's DenseTensor: shared by raydist's custom ops.
#pragma once

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

}  // namespace raydist
