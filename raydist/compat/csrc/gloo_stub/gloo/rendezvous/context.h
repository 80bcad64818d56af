// Paddle's wheel ships gloo_comm_context.h but not gloo's headers; it only
// holds gloo types by shared_ptr, so declarations are enough to compile
// against it. raydist never creates or destroys these objects.
#pragma once
namespace gloo { namespace rendezvous { class Context; } }
